"""Work a lane does on its prompt beyond filling the KV: scoring it (each prompt token's
log-probability, for a completion's ``echo`` with ``logprobs``) or pooling it into an embedding.

The scheduler asks for both through the tick's lane plans (``LanePlan.targets`` and
``LanePlan.embed``, filled here after the policy has cut the plan) and collects what comes back.
Results are kept by prompt position, so a lane that is preempted and computes part of its prompt
again (its KV dropped) counts each position once."""

from __future__ import annotations

import numpy as np

from .lane import Lane
from .media import grids, spans_within
from .tick import LanePlan, LaneResult, TickPlan


def annotate(plan: TickPlan, lanes: list[Lane]) -> None:
    """Give each prompt-scoring or embedding lane's plan what its engine needs for that, and
    each feed that holds image rows the images (binding the media: the engine encodes an image
    the first time its rows are fed, and keeps the rows by content hash)."""
    _bind_media(plan, lanes)
    by_slot = {lane.slot: lane for lane in lanes if lane.request.embed or lane.request.prompt_logprobs is not None}
    if not by_slot:  # the usual tick: nothing to add
        return
    for lp in plan.lanes:
        lane = by_slot.get(lp.slot)
        if lane is None or lp.decode:
            continue
        req = lane.request
        if req.embed:
            lp.embed = True
            lp.rank = req.rank
        if req.prompt_logprobs is not None and lp.pos < lane.n_prompt:
            lp.targets = lane.tokens[lp.pos + 1:min(lp.pos + len(lp.feed) + 1, lane.n_prompt)]
            lp.score_top = req.prompt_logprobs


def _bind_media(plan: TickPlan, lanes: list[Lane]) -> None:
    with_media = {lane.slot: lane for lane in lanes if lane.request.media}
    if not with_media:
        return
    for lp in plan.lanes:
        lane = with_media.get(lp.slot)
        if lane is None:
            continue
        if not lp.decode and lp.feed:
            lp.media = spans_within(lane.request.media, lp.pos, lp.pos + len(lp.feed))
        lp.grids = grids(lane.request.media)
        if lp.history:  # image rows are no tokens a fresh sampler could have seen
            lp.history = [t for t in lp.history if t >= 0]


def collect(lane: Lane, lp: LanePlan, res: LaneResult) -> None:
    """Keep what a tick computed of a lane's prompt: a logprob per scored position, the hidden
    states an embedding lane pooled (restarted from zero when its KV was, at position 0)."""
    for i, entry in enumerate(res.prompt_logprobs):
        lane.prompt_logprobs[lp.pos + i + 1] = entry
    if lp.embed and res.pooled:
        part = np.asarray(res.embedding_sum, dtype=np.float64)
        if lp.pos == 0 or lane.embedding_sum is None:
            lane.embedding_sum, lane.pooled = part, res.pooled
        else:
            lane.embedding_sum, lane.pooled = lane.embedding_sum + part, lane.pooled + res.pooled


def newly_scored(lane: Lane) -> bool:
    """Whether a scored prompt has just been computed to its end (its "scored" event is due): a
    streamed reply that echoes the prompt with its logprobs can start then, before any token."""
    if lane.request.prompt_logprobs is None or lane.scores_sent or lane.n_cached < lane.n_prompt:
        return False
    lane.scores_sent = True
    return True


def prompt_scores(lane: Lane) -> tuple:
    """A scored prompt's logprobs, one per position from 1 to the end, in order."""
    return tuple(lane.prompt_logprobs[p] for p in sorted(lane.prompt_logprobs) if p < lane.n_prompt)


def embedding(lane: Lane) -> tuple[float, ...]:
    """The lane's mean-pooled, L2-normalised embedding (as OpenAI's and llama-server's are); a
    reranker's lane (Request.rank): its head's scores as the engine computed them."""
    if lane.embedding_sum is None or not lane.pooled:
        return ()
    mean = lane.embedding_sum / lane.pooled
    if lane.request.rank:
        return tuple(float(x) for x in mean)
    norm = float(np.linalg.norm(mean))
    return tuple(float(x) for x in (mean / norm if norm > 0 else mean))
