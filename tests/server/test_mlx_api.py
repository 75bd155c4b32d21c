"""The MLX engine's seams for the rest of the OpenAI API, on the tiny random GGUF: logprobs of
sampled tokens, prompt scoring, ``logit_bias``, JSON-schema constraints and embeddings, each
checked against values computed here from a direct forward pass of the same model (no KV cache,
no runner), so a runner that reads the wrong row, position or layer fails."""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("llguidance", reason="llguidance is not installed")

from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, Seed, TickPlan  # noqa: E402
from superfluid.plugins.vocab.constraints import VocabConstrainer  # noqa: E402
from superfluid.plugins.mlx.runner import MlxRunner  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
PROMPT = "<|im_start|>user\nTell me about the people of the water<|im_end|>\n<|im_start|>assistant\n"


from .test_mlx import tiny, tiny_path  # noqa: E402,F401  the same tiny model and its loaded weights

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)


@pytest.fixture(scope="module")
def constrainer(tiny, tiny_path):
    model, vocab = tiny
    c = VocabConstrainer(tiny_path, model.args.vocab_size, vocab.eog)
    yield c
    c.close()


def _runner(tiny, constrainer=None):
    model, vocab = tiny
    return MlxRunner(model, vocab.eog, StopFlag(), 4096, constrainer=constrainer)


def _prompt(vocab, text=PROMPT):
    return vocab.tokenize(text, True, True)


def _log_softmax(model, tokens: list[int]) -> np.ndarray:
    """Every position's log-probabilities from one direct forward pass (float64)."""
    logits = np.array(model(mx.array([tokens])).astype(mx.float32))[0].astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    return logits - (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))


def _hidden(model, tokens: list[int]) -> np.ndarray:
    """The final hidden states (after the final norm) from a direct pass of the inner model."""
    return np.array(model.model(mx.array([tokens])).astype(mx.float32))[0].astype(np.float64)


def _sample(runner, tokens, sampling, n, slot=0, **extra):
    """One tick: prefill ``tokens`` and sample up to ``n`` tokens; the lane's result."""
    plan = LanePlan(slot=slot, pos=0, feed=list(tokens), sample=True, max_new=n, reset=True,
                    sampling=sampling, **extra)
    return runner.run(TickPlan(lanes=[plan])).lanes[slot]


# ---- logprobs of sampled tokens ---------------------------------------------------------------

def test_greedy_logprobs_are_the_models_own(tiny):
    model, vocab = tiny
    prompt = _prompt(vocab)
    plain = _sample(_runner(tiny), prompt, GREEDY, 6)
    got = _sample(_runner(tiny), prompt, SamplingParams(temperature=0.0, logprobs=3), 6)
    assert got.tokens == plain.tokens and len(got.logprobs) == 6 and not plain.logprobs
    for i, (tok, entry) in enumerate(zip(got.tokens, got.logprobs)):
        ref = _log_softmax(model, prompt + got.tokens[:i])[-1]
        assert entry.token == tok and entry.top[0][0] == tok and len(entry.top) == 3
        assert abs(entry.logprob - ref[tok]) < 1e-4
        best = np.argsort(-ref)[:3]
        assert [t for t, _ in entry.top] == best.tolist()
        assert np.allclose([lp for _, lp in entry.top], ref[best], atol=1e-4)


def test_logprobs_lane_beside_plain_lanes_changes_nothing(tiny):
    """A batched decode step holding a logprobs lane samples every lane as alone."""
    model, vocab = tiny
    prompts = [_prompt(vocab, "the water is"), _prompt(vocab, "Hello world, how are you")]
    alone = [_sample(_runner(tiny), p, GREEDY, 8).tokens for p in prompts]
    runner = _runner(tiny)
    plans = [LanePlan(slot=0, pos=0, feed=prompts[0], sample=True, max_new=8, reset=True, sampling=GREEDY),
             LanePlan(slot=1, pos=0, feed=prompts[1], sample=True, max_new=8, reset=True,
                      sampling=SamplingParams(temperature=0.0, logprobs=0))]
    res = runner.run(TickPlan(lanes=plans))
    assert [res.lanes[0].tokens, res.lanes[1].tokens] == alone
    assert any(step.decode_tokens == 2 for step in res.steps)
    assert [e.token for e in res.lanes[1].logprobs] == alone[1] and all(not e.top for e in res.lanes[1].logprobs)


