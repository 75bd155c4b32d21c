"""Disk full: the daemon's ``--state-dir`` sits on a small tmpfs that a filler file fills up while
sessions take turns (each finished turn seals its KV to the session's park artifact: ``--park``),
are parked on request, and are opened; meanwhile plain chat completions and a preemption load
(background streams on every lane, interactive requests that push them out) run beside them.

What reaches the disk, and what does not:

* the session log (``sessions/ID.jsonl``): one record per create, turn, SetQos, window cut and
  close (fsynced: a turn is acknowledged only once its record is on disk); park and resume
  records are informational (a restart rebuilds the state from the turns and the artifact);
* park artifacts (``park/ID.kv`` written whole via a temporary file, synced and renamed, then
  ``park/ID.json`` naming its tokens and its size, replaced the same way): sealed after every
  turn, on an explicit park, at shutdown;
* preempted lanes park their KV in the engine's host memory only (``--park``): nothing of theirs
  goes to disk, which the scenario checks (the state dir's listing is the same before and after
  a preemption load on the full disk).

Phases: (1) healthy: sessions take a turn, their artifacts appear; (2) the disk full (0 bytes
free): plain chats and the preemption load only; (3) still full: session turns, parks and creates
beside plain chats; (4) nearly full (room for log records, not for an artifact): turns and parks
again, their seals cannot be written; (5) the filler deleted: every session takes a turn and is
sealed again, a new session too; (6) the daemon stopped gracefully and started again on the same
state dir: every session comes back at its acknowledged turn and takes one more.

"Whole" for a file on disk: a session log whose every line parses; an artifact's metadata that
parses and names as many bytes as its KV file holds (a KV file without its metadata, or with
another size, is not whole); no ``*.tmp`` left behind.

Pass: the daemon never dies; plain chats and preempted requests all answer 200 on the full disk;
a request that needs the disk answers 200 or a clean 507 (never another 5xx); a seal or park that
cannot be written leaves a warning in the log and is dropped (the next turn recomputes it); every
file on disk is whole; once space is freed every session seals again; after a restart every
session is at its acknowledged turn and takes another."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import aiohttp

from tools.suite.common import call, metric_sum, metrics, stream

from ..common import MODEL_NAME, Ctx, Outcome, verdict

KEY, TITLE = "disk_full", "disk full"
FAULT = "the --state-dir tmpfs fills up while sessions seal, park and open, and preempted lanes park"
PASS = ("no crash; plain and preempted requests all 200; disk-bound requests 200 or a clean 507; unwritable "
        "parks dropped with a warning; every file on disk whole; sealing resumes once space is freed")
FULL = {"tmpfs_mb": 48, "sessions": 4, "chats": 24, "rounds": 3, "slack_kb": 96, "lanes": 2}
FAST = {"tmpfs_mb": 32, "sessions": 3, "chats": 10, "rounds": 1, "slack_kb": 96, "lanes": 2}
HEADLINE = ["plain_statuses", "disk_statuses", "5xx_other", "seal_warnings", "dropped_warnings",
            "artifact_bytes", "files_not_whole", "tmp_left", "resealed", "daemon_alive", "worker_restarted"]

SYSTEM = ("You are a careful assistant for a library. Answer briefly and politely. " * 4).strip()
QUESTIONS = ["Where is the library?", "Is parking free?", "Do you lend films?", "When do you open?",
             "Can I print there?", "Is there wifi?", "Do you have maps?", "Are dogs allowed?"]
SEAL_WARNINGS = ("could not write park artifact",)
DROP_WARNING = "park artifact dropped"


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs for the state dir"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount on this machine"
    probe = Path(f"/tmp/superfluid-chaos-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0:
            return f"cannot mount a tmpfs: {(r.stderr or r.stdout).strip()[:200]}"
        subprocess.run(["umount", str(probe)], capture_output=True, timeout=20)
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


# ---- the state dir -----------------------------------------------------------------------------

def mount_tmpfs(ctx: Ctx, path: Path, size_mb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True,
                   capture_output=True, timeout=20)
    ctx.on_cleanup(lambda: subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=20))


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0) -> int:
    """Fill the file system of ``path`` with ``path/filler`` until nothing (``leave``: about that
    many bytes) is free; the filler's size."""
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, 64 << 10, 4 << 10, 512):
            block = b"\0" * chunk
            while True:
                try:
                    if os.write(fd, block) < chunk:  # a short write: what fitted
                        break
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    break
    finally:
        os.close(fd)
    size = filler.stat().st_size
    if leave:
        size = max(size - leave, 0)
        os.truncate(filler, size)
    return size


