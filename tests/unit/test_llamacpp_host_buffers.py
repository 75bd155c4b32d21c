"""plugins/llamacpp/buffers.py's host buffers: a dropped buffer's mapping is kept for the next park
of a size it fits (a fresh mapping's page faults cost a seal 85-225 ms of the tick), but never
while anything still holds the buffer (the writer thread writes a dropped park key's buffer), and
never past SPARE_BYTES."""

from __future__ import annotations

import ctypes
import gc

import pytest

from superfluid.plugins.llamacpp import buffers


@pytest.fixture(autouse=True)
def empty_spares(monkeypatch):
    monkeypatch.setattr(buffers, "_spare", [])


def _address(buf) -> int:
    return ctypes.addressof(buf)


def test_a_dropped_buffer_is_reused_only_once_nothing_holds_it():
    a = buffers.host_buffer(3 << 20)
    a[0] = 7
    held = memoryview(a).cast("B")          # the writer thread's closure, still writing it
    where = _address(a)
    del a
    gc.collect()
    b = buffers.host_buffer(3 << 20)
    assert _address(b) != where and held[0] == 7   # not handed out while held
    del held
    gc.collect()
    c = buffers.host_buffer((3 << 20) - 100)       # a little smaller: fits the spare
    assert _address(c) == where and len(c) == (3 << 20) - 100


def test_a_spare_is_not_wasted_on_a_much_smaller_buffer_nor_kept_past_the_bound(monkeypatch):
    big = buffers.host_buffer(40 << 20)
    where = _address(big)
    del big
    gc.collect()
    small = buffers.host_buffer(1 << 20)
    assert _address(small) != where                 # 40 MiB kept for a 40 MiB park, not 1 MiB
    monkeypatch.setattr(buffers, "SPARE_BYTES", 8 << 20)
    for _ in range(3):
        buffers.host_buffer(4 << 20)                # each dropped at once
    gc.collect()
    assert sum(len(r) for r in buffers._spare) <= 8 << 20
