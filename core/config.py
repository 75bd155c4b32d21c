"""Configuration: TOML file → validated attrs objects, with a command-line flag for every key.

Keys are spelled as their flags (``max-batch`` / ``--max-batch``; ``max_batch`` is accepted in
TOML too). Precedence: built-in default < TOML < flag. Options scoped to a model can also be set
inside each ``[[models]]`` table. What an option is, and who owns it, is :mod:`.options`'; the
one loading path (:func:`option_values`) serves ``superfluid serve`` and ``superfluid fleet``."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Mapping, Protocol

import attrs

from .adapters import lora_options
from .errors import ConfigError, SuperfluidError
from .kv_context_options import kv_context_options
from .options import CORE, Check, Option, PluginOptions, Schema, in_range, parse_fraction  # noqa: F401

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@attrs.define
class ModelConfig:
    """One model to serve: its name, file and engine, and model-scoped option values."""

    name: str
    path: str
    engine: str
    values: dict[str, Any]
    _typed: dict = attrs.field(factory=dict, init=False, repr=False, eq=False)  # PluginOptions.of's

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


@attrs.define
class Config:
    """The validated configuration: top-level values, the models to serve, extra plugins, where
    it came from, and the :class:`Schema` it was validated against (None for one built by hand).

    A plugin reads its options through its :class:`PluginOptions` (``OPTIONS.of(config)``); the
    core's are ``CORE_OPTIONS.of(config)`` (or ``.of(model)``)."""

    values: dict[str, Any]
    models: list[ModelConfig]
    plugins: list[str]
    source: str = "defaults"
    schema: Schema | None = attrs.field(default=None, repr=False, eq=False)
    _typed: dict = attrs.field(factory=dict, init=False, repr=False, eq=False)  # PluginOptions.of's

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``45s``, ``30m``, ``12h`` or ``7d``."""
    text = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}.get(text[-1:], None)
    try:
        return float(text[:-1] if scale else text) * (scale or 1.0)
    except ValueError:
        raise ConfigError(f"expected seconds or a duration such as 45s, 30m, 12h or 7d, got {text!r}") from None


def _one_of(*values: str) -> Check:
    def check(value):
        return None if value in values else f"must be one of {', '.join(values)}"
    return check


def core_options() -> list[Option]:
    """The core's own options: models and the scheduler's knobs."""
    return [
        Option("model", str, None, "model file (GGUF) or directory to serve; default: SmolLM2-135M-Instruct", metavar="PATH"),
        Option("model-name", str, None, "name clients use for --model (default: the file's stem)", metavar="NAME"),
        Option("engine", str, "llamacpp", "engine adapter for --model", model_scoped=True, metavar="NAME"),
        Option("max-batch", int, 8, "concurrent lanes per model", in_range(1, 256), model_scoped=True, metavar="N"),
        Option("embedding-only", bool, False, "serve the model for /v1/embeddings only: chat and completions "
               "requests for it are refused with a 400", model_scoped=True),
        Option("mmproj", str, None, "the model's vision half (a llama.cpp mmproj GGUF), so that it takes images; "
               "default: the one mmproj*.gguf beside the model file, if there is one", model_scoped=True, metavar="PATH"),
        Option("image-encoding", str, "admission", "where a vision model encodes images: admission (on a "
               "background thread of the engine's process, from the first tick that plans the lane, while other "
               "lanes step) or tick (on the tick thread when the lane's feed reaches the image: every lane waits "
               "for the encode)", _one_of("admission", "tick"), model_scoped=True, metavar="admission|tick"),
        Option("max-context", int, 0, "per-lane context window in tokens (0: the model's, at most 8192)",
               in_range(0, 1 << 20), model_scoped=True, metavar="N"),
        *kv_context_options(),  # kv-bits, rope-*, yarn-*, allow-long-context: every engine reads them
        *lora_options(),  # --lora NAME=PATH[:SCALE] (core/adapters.py)
        Option("prefill-budget", int, 4096, "prompt tokens per tick across lanes, 64-4096; 0 selects the adaptive controller",
               in_range(64, 4096, also=(0,)), model_scoped=True, metavar="N"),
        Option("tick-decode-budget", int, 0, "decode tokens per tick across lanes; 0 scales with the grant",
               in_range(0), model_scoped=True, metavar="N"),
        Option("tick-target-ms", int, 2000, "tick duration while every lane is busy (engines may cap it)",
               in_range(1, 60000), model_scoped=True, metavar="N"),
        Option("max-queue", int, 256, "queued requests per QoS class per model; one more is a 429 queue_full "
               "with Retry-After", in_range(1, 1 << 20), model_scoped=True, metavar="N"),
        Option("starvation-ticks", int, 8, "starvation bound and queue aging period, in ticks",
               in_range(1, 100000), model_scoped=True, metavar="N"),
        Option("pressure-high", float, 0.85, "KV pool occupancy (of the cells lanes can hold) at which "
               "cached prefixes are evicted (0.85, or 85 as a percentage)", in_range(0.05, 1.0), model_scoped=True,
               metavar="FRACTION", parse=parse_fraction),
        Option("pressure-low", float, 0.70, "occupancy that eviction brings the KV pool down to",
               in_range(0.0, 1.0), model_scoped=True, metavar="FRACTION", parse=parse_fraction),
        Option("park", bool, False, "park a preempted lane's KV in host memory and restore it on resume "
               "(otherwise it prefills prompt + generated tokens again)", model_scoped=True),
        Option("host-cache-mb", int, 1024, "host memory for prefixes evicted from the KV pool (0: none)",
               in_range(0, 1 << 24), model_scoped=True, metavar="MB"),
        Option("pin-prompt", list, [], "a prompt prefix (raw text, special tokens parsed, e.g. a shared "
               "system prompt) whose cached KV is evicted last; repeat for several",
               lambda v: None if all(isinstance(x, str) and x for x in v) else "must be non-empty strings",
               model_scoped=True, metavar="TEXT"),
        Option("chat-template-file", str, None, "a Jinja chat template file that replaces the model's own (or "
               "gives one to a model without)", model_scoped=True, metavar="PATH"),
        Option("chat-template", str, None, "a built-in chat template by name that replaces the model's own "
               "(`superfluid template list` names them)", model_scoped=True, metavar="NAME"),
        Option("tool-call-parser", str, "auto", "how tool calls are read from the model's replies: a family's "
               "format by name (`superfluid template list`), 'none', or 'auto' (detected from the chat template)",
               model_scoped=True, metavar="NAME"),
        Option("reasoning-parser", str, "auto", "how a reasoning model's reply is split into its reasoning and "
               "its answer: a family's span by name ('think' for <think>...</think>; `superfluid template list`), "
               "'none' (all answer), or 'auto' (detected from the chat template)",
               model_scoped=True, metavar="NAME"),
        Option("threads", int, 0, "engine compute threads (0: one per physical core)", in_range(0, 512),
               model_scoped=True, metavar="N"),
        Option("state-dir", str, None, "directory for session logs and park artifacts; sessions and their "
               "KV survive a restart (default: sessions live in memory only)", metavar="DIR"),
        Option("session-overflow", str, "truncate", "a session turn whose history no longer fits the context: "
               "'truncate' leaves the oldest messages out of the prompt (keeping the system prompt and the first "
               "user message) until it fills half the context; 'error' answers 400 context_length_exceeded",
               lambda v: None if v in ("truncate", "error") else "must be truncate or error", metavar="POLICY"),
        Option("responses-ttl", float, 30 * 86400.0, "seconds a stored response (Responses API, store: true) is "
               "kept after it was created, then it is a 404 and, once its conversation holds no stored response, "
               "the conversation's log and park artifact are deleted; a suffix s, m, h or d names the unit "
               "(12h, 7d); 0: kept until --responses-max evicts it", in_range(0.0), metavar="DURATION",
               parse=parse_duration),
        Option("responses-max", int, 10000, "most stored responses kept; over it the oldest is evicted first "
               "(0: no cap)", in_range(0), metavar="N"),
        Option("shutdown-timeout", float, 30.0, "on SIGTERM/SIGINT, seconds to let running requests finish "
               "and persist sessions before exiting", in_range(0.0, 3600.0), metavar="S"),
        Option("log-level", str, "info", "logging level",
               lambda v: None if v.lower() in ("debug", "info", "warning", "error") else "must be debug, info, warning or error"),
        # Knobs more than one plugin reads are the core's (a plugin reads no other plugin's key).
        Option("host", str, "127.0.0.1", "address to listen on", metavar="ADDR"),  # the front end; KV events' topic
        Option("port", int, 8080, "port to listen on (0: any free port)", in_range(0, 65535), metavar="PORT"),
        # TLS on that port: the front end's, and `superfluid fleet`'s options of the same names
        Option("ssl-certfile", str, None, "serve HTTPS with this PEM certificate (chain); needs --ssl-keyfile",
               metavar="FILE.pem"),
        Option("ssl-keyfile", str, None, "the PEM private key of --ssl-certfile (unencrypted)", metavar="FILE.pem"),
        Option("kv-pool-cells", int, 0, "cells (tokens) in an engine's shared KV pool, at least --max-context. "
               "llama.cpp: the pool of --kv-unified, sliding-window and recurrent models (0: lanes × context, "
               "capped by free memory); in a pool smaller than lanes × context, lanes beyond what it holds queue. "
               "basert: its paged pool's tokens", in_range(0, 1 << 24), model_scoped=True, metavar="N"),
        Option("kv-events-block-size", int, 16, "tokens per block of a cached prefix: the blocks KV events "
               "publish (the scorer's blockSizeTokens; a partial last block is not published) and the unit "
               "/metrics counts the KV of an engine without pages in", in_range(1, 4096), metavar="N"),
    ]


CORE_OPTIONS = PluginOptions(CORE, core_options())
"""The core's options, typed: ``CORE_OPTIONS.of(model).max_batch``, ``CORE_OPTIONS.of(config).host``."""


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "a table"}


