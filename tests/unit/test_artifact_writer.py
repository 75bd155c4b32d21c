"""Park artifacts written off the tick thread: the tick hands over a closure holding the bytes
and goes on; a later tick reports the file. The llama.cpp, basert and MLX runners' own saves are
tested against their engines (tests/server/test_*_runner.py, test_mlx.py, test_park_sealing.py)."""

from __future__ import annotations

import threading

from superfluid.core.artifact_writer import ArtifactWriter
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import TickPlan
from superfluid.core.tick_runner import TickRunner


def test_writes_in_order_and_reports_each_once(tmp_path):
    w = ArtifactWriter()
    gate = threading.Event()
    order = []

    def slow(f):
        gate.wait(5)
        order.append("a")
        f.write(b"aaaa")

    w.submit(str(tmp_path / "a"), slow)
    w.submit(str(tmp_path / "b"), lambda f: (order.append("b"), f.write(b"bb")))
    assert w.pending() == 2 and w.finished() == {}  # nothing finished: the write is not waited for
    gate.set()
    w.flush(5)
    assert order == ["a", "b"] and w.pending() == 0
    assert w.finished() == {str(tmp_path / "a"): 4, str(tmp_path / "b"): 2}
    assert w.finished() == {}
    assert (tmp_path / "a").read_bytes() == b"aaaa"


def test_a_failed_write_reports_zero_and_leaves_no_file(tmp_path):
    w = ArtifactWriter()
    w.submit(str(tmp_path / "nowhere" / "x"), lambda f: f.write(b"x"))  # no such folder
    w.flush(5)
    assert w.finished() == {str(tmp_path / "nowhere" / "x"): 0}

    def broken(f):
        f.write(b"half")
        raise OSError("disk full")
    w.submit(str(tmp_path / "y"), broken)
    w.flush(5)
    assert w.finished() == {str(tmp_path / "y"): 0} and list(tmp_path.iterdir()) == []


class _Runner(TickRunner):
    """A runner with a save_writer and nothing else (the primitives a plan without lanes needs)."""

    def __init__(self, gate):
        super().__init__(StopFlag(), 16)
        self.gate = gate

    def save_writer(self, key):
        data = self.parked.get(key)
        if data is None:
            return None
        return lambda f: (self.gate.wait(5), f.write(data))

    def clear_kv(self, slot): ...
    def cut(self, slot, pos): ...
    def keep_prefix(self, slot, pos): return True
    def new_sampler(self, lp): ...
    def accepts(self, slot): return True
    def advance(self, work, plan, result): return True
    def kv_used(self, touched=()): return 0


def test_the_tick_does_not_wait_for_the_write_and_a_later_tick_reports_it(tmp_path):
    gate = threading.Event()
    r = _Runner(gate)
    r.parked["k"] = b"kv-bytes"
    path = str(tmp_path / "k.kv")
    res = r.run(TickPlan(save=[("k", path)], drop_parked=["k"]))  # returns while the write is blocked
    assert res.saved == {} and res.saves_pending == 1 and "k" not in r.parked
    gate.set()
    for _ in range(100):
        res = r.run(TickPlan(collect_saves=True))
        if res.saved:
            break
    assert res.saved == {path: 8} and res.saves_pending == 0
    assert (tmp_path / "k.kv").read_bytes() == b"kv-bytes"
    assert not TickPlan().collect_saves and TickPlan().empty() and not TickPlan(collect_saves=True).empty()


def test_unknown_key_reports_zero_at_once(tmp_path):
    r = _Runner(threading.Event())
    assert r.run(TickPlan(save=[("missing", str(tmp_path / "m"))])).saved == {str(tmp_path / "m"): 0}
