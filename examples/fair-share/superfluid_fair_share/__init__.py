"""Fair share of lanes between tenants within a QoS class, by deficit round robin.

Installed, it changes nothing; one TOML line turns it on: ``fair-share = true`` (a model-scoped
option, so it may go in one ``[[models]]`` table instead, or be the flag ``--fair-share``).

A tenant is whom a request is for: its API key under a key policy, else the body's ``user``
(``Request.meta["tenant"]``, set by the HTTP front end); requests with neither share one bucket.

It wraps the admission decision rather than replacing it: the plugin that answers
``superfluid_pick_next`` (the built-in qos plugin) still picks the lane, so its class order,
aging (the starvation bound), lane caps, pressure rules and the preemption that follows stay
exactly as they are. Fair-share only changes *whose* lane of the picked class goes next.
"""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.config import Option
from superfluid.core.hookspecs import hookimpl

OPTION = "fair-share"
_rings: dict[tuple, list] = {}      # (model, class, batch-invariant) -> tenants, next turn first
_pending: dict[int, tuple] = {}     # model -> (the lane handed out last, its ring's key)


@hookimpl
def superfluid_add_config(schema):
    schema.add(Option(OPTION, bool, False, "share lanes fairly between API keys (or users) within each "
                      "QoS class, by deficit round robin (the fair-share example plugin)", model_scoped=True))


def tenant(lane) -> str | None:
    return lane.request.meta.get("tenant")


def keeps_its_turn(pick, queue) -> bool:
    """The default policy's pick stands when it is more than "the next lane of its class": a
    preempted lane resuming (requeued at the head of its class) or a lane that beat a queued lane
    of a more urgent class (lifted by aging, the starvation bound; or that class is capped)."""
    rank = qos.priority(pick.qos)
    return pick.admitted_at is not None or any(qos.priority(l.qos) < rank for l in queue)


def _refund(queue, model: int) -> None:
    """The lane handed out last was not admitted after all (no room, no victim): its tenant
    gets its turn back, so a refused admission costs it nothing."""
    lane, key = _pending.pop(model, (None, None))
    ring = _rings.get(key)
    if lane is not None and lane in queue and ring and tenant(lane) in ring:
        ring.remove(tenant(lane))
        ring.insert(0, tenant(lane))


@hookimpl(wrapper=True)
def superfluid_pick_next(queue, settings):
    """Deficit round robin with a quantum of one lane, each admission costing one lane.

    Lanes are what is scarce, and a request's token cost is unknown until it ends (EOS, stop
    strings), so the lane is the unit; prompt lengths are already metered by the planner's
    prefill budget. With unit costs DRR's deficit never carries over: each round gives every
    backlogged tenant one lane, in turn. A tenant whose queue empties leaves the round (DRR
    resets its deficit) and a tenant that arrives joins at the round's end, so a flood waits
    its turn like anyone else and one client's backlog can no longer delay the others'."""
    pick = yield  # the next implementation's answer (the qos plugin's)
    if pick is None or not settings.extra.get(OPTION):
        return pick
    model = id(settings)
    _refund(queue, model)
    key = (model, pick.qos, pick.request.batch_invariant)
    heads: dict = {}  # tenant -> its oldest lane of the picked kind, tenants in arrival order
    for lane in queue:
        if (lane.qos, lane.request.batch_invariant) == key[1:] and lane.admitted_at is None:
            heads.setdefault(tenant(lane), lane)
    ring = [t for t in _rings.get(key, ()) if t in heads]
    ring += [t for t in heads if t not in ring]
    chosen = pick if keeps_its_turn(pick, queue) or not ring else heads[ring[0]]
    if tenant(chosen) in ring:  # served: to the end of the round
        ring.remove(tenant(chosen))
        ring.append(tenant(chosen))
    _rings[key] = ring
    _pending[model] = (chosen, key)
    return chosen
