"""``superfluid fleet``: parse the configuration, then run the head until SIGTERM/SIGINT.

Start order: the first round of node polls (so SMG gets the nodes that answer at once), then
SMG, then the head's own port. Shutdown stops them in reverse, SMG by its process group."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import signal
import sys

from aiohttp import web

from superfluid.core.errors import ConfigError
from superfluid.core.tls import client_context, server_context

from .config import FleetConfig, add_arguments, from_args  # noqa: F401  (add_arguments: the hook's)
from .metrics import HeadMetrics
from .nodes import NodeMonitor
from .proxy import FleetApp
from .smg import Smg

HELP = "run the fleet head: SMG routes to several `superfluid serve` nodes; one /health and /metrics"
log = logging.getLogger("superfluid.fleet")


def run(args: argparse.Namespace) -> int:
    try:
        config = from_args(args)
    except ConfigError as exc:
        print(f"superfluid fleet: configuration error: {exc}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("smg") is None:
        print("superfluid fleet: SMG (Shepherd Model Gateway) is not installed; pip install 'superfluid[fleet]'",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        pass
    except OSError as exc:  # the port is taken, say
        print(f"superfluid fleet: {exc}", file=sys.stderr)
        return 1
    return 0


async def serve(config: FleetConfig) -> None:
    def on_change(healthy: list[str]) -> None:
        log.info("%d healthy node(s): %s", len(healthy), ", ".join(healthy) or "none")
        smg.nodes_changed()
        fleet.nodes_changed(healthy)  # the streams of a node that left end now

    nodes_tls = client_context(config.ssl_cafile)  # https:// nodes: the system's CAs, and this file's
    monitor = NodeMonitor(config.nodes, config.discovery_file, on_change, ssl=nodes_tls)
    smg = Smg(config.policy, config.smg_port, config.log_level,
              desired=lambda: {n.url: n.models for n in monitor.healthy() if n.models}, ca_file=config.ssl_cafile)
    fleet = FleetApp(smg, monitor, HeadMetrics(), config.policy, ssl=nodes_tls)
    tls = server_context(config.ssl_certfile, config.ssl_keyfile)  # the head's own port
    # handler_cancellation: a client that leaves cancels its upstream call, so the node frees the lane
    runner = web.AppRunner(fleet.make_app(), access_log=None, handle_signals=False, handler_cancellation=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await monitor.start()
    await smg.start()
    try:
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port, ssl_context=tls)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.port
        where = f"{'https' if tls is not None else 'http'}://{config.host}:{port}"
        log.info("fleet head on %s: %d node(s), policy %s, SMG on %s", where, len(monitor.nodes),
                 config.policy, smg.base)
        print(f"superfluid fleet: serving on {where}", file=sys.stderr, flush=True)
        await stop.wait()
        log.info("stopping the fleet head")
    finally:
        await runner.cleanup()
        await smg.stop()
        await monitor.stop()
