"""The HTTP front end (aiohttp): the OpenAI API, llama.cpp-style /infill, /health, /slots and
/metrics.

This module is the plugin's hooks; the front end itself is a folder per concern (``openai/``,
``prepare/``, ``keys/``, ``events/``, ``manage/``, ``info/``, ``cli/``), which
docs/architecture.md maps ("The HTTP front end")."""

from __future__ import annotations

import os

from superfluid.core import qos
from superfluid.core.config import ModelConfig, Option, in_range
from superfluid.core.errors import ConfigError
from superfluid.core.hookspecs import hookimpl

from .info.metrics import METRICS
from .input_limits import STOP_CAP, TOOLS_CAP
from .keys.rate_limit import parse_rate
from .prepare.fim import FIM_MODEL_NAME

MAX_FIM_CONTEXT = 8192


def _rate(text: str) -> str:
    parse_rate(text)  # validates
    return text


@hookimpl
def superfluid_add_config(schema):
    schema.add(Option("host", str, "127.0.0.1", "address to listen on", metavar="ADDR"))
    schema.add(Option("port", int, 8080, "port to listen on (0: any free port)", in_range(0, 65535), metavar="PORT"))
    schema.add(Option("http-default-qos", str, qos.DEFAULT_CLASS,
                      "QoS class for requests that name none", parse=lambda v: qos.resolve(v, param="http-default-qos"),
                      metavar="CLASS"))
    schema.add(Option("http-qos-header", bool, True,
                      "honor the x-superfluid-qos request header (--no-http-qos-header ignores it)"))
    schema.add(Option("http-allow-batch-invariant", bool, False,
                      "allow x-superfluid-batch-invariant: true (such a lane ticks alone; any client "
                      "allowed to ask can serialize the server)"))
    schema.add(Option("http-open-probes", bool, False,
                      "with a key policy, let /metrics and /v1/models answer without a key too, like "
                      "/health (an inference gateway's endpoint picker and superfluid fleet read them "
                      "without one); keep such a node's port on a network only they reach"))
    schema.add(Option("max-body-mb", int, 16, "largest request body in MiB; larger is a 413 request_too_large",
                      in_range(1, 4096), metavar="MB"))
    schema.add(Option("max-header-kb", int, 16, "largest request head (request line and headers) in KiB; "
                      "larger is a 431", in_range(1, 1024), metavar="KB"))
    schema.add(Option("max-messages", int, 2048, "most messages in one request body (more: 400 naming messages)",
                      in_range(1, 1 << 20), metavar="N"))
    schema.add(Option("max-stop", int, 16, f"most stop strings in one request (more: 400 naming stop; at most "
                      f"{STOP_CAP})", in_range(1, STOP_CAP), metavar="N"))
    schema.add(Option("max-tools", int, 128, f"most tools in one request (more: 400 naming tools; at most "
                      f"{TOOLS_CAP})", in_range(1, TOOLS_CAP), metavar="N"))
    schema.add(Option("header-timeout", float, 10.0, "seconds a client has to send a request's head, from its "
                      "first byte (or the connection's opening); then 408 and the connection is closed",
                      in_range(0.1, 3600.0), metavar="S"))
    schema.add(Option("body-timeout", float, 60.0, "seconds a client has to send a request's body; then 408",
                      in_range(0.1, 3600.0), metavar="S"))
    schema.add(Option("keepalive-timeout", float, 15.0, "seconds an idle keep-alive connection stays open",
                      in_range(0.1, 3600.0), metavar="S"))
    schema.add(Option("max-connections", int, 1024, "open client connections at most; one more is a 503 "
                      "with Retry-After, closed at once", in_range(1, 1 << 20), metavar="N"))
    schema.add(Option("completion-rate", str, "10/s", "fill-in-the-middle requests per client: the token "
                      "bucket's refill rate (N/s, N/m, N/h)", parse=_rate, metavar="RATE"))
    schema.add(Option("completion-burst", int, 20, "fill-in-the-middle requests per client: the bucket's size",
                      in_range(1, 100000), metavar="N"))
    schema.add(Option("completion-deadline-ms", int, 0, "a fill-in-the-middle request not started within this "
                      "many ms fails fast (0: no deadline)", in_range(0, 3_600_000), metavar="MS"))
    schema.add(Option("fim-model", str, None, "run fill-in-the-middle requests on this dedicated model "
                      "(a GGUF with FIM tokens), with lanes of its own", metavar="PATH"))
    schema.add(Option("fim-max-batch", int, 2, "lanes of --fim-model", in_range(1, 256), metavar="N"))
    schema.add(Option("fim-max-context", int, 0, f"context of --fim-model (0: the model's, at most {MAX_FIM_CONTEXT})",
                      in_range(0, MAX_FIM_CONTEXT), metavar="N"))
    schema.add(Option("key-policy", str, None, "API keys and what each may do (TOML, [keys.NAME] tables; "
                      "see `superfluid keys new`); re-read on SIGHUP", metavar="FILE.toml"))
    schema.add(Option("insecure", bool, False, "serve a non-loopback --host without a --key-policy (anyone "
                      "who reaches the port may use every model and /admin)"))


@hookimpl
def superfluid_configure(config):
    _check_policy(config)
    _configure_fim(config)


def _check_policy(config):
    """Before any model loads: a bad key policy stops here (a ConfigError naming the line and the
    key), and so does an open door, a non-loopback --host with no key policy and no --insecure."""
    from .keys.auth import open_door
    from .keys.policy import load_policy
    if config.get("key-policy"):
        load_policy(config["key-policy"])
    refusal = open_door(config.get("host"), config.get("key-policy"), bool(config.get("insecure")))
    if refusal:
        raise ConfigError(f"refusing to start: {refusal}")


@hookimpl
def superfluid_add_commands(register):
    from .cli import keys, top
    register("keys", keys.HELP, keys.add_arguments, keys.run)
    register("top", top.HELP, top.add_arguments, top.run)


def _configure_fim(config):
    path = config.get("fim-model")
    if not path:
        return
    if any(m.name == FIM_MODEL_NAME for m in config.models):
        raise ConfigError(f"{config.source}: a model is already named {FIM_MODEL_NAME!r}; --fim-model needs that name")
    if not os.path.exists(path):
        raise ConfigError(f"--fim-model: file not found: {path}")
    values = dict(config.models[0].values) if config.models else {}
    values["max-batch"] = config["fim-max-batch"]
    values["max-context"] = config["fim-max-context"]  # 0: the engine's auto (at most 8192)
    values["class-lanes"] = {}
    config.models.append(ModelConfig(name=FIM_MODEL_NAME, path=path, engine=values.get("engine", "llamacpp"),
                                     values=values))


@hookimpl
def superfluid_add_frontends(register, config, daemon):
    from .frontend import HttpFrontend
    register(HttpFrontend(daemon, config))


@hookimpl
def superfluid_tick_done(model, stats):
    METRICS.tick_done(model, stats)  # (the wait for the event loop is the front end's LoopCatchup)


@hookimpl
def superfluid_lane_finished(model, lane):
    METRICS.lane_finished(model, lane)