def listing(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def check_state_dir(state: Path) -> dict:
    """Every file of a state dir checked for wholeness: session logs whose lines all parse, park
    artifacts whose metadata parses and names the size of its KV file; ``*.tmp`` leftovers."""
    not_whole: list[str] = []
    logs = artifacts = 0
    for log in sorted((state / "sessions").glob("*.jsonl")):
        logs += 1
        raw = log.read_bytes()
        if raw and not raw.endswith(b"\n"):
            not_whole.append(f"{log.name}: ends in a torn line")
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except ValueError:
                not_whole.append(f"{log.name} line {n} does not parse")
    park = state / "park"
    kv_files = {p.stem: p for p in park.glob("*.kv")}
    metas = {p.stem: p for p in park.glob("*.json")}
    for sid in sorted(set(kv_files) | set(metas)):
        artifacts += 1
        kv, meta_path = kv_files.get(sid), metas.get(sid)
        if meta_path is None:
            not_whole.append(f"{sid}.kv without its metadata")
            continue
        try:
            meta = json.loads(meta_path.read_text())
            tokens = meta["tokens"]
            assert isinstance(tokens, list) and tokens
        except (OSError, ValueError, KeyError, AssertionError, TypeError) as e:
            not_whole.append(f"{sid}.json does not parse ({type(e).__name__})")
            continue
        if kv is None:
            not_whole.append(f"{sid}.json without its KV file")
            continue
        size = kv.stat().st_size
        want = meta.get("kv_bytes")
        if size == 0 or (want is not None and want != size):
            not_whole.append(f"{sid}.kv holds {size} bytes, its metadata names {want}")
    tmp = [str(p.relative_to(state)) for p in state.rglob("*.tmp")]
    return {"logs": logs, "artifacts": artifacts, "not_whole": not_whole, "tmp": tmp}


def sealed_turns(state: Path, sid: str) -> int | None:
    try:
        return json.loads((state / "park" / f"{sid}.json").read_text()).get("turns")
    except (OSError, ValueError):
        return None


# ---- traffic -------------------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.plain: dict[str, int] = {}
        self.disk: dict[str, int] = {}
        self.other_5xx: list[str] = []   # 5xx where none may be (plain, or disk-bound but not 507)
        self.unexpected: list[str] = []  # neither 200/201 nor a clean 507 (or a refused connection)

    def plain_done(self, what: str, status: int, body=None) -> None:
        self.plain[str(status)] = self.plain.get(str(status), 0) + 1
        if status != 200:
            (self.other_5xx if status >= 500 else self.unexpected).append(f"{what}: {status} {str(body)[:200]}")

    def disk_done(self, what: str, status: int, body=None, full: bool = True) -> bool:
        """A request that needs the disk: 200/201, or (on a full disk) a 507 insufficient_storage."""
        self.disk[str(status)] = self.disk.get(str(status), 0) + 1
        if status in (200, 201):
            return True
        clean_507 = (status == 507 and isinstance(body, dict)
                     and (body.get("error") or {}).get("code") == "insufficient_storage")
        if full and clean_507:
            return False
        (self.other_5xx if status >= 500 else self.unexpected).append(f"{what}: {status} {str(body)[:200]}")
        return False


async def chat(http, base: str, tally: Tally, i: int, qos: str = "interactive", n: int = 12) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Count to {i % 7 + 3}."}],
            "max_tokens": n, "temperature": 0}
    try:
        r = await call(http, "POST", base + "/v1/chat/completions", body, headers={"x-superfluid-qos": qos},
                       timeout=180)
        ok = r.status == 200 and bool(r.body.get("choices"))
        tally.plain_done(f"chat {qos}", r.status if ok or r.status != 200 else 0, r.body)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        tally.plain_done(f"chat {qos}", 0, f"{type(e).__name__}: {e}")


async def preempt_load(http, base: str, tally: Tally, lanes: int, rounds: int) -> None:
    """Background streams on every lane; once they all decode, interactive chats that preempt
    them (their KV parks in host memory). Every one must finish with 200."""
    for r in range(rounds):
        decoding = [asyncio.Event() for _ in range(lanes)]

        async def background(j: int) -> None:
            res = await stream(http, base + "/v1/chat/completions",
                               {"model": MODEL_NAME, "max_tokens": 96, "temperature": 0.7, "ignore_eos": True,
                                "messages": [{"role": "user", "content": f"Write a long story number {j}."}]},
                               headers={"x-superfluid-qos": "background"}, timeout=180,
                               on_chunk=lambda _res: decoding[j].set())
            decoding[j].set()
            status = res.status if res.error is None or res.status != 200 else 0  # 0: a broken stream
            tally.plain_done("background stream", status, res.error)

        bg = [asyncio.create_task(background(j)) for j in range(lanes)]
        await asyncio.wait_for(asyncio.gather(*[e.wait() for e in decoding]), 120)
        await asyncio.gather(*[chat(http, base, tally, r * 10 + k, "interactive", 8) for k in range(lanes)])
        await asyncio.gather(*bg)


