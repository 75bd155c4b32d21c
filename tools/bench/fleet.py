"""The fleet bench: three ``superfluid serve`` nodes on loopback ports behind ``superfluid fleet``,
and the things issue 20 asks the head to show, measured:

0. **refusals**: ``superfluid fleet`` with each local-scheduler flag: exit status and message.
1. **affinity**: 48 chats over 4 shared ~1k-token system prompts; the prefill tokens summed over
   the nodes' ``superfluid_prefill_tokens_total`` under ``cache_aware`` and under
   ``round_robin`` (fresh nodes for each, so caches start cold). Goal: ratio <= 0.5.
2. **kill**: a burst of chats (half streamed); one node is SIGKILLed (its process group) while it
   has requests running. Counts sent / completed / failed (with each error) / lost (no answer in
   the timeout: a hang), the time until the head's /health calls the node unhealthy, probes sent
   after the kill, and the node's rejoin (its request counter rises after a restart).
3. **qos**: 8 agent chats with long prompts, spread over the fleet, prefill; an interactive chat
   (body ``superfluid: {"qos": "interactive"}``) is sent through the head and timed to its first
   token; the same chat as class ``agent`` is the peer in the same run. Goal: <= 1 s.
4. **overhead**: one small chat sent N times, sequentially, to a node directly, through the head
   and (when the head is ``superfluid fleet``) through SMG alone; p50/p99 of each.
5. **faults**: a node down when the head starts (the head's /health, a chat, the time until the
   node is routed to once it comes up), a model no node serves, and every node gone.

    .venv/bin/python -m tools.bench.fleet --out /tmp/fleet-bench            # all four
    .venv/bin/python -m tools.bench.fleet --out DIR --only affinity,kill
    .venv/bin/python -m tools.bench.fleet --out DIR --head smg             # SMG alone as the head

Writes DIR/fleet.json and DIR/fleet.md (and each process's log under DIR/logs). Every process
is started in its own process group and stopped by its PID, also when a stage fails; every loop
and every client read is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tools.bench import fleet_prompts as fp
from tools.bench.fleet_procs import BIN, Head, Node
from tools.bench.fleet_requests import Outcome, chat, chat_body, tally
from tools.bench.fleet_report import markdown

STAGES = ("refusals", "affinity", "kill", "qos", "overhead", "faults")
REFUSED = (["--class-lanes", "agent=2"], ["--http-default-qos", "batch"], ["--no-http-qos-header"],
           ["--http-allow-batch-invariant"])
PREFILLED = "superfluid_prefill_tokens_total"
REQUESTS = "superfluid_requests_total"
RETRIES = "smg_worker_retries_total"  # SMG's: a failed non-streamed request sent to another node


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def fleet_available() -> bool:
    """Whether this checkout has the ``superfluid fleet`` command."""
    try:
        r = subprocess.run([str(BIN / "superfluid"), "fleet", "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


class Fleet:
    """Fresh nodes and a head for one stage; ``close()`` stops them all by PID."""

    def __init__(self, args, stage: str, policy: str, max_batch: int | None = None, kind: str | None = None):
        self.args, self.stage = args, stage
        self.log_dir = Path(args.out) / "logs" / stage
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.kind = kind or args.head
        flags = ["--max-batch", str(max_batch or args.max_batch), "--max-context", str(args.max_context),
                 "--threads", str(args.threads), "--no-os-pressure", "--shutdown-timeout", "2"]
        if args.model:
            flags += ["--model", args.model]
        self.nodes = [Node(i, flags, self.log_dir) for i in range(args.nodes)]
        self.heads: list[Head] = []
        self.policy = policy
        self.model: str | None = None

    def start(self, held_back: int = 0) -> "Fleet":
        """Start the nodes (but the last ``held_back``: the head is given them while they are down)
        and the head."""
        up = self.nodes[:len(self.nodes) - held_back]
        for n in up:
            n.start()
        for n in up:
            took = n.wait_ready()
            log(f"{self.stage}: node{n.index} ready on {n.base} in {took:.1f} s")
        self.head = self.add_head(self.kind, self.policy, up=up)
        return self

    def add_head(self, kind: str, policy: str, tag: str = "", up: list[Node] | None = None) -> Head:
        head = Head(kind, self.nodes, policy, self.log_dir, tag)
        self.heads.append(head)
        took = head.wait_ready()
        self.wait_nodes(head, True, 60.0, up, key="routed")
        log(f"{self.stage}: head {kind} --policy {policy} ready on {head.base} in {took:.1f} s")
        return head

    def wait_nodes(self, head: Head, healthy: bool, timeout: float, nodes: list[Node] | None = None,
                   key: str = "healthy") -> float | None:
        """Seconds until the head reports every one of ``nodes`` as ``healthy`` (or, ``key="routed"``,
        routed to; None: not in time)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if all(head.node_healthy(n, key) is healthy for n in (nodes or self.nodes)):
                return time.monotonic() - t0
            time.sleep(0.2)
        return None

    def counters(self, name: str) -> list[float]:
        return [n.metrics().get(name, 0.0) for n in self.nodes]

    def settled(self, name: str, timeout: float = 5.0) -> list[float]:
        """Each node's counter once two reads 0.3 s apart agree (a reply can reach the client
        just before the node records the tick that made it)."""
        value, t0 = self.counters(name), time.monotonic()
        while time.monotonic() - t0 < timeout:
            time.sleep(0.3)
            again = self.counters(name)
            if again == value:
                break
            value = again
        return value

    def close(self) -> None:
        for h in self.heads:
            h.stop()
        for n in self.nodes:
            n.stop()