def coerce(option: Option, value: Any, label: str) -> Any:
    """``value`` (from TOML or a flag) as ``option``'s type, checked; errors begin with ``label``,
    the place and the key (``superfluid.toml: max-batch``, ``--max-batch``)."""
    if option.parse is not None and option.type is list:
        if not isinstance(value, list):
            raise ConfigError(f"{label} must be a list, got {value!r}")
        # a TOML list's items are named by index; a repeated flag's by the value its error quotes
        value = [_parsed(option, item, label if label.startswith("--") else f"{label}[{i}]")
                 for i, item in enumerate(value)]
    elif option.parse is not None:
        if isinstance(value, dict) and option.type is dict:  # a TOML table: {background = 2}
            value = ",".join(f"{k}={v}" for k, v in value.items())
        value = _parsed(option, value, label)
    elif option.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, option.type) and not (option.type is int and isinstance(value, bool))
    if option.parse is None and not ok and value is not None:
        raise ConfigError(f"{label} must be {_TYPE_NAMES.get(option.type, option.type.__name__)}, got {value!r}")
    if option.check is not None and value is not None:
        problem = option.check(value)
        if problem:
            raise ConfigError(f"{label} {problem}, got {value!r}")
    return value


def _parsed(option: Option, value: Any, label: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{label} must be a string, got {value!r}")
    try:
        return option.parse(str(value))
    except (ValueError, ConfigError, SuperfluidError) as exc:
        raise ConfigError(f"{label}: {getattr(exc, 'message', exc)}") from None


def add_flags(parser: argparse.ArgumentParser, schema: Schema) -> None:
    """A flag per option (``--no-NAME`` too for a bool; a list's flag repeats), default None:
    :func:`option_values` takes what was given."""
    for opt in schema.options.values():
        flag = opt.flag_name
        if opt.type is bool:
            parser.add_argument(flag, dest=opt.dest, action=argparse.BooleanOptionalAction,
                                default=None, help=f"{opt.help} (default: {'on' if opt.default else 'off'})")
        elif opt.type is list:
            parser.add_argument(flag, dest=opt.dest, action="append", default=None,
                                metavar=opt.metavar, help=opt.help)
        else:
            conv = str if opt.parse is not None else opt.type
            default_txt = "" if opt.default in (None, "") else f" (default: {opt.default})"
            parser.add_argument(flag, dest=opt.dest, type=conv, default=None,
                                metavar=opt.metavar, help=opt.help + default_txt)


def option_values(schema: Schema, table: Mapping[str, Any], flags: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Defaults < ``table`` (a TOML table: keys with ``-`` or ``_``) < ``flags`` (by dest; None:
    not given), every value validated; the keys of the result are the options' names. ``where``
    begins an error about a table key (``"superfluid.toml: "``, ``"fleet.toml: [fleet] "``)."""
    values = {name: opt.default for name, opt in schema.options.items()}
    for key, raw in table.items():
        opt = schema.lookup(key)
        if opt is None:
            raise ConfigError(f"{where}unknown key {key!r}" + _suggest(key, schema))
        values[opt.name] = coerce(opt, raw, where + opt.name)
    for dest, raw in flags.items():
        if raw is None:
            continue
        opt = schema.lookup(dest)
        values[opt.name] = coerce(opt, raw, opt.flag_name)
    return values


def read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses once per nesting level
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None


def build_config(schema: Schema, toml: dict, flags: dict[str, Any], source: str = "defaults") -> Config:
    """Merge defaults, the TOML table and explicit flags into a validated :class:`Config`."""
    toml = dict(toml)
    plugins = toml.pop("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{source}: plugins must be a list of module names")
    model_tables = toml.pop("models", [])
    if not isinstance(model_tables, list) or not all(isinstance(t, dict) for t in model_tables):
        raise ConfigError(f"{source}: models must be an array of tables ([[models]])")
    values = option_values(schema, toml, flags, f"{source}: ")

    scoped = {n: values[n] for n, o in schema.options.items() if o.model_scoped}
    models: list[ModelConfig] = []
    for i, table in enumerate(model_tables):
        where = f"{source}: models[{i}]"
        table = dict(table)
        path = table.pop("path", None)
        name = table.pop("name", None)
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{where}: path is required (a model file or directory)")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"{where}: name must be a non-empty string, got {name!r}")
        mvalues = dict(scoped)
        for key, raw in table.items():
            opt = schema.lookup(key)
            if opt is None or not opt.model_scoped:
                raise ConfigError(f"{where}: unknown model key {key!r}" + _suggest(key, schema))
            mvalues[opt.name] = coerce(opt, raw, f"{where}: {opt.name}")
        models.append(ModelConfig(name=name or _stem(path), path=path, engine=mvalues["engine"], values=mvalues))
    if values.get("model") or not models:
        # --model (or nothing configured: the default model, resolved at startup) comes first.
        path = values.get("model") or ""
        models.insert(0, ModelConfig(name=values.get("model-name") or (_stem(path) if path else ""),
                                     path=path, engine=scoped["engine"], values=dict(scoped)))
    for m in models:
        if m.values["pressure-low"] >= m.values["pressure-high"]:
            raise ConfigError(f"{source}: pressure-low ({m.values['pressure-low']}) must be below "
                              f"pressure-high ({m.values['pressure-high']})")
    names = [m.name for m in models if m.name]
    if len(names) != len(set(names)):
        raise ConfigError(f"{source}: two models share a name: {names}")
    return Config(values=values, models=models, plugins=plugins, source=source, schema=schema)


class ModelRegistrar(Protocol):
    """``superfluid_add_models``'s ``register``: adds a model and returns its configuration."""

    def __call__(self, name: str, path: str, values: Mapping[str, Any] | None = None) -> ModelConfig: ...


def model_registrar(config: Config) -> ModelRegistrar:
    """The ``register`` that ``superfluid_add_models`` hands plugins, adding to ``config.models``.

    ``register(name, path, values=None)``: ``values`` sets model-scoped options by key (the
    core's, such as ``max-batch``, and the registering plugin's own), validated as a
    ``[[models]]`` table's are. Every other model-scoped option is left to its owner's
    declaration: the first configured model's value, or the declared default for an option
    declared ``inherit=False``. Why: a plugin adding a model knows the knobs it sets, not the
    options of plugins it may not even know; the owner knows whether its value describes the
    deployment (threads, park, an engine's settings: inherited, as the user configured them) or
    one model's shape (class lane caps sized for that model's lanes: its default)."""
    if config.schema is None:
        raise ConfigError("a Config built without its Schema cannot add models")
    schema = config.schema

    def register(name: str, path: str, values: Mapping[str, Any] | None = None) -> ModelConfig:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{config.source}: a model needs a non-empty name, got {name!r}")
        if any(m.name == name for m in config.models):
            raise ConfigError(f"{config.source}: a model is already named {name!r}")
        first = config.models[0].values if config.models else {}
        mvalues = {n: first.get(n, o.default) if o.inherit else o.default
                   for n, o in schema.options.items() if o.model_scoped}
        for key, raw in (values or {}).items():
            opt = schema.lookup(key)
            if opt is None or not opt.model_scoped:
                raise ConfigError(f"model {name!r}: unknown model key {key!r}" + _suggest(key, schema))
            mvalues[opt.name] = coerce(opt, raw, f"model {name!r}: {opt.name}")
        model = ModelConfig(name=name, path=path, engine=mvalues["engine"], values=mvalues)
        config.models.append(model)
        return model

    return register


def _stem(path: str) -> str:
    import os
    base = os.path.basename(path.rstrip("/"))
    return base[:-5] if base.endswith(".gguf") else base


def _suggest(key: str, schema: Schema) -> str:
    import difflib
    close = difflib.get_close_matches(key.replace("_", "-"), list(schema.options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