class Sessions:
    """The client's view: each session's acknowledged turns and the questions they asked."""

    def __init__(self, http, base: str, tally: Tally, rng):
        self.http, self.base, self.tally, self.rng = http, base, tally, rng
        self.acked: dict[str, list[str]] = {}  # id -> the user message of every acknowledged turn

    async def create(self, full: bool) -> str | None:
        r = await call(self.http, "POST", self.base + "/v1/sessions", {"system": SYSTEM}, timeout=60)
        if self.tally.disk_done("create", r.status, r.body, full) and r.status == 201:
            self.acked[r.body["id"]] = []
            return r.body["id"]
        return None

    async def turn(self, sid: str, full: bool) -> dict | None:
        q = self.rng.choice(QUESTIONS)
        r = await call(self.http, "POST", self.base + f"/v1/sessions/{sid}/turns",
                       {"messages": [{"role": "user", "content": q}], "max_tokens": 12, "temperature": 0},
                       timeout=180)
        if self.tally.disk_done("turn", r.status, r.body, full) and r.status == 200:
            self.acked[sid].append(q)
            return r.body
        return None

    async def park(self, sid: str, full: bool) -> None:
        r = await call(self.http, "POST", self.base + f"/v1/sessions/{sid}/park", timeout=60)
        self.tally.disk_done("park", r.status, r.body, full)

    async def views(self) -> dict[str, dict]:
        out = {}
        for sid in self.acked:
            r = await call(self.http, "GET", self.base + f"/v1/sessions/{sid}", timeout=30)
            out[sid] = r.body if r.status == 200 else {"status": r.status}
        return out

    def mismatches(self, views: dict[str, dict]) -> list[str]:
        """Sessions whose server view is not their acknowledged turns, question by question."""
        bad = []
        for sid, asked in self.acked.items():
            v = views.get(sid) or {}
            got = [m.get("content") for m in v.get("messages") or [] if m.get("role") == "user"]
            if v.get("turns") != len(asked) or got != asked:
                bad.append(f"{sid}: server turns {v.get('turns')} / acked {len(asked)}")
        return bad


