"""Memory pressure for real: the daemon and its engine worker run in a memory cgroup (as in a
container) whose limit is too small for what the load asks of it, so first the pressure ladder
and then the kernel's OOM killer act.

The worker's KV pool is allocated (and zeroed) whole when the model loads, so what grows under
load is host memory: prefixes evicted from the pool into the host tier (``--host-cache-mb``) and
preempted lanes parked there (``--park``). The run, on one server in one cgroup:

1. **The ladder.** The limit is set to the working set after load plus ``headroom_mb``. Distinct
   long prompts push their prefixes into the host tier (short prompts between them reuse the slots
   that hold them) until the cgroup's working set is within 10 % of the limit. Pass: the cgroup pressure source reads it
   (``superfluid_memory_pressure_level`` above 0), the ladder drops the host tier
   (``superfluid_prefix_evictions_total{reason="host_os_pressure"}``, the log's "OS memory
   pressure"), the working set falls back, every request answers 200, and the OOM killer has not
   fired (the cgroup's ``oom_kill`` count).
2. **The kill.** Once the host tier is open again (30 s after the last pressure; in the CI variant
   ``host_pause_s``, the daemon's pause shortened by ``SUPERFLUID_TEST_HOST_PAUSE_S``), the limit is cut
   to the working set plus a margin that the ladder reads as "ok" (over 10 % of the limit) but that
   is smaller than one long lane's KV. A ``background`` lane with a long prompt decodes; an
   ``interactive`` request preempts it, and parking its KV asks for more than the margin in one
   allocation, faster than any poll can see. The OOM killer kills the biggest process in the
   cgroup, the worker. Pass: the kill happened (``oom_kill`` +1, a new worker PID), the daemon
   stayed up, both lanes resumed on the new worker and answered 200 with whole replies, and a
   request afterwards succeeds.

Before the cgroup source existed (plugins/pressure/cgroup.py) phase 1 failed: the host's PSI and
free memory read "ok" all the way to the kill, because the host had 23 GiB free.

Needs root and a memory cgroup (v1 ``/sys/fs/cgroup/memory`` or v2 with the memory controller)
and no swap for the cgroup (the kernel would swap instead of killing)."""

from __future__ import annotations

import asyncio
import errno
import os
import time
from pathlib import Path

import aiohttp

from superfluid.core.kv_room import HOST_PAUSE_S
from tools.suite.common import call, metric_sum, metrics, stream

from ..common import MODEL_NAME, Ctx, Outcome, verdict, wait_for

KEY, TITLE = "memory_pressure", "memory pressure"
FAULT = ("the daemon and worker in a memory cgroup whose limit the host tier outgrows (ladder), then cut below one "
         "lane's parked KV (OOM kill)")
PASS = ("the cgroup's pressure is read and the ladder drops the host tier before any kill, all 200; then the OOM "
        "killer kills the worker, the daemon stays up, the lanes resume on a new worker and finish whole")
# host_pause_s: how long the daemon keeps its host tier closed after pressure (None: its own 30 s;
# the CI variant sets it through SUPERFLUID_TEST_HOST_PAUSE_S and waits that out, not 31 s)
FULL = {"headroom_mb": 300, "prompt_words": 1400, "max_fill": 40, "long_tokens": 7000, "context": 8192,
        "reply_tokens": 24, "host_pause_s": None}
FAST = {"headroom_mb": 120, "prompt_words": 1000, "max_fill": 30, "long_tokens": 3700, "context": 4096,
        "reply_tokens": 16, "host_pause_s": 5.0}
HEADLINE = ["ladder_acted_after", "pressure_level_max", "host_os_pressure_evictions", "ws_peak_mb", "limit_mb",
            "ws_after_ladder_mb", "oom_kills_phase1", "oom_kills", "park_mb", "margin_mb", "worker_restarted",
            "lanes_resumed_whole", "daemon_up"]

MIB = 1 << 20
PENDING = 2  # long prefixes phase 1 lets wait in the pool for their slot's reuse
BACKGROUND_TOKENS = 160  # long enough to still be decoding when the interactive request preempts it
CGROOT = Path("/sys/fs/cgroup")
WORDS = ("amber basin cedar delta ember fjord grove heron inlet juniper kelp lagoon meadow nectar orchid "
         "pebble quartz reed saffron tundra umber violet willow yarrow zephyr").split()


