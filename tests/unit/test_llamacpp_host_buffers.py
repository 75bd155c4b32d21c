"""plugins/llamacpp/buffers.py's host buffers: a dropped buffer's mapping is kept for the next park
of a size it fits (a fresh mapping's page faults cost a seal 65-140 ms of the tick), but never
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


def _lazy_free_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("LazyFree:"):
                return int(line.split()[1])
    return 0


@pytest.mark.skipif(not hasattr(buffers.mmap, "MADV_FREE"), reason="no MADV_FREE on this platform")
def test_a_spare_leaves_the_working_set_until_it_is_reused():
    """The chaos memory scenario reads the cgroup's working set fall after the ladder drops the
    host tier; spares kept in it would hold the dropped parks' memory there."""
    try:
        before = _lazy_free_kib()
    except OSError:
        pytest.skip("no /proc/self/smaps_rollup")
    buf = buffers.host_buffer(16 << 20)
    ctypes.memset(buf, 1, len(buf))                 # a park's state written into it
    del buf
    gc.collect()
    assert _lazy_free_kib() - before >= 15 << 10    # its pages are the kernel's to take back
    again = buffers.host_buffer(16 << 20)
    ctypes.memset(again, 2, len(again))
    assert _lazy_free_kib() - before < 1 << 10      # written again: in use, not free
    assert bytes(again[:4]) == b"\x02" * 4
