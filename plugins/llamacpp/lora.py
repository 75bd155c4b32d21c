"""LoRA adapters in the llama.cpp worker: loaded onto the model, one set applied to the context.

llama.cpp applies an adapter set to a whole context (``llama_set_adapters_lora``), not to a
sequence, so this engine declares ``adapters="per_tick"`` and the scheduler puts only lanes of
one set in a plan. Each tick, before its lanes run: the plan's unloads are freed, its loads are
read (``llama_adapter_lora_init`` on the worker's model; a file llama.cpp refuses is reported in
``TickResult.adapter_errors`` with llama.cpp's own reason), and the context is switched to the
lanes' set when it differs from the last tick's (a switch makes llama.cpp reserve its graph
again, so it is not repeated for nothing).

The KV a slot holds was computed under the set of the tick that fed it; whether it may serve a
lane of another set is the scheduler's question (the prefix cache keys by set), not this one's.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os

import llama_cpp

from superfluid.core.request import AdapterSet
from superfluid.core.tick import TickPlan

log = logging.getLogger("superfluid.llamacpp.lora")

_GGML_LOG_ERROR, _GGML_LOG_CONT = 4, 5  # ggml.h enum ggml_log_level (llama_cpp._logger maps 3 as ERROR: it is WARN)


class LoraAdapters:
    """The adapters loaded on one model and the set applied to its context."""

    def __init__(self, model, ctx):
        self.model = model
        self.ctx = ctx
        self.loaded: dict[str, int] = {}  # name -> llama_adapter_lora pointer
        self.current: AdapterSet = ()

    def apply(self, plan: TickPlan, errors: dict[str, str]) -> None:
        """The plan's unloads and loads (a failed load goes to ``errors``), then its lanes' set.
        Raises if the lanes do not share one set, or one names an adapter not loaded: both are
        the scheduler's mistakes, and running them under another set would answer wrongly."""
        for name in plan.unload_adapters:
            self.unload(name)
        for name, path in plan.load_adapters:
            why = self.load(name, path)
            if why is not None:
                errors[name] = why
        sets = {lp.adapters for lp in plan.lanes}
        if len(sets) > 1:
            raise RuntimeError(f"one llama.cpp tick holds lanes of {len(sets)} adapter sets {sorted(sets)}: "
                               "llama.cpp applies one set to the whole context")
        if sets:
            self.use(sets.pop())

    def load(self, name: str, path: str) -> str | None:
        """Load ``path`` as adapter ``name`` (again: the old one is freed first); why not, or None."""
        if os.path.isdir(path):
            return (f"{path} is a directory (a PEFT adapter?): llama.cpp takes a GGUF adapter; convert it with "
                    "llama.cpp's convert_lora_to_gguf.py")
        if not os.path.isfile(path):
            return f"{path}: no such file"
        if name in self.loaded:
            self.unload(name)
        with _llama_errors() as lines:
            adapter = llama_cpp.llama_adapter_lora_init(self.model, os.fsencode(path))
        if not adapter:
            reason = "; ".join(line.split(": ", 1)[-1].strip() for line in lines if line.strip())
            return f"llama.cpp cannot load {path} as a LoRA adapter of this model: {reason or 'unknown reason'}"
        self.loaded[name] = adapter
        log.info("LoRA adapter %s loaded from %s", name, path)
        return None

    def unload(self, name: str) -> None:
        adapter = self.loaded.pop(name, None)
        if adapter is None:
            return
        if any(n == name for n, _ in self.current):  # never leave the context pointing at freed memory
            self._set(())
        llama_cpp.llama_adapter_lora_free(adapter)
        log.info("LoRA adapter %s unloaded", name)

    def use(self, adapters: AdapterSet) -> None:
        """Apply ``adapters`` to the context (nothing to do when it is already the set)."""
        if adapters == self.current:
            return
        missing = [name for name, _ in adapters if name not in self.loaded]
        if missing:
            raise RuntimeError(f"lanes run under LoRA adapter(s) {missing}, which this worker has not loaded")
        self._set(adapters)

    def _set(self, adapters: AdapterSet) -> None:
        n = len(adapters)
        ptrs = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*(self.loaded[name] for name, _ in adapters)) if n else None
        scales = (ctypes.c_float * n)(*(scale for _, scale in adapters)) if n else None
        rc = llama_cpp.llama_set_adapters_lora(self.ctx, ptrs, n, scales)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora failed ({rc}) for {adapters}")
        self.current = adapters

    def close(self) -> None:
        """Free every adapter (the context first drops its set)."""
        if self.current:
            self._set(())
        for name in list(self.loaded):
            self.unload(name)


@contextlib.contextmanager
def _llama_errors():
    """llama.cpp's error lines logged while the block runs (its reason for refusing a file is
    only logged), then its log goes back to llama-cpp-python's own handler."""
    lines: list[str] = []
    last = [0]

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, _user) -> None:
        if level == _GGML_LOG_ERROR or (level == _GGML_LOG_CONT and last[0] == _GGML_LOG_ERROR):
            lines.append(text.decode("utf-8", "replace"))
        if level != _GGML_LOG_CONT:
            last[0] = level

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        import llama_cpp._logger as own

        llama_cpp.llama_log_set(own.llama_log_callback, ctypes.c_void_p(0))


class LoraTicks:
    """The runner's part: adapters applied at the start of every tick (mixed into
    :class:`~.runner.LlamaCppRunner` ahead of core's TickRunner, whose ``run`` it wraps). The
    adapters are freed with the model when the worker ends."""

    lora: LoraAdapters

    def run(self, plan: TickPlan):
        errors: dict[str, str] = {}
        self.lora.apply(plan, errors)
        result = super().run(plan)  # type: ignore[misc]
        result.adapter_errors.update(errors)
        return result
