"""Write an mlx-lm model directory from a llama-family GGUF (Q4_0/Q4_1/Q8_0/F16/F32).

    python -m superfluid.plugins.mlx.convert MODEL.gguf OUT_DIR

The directory holds the GGUF's tensors as read by ``mx.load`` (quantized weights stay
quantized, groups of 32), a ``config.json`` mlx-lm reads (``rope_traditional`` set, see
``loader``), and the tokenizer that transformers builds from the GGUF metadata (this needs the
``gguf`` package). ``mlx_lm.load`` / ``mlx_lm.server`` serve it, so mlx-lm's own server can be
measured on exactly the weights superfluid's MLX engine runs from the GGUF."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import loader


def convert(gguf_path: str, out_dir: str) -> str:
    import mlx.core as mx
    raw, meta = mx.load(gguf_path, return_metadata=True)
    args = loader.gguf_model_args(meta, raw)
    weights = loader.rename_gguf(raw)
    config = dict(args, architectures=["LlamaForCausalLM"])
    bits = {name[:-len(".scales")]: weights[name[:-len(".scales")] + ".weight"].shape[-1] * 32
            // (weights[name].shape[-1] * loader.GROUP_SIZE) for name in weights if name.endswith(".scales")}
    if bits:
        common = max(set(bits.values()), key=list(bits.values()).count)
        config["quantization"] = {"group_size": loader.GROUP_SIZE, "bits": common,
                                  **{p: {"group_size": loader.GROUP_SIZE, "bits": b}
                                     for p, b in bits.items() if b != common}}
    os.makedirs(out_dir, exist_ok=True)
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, metadata={"format": "mlx"})
    tok = _tokenizer(meta)
    template = meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = str(template)
    tok.save_pretrained(out_dir)
    config["eos_token_id"] = tok.eos_token_id
    config["bos_token_id"] = tok.bos_token_id
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    return out_dir


def _tokenizer(meta: dict):
    """A fast tokenizer for a GGUF with a GPT-2 style (byte-level BPE) vocabulary, built from
    its token list and merges. (transformers' own GGUF reader needs torch.) The pre-tokenizer
    is plain byte-level BPE splitting, not the model family's exact regex, so rare inputs
    (long digit runs, some punctuation) can tokenize differently from llama.cpp."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if str(meta.get("tokenizer.ggml.model")) != "gpt2":
        raise loader.ModelLoadError("convert writes tokenizers for byte-level BPE (gpt2) GGUF vocabularies only")
    tokens = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    merges = [tuple(str(m).split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = [int(t) for t in meta["tokenizer.ggml.token_type"].tolist()]
    bpe = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == 3])

    def tok_id(key):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(value.item())] if value is not None else None

    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=tok_id("bos"), eos_token=tok_id("eos"),
                                   unk_token=tok_id("unknown"), pad_token=tok_id("padding"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m superfluid.plugins.mlx.convert", description=__doc__.split("\n")[0])
    p.add_argument("gguf")
    p.add_argument("out_dir")
    a = p.parse_args(argv)
    try:
        convert(a.gguf, a.out_dir)
    except (loader.ModelLoadError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
