"""The llama.cpp tick runner on the real SmolLM2 model, driven directly (no daemon, no HTTP).

The runner keeps a numpy view per logits row address and a per-slot count of KV cells between
ticks; these tests check that what it reuses across steps and ticks gives the same answers as
asking llama.cpp afresh."""

from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, TickPlan
from superfluid.plugins.llamacpp.worker import WorkerSpec, main

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ([1, 9690, 198, 4093, 314, 253, 1789, 30], [1, 4093, 28, 1350, 346, 1789, 30, 22])


@pytest.fixture(scope="module")
def tick(model_path):
    """Run ticks on a real worker (its ``main`` on a thread of this process, over a pipe)."""
    ours, theirs = mp.Pipe()
    thread = threading.Thread(target=main, args=(theirs, mp.RawArray("b", 3),
                              WorkerSpec(path=model_path, max_lanes=2, max_context=512, threads=2)), daemon=True)
    thread.start()
    while True:
        kind, payload = ours.recv()
        assert kind in ("progress", "ready"), payload
        if kind == "ready":
            break

    def run(plan: TickPlan):
        ours.send(("tick", plan))
        kind, result = ours.recv()
        assert kind == "ok", result
        return result

    yield run
    ours.send(("close",))
    thread.join(30)


def generate(tick, slots: list[int], n: int, rounds: int, beside: bool = False) -> dict[int, list[int]]:
    """Greedy tokens for PROMPTS[slot] in each slot, all lanes together, ``rounds`` decode rounds a
    tick; ``beside``: slot 3 prefills a chunk in every tick too, without sampling (a batch token
    that asks for no logits)."""
    out = {slot: [] for slot in slots}
    filler = 0
    plans = [LanePlan(slot=slot, pos=0, feed=list(PROMPTS[slot]), sample=True, max_new=1, reset=True,
                      sampling=GREEDY, ignore_eos=True) for slot in slots]
    while plans:
        if beside:
            plans.append(LanePlan(slot=3, pos=filler, feed=PROMPTS[1][:5], sample=False,
                                  reset=filler == 0, sampling=GREEDY))
            filler += 5
        result = tick(TickPlan(lanes=plans))
        plans = []
        for slot in slots:
            out[slot] += result.lanes[slot].tokens
            if len(out[slot]) < n:
                plans.append(LanePlan(slot=slot, pos=len(PROMPTS[slot]) + len(out[slot]) - 1, feed=[out[slot][-1]],
                                      sample=True, max_new=min(rounds, n - len(out[slot])), decode=True,
                                      ignore_eos=True))
    tick(TickPlan(release=list(slots) + ([3] if beside else [])))
    return out


def test_greedy_tokens_do_not_depend_on_how_steps_are_cut_into_ticks_or_batched(tick):
    alone_long = generate(tick, [0], 24, rounds=23)[0]
    alone_short = generate(tick, [0], 24, rounds=3)[0]
    together = generate(tick, [0, 1], 24, rounds=5)  # two logits rows a step
    with_prefill = generate(tick, [0, 1], 24, rounds=4, beside=True)
    other_alone = generate(tick, [1], 24, rounds=24)[1]
    assert len(alone_long) == 24
    assert alone_short == alone_long
    assert together[0] == alone_long
    assert together[1] == other_alone != alone_long
    assert with_prefill == together


def test_kv_cell_count_follows_the_slots_a_tick_touched(tick):
    first = tick(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(PROMPTS[0]), sample=True, max_new=4,
                                          reset=True, sampling=GREEDY, ignore_eos=True)]))
    held0 = len(PROMPTS[0]) + 3  # the last sampled token is not fed yet
    assert first.kv_used == held0
    second = tick(TickPlan(lanes=[LanePlan(slot=1, pos=0, feed=list(PROMPTS[1]), sample=True, max_new=1,
                                           reset=True, sampling=GREEDY)]))
    assert second.kv_used == held0 + len(PROMPTS[1])  # slot 0 untouched: its count is kept
    cut = tick(TickPlan(lanes=[LanePlan(slot=0, pos=5, feed=[PROMPTS[0][5]], sample=False)]))
    assert cut.kv_used == 6 + len(PROMPTS[1])         # cut back to 5 cells, then one fed
    released = tick(TickPlan(release=[0, 1]))
    assert released.kv_used == 0


def test_parked_kv_restores_into_another_slot_and_generation_continues(tick):
    prompt = PROMPTS[0]
    whole = generate(tick, [0], 16, rounds=16)[0]
    first = tick(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(prompt), sample=True, max_new=8,
                                          reset=True, sampling=GREEDY, ignore_eos=True)])).lanes[0].tokens
    assert first == whole[:8]
    parked = tick(TickPlan(park=[(0, "k")], release=[0]))
    assert parked.parked["k"] > 0 and parked.parked_bytes == parked.parked["k"] and parked.kv_used == 0
    resumed = tick(TickPlan(lanes=[LanePlan(slot=1, pos=len(prompt) + 7, feed=[first[-1]], sample=True,
                                            max_new=8, reset=True, restore="k", sampling=GREEDY,
                                            decode=True, ignore_eos=True)]))
    assert not resumed.lanes[1].restore_failed
    assert first + resumed.lanes[1].tokens == whole
    assert resumed.parked_bytes == 0  # restored without keep: the host copy is gone
    tick(TickPlan(release=[1]))
