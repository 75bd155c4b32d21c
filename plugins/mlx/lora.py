"""LoRA adapters in the MLX worker, one set a tick (``adapters="per_tick"``, as llama.cpp).

An adapter is read with ``mx.load``: llama.cpp's adapter GGUF (``blk.N.attn_q.weight.lora_a``
[r, in], ``lora_b`` [out, r], ``adapter.lora.alpha``), or a PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``). A model built from a GGUF keeps
llama.cpp's permuted q/k rows (loader.py, ``rope_traditional``), as the GGUF adapter's ``lora_b``
does; a PEFT adapter's q/k ``lora_b`` rows are permuted the same way for it.

At the first load each linear layer of the blocks is wrapped (:class:`LoraSwitch`): its output
plus ``B(A x) * s`` for each adapter of the tick's set that targets it (``s``: alpha / r times
the set's scale). Before a plan's lanes run, the wrappers are given the lanes' set (only when it
changes). The KV a slot holds was computed under its lane's set; keying the cache by set is the
scheduler's."""

from __future__ import annotations

import functools
import json
import logging
import os
import re

import mlx.core as mx
import mlx.nn as nn

from superfluid.core.request import AdapterSet
from superfluid.core.tick import TickPlan

log = logging.getLogger("superfluid.mlx.lora")

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_GGUF = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
         "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")

Weights = dict[tuple[int, str], tuple[mx.array, mx.array, float]]  # (layer, module) -> (A, B, alpha / r)


class _Active:
    """The wrappers' current terms, held outside MLX's parameter tree (not an array nor a list)."""

    def __init__(self):
        self.terms: list[tuple[mx.array, mx.array, float]] = []


