"""A fleet node cut off: three ``superfluid serve`` nodes, each in a network namespace of its own
behind a veth pair, the fleet head (``superfluid fleet --policy round_robin``) in front of them on
the host. One node (chosen by the seed) is cut off while streams run on it and new requests keep
arriving, healed, then put behind 500 ms of delay and 5 % loss, and healed again.

Phases, with a new request (a stream or a whole chat, seeded) every ``every_s`` seconds all along:

1. **baseline**;
2. **cut**: long streams are started until they run on every lane of the node (the ones that land
   elsewhere are left by the client at their first token) and, most often, one more waits in
   its queue; then every packet on its link is dropped, both ways: the ``blackhole`` qdisc on
   both veth ends. The links stay up, nothing sends an RST or a FIN, the node itself runs on;
3. **healed**: the qdiscs deleted;
4. **delay + loss**: 500 ms of delay and 5 % loss on the node's path;
5. **healed** again.

The full run holds each phase its length; the CI variant (``until_met``) ends a phase once it has
shown what it is there for (:func:`_phase_done`), its length then the most it lasts.

The deviation: this kernel has no ``sch_netem`` (nor iptables, nft, or a tc classifier that could
drop at random), so phase 4 is not ``tc netem``. The head reaches that node through a userspace
TCP relay (:class:`tools.chaos.netns.Relay`) during the whole run: a thread of the scenario that
joined the node's namespace (``setns``), listening on the node's address (port 8081) and
forwarding to the node (8080) over the namespace's loopback; a plain byte pipe outside phase 4.
The relay sits behind the veth, so the cut (phase 2, the kernel's) drops the head's packets to
it like any others. In phase 4 each chunk the node sends is held 500 ms, in order, a new
connection is answered 500 ms late, and a seeded 5 % of the chunks are "lost": TCP turns a lost
segment into a retransmission, so such a chunk, and every chunk behind it, arrives one
retransmission timeout (1 s) later still. That is netem on the node's egress, at the level of
the chunks a read returns rather than of packets; the head -> node direction is not delayed.

Measured, from the head's ``/health`` polled every 0.2 s: the **detection time** (the cut -> the
head calls the node ``unhealthy``; and -> SMG no longer routes to it), the **rejoin time** (a
heal -> healthy and routed again), the node's state changes under delay + loss. Per request: when
it was sent, the node that answered (SMG's ``x-smg-routed-worker-id``), its first token, its end
and how it ended: ``ok`` (200, whole; a stream ended by ``[DONE]``), ``error_event`` (a stream
ended by an SSE error event), ``http_NNN`` (an error answer with a JSON error body), ``broken``
(the connection ended with no error said: not a clear error) or ``hang`` (nothing ended it
within ``hang_s``). The timeline is written to ``fleet_partition.json`` and drawn to
``fleet_partition.png``; the head's own counts (streams moved, whole answers sent again) are in
the figures.

Pass: the head calls the cut node unhealthy within ``detect_bound_s``; every stream that had
started on it ends with an error event (or whole) within ``stream_bound_s`` of the cut; every
request not yet started there when it was cut (a stream without its first token, or any request
sent during the cut) completes elsewhere (200, whole); a whole chat in flight at the cut does
not wait for the heal on the cut node; after each heal the node is healthy and routed within
``rejoin_bound_s`` and answers requests again; under delay + loss every request completes or
fails clearly; nothing hangs, no connection ends without an error said; every process is alive
at the end; no namespace or link is left behind.

What it found (fixed in plugins/fleet/relay.py and proxy.py, tests/unit/test_fleet_node_lost.py):
a partitioned node's connections go silent instead of breaking, so the streams running on it,
the ones queued there, and the whole answers waiting on it hung until the heal (or SMG's TCP
timeout, about 45 s) even though the head had marked the node unhealthy after about 5 s."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass

import aiohttp

from tools.bench.client import STREAM_DONE, sse_events
from tools.suite.targets import Server, free_port

from .. import netns
from ..common import MODEL_NAME, Ctx, Outcome, verdict, wait_for

KEY, TITLE = "fleet_partition", "a fleet node cut off"
FAULT = ("one of three nodes behind `superfluid fleet` cut off (its packets dropped both ways, links up, the node "
         "running), healed; then 500 ms delay + 5 % loss on its path (a userspace relay: no sch_netem here), healed")
PASS = ("the head marks the cut node unhealthy within 10 s; its started streams end with an error event within 15 s, "
        "requests not started on it complete elsewhere (200); it rejoins within 15 s of each heal; under delay + loss "
        "every request completes or fails clearly; nothing hangs")
FULL = {"nodes": 3, "lanes": 2, "every_s": 0.7, "stream_share": 0.6, "baseline_s": 20, "cut_s": 40, "heal_s": 25,
        "impair_s": 60, "heal2_s": 25, "delay_s": 0.5, "loss": 0.05, "rto_s": 1.0, "long_tokens": 400,
        "hang_s": 90, "detect_bound_s": 10, "stream_bound_s": 15, "rejoin_bound_s": 15}
# until_met (the CI variant): a phase ends once what it is there to show has happened (see
# _phase_done), its length in seconds the most it lasts; the full run holds every phase its length
FAST = {"nodes": 3, "lanes": 2, "every_s": 0.7, "stream_share": 0.6, "baseline_s": 2, "cut_s": 14, "heal_s": 8,
        "impair_s": 10, "heal2_s": 6, "delay_s": 0.5, "loss": 0.05, "rto_s": 1.0, "long_tokens": 400,
        "hang_s": 60, "detect_bound_s": 10, "stream_bound_s": 15, "rejoin_bound_s": 15, "until_met": True}
HEADLINE = ["detect_s", "unrouted_s", "rejoin_s", "started_on_cut_node", "not_started_at_cut", "sent_during_cut",
            "moved", "impaired", "impaired_flaps", "rejoin2_s", "hangs", "unclear", "chart"]
PATH = "/v1/chat/completions"
TOPICS = ["a lighthouse", "a copper kettle", "the tide", "a violin maker", "a glacier", "a comet", "a harbor town",
          "a maple seed", "a night train", "a garden snail"]


def unavailable() -> str | None:
    import importlib.util
    if importlib.util.find_spec("smg") is None:
        return "the fleet head needs SMG: pip install 'superfluid[fleet]'"
    return netns.unavailable()


@dataclass
class Req:
    i: int
    kind: str  # stream | chat | long (a long stream, to be running on the node at the cut; dropped by
    # the client when it lands on another node)
    sent: float
    node: str | None = None
    first: float | None = None
    end: float | None = None
    status: int = 0
    outcome: str = ""
    error: str | None = None


class Run:
    """One run's clock, requests, node-state samples and events."""

    def __init__(self, ctx: Ctx, head: str, names: dict[str, str], cut: str):
        self.ctx, self.head, self.names, self.cut = ctx, head, names, cut
        self.t0 = time.monotonic()
        self.reqs: list[Req] = []
        self.samples: list[dict] = []  # {"t", name: [state, routed]}
        self.events: list[dict] = []
        self.tasks: set[asyncio.Task] = set()
        self.stop = False
        self.cut_at: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, what: str, **more) -> float:
        t = self.now()
        self.events.append({"t": round(t, 3), "event": what, **more})
        print(f"   fleet_partition: {t:7.2f} s {what} {more or ''}", file=sys.stderr, flush=True)
        return t

    # ---- requests ----------------------------------------------------------------------------
    def launch(self, http: aiohttp.ClientSession, kind: str) -> Req:
        rng = self.ctx.rng
        r = Req(len(self.reqs), kind, self.now())
        self.reqs.append(r)
        body = {"model": MODEL_NAME, "temperature": 0.7, "seed": r.i,
                "messages": [{"role": "user", "content": f"({r.i}) Tell me about {rng.choice(TOPICS)}."}]}
        if kind == "long":
            body.update(max_tokens=self.ctx.p["long_tokens"], ignore_eos=True, stream=True)
        elif kind == "stream":
            body.update(max_tokens=rng.randint(24, 64), stream=True)
        else:
            body.update(max_tokens=rng.randint(8, 24))
        task = asyncio.create_task(self._one(http, r, body))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return r

    async def _one(self, http: aiohttp.ClientSession, r: Req, body: dict) -> None:
        try:
            async with http.post(self.head + PATH, json=body,
                                 timeout=aiohttp.ClientTimeout(total=self.ctx.p["hang_s"])) as resp:
                r.status = resp.status
                r.node = self.names.get(resp.headers.get("x-smg-routed-worker-id", ""), None)
                if resp.status != 200 or not body.get("stream"):
                    raw = await resp.read()
                    try:
                        data = json.loads(raw)
                    except ValueError:
                        data = None
                    if resp.status == 200 and isinstance(data, dict) and data.get("choices"):
                        r.outcome = "ok"
                        r.first = self.now()
                    elif isinstance(data, dict) and isinstance(data.get("error"), dict):
                        r.outcome, r.error = f"http_{resp.status}", str(data["error"].get("message"))[:300]
                    else:
                        r.outcome, r.error = "broken", f"HTTP {resp.status}: {raw[:200]!r}"
                    return
                done = False
                async for event in sse_events(resp.content):
                    if event is STREAM_DONE:
                        done = True
                        break
                    if event.get("error"):
                        err = event["error"]
                        r.error = str(err.get("message") if isinstance(err, dict) else err)[:300]
                        continue
                    if r.first is None and any((c.get("delta") or {}).get("content")
                                               for c in event.get("choices") or [] if isinstance(c, dict)):
                        r.first = self.now()
                        if r.kind == "long" and r.node != self.cut and self.cut_at is None:
                            r.outcome = "dropped"  # only the one on the node to cut is needed:
                            return  # the client leaves the others (to spare the lanes)
                r.outcome = "error_event" if r.error else "ok" if done else "broken"
                if r.outcome == "broken":
                    r.error = "the stream ended without [DONE] or an error event"
        except asyncio.TimeoutError:
            r.outcome, r.error = "hang", f"no end within {self.ctx.p['hang_s']} s"
        except (aiohttp.ClientError, ConnectionError) as e:
            r.outcome, r.error = "broken", f"{type(e).__name__}: {e}"[:300]
        finally:
            r.end = self.now()

    async def traffic(self, http: aiohttp.ClientSession) -> None:
        p, rng = self.ctx.p, self.ctx.rng
        while not self.stop:
            self.launch(http, "stream" if rng.random() < p["stream_share"] else "chat")
            await asyncio.sleep(p["every_s"])

    # ---- the head's view -----------------------------------------------------------------------
    async def monitor(self, http: aiohttp.ClientSession) -> None:
        while not self.stop:
            t = self.now()
            row: dict = {"t": round(t, 3)}
            try:
                async with http.get(self.head + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    body = await resp.json(content_type=None)
                for url, n in (body.get("nodes") or {}).items():
                    if url in self.names:
                        row[self.names[url]] = [n.get("state"), bool(n.get("routed"))]
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            self.samples.append(row)
            await asyncio.sleep(max(0.0, 0.2 - (self.now() - t)))

    def first_sample(self, after: float, check) -> float | None:
        for s in self.samples:
            if s["t"] >= after and check(s):
                return round(s["t"] - after, 2)
        return None


async def _node_busy(http: aiohttp.ClientSession, base: str) -> tuple[int, int]:
    """(lanes busy, queued) on a node, asked directly (not through the relay)."""
    try:
        async with http.get(base + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            models = (await resp.json(content_type=None)).get("models") or {}
        return (sum(int(m.get("lanes_busy") or 0) for m in models.values()),
                sum(int(m.get("queued") or 0) for m in models.values()))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return 0, 0


def _phase_done(run: Run, phase: str, start: float) -> bool:
    """What a phase of the CI variant must have shown before it may end early (``until_met``):
    what judge() checks of it, measured the same way.

    * ``cut``: the head has called the node unhealthy and stopped routing to it (2 s of samples
      since), every request sent before that has ended or is streaming from another node (the
      streams running on it, those waiting in its queue, the whole chats in flight), and at least
      6 requests were sent during the cut;
    * ``heal``, ``heal2``: the node is healthy and routed again, and a request sent since answered
      whole from it;
    * ``impair``: 2 requests sent to the impaired node since the impairment have ended."""
    xn, now = run.cut, run.now()
    since = [r for r in run.reqs if r.sent >= start]
    if phase == "cut":
        gone = run.first_sample(start, lambda s: (s.get(xn) or [None, None])[0] == "unhealthy")
        unrouted = run.first_sample(start, lambda s: (s.get(xn) or [None, True])[1] is False)
        if gone is None or unrouted is None:
            return False
        seen = start + max(gone, unrouted)
        return (now >= seen + 2 and len(since) >= 6
                and all(r.end is not None or (r.first is not None and r.node != xn)
                        for r in run.reqs if r.sent <= seen + 0.5))
    if phase in ("heal", "heal2"):
        back = run.first_sample(start, lambda s: (s.get(xn) or [None, None]) == ["healthy", True])
        return back is not None and any(r.node == xn and r.outcome == "ok" for r in since)
    if phase == "impair":
        return sum(1 for r in since if r.node == xn and r.end is not None) >= 2
    return True


async def _hold(run: Run, p: dict, phase: str, seconds: float, start: float) -> None:
    """Hold a phase ``seconds``; in the CI variant (``until_met``) only until it has shown what it
    is there to show (polled every 0.2 s), ``seconds`` at most."""
    if not p.get("until_met"):
        await asyncio.sleep(seconds)
        return
    end = time.monotonic() + seconds
    while time.monotonic() < end and not _phase_done(run, phase, start):
        await asyncio.sleep(0.2)


async def _drive(ctx: Ctx, run: Run, net: netns.Net, relay: netns.Relay, x: int, x_direct: str) -> dict:
    p = ctx.p
    xn = f"node{x}"
    marks: dict = {}
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        mon = asyncio.create_task(run.monitor(http))
        gen = asyncio.create_task(run.traffic(http))
        run.event("baseline")
        await asyncio.sleep(p["baseline_s"])

        # seat long streams on every lane of the node to be cut, then wait for one in its queue
        longs: list[Req] = []
        deadline, seated = time.monotonic() + 40, None
        while time.monotonic() < deadline:
            running = sum(1 for r in longs if r.node == xn and r.first is not None and r.end is None)
            if running >= p["lanes"] or seated and running:
                seated = seated or time.monotonic()
                busy, queued = await _node_busy(http, x_direct)
                if queued >= 1 or time.monotonic() - seated > 8:
                    break  # running there, and (most often) one waiting in its queue
            if sum(1 for r in longs if r.first is None and r.end is None) < p["nodes"]:
                longs.append(run.launch(http, "long"))  # round robin: one in three lands there
            await asyncio.sleep(0.2)
        busy, queued = await _node_busy(http, x_direct)
        marks["at_cut"] = {"lanes_busy": busy, "queued": queued}
        await asyncio.to_thread(net.cut, x)
        marks["cut"] = run.cut_at = run.event("cut", node=xn, lanes_busy=busy, queued=queued)
        await _hold(run, p, "cut", p["cut_s"], marks["cut"])
        marks["dropped"] = await asyncio.to_thread(net.dropped, x)
        marks["link_up_during_cut"] = await asyncio.to_thread(net.link_up, x)
        await asyncio.to_thread(net.heal, x)
        marks["heal"] = run.event("heal", node=xn, packets_dropped=marks["dropped"])
        await _hold(run, p, "heal", p["heal_s"], marks["heal"])

        relay.impair(p["delay_s"], p["loss"], p["rto_s"])
        marks["impair"] = run.event("delay+loss", node=xn, delay_s=p["delay_s"], loss=p["loss"])
        await _hold(run, p, "impair", p["impair_s"], marks["impair"])
        relay.clear()
        marks["heal2"] = run.event("heal", node=xn)
        await _hold(run, p, "heal2", p["heal2_s"], marks["heal2"])
        run.stop = True
        await gen
        marks["traffic_end"] = run.event("traffic stops")
        if run.tasks:  # every request ends by hang_s at the latest (its client timeout)
            await asyncio.wait(set(run.tasks), timeout=p["hang_s"] + 10)
        marks["end"] = run.event("all requests ended" if not run.tasks else f"{len(run.tasks)} still running")
        await mon
        try:
            async with http.get(run.head + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                text = await resp.text()
            marks["head_errors"] = {line.split('kind="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                                    for line in text.splitlines()
                                    if line.startswith("superfluid_fleet_errors_total{")}
        except (aiohttp.ClientError, asyncio.TimeoutError, IndexError, ValueError):
            marks["head_errors"] = None
    return marks


def _tally(reqs: list[Req]) -> dict:
    out: dict = {}
    for r in reqs:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return out


def _by_node(reqs: list[Req]) -> dict:
    out: dict = {}
    for r in reqs:
        out[r.node or "none"] = out.get(r.node or "none", 0) + 1
    return dict(sorted(out.items()))


def judge(run: Run, marks: dict, x: int, p: dict) -> tuple[dict, list[str]]:
    """The figures and what broke the pass condition."""
    xn = f"node{x}"
    t_cut, t_heal, t_imp, t_heal2 = marks["cut"], marks["heal"], marks["impair"], marks["heal2"]
    reqs = run.reqs
    broken: list[str] = []
    fig: dict = {"cut_node": xn, "requests": len(reqs), "outcomes": _tally(reqs), "at_cut": marks.get("at_cut")}

    # detection
    state = lambda s: (s.get(xn) or [None, None])  # noqa: E731
    fig["detect_s"] = run.first_sample(t_cut, lambda s: state(s)[0] == "unhealthy")
    fig["unrouted_s"] = run.first_sample(t_cut, lambda s: state(s)[1] is False)
    if fig["detect_s"] is None or fig["detect_s"] > p["detect_bound_s"]:
        broken.append(f"the head did not mark {xn} unhealthy within {p['detect_bound_s']} s of the cut "
                      f"({fig['detect_s']})")
    cut_states = [state(s)[0] for s in run.samples if fig["detect_s"] is not None and
                  t_cut + fig["detect_s"] <= s["t"] < t_heal]
    if any(st != "unhealthy" for st in cut_states):
        broken.append(f"{xn} was called {sorted(set(cut_states))} while cut off")

    # streams running on the node at the cut
    started = [r for r in reqs if r.kind != "chat" and r.node == xn and r.first is not None and r.first < t_cut
               and (r.end is None or r.end > t_cut)]
    fig["started_on_cut_node"] = {"n": len(started), "outcomes": _tally(started),
                                  "ended_after_cut_s": [None if r.end is None else round(r.end - t_cut, 2)
                                                        for r in started]}
    if not started:
        broken.append(f"no stream was running on {xn} at the cut: the started-stream case did not happen")
    for r in started:
        if r.outcome not in ("error_event", "ok") or r.end is None or r.end - t_cut > p["stream_bound_s"]:
            broken.append(f"stream {r.i} started on {xn} ended {r.outcome} "
                          f"{None if r.end is None else round(r.end - t_cut, 1)} s after the cut: {r.error}")

    # requests not started on it: streams without a first token at the cut, and all sent during it
    waiting = [r for r in reqs if r.kind != "chat" and r.sent < t_cut and (r.first is None or r.first >= t_cut)
               and (r.end is None or r.end > t_cut)]
    during = [r for r in reqs if t_cut <= r.sent < t_heal]
    fig["not_started_at_cut"] = {"n": len(waiting), "outcomes": _tally(waiting), "nodes": _by_node(waiting)}
    fig["sent_during_cut"] = {"n": len(during), "outcomes": _tally(during), "nodes": _by_node(during),
                              "slowest_s": max((round(r.end - r.sent, 2) for r in during if r.end), default=None)}
    for r in waiting + during:
        if r.outcome != "ok" or r.node == xn:
            broken.append(f"request {r.i} ({r.kind}, sent {r.sent - t_cut:+.1f} s from the cut) ended {r.outcome} "
                          f"on {r.node}: {r.error}")
    chats = [r for r in reqs if r.kind == "chat" and r.sent < t_cut and r.end is not None and r.end > t_cut]
    fig["chats_in_flight_at_cut"] = {"n": len(chats), "outcomes": _tally(chats), "nodes": _by_node(chats)}
    for r in chats:  # started or not (a whole answer says nothing until it ends): whole or a clear error,
        if r.outcome in ("hang", "broken"):  # and not a wait for the heal on the cut node
            broken.append(f"chat {r.i} in flight at the cut ended {r.outcome}: {r.error}")
        elif r.node == xn and r.end is not None and r.end > t_cut + p["stream_bound_s"]:
            broken.append(f"chat {r.i} in flight at the cut waited {r.end - t_cut:.1f} s for {xn}")

    # rejoin after each heal
    back = lambda s: state(s) == ["healthy", True]  # noqa: E731
    fig["rejoin_s"] = run.first_sample(t_heal, back)
    served = [r for r in reqs if r.node == xn and r.outcome == "ok" and t_heal <= r.sent < t_imp]
    fig["served_after_heal"] = len(served)
    if fig["rejoin_s"] is None or fig["rejoin_s"] > p["rejoin_bound_s"] or not served:
        broken.append(f"{xn} did not rejoin after the heal: healthy and routed after {fig['rejoin_s']} s, "
                      f"{len(served)} requests served")

    # delay + loss
    imp = [r for r in reqs if t_imp <= r.sent < t_heal2]
    lat = lambda rs: statistics.median([r.end - r.sent for r in rs if r.end]) if rs else None  # noqa: E731
    on_x, elsewhere = [r for r in imp if r.node == xn], [r for r in imp if r.node != xn]
    imp_states = [state(s) for s in run.samples if t_imp <= s["t"] < t_heal2]
    flaps = sum(1 for a, b in zip(imp_states, imp_states[1:]) if a[0] != b[0])
    fig["impaired"] = {"n": len(imp), "outcomes": _tally(imp), "nodes": _by_node(imp),
                       "median_s_on_node": None if not on_x else round(lat(on_x), 2),
                       "median_s_elsewhere": None if not elsewhere else round(lat(elsewhere), 2),
                       "chunks_delayed": marks.get("relay_chunks"), "chunks_lost": marks.get("relay_lost"),
                       "states": sorted({s[0] for s in imp_states if s[0]})}
    fig["impaired_flaps"] = flaps
    for r in imp:
        if r.outcome in ("hang", "broken"):
            broken.append(f"request {r.i} under delay+loss ended {r.outcome} on {r.node}: {r.error}")

    # after the second heal
    last = [state(s) for s in run.samples if s["t"] >= t_heal2]
    fig["rejoin2_s"] = run.first_sample(t_heal2, back)
    served2 = [r for r in reqs if r.node == xn and r.outcome == "ok" and r.sent >= t_heal2]
    fig["served_after_heal2"] = len(served2)
    if fig["rejoin2_s"] is None or fig["rejoin2_s"] > p["rejoin_bound_s"] or not served2 or \
            (last and last[-1] != ["healthy", True]):
        broken.append(f"{xn} did not rejoin after the second heal: healthy and routed after {fig['rejoin2_s']} s, "
                      f"{len(served2)} requests served, last state {last[-1] if last else None}")

    # nothing hangs, nothing ends unclearly, anywhere in the run
    fig["hangs"] = sum(1 for r in reqs if r.outcome == "hang" or r.end is None)
    fig["unclear"] = sum(1 for r in reqs if r.outcome == "broken")
    if fig["hangs"] or fig["unclear"]:
        broken.append(f"{fig['hangs']} requests hung, {fig['unclear']} ended without an error said")
    base = [r for r in reqs if r.sent < t_cut and r.end is not None and r.end <= t_cut]
    fig["baseline"] = {"n": len(base), "outcomes": _tally(base), "nodes": _by_node(base)}
    fig["head_errors"] = marks.get("head_errors")
    errs = marks.get("head_errors") or {}
    fig["moved"] = {"streams": int(errs.get("stream_moved", 0)), "whole_resent": int(errs.get("whole_resent", 0))}
    fig["packets_dropped"] = marks.get("dropped")
    fig["link_up_during_cut"] = marks.get("link_up_during_cut")
    fig["phases_s"] = {k: round(marks[k], 2) for k in ("cut", "heal", "impair", "heal2", "traffic_end", "end")}
    return fig, broken


COLOURS = ["#3b7dd8", "#2a9d5c", "#9b59b6"]
STATE_COLOURS = {"healthy": "#6cc46c", "unhealthy": "#e05050", "unknown": "#c7c7c7", "unrouted": "#f0c040"}
ENDS = {"error_event": ("x", "crimson", "stream ended by an error event"),
        "http": ("s", "darkorange", "error answer (JSON error body)"),
        "broken": ("X", "black", "ended with no error said"), "hang": ("X", "black", "hung"),
        "dropped": (".", "grey", "spare long stream, left by the client")}


def chart(run: Run, marks: dict, x: int, fig: dict, path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    names = sorted(set(run.names.values()))
    f, (top, ax) = plt.subplots(2, 1, figsize=(11, 8.5), sharex=True, gridspec_kw={"height_ratios": [1, 5]})
    # the head's view of each node
    for row, name in enumerate(names):
        segs: dict[str, list] = {}
        for a, b in zip(run.samples, run.samples[1:]):
            st = a.get(name)
            if not st:
                continue
            key = "unrouted" if st[0] == "healthy" and not st[1] else st[0] or "unknown"
            segs.setdefault(key, []).append((a["t"], b["t"] - a["t"]))
        for key, spans in segs.items():
            top.broken_barh(spans, (row - 0.35, 0.7), color=STATE_COLOURS.get(key, "#888"), linewidth=0)
    top.set_yticks(range(len(names)))
    top.set_yticklabels([f"{n} (cut)" if n == f"node{x}" else n for n in names])
    top.invert_yaxis()
    top.set_title("the head's view of each node (/health, every 0.2 s)", fontsize=9)
    top.legend(handles=[Patch(color=STATE_COLOURS[k], label=lbl) for k, lbl in
                        (("healthy", "healthy, routed"), ("unrouted", "healthy, not routed yet"),
                         ("unhealthy", "unhealthy"))], loc="upper left", fontsize=7, ncol=3)
    # one point per request: when it was sent, how long until it ended; its colour the node that
    # answered, its shape its kind; how it ended when not whole
    from matplotlib.lines import Line2D
    seen: set = set()
    handles = [Patch(color=COLOURS[i % len(COLOURS)], label=f"answered by {n}") for i, n in enumerate(names)]
    handles += [Line2D([], [], marker=m, color="grey", linestyle="none", label=lbl)
                for m, lbl in (("o", "stream"), ("s", "whole chat"), ("^", "long stream (seated on the node to cut)"))]
    for r in run.reqs:
        end = r.end if r.end is not None else run.now()
        colour = COLOURS[int(r.node[4:]) % len(COLOURS)] if r.node else "#999999"
        key = "http" if r.outcome.startswith("http_") else r.outcome
        if key == "dropped":
            continue
        shape = {"chat": "s", "long": "^"}.get(r.kind, "o")
        ax.plot([r.sent], [max(end - r.sent, 0.05)], marker=shape, color=colour,
                markersize=4 if r.kind != "long" else 7, linestyle="none", alpha=0.8)
        if key in ENDS:
            m, c, lbl = ENDS[key]
            (h,) = ax.plot([r.sent], [max(end - r.sent, 0.05)], marker=m, color=c, markersize=9, linestyle="none",
                           label=lbl)
            if key not in seen:
                handles.append(h)
            seen.add(key)
    for a in (top, ax):
        a.axvspan(marks["cut"], marks["heal"], color="#e05050", alpha=0.08)
        a.axvspan(marks["impair"], marks["heal2"], color="#9b59b6", alpha=0.08)
        for t, style, c in ((marks["cut"], "-", "crimson"), (marks["heal"], "-", "green"),
                            (marks["impair"], "-", "purple"), (marks["heal2"], "--", "green")):
            a.axvline(t, linestyle=style, color=c, linewidth=1)
    for t, text in ((marks["cut"], f"cut node{x} off"), (marks["heal"], "heal"),
                    (marks["impair"], f"{run.ctx.p['delay_s'] * 1000:.0f} ms + {run.ctx.p['loss'] * 100:.0f} % loss"),
                    (marks["heal2"], "heal")):
        ax.text(t + 0.5, 0.01, text, fontsize=8, va="bottom", transform=ax.get_xaxis_transform())
    cut_errs = [r for r in run.reqs if r.outcome == "error_event" and r.node == f"node{x}" and r.end is not None]
    if cut_errs:
        r0 = max(cut_errs, key=lambda r: r.end - r.sent)
        ax.annotate(f"{len(cut_errs)} stream(s) running on node{x}: error event "
                    f"{r0.end - marks['cut']:.1f} s after the cut",
                    xy=(r0.sent, r0.end - r0.sent), xytext=(r0.sent + 8, 0.95), textcoords=("data", "axes fraction"),
                    fontsize=8,
                    color="crimson", arrowprops={"arrowstyle": "-", "color": "crimson", "lw": 0.8})
    from matplotlib.ticker import NullFormatter
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    ticks = [v for v in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= v <= hi]
    ax.set_yticks(ticks, [f"{v:g}" for v in ticks])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("seconds from sent to its end (log)")
    ax.set_xlabel("seconds since the start of the traffic (when each request was sent)")
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=2)
    f.suptitle(f"superfluid fleet: node{x} of {len(names)} cut off, healed, then 500 ms delay + 5 % loss (relay) — "
               f"unhealthy {fig.get('detect_s')} s after the cut, back {fig.get('rejoin_s')} s after the heal",
               fontsize=10)
    f.tight_layout()
    f.savefig(path, dpi=100)
    plt.close(f)
    return str(path)


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    net = netns.Net()
    ctx.on_cleanup(net.delete)  # after the servers: their namespaces are empty by then
    x = ctx.rng.randrange(p["nodes"])
    addrs = [net.add(i) for i in range(p["nodes"])]
    port = 8080  # each node in a namespace of its own
    # the head reaches the cut node through a relay in its namespace (phase 4), across the veth
    relay = netns.Relay((addrs[x], port), ctx.seed, listen=(addrs[x], port + 1), ns=net.ns(x))
    relay.start()
    ctx.on_cleanup(relay.stop)
    # --insecure: a namespace's address is reachable from this host only (no key policy needed)
    flags = ["--max-batch", str(p["lanes"]), "--max-context", "1024", "--threads", "1", "--no-os-pressure",
             "--insecure"]
    with concurrent.futures.ThreadPoolExecutor(p["nodes"]) as pool:  # the nodes load at once
        futures = [pool.submit(ctx.serve, *flags, name=f"node{i}", netns=net.ns(i), host=a, port=port)
                   for i, a in enumerate(addrs)]
        nodes = [f.result() for f in futures]  # ctx.close stops the ones that started if one failed
    urls = [f"http://{addrs[x]}:{relay.port}" if i == x else n.base for i, n in enumerate(nodes)]
    names = {u: f"node{i}" for i, u in enumerate(urls)}
    hport = free_port()
    cmd = [sys.executable, "-m", "superfluid.core.cli", "fleet", "--host", "127.0.0.1", "--port", str(hport),
           "--policy", "round_robin", *[a for u in urls for a in ("--node", u)]]
    log = ctx.log_path("head")
    log.write_bytes(b"")
    head = Server("fleet", cmd, log, "/health", startup_timeout=60)
    ctx.servers.append(head)
    r = Run(ctx, head.base, names, f"node{x}")

    def all_routed():
        try:
            with urllib.request.urlopen(head.base + "/health", timeout=2) as resp:
                nodes_view = json.loads(resp.read()).get("nodes") or {}
            return all(v.get("state") == "healthy" and v.get("routed") for v in nodes_view.values())
        except (OSError, ValueError):
            return False

    if not wait_for(all_routed, 30, 0.2):
        return Outcome(KEY, "superfluid", "error", "the head did not route to all three nodes within 30 s")
    marks = asyncio.run(_drive(ctx, r, net, relay, x, nodes[x].base))
    marks["relay_chunks"], marks["relay_lost"] = relay.chunks, relay.lost
    fig, broken = judge(r, marks, x, p)
    fig["alive"] = {**{f"node{i}": n.alive() for i, n in enumerate(nodes)}, "head": head.alive()}
    if not all(fig["alive"].values()):
        broken.append(f"a process died: {fig['alive']}")
    fig["head_log_warnings"] = [line[-240:] for line in head.log_text().splitlines() if "WARNING" in line][:12]
    (ctx.out_dir / "fleet_partition.json").write_text(json.dumps(
        {"cut_node": f"node{x}", "urls": names, "params": p, "events": r.events, "states": r.samples,
         "requests": [asdict(q) for q in r.reqs], "figures": fig}, default=str))
    fig["chart"] = chart(r, marks, x, fig, ctx.out_dir / "fleet_partition.png")
    # everything made must go when the run ends: stop the nodes now, delete, and look
    for srv in reversed(ctx.servers):
        srv.stop()
    relay.stop()
    net.delete()
    left = net.leftovers()
    fig["left_behind"] = left
    if left:
        broken.append(f"left behind: {left}")
    v, why = verdict(not broken,
                     f"node{x} cut: unhealthy after {fig['detect_s']} s; {fig['started_on_cut_node']['n']} started "
                     f"streams ended {fig['started_on_cut_node']['outcomes']}, "
                     f"{fig['not_started_at_cut']['n'] + fig['sent_during_cut']['n']} not started there completed "
                     f"elsewhere; rejoined {fig['rejoin_s']} s after the heal; under 500 ms + 5 % loss (relay, not "
                     f"netem) {fig['impaired']['outcomes']}; rejoined {fig['rejoin2_s']} s after; nothing hung",
                     "; ".join(broken[:6]))
    return Outcome(KEY, "superfluid", v, why, fig)