class Cgroup:
    """A memory cgroup this scenario made: v1 (``memory.limit_in_bytes``) or v2 (``memory.max``)."""

    def __init__(self, name: str):
        if (CGROOT / "memory").is_dir():
            self.v2, self.dir = False, CGROOT / "memory" / name
        else:
            self.v2, self.dir = True, CGROOT / name
        self.dir.mkdir()
        self.set_limit(None)

    def _file(self, v1: str, v2: str) -> Path:
        return self.dir / (v2 if self.v2 else v1)

    def set_limit(self, limit: int | None) -> None:
        path = self._file("memory.limit_in_bytes", "memory.max")
        path.write_text("max" if limit is None and self.v2 else str(-1 if limit is None else limit))
        if self.v2:
            swap = self.dir / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")

    def working_set(self) -> int:
        usage = int(self._file("memory.usage_in_bytes", "memory.current").read_text())
        inactive = 0
        key = "inactive_file" if self.v2 else "total_inactive_file"
        for line in (self.dir / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                inactive = int(value)
        return usage - inactive

    def oom_kills(self) -> int:
        text = self._file("memory.oom_control", "memory.events").read_text()
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
        return 0

    def enter_prefix(self) -> list[str]:
        """A command prefix that moves itself into this cgroup, then execs the server (same PID)."""
        return ["sh", "-c", f'echo $$ > {self.dir}/cgroup.procs && exec "$@"', "sh"]

    def remove(self, timeout: float = 15.0) -> None:
        """Remove the cgroup once it is empty: a process stopped a moment ago may still be leaving
        it (the kernel uncharges its memory as it goes), so EBUSY is waited out."""
        deadline = time.monotonic() + timeout
        while self.dir.exists():
            try:
                self.dir.rmdir()
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make a memory cgroup"
    if not (CGROOT / "memory").is_dir() and "memory" not in _read(CGROOT / "cgroup.controllers").split():
        return "no memory cgroup controller mounted at /sys/fs/cgroup"
    if Path("/proc/swaps").exists() and len(_read(Path("/proc/swaps")).splitlines()) > 1:
        return "swap is on: the kernel would swap instead of OOM-killing"
    if not (CGROOT / "memory").is_dir() and "memory" not in _read(CGROOT / "cgroup.subtree_control").split():
        return "cgroup v2 without the memory controller enabled for child cgroups (cgroup.subtree_control)"
    try:  # a read-only cgroup mount (inside a container) cannot hold one of ours
        probe = Cgroup(f"superfluid-chaos-probe-{os.getpid()}")
        probe.remove()
    except OSError as exc:
        return f"cannot make a memory cgroup here: {exc}"
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _prompt(rng, words: int, tag: str) -> str:
    return f"[{tag}] Summarize these notes: " + " ".join(rng.choice(WORDS) for _ in range(words))


def _push(i: int) -> str:
    """A short prompt whose head (its first word, a tenth of it) no other prompt here shares, so it
    takes the least recently used slot instead of cutting a similar one in place (core/prefix.py)."""
    return f"{WORDS[i % len(WORDS)].capitalize()} {i}: say hi to the {WORDS[(3 * i + 1) % len(WORDS)]} team, briefly."


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    cg = Cgroup(f"superfluid-chaos-{os.getpid()}-{ctx.seed}")
    ctx.on_cleanup(cg.remove)  # after the servers are stopped: an empty cgroup can be removed
    pause = p.get("host_pause_s")
    srv = ctx.serve("--max-batch", "1", "--max-context", str(p["context"]), "--park", "--host-cache-mb", "4096",
                    "--threads", "2", prefix=cg.enter_prefix(),
                    env={"SUPERFLUID_TEST_HOST_PAUSE_S": str(pause)} if pause else None)
    fig: dict = {}
    asyncio.run(_drive(ctx, srv, cg, fig))
    log = srv.log_text()
    fig["log_pressure_lines"] = log.count("OS memory pressure")
    fig["log_worker_lines"] = [ln.strip()[:200] for ln in log.splitlines()
                               if "engine restarted" in ln or "worker" in ln.lower() and "died" in ln.lower()][:5]
    fig["daemon_up"] = srv.alive()
    ok = (fig.get("ladder_acted_after") is not None and fig.get("oom_kills_phase1") == 0
          and fig.get("phase1_failures") == 0 and fig["log_pressure_lines"] > 0
          and fig.get("ws_after_ladder_mb", 1e9) < fig.get("ws_peak_mb", 0)
          and fig.get("oom_kills", 0) >= 1 and fig.get("worker_restarted") and fig.get("lanes_resumed_whole")
          and fig.get("after_ok") and fig["daemon_up"])
    return Outcome(KEY, "superfluid", *verdict(
        ok, f"ladder acted after {fig.get('ladder_acted_after')} prompts at {fig.get('ws_peak_mb')} of "
            f"{fig.get('limit_mb')} MiB with no kill; then {fig.get('oom_kills')} OOM kill, the worker restarted and "
            f"both lanes finished whole",
        _why_not(fig)), fig)


def _why_not(fig: dict) -> str:
    if fig.get("error"):
        return fig["error"]
    if fig.get("ladder_acted_after") is None:
        return f"the ladder never acted (working set peaked at {fig.get('ws_peak_mb')} of {fig.get('limit_mb')} MiB)"
    if fig.get("oom_kills_phase1"):
        return f"the OOM killer fired before the ladder acted ({fig['oom_kills_phase1']} kills)"
    if fig.get("phase1_failures"):
        return f"{fig['phase1_failures']} requests failed in the ladder phase"
    if not fig.get("oom_kills"):
        return "the cut limit did not lead to an OOM kill"
    if not fig.get("lanes_resumed_whole"):
        return f"the lanes did not resume whole: {fig.get('lanes')}"
    return f"after the kill: daemon up {fig.get('daemon_up')}, next request ok {fig.get('after_ok')}"


async def _health(http, base) -> dict:
    r = await call(http, "GET", base + "/health", timeout=10)
    return (r.body or {}).get("models", {}).get(MODEL_NAME, {}) if isinstance(r.body, dict) else {}


async def _drive(ctx: Ctx, srv, cg: Cgroup, fig: dict) -> None:
    p, base, rng = ctx.p, srv.base, ctx.rng
    async with aiohttp.ClientSession() as http:
        ws0 = cg.working_set()
        limit = ws0 + p["headroom_mb"] * MIB
        cg.set_limit(limit)
        fig.update(ws_loaded_mb=round(ws0 / MIB), limit_mb=round(limit / MIB))
        timeline, failures, peak = [], 0, ws0
        t0 = time.monotonic()
        last_pressure, fill_tokens, per_token, fills, host_bytes = None, 0, 0.0, 0, 0.0
        # ---- phase 1: the host tier grows until the ladder drops it -------------------------------
        # A long prompt's prefix reaches the host tier only once its slot is reused, after the
        # lane's and the spare slots' other prefixes (core/kv.py); short pushes reuse them for a
        # fraction of a long prefill, so at most PENDING long prefixes wait in the pool at a time.
        for i in range(p["max_fill"]):
            in_host = int(host_bytes // (0.9 * fill_tokens * per_token)) if per_token else 0
            long = fills - in_host < PENDING
            prompt = (_prompt(rng, p["prompt_words"], f"fill {i} {rng.random()}") if long
                      else _push(i))
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            r = await call(http, "POST", base + "/v1/completions", body, timeout=600)
            failures += r.status != 200
            if r.status == 200 and long:
                fill_tokens = (r.body.get("usage") or {}).get("prompt_tokens") or 0
                fig["tokens_per_word"] = fill_tokens / p["prompt_words"]
                fills += 1
            await asyncio.sleep(0.6)  # the gauge reads at most every 0.5 s, between ticks
            m = await metrics(http, base)
            ws = cg.working_set()
            peak = max(peak, ws)
            host_bytes = metric_sum(m, "superfluid_host_cache_bytes") or 0
            row = {"t": round(time.monotonic() - t0, 1), "i": i, "long": long, "status": r.status,
                   "ws_mb": round(ws / MIB), "host_mb": round(host_bytes / MIB),
                   "level": metric_sum(m, "superfluid_memory_pressure_level"),
                   "host_os_pressure": metric_sum(m, "superfluid_prefix_evictions_total", reason="host_os_pressure")}
            timeline.append(row)
            entries = metric_sum(m, "superfluid_host_cache_entries") or 0
            if entries and not per_token:  # the first prefix in host memory, a long one: its bytes per token
                per_token = host_bytes / (fill_tokens * entries)
            if row["host_os_pressure"]:
                fig["ladder_acted_after"] = i + 1
                fig["long_fills"] = fills
                last_pressure = time.monotonic()
                break
        fig.update(phase1=timeline, phase1_failures=failures, ws_peak_mb=round(peak / MIB),
                   oom_kills_phase1=cg.oom_kills(), pressure_level_max=max((r["level"] or 0) for r in timeline),
                   host_os_pressure_evictions=timeline[-1]["host_os_pressure"] if timeline else None)
        if fig.get("ladder_acted_after") is None or fig["oom_kills_phase1"]:
            return
        await asyncio.sleep(1.0)
        fig["ws_after_ladder_mb"] = round(cg.working_set() / MIB)
        # ---- phase 2: one park bigger than the margin the ladder calls ok --------------------------
        pid_before = (await _health(http, base)).get("worker_pid")
        # the host tier is closed for 30 s (host_pause_s) after pressure: a park then would be refused,
        # not attempted
        pause = p.get("host_pause_s") or HOST_PAUSE_S
        await asyncio.sleep(max(0.0, pause + 1.0 - (time.monotonic() - last_pressure)))
        long_words = int(p["long_tokens"] / fig.get("tokens_per_word", 1.5))
        long_prompt = _prompt(rng, long_words, f"long {rng.random()}")
        background = asyncio.create_task(stream(
            http, base + "/v1/completions",
            {"model": MODEL_NAME, "prompt": long_prompt, "max_tokens": BACKGROUND_TOKENS, "temperature": 0,
             "ignore_eos": True, "stream_options": {"include_usage": True}},
            headers={"x-superfluid-qos": "background"}, timeout=900))
        started = await _first_token(http, base, background)
        if not started:
            fig["error"] = "the long background lane never started decoding"
            await background
            return
        ws = cg.working_set()
        park = int(p["long_tokens"] * per_token)
        margin = int(ws / 9) + 8 * MIB  # over 10 % of the limit: the ladder reads "ok"
        fig.update(kv_bytes_per_token=round(per_token), park_mb=round(park / MIB), margin_mb=round(margin / MIB),
                   limit2_mb=round((ws + margin) / MIB), ws_before_kill_mb=round(ws / MIB))
        if park < margin * 1.2:
            fig["error"] = (f"the long lane's KV ({park / MIB:.0f} MiB) is not above the ok margin "
                            f"({margin / MIB:.0f} MiB)")
            background.cancel()
            return
        cg.set_limit(ws + margin)
        kills_before = cg.oom_kills()
        interactive = await stream(http, base + "/v1/completions",
                                   {"model": MODEL_NAME, "prompt": "Say hello.", "max_tokens": p["reply_tokens"],
                                    "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}},
                                   headers={"x-superfluid-qos": "interactive"}, timeout=900)
        bg = await background
        fig["oom_kills"] = cg.oom_kills() - kills_before
        cg.set_limit(ws + 2 * margin + 512 * MIB)  # room again: the check below is about the daemon
        h = await _health(http, base)
        fig["worker_restarted"] = bool(pid_before) and h.get("worker_pid") not in (None, pid_before)
        fig["worker_restarts"] = h.get("restarts")
        fig["lanes"] = {"interactive": {"status": interactive.status, "error": interactive.error,
                                        "chunks": interactive.chunks, "usage": interactive.usage},
                        "background": {"status": bg.status, "error": bg.error, "chunks": bg.chunks, "usage": bg.usage}}
        fig["lanes_resumed_whole"] = all(
            s.status == 200 and s.error is None and (s.usage or {}).get("completion_tokens") == n
            for s, n in ((interactive, p["reply_tokens"]), (bg, BACKGROUND_TOKENS)))
        after = await call(http, "POST", base + "/v1/completions",
                           {"model": MODEL_NAME, "prompt": "One more.", "max_tokens": 4}, timeout=300)
        fig["after_ok"] = after.status == 200


async def _first_token(http, base, task: asyncio.Task, timeout: float = 900.0) -> bool:
    """Wait until the lane is decoding (/slots shows generated tokens), or the task ended."""
    async def decoding():
        if task.done():
            return True
        r = await call(http, "GET", base + "/slots", timeout=10)
        model = ((r.body or {}).get("models") or {}).get(MODEL_NAME) or {} if isinstance(r.body, dict) else {}
        return any((s.get("generated_tokens") or 0) > 0 for s in model.get("slots") or [] if isinstance(s, dict))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await decoding():
            return not task.done() or task.result().status == 200
        await asyncio.sleep(0.5)
    return False
