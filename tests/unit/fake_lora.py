"""A FAKE engine for the LoRA unit tests: :class:`FakeLoraEngine` is ``fakes.FakeEngine`` (no
model) that also keeps LoRA adapters as the engine contract says (``TickPlan.load_adapters`` /
``unload_adapters`` applied before the lanes, ``TickResult.adapter_errors`` for a load that
fails) and whose KV depends on the adapter set each token was computed under.

Each KV cell holds ``token + 1000 * tag(set)`` (``tag`` is 0 for the base model), so the
``kv_hash`` sampler's output depends on the adapters of every cell: a lane seeded with KV
computed under another set samples other tokens than its cold run (:func:`expected_under`),
which is what a cross-adapter prefix-cache hit would do to a real model. It records as
violations (``errors``): a lane under an adapter not loaded, and, with ``adapters="per_tick"``,
a plan holding lanes of several sets."""

from __future__ import annotations

import attrs

from superfluid.core.tick import LaneResult, StepTiming, TickPlan, TickResult

from .fakes import FakeEngine, kv_hash

_TAGS: dict[tuple, int] = {(): 0}


def tag(adapters: tuple) -> int:
    """A small number per adapter set, 0 for the base model."""
    return _TAGS.setdefault(tuple(adapters), len(_TAGS))


def expected_under(prompt: list[int], n: int, adapters: tuple = ()) -> list[int]:
    """The cold greedy output of ``n`` tokens for ``prompt`` under ``adapters``."""
    t = tag(adapters) * 1000
    kv, out = [p + t for p in prompt], []
    for _ in range(n):
        token = kv_hash(kv)
        out.append(token)
        kv.append(token + t)
    return out


class FakeLoraEngine(FakeEngine):
    def __init__(self, *, adapters: str = "per_tick", fail_loads: dict[str, str] | None = None, **kw):
        kw.setdefault("prefix_cache", True)
        super().__init__(**kw)
        self.capabilities = attrs.evolve(self.capabilities, adapters=adapters)
        self.loaded: set[str] = set()
        self.fail_loads = dict(fail_loads or {})
        self.load_log: list[tuple[str, str]] = []   # ("load" | "unload", name), in order

    def _prelude(self, plan: TickPlan, result: TickResult) -> None:
        for name, path in plan.load_adapters:
            self.load_log.append(("load", name))
            if name in self.fail_loads:
                result.adapter_errors[name] = self.fail_loads[name]
            else:
                self.loaded.add(name)
        for name in plan.unload_adapters:
            self.load_log.append(("unload", name))
            if any(name in dict(lp.adapters) for lp in plan.lanes):
                self.errors.append(f"unloaded {name} under a lane of this plan")
            self.loaded.discard(name)
        sets = {lp.adapters for lp in plan.lanes}
        if self.capabilities.adapters == "per_tick" and len(sets) > 1:
            self.errors.append(f"one per_tick plan holds {len(sets)} adapter sets: {sorted(sets)}")
        for lp in plan.lanes:
            missing = [n for n, _ in lp.adapters if n not in self.loaded]
            if missing:
                self.errors.append(f"slot {lp.slot} runs under {missing}, not loaded")
        super()._prelude(plan, result)

    def _feed(self, live: list, result: TickResult) -> None:
        prefill = sum(len(lp.feed) for lp in live if not lp.decode)
        n_decode = sum(1 for lp in live if lp.decode)
        for lp in live:
            t = tag(lp.adapters) * 1000
            kv = self.kv[lp.slot]
            kv.extend(x + t for x in lp.feed)
            res = LaneResult(slot=lp.slot, n_fed=len(lp.feed), n_prefill=0 if lp.decode else len(lp.feed))
            if lp.sample:
                for r in range(lp.max_new):
                    if r > 0:
                        kv.append(res.tokens[-1] + t)
                        res.n_fed += 1
                    res.tokens.append(self.sampler(kv))
            result.lanes[lp.slot] = res
        if live:
            result.steps.append(StepTiming(prefill_tokens=prefill, decode_tokens=n_decode,
                                           seconds=prefill * self.prefill_rate + self.decode_rate))


def load_stepped(loop, engine, tmp_path, *names: str, scale: float = 1.0) -> None:
    """Load adapters into a loop that is not started: queued, then carried by one step."""
    for name in names:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"fake")
        loop.adapters.add(name, str(path), scale)
    loop.step()
    assert all(loop.adapters.get(n) is not None for n in names if n not in engine.fail_loads)
