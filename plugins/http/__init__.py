"""The HTTP front end (aiohttp): the OpenAI API, /health, /slots and /metrics."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.config import Option, in_range
from superfluid.core.hookspecs import hookimpl

from .metrics import METRICS


@hookimpl
def superfluid_add_config(schema):
    schema.add(Option("host", str, "127.0.0.1", "address to listen on", metavar="ADDR"))
    schema.add(Option("port", int, 8080, "port to listen on (0: any free port)", in_range(0, 65535), metavar="PORT"))
    schema.add(Option("http-default-qos", str, qos.DEFAULT_CLASS,
                      "QoS class for requests that name none", parse=lambda v: qos.resolve(v, param="http-default-qos"),
                      metavar="CLASS"))
    schema.add(Option("http-qos-header", bool, True,
                      "honor the x-superfluid-qos request header (--no-http-qos-header ignores it)"))


@hookimpl
def superfluid_frontends(config, daemon):
    from .frontend import HttpFrontend
    return [HttpFrontend(daemon, config)]


@hookimpl
def superfluid_tick_done(model, stats):
    METRICS.tick_done(model, stats)


@hookimpl
def superfluid_lane_finished(model, lane):
    METRICS.lane_finished(model, lane)
