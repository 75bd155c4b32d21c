"""tools/bench/kv_bits.py's arithmetic: what it reads from /health, the lanes a budget holds and
the agreement it reports (the run itself starts real servers: verified by hand, not here)."""

from __future__ import annotations

from tools.bench import kv_bits


def test_pool_figures_read_llama_cpps_health_and_count_its_spare_sequences():
    health = {"n_seq_max": 6, "lanes": 4, "kv_bytes": 600, "kv_pool": {
        "bytes_per_cell": 12240, "shared": False, "shape": {"type_k": "q8_0"}}}
    f = kv_bits.pool_figures(health, 2048)
    assert (f["bytes_per_cell"], f["bytes_per_lane"], f["type"], f["spare_sequences"]) == \
        (12240, 12240 * 2048, "q8_0", 2)
    shared = {**health, "kv_pool": {**health["kv_pool"], "shared": True}}
    assert kv_bits.pool_figures(shared, 2048)["spare_sequences"] == 0


def test_pool_figures_fall_back_to_an_engines_blocks():
    f = kv_bits.pool_figures({"kv_bytes": 4096 * 10, "kv_blocks": 10, "block_size": 16}, 100)
    assert f["bytes_per_cell"] == 256 and f["type"] is None


def test_lanes_within_a_budget_leave_room_for_the_spares():
    assert kv_bits.lanes_within(1 << 30, 23040, 2048, 2) == (1 << 30) // (23040 * 2048) - 2
    assert kv_bits.lanes_within(1 << 20, 23040, 2048, 2) == 0
    assert kv_bits.lanes_within(1 << 30, 0, 2048, 0) == 0


def test_agreement_counts_identical_replies_and_the_shared_prefix():
    a = kv_bits.agreement({"p": "abcd", "q": "xyz"}, {"p": "abcd", "q": "xy!"})
    assert a == {"identical": 1, "of": 2, "mean_shared_prefix": round((1 + 2 / 3) / 2, 3)}
