"""Configuration: TOML file → validated attrs objects, with a command-line flag for every key.

Keys are spelled as their flags (``max-batch`` / ``--max-batch``; ``max_batch`` is accepted in
TOML too). Precedence: built-in default < TOML < flag. Options scoped to a model can also be set
inside each ``[[models]]`` table."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable

import attrs

from .errors import ConfigError, SuperfluidError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

Check = Callable[[Any], "str | None"]


def in_range(lo: float | None = None, hi: float | None = None, *, also: tuple = ()) -> Check:
    def check(value):
        if isinstance(value, float) and not math.isfinite(value):  # NaN compares false with any bound
            return "must be a finite number"
        if value in also:
            return None
        if lo is not None and value < lo or hi is not None and value > hi:
            allowed = " or ".join(repr(a) for a in also)
            span = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            return f"must be {span}" + (f" (or {allowed})" if allowed else "")
        return None
    return check


def parse_fraction(text: str) -> float:
    """A share of something: ``0.85``, ``85`` or ``85%`` all mean 85 % (a number above 1 is read
    as a percentage)."""
    text = text.strip()
    percent = text.endswith("%")
    try:
        value = float(text[:-1] if percent else text)
    except ValueError:
        raise ConfigError(f"expected a fraction such as 0.85 or a percentage such as 85%, got {text!r}") from None
    return value / 100.0 if percent or value > 1.0 else value


@attrs.define(frozen=True)
class Option:
    """One option: its TOML key and flag name, type, default and help."""

    name: str
    type: type
    default: Any
    help: str
    check: Check | None = None
    model_scoped: bool = False
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # turns a flag/TOML string into the value

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


class Schema:
    """The options every plugin declared (through ``superfluid_add_config``)."""

    def __init__(self) -> None:
        self.options: dict[str, Option] = {}

    def add(self, option: Option) -> None:
        if option.name in self.options:
            raise ValueError(f"option {option.name!r} declared twice")
        self.options[option.name] = option

    def lookup(self, key: str) -> Option | None:
        return self.options.get(key.replace("_", "-"))


@attrs.define
class ModelConfig:
    """One model to serve: its name, file and engine, and model-scoped option values."""

    name: str
    path: str
    engine: str
    values: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


@attrs.define
class Config:
    values: dict[str, Any]
    models: list[ModelConfig]
    plugins: list[str]
    source: str = "defaults"

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


def core_options() -> list[Option]:
    """The core's own options: models and the scheduler's knobs."""
    return [
        Option("model", str, None, "model file (GGUF) or directory to serve; default: SmolLM2-135M-Instruct", metavar="PATH"),
        Option("model-name", str, None, "name clients use for --model (default: the file's stem)", metavar="NAME"),
        Option("engine", str, "llamacpp", "engine adapter for --model", model_scoped=True, metavar="NAME"),
        Option("max-batch", int, 8, "concurrent lanes per model", in_range(1, 256), model_scoped=True, metavar="N"),
        Option("embedding-only", bool, False, "serve the model for /v1/embeddings only: chat and completions "
               "requests for it are refused with a 400", model_scoped=True),
        Option("max-context", int, 0, "per-lane context window in tokens (0: the model's, at most 8192)",
               in_range(0, 1 << 20), model_scoped=True, metavar="N"),
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
        Option("threads", int, 0, "engine compute threads (0: one per physical core)", in_range(0, 512),
               model_scoped=True, metavar="N"),
        Option("state-dir", str, None, "directory for session logs and park artifacts; sessions and their "
               "KV survive a restart (default: sessions live in memory only)", metavar="DIR"),
        Option("session-overflow", str, "truncate", "a session turn whose history no longer fits the context: "
               "'truncate' leaves the oldest messages out of the prompt (keeping the system prompt and the first "
               "user message) until it fills half the context; 'error' answers 400 context_length_exceeded",
               lambda v: None if v in ("truncate", "error") else "must be truncate or error", metavar="POLICY"),
        Option("shutdown-timeout", float, 30.0, "on SIGTERM/SIGINT, seconds to let running requests finish "
               "and persist sessions before exiting", in_range(0.0, 3600.0), metavar="S"),
        Option("log-level", str, "info", "logging level",
               lambda v: None if v.lower() in ("debug", "info", "warning", "error") else "must be debug, info, warning or error"),
    ]


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "a table"}


def _coerce(option: Option, value: Any, where: str) -> Any:
    if option.parse is not None:
        if isinstance(value, dict) and option.type is dict:  # a TOML table: {background = 2}
            value = ",".join(f"{k}={v}" for k, v in value.items())
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ConfigError(f"{where}: {option.name} must be a string, got {value!r}")
        try:
            value = option.parse(str(value))
        except (ValueError, ConfigError, SuperfluidError) as exc:
            raise ConfigError(f"{where}: {option.name}: {getattr(exc, 'message', exc)}") from None
    elif option.type is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, option.type) and not (option.type is int and isinstance(value, bool))
    if option.parse is None and not ok and value is not None:
        raise ConfigError(f"{where}: {option.name} must be {_TYPE_NAMES.get(option.type, option.type.__name__)}, got {value!r}")
    if option.check is not None and value is not None:
        problem = option.check(value)
        if problem:
            raise ConfigError(f"{where}: {option.name} {problem}, got {value!r}")
    return value


def add_flags(parser: argparse.ArgumentParser, schema: Schema) -> None:
    for opt in schema.options.values():
        flag = "--" + opt.name
        if opt.type is bool:
            parser.add_argument(flag, dest=opt.dest, action=argparse.BooleanOptionalAction,
                                default=None, help=f"{opt.help} (default: {'on' if opt.default else 'off'})")
        elif opt.type is list and opt.parse is None:
            parser.add_argument(flag, dest=opt.dest, action="append", default=None,
                                metavar=opt.metavar, help=opt.help)
        else:
            conv = str if opt.parse is not None or opt.type is list else opt.type
            default_txt = "" if opt.default in (None, "") else f" (default: {opt.default})"
            parser.add_argument(flag, dest=opt.dest, type=conv, default=None,
                                metavar=opt.metavar, help=opt.help + default_txt)


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
    values = {name: opt.default for name, opt in schema.options.items()}
    toml = dict(toml)
    plugins = toml.pop("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) for p in plugins):
        raise ConfigError(f"{source}: plugins must be a list of module names")
    model_tables = toml.pop("models", [])
    if not isinstance(model_tables, list) or not all(isinstance(t, dict) for t in model_tables):
        raise ConfigError(f"{source}: models must be an array of tables ([[models]])")
    for key, raw in toml.items():
        opt = schema.lookup(key)
        if opt is None:
            raise ConfigError(f"{source}: unknown key {key!r}" + _suggest(key, schema))
        values[opt.name] = _coerce(opt, raw, source)
    for dest, raw in flags.items():
        if raw is None:
            continue
        opt = schema.lookup(dest)
        values[opt.name] = _coerce(opt, raw, "--" + opt.name)

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
            mvalues[opt.name] = _coerce(opt, raw, where)
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
    return Config(values=values, models=models, plugins=plugins, source=source)


def _stem(path: str) -> str:
    import os
    base = os.path.basename(path.rstrip("/"))
    return base[:-5] if base.endswith(".gguf") else base


def _suggest(key: str, schema: Schema) -> str:
    import difflib
    close = difflib.get_close_matches(key.replace("_", "-"), list(schema.options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
