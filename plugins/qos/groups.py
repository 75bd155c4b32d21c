"""Which adapter set's lanes a tick runs, on an engine that applies one LoRA adapter set per
step (``EngineCapabilities.adapters == "per_tick"``: llama.cpp applies an adapter to a whole
context, so lanes of different sets cannot share a decode batch).

The rule, in order:

1. A batch-invariant lane's group goes first (the lane ticks alone anyway, see the planner).
2. A starving group: one whose lanes have not run for ``--starvation-ticks`` ticks
   (``Lane.group_waited``) goes next, the longest-waiting first. This is the bound: with G
   groups, a group with lanes waits at most ``starvation_ticks + G - 1`` ticks.
3. Otherwise the group holding the most urgent lane by QoS class (interactive before
   completion before agent before background), so a chat under one adapter is not held
   behind agents under another.
4. Among groups equally urgent, the one that has waited longest, then the one whose lane was
   admitted first: equal groups take turns tick by tick.

QoS and preemption still apply across groups: admission, lane caps and preemption look at
every lane whatever its set (a queued interactive request under adapter A preempts a
background lane under B), and within the chosen group the planner orders prefill as always.
A tick holding one group costs the others that tick's decode round; with two busy groups of
equal class each decodes every other tick."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.lane import Lane


def adapter_group(lanes: list[Lane], settings) -> list[Lane]:
    """The lanes of the one adapter set this tick runs (all of ``lanes`` when they share one)."""
    groups: dict[tuple, list[Lane]] = {}
    for lane in lanes:
        groups.setdefault(lane.request.adapters, []).append(lane)
    if len(groups) <= 1:
        return lanes
    bound = max(settings.starvation_ticks, 1)

    def key(members: list[Lane]):
        waited = max(l.group_waited for l in members)
        starving = waited >= bound
        return (not any(l.request.batch_invariant for l in members), not starving,
                -waited if starving else 0, min(qos.priority(l.qos) for l in members), -waited,
                min(l.seniority for l in members))
    return min(groups.values(), key=key)