def session(limit: int = 64) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit))


async def model_of(base: str) -> str:
    async with session() as s:
        async with s.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.json(content_type=None)
    return data["data"][0]["id"]


# ---- 0. the head's refusals ---------------------------------------------------------------------

def on_fleet(args, stage: str, run, max_batch: int | None = None, held_back: int = 0) -> dict:
    """A stage on a fresh fleet (cache_aware), always stopped: ``run(args, fleet, model)``'s result."""
    fleet = Fleet(args, stage, "cache_aware", **({"max_batch": max_batch} if max_batch else {}))
    try:
        fleet.start(**({"held_back": held_back} if held_back else {}))
        model = asyncio.run(model_of(fleet.nodes[0].base))
        return {"head": fleet.kind, "policy": "cache_aware", **asyncio.run(run(args, fleet, model))}
    finally:
        fleet.close()


def refusals(args) -> dict:
    """``superfluid fleet`` with each local-scheduler flag: its exit status and message."""
    if args.head != "fleet":
        return {"error": "needs superfluid fleet (the head is SMG alone)"}
    out = []
    for flag in REFUSED:
        cmd = [str(BIN / "superfluid"), "fleet", "--node", "http://127.0.0.1:9", "--port", "0", *flag]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            out.append({"flags": flag, "rc": r.returncode, "message": (r.stderr.strip().splitlines() or [""])[-1]})
        except subprocess.TimeoutExpired:  # it started serving: not refused
            out.append({"flags": flag, "rc": None, "message": "not refused: still running after 60 s"})
    return {"runs": out}


# ---- 1. prefix affinity -------------------------------------------------------------------------

async def _affinity_burst(args, head: Head, model: str) -> list[Outcome]:
    gate = asyncio.Semaphore(args.affinity_concurrency)
    reqs = fp.affinity_requests(args.requests, args.families, args.prefix_tokens)

    async def one(s, messages):
        async with gate:
            return await chat(s, head.base, chat_body(model, messages, 4, False, None),
                              args.timeout, args.timeout)

    async with session() as s:
        return await asyncio.gather(*[one(s, m) for _, m in reqs])


def affinity_run(args, policy: str) -> dict:
    fleet = Fleet(args, f"affinity-{policy}", policy)
    try:
        fleet.start()
        model = asyncio.run(model_of(fleet.nodes[0].base))
        before_p, before_r = fleet.counters(PREFILLED), fleet.counters(REQUESTS)
        t0 = time.monotonic()
        outcomes = asyncio.run(_affinity_burst(args, fleet.head, model))
        wall = time.monotonic() - t0
        after_p, after_r = fleet.settled(PREFILLED), fleet.settled(REQUESTS)
    finally:
        fleet.close()
    prefilled = [a - b for a, b in zip(after_p, before_p)]
    per_node = [a - b for a, b in zip(after_r, before_r)]
    prompt = [o.prompt_tokens for o in outcomes if o.prompt_tokens]
    out = {"policy": policy, "head": fleet.kind, "prefilled_per_node": prefilled,
           "prefilled_total": sum(prefilled), "requests_per_node": per_node,
           "prompt_tokens_total": sum(prompt), "prompt_tokens_min": min(prompt, default=None),
           "prompt_tokens_max": max(prompt, default=None), "wall_s": round(wall, 1), **tally(outcomes)}
    log(f"affinity {policy}: prefilled {out['prefilled_total']:.0f} {prefilled}, requests {per_node}, "
        f"{out['completed']}/{out['sent']} completed, {wall:.0f} s")
    return out


