"""plugins/basert/sampler.py: basert's row sampler, on the CPU, where both of its paths run (a
lone lane's host path and the batched "device" path), against llama.cpp's chain as a float64
numpy reference and core's logprobs."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from superfluid.core.logits import token_logprob  # noqa: E402
from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams  # noqa: E402
from superfluid.plugins.basert import sampler as S  # noqa: E402
from superfluid.plugins.basert import sampling_math as M  # noqa: E402
from superfluid.plugins.basert.sampler import LaneSampler, sample_rows  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def paths(monkeypatch):
    """Counts of rows drawn on the host and of batches on the device path."""
    seen = {"host": 0, "device": 0}
    host, device = M.draw_host, S._Device.__init__

    def counted_host(*a, **k):
        seen["host"] += 1
        return host(*a, **k)

    def counted_device(self, *a, **k):
        seen["device"] += 1
        return device(self, *a, **k)

    monkeypatch.setattr(S, "draw_host", counted_host)
    monkeypatch.setattr(S._Device, "__init__", counted_device)
    return seen


def rows(n: int, vocab: int, scale: float = 3.0, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy((np.random.default_rng(seed).standard_normal((n, vocab)) * scale).astype(np.float32))


def one(logits: torch.Tensor, lane: LaneSampler | None) -> int:
    return sample_rows(logits[None] if logits.dim() == 1 else logits, [lane])[0][0]


def ref_pick(row: np.ndarray, params: SamplingParams, u: float) -> tuple[int, float]:
    """llama.cpp's chain (top-k, top-p over the survivors, min-p, temperature, then the
    inverse-CDF draw over the sorted kept tokens) in float64; also how close the call was (the
    smallest relative distance of u or a filter's threshold from a boundary)."""
    vocab = row.shape[0]
    order = np.lexsort((np.arange(vocab), -row))
    v = row[order].astype(np.float64)
    p = np.exp(v - v[0])
    keep, margin = vocab, 1.0
    if 0 < params.top_k < vocab:
        keep = params.top_k
    if params.top_p < 1.0:
        cum = np.cumsum(p[:keep])
        need = np.float32(params.top_p) * cum[-1]
        margin = min(margin, float(np.min(np.abs(cum - need)) / cum[-1]))
        keep = min(keep, int(np.searchsorted(cum, need, side="left")) + 1)
    if params.min_p > 0.0:
        margin = min(margin, float(np.min(np.abs(p - np.float32(params.min_p)))))
        keep = min(keep, max(1, int((p >= np.float32(params.min_p)).sum())))
    q = np.exp((v[:keep] - v[0]) / params.temperature)
    cq = np.cumsum(q)
    point = np.float32(u) * cq[-1]
    margin = min(margin, float(np.min(np.abs(cq - point)) / cq[-1]))
    return int(order[min(int(np.searchsorted(cq, point, side="right")), keep - 1)]), margin


def ref_dist(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The exact probability of each token under llama.cpp's chain."""
    vocab = row.shape[0]
    order = np.lexsort((np.arange(vocab), -row))
    v = row[order].astype(np.float64)
    p = np.exp(v - v[0])
    keep = params.top_k if 0 < params.top_k < vocab else vocab
    if params.top_p < 1.0:
        cum = np.cumsum(p[:keep])
        keep = min(keep, int(np.searchsorted(cum, params.top_p * cum[-1], side="left")) + 1)
    if params.min_p > 0.0:
        keep = min(keep, max(1, int((p >= params.min_p).sum())))
    q = np.exp((v[:keep] - v[0]) / params.temperature)
    out = np.zeros(vocab)
    out[order[:keep]] = q / q.sum()
    return out


def chi2_by_groups(tokens: list[int], dist: np.ndarray, groups: int = 8) -> float:
    """Pearson's statistic with tokens pooled (best first) into groups of about equal expected
    mass, so that every expected count is large enough."""
    order = np.argsort(-dist, kind="stable")
    order = order[dist[order] > 0]
    edges = np.searchsorted(np.cumsum(dist[order]), np.linspace(0, 1, groups + 1)[1:-1], side="right")
    group_of = np.zeros(dist.shape[0], np.int64)
    for g, chunk in enumerate(np.split(order, edges)):
        group_of[chunk] = g
    expected = np.bincount(group_of[order], weights=dist[order], minlength=groups) * len(tokens)
    observed = np.bincount(group_of[np.asarray(tokens)], minlength=groups)
    assert dist[np.asarray(tokens)].min() > 0, "drew a token the chain never keeps"
    mask = expected > 0
    return float((((observed - expected) ** 2)[mask] / expected[mask]).sum())


# --- where rows go ---------------------------------------------------------------------------

def test_greedy_rows_are_the_argmax_of_each_row():
    logits = rows(6, 1000)
    lanes = [None, LaneSampler(SamplingParams(temperature=0)), None,
             LaneSampler(SamplingParams(temperature=0, logprobs=2)), None, None]
    got = [t for t, _ in sample_rows(logits, lanes)]
    assert got == logits.argmax(dim=-1).tolist()


def test_a_lone_sampled_row_is_drawn_on_the_host_and_two_on_the_device(paths):
    logits = rows(3, 500)
    sample_rows(logits, [None, LaneSampler(SamplingParams(seed=1)), None])
    assert paths == {"host": 1, "device": 0}
    sample_rows(logits, [LaneSampler(SamplingParams(seed=1)), None, LaneSampler(SamplingParams(seed=2))])
    assert paths == {"host": 1, "device": 1}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=11),  # nothing cuts: flat rows send the host past its prefix
    SamplingParams(temperature=0.7, top_k=40, seed=12),
    SamplingParams(temperature=0.9, top_p=0.9, min_p=0.05, seed=13),
    SamplingParams(temperature=1.2, top_p=0.95, repeat_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2, penalty_last_n=8, logit_bias=((5, 3.0), (7, -100)), seed=14),
], ids=["plain", "top_k", "top_p+min_p", "penalties+bias"])
def test_a_seeded_lane_draws_the_same_tokens_alone_and_batched(params, paths):
    vocab = 20_000
    alone, batched = LaneSampler(params, history=[1, 2, 3]), LaneSampler(params, history=[1, 2, 3])
    others = [LaneSampler(SamplingParams(temperature=0.8, seed=99)),
              LaneSampler(SamplingParams(temperature=0, logprobs=3))]
    got_alone, got_batched = [], []
    for step in range(50):
        logits = rows(3, vocab, scale=1.0 if step % 2 else 3.0, seed=step)
        a = one(logits[1], alone)
        b = sample_rows(logits, [others[0], batched, others[1]])[1][0]
        alone.accept([a])
        batched.accept([b])
        got_alone.append(a)
        got_batched.append(b)
    assert got_alone == got_batched
    assert len(set(got_alone)) > 10  # it did sample
    assert paths["host"] == 50 and paths["device"] == 50


