"""Prompt-lookup speculation: drafts taken from the lane's own history, checked in the same
forward pass as the step, and a gate that turns it off when it does not pay.

A lane that repeats itself (code edits, quoting, structured output, summaries that copy their
source) often continues an n-gram it has seen before; :func:`propose` drafts the tokens that
followed its last occurrence, the runner feeds ``[last_token] + draft`` in one pass, and samples
the row after every position as that token would have been sampled without speculation: the
argmax for a greedy lane; for a sampled lane, the lane's own draw with the uniform that token
would get (:meth:`.sampler.LaneSampler.peek`). :func:`verify` keeps the draft's prefix that
agrees with those picks, plus the pick after it. Each pick before the first disagreement was
made from exactly the history the lane would have had, so the lane's output is the same with and
without speculation, token for token (seeded lanes included), up to float rounding of the
batched rows; a step just emits more than one token when the draft was right. For a sampled lane
this is speculative sampling with a draft that is one token for sure: a drafted token is kept
with its own probability, and on a miss the draw is already a sample of the model's
distribution, so unseeded text keeps its distribution too.

Logit bias and logprobs are read from each position's own row. Penalties and a grammar depend
on the tokens before a position, so each verify row gets the penalty window and the grammar mask
it would have had there (:meth:`.sampler.LaneSampler.verify_rows`). So every lane that decodes
may speculate. The win is at low concurrency, where a step is bound by reading the weights and the
extra positions are nearly free; under load the batch already fills the device and wasted draft
positions cost real compute, so :class:`Gate` turns it off there, and for lanes whose drafts
keep being rejected (a sampled lane at a high temperature keeps fewer)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose(history: Sequence[int], k: int, *, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Prompt-lookup drafts: the longest n-gram (``ngram_max`` down to ``ngram_min`` tokens) that
    ends ``history`` and occurs earlier in it; up to ``k`` tokens that followed its most recent
    earlier occurrence ([] if none).

    Cost: one vectorized numpy pass over the history (positions where its last token occurs),
    then narrowing those candidates one token further back per n-gram length; for a list the
    conversion to an array dominates (~0.2 ms for 8k tokens). A numpy array is used as it is."""
    if k <= 0 or ngram_max < 1:
        return []
    seq = history if isinstance(history, np.ndarray) else np.fromiter(history, dtype=np.int64, count=len(history))
    n_hist = seq.shape[0]
    if n_hist < 2:
        return []
    ngram_min = max(1, ngram_min)
    # ends[j]: an earlier n-gram ending at j (j < n_hist - 1) matches the history's last n tokens
    ends = np.flatnonzero(seq[:-1] == seq[-1])
    best: int | None = None
    for n in range(1, ngram_max + 1):
        if ends.size == 0:
            break
        if n > 1:
            ends = ends[ends >= n - 1]
            ends = ends[seq[ends - (n - 1)] == seq[n_hist - n]]
            if ends.size == 0:
                break
        if n >= ngram_min:
            best = int(ends[-1])
    if best is None:
        return []
    return [int(t) for t in seq[best + 1:best + 1 + k]]


def verify(draft: list[int], picks: list[int]) -> list[int]:
    """The tokens a lane emits after a verify pass: ``picks[i]`` is the token the lane's sampling
    picked from the model's row after feed position ``i`` of ``[last_token] + draft`` (so it has
    one more entry than ``draft``). The draft's prefix the picks agree with, then the pick after
    it: at least one token, exactly what decoding without speculation gives."""
    if len(picks) != len(draft) + 1:
        raise ValueError(f"{len(picks)} picks for a draft of {len(draft)}: expected one more")
    accepted = 0
    for proposed, actual in zip(draft, picks):
        if int(proposed) != int(actual):
            break
        accepted += 1
    return [int(t) for t in picks[:accepted + 1]]


class _LaneGate:
    __slots__ = ("ema", "since_probe")

    def __init__(self):
        self.ema = 1.0  # a new lane drafts until its drafts show they do not pay
        self.since_probe = 0


class Gate:
    """Turns speculation off when it does not pay: under load (more than ``max_lanes`` decoding
    lanes in the step: the batch fills the device, extra positions cost compute) and per lane at
    low acceptance (an EMA of accepted/drafted below ``min_acceptance``); such a lane drafts
    again once every ``probe_every`` of its steps, and the probe's outcome moves its EMA.

    Totals for /metrics: ``drafted``, ``accepted``, ``verify_steps``, :attr:`acceptance_rate`."""

    ALPHA = 0.3  # EMA weight of the latest verify step: a few bad steps turn a lane off

    def __init__(self, k: int, *, max_lanes: int = 4, min_acceptance: float = 0.3, probe_every: int = 16):
        self.k = k
        self.max_lanes = max_lanes
        self.min_acceptance = min_acceptance
        self.probe_every = max(1, probe_every)
        self.lanes: dict[int, _LaneGate] = {}
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0

    def draft_len(self, slot: int, n_decoding: int) -> int:
        """How many tokens ``slot`` may draft this step (0: decode normally)."""
        if self.k <= 0 or n_decoding > self.max_lanes:
            return 0
        lane = self.lanes.setdefault(slot, _LaneGate())
        if lane.ema >= self.min_acceptance:
            return self.k
        lane.since_probe += 1
        if lane.since_probe >= self.probe_every:
            lane.since_probe = 0
            return self.k
        return 0

    def record(self, slot: int, drafted: int, accepted: int) -> None:
        """A verify step's outcome: ``accepted`` of ``drafted`` tokens kept."""
        if drafted <= 0:
            return
        lane = self.lanes.setdefault(slot, _LaneGate())
        lane.ema += self.ALPHA * (min(accepted, drafted) / drafted - lane.ema)
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1

    def forget(self, slot: int) -> None:
        """The slot's lane ended: its successor starts afresh."""
        self.lanes.pop(slot, None)

    def active(self, slot: int) -> bool:
        """Whether the slot's acceptance keeps it drafting (load aside)."""
        lane = self.lanes.get(slot)
        return lane is None or lane.ema >= self.min_acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0
