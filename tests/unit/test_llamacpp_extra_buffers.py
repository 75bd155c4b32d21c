"""The llama.cpp engine's extra-buffer decision, fed llama.cpp's CPU reports as they read on the
machines in question (AMX on Intel Sapphire Rapids and later; AVX2 on AMD EPYC), and the
worker-exit reading the warm-up fallback relies on."""

from __future__ import annotations

import signal

import pytest

from superfluid.core.worker_process import WorkerExited, exit_text, signal_of
from superfluid.plugins.llamacpp import extra_buffers
from superfluid.plugins.llamacpp.extra_buffers import choose, names_amx, parse_report

# llama_print_system_info() on an Intel Xeon with AMX, and on this project's AMD EPYC machines
AMX_REPORT = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
              "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "
              "OPENMP = 1 | REPACK = 1 | ")
EPYC_REPORT = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
               "OPENMP = 1 | REPACK = 1 | ")


def test_the_report_reads_as_backends_and_features():
    features = parse_report(EPYC_REPORT + "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | ")
    assert list(features) == ["CPU", "CUDA"]
    assert features["CPU"]["AVX2"] == "1" and "AMX_INT8" not in features["CPU"]
    assert features["CUDA"] == {"ARCHS": "900", "USE_GRAPHS": "1"}
    assert parse_report("") == {}


def test_amx_is_named_only_when_reported_present():
    assert names_amx(parse_report(AMX_REPORT))
    assert not names_amx(parse_report(EPYC_REPORT))
    assert not names_amx(parse_report(EPYC_REPORT + "AMX_INT8 = 0 | "))


def test_auto_turns_the_extra_types_off_on_a_cpu_with_amx():
    choice = choose("auto", AMX_REPORT)
    assert choice.use is False
    assert "AMX_INT8" in choice.reason and "#20824" in choice.reason
    assert choice.describe() == {"mode": "auto", "used": False, "reason": choice.reason, "report_source": "given"}


def test_auto_keeps_them_where_there_is_no_amx():
    choice = choose("auto", EPYC_REPORT)
    assert choice.use is True and "no AMX" in choice.reason


@pytest.mark.parametrize("report", [AMX_REPORT, EPYC_REPORT])
def test_on_and_off_are_taken_as_asked_whatever_the_cpu(report):
    assert choose("on", report).use is True and choose("on", report).reason == "--llama-extra-buffers on"
    assert choose("off", report).use is False and choose("off", report).reason == "--llama-extra-buffers off"


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="auto, on, off"):
        choose("fast", EPYC_REPORT)
    assert extra_buffers.one_of_modes("fast") == "must be one of auto, on, off"
    assert extra_buffers.one_of_modes("off") is None


def test_the_test_report_variable_feeds_the_decision(monkeypatch):
    monkeypatch.setenv(extra_buffers.REPORT_ENV, AMX_REPORT)
    choice = choose("auto")
    assert choice.use is False and choice.report_source == extra_buffers.REPORT_ENV
    assert choice.features["CPU"]["AMX_INT8"] == "1"


def test_a_fallback_keeps_the_report_and_says_why():
    choice = choose("auto", EPYC_REPORT).turned_off("fallback: SIGSEGV")
    assert choice.use is False and choice.reason == "fallback: SIGSEGV" and choice.report == EPYC_REPORT


def test_the_option_is_declared_and_checked():
    from superfluid.core.cli import load
    from superfluid.core.errors import ConfigError

    config, _ = load(["serve", "--llama-extra-buffers", "off"])
    assert config.models[0]["llama-extra-buffers"] == "off"
    config, _ = load(["serve"])
    assert config.models[0]["llama-extra-buffers"] == "auto"
    with pytest.raises(ConfigError, match="llama-extra-buffers"):
        load(["serve", "--llama-extra-buffers", "sometimes"])


def test_a_worker_exit_names_its_signal():
    assert signal_of(-11) is signal.SIGSEGV and signal_of(0) is None and signal_of(1) is None
    assert signal_of(None) is None
    assert exit_text(-11) == "exit code -11 (SIGSEGV)" and exit_text(3) == "exit code 3"
    exc = WorkerExited("gone", -signal.SIGBUS)
    assert exc.signal is signal.SIGBUS and exc.exitcode == -signal.SIGBUS