class LoraSwitch(nn.Module):
    """A linear layer plus the current set's low-rank terms."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.active = _Active()

    def __call__(self, x):
        y = self.base(x)
        for a, b, s in self.active.terms:
            y = y + (((x @ a.T) @ b.T) * s).astype(y.dtype)
        return y


class MlxLora:
    def __init__(self, model):
        self.model = model
        self.adapters: dict[str, Weights] = {}
        self.switches: dict[tuple[int, str], LoraSwitch] = {}
        self.current: AdapterSet = ()

    def apply(self, plan: TickPlan, errors: dict[str, str]) -> None:
        for name in plan.unload_adapters:
            if self.adapters.pop(name, None) is not None:
                if any(n == name for n, _ in self.current):
                    self.use(())
                log.info("LoRA adapter %s unloaded", name)
        for name, path in plan.load_adapters:
            try:
                self.adapters[name] = self.read(path)
                log.info("LoRA adapter %s loaded from %s", name, path)
            except ValueError as exc:
                errors[name] = str(exc)
        sets = {lp.adapters for lp in plan.lanes}
        if len(sets) > 1:
            raise RuntimeError(f"one MLX tick holds lanes of {len(sets)} adapter sets {sorted(sets)}")
        if sets:
            self.use(sets.pop())

    def use(self, adapters: AdapterSet) -> None:
        if adapters == self.current:
            return
        missing = [n for n, _ in adapters if n not in self.adapters]
        if missing:
            raise RuntimeError(f"lanes run under LoRA adapter(s) {missing}, which this worker has not loaded")
        for switch in self.switches.values():
            switch.active.terms = []
        for name, scale in adapters:
            for key, (a, b, s) in self.adapters[name].items():
                self.switches[key].active.terms.append((a, b, s * scale))
        self.current = adapters

    # ---- reading -------------------------------------------------------------------------------

    def read(self, path: str) -> Weights:
        if os.path.isdir(path):
            raw, alpha, rank = self._peft(path)
        elif os.path.isfile(path):
            raw, alpha, rank = self._gguf(path)
        else:
            raise ValueError(f"{path}: no such file or directory")
        if not raw:
            raise ValueError(f"{path} holds no LoRA weights of a linear layer")
        self._wrap()
        layers = self.model.layers
        out: Weights = {}
        for (layer, module), pair in raw.items():
            if len(pair) != 2:
                raise ValueError(f"{path}: layer {layer} {module} lacks lora_A or lora_B")
            a, b = pair["A"], pair["B"]
            if layer >= len(layers):
                raise ValueError(f"{path}: an adapter for layer {layer}, and the model has {len(layers)} layers "
                                 "(an adapter of another base model?)")
            n_in, n_out = _dims(self.switches[(layer, module)].base)
            if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
                raise ValueError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                 f"do not fit a {n_in} -> {n_out} layer (an adapter of another base model?)")
            r = rank or a.shape[0]
            out[(layer, module)] = (a.astype(mx.float32), b.astype(mx.float32), (alpha / r) if alpha else 1.0)
        return out

    def _gguf(self, path: str):
        try:
            arrays, meta = mx.load(path, return_metadata=True)
        except Exception as exc:  # noqa: BLE001 - mx.load's errors are plain exceptions
            raise ValueError(f"{path}: not a GGUF adapter file ({exc})") from None
        if str(meta.get("general.type")) != "adapter" or str(meta.get("adapter.type")) != "lora":
            raise ValueError(f"{path}: a GGUF that is no LoRA adapter (general.type {meta.get('general.type')!r})")
        alpha = meta.get("adapter.lora.alpha")
        alpha = float(alpha.item()) if hasattr(alpha, "item") else float(alpha or 0)
        raw: dict = {}
        for key, value in arrays.items():
            m = _GGUF_KEY.match(key)
            if m is None or m.group(2) not in _GGUF:
                raise ValueError(f"{path}: tensor {key!r} is not a LoRA matrix of a linear layer")
            raw.setdefault((int(m.group(1)), _GGUF[m.group(2)]), {})[m.group(3).upper()] = value
        return raw, alpha, 0

    def _peft(self, path: str):
        try:
            with open(os.path.join(path, "adapter_config.json")) as f:
                cfg = json.load(f)
            arrays = mx.load(os.path.join(path, "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a PEFT adapter directory ({exc})") from None
        if cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("bias", "none") != "none" \
                or cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
            raise ValueError(f"{path}: DoRA, rsLoRA, biases, per-layer ranks and saved modules are not applied on MLX")
        traditional = bool(getattr(getattr(self.model, "args", None), "rope_traditional", False))
        args = self.model.args
        raw: dict = {}
        for key, value in arrays.items():
            m = _PEFT_KEY.match(key)
            if m is None or m.group(2) not in MODULES:
                raise ValueError(f"{path}: tensor {key!r} is not a LoRA matrix of a linear layer")
            module, which = m.group(2), m.group(3)
            if which == "B" and traditional and module in ("q_proj", "k_proj"):
                heads = args.num_attention_heads if module == "q_proj" else args.num_key_value_heads
                if value.shape[0] % (2 * heads) == 0:  # (another shape is refused by read())
                    value = _permute(value, heads)
            raw.setdefault((int(m.group(1)), module), {})[which] = value
        return raw, float(cfg.get("lora_alpha", cfg.get("r", 8))), int(cfg.get("r", 8))

    def _wrap(self) -> None:
        if self.switches:
            return
        for i, layer in enumerate(self.model.layers):
            for module, parent_name in MODULES.items():
                parent = getattr(layer, parent_name, None)
                base = getattr(parent, module, None) if parent is not None else None
                if base is None:
                    continue
                if not isinstance(base, LoraSwitch):  # (wrapped once, whoever wraps it)
                    base = LoraSwitch(base)
                    setattr(parent, module, base)
                self.switches[(i, module)] = base


def _dims(linear) -> tuple[int, int]:
    """(in, out) of a Linear or QuantizedLinear (its packed weight holds 32 // bits values a word)."""
    out, cols = linear.weight.shape
    bits = getattr(linear, "bits", None)
    return (cols * 32 // bits if bits else cols), out


def _permute(w: mx.array, n_head: int) -> mx.array:
    """HF's q/k row order to llama.cpp's (each head's two rotary halves interleaved)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class MlxLoraTicks:
    """The runner's part: the plan's adapters applied before core's tick (mixed in ahead of it)."""

    @functools.cached_property
    def lora(self) -> MlxLora:
        return MlxLora(self.model)  # type: ignore[attr-defined]

    def run(self, plan: TickPlan):
        errors: dict[str, str] = {}
        if plan.load_adapters or plan.unload_adapters or any(lp.adapters for lp in plan.lanes) or self.lora.current:
            self.lora.apply(plan, errors)
        result = super().run(plan)  # type: ignore[misc]
        result.adapter_errors.update(errors)
        return result
