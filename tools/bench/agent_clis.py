"""Claude Code and Codex, the published CLIs from npm, unmodified, against ``superfluid serve``.

    python -m tools.bench.agent_clis                 # install the CLIs if missing, run everything
    python -m tools.bench.agent_clis --only claude   # or: --only codex, --only side

What it runs, each against one server it starts (the default model at an 8192-token context,
with ``--model-alias claude-haiku=smollm2@background`` for Claude Code's small/fast slot):

* ``claude -p`` twice with the same prompt: both must exit 0 and print an answer. Each run's
  prefill is read from ``superfluid_prefill_tokens_total``: the second identical turn should
  prefill at most a quarter of the first (the billing-header rule keeps the prefix warm).
* ``codex exec`` once through a ``[model_providers.superfluid]`` with ``wire_api = "responses"``:
  exit 0 and an answer printed.
* A side request during a main turn: a Claude-Code-sized main turn (``/v1/messages``, streamed)
  alone, then with a title-sized side request to the ``claude-haiku`` alias (class
  ``background``) sent just before it; the main turn's time to first token in both cases.

The server logs each request's route (the access log), which is how the paths each CLI calls
were found. The CLIs are 350-400 MB each, so CI does not install them: the protocol is tested
with the ``anthropic`` and ``openai`` SDKs on every run, and this tool checks the CLIs
themselves when run by hand or as the opt-in test (``SUPERFLUID_AGENT_CLIS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from superfluid.core import lifeline
from superfluid.core.default_model import default_model_path

from . import machine

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.328"
CODEX = "@openai/codex@0.169.0"
DEFAULT_DIR = Path(os.environ.get("SUPERFLUID_AGENT_CLIS_DIR", Path.home() / ".cache" / "superfluid" / "agent-clis"))
CONTEXT = 8192  # the default model's training context: the most it serves
# Claude Code's default body (system prompt, 12 tools, reminders) is about 13.5k tokens in SmolLM2's
# vocabulary, over its 8192-token window; four coding tools bring it to about 7k
CLAUDE_TOOLS = ("--tools", "Bash,Edit,Read,Write")
PROMPT = "Reply with one word: hello."
SIDE_ALIAS = "claude-haiku"


def ensure_clis(where: Path) -> dict[str, Path]:
    """The two CLIs' executables, installed with npm under ``where`` if missing."""
    bins = {"claude": where / "node_modules" / ".bin" / "claude", "codex": where / "node_modules" / ".bin" / "codex"}
    if not all(b.exists() for b in bins.values()):
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(where), CLAUDE_CODE, CODEX],
                       check=True, timeout=1200)
    return bins


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``superfluid serve`` on a free loopback port, killed with this process (lifeline)."""

    def __init__(self, workdir: Path, *flags: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"serve-{self.port}.log"
        cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--model", default_model_path(),
               "--model-name", "smollm2", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-context", str(CONTEXT), "--model-alias", f"{SIDE_ALIAS}=smollm2@background", *flags]
        self._log = open(self.log_path, "ab")
        self.proc = lifeline.popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("serve not ready in 300 s")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")

    def routes_called(self) -> dict[str, int]:
        """Requests so far by method, route pattern and status (``/metrics``' per-route counts),
        plus the paths no route served (from the server's log)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        calls = {}
        for m in re.finditer(r'^superfluid_http_requests_total\{method="(\w+)",route="([^"]+)",status="(\d+)"\} (\S+)$',
                             text, re.M):
            calls[f"{m[1]} {m[2]} {m[3]}"] = int(float(m[4]))
        for m in re.finditer(r" (GET|POST|DELETE|PUT|PATCH|HEAD|OPTIONS) (\S+): no route serves this path", self.log()):
            calls[f"{m[1]} {m[2]} (no route)"] = calls.get(f"{m[1]} {m[2]} (no route)", 0) + 1
        return calls

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def run_claude(claude: Path, srv: Serve, home: Path, prompt: str = PROMPT, timeout: float = 900) -> dict:
    env = dict(os.environ, HOME=str(home), ANTHROPIC_BASE_URL=srv.base, ANTHROPIC_AUTH_TOKEN="superfluid",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", ANTHROPIC_SMALL_FAST_MODEL=SIDE_ALIAS,
               ANTHROPIC_DEFAULT_HAIKU_MODEL=SIDE_ALIAS,
               # the default model rambles to the ceiling: a one-shot answer needs no more
               CLAUDE_CODE_MAX_OUTPUT_TOKENS="1024",
               DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1")
    before = srv.metric("superfluid_prefill_tokens_total")
    t0 = time.monotonic()
    done = subprocess.run([str(claude), "-p", prompt, "--model", "smollm2", *CLAUDE_TOOLS], env=env, cwd=home,
                          capture_output=True, text=True, timeout=timeout)
    return {"exit": done.returncode, "seconds": round(time.monotonic() - t0, 1), "stdout": done.stdout.strip()[-400:],
            "stderr": done.stderr.strip()[-800:],
            "prefill_tokens": srv.metric("superfluid_prefill_tokens_total") - before}


def run_codex(codex: Path, srv: Serve, home: Path, prompt: str = PROMPT, timeout: float = 900) -> dict:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(
        'model = "smollm2"\nmodel_provider = "superfluid"\n'
        f"model_context_window = {CONTEXT}\n\n"
        "[model_providers.superfluid]\n"
        'name = "superfluid"\n'
        f'base_url = "{srv.base}/v1"\n'
        'wire_api = "responses"\n')
    env = dict(os.environ, HOME=str(home), CODEX_HOME=str(codex_home))
    before = srv.metric("superfluid_prefill_tokens_total")
    t0 = time.monotonic()
    done = subprocess.run([str(codex), "exec", "--skip-git-repo-check", prompt], env=env, cwd=home,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return {"exit": done.returncode, "seconds": round(time.monotonic() - t0, 1), "stdout": done.stdout.strip()[-400:],
            "stderr": done.stderr.strip()[-1200:],
            "prefill_tokens": srv.metric("superfluid_prefill_tokens_total") - before}


def _filler(tag: str, tokens: int) -> str:
    sentence = f"Note {tag}: the build scripts, the test runner and the deployment notes were reviewed. "
    return sentence * max(1, tokens // 40)  # about 40 tokens a sentence in SmolLM2's vocabulary


def _main_turn_ttft(srv: Serve, tag: str, side: bool) -> float:
    """A streamed Claude-Code-sized main turn's seconds to its first text delta; with ``side``, a
    title-sized request to the background alias goes out just before it."""
    import anthropic
    import threading

    client = anthropic.Anthropic(base_url=srv.base, api_key="superfluid", max_retries=0, timeout=600)
    side_thread = None
    if side:
        def side_request():
            client.messages.create(model=SIDE_ALIAS, max_tokens=32, messages=[{"role": "user", "content": (
                _filler(f"side-{tag}", 2500) + "\nWrite a five-word title for this conversation.")}])
        side_thread = threading.Thread(target=side_request)
        side_thread.start()
        time.sleep(0.3)  # the side request is admitted and prefilling when the main turn arrives
    t0 = time.monotonic()
    ttft = None
    with client.messages.stream(model="smollm2", max_tokens=16, system=_filler(f"main-{tag}", 5000),
                                messages=[{"role": "user", "content": "Summarize the notes in one line."}]) as s:
        for event in s:
            if event.type == "content_block_delta" and ttft is None:
                ttft = time.monotonic() - t0
    if side_thread is not None:
        side_thread.join()
    return ttft if ttft is not None else float("nan")


def side_requests(srv: Serve, rounds: int = 2) -> dict:
    alone, with_side = [], []
    for i in range(rounds):  # fresh prompts each time: no prefix cache answers
        alone.append(_main_turn_ttft(srv, f"a{i}-{time.time_ns()}", side=False))
        with_side.append(_main_turn_ttft(srv, f"b{i}-{time.time_ns()}", side=True))
    return {"main_ttft_alone_s": [round(x, 3) for x in alone], "main_ttft_with_side_s": [round(x, 3) for x in with_side]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.agent_clis", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["claude", "codex", "side"], action="append",
                   help="run only these parts (repeatable; default: all)")
    p.add_argument("--clis", type=Path, default=DEFAULT_DIR, help=f"where the CLIs are installed (default {DEFAULT_DIR})")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    parts = set(args.only or ["claude", "codex", "side"])
    bins = ensure_clis(args.clis) if parts & {"claude", "codex"} else {}
    results: dict = {"machine": machine.line()}
    with tempfile.TemporaryDirectory(prefix="sf-agent-clis-") as tmp:
        work = Path(tmp)
        srv = Serve(work)
        try:
            if "claude" in parts:
                home = work / "claude-home"
                home.mkdir()
                first = run_claude(bins["claude"], srv, home)
                second = run_claude(bins["claude"], srv, home)
                results["claude"] = {"first": first, "second": second,
                                     "second_over_first": (second["prefill_tokens"] / first["prefill_tokens"]
                                                           if first["prefill_tokens"] else None)}
            if "codex" in parts:
                home = work / "codex-home"
                home.mkdir()
                results["codex"] = run_codex(bins["codex"], srv, home)
            if "side" in parts:
                results["side"] = side_requests(srv)
            results["routes_called"] = srv.routes_called()
        finally:
            srv.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    failed = [name for name in ("claude", "codex") if name in results and (
        results[name].get("exit", 0) != 0 if name == "codex" else
        any(results[name][k]["exit"] != 0 for k in ("first", "second")))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