def test_the_same_seed_repeats_and_another_seed_differs():
    logits = rows(1, 5000, scale=1.0)

    def run(seed):
        lane = LaneSampler(SamplingParams(temperature=1.0, seed=seed))
        return [one(logits, lane) for _ in range(30)]

    assert run(5) == run(5)
    assert run(5) != run(6)
    unseeded = LaneSampler(SamplingParams(temperature=1.0))
    assert len({one(logits, unseeded) for _ in range(30)}) > 5


def test_a_resumed_seeded_lane_continues_its_sequence():
    logits = rows(1, 3000, scale=1.0)
    params = SamplingParams(temperature=1.0, seed=42)
    first = LaneSampler(params)
    straight = [one(logits, first) for _ in range(10)]
    resumed = LaneSampler(params)
    resumed.advance(6)
    assert [one(logits, resumed) for _ in range(4)] == straight[6:]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.95, seed=9),
    SamplingParams(temperature=0.8, seed=9, repeat_penalty=1.3, frequency_penalty=0.5, penalty_last_n=8),
    SamplingParams(temperature=0.0, presence_penalty=1.5),
], ids=["sampled", "sampled-penalized", "greedy-penalized"])
def test_verify_rows_sample_as_the_lane_would_and_leave_it_in_place(params):
    """A verify step's rows (speculation): row i drawn with the uniform its token would get and
    penalized by a window that holds the draft's first i tokens; ``advance`` then takes the kept
    tokens' draws, and the lane goes on as if it had sampled those tokens one by one."""
    logits = rows(1, 300, scale=1.0)
    straight = LaneSampler(params, history=[1, 2, 3])
    want = []
    for _ in range(8):
        want.append(one(logits, straight))
        straight.accept([want[-1]])
    lane = LaneSampler(params, history=[1, 2, 3])
    draft = want[:4]
    verify = lane.verify_rows(draft)
    assert len(verify) == 5
    assert [token for token, _ in sample_rows(torch.cat([logits] * 5), verify)] == want[:5]
    if lane.rng is not None:
        assert lane.peek(5) == lane.peek(5)  # peeking takes nothing
    if lane.window is not None:
        assert lane.window.counts == LaneSampler(params, history=[1, 2, 3]).window.counts
    lane.accept(want[:3])  # three of them kept
    lane.advance(3)
    got = []
    for _ in range(5):
        got.append(one(logits, lane))
        lane.accept([got[-1]])
    assert got == want[3:]


