"""Per-lane samplers that follow mlx-lm's own rules (``mlx_lm.sample_utils``), one lane per row.

The order is mlx-lm's ``generate_step`` + ``make_sampler``: logits processors (repetition,
presence, frequency penalties over the last ``penalty_last_n`` tokens), then log-softmax, then
top-p, min-p, top-k, then a categorical draw at ``1 / temperature``; temperature 0 is argmax.
The filters are mlx-lm's own functions. The one difference is the random source: mlx-lm draws
from MLX's global generator, which lanes would share, so each lane draws from its own key
(``mx.random.key(seed)``, split once per draw), which makes a seeded lane repeat itself
whatever else runs beside it.

A lane whose sampling is not ``plain`` (logprobs, ``logit_bias``, a JSON or grammar constraint)
has its row brought to the host first: core's fixed order (:mod:`superfluid.core.logits`) reads
the logprobs from the raw row, then adds the bias, then the constraint masks it, and only then do
the penalties, filters and temperature above pick the token (:meth:`LaneSampler.shape`)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
from mlx_lm import sample_utils as su

from superfluid.core.constrain import LaneConstraint
from superfluid.core.logits import apply_bias
from superfluid.core.request import SamplingParams

NO_LIMIT = 1 << 30


def logits_processors(params: SamplingParams) -> list:
    """mlx-lm's penalty processors for a lane (empty without penalties)."""
    if not params.uses_penalties or params.penalty_last_n == 0:
        return []
    size = NO_LIMIT if params.penalty_last_n < 0 else params.penalty_last_n
    procs = []
    if params.repeat_penalty != 1.0:
        procs.append(su.make_repetition_penalty(params.repeat_penalty, size))
    if params.presence_penalty != 0.0:
        procs.append(su.make_presence_penalty(params.presence_penalty, size))
    if params.frequency_penalty != 0.0:
        procs.append(su.make_frequency_penalty(params.frequency_penalty, size))
    return procs


def filters(params: SamplingParams) -> list:
    """mlx-lm's filters in ``make_sampler``'s order (on log-probabilities)."""
    out = []
    if 0 < params.top_p < 1.0:
        out.append(lambda x, p=params.top_p: su.apply_top_p(x, p))
    if params.min_p != 0.0:
        out.append(lambda x, p=params.min_p: su.apply_min_p(x, p, 1))
    if params.top_k > 0:
        out.append(lambda x, k=params.top_k: su.apply_top_k(x, k))
    return out


class LaneSampler:
    """One lane's sampler: its penalties' token window, its filters, its random key and its
    constraint (None: unconstrained)."""

    def __init__(self, params: SamplingParams, history: list[int] | None = None,
                 constraint: LaneConstraint | None = None):
        self.params = params
        self.greedy = params.greedy
        self.plain = params.plain  # sampled on the device straight from the model's row
        self.constraint = constraint
        self.processors = logits_processors(params)
        self.filters = filters(params)
        self.tokens: list[int] = list(history or ()) if self.processors else []
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.key = None if self.greedy else mx.random.key(seed & ((1 << 64) - 1))

    @property
    def penalized(self) -> bool:
        return bool(self.processors)

    @property
    def sees_feed(self) -> bool:
        """Whether tokens fed to the KV must reach it: penalties count the prompt, a constraint
        the generated tokens a resumed lane replays."""
        return bool(self.processors) or self.constraint is not None

    def accept(self, tokens: list[int]) -> None:
        """Tokens the lane generated (sampled now or replayed): penalties and constraint move on."""
        if self.processors:
            self.tokens.extend(tokens)
        if self.constraint is not None:
            for token in tokens:
                self.constraint.accept(token)

    def accept_fed(self, tokens: list[int], start: int, generated_from: int | None) -> None:
        """Tokens fed to the KV at positions ``start, start+1, ...``: the penalties see them all
        but image placeholders (negative ids, core/media.py: no token to penalise), the constraint
        only those at or past ``generated_from`` (the prompt's end; None: the lane has generated
        nothing yet), since it holds the generated text only."""
        if self.processors:
            self.tokens.extend(t for t in tokens if t >= 0)
        if self.constraint is not None and generated_from is not None:
            for i, token in enumerate(tokens):
                if start + i >= generated_from and token >= 0:
                    self.constraint.accept(token)

    def shape(self, raw: np.ndarray) -> np.ndarray:
        """The row to sample from, given the model's raw row (left untouched, for logprobs):
        the bias added, then the constraint's mask."""
        if not (self.params.logit_bias or self.constraint is not None):
            return raw
        row = np.array(raw, dtype=np.float32, copy=True)
        apply_bias(row, self.params.logit_bias)
        if self.constraint is not None:
            self.constraint.mask(row)
        return row

    def sample(self, logits: mx.array) -> mx.array:
        """A lazy token (shape (1,)) from one row of logits (shape (1, vocab))."""
        if self.processors and self.tokens:
            history = mx.array(self.tokens)
            for proc in self.processors:
                logits = proc(history, logits)
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        for f in self.filters:
            logprobs = f(logprobs)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.params.temperature), key=sub)
