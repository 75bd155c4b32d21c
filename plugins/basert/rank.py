"""A reranker on basert: a rank lane (``Work.rank``) gets the model's classification head on the
final hidden state of its prompt's last token, the row llama.cpp's rank pooling takes in a
causal model, instead of the summed states an embedding lane gets.

The head and the pair format come from a reranker GGUF (:mod:`superfluid.plugins.rank_head`:
Qwen3-Reranker as llama.cpp's converter writes it, rank pooling and ``cls.output``); basert reads
the same file's weights, so the same model serves on either engine with the same scores. A
Hugging Face directory carries no head or pair format that says it is a reranker, so it is not
served as one (``/v1/rerank`` answers a 400 naming the engine)."""

from __future__ import annotations

from superfluid.core.tick_runner import Work


def pooled_rows(rows, hidden, head) -> dict:
    """What a step pools, by row index: ``("sum", tensor)`` for an embedding lane (its fed
    tokens' states summed), ``("rank", scores)`` for a rank lane whose prompt ends in this step
    (``head``: the model's :class:`~superfluid.plugins.rank_head.RankHead`)."""
    out = {}
    for i, r in enumerate(rows):
        w = r.work
        if not w.embed:
            continue
        if not w.rank:
            out[i] = ("sum", hidden[r.offset:r.offset + r.count].float().sum(dim=0))
        elif r.count == len(w.feed) and w.ends_prompt:
            if head is None:
                raise RuntimeError("a rank lane on a model with no classification head (not a reranker)")
            out[i] = ("rank", head.scores(hidden[r.offset + r.count - 1].float().cpu().numpy()))
    return out


def keep_pooled(w: Work, entry, count: int) -> None:
    """Put a row's pooled entry (:func:`pooled_rows`; None: nothing) in the lane's result: a sum
    added to its embedding sum, a rank lane's scores as its one pooled "state"."""
    if entry is None:
        return
    kind, value = entry
    if kind == "sum":
        w.add_pooled(value.cpu().numpy(), count)
    else:
        w.result.embedding_sum, w.result.pooled = value, 1
