"""A context beyond the training window on llama.cpp: a tiny random-weight llama
(tests/tinygguf.py, trained window 512 in its metadata, weights spread enough that positions
matter) served at 1024 with YaRN (``--rope-scaling yarn --rope-scale 2 --yarn-orig-ctx 512``). A
~900-token prompt (two 512-token prefill chunks) gets a reply, and its own logprobs past position
512 (completions with ``echo`` and ``logprobs``, the same request) equal llama-cpp-python's
``Llama`` with the same rope parameters. Without scaling, 1024 is refused naming both ways out;
with ``--allow-long-context`` it starts, warns, and its logprobs there are not the YaRN ones (so
the equality is the options' doing).

The path is the one SmolLM2 at 16384 over its 8192 window takes (the same flags, the same
reference), at 1/16 of the length and a model that prefills it in milliseconds: the test's cost
is the server's start, not a 12k-token prefill twice.

One server per configuration, module-scoped; one shared pool of 1024 cells (``--kv-unified``)
keeps each at one lane's KV."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from ..kv_rope_reference import token_logprobs, tokenize
from ..llama_reference import in_child
from ..tinygguf import write_tiny_llama

WINDOW = 512             # the tiny model's training context (its GGUF's context_length)
LONG = 2 * WINDOW
YARN = ("--rope-scaling", "yarn", "--rope-scale", "2", "--yarn-orig-ctx", str(WINDOW))
YARN_LLAMA = {"rope_scaling_type": 2, "rope_freq_scale": 0.5, "yarn_orig_ctx": WINDOW}  # the same, as Llama takes them
START, COUNT = 576, 16   # the scored positions: past the 512 training window, in the second prefill chunk
TOLERANCE = 0.005        # nats, on a token's logprob (the reference feeds the same 512-token chunks: equal in practice)
WORDS = ("the river town market morning light people walked slowly along old stone streets while "
         "children played near water and merchants sold bread fruit cloth tools books every day until "
         "evening came with rain wind and quiet songs from open windows across small gardens").split()


def _text(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    sentences = []
    while sum(len(s.split()) for s in sentences) < n_words:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return " ".join(sentences)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The tiny llama with a 512-token training window; std 0.2 makes attention sharp enough that
    YaRN's frequencies move its logprobs by nats (at tinygguf's default 0.02 by ~0.001, under
    TOLERANCE: the test could not tell scaling on from off)."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("rope") / "tiny-512.gguf", context_length=WINDOW, std=0.2))


def _serve(start_server, tiny, *flags):
    return start_server("--max-context", str(LONG), "--max-batch", "1", "--kv-unified",
                        "--kv-pool-cells", str(LONG), *flags, model=tiny)


@pytest.fixture(scope="module")
def tokens(tiny) -> list[int]:
    """A ~900-token prompt (plain prose), as the model's tokens: past the window, two prefill chunks."""
    ids = in_child(tokenize, tiny, _text(200, seed=1))
    assert LONG - 8 >= len(ids) > START + COUNT  # room for the 8-token reply; past the scored positions
    return ids


@pytest.fixture(scope="module")
def reference(tiny, tokens) -> list[float]:
    return in_child(token_logprobs, tiny, tokens, START, COUNT, LONG, **YARN_LLAMA)


def _score(srv, tokens, max_tokens: int = 0) -> dict:
    """The prompt's own logprobs (completions with echo), and a reply of ``max_tokens``."""
    status, body = srv.call("POST", "/v1/completions", {"model": "smollm2", "prompt": tokens, "echo": True,
                                                        "logprobs": 1, "max_tokens": max_tokens,
                                                        "temperature": 0}, timeout=120)
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def yarn_server(start_server, tiny):
    return _serve(start_server, tiny, *YARN)


@pytest.fixture(scope="module")
def long_reply(yarn_server, tokens) -> dict:
    """The whole prompt scored and continued by 8 tokens: one prefill for two tests."""
    return _score(yarn_server, tokens, max_tokens=8)


def test_logprobs_past_the_training_window_equal_llama_with_the_same_yarn(long_reply, tokens, reference):
    scores = long_reply["choices"][0]["logprobs"]["token_logprobs"]
    assert scores[0] is None and len(scores) >= len(tokens)
    served = scores[START:START + COUNT]
    worst = max(abs(a - b) for a, b in zip(served, reference))
    assert worst <= TOLERANCE, list(zip(served, reference))


def test_a_prompt_past_the_window_gets_a_reply(long_reply, tokens):
    assert long_reply["usage"]["prompt_tokens"] == len(tokens) > WINDOW, long_reply["usage"]
    assert long_reply["usage"]["completion_tokens"] > 0
    assert len(long_reply["choices"][0]["text"]) > 0


def test_past_the_window_without_scaling_is_refused_naming_both_ways_out(tiny):
    out = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--model", tiny,
                          "--port", "0", "--max-context", str(LONG)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    err = out.stderr
    assert f"max-context {LONG} exceeds the model's training context {WINDOW}" in err, err[-2000:]
    assert "--rope-scaling" in err and "--allow-long-context" in err, err[-2000:]


def test_allow_long_context_starts_warns_and_is_not_yarn(start_server, tiny, yarn_server, tokens):
    """Served unscaled, with a warning; YaRN's frequencies differ at every position, so even a
    short prompt's logprobs tell the two apart (the equality above is the rope options' doing)."""
    srv = _serve(start_server, tiny, "--allow-long-context")
    assert "without rope scaling (--allow-long-context)" in srv.log()
    short = tokens[:256]
    plain = _score(srv, short)["choices"][0]["logprobs"]["token_logprobs"][1:]
    yarn = _score(yarn_server, short)["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert max(abs(a - b) for a, b in zip(plain, yarn)) > 10 * TOLERANCE, "yarn changed nothing"