def affinity(args) -> dict:
    runs = {p: affinity_run(args, p) for p in ("cache_aware", "round_robin")}
    rr = runs["round_robin"]["prefilled_total"]
    ratio = runs["cache_aware"]["prefilled_total"] / rr if rr else None
    return {"requests": args.requests, "families": args.families, "prefix_tokens_asked": args.prefix_tokens,
            "concurrency": args.affinity_concurrency, "runs": runs,
            "ratio_cache_aware_to_round_robin": ratio, "goal": 0.5}


# ---- 2. a node SIGKILLed mid-burst -------------------------------------------------------------

async def _kill(args, fleet: Fleet, model: str) -> dict:
    head = fleet.head
    msgs = fp.burst_messages(args.burst, "kill")
    async with session() as s:
        def body(i):
            stream = i % 2 == 0
            return chat_body(model, msgs[i], args.burst_tokens, stream, None)

        before_kill = [n.metrics().get(REQUESTS, 0.0) for n in fleet.nodes]
        retries_before = await asyncio.to_thread(head.metric, RETRIES)
        t_start = time.monotonic()
        burst = [asyncio.create_task(chat(s, head.base, body(i), args.timeout, args.read_timeout))
                 for i in range(args.burst)]
        # The victim: the busiest node once the burst has reached the nodes, after
        # --kill-after seconds (so some of its streams have started); the wait is bounded.
        await asyncio.sleep(args.kill_after)
        busy: list[int] = []
        while time.monotonic() - t_start < args.kill_after + 30.0:
            busy = await asyncio.to_thread(lambda: [n.busy() for n in fleet.nodes])
            if max(busy) > 0:
                break
            await asyncio.sleep(0.1)
        victim_index = max(range(len(busy)), key=lambda i: busy[i])
        victim = fleet.nodes[victim_index]
        busy_at_kill = busy[victim_index]
        t_kill = time.monotonic()
        await asyncio.to_thread(victim.kill)
        log(f"kill: SIGKILLed node{victim_index} (pid {victim.proc.pid}) {t_kill - t_start:.2f} s into the burst, "
            f"busy per node {busy}")

        # Probes after the kill: one small chat every --probe-interval seconds for --probe-seconds.
        async def probe(i):
            return await chat(s, head.base, chat_body(model, [{"role": "user", "content": f"Probe {i}: say yes."}],
                                                      2, False, None), args.timeout, args.read_timeout)
        probes: list[asyncio.Task] = []

        async def probing():
            i = 0
            while time.monotonic() - t_kill < args.probe_seconds:
                probes.append(asyncio.create_task(probe(i)))
                i += 1
                await asyncio.sleep(args.probe_interval)

        async def false_after(key):
            while time.monotonic() - t_kill < 60.0:
                if await asyncio.to_thread(head.node_healthy, victim, key) is False:
                    return time.monotonic() - t_kill
                await asyncio.sleep(0.1)
            return None

        probe_task = asyncio.create_task(probing())
        to_unhealthy, to_unrouted = await asyncio.gather(false_after("healthy"), false_after("routed"))
        log(f"kill: head reports node{victim_index} unhealthy {to_unhealthy} s after the kill")
        burst_out = await asyncio.gather(*burst)
        await probe_task
        probe_out = await asyncio.gather(*probes)
        log(f"kill: burst {tally(burst_out)}")
        retries_after = await asyncio.to_thread(head.metric, RETRIES)

        failed_probes = [p for p in probe_out if p.kind != "completed"]
        to_victim = [p for p in probe_out if p.worker == victim.base]
        last_to_victim = max((p.sent_at - t_kill for p in to_victim), default=None)
        last_failed = max((p.sent_at - t_kill for p in failed_probes), default=None)

        # Rejoin: restart the victim on its port, wait until the head calls it healthy, send more.
        t_restart = time.monotonic()
        await asyncio.to_thread(victim.start)
        ready = await asyncio.to_thread(victim.wait_ready)
        rejoin = await asyncio.to_thread(fleet.wait_nodes, head, True, 60.0, [victim], "routed")
        log(f"kill: node{victim_index} restarted, ready in {ready:.1f} s, healthy at the head {rejoin} s later")
        before = [n.metrics().get(REQUESTS, 0.0) for n in fleet.nodes]
        after_msgs = fp.burst_messages(args.rejoin_requests, "rejoin")
        rejoin_out = await asyncio.gather(*[
            chat(s, head.base, chat_body(model, m, 8, False, None), args.timeout, args.read_timeout)
            for m in after_msgs])
    after = await asyncio.to_thread(fleet.settled, REQUESTS)
    return {
        "burst": args.burst, "streamed": sum(1 for i in range(args.burst) if i % 2 == 0),
        "max_tokens": args.burst_tokens, "killed_after_s": round(t_kill - t_start, 2),
        "victim": victim_index, "busy_per_node_at_kill": busy, "victim_busy_at_kill": busy_at_kill,
        "served_by_victim_before_kill": sum(1 for o in burst_out if o.worker == victim.base and o.kind == "completed"
                                            and o.sent_at + o.seconds < t_kill), "requests_before_burst": before_kill,
        "counts": tally(burst_out),
        "smg_retries": None if retries_before is None or retries_after is None else retries_after - retries_before,
        "streams": tally([o for o in burst_out if o.stream]),
        "failed_streams_with_content": sum(1 for o in burst_out if o.stream and o.kind != "completed" and o.ttft),
        "failed_ended_after_kill_s_max": max((round(o.sent_at + o.seconds - t_kill, 2) for o in burst_out
                                              if o.kind != "completed"), default=None),
        "unhealthy_after_s": None if to_unhealthy is None else round(to_unhealthy, 2),
        "unrouted_after_s": None if to_unrouted is None else round(to_unrouted, 2),
        "probes": {**tally(probe_out), "interval_s": args.probe_interval, "seconds": args.probe_seconds,
                   "last_failed_sent_after_kill_s": None if last_failed is None else round(last_failed, 2),
                   "served_by_victim": len(to_victim),
                   "last_served_by_victim_sent_after_kill_s": None if last_to_victim is None else round(last_to_victim, 2),
                   "workers_seen": sorted({p.worker for p in probe_out if p.worker}),
                   "p50_s": percentile([p.seconds for p in probe_out if p.kind == "completed"], 0.5),
                   "max_s": max((p.seconds for p in probe_out), default=None)},
        "rejoin": {"restart_ready_s": round(ready, 1),
                   "routed_at_head_after_ready_s": None if rejoin is None else round(rejoin, 2),
                   "since_restart_s": round(time.monotonic() - t_restart, 1),
                   "requests": tally(rejoin_out),
                   "requests_per_node": [a - b for a, b in zip(after, before)]},
        "outcomes": [o.to_json() for o in burst_out],
    }


