"""Reading a LoRA adapter for basert: a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors`` or ``.bin``) or llama.cpp's adapter GGUF (``convert_lora_to_gguf.py``'s),
checked against the model it is to be applied to (:mod:`.lora` applies it).

llama.cpp's converter puts llama's q/k ``lora_b`` rows in its interleaved rotary order, as it does
the weights; they are put back in HF's order, as :mod:`.weights` does for the weights. A file
that does not fit the model (its layers, its shapes, or options basert does not apply: DoRA,
biases, saved modules, per-layer ranks) is refused with the reason."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import torch
from torch import nn

from superfluid.plugins.gguf_file import GgufFile

from .weights import _unpermute

# PEFT's module names (transformers' llama/qwen/gemma) -> basert's Layer attributes
MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
           "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
GGUF_MODULES = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o",
                "ffn_gate": "gate", "ffn_up": "up", "ffn_down": "down"}
_PEFT_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


class AdapterError(ValueError):
    """A file basert cannot apply as a LoRA adapter of this model (the message says why)."""


def read(path: str, model) -> Weights:
    """The adapter at ``path`` (a PEFT directory or an adapter GGUF) checked against ``model``
    and moved to its device and dtype; AdapterError says why not."""
    if os.path.isdir(path):
        raw, scaling = _read_peft(path)
    elif os.path.isfile(path):
        raw, scaling = _read_gguf(path, model)
    else:
        raise AdapterError(f"{path}: no such file or directory")
    if not raw:
        raise AdapterError(f"{path} holds no LoRA weights for any linear layer basert knows "
                           f"({', '.join(MODULES)})")
    layers = model.layers
    weights = {}
    device, dtype = model.embed.weight.device, model.dtype
    for (layer, module), pair in sorted(raw.items()):
        if "A" not in pair or "B" not in pair:
            raise AdapterError(f"{path}: layer {layer} {module} has only lora_{'A' if 'A' in pair else 'B'}")
        a, b = pair["A"], pair["B"]
        if layer >= len(layers):
            raise AdapterError(f"{path}: an adapter for layer {layer}, and the model has {len(layers)} layers "
                               "(an adapter of another base model?)")
        target: nn.Linear = getattr(layers[layer], module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape[0] != target.out_features \
                or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               f"do not fit a {target.in_features} -> {target.out_features} layer "
                               "(an adapter of another base model?)")
        weights[(layer, module)] = (a.to(device=device, dtype=dtype).contiguous(),
                                    b.to(device=device, dtype=dtype).contiguous(), scaling(a.shape[0]))
    return weights


def _read_peft(path: str):
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: no readable adapter_config.json ({exc})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: a {cfg.get('peft_type')} adapter; basert applies LoRA")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "saved modules"), ("fan_in_fan_out", "fan_in_fan_out")):
        if cfg.get(key):
            raise AdapterError(f"{path}: {why} ({key}) is not applied by basert")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{path}: bias={cfg['bias']!r} is not applied by basert (only 'none')")
    alpha, rank = float(cfg.get("lora_alpha", cfg.get("r", 8))), int(cfg.get("r", 8))
    rslora = bool(cfg.get("use_rslora"))
    patterns, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if patterns or alphas:
        raise AdapterError(f"{path}: rank_pattern / alpha_pattern are not applied by basert")
    tensors = _peft_tensors(path)
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None or m.group(2) not in MODULES:
            raise AdapterError(f"{path}: tensor {key!r} is not a LoRA matrix of a linear layer basert knows")
        raw.setdefault((int(m.group(1)), MODULES[m.group(2)]), {})[m.group(3)] = value.float()

    def scaling(r: int) -> float:
        del r  # PEFT's scaling comes from the config's r, the same for every layer here
        return alpha / math.sqrt(rank) if rslora else alpha / rank

    return raw, scaling


def _peft_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file

        try:
            return load_file(st, device="cpu")
        except Exception as exc:  # a torn or foreign file fails in many ways
            raise AdapterError(f"{st}: not a readable safetensors file ({exc})") from None
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.exists(pt):
        try:
            return torch.load(pt, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise AdapterError(f"{pt}: not a readable PyTorch file ({exc})") from None
    raise AdapterError(f"{path}: no adapter_model.safetensors or adapter_model.bin")


def _read_gguf(path: str, model):
    """llama.cpp's adapter GGUF: ``blk.N.attn_q.weight.lora_a`` [r, in] / ``lora_b`` [out, r] and
    ``adapter.lora.alpha``; q and k ``lora_b`` rows are in llama.cpp's rotary order, undone here."""
    try:
        adapter = GgufFile(path)
        tensors = adapter.tensors
    except Exception as exc:  # a torn or foreign file fails in many ways
        raise AdapterError(f"{path}: not a GGUF adapter file ({exc})") from None
    if adapter.get("general.type") != "adapter" or adapter.get("adapter.type") != "lora":
        raise AdapterError(f"{path}: a GGUF that is no LoRA adapter (general.type {adapter.get('general.type')!r})")
    alpha = adapter.get("adapter.lora.alpha")
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    shape = model.shape
    for t in tensors.values():
        m = _GGUF_KEY.match(t.name)
        if m is None or m.group(2) not in GGUF_MODULES:
            raise AdapterError(f"{path}: tensor {t.name!r} is not a LoRA matrix of a linear layer basert knows")
        if t.tensor_type.name not in ("F32", "F16", "BF16"):
            raise AdapterError(f"{path}: {t.name} is {t.tensor_type.name}; basert reads F32/F16/BF16 adapters")
        value = torch.from_numpy(np.array(t.dequantize()))  # (a copy: the map is read-only)
        module = GGUF_MODULES[m.group(2)]
        heads = shape.n_heads if module == "q" else shape.n_kv_heads
        if m.group(3) == "b" and module in ("q", "k") and shape.arch == "llama" \
                and value.shape[0] == heads * shape.head_dim:  # (another shape is refused by read())
            value = torch.from_numpy(_unpermute(value.numpy(), heads).copy())
        raw.setdefault((int(m.group(1)), module), {})["A" if m.group(3) == "a" else "B"] = value

    def scaling(r: int) -> float:
        return float(alpha) / r if alpha else 1.0  # llama.cpp: alpha 0 means a scale of 1

    return raw, scaling
