"""The llama.cpp runner's share of the OpenAI API, on the real SmolLM2 model, driven directly:
logprobs (against llama.cpp's own logits, computed separately by llama-cpp-python's ``Llama``),
prompt scoring, logit_bias, llguidance constraints and pooled embeddings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams
from superfluid.core.tick import LanePlan, TickPlan

from ..llama_reference import all_logits, hidden_states, in_child
from .test_llamacpp_runner import PROMPTS, Worker

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def worker(model_path):
    w = Worker(model_path, native_rounds=True)
    yield w
    w.close()


@pytest.fixture(scope="module")
def reference(model_path):
    """llama-cpp-python's own logits for every position of a prompt (computed in a child process)."""
    return lambda tokens: in_child(all_logits, model_path, list(tokens))


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = np.asarray(row, dtype=np.float64)
    top = row.max()
    return row - (top + np.log(np.exp(row - top).sum()))


def run(worker, slot: int, feed: list[int], sampling: SamplingParams, max_new: int, **kw):
    plan = TickPlan(lanes=[LanePlan(slot=slot, pos=0, feed=list(feed), sample=True, max_new=max_new, reset=True,
                                    sampling=sampling, ignore_eos=True, **kw)])
    return worker(plan).lanes[slot]


def test_greedy_logprobs_are_the_models_own(worker, reference):
    prompt = PROMPTS[0]
    res = run(worker, 0, prompt, SamplingParams(temperature=0.0, logprobs=5), max_new=1)
    assert len(res.tokens) == len(res.logprobs) == 1
    entry = res.logprobs[0]
    assert entry.token == res.tokens[0]
    assert entry.top[0][0] == entry.token  # greedy: the chosen token is the top candidate
    assert len(entry.top) == 5 and all(a[1] >= b[1] for a, b in zip(entry.top, entry.top[1:]))
    expected = log_softmax(reference(prompt)[-1])
    assert abs(entry.logprob - expected[entry.token]) < 1e-3
    for token, lp in entry.top:
        assert abs(lp - expected[token]) < 1e-3


def test_logprobs_across_decode_steps_match_a_fresh_pass(worker, reference):
    prompt = PROMPTS[1]
    res = run(worker, 1, prompt, SamplingParams(temperature=0.0, logprobs=0), max_new=4)
    assert len(res.logprobs) == 4
    rows = reference(prompt + res.tokens[:-1])
    for i, entry in enumerate(res.logprobs):
        expected = log_softmax(rows[len(prompt) - 1 + i])
        assert entry.top == ()
        assert abs(entry.logprob - expected[entry.token]) < 1e-3


def test_prompt_scoring_in_two_chunks(worker, reference):
    prompt = PROMPTS[0]
    rows = reference(prompt)
    half = 4
    plan = TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=prompt[:half], sample=False, reset=True, sampling=GREEDY,
                                    targets=prompt[1:half + 1], score_top=2)])
    first = worker(plan).lanes[0]
    plan = TickPlan(lanes=[LanePlan(slot=0, pos=half, feed=prompt[half:], sample=True, max_new=1, sampling=GREEDY,
                                    targets=prompt[half + 1:], score_top=2)])
    second = worker(plan).lanes[0]
    scored = first.prompt_logprobs + second.prompt_logprobs
    assert [e.token for e in scored] == prompt[1:]
    for pos, entry in enumerate(scored):
        expected = log_softmax(rows[pos])
        assert abs(entry.logprob - expected[prompt[pos + 1]]) < 1e-3
        assert len(entry.top) == 2 and entry.top[0][0] == int(np.argmax(expected))


def test_logit_bias_bans_and_forces(worker):
    prompt = PROMPTS[0]
    free = run(worker, 0, prompt, GREEDY, max_new=1).tokens[0]
    banned = run(worker, 0, prompt, SamplingParams(temperature=0.0, logit_bias=((free, -100.0),)), max_new=1).tokens[0]
    assert banned != free
    forced = run(worker, 0, prompt, SamplingParams(temperature=0.0, logit_bias=((1234, 100.0),)), max_new=3).tokens
    assert forced == [1234, 1234, 1234]


def test_json_schema_constraint_holds_greedy_output(worker, model_path):
    from superfluid.plugins.vocab.gguf import Vocab

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    sampling = SamplingParams(temperature=0.0, json_schema=JsonConstraint(choices=(JsonChoice("", schema),)))
    plan = TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(PROMPTS[1]), sample=True, max_new=40, reset=True,
                                    sampling=sampling, ignore_eos=False)])
    res = worker(plan).lanes[0]
    assert res.eog, "a complete value must end the generation"
    vocab = Vocab(model_path, "smollm2")
    try:
        text = b"".join(vocab.token_bytes(t) for t in res.tokens[:-1]).decode()
    finally:
        vocab.close()
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)


def test_embedding_is_the_mean_hidden_state_in_any_chunking(worker, model_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    prompt = PROMPTS[0]
    whole = worker(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(prompt), sample=True, max_new=1, reset=True,
                                            sampling=GREEDY, embed=True)])).lanes[0]
    assert whole.tokens == [] and whole.pooled == len(prompt) and whole.n_fed == len(prompt)
    a = worker(TickPlan(lanes=[LanePlan(slot=1, pos=0, feed=prompt[:3], sample=False, reset=True,
                                        sampling=GREEDY, embed=True)])).lanes[1]
    b = worker(TickPlan(lanes=[LanePlan(slot=1, pos=3, feed=prompt[3:], sample=True, max_new=1,
                                        sampling=GREEDY, embed=True)])).lanes[1]
    assert a.pooled + b.pooled == len(prompt)
    np.testing.assert_allclose(np.add(a.embedding_sum, b.embedding_sum), whole.embedding_sum, rtol=1e-4, atol=1e-4)
    states = in_child(hidden_states, model_path, list(prompt))  # llama-cpp-python's own, one per token
    np.testing.assert_allclose(np.asarray(whole.embedding_sum) / whole.pooled, states.mean(axis=0), rtol=1e-3, atol=1e-3)


def test_a_plain_lane_beside_an_embedding_lane_samples_as_alone(worker):
    alone = run(worker, 0, PROMPTS[1], GREEDY, max_new=3).tokens
    plan = TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(PROMPTS[1]), sample=True, max_new=3, reset=True,
                                    sampling=GREEDY, ignore_eos=True),
                           LanePlan(slot=1, pos=0, feed=list(PROMPTS[0]), sample=True, max_new=1, reset=True,
                                    sampling=GREEDY, embed=True)])
    got = worker(plan).lanes
    assert got[0].tokens == alone and got[1].pooled == len(PROMPTS[0])
