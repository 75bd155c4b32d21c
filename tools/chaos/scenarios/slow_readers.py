"""Slow and vanishing readers: clients that read a stream one byte a second, stop reading without
closing, or half-close their side, beside people whose streams must not notice.

Up to three phases on one server (``--max-batch 4``, ``--stream-stall-timeout stall_s``), each
with ``normal`` clients (the ``interactive`` class) streaming ``normal_tokens``-token completions
back to back for ``phase_s`` seconds; a stream's rate is its tokens over the time from its send to
its last delta:

1. **Alone** (``alone``; the full run only): only the normal clients, for the record.
2. **Control**: beside them, the background requests of phase 3 from clients that read their
   replies. The baseline: the same work for the server, minus the misbehaviour.
3. **Faults**: the same background requests, from clients that misbehave:

   * ``vanish`` clients (``background``, ``/v1/completions``) send a streamed request of
     ``vanish_tokens`` tokens and never read, with a 4 KiB receive buffer, holding the connection
     open: their short replies fit in the socket buffers, the lane finishes, the connection stays;
   * ``stall`` of them (``agent``, ``/v1/chat/completions`` with ``top_logprobs: 20``, about
     1.9 KB a token) ask ``stall_tokens`` tokens, some 1.5 MB, far more than the buffers hold
     (some 270 KB): the server's write waits, and after ``--stream-stall-timeout`` the stream is
     closed and the lane cancelled (plugins/http/stall.py);
   * one client reads its stream one byte a second for ``slow_s`` seconds, then closes;
   * ``half_close`` clients send their request and shut down their sending side at once
     (``shutdown(SHUT_WR)``), then read the reply.

The clients that never read are plain sockets that nothing reads. (Wrapped in asyncio's streams,
as a first version of this scenario had them, the client's own protocol reads up to 128 KiB into
its buffer before it pauses, and a 1,500-token reply with ``logprobs: 5``, 370 KB, then fitted in
that plus the server's buffers in some runs and ended 200.)

Sampled every 0.5 s: the daemon's and the engine worker's RSS. Pass: the daemon's RSS in the fault
phase stays within 64 MiB of its peak before; the normal streams' median token rate is at least
``min_rate_ratio`` of the control's; every stalled stream was cancelled by the guard (its warning
in the log, one per stalled client); every lane is free afterwards, the queue empty; the slow
reader got the start of a well-formed stream; every half-closed request got a whole reply or a
closed connection (aiohttp takes a half-close for a client gone: the request is cancelled, 499),
never a 5xx; the server answers afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import urllib.request

import aiohttp
import psutil

from tools.suite.common import call, stream

from ..common import MODEL_NAME, Ctx, Outcome, verdict

KEY, TITLE = "slow_readers", "slow and vanishing readers"
FAULT = ("clients that never read (200, 4 KiB receive buffers; a few asking far more than the buffers hold), one "
         "that reads a byte a second, and clients that half-close, beside interactive streams")
PASS = ("daemon RSS within 64 MiB of its baseline; the interactive streams' token rate within the stated ratio of "
        "a run without them; every stalled stream cancelled after --stream-stall-timeout, every lane free after; "
        "no 5xx")
FULL = {"normal": 2, "normal_tokens": 96, "phase_s": 40.0, "alone": True, "vanish": 200, "vanish_tokens": 24,
        "stall": 4, "stall_tokens": 800, "stall_s": 10.0, "half_close": 8, "slow_s": 30.0, "min_rate_ratio": 0.6}
FAST = {"normal": 2, "normal_tokens": 48, "phase_s": 6.0, "alone": False, "vanish": 24, "vanish_tokens": 16,
        "stall": 2, "stall_tokens": 800, "stall_s": 3.0, "half_close": 3, "slow_s": 5.0, "min_rate_ratio": 0.5}
HEADLINE = ["rss_baseline_mib", "rss_fault_peak_mib", "rss_end_mib", "worker_rss_mib", "rate_baseline", "rate_fault",
            "rate_ratio", "stalled_cancelled", "vanished_connections", "slow_reader_bytes", "half_close",
            "lanes_busy_after", "5xx"]
RSS_SLACK_MIB = 64
RCVBUF = 4096  # a client that never reads: the kernel's receive buffer fills at once


def unavailable() -> str | None:
    return None


def _request(tokens: int, tag: str, stall: bool = False) -> bytes:
    """A streamed request, raw. ``stall``: a chat completion with ``top_logprobs: 20`` (about
    1.9 KB of SSE a token: the reply outgrows every buffer within some 150 tokens), ``agent``;
    else a plain completion, ``background``."""
    if stall:
        path, qos = b"/v1/chat/completions", b"agent"
        fields = {"messages": [{"role": "user", "content": f"[{tag}] Tell a long story."}], "logprobs": True,
                  "top_logprobs": 20}
    else:
        path, qos = b"/v1/completions", b"background"
        fields = {"prompt": f"[{tag}] Tell a long story:"}
    body = json.dumps({"model": MODEL_NAME, "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       **fields}).encode()
    return (b"POST %s HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
            b"x-superfluid-qos: %s\r\nContent-Length: %d\r\n\r\n" % (path, qos, len(body)) + body)


async def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: the window follows
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return sock


async def _open(port: int):
    return await asyncio.open_connection(sock=await _connect(port))


async def _never_read(port: int, data: bytes) -> socket.socket:
    """Send the request on a plain socket nothing will read (not an asyncio stream: its protocol
    would read up to 128 KiB into the client's memory first)."""
    sock = await _connect(port, RCVBUF)
    await asyncio.get_running_loop().sock_sendall(sock, data)
    return sock


async def _normal_phase(base: str, p: dict, tag: str) -> list[float]:
    """The normal clients' streams for phase_s seconds; each stream's tokens per second."""
    rates: list[float] = []
    end = time.monotonic() + p["phase_s"]

    async def client(i: int) -> None:
        async with aiohttp.ClientSession() as http:
            n = 0
            while time.monotonic() < end:
                instants: list[float] = []
                res = await stream(http, base + "/v1/completions",
                                   {"model": MODEL_NAME, "prompt": f"[{tag} {i} {n}] A note:",
                                    "max_tokens": p["normal_tokens"], "ignore_eos": True, "temperature": 0,
                                    "stream_options": {"include_usage": True}},
                                   headers={"x-superfluid-qos": "interactive"},
                                   on_chunk=lambda r: instants.append(time.monotonic()), timeout=300)
                n += 1
                if res.error or len(instants) < 2 or not res.usage:
                    raise RuntimeError(f"a normal stream failed: {res.error}")
                rates.append(res.usage["completion_tokens"] / (instants[-1] - res.sent))

    await asyncio.gather(*(client(i) for i in range(p["normal"])))
    return rates


class RssSampler:
    """The daemon's and its worker's RSS (MiB) every 0.5 s."""

    def __init__(self, pid: int, worker_pid: int | None):
        self.proc = psutil.Process(pid)
        self.worker = psutil.Process(worker_pid) if worker_pid else None
        self.samples: list[tuple[float, float, float | None]] = []
        self._task: asyncio.Task | None = None

    def _worker_rss(self) -> float | None:
        try:
            return self.worker.memory_info().rss / 2**20 if self.worker else None
        except psutil.NoSuchProcess:
            return None

    async def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.proc.memory_info().rss / 2**20, self._worker_rss()))
            await asyncio.sleep(0.5)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def peak(self, since: float = 0.0, worker: bool = False) -> float | None:
        vals = [w if worker else d for t, d, w in self.samples if t >= since and (w if worker else d) is not None]
        return max(vals) if vals else None


