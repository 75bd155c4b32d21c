"""core.tick_runner's shared tick, driven with a tiny in-memory engine (no model, no worker).

The fake's KV is a list of tokens per slot; it "samples" the token after the last one fed (its
end-of-generation token is EOG), so every count and token a tick reports can be worked out by
hand. The real engines' tests (test_llamacpp_runner.py, test_mlx.py) stay the real check."""

from __future__ import annotations

import pytest

from superfluid.core.request import SamplingParams
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import LanePlan, Seed, StepTiming, TickPlan
from superfluid.core.tick_runner import PoolFull, TickRunner, Work, takes_one

GREEDY = SamplingParams(temperature=0.0)
PENALIZED = SamplingParams(temperature=0.0, repeat_penalty=1.3)
EOG = 99


class FakeSampler:
    def __init__(self, params: SamplingParams, history):
        self.penalized = params.uses_penalties
        self.seen = list(history or ())

    def accept(self, tokens):
        self.seen += tokens


class FakeStepRunner(TickRunner):
    """Each step feeds every single-token lane one token and prefill up to ``step_tokens`` (the
    plan's, else 4), then samples ``last fed + 1``. ``calls`` records the primitives in order;
    ``on_step(n)`` runs after step ``n`` (1-based); ``abort_at``/``full_at`` make that step
    fail as a stop-flag abort or a full pool would."""

    def __init__(self, stop_flag=None):
        super().__init__(stop_flag if stop_flag is not None else StopFlag(), kv_capacity=1000)
        self.kv: dict[int, list[int]] = {}
        self.files: dict[str, list[int]] = {}
        self.calls: list[tuple] = []
        self.n_steps = 0
        self.advances = 0
        self.on_step = None
        self.abort_at = self.full_at = None
        self.touched = None

    def park(self, slot, key):
        self.calls.append(("park", slot, key))
        self.parked[key] = list(self.kv.get(slot, ()))
        return len(self.parked[key]) or 1

    def load(self, path, key):
        self.calls.append(("load", path, key))
        if path not in self.files:
            return 0
        self.parked[key] = list(self.files[path])
        return len(self.parked[key])

    def save(self, key, path):
        self.calls.append(("save", key, path))
        self.files[path] = list(self.parked[key])
        return len(self.files[path])

    def drop(self, key):
        self.calls.append(("drop", key))
        super().drop(key)

    def parked_bytes(self):
        return sum(len(e) for e in self.parked.values())

    def restore(self, slot, entry):
        self.calls.append(("restore", slot))
        self.kv[slot] = list(entry)
        return True

    def clear_kv(self, slot):
        self.calls.append(("clear_kv", slot))
        self.kv.pop(slot, None)

    def copy(self, src, dst, pos):
        self.calls.append(("copy", src, dst, pos))
        self.kv[dst] = list(self.kv.get(src, ()))

    def keep_prefix(self, slot, pos):
        self.calls.append(("keep_prefix", slot, pos))
        held = self.kv.setdefault(slot, [])
        del held[pos:]
        return len(held) == pos

    def cut(self, slot, pos):
        self.calls.append(("cut", slot, pos))
        del self.kv.setdefault(slot, [])[pos:]

    def kv_used(self, touched):
        self.touched = set(touched)
        return sum(len(t) for t in self.kv.values())

    def new_sampler(self, lp):
        self.calls.append(("new_sampler", lp.slot))
        self.samplers[lp.slot] = FakeSampler(lp.sampling, lp.history)

    def accepts(self, slot):
        sampler = self.samplers.get(slot)
        return bool(sampler and sampler.penalized)

    def advance(self, active, plan, result):
        self.advances += 1
        self.n_steps += 1
        if self.n_steps == self.abort_at:
            return False
        if self.n_steps == self.full_at:
            raise PoolFull(sum(len(w.feed) for w in active))
        room = plan.step_tokens or 4
        timing = StepTiming(prefill_tokens=0, decode_tokens=0, seconds=0.0)
        for w in active:
            single = takes_one(w)
            count = 1 if single else min(len(w.feed), max(room, 0))
            if not count:
                continue
            room -= 0 if single else count
            fed, w.feed = w.feed[:count], w.feed[count:]
            self.kv.setdefault(w.slot, []).extend(fed)
            w.pos, w.result.n_fed = w.pos + count, w.result.n_fed + count
            if w.decoding:
                timing.decode_tokens += 1
            else:
                timing.prefill_tokens += count
                w.result.n_prefill += count
            sampler = self.samplers.get(w.slot)
            if sampler and w.accept:
                sampler.accept(fed)
            if w.sample and not w.feed:
                token = fed[-1] + 1
                if sampler:
                    sampler.accept([token])
                w.sampled(token, token == EOG)
        result.steps.append(timing)
        if self.on_step:
            self.on_step(self.n_steps)
        return True


