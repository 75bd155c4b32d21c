"""Slow and vanishing readers: clients that read a stream one byte a second, stop reading without
closing, or half-close their side, beside people whose streams must not notice.

Three phases on one server (``--max-batch 4``, ``--stream-stall-timeout stall_s``), each with
``normal`` clients (the ``interactive`` class) streaming ``normal_tokens``-token completions back
to back for ``phase_s`` seconds; a stream's rate is its tokens over the time from its send to its
last delta:

1. **Alone**: only the normal clients.
2. **Control**: beside them, the background requests of phase 3 from clients that read their
   replies.
3. **Faults**: the same background requests, from clients that misbehave:

   * ``vanish`` clients (``background``) send a streamed request of ``vanish_tokens`` tokens and
     never read, with a 4 KiB receive buffer, holding the connection open: short replies end up
     whole in the kernel's buffers, the lane done;
   * ``stall`` of them (``agent``) ask ``stall_tokens`` tokens with ``logprobs`` (about 1 KB a
     token), more than the buffers hold: the server's write waits, and after
     ``--stream-stall-timeout`` the stream is closed and the lane cancelled (plugins/http/stall.py);
   * one client reads its stream one byte a second for ``slow_s`` seconds, then closes;
   * ``half_close`` clients send their request and shut down their sending side at once
     (``shutdown(SHUT_WR)``), then read the reply.

Sampled every 0.5 s: the daemon's RSS. Pass: the daemon's RSS in the fault phase stays within
64 MiB of its peak before; the normal streams' median token rate is at least ``min_rate_ratio``
of the control's (the same work for the server, read or not); every stalled stream was cancelled
(the log's warnings: at least one; a stalled client's reply that the kernel's buffers took whole
ends 200 instead, and the figures count both) and every lane is free afterwards, the queue
empty; the slow reader got the start of a well-formed stream; every half-closed request got a
whole reply or a closed connection (aiohttp takes a half-close for a client gone: the request is
cancelled, 499), never a 5xx; the server answers afterwards."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time

import aiohttp
import psutil

from tools.suite.common import call, stream

from ..common import MODEL_NAME, Ctx, Outcome, verdict

KEY, TITLE = "slow_readers", "slow and vanishing readers"
FAULT = ("clients that never read (200, 4 KiB receive buffers), one that reads a byte a second, and clients that "
         "half-close, beside interactive streams")
PASS = ("daemon RSS within 64 MiB of its baseline; the interactive streams' token rate within the stated ratio of "
        "a run without them; stalled streams cancelled after --stream-stall-timeout, every lane free after; no 5xx")
FULL = {"normal": 2, "normal_tokens": 96, "phase_s": 40.0, "vanish": 200, "vanish_tokens": 24, "stall": 4,
        "stall_tokens": 1500, "stall_s": 10.0, "half_close": 8, "slow_s": 30.0, "min_rate_ratio": 0.6}
FAST = {"normal": 2, "normal_tokens": 48, "phase_s": 12.0, "vanish": 24, "vanish_tokens": 16, "stall": 2,
        "stall_tokens": 1500, "stall_s": 3.0, "half_close": 3, "slow_s": 6.0, "min_rate_ratio": 0.5}
HEADLINE = ["rss_baseline_mib", "rss_fault_peak_mib", "rate_baseline", "rate_fault", "rate_ratio", "stalled_cancelled",
            "vanished_connections", "slow_reader_bytes", "half_close", "lanes_busy_after", "5xx"]
RSS_SLACK_MIB = 64


def unavailable() -> str | None:
    return None


def _request(tokens: int, tag: str, logprobs: bool = False, qos: str = "background") -> bytes:
    fields = {"model": MODEL_NAME, "prompt": f"[{tag}] Tell a long story:", "max_tokens": tokens,
              "ignore_eos": True, "stream": True}
    if logprobs:
        fields["logprobs"] = 5  # about 1 KB a token: the reply outgrows the socket's buffers
    body = json.dumps(fields).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
            b"x-superfluid-qos: %s\r\nContent-Length: %d\r\n\r\n" % (qos.encode(), len(body)) + body)


async def _open(port: int, rcvbuf: int | None = None):
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock)


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
    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), self.proc.memory_info().rss / 2**20))
            await asyncio.sleep(0.5)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def peak(self, since: float = 0.0) -> float:
        return max(v for t, v in self.samples if t >= since)


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


async def _background(port: int, p: dict, read: bool, tag: str) -> list:
    """The vanishing and stalling clients' requests. ``read``: the control run, the same requests
    from clients that read their replies (tasks); else the writers of connections never read."""
    out = []
    for i in range(p["vanish"] + p["stall"]):
        stall = i < p["stall"]
        tokens = p["stall_tokens"] if stall else p["vanish_tokens"]
        reader, writer = await _open(port, rcvbuf=None if read else 4096)
        writer.write(_request(tokens, f"{tag} {i}", logprobs=stall, qos="agent" if stall else "background"))
        out.append(asyncio.create_task(_read_all(reader, writer)) if read else writer)
    return out


async def _read_all(reader, writer) -> None:
    try:
        while await reader.read(65536):
            pass
    finally:
        writer.close()


async def _drive(ctx: Ctx, srv, fig: dict) -> None:
    p, base, port = ctx.p, srv.base, srv.port
    sampler = RssSampler(srv.pid)
    sampler.start()
    await asyncio.sleep(1.0)
    baseline = await _normal_phase(base, p, "base")
    fig["rss_baseline_mib"] = round(sampler.peak(), 1)
    # control: the same background requests from clients that read their replies
    readers = await _background(port, p, read=True, tag="control")
    control = await _normal_phase(base, p, "control")
    for task in readers:
        task.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
    t_fault = time.monotonic()
    held = await _background(port, p, read=False, tag="fault")  # open and unread until the phase ends
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
        for w in held:
            w.close()
        after = await call(http, "POST", base + "/v1/completions",
                           {"model": MODEL_NAME, "prompt": "After:", "max_tokens": 4}, timeout=120)
        health = await call(http, "GET", base + "/health", timeout=10)
    await sampler.stop()
    fig["rss_end_mib"] = round(sampler.samples[-1][1], 1)
    slow, halves = side_results[0], side_results[1:]
    rb, rc, rf = statistics.median(baseline), statistics.median(control), statistics.median(fault)
    fig.update(rate_alone=round(rb, 1), rate_baseline=round(rc, 1), rate_fault=round(rf, 1),
               rate_ratio=round(rf / rc, 2),
               streams_baseline=len(baseline), streams_fault=len(fault), vanished_connections=len(held),
               slow_reader_bytes=slow["bytes"], slow_reader_well_formed=slow["well_formed"],
               half_close={k: halves.count(k) for k in set(halves)}, after_ok=after.status == 200,
               healthy=health.status == 200)


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    srv = ctx.serve("--max-batch", "4", "--max-context", "4096", "--stream-stall-timeout", str(p["stall_s"]))
    fig: dict = {}
    asyncio.run(_drive(ctx, srv, fig))
    log = srv.log_text()
    fig["stalled_cancelled"] = log.count("(--stream-stall-timeout)")
    fig["stall_clients_whole"] = sum(1 for ln in log.splitlines() if "qos=agent" in ln and '" 200 ' in ln
                                     and f"completion={p['stall_tokens']} " in ln)
    fig["5xx"] = sum(1 for ln in log.splitlines() if '" 5' in ln and "superfluid.access" in ln)
    checks = {
        "rss": fig["rss_fault_peak_mib"] <= fig["rss_baseline_mib"] + RSS_SLACK_MIB,
        "rate": fig["rate_ratio"] >= p["min_rate_ratio"],
        "stalled": fig["stalled_cancelled"] >= 1,  # the guard acted (all of them, in most runs)
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
        f"{fig['stalled_cancelled']} stalled streams cancelled, every lane free {fig['freed_after_s']} s after; "
        f"half-closed {fig['half_close']}",
        f"failed: {[k for k, v in checks.items() if not v]}"), fig)
