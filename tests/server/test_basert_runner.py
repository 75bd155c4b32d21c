"""basert's tick runner on a real (tiny, random-weight) GGUF, driven as the scheduler drives it:
batched lanes against each lane alone, pages shared and parked, the stop flag, a full pool,
speculation, narrow KV, prompt scoring and embedding lanes."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from superfluid.core.logits import token_logprob  # noqa: E402
from superfluid.core.request import SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, Seed, TickPlan  # noqa: E402
from superfluid.plugins.basert import model as models  # noqa: E402
from superfluid.plugins.basert.decode_graph import DecodeGraphs  # noqa: E402
from superfluid.plugins.basert.dense_attention import DenseAttention  # noqa: E402
from superfluid.plugins.basert.kv_pool import PagedKV  # noqa: E402
from superfluid.plugins.basert.runner import BasertRunner  # noqa: E402

from ..tinygguf import write_tiny_llama  # noqa: E402

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [list(range(5, 45)), list(range(60, 83)), [7, 8, 9, 10] * 9, list(range(300, 371))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("basert") / "tiny.gguf", n_layer=2, n_embd=64)
    return models.load(str(path), name="tiny", device=CPU, dtype=torch.float32)


def runner(model, *, n_blocks=256, bits=0, speculate=0, step_tokens=512, flex_lanes=0):
    """``flex_lanes``: decode-only steps of up to that many lanes go through the fixed-size flex
    decoder (eager on the CPU: what a CUDA graph replays)."""
    s = model.shape
    pool = PagedKV(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, n_blocks=n_blocks,
                   block_size=16, dtype=torch.float32, device=CPU, bits=bits, scratch=bool(flex_lanes))
    decoder = (DecodeGraphs(model, pool, max_lanes=flex_lanes, max_context=1024, graphs=False)
               if flex_lanes else None)
    return BasertRunner(model, pool, set(), StopFlag(), device=CPU, speculate=speculate, step_tokens=step_tokens,
                        decoder=decoder)


def generate(r, lanes: dict[int, list[int]], n: int, grant: int = 4, sampling=GREEDY, logprobs=None):
    """Prefill + first token, then decode grants, as the scheduler plans them; ``logprobs`` (a
    dict) gathers each slot's logprob entries."""
    out = {s: [] for s in lanes}
    pos = {s: 0 for s in lanes}
    plans = [LanePlan(slot=s, pos=0, feed=list(t), sample=True, max_new=grant, reset=True, sampling=sampling,
                      ignore_eos=True) for s, t in lanes.items()]
    with torch.inference_mode():
        while plans:
            res = r.run(TickPlan(lanes=plans))
            nxt = []
            for lp in plans:
                lr = res.lanes[lp.slot]
                out[lp.slot] += lr.tokens
                if logprobs is not None:
                    logprobs.setdefault(lp.slot, []).extend(lr.logprobs)
                pos[lp.slot] += lr.n_fed
                if len(out[lp.slot]) < n:
                    nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=[out[lp.slot][-1]], sample=True,
                                        max_new=min(grant, n - len(out[lp.slot])), decode=True, ignore_eos=True))
            plans = nxt
    return out


def dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    attn = DenseAttention(model.shape, 1, len(prompt) + n, CPU, torch.float32)
    out, feed, pos = [], list(prompt), 0
    with torch.inference_mode():
        while len(out) < n:
            attn.begin([(0, pos, len(feed))])
            h = model(torch.tensor(feed), torch.arange(pos, pos + len(feed)), attn)
            pos += len(feed)
            out.append(int(model.logits(h[-1:]).argmax()))
            feed = [out[-1]]
    return out


def test_batched_lanes_equal_each_lane_alone_and_the_dense_reference(tiny):
    together = generate(runner(tiny), dict(enumerate(PROMPTS)), 12)
    for slot, prompt in enumerate(PROMPTS):
        assert together[slot] == generate(runner(tiny), {0: prompt}, 12)[0]
        assert together[slot] == dense_greedy(tiny, prompt, 12)


def test_the_flex_decoder_gives_the_gather_paths_tokens_and_logits(tiny):
    """Decode-only steps through the fixed-size flex decoder (3 lanes padded to a bucket of 4, one
    lane in the bucket of 1): the same greedy tokens as the gather path, the same logits to 1e-5,
    and it really ran (its buckets' buffers hold the last steps' positions)."""
    lanes = {0: PROMPTS[0], 1: PROMPTS[1], 2: PROMPTS[3]}
    flex, gather = runner(tiny, flex_lanes=4), runner(tiny)
    assert generate(flex, lanes, 12) == generate(gather, lanes, 12)
    four = flex.decoder.buckets[4].decode
    assert four.n_rows == 3 and four.positions[:3].tolist() == [len(lanes[s]) + 10 for s in range(3)]
    assert generate(flex, {0: PROMPTS[2]}, 9) == generate(gather, {0: PROMPTS[2]}, 9)
    assert int(flex.decoder.buckets[1].decode.positions[0]) == len(PROMPTS[2]) + 7
    # one more decode step on each, from the same pages: the hidden states' logits agree
    pos, token = len(PROMPTS[2]) + 8, 5
    logits = []
    for r in (flex, gather):
        with torch.inference_mode():
            assert r.pool.reserve([(0, pos, 1)])
            h = r._forward([_OneToken()], [(0, pos, 1)], [token], [pos])
            logits.append(tiny.logits(h))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)


