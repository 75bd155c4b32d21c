"""Options: what one is (:class:`Option`), who declared which (:class:`Schema`), and a plugin's
options read back as one typed object (:class:`PluginOptions`).

Every option belongs to the core or to the one plugin that declared it. A plugin reads its own
options, never another plugin's key: a knob two plugins share is the core's (``max-batch``,
``kv-pool-cells``, ``host``). The loading (TOML, flags, validation) is :mod:`.config`'s."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import attrs

from .errors import ConfigError

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
    """One option: its TOML key and flag name, type, default and help.

    ``parse`` turns a flag or TOML string into the value (for a ``list`` option, each item).
    ``flag`` names the flag when it is not the key (``superfluid fleet``'s repeatable ``--node``
    for ``nodes = [...]``). ``inherit`` is for a model-scoped option: a model that a plugin adds
    (``superfluid_add_models``) takes the first configured model's value, or, with
    ``inherit=False``, the declared default (a value sized for one model, such as the qos
    plugin's ``class-lanes``, whose caps are counted in that model's lanes)."""

    name: str
    type: type
    default: Any
    help: str
    check: Check | None = None
    model_scoped: bool = False
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # turns a flag/TOML string into the value
    flag: str | None = None
    inherit: bool = True

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def flag_name(self) -> str:
        return "--" + (self.flag or self.name)


CORE = "core"
"""The owner :class:`Schema` records for the core's own options."""


class Schema:
    """The options every plugin declared (through ``superfluid_add_config``), and who declared
    each: ``owner(name)`` is the plugin's name (or ``"core"``). A :class:`PluginOptions` names its
    owner; a plain ``schema.add(Option(...))`` gets the name of the plugin whose hook is running
    (:func:`superfluid.core.cli.declare_options` calls them one plugin at a time), else None."""

    def __init__(self) -> None:
        self.options: dict[str, Option] = {}
        self.owners: dict[str, str | None] = {}
        self._declaring: str | None = None

    def add(self, option: Option, owner: str | None = None) -> None:
        if option.name in self.options:
            raise ValueError(f"option {option.name!r} declared twice")
        self.options[option.name] = option
        self.owners[option.name] = owner or self._declaring

    @contextlib.contextmanager
    def declaring(self, owner: str) -> Iterator[None]:
        """Options added meanwhile without an owner are ``owner``'s."""
        before, self._declaring = self._declaring, owner
        try:
            yield
        finally:
            self._declaring = before

    def lookup(self, key: str) -> Option | None:
        return self.options.get(key.replace("_", "-"))

    def owner(self, name: str) -> str | None:
        return self.owners.get(name.replace("_", "-"))

    def __iter__(self) -> Iterator[Option]:
        return iter(self.options.values())


def _options_class(owner: str, options: tuple[Option, ...], suffix: str = "") -> type:
    name = "".join(part.capitalize() for part in owner.replace("-", "_").split("_")) + suffix + "Options"
    fields = {o.dest: attrs.field(type=o.type) for o in options}
    return attrs.make_class(name, fields, frozen=True, slots=True)


class PluginOptions:
    """A plugin's options, declared once and read back as one frozen, typed object::

        OPTIONS = PluginOptions("llamacpp", [Option("kv-unified", bool, False, "...", model_scoped=True)])

        @hookimpl
        def superfluid_add_config(schema):
            OPTIONS.declare(schema)                # each option, recorded as the plugin's own

        OPTIONS.of(model).kv_unified               # in the engine: this model's value, a bool

    :meth:`of` reads the validated values: the fields are the options' names with ``_`` for
    ``-``, each of its declared type. The object is built by the core's machinery, so a plugin
    never spells a key (its own or another's) to read a value; iterating over a
    ``PluginOptions`` gives its :class:`Option` declarations."""

    def __init__(self, owner: str, options: list[Option] | tuple[Option, ...]) -> None:
        self.owner = owner
        self.options = tuple(options)
        self.cls = _options_class(owner, self.options)
        scoped = tuple(o for o in self.options if o.model_scoped)
        self.model_cls = self.cls if len(scoped) == len(self.options) else _options_class(owner, scoped, "Model")
        self._scoped = scoped

    def __iter__(self) -> Iterator[Option]:
        return iter(self.options)

    def declare(self, schema: Schema) -> None:
        """Add every option to ``schema`` as this plugin's (call it in ``superfluid_add_config``)."""
        for option in self.options:
            schema.add(option, owner=self.owner)

    def of(self, source: Any) -> Any:
        """This plugin's options, typed (an instance of :attr:`cls` or :attr:`model_cls`), from:

        - a :class:`~superfluid.core.config.Config`: every option, at the top level (a
          model-scoped option's top-level value is what models that do not set it take);
        - a :class:`~superfluid.core.config.ModelConfig` or the
          :class:`~superfluid.core.settings.SchedulerSettings` a hook receives: the model-scoped
          options only, as that model has them (:attr:`model_cls`);
        - a plain mapping of key to value (a test's configuration): every option.

        An option missing from the source (or None) reads as its declared default. An object
        this method returned is returned as it is, so a function may take either. A Config's
        and a ModelConfig's values are fixed once validated: their typed object is built once."""
        if isinstance(source, (self.cls, self.model_cls)):
            return source
        cache = getattr(source, "_typed", None)  # a Config's or ModelConfig's: built once per plugin
        if cache is not None:
            hit = cache.get(self)
            if hit is None or hit[0] is not source.values:
                hit = cache[self] = (source.values, self._read(source))
            return hit[1]
        return self._read(source)

    def _read(self, source: Any) -> Any:
        values = getattr(source, "values", None)
        if isinstance(values, Mapping) and hasattr(source, "models"):  # a Config
            return self._build(self.cls, self.options, values)
        scoped = values if isinstance(values, Mapping) else getattr(source, "extra", None)
        if isinstance(scoped, Mapping):  # a ModelConfig or SchedulerSettings
            if not self._scoped:
                raise TypeError(f"{self.owner} declares no model-scoped option; read its options from the Config")
            return self._build(self.model_cls, self._scoped, scoped)
        if isinstance(source, Mapping):
            return self._build(self.cls, self.options, source)
        raise TypeError(f"cannot read {self.owner}'s options from {type(source).__name__}")

    @staticmethod
    def _build(cls: type, options: tuple[Option, ...], values: Mapping) -> Any:
        out = {}
        for o in options:
            value = values.get(o.name)
            out[o.dest] = o.default if value is None else value
        return cls(**out)