# ---- prompt scoring ---------------------------------------------------------------------------

def test_prompt_scoring_matches_a_direct_pass(tiny):
    """Scored over three ticks (a chunked prefill, a one-token feed, the rest with the first
    token sampled), every prompt position after the first gets its logprob and top candidates."""
    model, vocab = tiny
    prompt = _prompt(vocab)
    n = len(prompt)
    runner = _runner(tiny)
    ticks = [(0, 7, False), (7, 8, False), (8, n, True)]
    scored = []
    for start, end, sample in ticks:
        lp = LanePlan(slot=0, pos=start, feed=prompt[start:end], sample=sample, max_new=1, reset=start == 0,
                      sampling=GREEDY if start == 0 else None, targets=prompt[start + 1:end + 1], score_top=2)
        res = runner.run(TickPlan(lanes=[lp], step_tokens=3)).lanes[0]
        assert res.n_fed == end - start
        scored += res.prompt_logprobs
    ref = _log_softmax(model, prompt)
    assert len(scored) == n - 1
    for pos, entry in enumerate(scored, start=1):
        assert entry.token == prompt[pos]
        assert abs(entry.logprob - ref[pos - 1, prompt[pos]]) < 1e-4
        best = np.argsort(-ref[pos - 1])[:2]
        assert [t for t, _ in entry.top] == best.tolist()
    assert res.tokens == [int(np.argmax(ref[-1]))]


# ---- logit_bias -------------------------------------------------------------------------------

def test_logit_bias_bans_and_forces(tiny):
    model, vocab = tiny
    prompt = _prompt(vocab)
    ref = _log_softmax(model, prompt)[-1]
    first, second = np.argsort(-ref)[:2].tolist()
    assert _sample(_runner(tiny), prompt, GREEDY, 1).tokens == [first]
    banned = _sample(_runner(tiny), prompt, SamplingParams(temperature=0.0, logit_bias=((first, -100.0),)), 1)
    assert banned.tokens == [second]
    unlikely = int(np.argmin(ref))
    forced = _sample(_runner(tiny), prompt,
                     SamplingParams(temperature=0.0, logit_bias=((unlikely, 100.0),), logprobs=0), 1)
    assert forced.tokens == [unlikely]
    # its logprob is the model's own, read before the bias
    assert abs(forced.logprobs[0].logprob - ref[unlikely]) < 1e-4
    # sampled hot, banned tokens never come, though unbanned they are the likeliest
    ban = ((first, -100.0), (second, -100.0))
    drawn = {_sample(_runner(tiny), prompt, SamplingParams(temperature=2.0, seed=seed, logit_bias=ban), 1).tokens[0]
             for seed in range(20)}
    assert len(drawn) > 1 and not drawn & {first, second}