def test_host_and_device_math_agree_and_follow_llama_cpp_chain():
    """The host's prefix shortcuts against the device's whole sorted rows, and both against a
    float64 reference, over random rows, filters and uniforms."""
    rng = np.random.default_rng(0)
    close = 0
    for trial in range(250):
        vocab = int(rng.choice([300, 3000]))
        row = torch.from_numpy((rng.standard_normal(vocab) * rng.choice([0.5, 2.0, 6.0])).astype(np.float32))[None]
        params = SamplingParams(temperature=float(rng.choice([0.3, 1.0, 2.0])),
                                top_k=int(rng.choice([0, 0, 5, 300, 1000])),
                                top_p=float(rng.choice([1.0, 1.0, 0.5, 0.9, 0.99])),
                                min_p=float(rng.choice([0.0, 0.0, 0.01, 0.2])))
        u = float(rng.random()) if trial % 10 else float(1 - rng.random() * 1e-3)  # some draws deep in the tail
        prm = {k: torch.from_numpy(v) for k, v in M.draw_params([params], [u]).items()}
        host = M.draw_host(row, prm)
        top, p_total, q_total, _ = M.totals(row, prm["inv_t"])
        vals, ids = M.sorted_rows(row)
        device, ok = M.choose(vals, ids, torch.tensor([vocab]), torch.zeros(1), vocab, top, p_total, q_total, prm)
        assert bool(ok[0])
        want, margin = ref_pick(row[0].numpy(), params, u)
        if margin < 2e-6:
            close += 1
            continue
        assert host == int(device[0]) == want, (trial, params, u)
    assert close < 25, close


# --- the filters -----------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(temperature=1.5, top_k=1, seed=3),
                                    SamplingParams(temperature=1.5, top_p=1e-6, seed=3)], ids=["top_k=1", "top_p tiny"])
def test_a_filter_down_to_one_token_is_greedy(params):
    logits = rows(4, 3000, scale=0.5)
    argmax = logits.argmax(dim=-1).tolist()
    for _ in range(10):
        assert [one(logits[i], LaneSampler(params)) for i in range(4)] == argmax
        assert [t for t, _ in sample_rows(logits, [LaneSampler(params) for _ in range(4)])] == argmax


