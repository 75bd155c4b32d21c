"""What Gemma 3's image steps cost the text lanes beside them on llama.cpp.

A Gemma 3 image's rows are decoded with non-causal attention, whole, in a step of their own, so
a lane streaming text sits that step out; the engine never runs two image steps in a row while
text waits, so a text lane should lose at most one step to an image. This bench starts a server
on a Gemma 3 GGUF with its mmproj (``--model``; by default the tiny fixture
tools/fixtures/tiny_gemma3_vlm.py builds) and streams ``--text-lanes`` greedy text replies of
``--tokens`` tokens each, in three conditions, interleaved round after round so the machine's
drift falls on each alike:

- **alone**: the text lanes only;
- **text arrivals**: a short text request arrives every ``--interval`` s while they stream (the
  same load without images);
- **image arrivals**: the same requests, each with a new image (so each is encoded, off the
  tick, and its rows decoded in an image step).

Reported per condition: the text lanes' largest gap between two streamed tokens (median over
rounds, and the worst), their p99 gap and their decode rate, with the machine's load average
before and after (the figures mean little on a machine other work is using).

    python -m tools.bench.gemma3_images --rounds 3 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median

from .image_lanes import _gap_figures
from .images import _with_arrivals, chat, image_content, stream

MODEL = "gemma3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, lanes: int, log: Path) -> tuple[subprocess.Popen, str]:
    """A superfluid server on ``model`` (its mmproj beside it), ready; (its process, base URL)."""
    from superfluid.core import lifeline

    port = _free_port()
    cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--model-name", MODEL, "--max-batch", str(lanes + 1), "--max-context", "2048"]
    proc = lifeline.popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.loads(r.read()).get("status") == "ok":
                    return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not get ready in 300 s; see {log}")


async def run(base: str, lanes: int, tokens: int, interval: float, rounds: int) -> dict:
    import aiohttp

    text = [chat(MODEL, tokens, f"Write a long story about lighthouse number {i}.") for i in range(lanes)]
    rng = random.Random(5)

    def an_image():
        return image_content(tuple(rng.randrange(256) for _ in range(3)))

    def a_text():  # the same request without its image
        return f"{rng.randrange(10 ** 6)} What is in this picture?"

    got: dict[str, list[dict]] = {"alone": [], "text_arrivals": [], "image_arrivals": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(stream(session, base, b) for b in text))  # warm: prompts cached alike
        await stream(session, base, chat(MODEL, 2, an_image()))
        for _ in range(rounds):
            got["alone"].append(_gap_figures(await asyncio.gather(*(stream(session, base, b) for b in text))))
            for name, content in (("text_arrivals", a_text), ("image_arrivals", an_image)):
                beside, _ = await _with_arrivals(session, base, MODEL, text, content, interval)
                got[name].append(_gap_figures(beside))
    out = {}
    for name, figures in got.items():
        out[name] = {"max_gap_s_median": round(median(f["max_gap_s"] for f in figures), 4),
                     "max_gap_s_worst": max(f["max_gap_s"] for f in figures),
                     "p99_gap_s_median": round(median(f["p99_gap_s"] for f in figures), 4),
                     "decode_tok_s_median": round(median(f["decode_tok_s"] for f in figures), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Gemma 3 GGUF with its mmproj beside it (default: the tiny fixture)")
    ap.add_argument("--text-lanes", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--interval", type=float, default=0.3, help="seconds between arrivals")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the report here")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from tools.fixtures import tiny_gemma3_vlm

        model = str(tiny_gemma3_vlm.build()["gguf"])
    log = Path(tempfile.mkdtemp(prefix="gemma3-bench-")) / "server.log"
    proc, base = start_server(model, args.text_lanes, log)
    try:
        load_before = os.getloadavg()
        figures = asyncio.run(run(base, args.text_lanes, args.tokens, args.interval, args.rounds))
        load_after = os.getloadavg()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    report = {"model": model, "text_lanes": args.text_lanes, "tokens": args.tokens, "interval_s": args.interval,
              "rounds": args.rounds, "cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in load_before],
              "loadavg_after": [round(x, 2) for x in load_after], **figures}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
