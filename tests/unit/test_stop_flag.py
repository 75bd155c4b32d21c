"""core.stop_flag: what its requests mean, the byte layout C code reads (llama.cpp's abort
callback is libc's strlen on the flag; _rounds.c reads bytes 0 and 2), and a worker engine's
flag shared with a spawned process."""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing as mp

import pytest

from superfluid.core.stop_flag import StopFlag


@pytest.mark.parametrize("shared", [False, True], ids=["in-process", "shared"])
def test_stop_ends_the_step_in_flight_yield_only_the_tick(shared):
    flag = StopFlag(mp.get_context("spawn") if shared else None)
    assert not flag.stop_requested() and not flag.abort_requested()
    flag.request_yield()
    assert flag.stop_requested() and not flag.abort_requested()
    flag.request_stop()
    assert flag.stop_requested() and flag.abort_requested()
    flag.clear()
    assert not flag.stop_requested() and not flag.abort_requested()


def test_c_code_reads_stop_as_a_one_byte_string_and_yield_at_byte_two():
    strlen = ctypes.CDLL(ctypes.util.find_library("c")).strlen
    strlen.argtypes, strlen.restype = [ctypes.c_void_p], ctypes.c_size_t
    flag = StopFlag(mp.get_context("spawn"))
    flag.request_yield()
    assert strlen(flag.address) == 0  # the abort callback ignores yield
    flag.request_stop()
    assert strlen(flag.address) == 1
    assert ctypes.string_at(flag.address, 3) == b"\x01\x00\x01"


def raise_yield(flag: StopFlag) -> None:
    flag.request_yield()


def test_a_shared_flag_raised_in_a_spawned_worker_is_seen_by_the_daemon():
    ctx = mp.get_context("spawn")
    flag = StopFlag(ctx)
    child = ctx.Process(target=raise_yield, args=(flag,))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and flag.stop_requested() and not flag.abort_requested()