def test_min_p_keeps_only_tokens_near_the_best():
    row = np.full(1000, -20.0, np.float32)
    row[[3, 8, 1, 9]] = np.log([1.0, 0.5, 0.2, 0.09])
    logits = torch.from_numpy(np.stack([row, row]))
    params = SamplingParams(temperature=1.0, min_p=0.1, seed=4)
    host = LaneSampler(params)
    device = [LaneSampler(params), LaneSampler(attrs.evolve(params, seed=5))]
    seen = [one(logits[0], host) for _ in range(300)]
    for _ in range(150):
        seen += [t for t, _ in sample_rows(logits, device)]
    assert set(seen) == {3, 8, 1}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.5, seed=21),
    SamplingParams(temperature=2.0, seed=22),
    SamplingParams(temperature=0.7, top_k=30, top_p=0.9, seed=23),
    SamplingParams(temperature=1.0, top_p=0.8, min_p=0.02, seed=24),
], ids=["T=0.5", "T=2", "top_k+top_p", "top_p+min_p"])
def test_draws_follow_the_exact_distribution(params):
    row = rows(1, 600, scale=1.5, seed=7)[0]
    dist = ref_dist(row.numpy(), params)
    host = LaneSampler(params)
    drawn = [one(row, host) for _ in range(2000)]
    pair = [LaneSampler(params), LaneSampler(attrs.evolve(params, seed=77))]
    batched = []
    logits = torch.stack([row, row])
    for _ in range(1000):
        batched += [t for t, _ in sample_rows(logits, pair)]
    # df = 7: the 1e-6 tail is at ~40; a wrong temperature or filter gives hundreds
    assert chi2_by_groups(drawn, dist) < 40
    assert chi2_by_groups(batched, dist) < 40
    untempered = ref_dist(row.numpy(), SamplingParams(temperature=1.0))
    if params.temperature != 1.0:
        assert chi2_by_groups(drawn, untempered) > 100  # the check can tell the difference


# --- penalties and bias ----------------------------------------------------------------------

def penalized_ref(row: np.ndarray, window: list[int], rep: float, freq: float, pres: float) -> np.ndarray:
    out = row.astype(np.float32).copy()
    for token in set(window):
        count = window.count(token)
        logit = out[token]
        logit = logit * rep if logit <= 0 else logit / rep
        out[token] = logit - count * freq - pres
    return out


@pytest.mark.parametrize("last_n", [4, -1])
def test_penalties_change_exactly_the_window_s_tokens_by_llama_cpp_formula(last_n):
    vocab = 64
    history = [3, 5, 5, 9, 3, 3, 12, 40, 40, 7]
    params = SamplingParams(repeat_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5, penalty_last_n=last_n)
    lane = LaneSampler(params, history=history)
    window = history[-last_n:] if last_n > 0 else history
    row = rows(1, vocab, seed=3)[0].numpy()
    row[40], row[7] = -2.0, 2.0  # one negative, one positive penalized logit
    want = penalized_ref(row, window, 1.5, 0.25, 0.5)

    host = torch.from_numpy(row.copy())[None]
    M.penalize(host, {k: torch.from_numpy(v) for k, v in M.penalty_tables([lane.window]).items()})
    assert np.allclose(host[0].numpy(), want, atol=1e-6)
    assert np.array_equal(host[0].numpy() != row, want != row)  # only the window's tokens moved

    both = torch.from_numpy(np.stack([row, row]))
    sent = S._upload(M.penalty_tables([None, lane.window]), both.device)
    M.penalize(both, sent)
    assert np.array_equal(both[0].numpy(), row)
    assert np.allclose(both[1].numpy(), want, atol=1e-6)


