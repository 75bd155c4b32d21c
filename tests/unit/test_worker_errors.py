"""A tick's error in a worker process reaches the daemon as the error it was (core.worker_errors):
its class, status, type and code, so a client error raised in a worker answers its client as it
would in process, and an engine failure stays a 500 that names the model; both the value alone
and a real spawned worker serving ticks (core.worker_process)."""

from __future__ import annotations

import logging
import os
import pickle

import pytest

from superfluid.core.errors import ContextLengthExceeded, EngineFailure, InvalidRequest, SuperfluidError
from superfluid.core.worker_errors import WorkerError
from superfluid.core.worker_process import WorkerProcess, serve_ticks


class TooManyKeys(SuperfluidError):
    """A plugin's own error class, which the daemon does not know by name."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_keys"


def carried(exc: Exception) -> SuperfluidError:
    """``exc`` raised in a worker, carried over the pipe (pickled) and raised again in the daemon."""
    try:
        raise exc
    except Exception as raised:
        report = WorkerError.of(raised)
    return pickle.loads(pickle.dumps(report)).rebuild("m")


@pytest.mark.parametrize("exc,cls,status,code", [
    (InvalidRequest("the grammar does not parse", param="grammar"), InvalidRequest, 400, "invalid_request"),
    (ContextLengthExceeded("too long", param="messages"), ContextLengthExceeded, 400, "context_length_exceeded"),
    (InvalidRequest("no such schema", code="unsupported_schema"), InvalidRequest, 400, "unsupported_schema"),
])
def test_a_client_error_keeps_its_class_status_code_and_message(exc, cls, status, code):
    got = carried(exc)
    assert type(got) is cls and got.status == status and got.code == code
    assert got.to_body()["error"] == exc.to_body()["error"]


def test_a_plugin_error_the_daemon_does_not_know_keeps_its_status_type_and_code():
    got = carried(TooManyKeys("slow down", param="key"))
    assert type(got) is SuperfluidError and got.status == 429
    assert got.to_body()["error"] == {"message": "slow down", "type": "rate_limit_error", "param": "key",
                                      "code": "too_many_keys"}


def test_any_other_exception_is_an_engine_failure_naming_the_model_and_the_exception():
    got = carried(RuntimeError("llama_decode failed (-3)"))
    assert type(got) is EngineFailure and got.status == 500 and got.code == "engine_error"
    assert got.message == "model 'm': RuntimeError: llama_decode failed (-3)"


def test_the_report_carries_the_worker_traceback():
    try:
        raise ValueError("deep inside")
    except ValueError as exc:
        report = WorkerError.of(exc)
    assert "Traceback" in report.traceback and "ValueError: deep inside" in report.traceback
    assert "test_the_report_carries_the_worker_traceback" in report.traceback


# ---- a real worker process ---------------------------------------------------------------------

class RaisingRunner:
    """Raises what the plan names; any other plan runs."""

    def run(self, plan):
        if plan == "invalid":
            raise InvalidRequest("the grammar does not parse", param="grammar")
        if plan == "broken":
            raise RuntimeError("llama_decode failed (-3)")
        return f"ran {plan}"


def raising_worker(conn, stop_flag, spec) -> None:
    conn.send(("ready", {"pid": os.getpid()}))
    serve_ticks(conn, RaisingRunner())


@pytest.fixture(scope="module")
def worker():
    process = WorkerProcess("m")
    process.start(raising_worker, None, name="test-raising-worker")
    yield process
    process.close()


def test_a_worker_tick_raising_a_client_error_is_a_400_and_the_worker_serves_on(worker, caplog):
    with caplog.at_level(logging.ERROR, logger="superfluid.worker"):
        with pytest.raises(InvalidRequest) as got:
            worker.call(("tick", "invalid"))
    assert got.value.status == 400 and got.value.param == "grammar"
    assert "raise InvalidRequest" in caplog.text  # the worker's traceback, in the daemon's log
    assert worker.call(("tick", "next")) == "ran next" and worker.state == "ready"


def test_a_worker_tick_raising_anything_else_is_an_engine_failure(worker):
    with pytest.raises(EngineFailure, match=r"^model 'm': RuntimeError: llama_decode failed \(-3\)$") as got:
        worker.call(("tick", "broken"))
    assert got.value.status == 500 and got.value.code == "engine_error"
