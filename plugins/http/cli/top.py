"""``superfluid top --url http://HOST:PORT``: the dashboard's view in a terminal.

It reads the server's ``GET /events`` stream (see docs/api.md, "Live events") like any client,
and draws each snapshot with ``rich``: per model the lanes, the queues per class, the KV pool and
its host tier, the pressure level, the recent ticks and TTFT percentiles per class, and with a key
policy each key's requests, tokens and rejections. ``--once`` prints one frame and exits (for
scripts and tests). A server that cannot be reached, or refuses the key, is a clear message and
exit status 1."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request

HELP = "watch a running server's lanes, queues and KV live in the terminal (reads GET /events)"
READ_TIMEOUT_S = 40.0  # the server pings every 15 s when it has nothing else to send
TICK_ROWS = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8080", metavar="URL",
                        help="the server's base URL (default: http://127.0.0.1:8080)")
    parser.add_argument("--key", default=None, metavar="SECRET",
                        help="an API key with admin = true or dashboard = true (servers with --key-policy)")
    parser.add_argument("--model", default=None, metavar="NAME", help="show only this model")
    parser.add_argument("--interval-ms", type=int, default=1000, metavar="MS",
                        help="how often the server sends a snapshot (100..5000; default 1000)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")


# ---- the stream ------------------------------------------------------------------------------

class TopError(Exception):
    """Why ``top`` cannot show the server (the message is for the user)."""


def events_url(base: str, model: str | None, interval_ms: int) -> str:
    query = {"interval_ms": str(interval_ms)}
    if model:
        query["model"] = model
    return base.rstrip("/") + "/events?" + urllib.parse.urlencode(query)


def open_stream(url: str, key: str | None):
    headers = {"Accept": "text/event-stream"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=READ_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        message = exc.reason
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        hint = ""
        if exc.code in (401, 403):
            hint = " (give --key SECRET of a key with admin = true or dashboard = true)"
        raise TopError(f"{exc.code} from {url.split('?')[0]}: {message}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TopError(f"cannot reach {url.split('?')[0]}: {reason}") from None


def events(stream):
    """(type, data) of each SSE event read from ``stream`` (a file-like of bytes lines)."""
    kind, data = None, []
    for raw in stream:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield kind or "message", json.loads("\n".join(data))
            kind, data = None, []
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


# ---- drawing ---------------------------------------------------------------------------------

def _num(value, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _bar(fraction: float, width: int = 30) -> str:
    fraction = max(0.0, min(1.0, fraction))
    full = round(fraction * width)
    return "█" * full + "░" * (width - full)


STATE_STYLE = {"free": "dim", "queued": "yellow", "prefilling": "cyan", "decoding": "green",
               "preempted": "magenta", "finished": "blue", "cancelled": "red"}
PRESSURE_STYLE = {"ok": "green", "warning": "yellow", "critical": "bold red"}


def model_panel(name: str, view: dict):
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    lanes = Table(title="lanes", title_justify="left")
    for col in ("lane", "state", "class", "request", "prompt", "output", "tok/s", "preempted"):
        lanes.add_column(col, justify="right" if col in ("lane", "prompt", "output", "tok/s", "preempted") else "left")
    for lane in view["lanes"]:
        state = lane["state"]
        busy = state != "free"
        prompt = (f"{min(lane['cached_tokens'], lane['prompt_tokens'])}/{lane['prompt_tokens']}" if busy
                  else (f"cached {lane['cached_tokens']}" if lane["cached_tokens"] else ""))
        output = (f"{lane['generated_tokens']}/{lane['max_tokens'] if lane['max_tokens'] is not None else '∞'}"
                  if busy else "")
        lanes.add_row(str(lane["id"]), Text(state, style=STATE_STYLE.get(state, "")), lane["qos"] or "",
                      (lane["request_id"] or "")[-18:], prompt, output, _num(lane["tokens_per_s"]),
                      str(lane["preemptions"]) if lane["preemptions"] else "")

    queues = Table(title="queues", title_justify="left")
    for col in ("class", "queued", "oldest wait", "parked"):
        queues.add_column(col, justify="left" if col == "class" else "right", no_wrap=True)
    for cls, q in view["queues"].items():
        queues.add_row(cls, str(q["count"]), f"{q['oldest_wait_s']:.1f} s" if q["count"] else "-", str(q["parked"]))

    ttft = Table(title="TTFT (recent, s)", title_justify="left")
    for col in ("class", "n", "p50", "p95", "p99"):
        ttft.add_column(col, justify="left" if col == "class" else "right")
    for cls, t in view["ttft"].items():
        ttft.add_row(cls, str(t["count"]), _num(t["p50"], "{:.3f}"), _num(t["p95"], "{:.3f}"), _num(t["p99"], "{:.3f}"))

    ticks = Table(title="recent ticks", title_justify="left")
    for col in ("tick", "lanes", "prefill", "decode", "length", "target", ""):
        ticks.add_column(col, justify="right", no_wrap=True)
    for tick in view["ticks"][-TICK_ROWS:]:
        target = tick["target_s"]
        over = target is not None and tick["seconds"] > target * 1.2
        ticks.add_row(str(tick["seq"]), str(tick["lanes"]), str(tick["prefill_tokens"]), str(tick["decode_tokens"]),
                      Text(f"{tick['seconds'] * 1000:.0f} ms", style="red" if over else ""),
                      _num(target * 1000 if target is not None else None, "{:.0f} ms"),
                      "early" if tick["stopped_early"] else "")

    kv = view["kv"]
    occupancy = kv["occupancy"]
    pressure = view["pressure"]
    summary = Text()
    summary.append("KV ")
    summary.append(_bar(occupancy), style="red" if occupancy > 0.9 else "cyan")
    summary.append(f" {occupancy * 100:.1f}%  {kv['used']}/{kv['capacity']} cells  cached {kv['cached_tokens']} tokens"
                   if kv["capacity"] else f" cached {kv['cached_tokens']} tokens")
    summary.append(f"\nhost tier {_bytes(kv['host_bytes'])} in {kv['host_entries']} prefixes  "
                   f"parked {_bytes(kv['parked_bytes'])}   pressure ")
    summary.append(pressure, style=PRESSURE_STYLE.get(pressure, ""))
    summary.append(f"   requests {view['requests_total']}  preemptions {view['preemptions_total']}")

    side = Table.grid(padding=(0, 2))
    side.add_row(queues, ttft)
    return Panel(Group(lanes, summary, side, ticks), title=f"[b]{name}[/b]", title_align="left")


def keys_table(keys: dict):
    from rich.table import Table
    table = Table(title="keys", title_justify="left")
    for col in ("key", "requests", "tokens", "rejections"):
        table.add_column(col, justify="left" if col == "key" else "right")
    for name, k in keys.items():
        table.add_row(name, str(k["requests"]), str(k["tokens"]), str(k["rejections"]))
    return table


def frame(url: str, snap: dict):
    from rich.console import Group
    from rich.text import Text
    head = Text(f"superfluid top  {url}  snapshot {snap['seq']}", style="bold")
    if snap.get("coalesced"):
        head.append(f"  ({snap['coalesced']} snapshots skipped: the terminal was slow)", style="yellow")
    parts = [head] + [model_panel(name, view) for name, view in snap["models"].items()]
    if not snap["models"]:
        parts.append(Text("no models served"))
    if "keys" in snap:
        parts.append(keys_table(snap["keys"]))
    return Group(*parts)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    if not 100 <= args.interval_ms <= 5000:
        print("superfluid top: --interval-ms must be from 100 to 5000", file=sys.stderr)
        return 2
    console = Console() if sys.stdout.isatty() else Console(width=140)
    url = events_url(args.url, args.model, args.interval_ms)
    try:
        stream = open_stream(url, args.key)
        with stream:
            if args.once:
                for kind, data in events(stream):
                    if kind == "snapshot":
                        console.print(frame(args.url, data))
                        return 0
                raise TopError("the server closed the stream before sending a snapshot")
            if not console.is_terminal:  # a pipe or a file: one frame after another
                for kind, data in events(stream):
                    if kind == "snapshot":
                        console.print(frame(args.url, data))
                        sys.stdout.flush()
                raise TopError("the server closed the stream")
            from rich.live import Live
            with Live(console=console, screen=False, auto_refresh=False) as live:
                for kind, data in events(stream):
                    if kind == "snapshot":
                        live.update(frame(args.url, data), refresh=True)
            raise TopError("the server closed the stream")
    except TopError as exc:
        print(f"superfluid top: {exc}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError) as exc:
        print(f"superfluid top: the stream from {args.url} broke: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