def kill(args) -> dict:
    return on_fleet(args, "kill", _kill)


# ---- 3. QoS through the head -------------------------------------------------------------------
# (label, class in the body's superfluid.qos, class in the x-superfluid-qos header): the class by
# each route a client has through the head, and the same chat as class agent, the peer.
CHATS = (("interactive (body field)", "interactive", None), ("agent (peer)", "agent", None),
         ("interactive (header)", None, "interactive"))

async def _qos(args, fleet: Fleet, model: str) -> dict:
    head = fleet.head
    async with session() as s:
        agents = [asyncio.create_task(chat(s, head.base, chat_body(model, fp.agent_messages(i, args.agent_tokens),
                                                                      16, False, "agent"),
                                           args.timeout, args.timeout))
                  for i in range(args.agents)]
        t0 = time.monotonic()
        lanes = args.qos_max_batch * len(fleet.nodes)
        while time.monotonic() - t0 < 30.0:  # until the agents hold the lanes (bounded)
            busy = await asyncio.to_thread(lambda: [n.busy() for n in fleet.nodes])
            if sum(busy) >= min(args.agents, lanes):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(args.chat_delay)
        spread = await asyncio.to_thread(lambda: [n.health() for n in fleet.nodes])
        per_node = [{"lanes_busy": sum(int(m.get("lanes_busy") or 0) for m in (h.get("models") or {}).values()),
                     "queued": sum(int(m.get("queued") or 0) for m in (h.get("models") or {}).values())}
                    for h in spread]
        chats = {}
        for label, body_cls, header_cls in CHATS:
            headers = {"x-superfluid-qos": header_cls} if header_cls else None
            chats[label] = await chat(s, head.base, chat_body(model, fp.chat_messages(), 8, True, body_cls),
                                      args.chat_timeout, args.chat_timeout, headers)
            log(f"qos: {label} chat {chats[label].kind}, TTFT {chats[label].ttft}")
        done_agents = [a for a in agents if a.done()]
        for a in agents:  # the measurement is over: free the shared machine
            a.cancel()
        await asyncio.gather(*agents, return_exceptions=True)
    return {"agents": args.agents, "agent_tokens_asked": args.agent_tokens, "lanes_per_node": args.qos_max_batch,
            "chat_delay_s": args.chat_delay, "per_node_at_chat": per_node,
            "agents_finished_before_chats_ended": len(done_agents),
            "chats": {label: o.to_json() for label, o in chats.items()}, "goal_s": 1.0}


