"""The QoS options: class lane caps, lanes left to urgent classes and quiet ticks, read back typed:
``OPTIONS.of(settings).class_lanes``."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.config import CORE_OPTIONS
from superfluid.core.options import Option, PluginOptions, in_range
from superfluid.core.errors import ConfigError


def parse_class_lanes(text: str) -> dict[str, int]:
    """``background=2,agent=6`` → {"background": 2, "agent": 6} (aliases accepted)."""
    caps: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"expected CLASS=N, got {part!r}")
        canonical = qos.ALIASES.get(name.strip().lower())
        if canonical is None:
            raise ConfigError(f"unknown QoS class {name.strip()!r} (classes: {', '.join(qos.CLASSES)})")
        try:
            caps[canonical] = int(value)
        except ValueError:
            raise ConfigError(f"{part!r}: the cap must be an integer") from None
    return caps


OPTIONS = PluginOptions("qos", [
    # Caps are counted in one model's lanes: a model another plugin adds (superfluid_add_models,
    # the HTTP front end's --fim-model) does not inherit the first model's, it has none.
    Option("class-lanes", dict, {}, "cap the lanes a class may hold, e.g. background=2,agent=6 "
           "(each between 1 and --max-batch)", model_scoped=True, metavar="CLASS=N,...",
           parse=parse_class_lanes, inherit=False),
    Option("urgent-lanes", int, 1, "lanes that media lanes below the urgent classes leave to them: a "
           "background or agent request with an image is admitted only while the lanes that cannot be "
           "preempted (media, batch-invariant) stay at most --max-batch minus this many, so an interactive or "
           "completion request always finds a lane free or one it may preempt (0: off; with --max-batch 1 the "
           "one lane is anyone's)", in_range(0, 256), model_scoped=True, metavar="N"),
    Option("quiet-ticks", bool, False, "with a lane free but nothing queued or prefilling and no client "
           "reading before a reply ends, run ticks to the busy target and end one at the engine's next "
           "step when a request arrives (engines that can stop mid-tick); off: every tick with a lane "
           "free aims at the engine's free-lane target (50 ms on llama.cpp and MLX)", model_scoped=True),
])


def check_caps(config) -> None:
    """Caps must be between 1 and each model's --max-batch."""
    for model in config.models:
        caps = OPTIONS.of(model).class_lanes or {}
        max_batch = CORE_OPTIONS.of(model).max_batch
        for cls, cap in caps.items():
            if not 1 <= cap <= max_batch:
                raise ConfigError(f"{config.source}: class-lanes: {cls}={cap} must be between 1 and "
                                  f"--max-batch ({max_batch}) for model {model.name or 'default'!r}")