def lane(slot, feed, pos=0, *, max_new=1, reset=True, sampling=GREEDY, **kw) -> LanePlan:
    return LanePlan(slot=slot, pos=pos, feed=list(feed), sample=kw.pop("sample", True), max_new=max_new,
                    reset=reset, sampling=sampling if reset else None, **kw)


def decode(slot, last, pos, max_new, **kw) -> LanePlan:
    return LanePlan(slot=slot, pos=pos, feed=[last], sample=True, max_new=max_new, decode=True, **kw)


# ---- the prelude, in the plan's order -----------------------------------------------------------

def test_prelude_runs_park_load_save_drop_release_then_the_lanes():
    r = FakeStepRunner()
    r.kv = {0: [1, 2, 3], 1: [4, 5]}
    r.files["f.in"] = [7, 8]
    r.parked["old"] = [9]
    res = r.run(TickPlan(park=[(0, "p")], load=[("f.in", "l")], save=[("old", "f.out")], drop_parked=["old"],
                         release=[1], lanes=[lane(2, [10, 11])]))
    assert r.calls[:7] == [("park", 0, "p"), ("load", "f.in", "l"), ("save", "old", "f.out"), ("drop", "old"),
                           ("clear_kv", 1), ("keep_prefix", 2, 0), ("new_sampler", 2)]
    assert res.parked == {"p": 3, "l": 2} and res.saved == {"f.out": 1}
    assert set(r.parked) == {"p", "l"} and res.parked_bytes == 5
    assert 1 not in r.kv and r.files["f.out"] == [9]
    assert res.lanes[2].tokens == [12] and res.lanes[2].n_fed == res.lanes[2].n_prefill == 2
    assert r.touched == {1, 2} and res.kv_used == 3 + 2 and res.kv_capacity == 1000
    assert len(res.steps) == 1 and not res.stopped_early


class SlotsOnlyRunner(TickRunner):
    """FakeStepRunner without the primitives a capability gates (parking, persisted KV, prefix
    copies): what an engine that declares none of them writes."""

    def __init__(self):
        super().__init__(StopFlag(), kv_capacity=1000)
        self.kv: dict[int, list[int]] = {}
        self.calls: list[tuple] = []
        self.n_steps = self.advances = 0
        self.on_step = self.abort_at = self.full_at = None

    clear_kv, keep_prefix, cut, kv_used = (FakeStepRunner.clear_kv, FakeStepRunner.keep_prefix,
                                           FakeStepRunner.cut, FakeStepRunner.kv_used)
    new_sampler, accepts, advance = FakeStepRunner.new_sampler, FakeStepRunner.accepts, FakeStepRunner.advance


def test_an_engine_without_parking_or_a_prefix_cache_writes_none_of_their_primitives():
    r = SlotsOnlyRunner()
    res = r.run(TickPlan(park=[(0, "p")], load=[("f.in", "l")], save=[("p", "f.out")], lanes=[lane(0, [1, 2])]))
    assert res.parked == {"p": 0, "l": 0} and res.saved == {"f.out": 0} and res.parked_bytes == 0
    assert r.parked == {} and res.lanes[0].tokens == [3]
    res = r.run(TickPlan(lanes=[lane(1, [5], pos=2, seed=Seed(key="p"))]))
    assert res.lanes[1].restore_failed and 1 not in r.kv
    with pytest.raises(NotImplementedError, match="prefix_cache"):
        r.run(TickPlan(lanes=[lane(2, [5], pos=2, seed=Seed(slot=0))]))


def test_a_plan_with_no_lanes_runs_no_step():
    r = FakeStepRunner()
    res = r.run(TickPlan(release=[3]))
    assert r.advances == 0 and res.lanes == {} and res.steps == [] and not res.stopped_early


# ---- seeding --------------------------------------------------------------------------------------

def test_own_seed_is_cut_to_pos_and_a_running_lane_is_cut_back():
    r = FakeStepRunner()
    r.kv = {0: [1, 2, 3, 4, 5], 1: [6, 7, 8]}
    r.samplers[0] = "old sampler"
    res = r.run(TickPlan(lanes=[lane(0, [30], pos=2), lane(1, [31], pos=1, reset=False, sample=False)]))
    assert r.kv[0] == [1, 2, 30] and r.kv[1] == [6, 31]
    assert ("cut", 1, 1) in r.calls and isinstance(r.samplers[0], FakeSampler)
    assert not res.lanes[0].restore_failed and res.lanes[0].tokens == [31]


