"""Soak: mixed traffic for a long time (30 minutes in the full run) while the daemon's resources
are sampled, to show that nothing grows without bound.

Traffic: a few clients at once, each picking its next request at random (seeded) from every API
the daemon serves: chat (whole and streamed), completions, session turns (sessions opened,
parked and closed), embeddings, tool calls, structured output (a JSON schema), streams the
client drops after the first token, Anthropic Messages, Responses (not stored: stored responses
are sessions a client keeps on purpose) and Ollama's chat. Every reply is checked: a 5xx or a
request with no whole answer fails the run.

The daemon runs with ``--park`` and a state directory, so session turns seal their KV to disk.

Sampled every ``every_s`` seconds: the daemon's and the worker's RSS, the daemon's open file
descriptors and threads, busy lanes and the host tier's bytes (/metrics).

Pass: after a warm-up (the first fifth of the run: caches fill, allocators settle), the last
third's highest sample stays within stated bounds of the warm baseline (the median of the
samples between the warm-up and the end of the first third): RSS within 10 % + 48 MiB (daemon)
and 10 % + 96 MiB (worker), file descriptors within +16, threads within +8, the host tier within
its cap (``--host-cache-mb``); after the traffic stops every lane is free again; no 5xx and
nothing lost. The chart (``soak.png``) draws every series against time."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request

import aiohttp
import psutil

from tools.suite.common import call, metric_sum, metrics, stream

from ..common import MODEL_NAME, Ctx, Outcome, verdict

KEY, TITLE = "soak", "soak"
FAULT = "mixed traffic on every API for a long run, with dropped streams"
PASS = ("after warm-up, RSS, file descriptors, threads and host-tier bytes stay within stated bounds of "
        "their warm baseline; lanes free at the end; no 5xx, nothing lost")
FULL = {"seconds": 1800, "every_s": 10, "clients": 4, "lanes": 4, "host_cache_mb": 64}
# the CI variant: 20 s (4 clients on 4 lanes reach the test's 20 requests and 8 APIs in it; a sample
# every 2 s gives its 5 samples, the warm baseline two of them)
FAST = {"seconds": 12, "every_s": 2, "clients": 4, "lanes": 4, "host_cache_mb": 64}
HEADLINE = ["requests", "by_kind", "5xx", "lost", "daemon_rss_mib", "worker_rss_mib", "fds", "threads",
            "host_bytes_max_mib", "lanes_after"]
KINDS = ["chat", "chat_stream", "completion", "session", "embedding", "tools", "schema", "drop",
         "anthropic", "responses", "ollama"]
RSS_BOUND = {"daemon_rss": (0.10, 48 << 20), "worker_rss": (0.10, 96 << 20)}
COUNT_BOUND = {"fds": 16, "threads": 8}

WORDS = ["river", "lamp", "garden", "copper", "violin", "harbor", "maple", "comet", "pepper", "glacier"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False}}}


def unavailable() -> str | None:
    return None


def _topic(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(3))


class Traffic:
    """The clients' requests and what came back."""

    def __init__(self, ctx: Ctx, http: aiohttp.ClientSession, base: str):
        self.ctx, self.http, self.base = ctx, http, base
        self.by_kind: dict[str, int] = {k: 0 for k in KINDS}
        self.statuses: dict[str, int] = {}
        self.lost: list[str] = []
        self.server_errors: list[str] = []

    def _note(self, kind: str, status: int, whole: bool, why: str = "") -> None:
        self.by_kind[kind] += 1
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if status >= 500:
            self.server_errors.append(f"{kind}: {status} {why}"[:300])
        elif status == 200 and not whole:
            self.lost.append(f"{kind}: {why}"[:300])
        elif status != 200:
            self.lost.append(f"{kind}: unexpected {status} {why}"[:300])

    async def post(self, kind: str, path: str, body: dict, check) -> None:
        try:
            r = await call(self.http, "POST", self.base + path, body, timeout=300)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self._note(kind, 0, False, f"{type(e).__name__}: {e}")
            return
        whole = r.status == 200 and bool(check(r.body))
        self._note(kind, r.status, whole, str(r.body)[:200])

    async def one(self, kind: str, rng, session_state: dict) -> None:
        msg = [{"role": "user", "content": f"Say something about {_topic(rng)}."}]
        n = rng.randint(8, 24)
        chat = {"model": MODEL_NAME, "messages": msg, "max_tokens": n, "temperature": 0.7}
        choice_text = lambda b: isinstance(b, dict) and b.get("choices")  # noqa: E731
        if kind == "chat":
            await self.post(kind, "/v1/chat/completions", chat, choice_text)
        elif kind == "chat_stream" or kind == "drop":
            res = await stream(self.http, self.base + "/v1/chat/completions",
                               {**chat, "stream_options": {"include_usage": True}},
                               on_chunk=_drop if kind == "drop" else None, timeout=300)
            dropped = kind == "drop" and res.error is not None and res.status == 200
            self._note(kind, res.status, dropped or (res.error is None and res.usage is not None), res.error or "")
        elif kind == "completion":
            await self.post(kind, "/v1/completions", {"model": MODEL_NAME, "prompt": f"A note on {_topic(rng)}:",
                                                      "max_tokens": n}, choice_text)
        elif kind == "embedding":
            await self.post(kind, "/v1/embeddings", {"model": MODEL_NAME, "input": [_topic(rng), _topic(rng)]},
                            lambda b: isinstance(b, dict) and len(b.get("data") or []) == 2)
        elif kind == "tools":
            await self.post(kind, "/v1/chat/completions",
                            {**chat, "messages": [{"role": "user", "content": f"Weather in {rng.choice(WORDS)}?"}],
                             "tools": [TOOL], "tool_choice": "required", "max_tokens": 96}, _tool_call_ok)
        elif kind == "schema":
            await self.post(kind, "/v1/chat/completions",
                            {**chat, "response_format": SCHEMA, "max_tokens": 96}, _schema_ok)
        elif kind == "anthropic":
            await self.post(kind, "/v1/messages", {"model": MODEL_NAME, "max_tokens": n, "messages": msg},
                            lambda b: isinstance(b, dict) and b.get("type") == "message")
        elif kind == "responses":
            await self.post(kind, "/v1/responses", {"model": MODEL_NAME, "input": msg[0]["content"],
                                                    "max_output_tokens": n, "store": False},
                            _response_whole)
        elif kind == "ollama":
            await self.post(kind, "/api/chat", {"model": MODEL_NAME, "messages": msg, "stream": False,
                                                "options": {"num_predict": n}},
                            lambda b: isinstance(b, dict) and b.get("done") is True)
        elif kind == "session":
            await self.session_turn(rng, session_state, msg, n)

    async def session_turn(self, rng, state: dict, msg: list, n: int) -> None:
        """A session lives a few turns, is sometimes parked between them, then closed."""
        if state.get("id") is None:
            r = await call(self.http, "POST", self.base + "/v1/sessions",
                           {"model": MODEL_NAME, "system": "You are brief."})
            if r.status != 201:
                self._note("session", r.status, False, f"create: {str(r.body)[:200]}")
                return
            state.update(id=r.body["id"], turns=0, limit=rng.randint(2, 5))
        sid = state["id"]
        await self.post("session", f"/v1/sessions/{sid}/turns", {"messages": msg, "max_tokens": n},
                        lambda b: isinstance(b, dict) and b.get("choices"))
        state["turns"] += 1
        if rng.random() < 0.3:
            r = await call(self.http, "POST", self.base + f"/v1/sessions/{sid}/park")
            if r.status >= 500:
                self._note("session", r.status, False, f"park: {str(r.body)[:200]}")
        if state["turns"] >= state["limit"]:
            r = await call(self.http, "DELETE", self.base + f"/v1/sessions/{sid}")
            if r.status != 200:
                self._note("session", r.status, False, f"close: {str(r.body)[:200]}")
            state["id"] = None


