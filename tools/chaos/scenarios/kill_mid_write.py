"""Kill mid-write: the daemon and its engine worker are SIGKILLed (``os.killpg``: no shutdown runs)
at random moments (seeded) while sessions write their state, then started again on the same
``--state-dir``, many times over.

The workload between kills: a few sessions at once taking turns (each finished turn appends a
record to the session's log and, with ``--park``, seals the turn's KV to the session's park
artifact in the background), explicit parks, and new sessions opened. The client keeps its own
account: a turn counts as completed when it answered 200; a turn whose answer the kill cut off is
"in flight" (the server may or may not have recorded it).

What the state dir's writes promise (core/sessions.py, core/tick_runner.py ``write_atomically``):

* ``sessions/ID.jsonl``, the session log — appended, one record per ``write`` loop, **fsynced
  before the request is answered** (a 200 turn is on disk); not renamed into place, so a kill
  mid-append can leave a torn last line: a failed write is cut off again at once, and recovery
  cuts a torn last line back to the last whole record (the next record starts a line of its own);
* ``park/ID.kv``, the park artifact's KV — **atomic and fsynced**: a temporary file, written,
  fsynced, renamed over the old one, the directory fsynced;
* ``park/ID.json``, its metadata (the tokens it holds, its KV file's size) — **atomic and
  fsynced** the same way, written after the KV file; a kill between the two renames leaves
  metadata naming another size, and recovery refuses that pair and deletes it (the session's next
  turn prefills);
* ``*.tmp`` — what a kill cut short: deleted at recovery; never read.

Pass: every restart answers /health within ``startup_s``; every state dir after recovery holds
only whole files (every log line parses, every artifact's metadata names its KV file's size, no
``*.tmp``); every session the client knows is at its last completed turn, or one further when a
turn was in flight at the kill (never behind: a 200 turn is never lost), with the very messages
the client sent; and its next turn succeeds (200)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import time

import aiohttp
import psutil

from tools.suite.common import call

from ..common import Ctx, Outcome, verdict
from .disk_full import QUESTIONS, SYSTEM, check_state_dir

KEY, TITLE = "kill_mid_write", "kill mid-write"
FAULT = "SIGKILL of the daemon and its worker at random moments while sessions log turns, seal and park"
PASS = ("every restart loads; every file on disk whole after recovery; every session at its last 200 turn (or one "
        "further if one was in flight), never behind, and its next turn answers 200")
FULL = {"kills": 50, "sessions": 4, "window_s": [0.05, 2.5], "startup_s": 90, "lanes": 2, "park_share": 0.2}
# the CI variant: 4 kills (each costs a restart, a model load: most of its time)
FAST = {"kills": 4, "sessions": 3, "window_s": [0.05, 2.0], "startup_s": 90, "lanes": 2, "park_share": 0.2}
HEADLINE = ["kills", "restart_s", "turns_acked", "in_flight_at_kill", "in_flight_recorded", "lost_acked_turns",
            "corrupt_sessions", "cut_writes_repaired", "not_whole_after_restart", "next_turn_failures",
            "warm_after_restart"]
WRITES = {
    "sessions/ID.jsonl": "appended, fsynced per record before the answer; a torn tail cut at recovery",
    "park/ID.kv": "atomic (temporary file, fsync, rename, directory fsync)",
    "park/ID.json": "atomic (same), after the KV file; names the KV file's size, a mismatched pair is refused",
    "*.tmp": "cut-short writes: deleted at recovery",
}
RECOVERY_LOG = ("park artifact unusable", "torn last record", "temporary files that unfinished writes left")


def unavailable() -> str | None:
    if not hasattr(os, "killpg"):
        return "no process groups on this platform"
    return None


class Account:
    """The client's record of every session: the questions of its completed turns, and the one in
    flight (sent, not answered)."""

    def __init__(self):
        self.acked: dict[str, list[str]] = {}
        self.in_flight: dict[str, str] = {}
        self.turns_acked = 0


async def _turn(http, base: str, acct: Account, sid: str, q: str, timeout: float = 120) -> int:
    acct.in_flight[sid] = q
    r = await call(http, "POST", base + f"/v1/sessions/{sid}/turns",
                   {"messages": [{"role": "user", "content": q}], "max_tokens": 10, "temperature": 0},
                   timeout=timeout)
    if r.status == 200:
        acct.acked[sid].append(q)
        acct.turns_acked += 1
    acct.in_flight.pop(sid, None)  # answered: its outcome is known
    return r.status


async def _workload(ctx: Ctx, base: str, acct: Account, stop_at: float) -> None:
    """Sessions take turns (sealed), are parked and opened until the kill."""
    p = ctx.p
    rng = ctx.rng
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        async def one(sid: str | None, seed: int) -> None:
            r = type(rng)(seed)
            try:
                while time.monotonic() < stop_at:
                    if sid is None:
                        reply = await call(http, "POST", base + "/v1/sessions", {"system": SYSTEM}, timeout=30)
                        if reply.status != 201:
                            return
                        sid = reply.body["id"]
                        acct.acked[sid] = []
                    if acct.acked[sid] and r.random() < p["park_share"]:
                        await call(http, "POST", base + f"/v1/sessions/{sid}/park", timeout=60)
                    else:
                        await _turn(http, base, acct, sid, r.choice(QUESTIONS))
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                return  # the kill: whatever was sent is in flight

        known = list(acct.acked)
        sids = known + [None] * max(p["sessions"] - len(known), 0)
        await asyncio.gather(*[one(sid, rng.randrange(1 << 30)) for sid in sids])


def _kill(pid: int) -> list[int]:
    """SIGKILL the daemon's process group (its worker with it); the PIDs left alive after 20 s."""
    try:
        held = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        held = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, alive = psutil.wait_procs(held, timeout=20)
    return [p.pid for p in alive]


