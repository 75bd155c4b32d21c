"""tools/gpu/check.py on the CPU with the tiny shape: the same code the GPU machine runs, so the
prepared check cannot rot between the times a GPU is lent."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tools.gpu import check  # noqa: E402


def test_the_gpu_check_runs_on_the_cpu_and_prints_every_row(capsys):
    assert check.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--lanes", "1,2", "--prompt", "32",
                       "--reply", "8"]) == 0
    out = capsys.readouterr().out
    table = out[out.rindex("| shape |"):]  # the whole table, printed last (rows also stream as they come)
    rows = [line for line in table.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 * 4 + 1  # four variants per lane count (on the CPU), then the plain loop
    assert "| basert --attention flex |" in table
    check_line = next(line for line in out.splitlines() if "against the gather path" in line)
    diff = float(check_line.split("max |logit difference| ")[1].split(",")[0])
    assert diff < 1e-4 and "argmax agrees 2/2" in check_line  # fp32: the decoder computes the same logits
    for row in rows:
        aggregate = float(row.split("|")[4])
        assert aggregate > 0
    assert "plain PyTorch loop" in rows[-1]
    assert "copy bandwidth" in out


def test_a_decode_mode_that_fails_costs_its_rows_not_the_check(capsys, monkeypatch):
    def broken(self):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(check.DecodeGraphs, "warm_up", broken)
    assert check.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--lanes", "1", "--prompt", "16",
                       "--reply", "4"]) == 0
    out = capsys.readouterr().out
    assert "decode flex FAILED: RuntimeError: no kernel for you" in out
    table = out[out.rindex("| shape |"):]
    assert "| basert |" in table and "--attention flex" not in table


def test_the_roofline_counts_weights_and_context():
    import torch

    shape = check.ModelShape.from_hf_config(check.LLAMA_3_1_8B)
    per_token = check.bytes_per_decode_token(shape, torch.bfloat16, 0, 0)
    assert 14.5e9 < per_token < 16.5e9  # ~7.5B parameters read per token in bf16 (the input embedding is not)
    longer = check.bytes_per_decode_token(shape, torch.bfloat16, 1000, 0)
    assert longer - per_token == pytest.approx(1000 * 32 * 2 * 8 * 128 * 2, rel=1e-6)
