"""A reasoning model's thinking budget, enforced token by token for every engine.

The lane counts the tokens it generates inside its think span (from the open marker, or from the
start when the prompt opened the span). The model may close the span itself. Once it has
written ``ThinkBudget.tokens`` tokens of thinking without closing it, the only tokens it may
sample are those of the close marker. If the text so far ends with the start of the marker, only
the rest is forced. After the span it samples freely. So reasoning can never eat a reply's
``max_tokens``.

It offers the same face as a grammar's :class:`~superfluid.core.constrain.LaneConstraint`
(``allowed``, ``mask``, ``accept``, ``masks_along``, ``done``), so every engine's sampling path
applies it as it applies a constraint. A grammar cannot express it: llguidance's lexemes cannot
both end at the first close marker and force one after a token count (measured:
``max_tokens`` on the span lets a closed span run on as thinking, ``stop=`` ends the span without
the marker)."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import numpy as np

from .request import ThinkBudget


class ThinkBudgetLane:
    """One lane's thinking budget. ``tokenize`` gives the tokens of a text (the close marker's
    canonical tokens), ``piece`` a token's bytes; ``n_vocab`` the logits row's length."""

    def __init__(self, budget: ThinkBudget, tokenize: Callable[[str], list[int]], piece: Callable[[int], bytes],
                 n_vocab: int):
        self.budget = budget
        self._tokenize = tokenize
        self._piece = piece
        self.n_vocab = n_vocab
        self.inside = budget.open is None  # the prompt opened the span
        self.closed = False
        self.thought = 0   # tokens generated inside the span
        self.text = b""    # what the lane generated so far (to find the markers across tokens)
        self.forced: list[int] = []
        self._open = budget.open.encode() if budget.open else b""
        self._close = budget.close.encode()

    @property
    def constrained(self) -> bool:
        return True

    def allowed(self) -> np.ndarray:
        if not self.forced:
            return np.ones(self.n_vocab, dtype=bool)
        only = np.zeros(self.n_vocab, dtype=bool)
        only[self.forced[0]] = True
        return only

    def mask(self, logits: np.ndarray) -> None:
        if self.forced:
            keep = logits[self.forced[0]]
            logits[:] = -np.inf
            logits[self.forced[0]] = keep

    def accept(self, token: int) -> bool:
        """Move past a sampled (or replayed) token; False if it was not the one forced."""
        ok = not self.forced or token == self.forced[0]
        if self.forced:
            self.forced.pop(0)
        self.text += self._piece(token)
        if self.closed:
            return ok
        if not self.inside:
            if self._open and self._open in self.text:
                self.inside = True
                self.text = self.text[self.text.index(self._open) + len(self._open):]
            return ok
        if self._close in self.text:
            self.inside, self.closed, self.forced = False, True, []
            return ok
        self.thought += 1
        if self.thought >= self.budget.tokens and not self.forced:
            self.forced = self._rest_of_marker()
        return ok

    def _rest_of_marker(self) -> list[int]:
        """The tokens that complete the close marker after the text so far (which may end with
        its first bytes)."""
        for k in range(min(len(self._close) - 1, len(self.text)), 0, -1):
            if self.text.endswith(self._close[:k]):
                return self._tokenize(self._close[k:].decode("utf-8", errors="ignore"))
        return self._tokenize(self.budget.close)

    def masks_along(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """What :meth:`allowed` says before each of ``tokens`` and after the last, the lane's own
        state left as it was (a copy walks them)."""
        walker = copy.copy(self)
        walker.forced = list(self.forced)
        masks = [walker.allowed()]
        for token in tokens:
            if not walker.accept(token):
                break
            masks.append(walker.allowed())
        masks += [masks[-1]] * (len(tokens) + 1 - len(masks))
        return masks

    @property
    def done(self) -> bool:
        return False  # the answer after the span is free; only the model ends it