# ---- JSON-schema constraints ------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]},
                                           "tag": {"enum": ["water", "people"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
JSON_GREEDY = SamplingParams(temperature=0.0, json_schema=JsonConstraint(choices=(JsonChoice("", SCHEMA),)))


def _text(vocab, tokens, errors="strict") -> str:
    return b"".join(vocab.token_bytes(t) for t in tokens if t not in vocab.eog).decode("utf-8", errors)


def test_json_schema_makes_greedy_output_json(tiny, constrainer):
    model, vocab = tiny
    prompt = _prompt(vocab)
    free = _sample(_runner(tiny), prompt, GREEDY, 40)
    with pytest.raises(json.JSONDecodeError):  # the random model alone does not write JSON
        json.loads(_text(vocab, free.tokens, errors="replace"))
    lane = _sample(_runner(tiny, constrainer), prompt, JSON_GREEDY, 60)
    assert lane.eog and lane.tokens[-1] in vocab.eog  # complete: only the end may follow
    value = json.loads(_text(vocab, lane.tokens))
    assert set(value) == {"ok", "n", "tag"}
    assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and value["tag"] in ("water", "people")
    # each step is the greedy choice among the tokens the grammar allows: the constrained token is
    # the model's best allowed one, so with logprobs on the tokens do not change
    again = _sample(_runner(tiny, constrainer), prompt,
                    attrs.evolve(JSON_GREEDY, logprobs=1), 60)
    assert again.tokens == lane.tokens
    for i, entry in enumerate(again.logprobs):
        ref = _log_softmax(model, prompt + again.tokens[:i])[-1]
        assert abs(entry.logprob - ref[again.tokens[i]]) < 1e-4  # raw, before the mask


def test_constraint_resumes_where_the_lane_left_it(tiny, constrainer):
    """A constrained lane resumed mid-reply (replayed after a restart; seeded from KV with its
    history) continues exactly as it would have."""
    model, vocab = tiny
    prompt = _prompt(vocab)
    full = _sample(_runner(tiny, constrainer), prompt, JSON_GREEDY, 60).tokens
    k = 6
    replayed = _sample(_runner(tiny, constrainer), prompt + full[:k], JSON_GREEDY, 60, replay_from=len(prompt))
    assert full[:k] + replayed.tokens == full

    runner = _runner(tiny, constrainer)
    head = _sample(runner, prompt, JSON_GREEDY, k)
    assert head.tokens == full[:k]
    kept = prompt + full[:k - 1]  # the last sampled token was never fed
    lp = LanePlan(slot=1, pos=len(kept), feed=[full[k - 1]], sample=True, max_new=60, reset=True,
                  sampling=JSON_GREEDY, seed=Seed(slot=0), history=kept, replay_from=len(prompt))
    rest = runner.run(TickPlan(lanes=[lp])).lanes[1]
    assert full[:k] + rest.tokens == full


# ---- embeddings -------------------------------------------------------------------------------

def _embed(runner, tokens, pos=0, reset=True, step_tokens=0):
    lp = LanePlan(slot=0, pos=pos, feed=list(tokens), sample=False, reset=reset,
                  sampling=GREEDY if reset else None, embed=True)
    return runner.run(TickPlan(lanes=[lp], step_tokens=step_tokens)).lanes[0]


def test_embeddings_are_the_mean_hidden_state(tiny):
    model, vocab = tiny
    prompt = _prompt(vocab)
    ref = _hidden(model, prompt).mean(axis=0)
    whole = _embed(_runner(tiny), prompt)
    assert not whole.tokens and whole.pooled == len(prompt) and whole.n_fed == len(prompt)
    mean = np.asarray(whole.embedding_sum) / whole.pooled
    assert len(mean) == model.args.hidden_size == vocab.info.n_embd
    assert np.allclose(mean, ref, atol=1e-4, rtol=1e-4)

    # two ticks, the second in chunks of 3 and a last single token (the batched path): the same sum
    split = 5 + (len(prompt) - 5 - 1) % 3
    runner = _runner(tiny)
    a = _embed(runner, prompt[:split])
    b = _embed(runner, prompt[split:], pos=split, reset=False, step_tokens=3)
    assert len(b.embedding_sum) == len(ref) and (len(prompt) - split) % 3 == 1
    total = (np.asarray(a.embedding_sum) + np.asarray(b.embedding_sum)) / (a.pooled + b.pooled)
    assert a.pooled + b.pooled == len(prompt)
    assert np.allclose(total, ref, atol=1e-4, rtol=1e-4)


# ---- through the HTTP API, with the openai client -----------------------------------------------

@pytest.fixture(scope="module")
def tiny_server(start_server, tiny_path):
    return start_server("--model", tiny_path, "--model-name", "tiny", "--engine", "mlx", "--max-batch", "2")


def _client(srv):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_server_completion_logprobs_and_echo(tiny_server, tiny):
    """A completion's logprobs (and, with echo, the prompt's) are the model's own."""
    model, vocab = tiny
    prompt = _prompt(vocab)
    r = _client(tiny_server).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                                logprobs=2, echo=True, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 4
    generated = [int(np.argmax(_log_softmax(model, prompt)[-1]))]
    for _ in range(3):
        generated.append(int(np.argmax(_log_softmax(model, prompt + generated)[-1])))
    ref = _log_softmax(model, prompt + generated[:-1])
    seq = prompt + generated
    # echo: position 0 has no logprob (None), then every prompt and generated token in order
    assert len(lp.token_logprobs) == len(seq) and lp.token_logprobs[0] is None
    for pos in range(1, len(seq)):
        assert abs(lp.token_logprobs[pos] - ref[pos - 1, seq[pos]]) < 1e-4, pos
        assert max(lp.top_logprobs[pos].values()) == pytest.approx(ref[pos - 1].max(), abs=1e-4)


def test_server_response_format_json_schema(tiny_server):
    r = _client(tiny_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me about the water"}], max_tokens=80,
        temperature=0, response_format={"type": "json_schema",
                                        "json_schema": {"name": "facts", "strict": True, "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok", "n", "tag"} and value["n"] in (1, 2, 3) and value["tag"] in ("water", "people")


def test_server_embeddings_are_the_normalised_mean(tiny_server, tiny):
    model, vocab = tiny
    text = "the people of the water"
    r = _client(tiny_server).embeddings.create(model="tiny", input=[text])
    mean = _hidden(model, vocab.tokenize(text, True, True)).mean(axis=0)
    assert np.allclose(r.data[0].embedding, mean / np.linalg.norm(mean), atol=1e-4)


def test_server_logit_bias_and_n_choices(tiny_server, tiny):
    """logit_bias through the client bans the greedy token; n=3 gives three choices of one prompt."""
    model, vocab = tiny
    client = _client(tiny_server)
    first = int(np.argmax(_log_softmax(model, _prompt(vocab))[-1]))
    free = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    biased = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0,
                                       logit_bias={str(first): -100})
    assert free.choices[0].logprobs.tokens[0] == vocab.token_bytes(first).decode("utf-8", "ignore")
    assert biased.choices[0].logprobs.tokens[0] != free.choices[0].logprobs.tokens[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0.9, seed=3, n=3,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 9 and r.usage.prompt_tokens == len(_prompt(vocab))


def test_server_tokenize_round_trip(tiny_server, tiny):
    _, vocab = tiny
    status, got = tiny_server.call("POST", "/tokenize", {"content": "the water", "with_pieces": True})
    assert status == 200, got
    ids = [t["id"] for t in got["tokens"]]
    assert ids == vocab.tokenize("the water", False, True)
    status, back = tiny_server.call("POST", "/detokenize", {"tokens": ids})
    # the tiny vocabulary prefixes words with a space ("▁the"), which its pieces keep, as llama-server's do
    assert status == 200 and back["content"] == "".join(vocab.token_bytes(t).decode() for t in ids)
    assert back["content"].lstrip() == "the water"


# ---- the constrainer of an mlx-lm directory ----------------------------------------------------

def test_directory_constrainer_masks_as_the_gguf_one(tmp_path, model_path):
    """SmolLM2 as an mlx-lm directory (Hugging Face tokenizer) and as a GGUF (llama.cpp's vocab):
    their constrainers allow the same tokens at every step of a JSON reply, and refuse the
    control tokens the grammar cannot spell."""
    from superfluid.plugins.mlx.convert import convert

    out = convert(model_path, str(tmp_path / "smol-mlx"))
    gguf = VocabConstrainer(model_path, None, {2})
    hf = VocabConstrainer(out, None, {2})
    try:
        assert gguf.n_vocab == hf.n_vocab == 49152
        assert gguf.vocab.info.n_embd == hf.vocab.info.n_embd == 576  # ModelInfo.n_embd, both ways
        assert gguf.vocab.model_type == hf.vocab.model_type == "llama"
        note = {"type": "object", "properties": {"note": {"type": "string"}}, "required": ["note"],
                "additionalProperties": False}
        params = SamplingParams(temperature=0.0, json_schema=JsonConstraint(choices=(JsonChoice("", note),)))
        reply = gguf.vocab.tokenize(json.dumps({"note": "the <b>water</b> is 12"}), False, False)
        lanes = [c.for_lane(params) for c in (gguf, hf)]
        im_start = gguf.vocab.tokenize("<|im_start|>", False, True)
        assert len(im_start) == 1 and im_start[0] != 2
        for token in reply + [2]:
            a, b = (lane.allowed() for lane in lanes)
            assert a[token] and np.array_equal(a, b)
            assert not a[im_start[0]]
            assert all(lane.accept(token) for lane in lanes)
        assert all(lane.done for lane in lanes)
    finally:
        gguf.close()
        hf.close()
