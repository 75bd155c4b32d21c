"""A model's LoRA adapters: which are served, under which names and ids, and their loads and
unloads, carried out by the engine at the start of a tick (``TickPlan.load_adapters`` /
``unload_adapters``).

Why here and not in the engine: a request may name an adapter only while it is served, an
unload must wait until no lane runs (or waits) under the adapter, and a load's answer (success,
or ``TickResult.adapter_errors``) goes back to whoever asked. Those are questions of the
model's queue and lanes, which the loop holds under its lock; the engine only applies the file.

An adapter's id is given once and never reused (the configured adapters get 0, 1, ... in their
order, as llama-server numbers its ``--lora`` files), so a client's ``lora: [{"id": 1}]`` never
silently means another adapter after one is unloaded."""

from __future__ import annotations

import logging
import os
import threading

import attrs

from .errors import ConfigError, SuperfluidError
from .options import Option
from .request import AdapterSet

log = logging.getLogger("superfluid.adapters")


class AdapterNotFound(SuperfluidError):
    """A request names an adapter this model does not serve (or serves no longer)."""

    status = 404
    type = "invalid_request_error"
    code = "adapter_not_found"


class AdapterConflict(SuperfluidError):
    status = 409
    type = "invalid_request_error"
    code = "adapter_exists"


@attrs.frozen
class LoraSpec:
    """One ``--lora NAME=PATH[:SCALE]``: the adapter's name, its GGUF (or PEFT directory) and the
    scale a request gets when it selects the adapter without one."""

    name: str
    path: str
    scale: float = 1.0


def parse_lora(text: str) -> LoraSpec:
    """``NAME=PATH`` or ``NAME=PATH:SCALE`` (the last ``:`` followed by a number is the scale, so
    a path may hold colons)."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"expected NAME=PATH[:SCALE], got {text!r}")
    name, _, rest = text.partition("=")
    name, rest = name.strip(), rest.strip()
    scale = 1.0
    head, sep, tail = rest.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
            rest = head
        except ValueError:
            pass
    check_name(name)
    if not rest:
        raise ConfigError(f"expected NAME=PATH[:SCALE], got {text!r}: the path is empty")
    if not (scale == scale and abs(scale) < 1e6):
        raise ConfigError(f"{text!r}: the scale must be a finite number")
    return LoraSpec(name=name, path=rest, scale=scale)


def check_name(name: str) -> None:
    """An adapter's name: what follows ``MODEL:`` in a model name, so no ``:``, ``/`` or spaces."""
    if not name or any(c in name for c in ":/ \t=") or len(name) > 128:
        raise ConfigError(f"an adapter's name must be 1-128 characters without ':', '/', '=' or spaces, got {name!r}")


def check_specs(specs: list) -> str | None:
    """The option's check: names given once."""
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    return f"names {', '.join(twice)} more than once" if twice else None


def lora_options() -> list[Option]:
    """``--lora``, for :func:`superfluid.core.config.core_options` (every engine reads it: one
    that serves no adapters refuses it at start, naming itself)."""
    return [Option("lora", list, [], "a LoRA adapter to serve with this model, NAME=PATH[:SCALE] (a GGUF LoRA; "
                   "SCALE, default 1, is what a request selecting it without a scale gets); repeat for several. "
                   "Requests select it as model MODEL:NAME or by llama-server's lora field; "
                   "engines llamacpp, mlx, basert", check_specs, model_scoped=True, metavar="NAME=PATH[:SCALE]",
                   parse=parse_lora)]


@attrs.define(eq=False)
class Adapter:
    name: str
    path: str
    id: int
    scale: float = 1.0          # a request's scale when it selects this adapter without one
    global_scale: float = 0.0   # applied to requests naming the base model without a ``lora`` field
    state: str = "loading"      # loading | ready | unloading
    error: str | None = None
    done: threading.Event = attrs.field(factory=threading.Event)

    def view(self, model: str) -> dict:
        return {"id": self.id, "name": self.name, "model": f"{model}:{self.name}", "path": self.path,
                "scale": self.global_scale, "model_scale": self.scale, "state": self.state}


