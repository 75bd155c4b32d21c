"""LoRA adapters on basert, per row: rows of different adapter sets share one forward pass.

For each linear layer an adapter targets, a row's output becomes ``W x + sum over its set of
B(A x) * (s * scale)`` (``s`` is the adapter's own ``lora_alpha / r``, PEFT's scaling; ``scale``
the request's), as PEFT computes it. Each adapter of the step runs its two small matmuls once
over all the step's rows, times a per-row scale that is 0 for the rows whose set lacks it (a
base row gets exactly its own output): at rank r that costs about 2r / hidden of the layer's own
product, with no gather or scatter of rows. A step
with no adapter row costs one check per linear layer, and the hooks exist only while an adapter
is loaded (:mod:`.lora_files` reads the files).

The deltas are added by forward hooks on the model's ``nn.Linear`` modules (``Layer.q`` ...
``Layer.down``), so the model's code is unchanged. A decode step that would replay a CUDA graph
(captured without adapters) runs eagerly when any of its rows has one.

The paged pool names the pages a lane computes from a root of the lane's set
(:func:`set_root`, ``PagedKV.roots``), so a page computed under one set is never shared with a
lane of another, even when their tokens are equal.
"""

from __future__ import annotations

import functools
import hashlib
import logging

import torch

from superfluid.core.request import AdapterSet
from superfluid.core.tick import TickPlan

from .lora_files import AdapterError, Weights, read

log = logging.getLogger("superfluid.basert.lora")


def set_root(adapters: AdapterSet) -> int | None:
    """The root a lane's page names chain from under ``adapters`` (None: the pool's own, for the
    base model). Equal sets give equal roots; the scales are part of the set."""
    if not adapters:
        return None
    text = "superfluid-lora:" + ";".join(f"{name}={scale!r}" for name, scale in adapters)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") or 1


class RowLora:
    """The adapters loaded on one model, and the current step's rows under each."""

    def __init__(self, model):
        self.model = model
        self.adapters: dict[str, Weights] = {}
        self.hooks: list = []
        # the step's terms: (adapter weights, each row's scale under it [n, 1], 0 where its set lacks it)
        self.groups: list[tuple[Weights, torch.Tensor]] = []

    def load(self, name: str, path: str) -> str | None:
        """Load ``path`` as ``name`` (replacing an adapter of that name); why not, or None."""
        try:
            weights = read(path, self.model)
        except AdapterError as exc:
            return str(exc)
        self.adapters[name] = weights
        self._hook()
        log.info("LoRA adapter %s loaded from %s (%d layers, %.1f MiB)", name, path, len(weights),
                 sum(a.nbytes + b.nbytes for a, b, _ in weights.values()) / 2**20)
        return None

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            log.info("LoRA adapter %s unloaded", name)
        if not self.adapters:
            for handle in self.hooks:
                handle.remove()
            self.hooks = []

    def _hook(self) -> None:
        if self.hooks:
            return
        for index, layer in enumerate(self.model.layers):
            for module in ("q", "k", "v", "o", "gate", "up", "down"):
                self.hooks.append(getattr(layer, module).register_forward_hook(self._delta_hook(index, module)))

    def _delta_hook(self, layer: int, module: str):
        key = (layer, module)

        def add_delta(_mod, inputs, out):
            if not self.groups:
                return None
            x = inputs[0]
            for weights, scales in self.groups:
                ab = weights.get(key)
                if ab is not None:
                    a, b, s = ab
                    out = out + (x @ a.T) @ b.T * (scales * s)
            return out

        return add_delta

    def begin(self, row_sets: list[AdapterSet]) -> bool:
        """Each adapter's per-row scales for the step (one set per flat row); whether any row has one."""
        self.groups = []
        names = sorted({name for adapters in row_sets for name, _ in adapters})
        if not names:
            return False
        missing = [name for name in names if name not in self.adapters]
        if missing:
            raise RuntimeError(f"rows run under LoRA adapter(s) {missing}, which this model has not loaded")
        device, dtype = self.model.embed.weight.device, self.model.dtype
        for name in names:
            scales = [[dict(adapters).get(name, 0.0)] for adapters in row_sets]
            self.groups.append((self.adapters[name], torch.tensor(scales, device=device, dtype=dtype)))
        return True

    def end(self) -> None:
        self.groups = []


class LoraSteps:
    """The runner's part (mixed into :class:`~.runner.BasertRunner` ahead of core's TickRunner):
    a plan's loads and unloads first, each lane's set noted (and its pages' root set), then every
    forward pass told which rows run under which adapters (:meth:`lora_step`)."""

    lane_sets: dict[int, AdapterSet] = {}  # slot -> the set of its lane in this tick (replaced each tick)

    @functools.cached_property
    def lora(self) -> RowLora:
        return RowLora(self.model)  # type: ignore[attr-defined]

    def run(self, plan: TickPlan):
        errors: dict[str, str] = {}
        for name in plan.unload_adapters:
            self.lora.unload(name)
        for name, path in plan.load_adapters:
            why = self.lora.load(name, path)
            if why is not None:
                errors[name] = why
        self.lane_sets = {lp.slot: lp.adapters for lp in plan.lanes}
        for lp in plan.lanes:  # before seeding: a restored page is named under its lane's set
            self.pool.roots[lp.slot] = set_root(lp.adapters)
        try:
            result = super().run(plan)  # type: ignore[misc]
        finally:
            self.lora.end()
        result.adapter_errors.update(errors)
        return result

    def lora_step(self, rows) -> bool:
        """Before a forward pass (the runner's ``_forward``): each flat row's set, from its lane's
        (a ``_Row`` of ``width`` rows per lane); whether any row runs under an adapter, in which
        case the pass runs eagerly, not as a captured decode graph."""
        if not self.lora.adapters:  # none loaded: nothing to look up
            return False
        return self.lora.begin([self.lane_sets.get(r.work.slot, ()) for r in rows for _ in range(r.width)])
