"""An embedding lane's pooling of llama.cpp's hidden states.

The context runs without a pooling layer of its own (``LLAMA_POOLING_TYPE_NONE``), so prompts
of any length are prefilled in chunks across ticks like any other lane's; this module pools the
per-token states as the model's GGUF says (``{arch}.pooling_type``: mean, cls, last; mean for a
model that declares none, as a generative model does). Each step adds what it computed into the
lane's ``LaneResult.embedding_sum``; the scheduler divides and normalises at the end
(``superfluid.core.prompt_work``). A reranker's lane (``Work.rank``) takes the last token's state
and gets the model's classification head on it instead (rank.py)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from superfluid.core.tick_runner import Work

POOLING = {"1": "mean", "2": "cls", "3": "last"}  # llama_pooling_type values as GGUF stores them


def model_pooling(model) -> str:
    """The pooling a GGUF declares ("mean" where it declares none, or one we do not pool)."""
    arch = _meta(model, "general.architecture") or ""
    return POOLING.get(_meta(model, f"{arch}.pooling_type") or "", "mean")


def _meta(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return None if n < 0 else buf.value.decode("utf-8", errors="replace")


class HiddenStates:
    def __init__(self, ctx, n_embd: int, pooling: str = "mean"):
        self.ctx = ctx
        self.n_embd = n_embd
        self.pooling = pooling
        self.head = None  # a reranker's RankHead (rank.py), set by the worker; None: not a reranker

    def state(self, index: int) -> np.ndarray:
        """The hidden state the last step computed for batch row ``index``."""
        ptr = llama_cpp.llama_get_embeddings_ith(self.ctx, index)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no embedding for batch row {index}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,))

    def pool(self, w: Work, first: int, count: int) -> None:
        """Add the states of the ``count`` tokens a step fed for ``w`` (batch rows from ``first``)."""
        if w.rank:
            self._rank(w, first, count)
            return
        if self.pooling == "cls":
            rows = [first] if w.pos == 0 else []
        elif self.pooling == "last":
            rows = [first + count - 1] if count == len(w.feed) and w.ends_prompt else []
        else:
            rows = range(first, first + count)
        if not rows:
            return
        total = np.zeros(self.n_embd, dtype=np.float64)
        for i in rows:
            total += self.state(i)
        if w.result.embedding_sum is not None:
            total += np.asarray(w.result.embedding_sum)
        w.result.embedding_sum = total.tolist()
        w.result.pooled += len(rows)

    def _rank(self, w: Work, first: int, count: int) -> None:
        """A reranker's lane: once the step that ends its prompt has run, the head's outputs on
        the last token's state (the row llama.cpp's rank pooling takes in a causal model), as one
        pooled "state" that the scheduler keeps as it is."""
        if not (count == len(w.feed) and w.ends_prompt):
            return
        if self.head is None:
            raise RuntimeError("a rank lane on a model with no classification head (not a reranker)")
        w.result.embedding_sum = self.head.scores(self.state(first + count - 1))
        w.result.pooled = 1