class _OneToken:
    width = 1


def test_speculation_with_the_flex_decoder_gives_the_greedy_tokens(tiny):
    """Verify rows (several tokens) leave the decoder for the gather path and come back to it once
    the gate closes: the tokens stay the greedy ones."""
    prompt = [11, 12, 13, 14, 15] * 8
    want = generate(runner(tiny), {0: prompt, 1: PROMPTS[1]}, 24)
    assert generate(runner(tiny, flex_lanes=2, speculate=4), {0: prompt, 1: PROMPTS[1]}, 24) == want


def test_prefill_in_small_steps_gives_the_same_tokens(tiny):
    assert generate(runner(tiny, step_tokens=7), {0: PROMPTS[3]}, 8) == generate(runner(tiny), {0: PROMPTS[3]}, 8)


def test_copy_shares_pages_and_parked_kv_comes_back_from_memory_and_files(tiny, tmp_path):
    r = runner(tiny)
    prompt = PROMPTS[3]
    with torch.inference_mode():
        r.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=prompt, sample=True, max_new=1, reset=True,
                                       sampling=GREEDY, ignore_eos=True)]))
        used = r.kv_used()
        assert used == len(prompt)  # positions held, not whole pages
        # a lane seeded from slot 0's first 64 tokens shares its four full pages
        res = r.run(TickPlan(lanes=[LanePlan(slot=1, pos=64, feed=prompt[64:], sample=True, max_new=3, reset=True,
                                             sampling=GREEDY, seed=Seed(slot=0), ignore_eos=True)]))
        assert res.lanes[1].n_prefill == len(prompt) - 64
        # 64 shared positions counted once; each slot's own last page: 7 and 9 (7 + 2 decoded)
        assert r.kv_used() == 64 + 7 + 9
        reference = res.lanes[1].tokens
        # park slot 1 (its pages stay in the pool, no copy), save it, load it under another key,
        # restore it into slot 2: same continuation
        r.run(TickPlan(park=[(1, "k")], release=[1]))
        assert r.pool.parking.kept(r.parked["k"]) and r.kv_used() == used
        path = str(tmp_path / "park.bin")
        res = r.run(TickPlan(save=[("k", path)]))
        for _ in range(200):  # written off the tick thread: the tick in which it finished reports it
            if path in res.saved:
                break
            res = r.run(TickPlan(collect_saves=True))
        assert res.saved[path] > 0
        assert r.run(TickPlan(load=[(path, "k2")])).parked["k2"] > 0
        first = r.run(TickPlan(lanes=[LanePlan(slot=2, pos=len(prompt), feed=[reference[0]], sample=True,
                                               max_new=2, reset=True, sampling=GREEDY, seed=Seed(key="k2"),
                                               ignore_eos=True)]))
    assert not first.lanes[2].restore_failed
    assert first.lanes[2].tokens == reference[1:3]
    # dropping the kept entry lets its pages go; slot 1's own last page was only its
    held = r.pool.used_blocks()
    kept = r.parked["k"]
    with torch.inference_mode():
        r.run(TickPlan(drop_parked=["k"]))
    assert not r.pool.parking.kept(kept) and r.pool.used_blocks() == held - 1


def test_a_missing_or_corrupt_park_is_reported_not_raised(tiny, tmp_path):
    r = runner(tiny)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"not a park file")
    with torch.inference_mode():
        assert r.run(TickPlan(load=[(str(bad), "x")])).parked["x"] == 0
        res = r.run(TickPlan(lanes=[LanePlan(slot=0, pos=5, feed=[1], sample=True, max_new=1, reset=True,
                                             sampling=GREEDY, seed=Seed(key="absent"))]))
    assert res.lanes[0].restore_failed


def test_stop_flag_ends_the_tick_between_steps(tiny):
    r = runner(tiny, step_tokens=8)
    r.stop_flag.request_yield()  # end before the next step
    with torch.inference_mode():
        res = r.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=PROMPTS[3], sample=True, max_new=4, reset=True,
                                             sampling=GREEDY)]))
    assert res.stopped_early and res.lanes[0].n_fed == 0


def test_a_step_the_pool_cannot_hold_is_refused_whole(tiny):
    r = runner(tiny, n_blocks=3)
    with torch.inference_mode():
        res = r.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=PROMPTS[3], sample=True, max_new=1, reset=True,
                                             sampling=GREEDY)]))
    assert res.rejected_tokens > 0 and res.lanes[0].n_fed == 0 and r.kv_used() == 0