async def _check(ctx: Ctx, base: str, acct: Account, fig: dict, broken: list[str]) -> None:
    """After a restart: every session the client knows at its last completed turn (or the one in
    flight), with its questions; each takes its next turn."""
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        r = await call(http, "GET", base + "/v1/sessions", timeout=30)
        listed = {s["id"]: s for s in (r.body or {}).get("data", [])} if r.status == 200 else {}
        if r.status != 200:
            broken.append(f"GET /v1/sessions answered {r.status}")
        for sid in [s for s in listed if s not in acct.acked]:  # opened, but its 201 was cut off
            fig["unacked_creates"] += 1
            acct.acked[sid] = []
        for sid, asked in list(acct.acked.items()):
            r = await call(http, "GET", base + f"/v1/sessions/{sid}", timeout=30)
            flying = acct.in_flight.pop(sid, None)
            if r.status != 200:
                if not asked and sid not in listed:  # never confirmed, never recorded: fine
                    acct.acked.pop(sid)
                    continue
                fig["corrupt_sessions"] += 1
                broken.append(f"{sid} did not load: {r.status} {str(r.body)[:160]}")
                acct.acked.pop(sid)
                continue
            got = [m.get("content") for m in r.body.get("messages") or [] if m.get("role") == "user"]
            turns = r.body.get("turns")
            if flying is not None:
                fig["in_flight_at_kill"] += 1
            if flying is not None and turns == len(asked) + 1 and got == asked + [flying]:
                fig["in_flight_recorded"] += 1
                asked.append(flying)  # it finished before the kill; its answer did not arrive
            elif turns < len(asked):
                fig["lost_acked_turns"] += len(asked) - turns
                broken.append(f"{sid}: {len(asked)} turns answered 200, {turns} after the restart")
                acct.acked[sid] = asked = got
            elif turns != len(asked) or got != asked:
                fig["corrupt_sessions"] += 1
                broken.append(f"{sid}: turns {turns} / acked {len(asked)}, messages differ")
                acct.acked[sid] = asked = got
        # every known session takes its next turn: it loads, it is not corrupt
        results = await asyncio.gather(*[_next(http, base, acct, sid) for sid in list(acct.acked)])
        for sid, (status, cached) in zip(list(acct.acked), results):
            fig["next_turns"] += 1
            if status != 200:
                fig["next_turn_failures"] += 1
                broken.append(f"{sid}: its next turn after the restart answered {status}")
            elif cached:
                fig["warm_next_turns"] += 1