async def wait_sealed(state: Path, views: dict[str, dict], timeout: float) -> list[str]:
    """The sessions whose artifact does not name their latest turn within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        late = [sid for sid, v in views.items() if v.get("turns") and sealed_turns(state, sid) != v["turns"]]
        if not late or time.monotonic() > deadline:
            return late
        await asyncio.sleep(0.2)


async def health(http, base: str) -> dict:
    r = await call(http, "GET", base + "/health", timeout=10)
    return r.body if isinstance(r.body, dict) else {}


def worker_pid(h: dict):
    return ((h.get("models") or {}).get(MODEL_NAME) or {}).get("worker_pid")


async def _drive(ctx: Ctx, srv, state: Path) -> tuple[dict, list[str]]:
    p = ctx.p
    fig: dict = {}
    broken: list[str] = []
    tally = Tally()
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        base = srv.base
        w0 = worker_pid(await health(http, base))
        ss = Sessions(http, base, tally, ctx.rng)
        # (1) healthy: sessions take a turn and are sealed
        for _ in range(p["sessions"]):
            sid = await ss.create(full=False)
            if sid:
                await ss.turn(sid, full=False)
        late = await wait_sealed(state, await ss.views(), 60)
        if late:
            broken.append(f"{len(late)} sessions not sealed before the fault")
        sizes = [v for k, v in listing(state).items() if k.endswith(".kv")]
        fig["artifact_bytes"] = max(sizes) if sizes else None

        # (2) the disk full: plain chats and the preemption load only; nothing of theirs on disk
        m0 = await metrics(http, base)
        fig["filler_mb"] = round(fill(state) / 2**20, 1)
        fig["free_when_full"] = free_bytes(state)
        before = listing(state)
        await asyncio.gather(*[chat(http, base, tally, i) for i in range(p["chats"] // 2)])
        await preempt_load(http, base, tally, p["lanes"], p["rounds"])
        m1 = await metrics(http, base)
        fig["preemptions"] = (metric_sum(m1, "superfluid_preemptions_total") or metric_sum(m1, "superfluid_preemptions")
                              or 0) - (metric_sum(m0, "superfluid_preemptions_total")
                                       or metric_sum(m0, "superfluid_preemptions") or 0)
        after = listing(state)
        if after != before:
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            broken.append(f"plain/preempted traffic changed the state dir: {changed[:5]}")

        # (3) still full: turns, parks, creates beside plain chats
        async def disk_traffic(full: bool) -> None:
            for sid in list(ss.acked):
                await ss.turn(sid, full)
                if ctx.rng.random() < 0.5:
                    await ss.park(sid, full)
            await ss.create(full)

        await asyncio.gather(disk_traffic(True), *[chat(http, base, tally, i) for i in range(p["chats"] // 4)])
        # (4) nearly full: room for log records, not for an artifact
        os.unlink(state / "filler")
        fill(state, leave=p["slack_kb"] << 10)
        fig["free_when_nearly_full"] = free_bytes(state)
        await asyncio.gather(disk_traffic(True), *[chat(http, base, tally, i) for i in range(p["chats"] // 4)])
        await asyncio.sleep(1.0)  # the last seals' ticks
        fig["while_full"] = check_state_dir(state)

        # (5) space freed: every session (and a new one) takes a turn and is sealed again
        os.unlink(state / "filler")
        for sid in list(ss.acked):
            await ss.turn(sid, full=False)
        new = await ss.create(full=False)
        if new:
            await ss.turn(new, full=False)
        views = await ss.views()
        late = await wait_sealed(state, views, 60)
        fig["resealed"] = f"{len(views) - len(late)}/{len(views)}"
        if late:
            broken.append(f"{len(late)} sessions not sealed again once space was freed")
        bad = ss.mismatches(views)
        if bad:
            broken.append(f"sessions differ from their acknowledged turns: {bad[:3]}")
        h = await health(http, base)
        fig["worker_restarted"] = worker_pid(h) != w0
        fig["daemon_alive"] = srv.alive()
        fig["after_freed"] = check_state_dir(state)

    # (6) a graceful restart on the same state dir: every session at its acknowledged turn
    srv.restart()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:
        ss.http, ss.base = http, srv.base
        views = await ss.views()
        bad = ss.mismatches(views)
        if bad:
            broken.append(f"after a restart, sessions differ from their acknowledged turns: {bad[:3]}")
        for sid in list(ss.acked):
            await ss.turn(sid, full=False)
        fig["after_restart"] = check_state_dir(state)

    log = srv.log_text()
    fig["seal_warnings"] = sum(log.count(w) for w in SEAL_WARNINGS)
    fig["dropped_warnings"] = log.count(DROP_WARNING)
    fig["tracebacks"] = log.count("Traceback")
    fig["plain_statuses"], fig["disk_statuses"] = tally.plain, tally.disk
    fig["5xx_other"] = len(tally.other_5xx)
    fig["errors"] = (tally.other_5xx + tally.unexpected)[:6]
    checks = [fig["while_full"], fig["after_freed"], fig["after_restart"]]
    fig["files_not_whole"] = sum(len(c["not_whole"]) for c in checks)
    fig["tmp_left"] = sum(len(c["tmp"]) for c in checks)
    if tally.other_5xx:
        broken.append(f"{len(tally.other_5xx)} 5xx other than a clean 507: {tally.other_5xx[:2]}")
    if tally.unexpected:
        broken.append(f"{len(tally.unexpected)} unexpected answers: {tally.unexpected[:2]}")
    if set(tally.plain) != {"200"}:
        broken.append(f"plain requests answered {tally.plain}")
    if fig["seal_warnings"] + fig["dropped_warnings"] == 0:
        broken.append("no warning in the log for a park that could not be written")
    if fig["files_not_whole"]:
        broken.append(f"files not whole: {[c['not_whole'][:2] for c in checks]}")
    if fig["tmp_left"]:
        broken.append(f"*.tmp left behind: {[c['tmp'][:2] for c in checks]}")
    if fig["tracebacks"]:
        broken.append(f"{fig['tracebacks']} tracebacks in the daemon's log")
    return fig, broken


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    state = ctx.out_dir / "disk_full-state"
    mount_tmpfs(ctx, state, p["tmpfs_mb"])
    srv = ctx.serve("--max-batch", str(p["lanes"]), "--max-context", "1024", "--park", "--state-dir", str(state),
                    name="disk_full")
    daemon_pid = srv.pid
    fig, broken = asyncio.run(_drive(ctx, srv, state))
    fig["daemon_alive"] = fig.get("daemon_alive", False) and srv.alive()
    if not fig["daemon_alive"]:
        broken.append(f"the daemon (pid {daemon_pid}) died")
    v, why = verdict(not broken,
                     f"disk filled twice: plain requests {fig['plain_statuses']}, disk-bound {fig['disk_statuses']}, "
                     f"{fig['seal_warnings'] + fig['dropped_warnings']} unwritable parks warned and dropped, every "
                     f"file whole, {fig['resealed']} sessions sealed again once freed",
                     "; ".join(broken))
    return Outcome(KEY, "superfluid", v, why, fig)