def test_copy_seed_takes_the_source_slots_first_tokens():
    r = FakeStepRunner()
    r.kv = {0: [1, 2, 3, 4]}
    res = r.run(TickPlan(lanes=[lane(5, [40], pos=3, seed=Seed(slot=0))]))
    assert ("copy", 0, 5, 3) in r.calls and r.kv[5] == [1, 2, 3, 40] and r.kv[0] == [1, 2, 3, 4]
    assert res.lanes[5].tokens == [41]


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_parked_seed_is_restored_taken_out_unless_shared(shared):
    r = FakeStepRunner()
    r.parked["k"] = [1, 2, 3]
    r.kv[4] = [50, 51, 52, 53]
    res = r.run(TickPlan(lanes=[lane(4, [60], pos=2, seed=Seed(key="k", shared=shared))]))
    assert r.calls.index(("clear_kv", 4)) < r.calls.index(("restore", 4))
    assert r.kv[4] == [1, 2, 60] and ("k" in r.parked) == shared
    assert res.parked_bytes == (3 if shared else 0) and not res.lanes[4].restore_failed


@pytest.mark.parametrize("seed,pos", [(Seed(key="missing"), 1), (Seed(key="short"), 5), (Seed(slot=0), 9)],
                         ids=["missing", "too-short", "copy-too-short"])
def test_a_seed_that_cannot_give_pos_tokens_is_restore_failed(seed, pos):
    r = FakeStepRunner()
    r.parked["short"] = [1, 2]
    r.kv = {0: [1, 2, 3], 3: [7, 7]}
    r.samplers[3] = "old"
    res = r.run(TickPlan(lanes=[lane(3, [70], pos=pos, seed=seed), lane(1, [5, 6])]))
    failed = res.lanes[3]
    assert failed.restore_failed and failed.n_fed == 0 and failed.tokens == []
    assert 3 not in r.kv and 3 not in r.samplers  # the slot was cleared
    assert res.lanes[1].tokens == [7] and not res.lanes[1].restore_failed  # the other lane went on


# ---- samplers ---------------------------------------------------------------------------------------

def test_a_penalized_sampler_sees_history_and_prompt_but_a_decoding_lane_feeds_nothing_twice():
    r = FakeStepRunner()
    r.kv[0] = [1, 2]
    r.run(TickPlan(lanes=[lane(0, [3, 4], pos=2, sampling=PENALIZED, history=[1, 2], max_new=2)]))
    assert r.samplers[0].seen == [1, 2, 3, 4, 5, 6]  # history, prompt, then its own tokens only
    r.run(TickPlan(lanes=[decode(0, 6, pos=5, max_new=1)]))
    assert r.samplers[0].seen == [1, 2, 3, 4, 5, 6, 7]


# ---- the step loop ------------------------------------------------------------------------------------

def test_lanes_run_until_each_ends_at_its_grant_or_an_eog():
    r = FakeStepRunner()
    res = r.run(TickPlan(lanes=[lane(0, [1, 2, 3, 4, 5, 6], max_new=3), lane(1, [96], max_new=9),
                                lane(2, [96], max_new=9, ignore_eos=True)]))
    assert res.lanes[0].tokens == [7, 8, 9] and res.lanes[0].n_fed == 8 and res.lanes[0].n_prefill == 6
    assert res.lanes[1].tokens == [97, 98, 99] and res.lanes[1].eog
    assert res.lanes[2].tokens == [97, 98, 99, 100, 101, 102, 103, 104, 105] and not res.lanes[2].eog
    assert not res.stopped_early and r.n_steps == 9
    assert [s.prefill_tokens for s in res.steps[:3]] == [4 + 2, 2, 0]


@pytest.mark.parametrize("request_", ["request_stop", "request_yield"])
def test_the_stop_flag_ends_the_tick_before_the_next_step(request_):
    flag = StopFlag()
    getattr(flag, request_)()
    r = FakeStepRunner(flag)
    res = r.run(TickPlan(lanes=[lane(0, [1, 2], max_new=4)]))
    assert res.stopped_early and r.advances == 0 and res.lanes[0].n_fed == 0 and res.steps == []

    flag.clear()
    r = FakeStepRunner(flag)
    r.on_step = lambda n: getattr(flag, request_)() if n == 2 else None
    res = r.run(TickPlan(lanes=[lane(0, [1, 2], max_new=4)]))
    assert res.stopped_early and r.advances == 2 and res.lanes[0].tokens == [3, 4]