def test_penalty_window_moves_with_accepted_tokens_and_off_when_zero():
    lane = LaneSampler(SamplingParams(repeat_penalty=2.0, penalty_last_n=2), history=[1, 2])
    lane.accept([3])
    assert sorted(lane.window.counts) == [2, 3]
    lane.accept_fed([4, 4], start=10, generated_from=None)
    assert lane.window.counts == {4: 2}
    off = LaneSampler(SamplingParams(repeat_penalty=2.0, penalty_last_n=0), history=[1, 2])
    assert off.window is None and not off.sees_feed and off.fast is False
    assert LaneSampler(SamplingParams(temperature=0)).fast


def test_a_greedy_lane_with_a_repeat_penalty_leaves_the_repeated_token():
    row = torch.full((100,), -5.0)
    row[10], row[20] = 3.0, 2.5
    lane = LaneSampler(SamplingParams(temperature=0, repeat_penalty=1.5), history=[10])
    assert one(row, lane) == 20
    fresh = LaneSampler(SamplingParams(temperature=0, repeat_penalty=1.5))
    assert [t for t, _ in sample_rows(torch.stack([row, row]), [lane, fresh])] == [20, 10]


def test_logit_bias_minus_100_bans_and_other_values_shift():
    logits = rows(2, 2000, scale=1.0)
    logits[:, 77] = 50.0
    ban = SamplingParams(temperature=1.0, top_k=3, logit_bias=((77, -100),), seed=8)
    lone = LaneSampler(ban)
    pair = [LaneSampler(ban), LaneSampler(SamplingParams(temperature=1.0, top_k=3, logit_bias=((77, -100),), seed=9))]
    drawn = [one(logits[0], lone) for _ in range(200)]
    for _ in range(100):
        drawn += [t for t, _ in sample_rows(logits, pair)]
    assert 77 not in drawn
    greedy_ban = SamplingParams(temperature=0, logit_bias=((77, -100),))
    unbanned = logits[0].clone()
    unbanned[77] = float("-inf")
    assert one(logits[0], LaneSampler(greedy_ban)) == int(unbanned.argmax())
    shift = SamplingParams(temperature=0, logit_bias=((5, 100.0),))
    assert one(logits[0], LaneSampler(shift)) == 5
    assert [t for t, _ in sample_rows(logits, [LaneSampler(shift), LaneSampler(greedy_ban)])][0] == 5


# --- logprobs --------------------------------------------------------------------------------

def assert_matches_core(entry, raw: np.ndarray, token: int, k: int):
    want = token_logprob(raw, token, k)
    assert entry.token == token
    assert abs(entry.logprob - want.logprob) < 1e-5
    assert len(entry.top) == len(want.top) == k
    kth = want.top[-1][1] if k else 0.0
    for (got_id, got_lp), (want_id, want_lp) in zip(entry.top, want.top):
        assert abs(got_lp - want_lp) < 1e-5
        if want_lp > kth + 1e-6:  # ties at the k-th value: core's pick among them is arbitrary
            assert got_id == want_id


@pytest.mark.parametrize("k", [0, 5])
def test_logprobs_come_from_the_raw_row_as_core_reads_them(k):
    # bf16-rounded logits, as a CUDA model gives: many ties
    logits = rows(4, 5000, scale=4.0, seed=11).bfloat16().float()
    raw = logits.numpy().copy()
    params = [SamplingParams(temperature=0.8, logprobs=k, logit_bias=((1, 5.0),), repeat_penalty=1.3, seed=1),
              SamplingParams(temperature=0, logprobs=k),
              SamplingParams(temperature=1.0, top_p=0.9, logprobs=k, seed=2)]
    out = sample_rows(logits, [LaneSampler(params[0], history=[1, 2]), LaneSampler(params[1]), None,
                               LaneSampler(params[2])])
    assert out[2][1] is None
    for i in (0, 1, 3):
        assert_matches_core(out[i][1], raw[i], out[i][0], k)
    token, entry = sample_rows(logits[:1], [LaneSampler(params[0], history=[1, 2])])[0]
    assert_matches_core(entry, raw[0], token, k)
    assert torch.equal(logits, torch.from_numpy(raw))  # the caller's logits are left as they were


