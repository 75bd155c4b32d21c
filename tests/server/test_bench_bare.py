"""The bench's bare-runtime target: llama.cpp driven with no server, the ceiling that a
server on the same build is measured against. Run for real on the default model, beside
the real server, so the ceiling is known to do the servers' work: same prompts, same
reply length, the same greedy tokens."""

from __future__ import annotations

import asyncio

import pytest

from tools.bench import bare, cli, report
from tools.bench.runner import Settings, Target, run

PROMPTS = [
    "<|im_start|>user\nExplain what a compiler does.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
]
MAX_TOKENS = 24


async def _bare_replies(model_path: str) -> list[list[int]]:
    loop = bare.BareTarget(model_path, lanes=len(PROMPTS), context=1024)
    await loop.start()
    try:
        return (await loop.run(PROMPTS, MAX_TOKENS, timeout=120))["tokens"]
    finally:
        await loop.close()


def test_bare_loop_decodes_what_the_server_decodes(model_path, client):
    """Two prompts decoded together by the bare loop give, token for token, the server's
    greedy replies: the ceiling runs the same work, not a cheaper one."""
    llama_cpp = pytest.importorskip("llama_cpp")
    replies = asyncio.run(_bare_replies(model_path))
    assert [len(r) for r in replies] == [MAX_TOKENS] * len(PROMPTS)
    vocab = llama_cpp.Llama(model_path, vocab_only=True, verbose=False)
    for prompt, tokens in zip(PROMPTS, replies):
        served = client.completions.create(model="smollm2", prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})
        assert served.usage.completion_tokens == MAX_TOKENS
        assert vocab.detokenize(tokens).decode() == served.choices[0].text, prompt


def test_bench_interleaves_the_bare_loop_with_a_server(model_path, server):
    """One run with a server and the bare loop: both do every round at every concurrency,
    the bare loop takes no TTFT rounds, and the report sets the server against it."""
    settings = Settings(concurrencies=[1, 2], rounds=1, warmup=0, max_tokens=8, ttft_max_tokens=4)
    targets = [Target("superfluid", server.base), Target("bare", bare.SCHEME + model_path)]
    res = asyncio.run(run(targets, settings, lambda _line: None))
    assert res.error is None
    got = {(r.target, r.concurrency): r.completion_tokens for r in res.throughput_rounds}
    assert got == {("superfluid", 1): [8], ("bare", 1): [8],
                   ("superfluid", 2): [8, 8], ("bare", 2): [8, 8]}
    assert {r.target for r in res.ttft_rounds} == {"superfluid"}
    assert res.throughput_cell("bare", 2) > 0
    text = report.markdown(res)
    assert "| superfluid / bare |" in text
    assert "| bare |" in text.split("Chat streams")[0] and "| bare |" not in text.split("Chat streams")[1]


def test_bare_loop_that_cannot_load_stops_the_run(tmp_path):
    missing = tmp_path / "missing.gguf"
    settings = Settings(concurrencies=[1], rounds=1, warmup=0, max_tokens=4, ttft=False)
    res = asyncio.run(run([Target("bare", bare.SCHEME + str(missing))], settings, lambda _line: None))
    assert res.error and "did not start" in res.error and not res.throughput_rounds


def test_bare_target_refuses_sampling(model_path, capsys):
    assert cli.main(["--target", f"bare=llamacpp:{model_path}", "--sampled"]) == 2
    assert "greedily" in capsys.readouterr().err
