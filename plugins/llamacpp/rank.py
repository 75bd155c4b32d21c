"""A reranker on llama.cpp: its pair format (in the daemon) and its classification head (in the
worker).

A GGUF whose ``{arch}.pooling_type`` is rank (4) is a cross-encoder: llama.cpp's own rank pooling
takes one row of the final hidden states (the last token's for a causal model, Qwen3-Reranker;
the first's, CLS, for a BERT-style encoder), applies the classification head stored beside the
weights (``cls`` + tanh, then ``cls.output``; Qwen3's head is ``cls.output`` alone, the LM head's
"yes" and "no" rows, followed by a softmax) and returns those outputs, the first being the score.

The worker's context has no pooling layer (``LLAMA_POOLING_TYPE_NONE``, see hidden.py), so that a
reranker's lanes are prefilled in chunks across ticks like any other and the same context still
generates. A rank lane (``LanePlan.rank``) therefore takes the hidden state of the row rank
pooling would take and :class:`RankHead` applies the head in numpy, from the GGUF's own tensors:
the same arithmetic as llama.cpp's graph (checked against llama-cpp-python's ``Llama`` with rank
pooling in tests/server/test_rerank.py).

Only causal rerankers are served: the worker runs every prompt with causal attention, and an
encoder's (BERT's) pair would have to reach llama.cpp whole in one batch, without a KV cache."""

from __future__ import annotations

import logging

import numpy as np

from superfluid.core.engine import RerankFormat

log = logging.getLogger("superfluid.llamacpp")

RANK = "4"  # llama_pooling_type's rank value, as a GGUF stores it
SOFTMAX_ARCHS = ("qwen3", "qwen3vl")  # llama.cpp ends these heads with a softmax over the labels


# ---- the daemon: is it a reranker, and how is a pair its prompt ------------------------------


def rerank_format(vocab, name: str) -> RerankFormat | None:
    """The pair format of a reranker GGUF (``vocab``: the daemon's vocab-only load,
    plugins/vocab/gguf.py); None for a model that is not one, or one this engine cannot serve
    (logged)."""
    import llama_cpp

    meta = vocab._meta
    arch = meta("general.architecture") or ""
    if meta(f"{arch}.pooling_type") != RANK:
        return None
    if (meta(f"{arch}.attention.causal") or "true").lower() == "false":
        log.warning("model %s: a %s reranker (non-causal attention) is not served on llama.cpp here: an "
                    "encoder's pair must be decoded whole, without a KV cache; /v1/rerank refuses it", name, arch)
        return None
    v = vocab._vocab
    bos, eos, sep = (llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v), llama_cpp.llama_vocab_sep(v))
    eos = eos if eos >= 0 else sep
    add_bos, add_eos = llama_cpp.llama_vocab_get_add_bos(v), llama_cpp.llama_vocab_get_add_eos(v)
    add_sep = llama_cpp.llama_vocab_get_add_sep(v)
    end = (eos,) if add_eos and eos >= 0 else ()
    return RerankFormat(template=meta("tokenizer.chat_template.rerank"),
                        prefix=(bos,) if add_bos and bos >= 0 else (),
                        middle=end + ((sep,) if add_sep and sep >= 0 else ()), suffix=end)


# ---- the worker: the head on the pooled row ---------------------------------------------------


class RankHead:
    """The classification head of a reranker GGUF, applied to one final hidden state."""

    def __init__(self, arch: str, cls_w, cls_b, out_w, out_b):
        self.arch = arch
        self.cls_w, self.cls_b, self.out_w, self.out_b = cls_w, cls_b, out_w, out_b

    @classmethod
    def load(cls, path: str, model) -> "RankHead | None":
        """The head of the GGUF at ``path`` (``model``: the worker's loaded llama_model), or None
        where the model declares no rank pooling or has no head."""
        import gguf

        from .hidden import _meta

        arch = _meta(model, "general.architecture") or ""
        if _meta(model, f"{arch}.pooling_type") != RANK:
            return None
        wanted = {"cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias"}
        found = {t.name: _dequantize(gguf, t) for t in gguf.GGUFReader(path).tensors if t.name in wanted}
        if "cls.weight" not in found and "cls.output.weight" not in found:
            return None
        return cls(arch, found.get("cls.weight"), found.get("cls.bias"), found.get("cls.output.weight"),
                   found.get("cls.output.bias"))

    def scores(self, state: np.ndarray) -> list[float]:
        """The head's outputs on a pooled hidden state, as llama.cpp's rank pooling computes them:
        ``cls`` (+ bias) and tanh, then ``cls.output`` (+ bias), then a softmax for Qwen3."""
        x = np.asarray(state, dtype=np.float64)
        if self.cls_w is not None:
            x = self.cls_w @ x
            if self.cls_b is not None:
                x = x + self.cls_b
            x = np.tanh(x)
        if self.out_w is not None:
            x = self.out_w @ x
            if self.out_b is not None:
                x = x + self.out_b
        if self.arch in SOFTMAX_ARCHS:
            e = np.exp(x - x.max())
            x = e / e.sum()
        return [float(v) for v in np.atleast_1d(x)]


def _dequantize(gguf, tensor) -> np.ndarray:
    """A GGUF tensor as float64 rows (GGUF lists a matrix's dims innermost first; numpy's data
    is already [outputs, inputs])."""
    data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float64)
    dims = [int(d) for d in reversed(tensor.shape.tolist())]
    return data.reshape(dims) if len(dims) > 1 else data.reshape(-1)

