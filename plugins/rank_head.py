"""A reranker GGUF's classification head and pair format, for every engine that serves one.

A GGUF whose ``{arch}.pooling_type`` is rank (4) is a cross-encoder: llama.cpp's rank pooling
takes one row of the final (normed) hidden states, the last token's for a causal model
(Qwen3-Reranker) or the first's (CLS) for a BERT-style encoder, applies the head stored beside
the weights (``cls`` + tanh, then ``cls.output``; Qwen3's head is ``cls.output`` alone, the LM
head's "yes" and "no" rows, then a softmax) and returns those outputs, the first being the
pair's score. Both engines here run prompts causally and pool that row themselves (llama.cpp:
plugins/llamacpp/hidden.py; basert: plugins/basert/rank.py), then :class:`RankHead` applies the
head in numpy from the GGUF's own tensors, the same arithmetic as llama.cpp's graph (checked
against llama-cpp-python's ``Llama`` with rank pooling in tests/server/test_rerank.py).

Only causal rerankers are served: an encoder's pair would have to be computed whole, without a
KV cache, which neither engine's lanes do."""

from __future__ import annotations

import logging

import numpy as np

from superfluid.core.engine import RerankFormat
from superfluid.plugins.gguf_file import GgufFile

log = logging.getLogger("superfluid.rerank")

RANK = 4  # llama_pooling_type's rank value, as a GGUF stores it
SOFTMAX_ARCHS = ("qwen3", "qwen3vl")  # llama.cpp ends these heads with a softmax over the labels
HEAD_TENSORS = ("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias")


def rerank_format(path: str, name: str, vocab=None) -> RerankFormat | None:
    """How a reranker GGUF's pairs become prompts; None for a file that is not one (a Hugging
    Face directory, a GGUF without rank pooling) or a reranker no engine here serves (logged).
    ``vocab``: the daemon's llama.cpp vocab-only load of it (plugins/vocab/gguf.py), whose
    special tokens make the BOS query EOS SEP document EOS format of a model without a template.
    Every basert start asks this of its GGUF, hence :class:`GgufFile`'s header walk, which
    leaves the vocabulary's strings undecoded."""
    if not path.endswith(".gguf"):
        return None
    gguf_file = GgufFile(path)
    arch = gguf_file.get("general.architecture") or ""
    if gguf_file.get(f"{arch}.pooling_type") != RANK:
        return None
    if gguf_file.get(f"{arch}.attention.causal") is False:
        log.warning("model %s: a %s reranker (non-causal attention) is not served here: an encoder's pair "
                    "must be computed whole, without a KV cache; /v1/rerank refuses it", name, arch)
        return None
    if not any(n in gguf_file.tensors for n in ("cls.weight", "cls.output.weight")):
        log.warning("model %s: declares rank pooling but has no classification head (cls.*)", name)
        return None
    template = gguf_file.get("tokenizer.chat_template.rerank")
    return RerankFormat(template=template, **(_special_pair(vocab) if template is None and vocab else {}))


def _special_pair(vocab) -> dict:
    """llama-server's pair without a template: BOS query EOS SEP document EOS, each as the
    vocabulary adds it (EOS falls back to SEP)."""
    import llama_cpp

    v = vocab._vocab
    bos, eos, sep = llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v), llama_cpp.llama_vocab_sep(v)
    eos = eos if eos >= 0 else sep
    end = (eos,) if llama_cpp.llama_vocab_get_add_eos(v) and eos >= 0 else ()
    return {"prefix": (bos,) if llama_cpp.llama_vocab_get_add_bos(v) and bos >= 0 else (),
            "middle": end + ((sep,) if llama_cpp.llama_vocab_get_add_sep(v) and sep >= 0 else ()),
            "suffix": end}


class RankHead:
    """The classification head of a reranker GGUF, applied to one pooled final hidden state."""

    def __init__(self, arch: str, cls_w=None, cls_b=None, out_w=None, out_b=None):
        self.arch = arch
        self.cls_w, self.cls_b, self.out_w, self.out_b = cls_w, cls_b, out_w, out_b

    @classmethod
    def from_gguf(cls, path: str) -> "RankHead | None":
        """The head of the GGUF at ``path``; None where it declares no rank pooling or has no head."""
        if not path.endswith(".gguf"):
            return None
        gguf_file = GgufFile(path)
        arch = gguf_file.get("general.architecture") or ""
        if gguf_file.get(f"{arch}.pooling_type") != RANK:
            return None
        # as float64, in numpy's order ([outputs, inputs]: GGUF lists a matrix's dims innermost first)
        found = {n: t.dequantize().astype(np.float64) for n, t in gguf_file.tensors.items() if n in HEAD_TENSORS}
        if "cls.weight" not in found and "cls.output.weight" not in found:
            return None
        return cls(arch, found.get("cls.weight"), found.get("cls.bias"), found.get("cls.output.weight"),
                   found.get("cls.output.bias"))

    def scores(self, state) -> list[float]:
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
