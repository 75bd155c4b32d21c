"""A reranker on llama.cpp: its pair format (in the daemon) and its classification head (in the
worker), both read from the GGUF by :mod:`superfluid.plugins.rank_head`.

The worker's context has no pooling layer (``LLAMA_POOLING_TYPE_NONE``, see hidden.py), so that a
reranker's lanes are prefilled in chunks across ticks like any other and the same context still
generates; llama.cpp's own rank pooling would need a context of its own. A rank lane
(``LanePlan.rank``) takes the hidden state of the row rank pooling takes in a causal model (its
last token's) and the head is applied to it in numpy (hidden.py)."""

from __future__ import annotations

from superfluid.core.engine import RerankFormat
from superfluid.plugins import rank_head


def rerank_format(vocab, name: str) -> RerankFormat | None:
    """The pair format of a reranker GGUF (``vocab``: the daemon's vocab-only load of it,
    plugins/vocab/gguf.py); None for a model that is not one, or one not served (logged)."""
    arch = vocab._meta("general.architecture") or ""
    if vocab._meta(f"{arch}.pooling_type") != str(rank_head.RANK):  # (no second read of a model that is not one)
        return None
    return rank_head.rerank_format(vocab.info.path, name, vocab)


class RankHead:
    """Where the worker gets a reranker's head."""

    @staticmethod
    def load(path: str, model=None) -> "rank_head.RankHead | None":
        """The head of the GGUF at ``path`` (``model``: the worker's loaded llama_model, whose
        metadata says first whether it is a reranker at all); None for a model that is not one."""
        if model is not None:
            from .hidden import _meta

            arch = _meta(model, "general.architecture") or ""
            if _meta(model, f"{arch}.pooling_type") != str(rank_head.RANK):
                return None
        return rank_head.RankHead.from_gguf(path)
