"""Where a new lane's KV may come from: which lanes may reuse others' KV, which running lane's
slot holds a prefix, and which queued lanes should wait for a prefix still being prefilled."""

from __future__ import annotations

from .lane import Lane
from .prefix import MIN_REUSE, common_prefix


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
            if donor.tokens[:MIN_REUSE] != head:  # cheap reject before the full comparison
                continue
            shared = min(common_prefix(donor.tokens[:donor.n_prompt], lane.tokens), lane.n_prompt - 1)
            if shared >= MIN_REUSE and donor.n_cached < shared:
                waiting.add(lane)
                break
    return waiting


def may_reuse(lane: Lane) -> bool:
    """Whether a lane may be seeded from KV other lanes computed. A batch-invariant lane may not:
    its output must not depend on other traffic, and cached KV was computed beside it. Nor may a
    lane that needs every prompt position computed here (prompt logprobs, an embedding)."""
    req = lane.request
    return (lane.parked is None and req.reuse_prefix and not req.batch_invariant
            and req.prompt_logprobs is None and not req.embed)


def kv_source(lane: Lane) -> int | None:
    """The slot whose KV holds ``lane.tokens[:lane.n_cached]`` when the next tick starts (copies
    are made then): its own slot, unless it is itself restored this tick or copied in."""
    if not lane.needs_reset:
        return lane.slot
    if lane.seed.key is not None:
        return None
    return lane.seed.slot if lane.seed.slot is not None else lane.slot