async def _slow_reader(port: int, p: dict) -> dict:
    reader, writer = await _open(port)
    writer.write(_request(64, "slow"))
    await writer.drain()
    got = b""
    end = time.monotonic() + p["slow_s"]
    while time.monotonic() < end:
        b = await reader.read(1)
        if not b:
            break
        got += b
        await asyncio.sleep(1.0)
    writer.close()
    return {"bytes": len(got), "well_formed": len(got) > 0 and (b"HTTP/1.1 200".startswith(got)
                                                             or got.startswith(b"HTTP/1.1 200"))}


async def _half_closer(port: int, i: int) -> str:
    reader, writer = await _open(port)
    writer.write(_request(16, f"half {i}"))
    await writer.drain()
    writer.write_eof()  # shutdown(SHUT_WR): nothing more will come from this client
    try:
        data = await asyncio.wait_for(reader.read(), 120)
    except (ConnectionError, asyncio.TimeoutError) as e:
        return f"closed ({type(e).__name__})"
    finally:
        writer.close()
    head = data.split(b"\r\n", 1)[0]
    if head.startswith(b"HTTP/1.1 5"):
        return "5xx"
    if head.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in data:
        return "whole"
    return "closed" if not data else f"other: {head[:40]!r}"


def _background_requests(p: dict, tag: str) -> list[bytes]:
    return [_request(p["stall_tokens"], f"{tag} {i}", stall=True) if i < p["stall"]
            else _request(p["vanish_tokens"], f"{tag} {i}") for i in range(p["stall"] + p["vanish"])]


async def _read_all(port: int, data: bytes) -> None:
    reader, writer = await _open(port)
    try:
        writer.write(data)
        while await reader.read(65536):
            pass
    finally:
        writer.close()