def test_lanes_asking_different_numbers_of_candidates_share_a_batch():
    logits = rows(3, 4000, seed=12).bfloat16().float()
    raw = logits.numpy().copy()
    ks = [0, 3, 7]
    out = sample_rows(logits, [LaneSampler(SamplingParams(temperature=0.9, logprobs=k, seed=k)) for k in ks])
    for i, k in enumerate(ks):
        assert_matches_core(out[i][1], raw[i], out[i][0], k)


def test_top_candidates_break_ties_by_lower_id():
    raw = torch.zeros(2, 50)
    raw[:, 30] = 2.0
    vals, ids = M.top_exact(raw, 4)
    assert ids.tolist() == [[30, 0, 1, 2], [30, 0, 1, 2]]


# --- constraints -----------------------------------------------------------------------------

TINY = [b"<eos>", b"a", b"b", b'"', b"ab", b"x", b"1", b"2", b"{", b"}"]


@pytest.fixture(scope="module")
def constrainer():
    llguidance = pytest.importorskip("llguidance")
    from superfluid.core.constrain import Constrainer

    class Tiny:
        eos_token_id = 0
        bos_token_id = None
        tokens = TINY
        special_token_ids = [0]

        def __call__(self, text):
            raw = text.encode() if isinstance(text, str) else text
            return [TINY.index(bytes([c])) for c in raw]

    return Constrainer(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tiny())), len(TINY), (0,))


ENUM = SamplingParams(json_schema=JsonConstraint(choices=(JsonChoice("", {"type": "string", "enum": ["ab", "b"]}),)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_constrained_row_only_yields_allowed_tokens(constrainer, temperature):
    texts = set()
    for seed in range(12):
        params = SamplingParams(temperature=temperature, seed=seed, json_schema=ENUM.json_schema,
                                logprobs=1 if seed % 2 else None)
        lane = LaneSampler(params, constraint=constrainer.for_lane(params))
        other = LaneSampler(SamplingParams(temperature=1.0, seed=seed))
        text = b""
        for step in range(8):
            logits = rows(2, len(TINY), scale=2.0, seed=seed * 10 + step)
            logits[:, 5] = 30.0  # "x": the model's favourite, never allowed
            allowed = lane.constraint.allowed()
            batch = [lane, other] if step % 2 else [lane]
            token, entry = sample_rows(logits[:len(batch)], batch)[0]
            assert allowed[token]
            assert (entry is None) == (params.logprobs is None)
            lane.accept([token])
            if token == 0:
                break
            text += TINY[token]
        assert token == 0
        texts.add(text)
    assert texts <= {b'"ab"', b'"b"'}


def test_sampling_moves_no_state_but_the_generator(constrainer):
    params = SamplingParams(temperature=1.0, seed=1, repeat_penalty=1.2, json_schema=ENUM.json_schema)
    lane = LaneSampler(params, history=[1, 2], constraint=constrainer.for_lane(params))
    before = (dict(lane.window.counts), lane.constraint.allowed().copy())
    sample_rows(rows(1, len(TINY)), [lane])
    assert lane.window.counts == before[0]
    assert np.array_equal(lane.constraint.allowed(), before[1])
    assert lane.sees_feed


def test_accept_fed_moves_the_constraint_only_past_generated_positions(constrainer):
    params = SamplingParams(repeat_penalty=1.2, json_schema=ENUM.json_schema)
    lane = LaneSampler(params, constraint=constrainer.for_lane(params))
    lane.accept_fed([8, 9, 3], start=0, generated_from=2)  # prompt "{}" then a generated '"'
    assert lane.window.counts == {8: 1, 9: 1, 3: 1}
    assert lane.constraint.allowed()[[1, 2, 4]].all() and not lane.constraint.allowed()[3]