def _drop(res) -> None:
    raise ConnectionResetError("client dropped the stream")  # caught by stream(): the connection closes


def _response_whole(body) -> bool:
    """Completed, or cut at max_output_tokens (what a short limit does): a whole answer either way."""
    return isinstance(body, dict) and (body.get("status") == "completed" or (
        body.get("status") == "incomplete"
        and (body.get("incomplete_details") or {}).get("reason") == "max_output_tokens"))


def _finish(body) -> str | None:
    try:
        return body["choices"][0]["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return None


def _tool_call_ok(body) -> bool:
    """A required tool call came whole, or the reply reached max_tokens first (cut by the client's
    own limit: whole as far as the protocol goes)."""
    if _finish(body) == "length":
        return True
    return _finish(body) == "tool_calls" and bool(body["choices"][0]["message"].get("tool_calls"))


def _schema_ok(body) -> bool:
    """The content is JSON that fits the schema, unless max_tokens cut it first."""
    if _finish(body) == "length":
        return True
    try:
        data = json.loads(body["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("name"), str) and isinstance(data.get("age"), int)


def _sample(daemon: psutil.Process, worker_pid: int | None, samples: dict | None) -> dict:
    row = {"daemon_rss": daemon.memory_info().rss, "fds": daemon.num_fds(), "threads": daemon.num_threads()}
    try:
        row["worker_rss"] = psutil.Process(worker_pid).memory_info().rss if worker_pid else None
    except psutil.NoSuchProcess:
        row["worker_rss"] = None
    row["lanes"] = metric_sum(samples, "superfluid_lanes_busy")
    row["host_bytes"] = metric_sum(samples, "superfluid_host_cache_bytes")
    return row


async def _drive(ctx: Ctx, base: str, daemon: psutil.Process, worker_pid: int | None) -> tuple[Traffic, list]:
    p = ctx.p
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        traffic = Traffic(ctx, http, base)
        t0 = time.monotonic()
        stop_at = t0 + p["seconds"]
        timeline: list[dict] = []

        async def client(i: int) -> None:
            rng = type(ctx.rng)(ctx.seed * 1000 + i)
            state: dict = {}
            while time.monotonic() < stop_at:
                await traffic.one(rng.choice(KINDS), rng, state)
            if state.get("id"):
                await call(http, "DELETE", base + f"/v1/sessions/{state['id']}")

        async def sampler() -> None:
            while time.monotonic() < stop_at:
                samples = await metrics(http, base)
                timeline.append({"t": round(time.monotonic() - t0, 1), **_sample(daemon, worker_pid, samples)})
                await asyncio.sleep(p["every_s"])

        await asyncio.gather(sampler(), *[client(i) for i in range(p["clients"])])
        # after the traffic: every lane free again (a dropped stream's lane included)
        lanes_after = None
        for _ in range(40):
            lanes_after = metric_sum(await metrics(http, base), "superfluid_lanes_busy")
            if lanes_after == 0:
                break
            await asyncio.sleep(0.5)
        timeline.append({"t": round(time.monotonic() - t0, 1), "end": True,
                         **_sample(daemon, worker_pid, await metrics(http, base))})
        traffic.lanes_after = lanes_after
        return traffic, timeline


def flatness(timeline: list[dict], seconds: float, host_cap: int) -> tuple[dict, list[str]]:
    """The warm baseline and the last third's highest sample of every series, and what broke a bound."""
    warm = [r for r in timeline if seconds / 5 <= r["t"] < seconds / 3 and not r.get("end")]
    late = [r for r in timeline if r["t"] >= seconds * 2 / 3]
    if not warm:  # a very short run: the first half against the second
        warm = timeline[: max(1, len(timeline) // 2)]
    figures, broken = {}, []
    for name in [*RSS_BOUND, *COUNT_BOUND]:
        base_vals = [r[name] for r in warm if r.get(name) is not None]
        late_vals = [r[name] for r in late if r.get(name) is not None]
        if not base_vals or not late_vals:
            broken.append(f"{name}: no samples")
            continue
        base, peak = statistics.median(base_vals), max(late_vals)
        if name in RSS_BOUND:
            frac, extra = RSS_BOUND[name]
            bound = base * (1 + frac) + extra
            figures[f"{name.split('_')[0]}_rss_mib"] = {"warm": round(base / 2**20, 1), "late_max": round(peak / 2**20, 1),
                                                        "bound": round(bound / 2**20, 1)}
        else:
            bound = base + COUNT_BOUND[name]
            figures[name] = {"warm": base, "late_max": peak, "bound": bound}
        if peak > bound:
            broken.append(f"{name} {peak:.0f} over its bound {bound:.0f} (warm {base:.0f})")
    host = [r["host_bytes"] for r in timeline if r.get("host_bytes") is not None]
    figures["host_bytes_max_mib"] = round(max(host) / 2**20, 1) if host else None
    if host and max(host) > host_cap:
        broken.append(f"host tier {max(host)} bytes over its cap {host_cap}")
    return figures, broken


def chart(timeline: list[dict], path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t = [r["t"] / 60 for r in timeline]
    fig, axes = plt.subplots(4, 1, figsize=(8, 9), sharex=True)
    for name, label in (("daemon_rss", "daemon RSS"), ("worker_rss", "worker RSS"), ("host_bytes", "host tier")):
        axes[0].plot(t, [(r.get(name) or 0) / 2**20 for r in timeline], label=label)
    axes[0].set_ylabel("MiB")
    axes[0].legend(loc="upper left", fontsize=8)
    axes[1].plot(t, [r.get("fds") for r in timeline], label="open fds")
    axes[1].set_ylabel("fds")
    axes[2].plot(t, [r.get("threads") for r in timeline], label="threads", color="tab:green")
    axes[2].set_ylabel("threads")
    axes[3].step(t, [r.get("lanes") or 0 for r in timeline], where="post", color="tab:red")
    axes[3].set_ylabel("busy lanes")
    axes[3].set_xlabel("minutes")
    fig.suptitle("superfluid soak: mixed traffic on every API")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def run(ctx: Ctx) -> Outcome:
    p = ctx.p
    state = ctx.out_dir / "soak-state"  # sessions park and seal (--park) into it
    state.mkdir(exist_ok=True)
    srv = ctx.serve("--max-batch", str(p["lanes"]), "--max-context", "2048", "--park", "--state-dir", str(state),
                    "--host-cache-mb", str(p["host_cache_mb"]), name="soak")
    daemon = psutil.Process(srv.pid)
    with urllib.request.urlopen(srv.base + "/health", timeout=10) as r:
        health = json.loads(r.read())
    worker_pid = health["models"][MODEL_NAME].get("worker_pid")
    traffic, timeline = asyncio.run(_drive(ctx, srv.base, daemon, worker_pid))
    figures, broken = flatness(timeline, p["seconds"], p["host_cache_mb"] << 20)
    (ctx.out_dir / "soak.json").write_text(json.dumps(timeline))
    figures.update(requests=sum(traffic.by_kind.values()), by_kind=traffic.by_kind, statuses=traffic.statuses,
                   **{"5xx": len(traffic.server_errors)}, lost=len(traffic.lost), lanes_after=traffic.lanes_after,
                   errors=(traffic.server_errors + traffic.lost)[:5], daemon_alive=srv.alive(),
                   chart=chart(timeline, ctx.out_dir / "soak.png"), samples=len(timeline))
    if traffic.server_errors:
        broken.append(f"{len(traffic.server_errors)} server errors")
    if traffic.lost:
        broken.append(f"{len(traffic.lost)} requests without a whole answer")
    if traffic.lanes_after != 0:
        broken.append(f"{traffic.lanes_after} lanes still busy after the traffic stopped")
    if not srv.alive():
        broken.append("the daemon died")
    ok = not broken
    v, why = verdict(ok, f"{figures['requests']} requests over {p['seconds']} s, every series within its bound",
                     "; ".join(broken))
    return Outcome(KEY, "superfluid", v, why, figures)