class AdapterTable:
    """The adapters of one model. Loads, unloads and the tick's calls hold the model loop's
    lock; front ends look adapters up without it (a dict read), and a request's set is checked
    again under the lock when it is queued (``ModelLoop.submit``)."""

    def __init__(self, model: str):
        self.model = model
        self._adapters: dict[str, Adapter] = {}
        self._next_id = 0
        self._load: list[Adapter] = []       # to load at the next tick
        self._loading: list[Adapter] = []    # loads the tick in flight carries
        self._unloading: list[Adapter] = []  # unloads the tick in flight carries

    # ---- what requests see -----------------------------------------------------------------

    def served(self) -> list[Adapter]:
        """Ready adapters, by id: what /v1/models and GET /lora-adapters list."""
        return sorted((a for a in self._adapters.values() if a.state == "ready"), key=lambda a: a.id)

    def listing(self) -> list[Adapter]:
        """Every adapter the table holds, loading and unloading ones too (the admin view)."""
        return sorted(self._adapters.values(), key=lambda a: a.id)

    def get(self, name: str) -> Adapter | None:
        adapter = self._adapters.get(name)
        return adapter if adapter is not None and adapter.state == "ready" else None

    def by_id(self, ident: int) -> Adapter | None:
        return next((a for a in self.served() if a.id == ident), None)

    def check(self, adapters: AdapterSet) -> None:
        """Raise :class:`AdapterNotFound` unless every adapter of the set is served now."""
        for name, _ in adapters:
            if self.get(name) is None:
                raise AdapterNotFound(f"model {self.model!r} has no LoRA adapter {name!r} "
                                      f"(served: {', '.join(a.name for a in self.served()) or 'none'})",
                                      param="model")

    def default_set(self) -> AdapterSet:
        """The set a request naming the base model with no ``lora`` field runs under: the global
        scales POST /lora-adapters set (none by default: the base model, as vLLM serves it)."""
        return tuple(sorted((a.name, a.global_scale) for a in self.served() if a.global_scale))

    # ---- loads and unloads (asked from any thread, under the loop's lock) ------------------

    def add(self, name: str, path: str, scale: float = 1.0) -> Adapter:
        """Queue a load for the next tick; ``adapter.done`` is set once the engine answered."""
        check_name(name)
        if name in self._adapters:
            raise AdapterConflict(f"model {self.model!r} already has an adapter named {name!r}", param="name")
        if not os.path.exists(path):
            raise ConfigError(f"LoRA adapter {name!r}: {path} does not exist")
        adapter = Adapter(name=name, path=path, id=self._next_id, scale=scale)
        self._next_id += 1
        self._adapters[name] = adapter
        self._load.append(adapter)
        log.info("model %s: loading LoRA adapter %s (id %d) from %s", self.model, name, adapter.id, path)
        return adapter

    def remove(self, name: str) -> Adapter:
        """Stop serving an adapter: requests naming it get 404 from now on; it is unloaded once
        no lane runs or waits under it (``adapter.done`` is set then)."""
        adapter = self.get(name)
        if adapter is None:
            raise AdapterNotFound(f"model {self.model!r} has no LoRA adapter {name!r}", param="name")
        adapter.state = "unloading"
        adapter.done = threading.Event()
        log.info("model %s: unloading LoRA adapter %s once its lanes finish", self.model, name)
        return adapter

    def set_global(self, scales: dict[int, float]) -> None:
        """POST /lora-adapters: each listed id's global scale; unlisted adapters get 0."""
        for adapter in self.served():
            adapter.global_scale = float(scales.get(adapter.id, 0.0))

    # ---- the tick (the model's thread) -----------------------------------------------------

    def has_work(self, busy: set[str]) -> bool:
        return bool(self._load) or any(a.state == "unloading" and a.name not in busy
                                       for a in self._adapters.values())

    def fill_plan(self, plan, busy: set[str]) -> None:
        """Put queued loads, and the unloads no lane waits for (``busy``: the names running and
        queued lanes use), in the next plan."""
        self._loading, self._load = self._load, []
        plan.load_adapters.extend((a.name, a.path) for a in self._loading)
        self._unloading = [a for a in self._adapters.values() if a.state == "unloading" and a.name not in busy]
        plan.unload_adapters.extend(a.name for a in self._unloading)
        for adapter in self._unloading:
            adapter.state = "unloaded"

    def tick_done(self, errors: dict[str, str]) -> list[str]:
        """The engine ran the plan: each load succeeded unless ``errors`` names it. Returns the
        names it unloaded (their cached prefixes are to go)."""
        unloaded = [a.name for a in self._unloading]
        for adapter in self._loading:
            why = errors.get(adapter.name)
            if adapter.state != "loading":  # a served adapter loaded again into a restarted engine
                if why is not None:
                    log.error("model %s: LoRA adapter %s could not be loaded again: %s", self.model, adapter.name, why)
                continue
            if why is None:
                adapter.state = "ready"
                log.info("model %s: LoRA adapter %s loaded", self.model, adapter.name)
            else:
                adapter.state, adapter.error = "failed", why
                self._adapters.pop(adapter.name, None)
                log.error("model %s: LoRA adapter %s failed to load: %s", self.model, adapter.name, why)
            adapter.done.set()
        for adapter in self._unloading:
            self._adapters.pop(adapter.name, None)
            log.info("model %s: LoRA adapter %s unloaded", self.model, adapter.name)
            adapter.done.set()
        self._loading, self._unloading = [], []
        return unloaded

    def tick_failed(self, why: str) -> None:
        """The tick carrying loads failed (or its worker died): those loads failed with it (a
        file that breaks the engine is not tried again); unloads are done (the state is gone)."""
        self.tick_done({a.name: why for a in self._loading if a.state == "loading"})

    def engine_restarted(self) -> None:
        """A restarted engine holds no adapter: every served one is loaded again in the next
        plan, before any lane (they stay served meanwhile: the plan loads them first)."""
        ready = sorted((a for a in self._adapters.values() if a.state in ("ready", "unloading")
                        and a not in self._load), key=lambda a: a.id)
        self._load = ready + self._load


def check_files(model: str, specs: list[LoraSpec]) -> None:
    """Before the weights load: every ``--lora`` file exists."""
    for spec in specs:
        if not os.path.exists(spec.path):
            raise ConfigError(f"model {model!r}: --lora {spec.name}: {spec.path} does not exist")


def load_configured(loop, engine_name: str, specs: list[LoraSpec], timeout: float = 300.0) -> None:
    """Load a model's ``--lora`` adapters through its first ticks (ids 0, 1, ... in order); a
    file the engine cannot load, or an engine that serves no adapters, is a ConfigError."""
    if not specs:
        return
    if getattr(loop.engine.capabilities, "adapters", "none") == "none":
        raise ConfigError(f"model {loop.name!r}: engine {engine_name!r} serves no LoRA adapters; drop --lora "
                          "or serve the model with an engine that does")
    check_files(loop.name, specs)
    for spec in specs:
        try:
            loop.load_adapter(spec.name, spec.path, spec.scale, timeout=timeout)
        except SuperfluidError as exc:
            raise ConfigError(f"model {loop.name!r}: --lora {spec.name}={spec.path}: {exc}") from None


def adapters_in_use(lanes, queue) -> set[str]:
    """The adapter names any running or queued lane runs under."""
    return {name for lane in (*lanes, *queue) for name, _ in lane.request.adapters}
