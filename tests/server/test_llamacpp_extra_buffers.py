"""llama.cpp's extra buffer types on a real server: each branch of the decision, the warm-up
fallback, and a worker that faults while serving.

The decision is fed llama.cpp's CPU report through ``SUPERFLUID_TEST_CPU_REPORT``, so that the AMX
branch runs on any machine. The model is the default SmolLM2 requantized to Q4_0, whose weights
llama.cpp repacks on any AVX2 CPU: where they land (``weight_buffers`` in /health, read from
llama.cpp's own load lines) shows whether the choice reached llama.cpp. Crashes are injected with
the worker's test-only switch ``SUPERFLUID_TEST_WARMUP_CRASH``, or a real SIGSEGV to the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from superfluid.plugins.llamacpp.extra_buffers import REPORT_ENV, names_amx, parse_report
from superfluid.plugins.llamacpp.warmup import CRASH_ENV

from ..llama_reference import in_child
from ..unit.test_llamacpp_extra_buffers import AMX_REPORT, EPYC_REPORT
from .serverproc import free_port

PLAIN_TYPES = {"CPU", "CPU_Mapped"}  # where weights sit when no extra buffer type takes them


def requantize_q4_0(source: str, target: str) -> int:
    """In a child: llama.cpp's own quantizer, the default model to Q4_0 (0 on success)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    return llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))


@pytest.fixture(scope="module")
def q4_0_model(model_path, tmp_path_factory) -> str:
    target = str(tmp_path_factory.mktemp("q4_0") / "smollm2-q4_0.gguf")
    assert in_child(requantize_q4_0, model_path, target) == 0
    return target


@pytest.fixture(scope="module")
def machine_has_amx() -> bool:
    """Whether this machine's own llama.cpp reports AMX: then 'on' meets the real AMX path."""
    import llama_cpp

    return names_amx(parse_report(llama_cpp.llama_print_system_info().decode()))


def model_health(srv) -> dict:
    return next(iter(srv.get_json("/health")["models"].values()))


def extra_types(health: dict) -> set[str]:
    return set(health["weight_buffers"]) - PLAIN_TYPES


def chat(srv) -> str:
    status, body = srv.call("POST", "/v1/chat/completions", {
        "model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_auto_on_a_cpu_reporting_amx_keeps_weights_out_of_extra_buffers(start_server, q4_0_model):
    srv = start_server("--max-batch", "2", model=q4_0_model, env={REPORT_ENV: AMX_REPORT})
    health = model_health(srv)
    assert health["extra_buffers"]["used"] is False
    assert health["extra_buffers"]["mode"] == "auto" and "AMX_INT8" in health["extra_buffers"]["reason"]
    assert health["extra_buffers"]["report_source"] == REPORT_ENV
    assert health["cpu_features"]["CPU"]["AMX_INT8"] == "1"
    assert extra_types(health) == set(), health["weight_buffers"]
    assert chat(srv)
    assert "llama.cpp extra buffer types off (auto: llama.cpp's CPU report names AMX_INT8" in srv.log()
    srv.stop()


def test_auto_without_amx_repacks_the_weights(start_server, q4_0_model, machine_has_amx):
    srv = start_server("--max-batch", "2", model=q4_0_model, env={REPORT_ENV: EPYC_REPORT})
    health = model_health(srv)
    if machine_has_amx:  # the fed report hides AMX, but llama.cpp uses it: the warm-up must catch that
        assert health["extra_buffers"]["used"] is False and health["extra_buffers"]["reason"].startswith("fallback")
    else:
        assert health["extra_buffers"]["used"] is True and "no AMX" in health["extra_buffers"]["reason"]
        assert "CPU_REPACK" in health["weight_buffers"], health["weight_buffers"]
    assert chat(srv)
    srv.stop()


def test_on_overrides_a_cpu_reporting_amx(start_server, q4_0_model, machine_has_amx):
    srv = start_server("--max-batch", "2", "--llama-extra-buffers", "on", model=q4_0_model,
                       env={REPORT_ENV: AMX_REPORT})
    health = model_health(srv)
    if not machine_has_amx:
        assert health["extra_buffers"] == {"mode": "on", "used": True, "reason": "--llama-extra-buffers on",
                                           "report_source": REPORT_ENV}
        assert extra_types(health) == {"CPU_REPACK"}, health["weight_buffers"]
    assert chat(srv)
    srv.stop()


def test_off_overrides_a_cpu_without_amx(start_server, q4_0_model):
    srv = start_server("--max-batch", "2", "--llama-extra-buffers", "off", model=q4_0_model,
                       env={REPORT_ENV: EPYC_REPORT})
    health = model_health(srv)
    assert health["extra_buffers"]["used"] is False and health["extra_buffers"]["reason"] == "--llama-extra-buffers off"
    assert extra_types(health) == set(), health["weight_buffers"]
    assert chat(srv)
    srv.stop()


def test_a_worker_dying_in_its_warmup_with_extra_buffers_is_started_again_without_them(start_server, q4_0_model):
    srv = start_server("--max-batch", "2", model=q4_0_model,
                       env={REPORT_ENV: EPYC_REPORT, CRASH_ENV: "extra-buffers"})
    health = model_health(srv)
    assert health["extra_buffers"]["used"] is False
    assert health["extra_buffers"]["reason"].startswith("fallback: the worker died with SIGSEGV")
    assert extra_types(health) == set(), health["weight_buffers"]
    assert health["restarts"] == 0 and health["state"] == "ready"
    log = srv.log()
    assert "died with SIGSEGV before it was ready" in log
    assert "llama.cpp's CPU report: CPU : SSE3 = 1" in log and "Set --llama-extra-buffers off" in log
    assert chat(srv)  # the first request never meets the crash
    srv.stop()


def test_a_worker_dying_in_its_warmup_on_safe_settings_too_stops_the_daemon_with_exit_2(model_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{REPORT_ENV: EPYC_REPORT, CRASH_ENV: "always"})
    done = subprocess.run([sys.executable, "-m", "superfluid.core.cli", "serve", "--host", "127.0.0.1",
                           "--port", str(free_port()), "--model", model_path, "--max-batch", "2",
                           "--max-context", "512"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("superfluid: model ") and "died with SIGSEGV" in last, last
    assert "even with extra buffer types off (--llama-extra-buffers off)" in last
    assert "llama.cpp's CPU report: CPU : SSE3 = 1" in last
    assert "starting it again with them off" in done.stderr  # the one retry was made first


def test_a_worker_faulting_while_serving_comes_back_without_extra_buffers(start_server, q4_0_model,
                                                                          machine_has_amx):
    if machine_has_amx:
        pytest.skip("auto is off on this CPU already")
    srv = start_server("--max-batch", "2", model=q4_0_model, env={REPORT_ENV: EPYC_REPORT})
    before = model_health(srv)
    assert before["extra_buffers"]["used"] is True
    os.kill(before["worker_pid"], signal.SIGSEGV)
    time.sleep(0.5)
    assert chat(srv)  # the loop meets the dead worker on this request's tick and restarts it
    after = model_health(srv)
    assert after["restarts"] == 1 and after["worker_pid"] != before["worker_pid"]
    assert after["extra_buffers"]["used"] is False
    assert after["extra_buffers"]["reason"] == "fallback: the worker died with SIGSEGV while serving with them on"
    assert extra_types(after) == set(), after["weight_buffers"]
    srv.stop()
