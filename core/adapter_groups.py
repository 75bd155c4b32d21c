"""How long each adapter set's lanes have waited for a tick: the bookkeeping behind grouping
lanes by LoRA adapter set on an engine that applies one set per step
(``EngineCapabilities.adapters == "per_tick"``: llama.cpp, MLX).

Which group a tick runs is policy (the qos plugin's ``groups.py``); this module only counts, so
the policy sees on each lane how many ticks have passed since a lane of its set last ran
(``Lane.group_waited``). The scheduler stamps the lanes before it asks for a plan and counts the
plan once it is made."""

from __future__ import annotations

from .lane import Lane
from .request import AdapterSet
from .tick import TickPlan


class GroupClock:
    def __init__(self) -> None:
        self.waited: dict[AdapterSet, int] = {}

    def stamp(self, lanes: list[Lane]) -> None:
        """Write each lane's group wait on it (0 for a set seen for the first time)."""
        for lane in lanes:
            lane.group_wait(self.waited.get(lane.request.adapters, 0))

    def count(self, lanes: list[Lane], plan: TickPlan, per_tick: bool = False) -> None:
        """A plan was made: the sets it runs waited 0 ticks, the other sets of running lanes one
        more; sets no lane runs under are forgotten. ``per_tick``: the engine runs one set per
        step, so a policy that planned lanes of several sets broke the engine's contract."""
        ran = {lp.adapters for lp in plan.lanes}
        if per_tick and len(ran) > 1:
            raise RuntimeError(f"the tick policy planned lanes of {len(ran)} LoRA adapter sets on an engine "
                               "that runs one set per tick")
        sets = {lane.request.adapters for lane in lanes}
        self.waited = {s: 0 if s in ran else self.waited.get(s, 0) + 1 for s in sets}