def test_speculation_gives_the_greedy_tokens_and_accepts_drafts(tiny):
    prompt = [11, 12, 13, 14, 15] * 6
    plain = generate(runner(tiny), {0: prompt}, 24, grant=24)
    r = runner(tiny, speculate=4)
    spec = generate(r, {0: prompt}, 24, grant=24)
    assert spec == plain
    assert r.gate.drafted > 0


# the tiny random model's logits lie close together: at 0.01 it still samples, and keeps drafts
SAMPLED = SamplingParams(temperature=0.01, top_p=0.95, seed=3)
PENALIZED = SamplingParams(temperature=0.01, seed=3, repeat_penalty=1.02, frequency_penalty=0.01, penalty_last_n=16)


@pytest.mark.parametrize("grant", [4, 24])
@pytest.mark.parametrize("sampled", [SAMPLED, PENALIZED], ids=["sampled", "penalized"])
def test_seeded_sampled_lanes_speculate_and_keep_their_text(tiny, grant, sampled):
    """Sampled lanes verify drafts by drawing each row with the uniform its token would get (and
    the penalty window it would see): two seeded lanes give the tokens they give without
    speculation, across ticks (grant 4) too."""
    lanes = {0: [11, 12, 13, 14, 15] * 6, 1: PROMPTS[2]}
    plain = generate(runner(tiny), lanes, 24, grant=grant, sampling=sampled)
    r = runner(tiny, speculate=4)
    assert generate(r, lanes, 24, grant=grant, sampling=sampled) == plain
    assert r.gate.drafted > 0 and r.gate.accepted > 0
    assert plain != generate(runner(tiny), lanes, 24, grant=grant, sampling=GREEDY)  # it did sample


def test_lanes_with_logprobs_and_bias_speculate_and_keep_their_tokens_and_logprobs(tiny):
    """Bias and logprobs are read from each verify position's own row: such lanes draft, and give
    the tokens and logprob entries they give without speculation."""
    lanes = {0: [11, 12, 13, 14, 15] * 6, 1: PROMPTS[2]}
    params = SamplingParams(temperature=0.0, logprobs=2, logit_bias=((600, 0.5),))
    want, got = {}, {}
    plain = generate(runner(tiny), lanes, 24, grant=24, sampling=params, logprobs=want)
    r = runner(tiny, speculate=4)
    assert generate(r, lanes, 24, grant=24, sampling=params, logprobs=got) == plain
    assert r.gate.accepted > 0
    for slot in lanes:
        assert [e.token for e in got[slot]] == plain[slot]
        assert [[t for t, _ in e.top] for e in got[slot]] == [[t for t, _ in e.top] for e in want[slot]]
        np.testing.assert_allclose([e.logprob for e in got[slot]], [e.logprob for e in want[slot]], atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_narrow_kv_runs_and_stays_close(tiny, bits):
    full = generate(runner(tiny), {0: PROMPTS[0]}, 8)[0]
    narrow = generate(runner(tiny, bits=bits), {0: PROMPTS[0]}, 8)[0]
    assert len(narrow) == 8
    if bits == 8:
        assert narrow[:4] == full[:4]


def test_prompt_scores_and_embedding_sums_match_the_dense_model(tiny):
    prompt = PROMPTS[1]
    attn = DenseAttention(tiny.shape, 1, len(prompt), CPU, torch.float32)
    with torch.inference_mode():
        attn.begin([(0, 0, len(prompt))])
        hidden = tiny(torch.tensor(prompt), torch.arange(len(prompt)), attn)
        rows = tiny.logits(hidden).numpy()
        r = runner(tiny, step_tokens=9)
        res = r.run(TickPlan(lanes=[
            LanePlan(slot=0, pos=0, feed=prompt, sample=False, reset=True, sampling=GREEDY,
                     targets=prompt[1:], score_top=2),
            LanePlan(slot=1, pos=0, feed=prompt, sample=False, reset=True, sampling=GREEDY, embed=True)]))
    scores = res.lanes[0].prompt_logprobs
    assert len(scores) == len(prompt) - 1
    for i, entry in enumerate(scores):
        want = token_logprob(rows[i], prompt[i + 1], 2)
        assert abs(entry.logprob - want.logprob) < 1e-4
    assert res.lanes[1].pooled == len(prompt)
    np.testing.assert_allclose(res.lanes[1].embedding_sum, hidden.sum(0).numpy(), rtol=1e-4, atol=1e-4)


def test_park_file_round_trips_through_bytes(tiny):
    r = runner(tiny)
    with torch.inference_mode():
        generate(r, {0: PROMPTS[0]}, 2)
    entry = r.pool.parking.export(0)
    buf = io.BytesIO()
    PagedKV.save(entry, buf)
    buf.seek(0)
    back = PagedKV.load(buf)
    assert back.length == entry.length and back.tokens == entry.tokens
