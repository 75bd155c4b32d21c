"""The llama.cpp tick runner on the real SmolLM2 model, driven directly (no daemon, no HTTP).

The runner keeps a numpy view per logits row address and a per-slot count of KV cells between
ticks; these tests check that what it reuses across steps and ticks gives the same answers as
asking llama.cpp afresh. Each runs twice: with the decode rounds in C (``_rounds.c``, built by
the install) and in Python; both must give the same tokens."""

from __future__ import annotations

import pytest

from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, Seed, TickPlan
from superfluid.core.worker_process import WorkerProcess
from superfluid.plugins.llamacpp.extra_buffers import choose
from superfluid.plugins.llamacpp.worker import WorkerSpec, main

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = ([1, 9690, 198, 4093, 314, 253, 1789, 30], [1, 4093, 28, 1350, 346, 1789, 30, 22])


class Worker:
    """A real worker process, as the daemon runs it (``WorkerProcess`` over the worker's ``main``),
    so that a crash in llama.cpp fails the test that met it, not the whole run. Call it with a plan."""

    def __init__(self, model_path: str, native_rounds: bool, max_context: int = 512):
        self.process = WorkerProcess("test-model")
        self.flag = self.process.stop_flag
        spec = WorkerSpec(path=model_path, max_lanes=2, max_context=max_context, threads=2,
                          native_rounds=native_rounds, extra_buffers=choose("auto").use)
        self.info = self.process.start(main, spec, name="test-llamacpp-worker")

    def __call__(self, plan: TickPlan):
        return self.process.call(("tick", plan))

    def close(self) -> None:
        self.process.close()


@pytest.fixture(scope="module")
def workers(model_path):
    made = {"native": Worker(model_path, True), "python": Worker(model_path, False)}
    yield made
    for worker in made.values():
        worker.close()


@pytest.fixture(params=["native", "python"])
def tick(request, workers):
    return workers[request.param]


def test_the_install_built_the_c_decode_loop(workers):
    assert workers["native"].info["native_rounds"] is True
    assert workers["python"].info["native_rounds"] is False


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
                                            max_new=8, reset=True, seed=Seed(key="k"), sampling=GREEDY,
                                            decode=True, ignore_eos=True)]))
    assert not resumed.lanes[1].restore_failed
    assert first + resumed.lanes[1].tokens == whole
    assert resumed.parked_bytes == 0  # restored without keep: the host copy is gone
    tick(TickPlan(release=[1]))


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
PENALIZED = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.2)


@pytest.mark.parametrize("sampling", [SAMPLED, PENALIZED], ids=["seeded", "penalties"])
def test_c_and_python_decode_loops_sample_the_same_tokens(workers, sampling):
    """Sampled through llama.cpp's chain (seeded, or greedy with penalties), in ticks of 5
    rounds: the C loop and the Python loop feed the chain the same logits in the same order."""
    runs = {}
    for name, tick in workers.items():
        plan = LanePlan(slot=0, pos=0, feed=list(PROMPTS[0]), sample=True, max_new=1, reset=True,
                        sampling=sampling, ignore_eos=True)
        out: list[int] = []
        while len(out) < 30:
            out += tick(TickPlan(lanes=[plan])).lanes[0].tokens
            plan = LanePlan(slot=0, pos=len(PROMPTS[0]) + len(out) - 1, feed=[out[-1]], sample=True,
                            max_new=min(5, 30 - len(out)), decode=True, ignore_eos=True)
        tick(TickPlan(release=[0]))
        runs[name] = out
    assert len(runs["native"]) == 30
    assert runs["native"] == runs["python"]
    assert runs["native"] != generate(workers["native"], [0], 30, rounds=5)[0]  # the chain did sample


def _two_lanes(first_grant: int, second_grant: int, quiet: bool) -> TickPlan:
    return TickPlan(quiet=quiet, lanes=[
        LanePlan(slot=slot, pos=len(PROMPTS[slot]) - 1, feed=[PROMPTS[slot][-1]], sample=True, max_new=grant,
                 decode=True, ignore_eos=True)
        for slot, grant in ((0, first_grant), (1, second_grant))])


@pytest.mark.parametrize("quiet", [False, True])
def test_a_quiet_tick_ends_when_a_lane_does(tick, quiet):
    """In a quiet tick no client reads a lane's tokens before the tick ends, so the tick ends
    with the first lane to finish; an ordinary tick runs the other lanes' grants out."""
    for slot in (0, 1):  # each slot holds its prompt but the last token, fed by the plan
        tick(TickPlan(lanes=[LanePlan(slot=slot, pos=0, feed=PROMPTS[slot][:-1], sample=False, reset=True,
                                      sampling=GREEDY)]))
    result = tick(_two_lanes(3, 12, quiet))
    assert len(result.lanes[0].tokens) == 3
    assert len(result.lanes[1].tokens) == (3 if quiet else 12)
    assert result.stopped_early is quiet
    assert [s.decode_tokens for s in result.steps] == [2, 2, 2] + ([] if quiet else [1] * 9)
    tick(TickPlan(release=[0, 1]))


def test_a_raised_yield_flag_ends_the_tick_before_its_next_step(tick):
    tick(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=PROMPTS[0][:-1], sample=False, reset=True,
                                  sampling=GREEDY)]))
    tick.flag.request_yield()
    try:
        result = tick(TickPlan(lanes=_two_lanes(5, 5, False).lanes[:1]))
    finally:
        tick.flag.clear()
    assert result.stopped_early and result.lanes[0].tokens == [] and result.steps == []
    again = tick(TickPlan(lanes=_two_lanes(5, 5, False).lanes[:1]))  # nothing was fed: the same plan runs
    assert len(again.lanes[0].tokens) == 5 and not again.stopped_early
    tick(TickPlan(release=[0]))
