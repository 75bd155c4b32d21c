"""The HTTP front end (aiohttp): the OpenAI API, llama.cpp-style /infill, /health, /slots and
/metrics.

This module is the plugin's hooks; the front end itself is a folder per concern (``openai/``,
``prepare/``, ``keys/``, ``events/``, ``manage/``, ``info/``, ``cli/``), which
docs/architecture.md maps ("The HTTP front end")."""

from __future__ import annotations

import os

from superfluid.core.config import CORE_OPTIONS
from superfluid.core.errors import ConfigError
from superfluid.core.hookspecs import hookimpl

from .info.metrics import METRICS
from .options import MAX_FIM_CONTEXT, OPTIONS  # noqa: F401  (MAX_FIM_CONTEXT: by its old name too)
from .prepare.fim import FIM_MODEL_NAME


@hookimpl
def superfluid_add_config(schema):
    OPTIONS.declare(schema)


@hookimpl
def superfluid_configure(config):
    _check_policy(config)


def _check_policy(config):
    """Before any model loads: a bad key policy stops here (a ConfigError naming the line and the
    key), and so does an open door, a non-loopback --host with no key policy and no --insecure,
    --cors-origins '*' there without a key policy, and a TLS certificate or key that cannot serve."""
    from superfluid.core.tls import server_context
    from .cors import wildcard_refusal
    from .keys.auth import open_door
    from .keys.policy import load_policy
    opts = OPTIONS.of(config)
    if opts.key_policy:
        load_policy(opts.key_policy)
    core = CORE_OPTIONS.of(config)
    refusal = (open_door(core.host, opts.key_policy, bool(opts.insecure))
               or wildcard_refusal(opts.cors_origins, core.host, opts.key_policy))
    if refusal:
        raise ConfigError(f"refusing to start: {refusal}")
    server_context(core.ssl_certfile, core.ssl_keyfile)  # both or neither, readable, a matching pair


@hookimpl
def superfluid_add_commands(register):
    from .cli import keys, top
    register("keys", keys.HELP, keys.add_arguments, keys.run)
    register("top", top.HELP, top.add_arguments, top.run)


@hookimpl
def superfluid_add_models(register, config):
    """``--fim-model``: a model of its own for fill-in-the-middle requests, named ``fim``, with
    ``--fim-max-batch`` lanes and ``--fim-max-context``. This plugin sets only those two (the
    core's keys); every other model-scoped option is what its owner declared for an added model."""
    opts = OPTIONS.of(config)
    path = opts.fim_model
    if not path:
        return
    if any(m.name == FIM_MODEL_NAME for m in config.models):
        raise ConfigError(f"{config.source}: a model is already named {FIM_MODEL_NAME!r}; --fim-model needs that name")
    if not os.path.exists(path):
        raise ConfigError(f"--fim-model: file not found: {path}")
    register(FIM_MODEL_NAME, path, {"max-batch": opts.fim_max_batch,
                                    "max-context": opts.fim_max_context})  # 0: the engine's auto (at most 8192)


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