async def _drive(ctx: Ctx, srv, worker_pid: int | None, fig: dict) -> None:
    p, base, port = ctx.p, srv.base, srv.port
    sampler = RssSampler(srv.pid, worker_pid)
    sampler.start()
    await asyncio.sleep(1.0)
    fig["rss_start_mib"] = round(sampler.samples[0][1], 1)
    alone = await _normal_phase(base, p, "alone") if p["alone"] else []
    # control: the same background requests from clients that read their replies
    readers = [asyncio.create_task(_read_all(port, data)) for data in _background_requests(p, "control")]
    control = await _normal_phase(base, p, "control")
    for task in readers:
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    fig["rss_baseline_mib"] = round(sampler.peak(), 1)
    t_fault = time.monotonic()
    held = [await _never_read(port, data) for data in _background_requests(p, "fault")]  # open until the end
    try:
        side = [asyncio.create_task(_slow_reader(port, p))] + [
            asyncio.create_task(_half_closer(port, i)) for i in range(p["half_close"])]
        fault = await _normal_phase(base, p, "fault")
        side_results = await asyncio.gather(*side)
        fig["rss_fault_peak_mib"] = round(sampler.peak(t_fault), 1)
        # the stalled streams: their buffers fill, then the stall timeout ends them
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + p["stall_s"] + 120
            busy = queued = None
            while time.monotonic() < deadline:
                r = await call(http, "GET", base + "/slots", timeout=10)
                model = r.body["models"][MODEL_NAME]
                busy = sum(1 for s in model["slots"] if s.get("state") != "free")
                queued = len(model.get("queue") or [])
                if not busy and not queued:
                    break
                await asyncio.sleep(0.5)
            fig.update(lanes_busy_after=busy, queued_after=queued, freed_after_s=round(time.monotonic() - t_fault, 1))
    finally:
        for sock in held:
            sock.close()
    async with aiohttp.ClientSession() as http:
        after = await call(http, "POST", base + "/v1/completions",
                           {"model": MODEL_NAME, "prompt": "After:", "max_tokens": 4}, timeout=120)
        health = await call(http, "GET", base + "/health", timeout=10)
    await asyncio.sleep(1.0)
    await sampler.stop()
    fig["rss_end_mib"] = round(sampler.samples[-1][1], 1)
    w_before, w_peak = sampler.peak(worker=True), sampler.peak(t_fault, worker=True)
    fig["worker_rss_mib"] = {"peak_before": round(w_before, 1), "peak_fault": round(w_peak, 1)} \
        if w_before is not None and w_peak is not None else None
    slow, halves = side_results[0], side_results[1:]
    rc, rf = statistics.median(control), statistics.median(fault)
    fig.update(rate_alone=round(statistics.median(alone), 1) if alone else None, rate_baseline=round(rc, 1),
               rate_fault=round(rf, 1), rate_ratio=round(rf / rc, 2),
               streams_baseline=len(control), streams_fault=len(fault), vanished_connections=len(held),
               slow_reader_bytes=slow["bytes"], slow_reader_well_formed=slow["well_formed"],
               half_close={k: halves.count(k) for k in set(halves)}, after_ok=after.status == 200,
               healthy=health.status == 200)


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    srv = ctx.serve("--max-batch", "4", "--max-context", "4096", "--stream-stall-timeout", str(p["stall_s"]))
    with urllib.request.urlopen(srv.base + "/health", timeout=10) as r:
        worker_pid = json.loads(r.read())["models"][MODEL_NAME].get("worker_pid")
    fig: dict = {}
    asyncio.run(_drive(ctx, srv, worker_pid, fig))
    log = srv.log_text()
    lines = [ln for ln in log.splitlines() if "superfluid.access" in ln]
    fig["stalled_cancelled"] = log.count("(--stream-stall-timeout)")
    fig["stalled_logged_499"] = sum(1 for ln in lines if '" 499 ' in ln and "finish=stalled" in ln)
    fig["5xx"] = sum(1 for ln in lines if '" 5' in ln)
    checks = {
        "rss": fig["rss_fault_peak_mib"] <= fig["rss_baseline_mib"] + RSS_SLACK_MIB,
        "rate": fig["rate_ratio"] >= p["min_rate_ratio"],
        "stalled": fig["stalled_cancelled"] == fig["stalled_logged_499"] == p["stall"],
        "freed": fig["lanes_busy_after"] == 0 and fig["queued_after"] == 0,
        "slow_reader": fig["slow_reader_well_formed"] and fig["slow_reader_bytes"] > 0,
        "half_close": "5xx" not in fig["half_close"] and not any(k.startswith("other") for k in fig["half_close"]),
        "no_5xx": fig["5xx"] == 0,
        "after": fig["after_ok"] and fig["healthy"] and srv.alive(),
    }
    fig["checks"] = checks
    return Outcome(KEY, "superfluid", *verdict(
        all(checks.values()),
        f"RSS {fig['rss_baseline_mib']} -> {fig['rss_fault_peak_mib']} MiB peak; interactive streams at "
        f"{fig['rate_ratio']}x their baseline rate ({fig['rate_fault']} vs {fig['rate_baseline']} tok/s); "
        f"{fig['stalled_cancelled']}/{p['stall']} stalled streams cancelled, every lane free "
        f"{fig['freed_after_s']} s after; half-closed {fig['half_close']}",
        f"failed: {[k for k, v in checks.items() if not v]}"), fig)