def qos(args) -> dict:
    return on_fleet(args, "qos", _qos, max_batch=args.qos_max_batch)


# ---- 4. overhead --------------------------------------------------------------------------------

async def _overhead(args, fleet: Fleet, model: str) -> dict:
    routes = {"direct": None, "head": fleet.head.base}
    if fleet.kind == "fleet" and shutil.which(str(BIN / "smg")):
        smg = await asyncio.to_thread(fleet.add_head, "smg", "cache_aware", "-alone")
        routes["smg"] = smg.base
    body = chat_body(model, [{"role": "user", "content": "Say OK."}], 1, False, None)
    async with session(8) as s:
        # Warm up, and find the node the head sends this prompt to: the direct path uses it.
        before = await asyncio.to_thread(fleet.counters, REQUESTS)
        for _ in range(5):
            await chat(s, fleet.head.base, body, 60, 60)
        after = await asyncio.to_thread(fleet.settled, REQUESTS)
        target = max(range(len(after)), key=lambda i: after[i] - before[i])
        routes["direct"] = fleet.nodes[target].base
        for base in routes.values():
            for _ in range(3):
                await chat(s, base, body, 60, 60)
        lat: dict[str, list[float]] = {k: [] for k in routes}
        failed: dict[str, int] = {k: 0 for k in routes}
        names = list(routes)
        t0 = time.monotonic()
        for i in range(args.overhead_n):
            if time.monotonic() - t0 > args.overhead_seconds:
                break
            for k in names[i % len(names):] + names[:i % len(names)]:  # rotate who goes first
                o = await chat(s, routes[k], body, 30, 30)
                if o.kind == "completed":
                    lat[k].append(o.seconds)
                else:
                    failed[k] += 1
    stats = {k: {"n": len(v), "failed": failed[k], "p50_ms": _ms(percentile(v, 0.5)),
                 "p99_ms": _ms(percentile(v, 0.99)), "mean_ms": _ms(sum(v) / len(v) if v else None)}
             for k, v in lat.items()}
    diff = {k: {"p50_ms": _sub(stats[k]["p50_ms"], stats["direct"]["p50_ms"]),
                "p99_ms": _sub(stats[k]["p99_ms"], stats["direct"]["p99_ms"])}
            for k in routes if k != "direct"}
    return {"n": args.overhead_n, "direct_node": target, "routes": stats, "added": diff,
            "request": "chat 'Say OK.', max_tokens 1, not streamed, sequential"}


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 2)


def _sub(a, b):
    return None if a is None or b is None else round(a - b, 2)


def overhead(args) -> dict:
    return on_fleet(args, "overhead", _overhead)


# ---- 5. faults at the head --------------------------------------------------------------------