async def _next(http, base, acct: Account, sid: str) -> tuple[int, int]:
    q = QUESTIONS[len(acct.acked[sid]) % len(QUESTIONS)]
    acct.in_flight[sid] = q
    r = await call(http, "POST", base + f"/v1/sessions/{sid}/turns",
                   {"messages": [{"role": "user", "content": q}], "max_tokens": 6, "temperature": 0}, timeout=120)
    acct.in_flight.pop(sid, None)
    if r.status != 200:
        return r.status, 0
    acct.acked[sid].append(q)
    acct.turns_acked += 1
    return 200, ((r.body.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    state = ctx.out_dir / "kill_mid_write-state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    srv = ctx.serve("--max-batch", str(p["lanes"]), "--max-context", "1024", "--park", "--state-dir", str(state),
                    name="kill_mid_write", startup_timeout=p["startup_s"])
    acct = Account()
    fig: dict = {"kills": 0, "restarts": 0, "in_flight_at_kill": 0, "in_flight_recorded": 0, "lost_acked_turns": 0,
                 "corrupt_sessions": 0, "unacked_creates": 0, "next_turns": 0, "next_turn_failures": 0,
                 "warm_next_turns": 0, "cut_writes_found": 0, "not_whole_after_restart": 0, "left_alive": 0,
                 "writes": WRITES}
    broken: list[str] = []
    restart_s: list[float] = []
    kill_at: list[float] = []
    lo, hi = p["window_s"]
    for k in range(p["kills"]):
        # the workload runs; the kill comes at a random moment of it
        delay = ctx.rng.uniform(lo, hi)
        kill_at.append(round(delay, 3))
        pid = srv.pid

        async def cycle() -> None:
            stop_at = time.monotonic() + delay + 30
            work = asyncio.create_task(_workload(ctx, srv.base, acct, stop_at))
            await asyncio.sleep(delay)
            left = await asyncio.get_running_loop().run_in_executor(None, _kill, pid)
            fig["left_alive"] += len(left)
            if left:
                broken.append(f"kill {k}: processes left alive after SIGKILL of the group: {left}")
            await asyncio.wait_for(work, 60)

        asyncio.run(cycle())
        fig["kills"] += 1
        before = check_state_dir(state)  # what the kill left, for recovery to repair
        fig["cut_writes_found"] += len(before["tmp"]) + len(before["not_whole"])
        srv.terminate(5)  # already dead: closes its log handle
        t0 = time.monotonic()
        try:
            srv.start()  # same port, same state dir; waits for /health 200 (startup_s at most)
        except RuntimeError as e:
            broken.append(f"restart {k + 1} failed: {str(e)[:300]}")
            break
        restart_s.append(time.monotonic() - t0)
        fig["restarts"] += 1
        after = check_state_dir(state)
        fig["not_whole_after_restart"] += len(after["tmp"]) + len(after["not_whole"])
        if after["tmp"] or after["not_whole"]:
            broken.append(f"restart {k + 1}: not whole after recovery: {(after['tmp'] + after['not_whole'])[:3]}")
        asyncio.run(_check(ctx, srv.base, acct, fig, broken))
        if len(broken) > 20:
            break
    log = srv.log_text()
    fig["cut_writes_repaired"] = {w: log.count(w) for w in RECOVERY_LOG}
    fig["restart_s"] = {"median": round(statistics.median(restart_s), 2) if restart_s else None,
                        "max": round(max(restart_s), 2) if restart_s else None}
    fig["turns_acked"] = acct.turns_acked
    fig["sessions"] = len(acct.acked)
    fig["warm_after_restart"] = f"{fig['warm_next_turns']}/{fig['next_turns']}"
    fig["kill_at_s"] = kill_at
    fig["tracebacks"] = log.count("Traceback")
    fig["errors"] = broken[:8]
    if restart_s and max(restart_s) > p["startup_s"]:
        broken.append(f"a restart took {max(restart_s):.1f} s")
    if fig["kills"] < p["kills"]:
        broken.append(f"only {fig['kills']} of {p['kills']} kills ran")
    v, why = verdict(not broken,
                     f"{fig['kills']} kills, {fig['restarts']} restarts (max {fig['restart_s']['max']} s): "
                     f"{acct.turns_acked} turns answered 200, none lost, {fig['in_flight_recorded']}/"
                     f"{fig['in_flight_at_kill']} in-flight turns recorded, every file whole after recovery, "
                     f"every next turn 200",
                     "; ".join(broken[:6]))
    return Outcome(KEY, "superfluid", v, why, fig)
