"""Where a new lane's KV may come from: which lanes may reuse others' KV, which running lane's
slot holds a prefix, which seed holds the longest prefix of a prompt, and which queued lanes
should wait for a prefix still being prefilled. A prefix is shared only between lanes of one
LoRA adapter set (KV computed under one adapter is not another's). It only chooses: the KV manager
(``core/kv.py``) takes the slot and keeps the books."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lane import Lane
from .media import snap
from .prefix import MIN_REUSE, common_prefix
from .tick import OWN, Seed

if TYPE_CHECKING:
    from .prefix import HostTier, SlotCache


def waiting_for_donors(queue: list[Lane], donors: list[Lane]) -> set[Lane]:
    """Queued lanes whose prompt starts with a prefix one of ``donors`` is still prefilling:
    they wait for it and copy it, instead of prefilling the same tokens again."""
    donors = [l for l in donors if l.is_prefilling and l.n_cached < l.n_prompt]
    waiting = set()
    for lane in queue if donors else ():
        if not may_reuse(lane):
            continue
        head = lane.tokens[:MIN_REUSE]
        for donor in donors:
            # cheap reject before the full comparison
            if donor.tokens[:MIN_REUSE] != head or donor.request.adapters != lane.request.adapters:
                continue
            shared = min(common_prefix(donor.tokens[:donor.n_prompt], lane.tokens), lane.n_prompt - 1)
            if shared >= MIN_REUSE and donor.n_cached < shared:
                waiting.add(lane)
                break
    return waiting


def best_seed(lane: Lane, cache: SlotCache, host: HostTier, free: list[int], busy: list[int] | None,
              running: list[Lane]) -> tuple[int, int, Seed, int | None]:
    """For a lane that may reuse a prefix: its slot, how many of its tokens the seed holds, the
    seed, and the cached slot it copies from instead of taking it (kept whole this tick), if any.
    The longest prefix wins: a free slot's cache, a running lane's KV, the host tier."""
    seed, copied = OWN, None
    media = lane.request.media  # a prefix holds every image whole (see media.snap)
    adapters = lane.request.adapters  # and is shared only under the same adapter set
    slot, reuse = cache.best_slot(lane.tokens, free, busy, adapters)
    reuse = snap(media, reuse)
    if reuse and len(cache.tokens(slot)) > reuse + MIN_REUSE:
        # The cache holds more than this lane shares (another conversation that branched off
        # here): copy the shared part into the least valuable other free slot (an empty one
        # first) and keep the cache whole, unless every other slot's cache is worth more.
        target = cache.least_valuable([s for s in free if s != slot], busy)
        if target is not None and cache.worth_less(target, slot):
            seed = Seed(slot=slot)
            copied, slot = slot, target
    for donor in running:  # a running lane's KV may hold more of this prompt
        source = kv_source(donor)
        if source is None or donor.request.adapters != adapters:
            continue
        shared = snap(media, min(common_prefix(donor.tokens[:donor.n_cached], lane.tokens), len(lane.tokens) - 1))
        if shared > reuse and shared >= MIN_REUSE:
            reuse, seed = shared, Seed(slot=source)
    if len(host):  # a host-memory prefix may hold more of it
        key, shared = host.best(lane.tokens, adapters)
        shared = snap(media, shared)
        if key is not None and shared > reuse and shared >= MIN_REUSE:
            reuse, seed = shared, Seed(key=key, shared=True)
    return slot, reuse, seed, copied


def own_head(cache: SlotCache, slot: int, lane: Lane) -> int:
    """Tokens ``slot``'s own cache (if of the lane's adapter set) shares with the lane's prompt,
    one token left to feed."""
    return min(common_prefix(cache.tokens_for(slot, lane.request.adapters), lane.tokens), len(lane.tokens) - 1)


def may_reuse(lane: Lane) -> bool:
    """Whether a lane may be seeded from KV other lanes computed. A batch-invariant lane may not:
    its output must not depend on other traffic, and cached KV was computed beside it. Nor may a
    lane that needs every prompt position computed here (prompt logprobs, an embedding); a
    reranker's lane may (Request.rank): it needs only its last position's state, so the pairs of
    one query share the prompt up to the document."""
    req = lane.request
    return (lane.parked is None and req.reuse_prefix and not req.batch_invariant
            and req.prompt_logprobs is None and (not req.embed or req.rank))


def kv_source(lane: Lane) -> int | None:
    """The slot whose KV holds ``lane.tokens[:lane.n_cached]`` when the next tick starts (copies
    are made then): its own slot, unless it is itself restored this tick or copied in."""
    if not lane.needs_reset:
        return lane.slot
    if lane.seed.key is not None:
        return None
    return lane.seed.slot if lane.seed.slot is not None else lane.slot