async def _faults(args, fleet: Fleet, model: str) -> dict:
    head, late = fleet.head, fleet.nodes[-1]
    out: dict = {}
    status, body = await asyncio.to_thread(head.health)
    out["down_at_start"] = {"head_health_status": status,
                            "late_node_healthy": await asyncio.to_thread(head.node_healthy, late),
                            "late_node_routed": await asyncio.to_thread(head.node_healthy, late, "routed")}
    async with session() as s:
        msgs = [{"role": "user", "content": "Say yes."}]
        o = await chat(s, head.base, chat_body(model, msgs, 2, False, None), 60, 60)
        out["down_at_start"]["chat"] = {"kind": o.kind, "status": o.status, "worker": o.worker}
        t0 = time.monotonic()
        await asyncio.to_thread(late.start)
        ready = await asyncio.to_thread(late.wait_ready)
        routed = await asyncio.to_thread(fleet.wait_nodes, head, True, 60.0, [late], "routed")
        out["down_at_start"].update({"started_ready_s": round(ready, 1),
                                     "routed_after_ready_s": None if routed is None else round(routed, 2),
                                     "since_start_s": round(time.monotonic() - t0, 1)})
        o = await chat(s, head.base, chat_body("no-such-model", msgs, 2, False, None), 60, 60)
        out["unknown_model"] = {"status": o.status, "error": o.error, "code": o.code}
        for n in fleet.nodes:
            await asyncio.to_thread(n.kill)
        went = await asyncio.to_thread(fleet.wait_nodes, head, False, 30.0)
        status, body = await asyncio.to_thread(head.health)
        o = await chat(s, head.base, chat_body(model, msgs, 2, False, None), 60, 60)
        out["all_down"] = {"unhealthy_after_s": None if went is None else round(went, 2), "head_health_status": status,
                           "chat": {"kind": o.kind, "status": o.status, "error": o.error, "code": o.code}}
    return out


def faults(args) -> dict:
    return on_fleet(args, "faults", _faults, held_back=1)


# ---- the command --------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="DIR", help="where fleet.json, fleet.md and logs/ go")
    ap.add_argument("--only", default=",".join(STAGES), help=f"stages to run, of {','.join(STAGES)}")
    ap.add_argument("--head", choices=("auto", "fleet", "smg"), default="auto",
                    help="the head: superfluid fleet, or SMG alone (auto: fleet if this checkout has it)")
    ap.add_argument("--model", help="GGUF for every node (default: the default model)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=4, help="lanes per node (default 4)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="engine threads per node (default 1)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request (default 300)")
    ap.add_argument("--read-timeout", type=float, default=60.0,
                    help="seconds any one read of a reply may wait: past it the request is lost (default 60)")
    g = ap.add_argument_group("affinity")
    g.add_argument("--requests", type=int, default=48)
    g.add_argument("--families", type=int, default=4)
    g.add_argument("--prefix-tokens", type=int, default=1000, help="about, per shared system prompt")
    g.add_argument("--affinity-concurrency", type=int, default=6)
    g = ap.add_argument_group("kill")
    g.add_argument("--burst", type=int, default=30)
    g.add_argument("--burst-tokens", type=int, default=48, help="reply length of the burst's chats")
    g.add_argument("--kill-after", type=float, default=4.0, help="seconds into the burst (default 4)")
    g.add_argument("--probe-interval", type=float, default=0.25)
    g.add_argument("--probe-seconds", type=float, default=12.0)
    g.add_argument("--rejoin-requests", type=int, default=12)
    g = ap.add_argument_group("qos")
    g.add_argument("--agents", type=int, default=8)
    g.add_argument("--agent-tokens", type=int, default=2500, help="about, per agent prompt")
    g.add_argument("--qos-max-batch", type=int, default=2,
                   help="lanes per node in this stage (default 2: 8 agents more than fill 3 nodes)")
    g.add_argument("--chat-delay", type=float, default=3.0, help="seconds after the agents hold the lanes")
    g.add_argument("--chat-timeout", type=float, default=180.0)
    g = ap.add_argument_group("overhead")
    g.add_argument("--overhead-n", type=int, default=200)
    g.add_argument("--overhead-seconds", type=float, default=300.0, help="bound on the whole loop")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    stages = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        print(f"error: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    if args.head == "auto":
        args.head = "fleet" if fleet_available() else "smg"
        log(f"head: {args.head}" + ("" if args.head == "fleet" else " (this checkout has no superfluid fleet)"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "head": args.head,
                     "command": " ".join(["python -m tools.bench.fleet", *(argv if argv is not None else sys.argv[1:])]),
                     "commit": _commit(), "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    runners = {"refusals": refusals, "affinity": affinity, "kill": kill, "qos": qos, "overhead": overhead,
               "faults": faults}
    status = 0
    for stage in stages:
        log(f"stage {stage}")
        try:
            results[stage] = runners[stage](args)
        except Exception as exc:  # keep what the other stages measured
            results[stage] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            log(f"stage {stage} failed: {exc}")
            status = 1
        (out_dir / "fleet.json").write_text(json.dumps(results, indent=1) + "\n")
    text = markdown(results)
    (out_dir / "fleet.md").write_text(text)
    print(text)
    return status


def _commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


if __name__ == "__main__":
    sys.exit(main())
