"""The basert benchmarks whose numbers go into the docs (tools/bench/basert_kv_bits.py,
basert_speculation.py and basert_parking.py) run end to end on a tiny random-weight GGUF with tiny settings: their
tables print, their JSON is written, and the invariants they report hold (full width agrees with
itself, speculation gives the greedy tokens, 8 lanes past the gate draft nothing)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from tools.bench import basert_kv_bits, basert_parking, basert_speculation  # noqa: E402

from ..tinygguf import write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("benches") / "tiny.gguf", n_layer=2, n_embd=64))


def test_first_divergence_counts_the_common_prefix():
    assert basert_kv_bits.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert basert_kv_bits.first_divergence([5, 6], [5, 6]) == 2
    assert basert_kv_bits.first_divergence([1], [2]) == 0


def test_kv_bits_prints_its_three_tables(tiny, tmp_path, capsys):
    out = tmp_path / "kv.json"
    res = basert_kv_bits.main(["--model", tiny, "--tokens", "6", "--prompts", "3", "--passage-tokens", "80",
                               "--chunk", "16", "--threads", "1", "--json", str(out)])
    text = capsys.readouterr().out
    for heading in ("## (a) KV memory", "## (b) perplexity", "## (c) greedy agreement"):
        assert heading in text
    assert "| 8-bit |" in text and "| 4-bit |" in text and "| full bf16 |" in text
    mem = {r["kv"]: r for r in res["memory"]}
    # bf16 is half of fp32; the quantized widths are smaller still, 4 bits below 8
    assert mem["full bf16"]["bytes_per_token"] * 2 == mem["full fp32"]["bytes_per_token"]
    assert mem["4-bit"]["bytes_per_token"] < mem["8-bit"]["bytes_per_token"] < mem["full bf16"]["bytes_per_token"]
    assert [r["bits"] for r in res["perplexity"]] == [0, 8, 4]
    assert all(r["ppl"] > 1 for r in res["perplexity"])
    assert res["passage_tokens"] == 80
    for row in res["agreement"]:
        assert row["prompts"] == 3 and 0 <= row["min_agree"] <= row["mean_agree"] <= 6
    assert json.loads(out.read_text())["passage_tokens"] == 80


def test_full_width_agrees_with_itself(tiny):
    """The agreement measure is not noise: two full-width runs give the same greedy tokens."""
    model, vocab = basert_kv_bits.load(tiny)
    prompts = [vocab.tokenize(basert_kv_bits.chat(t), True, True) for t in basert_kv_bits.CHAT_PROMPTS[:3]]
    a, _ = basert_kv_bits.generate(basert_kv_bits.make_runner(model), prompts, 8, 3)
    b, _ = basert_kv_bits.generate(basert_kv_bits.make_runner(model), [prompts[1]], 8, 8)
    assert all(len(t) == 8 for t in a)
    assert a[1] == b[0]


def test_speculation_prints_its_table_and_keeps_the_greedy_tokens(tiny, tmp_path, capsys):
    out = tmp_path / "spec.json"
    res = basert_speculation.main(["--model", tiny, "--tokens", "10", "--rounds", "1", "--lanes", "8",
                                   "--threads", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert "## --speculate 4" in text and "| (a) 1 lane, repetitive |" in text and "| (c) 8 lanes |" in text
    assert "| (f) 1 lane, JSON held to a schema |" in text
    cases = res["cases"]
    assert all(r["identical"] for r in cases.values())
    assert all(r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 for r in cases.values())
    assert cases["(c) 8 lanes"]["lanes"] == 8
    assert json.loads(out.read_text())["k"] == 4


def test_eight_lanes_past_the_gate_draft_nothing_but_one_lane_drafts(tiny):
    """Case (c)'s premise: with more decoding lanes than the gate's max_lanes no lane drafts,
    while a lone lane on a repeating prompt does."""
    model, _ = basert_kv_bits.load(tiny)
    prompt = [11, 12, 13, 14, 15] * 6
    busy = basert_kv_bits.make_runner(model, speculate=4)
    basert_kv_bits.generate(busy, [prompt] * 8, 8, 8)
    assert busy.gate.drafted == 0
    alone = basert_kv_bits.make_runner(model, speculate=4)
    basert_kv_bits.generate(alone, [prompt], 16, 16)
    assert alone.gate.drafted > 0


@pytest.mark.parametrize("bits", [0, 4])
def test_parking_prints_its_table_and_both_cycles_keep_the_kv(tmp_path, capsys, bits):
    out = tmp_path / "park.json"
    res = basert_parking.main(["--tiny", "--tokens", "20,40", "--reps", "2", "--bits", str(bits),
                               "--threads", "1", "--json", str(out)])
    assert "## Parking a lane on basert" in capsys.readouterr().out
    assert [r["tokens"] for r in res["rows"]] == [20, 40]
    assert all(r["kv_unchanged"] and r["bytes"] > 0 for r in res["rows"])
    assert json.loads(out.read_text())["bits"] == bits