def test_an_aborted_step_or_a_full_pool_ends_the_tick():
    r = FakeStepRunner()
    r.abort_at = 2
    res = r.run(TickPlan(lanes=[lane(0, [1], max_new=5)]))
    assert res.stopped_early and res.rejected_tokens == 0 and res.lanes[0].tokens == [2]
    r = FakeStepRunner()
    r.full_at = 1
    res = r.run(TickPlan(lanes=[lane(0, [1, 2, 3], max_new=5), lane(1, [4], max_new=2)]))
    assert res.stopped_early and res.rejected_tokens == 4 and res.lanes[0].n_fed == 0


def test_end_after_first_token_ends_at_the_step_that_samples_a_first_token():
    r = FakeStepRunner()
    res = r.run(TickPlan(end_after_first_token=True, step_tokens=3,
                         lanes=[decode(0, 10, pos=5, max_new=9), lane(1, [1, 2, 3, 4, 5], max_new=9)]))
    # step 1: slot 0 decodes (not a first token), slot 1 prefills 3; step 2: slot 1 samples its first
    assert r.n_steps == 2 and res.stopped_early
    assert res.lanes[0].tokens == [11, 12] and res.lanes[1].tokens == [6]
    r = FakeStepRunner()
    res = r.run(TickPlan(end_after_first_token=True, lanes=[lane(1, [1, 2], max_new=1)]))
    assert not res.stopped_early  # nothing was left undone


def test_a_quiet_tick_ends_when_a_lane_ends():
    plan = lambda quiet: TickPlan(quiet=quiet, lanes=[decode(0, 10, pos=5, max_new=2),  # noqa: E731
                                                      decode(1, 20, pos=5, max_new=5)])
    r = FakeStepRunner()
    res = r.run(plan(True))
    assert r.n_steps == 2 and res.stopped_early and res.lanes[1].tokens == [21, 22]
    r = FakeStepRunner()
    res = r.run(plan(False))
    assert r.n_steps == 5 and not res.stopped_early and res.lanes[1].tokens == [21, 22, 23, 24, 25]
    r = FakeStepRunner()
    res = r.run(TickPlan(quiet=True, lanes=[decode(0, 10, pos=5, max_new=2), decode(1, 20, pos=5, max_new=2)]))
    assert not res.stopped_early  # both ended in the same step


class FakeRoundsRunner(FakeStepRunner):
    """An engine that finishes decode itself, many steps to one ``advance`` (as llama.cpp's rounds
    in C do, and basert will): it stops between steps on the flag and, in a quiet tick, after
    the step where a lane ends."""

    def advance(self, active, plan, result):
        if not all(w.decoding for w in active):
            return super().advance(active, plan, result)
        self.advances += 1
        while any(w.feed for w in active) and not self.stop_flag.stop_requested():
            live = [w for w in active if w.feed]
            for w in live:
                self.kv.setdefault(w.slot, []).append(w.feed.pop())
                w.pos += 1
                w.result.n_fed += 1
                w.sampled(w.pos + 100, False)
            result.steps.append(StepTiming(prefill_tokens=0, decode_tokens=len(live), seconds=0.0))
            if plan.quiet and any(not w.feed for w in live):
                break
        return True


def test_an_engine_may_run_many_steps_in_one_advance():
    r = FakeRoundsRunner()
    res = r.run(TickPlan(lanes=[lane(0, [1, 2], max_new=4), decode(1, 5, pos=3, max_new=3)]))
    assert r.advances == 2  # the prefill step, then every decode round in one call
    assert len(res.lanes[0].tokens) == 4 and len(res.lanes[1].tokens) == 3 and len(res.steps) == 4
    r = FakeRoundsRunner()
    res = r.run(TickPlan(quiet=True, lanes=[decode(0, 5, pos=3, max_new=1), decode(1, 5, pos=3, max_new=3)]))
    assert r.advances == 1 and res.stopped_early and len(res.lanes[1].tokens) == 1


def test_work_takes_one_and_records_sampled_tokens():
    w = Work(lane(0, [1, 2, 3], pos=4, max_new=2, replay_from=6), accept=True)
    assert not takes_one(w) and w.pos == 4 and w.result.slot == 0
    w.pos = 6
    assert takes_one(w)
    w.feed = []
    w.sampled(8, False)
    assert w.feed == [8] and w.decoding and not w.accept and not w.was_decoding
    w.feed = []
    w.sampled(9, False)
    assert w.feed == [] and w.result.tokens == [8, 9] and not w.result.eog  # the grant is used up
    w = Work(lane(1, [5], max_new=4), accept=False)
    w.feed = []
    w.sampled(EOG, True)
    assert w.feed == [] and w.result.eog
