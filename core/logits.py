"""What every engine does to one logits row outside its own sampler, in numpy: log-probabilities
as OpenAI reports them, and ``logit_bias``.

The order is fixed for all engines: log-probabilities are read from the raw row (the model's own
distribution, as OpenAI and vLLM report them); then the bias is added, then the lane's constraint
masks the row (:mod:`.constrain`), and only then does the engine's sampler (penalties, filters,
temperature) pick a token."""

from __future__ import annotations

import numpy as np

from .tick import TokenLogprob


def log_normalizer(row: np.ndarray) -> float:
    """log(sum(exp(row))), computed stably in float64."""
    top = float(row.max())
    return top + float(np.log(np.exp(row.astype(np.float64) - top).sum()))


def top_candidates(row: np.ndarray, k: int, lse: float) -> tuple[tuple[int, float], ...]:
    """The ``k`` most likely tokens, best first, with their log-probabilities (ties: lower id)."""
    if k <= 0:
        return ()
    k = min(k, row.shape[0])
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.lexsort((idx, -row[idx]))]
    return tuple((int(i), float(row[i]) - lse) for i in idx)


def token_logprob(row: np.ndarray, token: int, top: int, lse: float | None = None) -> TokenLogprob:
    """``token``'s log-probability under ``row`` and the ``top`` best candidates."""
    if lse is None:
        lse = log_normalizer(row)
    return TokenLogprob(token=int(token), logprob=float(row[token]) - lse, top=top_candidates(row, top, lse))


def apply_bias(row: np.ndarray, bias: tuple[tuple[int, float], ...]) -> None:
    """Add OpenAI's ``logit_bias`` to a row in place; −100 bans a token outright (as OpenAI: such a
    token is never sampled), other values shift its logit."""
    for token, value in bias:
        if 0 <= token < row.shape[0]:
            row[token] = -np.inf if value <= -100 else row[token] + value


class LaneRow:
    """One lane's handling of a logits row around its engine's sampler, for a lane whose sampling
    is not :attr:`~superfluid.core.request.SamplingParams.plain`: :meth:`before` (keep the raw row
    for logprobs, add the bias, mask what the constraint forbids, all in place) then the engine
    samples from the row, then :meth:`after` (move the constraint on, read the logprob).

    ``constraint`` is the lane's :class:`~superfluid.core.constrain.LaneConstraint` or None."""

    def __init__(self, params, constraint=None):
        self.top = params.logprobs
        self.bias = tuple(params.logit_bias)
        self.constraint = constraint
        self._raw: np.ndarray | None = None

    @property
    def constrained(self) -> bool:
        return self.constraint is not None

    def before(self, row: np.ndarray) -> None:
        self._raw = None
        if self.top is not None:
            # the raw distribution: copied only if the row is about to change under it
            self._raw = row.copy() if (self.bias or self.constraint is not None) else row
        if self.bias:
            apply_bias(row, self.bias)
        if self.constraint is not None:
            self.constraint.mask(row)

    def after(self, token: int) -> TokenLogprob | None:
        if self.constraint is not None:
            self.constraint.accept(token)
        if self._raw is None:
            return None
        entry = token_logprob(self._raw, token, self.top)
        self._raw = None
        return entry

    def accept(self, token: int) -> None:
        """A generated token replayed into the KV (a resumed lane): the constraint moves past it."""
        if self.constraint is not None:
            self.constraint.accept(token)
