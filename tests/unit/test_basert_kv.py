"""basert's paged KV pool and paged attention against a dense reference: per slot, per layer,
plain K/V tensors and an attention written out here (explicit mask, softmax), fed the same random
q/k/v. Steps mix prefill chunks, decode rows and verify rows; the pool must give the dense
outputs (fp32 within 1e-5), keep shared sources intact through copy-on-write, free blocks on
truncate and dedupe, refuse whole plans it cannot hold, park and restore slots (quantized ones
too), and stay close to fp32 at 8 and 4 bits."""

from __future__ import annotations

import io

import pytest
import torch

from superfluid.plugins.basert.kv_blocks import ParkedKV
from superfluid.plugins.basert.kv_pool import PagedKV
from superfluid.plugins.basert.kv_quant import rotation

torch.set_num_threads(1)

L, HQ, HK, D, BS = 2, 4, 2, 8, 4
SCALE = D ** -0.5


def make_pool(bits: int = 0, n_blocks: int = 64, dtype: torch.dtype = torch.float32,
              block_size: int = BS) -> PagedKV:
    return PagedKV(n_layers=L, n_kv_heads=HK, head_dim=D, n_blocks=n_blocks,
                   block_size=block_size, dtype=dtype, device=torch.device("cpu"), bits=bits)


def ref_attention(q, keys, values, start, window, softcap):
    """q ``[n, HQ, D]`` at positions start.., keys/values ``[start + n, HK, D]``."""
    n, n_keys = q.shape[0], keys.shape[0]
    rep = HQ // HK
    k = keys.repeat_interleave(rep, dim=1).double()
    v = values.repeat_interleave(rep, dim=1).double()
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * SCALE
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    mask = torch.zeros(n, n_keys, dtype=torch.bool)
    for i in range(n):
        for j in range(n_keys):
            mask[i, j] = j <= start + i and (window is None or start + i - j < window)
    logits = logits.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v).float()


class Dense:
    """The reference cache: per slot, per layer, K and V as plain ``[pos, HK, D]`` tensors."""

    def __init__(self):
        self.kv: dict[int, list[list[torch.Tensor]]] = {}

    def get(self, slot):
        return self.kv.setdefault(slot, [[torch.zeros(0, HK, D), torch.zeros(0, HK, D)]
                                         for _ in range(L)])

    def truncate(self, slot, pos):
        for layer in self.get(slot):
            layer[0], layer[1] = layer[0][:pos], layer[1][:pos]

    def share(self, src, dst, pos):
        self.kv[dst] = [[k[:pos].clone(), v[:pos].clone()] for k, v in self.get(src)]

    def step(self, rows, layer, q, k, v, window, softcap):
        out = torch.empty_like(q)
        off = 0
        for slot, start, count in rows:
            cache = self.get(slot)[layer]
            cache[0] = torch.cat([cache[0][:start], k[off:off + count]])
            cache[1] = torch.cat([cache[1][:start], v[off:off + count]])
            out[off:off + count] = ref_attention(q[off:off + count], cache[0], cache[1], start,
                                                 window, softcap)
            off += count
        return out


def run_step(pool, ref, rows, gen, *, windows=(None, None), softcap=None, kv=None,
             tokens=None):
    """One step on both caches with the same random q/k/v; returns (pool out, ref out) per
    layer. ``kv`` overrides the k/v per layer (to write identical KV into two slots);
    ``tokens`` (slot -> ids) are noted after the forward."""
    assert pool.reserve(rows)
    view = pool.begin_step(rows)
    t = sum(c for _, _, c in rows)
    if ref is not None:
        for slot, start, _ in rows:
            ref.truncate(slot, start)
    outs, refs = [], []
    for layer in range(L):
        q = torch.randn(t, HQ, D, generator=gen)
        if kv is None:
            k, v = torch.randn(t, HK, D, generator=gen), torch.randn(t, HK, D, generator=gen)
        else:
            k, v = kv[layer]
        outs.append(view.attend(layer, q, k, v, window=windows[layer], scale=SCALE,
                                softcap=softcap))
        if ref is not None:
            refs.append(ref.step(rows, layer, q, k, v, windows[layer], softcap))
    for slot, ids in (tokens or {}).items():
        start = pool.length(slot) - len(ids)
        pool.note_tokens(slot, start, ids)
    return outs, refs


def assert_close(outs, refs, atol=1e-5):
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, atol=atol, rtol=0)


SCHEDULE = [
    [(0, 0, 7), (1, 0, 5)],                       # two prefill chunks
    [(0, 7, 6), (1, 5, 1), (2, 0, 9)],            # chunk + decode + prefill in one step
    [(0, 13, 1), (1, 6, 1), (2, 9, 1), (3, 0, 3)],
    [(2, 10, 4), (0, 14, 1), (1, 7, 1)],          # a verify row between decodes
    [(2, 12, 1), (0, 15, 1), (1, 8, 1), (3, 3, 1)],  # verify rejected two: 2 restarts at 12
]


@pytest.mark.parametrize("windows,softcap", [
    ((None, None), None),
    ((3, None), None),        # sliding layer then global layer, as Gemma alternates
    ((5, 2), None),
    ((None, None), 2.0),
    ((3, None), 1.5),
])
def test_mixed_steps_match_dense_reference(windows, softcap):
    gen = torch.Generator().manual_seed(0)
    pool, ref = make_pool(), Dense()
    for rows in SCHEDULE:
        outs, refs = run_step(pool, ref, rows, gen, windows=windows, softcap=softcap)
        assert_close(outs, refs)
    assert [pool.length(s) for s in range(4)] == [16, 9, 13, 4]


def test_decode_rows_split_by_gather_budget():
    """A small gather budget splits the decode rows into several calls (sorted by span); the
    outputs stay the dense ones."""
    gen = torch.Generator().manual_seed(12)
    pool = PagedKV(n_layers=L, n_kv_heads=HK, head_dim=D, n_blocks=64, block_size=BS,
                   dtype=torch.float32, device=torch.device("cpu"), max_gather_tokens=24)
    ref = Dense()
    for rows in SCHEDULE:
        outs, refs = run_step(pool, ref, rows, gen, windows=(6, None))
        assert_close(outs, refs)
    rows = [(0, 16, 1), (1, 9, 1), (2, 13, 1), (3, 4, 1)]
    assert pool.reserve(rows)
    view = pool.begin_step(rows)
    calls = view._plan(None)
    # spans of 2, 3, 4, 5 blocks: 2 rows x 3 blocks fit 24 keys, the longer rows go alone
    assert [c.tok.tolist() for c in calls] == [[3, 1], [2], [0]]
    assert [tuple(c.blocks.shape) for c in calls] == [(2, 3), (1, 4), (1, 5)]
    # a window of 6 reaches back only 2 or 3 blocks: three rows of 2 blocks share a call
    assert [tuple(c.blocks.shape) for c in view._plan(6)] == [(3, 2), (1, 3)]


def test_bf16_pool_close_to_fp32_reference():
    gen = torch.Generator().manual_seed(13)
    pool, ref = make_pool(dtype=torch.bfloat16), Dense()
    for rows in SCHEDULE:
        assert pool.reserve(rows)
        view = pool.begin_step(rows)
        for slot, start, _ in rows:
            ref.truncate(slot, start)
        t = sum(c for _, _, c in rows)
        for layer in range(L):
            q, k, v = (torch.randn(t, h, D, generator=gen).bfloat16().float()
                       for h in (HQ, HK, HK))
            out = view.attend(layer, q.bfloat16(), k.bfloat16(), v.bfloat16(), window=3,
                              scale=SCALE, softcap=None)
            assert out.dtype == torch.bfloat16
            want = ref.step(rows, layer, q, k, v, 3, None)
            torch.testing.assert_close(out.float(), want, atol=0.05, rtol=0)


def test_share_copy_on_write_keeps_source():
    gen = torch.Generator().manual_seed(1)
    pool, ref = make_pool(), Dense()
    run_step(pool, ref, [(0, 0, 10)], gen)          # blocks: 2 full + 1 partial
    before = pool.store.data.clone()
    used = pool.used_blocks()
    pool.share(0, 1, 10)
    ref.share(0, 1, 10)
    assert pool.used_blocks() == used and pool.length(1) == 10
    assert pool.block_table(1) == pool.block_table(0)
    # dst writes into the shared partial block: it gets a copy, the source stays as it was
    outs, refs = run_step(pool, ref, [(1, 10, 1)], gen)
    assert_close(outs, refs)
    assert pool.used_blocks() == used + 1
    assert pool.block_table(1)[:2] == pool.block_table(0)[:2]
    assert pool.block_table(1)[2] != pool.block_table(0)[2]
    assert torch.equal(pool.store.data[:, :, pool.block_table(0)],
                       before[:, :, pool.block_table(0)])
    # the source continues on its own history
    outs, refs = run_step(pool, ref, [(0, 10, 2), (1, 11, 1)], gen)
    assert_close(outs, refs)
    # a share cut mid-block, then the source writes first: the source copies, dst keeps its view
    pool.share(0, 2, 6)
    ref.share(0, 2, 6)
    run_step(pool, ref, [(0, 6, 3)], gen)          # source rewrites positions 6.. in place
    outs, refs = run_step(pool, ref, [(2, 6, 1), (0, 9, 1)], gen)
    assert_close(outs, refs)
    for s in (0, 1, 2):
        pool.clear(s)
    assert pool.used_blocks() == 0 and pool.free_blocks() == pool.n_blocks


def test_identical_prefixes_dedupe_and_outputs_stay():
    gen = torch.Generator().manual_seed(2)
    ids = list(range(100, 111))                    # 11 tokens: 2 full blocks + 3
    kv = [(torch.randn(11, HK, D, generator=gen), torch.randn(11, HK, D, generator=gen))
          for _ in range(L)]
    pool, ref = make_pool(), Dense()
    run_step(pool, ref, [(0, 0, 11)], gen, kv=kv, tokens={0: ids})
    assert pool.used_blocks() == 3
    # the same prefix computed again in another slot, ids noted before the forward this time
    assert pool.reserve([(1, 0, 11)])
    pool.note_tokens(1, 0, ids)
    assert pool.used_blocks() == 6                  # no KV yet: nothing hashed, nothing shared
    view = pool.begin_step([(1, 0, 11)])
    ref.truncate(1, 0)
    for layer in range(L):
        q = torch.randn(11, HQ, D, generator=gen)
        view.attend(layer, q, *kv[layer], window=None, scale=SCALE, softcap=None)
        ref.step([(1, 0, 11)], layer, q, *kv[layer], None, None)
    assert pool.used_blocks() == 4                  # the 2 full blocks count once
    assert pool.block_table(1)[:2] == pool.block_table(0)[:2]
    # both continue; writes past the shared full blocks need no copy
    outs, refs = run_step(pool, ref, [(0, 11, 1), (1, 11, 2)], gen)
    assert_close(outs, refs)
    # different ids in the second block: only the first block is shared
    other = ids[:4] + [7] * 7
    run_step(pool, ref, [(2, 0, 11)], gen, kv=kv, tokens={2: other})
    assert pool.block_table(2)[0] == pool.block_table(0)[0]
    assert pool.block_table(2)[1] != pool.block_table(0)[1]
    outs, refs = run_step(pool, ref, [(2, 11, 1), (0, 12, 1)], gen)
    assert_close(outs, refs)
    # a shared full block rewritten after a truncate into it is copied first
    pool.truncate(1, 6)
    ref.truncate(1, 6)
    outs, refs = run_step(pool, ref, [(1, 6, 1), (0, 13, 1)], gen)
    assert_close(outs, refs)
    assert pool.block_table(1)[1] != pool.block_table(0)[1]
    assert pool.block_table(1)[0] == pool.block_table(0)[0]


def test_truncate_frees_blocks_and_keeps_prefix():
    gen = torch.Generator().manual_seed(3)
    pool, ref = make_pool(n_blocks=8), Dense()
    run_step(pool, ref, [(0, 0, 10)], gen, tokens={0: list(range(10))})
    assert pool.used_blocks() == 3 and pool.free_blocks() == 5
    pool.truncate(0, 4)
    ref.truncate(0, 4)
    assert pool.used_blocks() == 1 and pool.length(0) == 4
    assert pool.tokens(0) == [0, 1, 2, 3]
    outs, refs = run_step(pool, ref, [(0, 4, 1)], gen)
    assert_close(outs, refs)
    pool.truncate(0, 3)                              # into a block: it stays held
    assert pool.used_blocks() == 1
    pool.truncate(0, 0)
    assert pool.used_blocks() == 0 and pool.length(0) == 0


def test_reserve_is_all_or_nothing():
    gen = torch.Generator().manual_seed(4)
    pool, ref = make_pool(n_blocks=4), Dense()
    run_step(pool, ref, [(0, 0, 8)], gen)            # 2 of 4 blocks
    table = pool.block_table(0)
    assert not pool.reserve([(0, 8, 4), (1, 0, 9)])  # 1 + 3 > 2 free
    assert pool.length(0) == 8 and pool.length(1) == 0
    assert pool.block_table(0) == table and pool.free_blocks() == 2
    # the same slot cut back frees what the plan then uses
    assert pool.reserve([(0, 0, 4), (1, 0, 9)])
    assert pool.free_blocks() == 0
    # copy-on-write counts too: a shared partial block needs a free block to be written
    pool, ref = make_pool(n_blocks=2), Dense()
    run_step(pool, ref, [(0, 0, 6)], gen)
    pool.share(0, 1, 6)
    ref.share(0, 1, 6)
    assert pool.free_blocks() == 0
    assert not pool.reserve([(1, 6, 1)])
    assert not pool.reserve([(0, 6, 1), (1, 6, 1)])
    assert pool.length(0) == 6 and pool.length(1) == 6
    assert pool.block_table(0) == pool.block_table(1)
    # the source lets go of the partial block: the other slot writes it in place
    pool.truncate(0, 4)
    ref.truncate(0, 4)
    outs, refs = run_step(pool, ref, [(1, 6, 1)], gen)
    assert_close(outs, refs)
    assert pool.free_blocks() == 0 and pool.block_table(1) == pool.block_table(0) + [1]
    assert not pool.reserve([(0, 4, 1)])             # its old block is gone, none is free
    pool.truncate(1, 4)
    ref.truncate(1, 4)
    outs, refs = run_step(pool, ref, [(0, 4, 2)], gen)
    assert_close(outs, refs)
    with pytest.raises(ValueError):
        pool.reserve([(0, 7, 1)])                    # past the slot's length
    with pytest.raises(ValueError):
        pool.begin_step([(0, 6, 1)])                 # not reserved


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_park_round_trip(bits):
    gen = torch.Generator().manual_seed(5)
    twin_gen = torch.Generator().manual_seed(5)
    pool, twin = make_pool(bits, n_blocks=16), make_pool(bits, n_blocks=16)
    ids = list(range(13))
    for p, g in ((pool, gen), (twin, twin_gen)):
        run_step(p, None, [(0, 0, 9)], g, tokens={0: ids[:9]})
        run_step(p, None, [(0, 9, 4)], g, tokens={0: ids[9:]})
    parked = pool.parking.export(0)
    assert parked.length == 13 and parked.tokens == ids
    assert all(t.device.type == "cpu" for t in parked.tensors.values())
    assert parked.nbytes == pool.store.nbytes * 4 // pool.n_blocks       # 4 blocks of 16
    buf = io.BytesIO()
    PagedKV.save(parked, buf)
    buf.seek(0)
    loaded = PagedKV.load(buf)
    assert loaded.length == 13 and loaded.tokens == ids and loaded.meta == parked.meta
    for name, t in parked.tensors.items():
        assert torch.equal(loaded.tensors[name], t)
    pool.clear(0)
    assert pool.used_blocks() == 0
    assert pool.parking.import_(3, loaded)
    assert pool.length(3) == 13 and pool.tokens(3) == ids
    assert pool.parking.import_(4, loaded) and pool.used_blocks() == 5   # its 3 full blocks are hashed:
    pool.clear(4)                                                        # a second copy shares them
    outs, _ = run_step(pool, None, [(3, 13, 1)], gen)
    twin_outs, _ = run_step(twin, None, [(0, 13, 1)], twin_gen)
    for o, t in zip(outs, twin_outs):
        assert torch.equal(o, t)


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_a_kept_park_holds_its_blocks_and_comes_back_without_a_copy(bits):
    gen, twin_gen = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    pool, twin = make_pool(bits, n_blocks=16), make_pool(bits, n_blocks=16)
    ids = list(range(13))
    for p, g in ((pool, gen), (twin, twin_gen)):
        run_step(p, None, [(0, 0, 13)], g, tokens={0: ids})
    host = pool.parking.export(0)
    kept = pool.parking.keep(0)
    assert kept.tensors is None and pool.parking.kept(kept)
    assert kept.nbytes == host.nbytes and (kept.length, kept.tokens, kept.meta) == (13, ids, host.meta)
    pool.clear(0)
    assert pool.used_blocks() == 4 and pool.used_cells() == 0           # held by the entry, no slot's
    assert pool.parking.import_(3, kept)
    assert pool.used_blocks() == 4                                      # the same blocks, no copy
    assert pool.tokens(3) == ids
    pool.parking.forget(kept)
    assert not pool.parking.kept(kept) and pool.used_blocks() == 4      # slot 3 holds them now
    outs, _ = run_step(pool, None, [(3, 13, 1)], gen)                   # writes the shared partial block
    twin_outs, _ = run_step(twin, None, [(0, 13, 1)], twin_gen)
    for o, t in zip(outs, twin_outs):
        assert torch.equal(o, t)


def test_a_step_short_of_room_spills_the_oldest_kept_entry_to_host_memory():
    gen = torch.Generator().manual_seed(8)
    pool = make_pool(n_blocks=8)
    run_step(pool, None, [(0, 0, 9), (1, 0, 9)], gen)                   # 3 blocks each
    want = [pool.parking.export(0).tensors, pool.parking.export(1).tensors]
    old, new = pool.parking.keep(0), pool.parking.keep(1)
    pool.clear(0)
    pool.clear(1)
    assert pool.free_blocks() == 2
    assert pool.reserve([(2, 0, 20)])                                   # 5 blocks: the older entry goes
    assert not pool.parking.kept(old) and pool.parking.kept(new) and pool.free_blocks() == 0
    assert all(torch.equal(old.tensors[k], want[0][k]) for k in want[0])
    assert pool.parking.import_(3, old)                                 # 3 fresh blocks: the other goes too
    assert not pool.parking.kept(new) and all(torch.equal(new.tensors[k], want[1][k]) for k in want[1])
    assert all(torch.equal(pool.parking.export(3).tensors[k], want[0][k]) for k in want[0])
    assert not pool.reserve([(4, 0, 8)])                                # nothing left to spill: refused
    assert pool.length(4) == 0 and pool.free_blocks() == 0


def test_a_kept_entry_shared_by_slots_stays_intact_and_forget_lets_go():
    gen = torch.Generator().manual_seed(9)
    pool = make_pool(n_blocks=16)
    run_step(pool, None, [(0, 0, 6)], gen)                      # 2 blocks, the last partial
    kept = pool.parking.keep(0)
    before = pool.parking.host_copy(kept).tensors
    assert pool.parking.kept(kept)                              # a host copy leaves it kept
    pool.clear(0)
    assert pool.parking.import_(1, kept) and pool.parking.import_(2, kept)  # shared (a seed that stays parked)
    run_step(pool, None, [(1, 6, 1), (2, 6, 3)], gen)           # both write the shared partial block
    after = pool.parking.host_copy(kept).tensors
    assert all(torch.equal(before[k], after[k]) for k in before)
    used = pool.used_blocks()
    pool.parking.forget(kept)
    assert pool.used_blocks() == used - 1   # its own copy of the partial block goes, the shared full one stays
    pool.clear(1)
    pool.clear(2)
    assert pool.used_blocks() == 0
    with pytest.raises(ValueError):
        PagedKV.save(pool.parking.keep(0), io.BytesIO())        # a kept entry has no host copy


def test_import_refuses_without_changing_anything():
    gen = torch.Generator().manual_seed(6)
    pool = make_pool(n_blocks=4)
    run_step(pool, None, [(0, 0, 9)], gen)                    # 3 blocks
    parked = pool.parking.export(0)
    assert not make_pool(8).parking.import_(0, parked)        # stored form differs
    assert not make_pool(block_size=8).parking.import_(0, parked)
    assert not pool.parking.import_(1, parked)                # 1 free block < 3
    assert pool.length(1) == 0 and pool.free_blocks() == 1
    empty = make_pool(n_blocks=4).parking.export(7)           # a slot never used parks as nothing
    assert empty.length == 0 and empty.nbytes == 0
    assert pool.parking.import_(1, empty) and pool.length(1) == 0
    assert pool.parking.import_(0, parked)                    # over itself: its own blocks make room
    assert pool.length(0) == 9 and pool.free_blocks() == 1
    bad = ParkedKV(length=parked.length, tokens=[], meta=parked.meta,
                   tensors={"data": parked.tensors["data"][:, :, :2]})
    pool.clear(0)
    assert not pool.parking.import_(0, bad) and pool.free_blocks() == 4
    assert pool.parking.import_(0, parked)                    # dedupe: shares the live blocks it can


def test_corrupt_park_files_raise():
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(4)
    run_step(pool, None, [(0, 0, 6)], gen)
    buf = io.BytesIO()
    PagedKV.save(pool.parking.export(0), buf)
    data = buf.getvalue()
    for blob in (b"", b"not a torch file", data[:len(data) // 2]):
        with pytest.raises((ValueError, OSError)):
            PagedKV.load(io.BytesIO(blob))
    wrong = io.BytesIO()
    torch.save({"format": "basert-parked-kv/1", "length": 99, "tokens": torch.tensor([1]),
                "meta": pool.meta, "tensors": pool.parking.export(0).tensors}, wrong)
    wrong.seek(0)
    with pytest.raises(ValueError):
        PagedKV.load(wrong)


def test_note_tokens_checks_positions():
    gen = torch.Generator().manual_seed(8)
    pool = make_pool()
    run_step(pool, None, [(0, 0, 5)], gen)
    with pytest.raises(ValueError):
        pool.note_tokens(0, 0, list(range(6)))       # past the reserved positions
    with pytest.raises(ValueError):
        pool.note_tokens(0, 2, [1, 2])               # a gap: 0 and 1 not noted
    pool.note_tokens(0, 0, [1, 2, 3, 4, 5])
    pool.note_tokens(0, 1, [9])                      # ids changed: the hashes follow them
    assert pool.tokens(0) == [1, 9, 3, 4, 5]
    ids = [1, 9, 3, 4, 5, 6, 7, 8]
    run_step(pool, None, [(0, 5, 3)], gen, tokens={0: ids[5:]})
    run_step(pool, None, [(1, 0, 8)], gen, tokens={1: ids})
    assert pool.block_table(1)[1] == pool.block_table(0)[1]   # chained on the changed ids: shared


def _quant_errors(bits):
    """Max |pool(bits) - pool(fp32)| over the schedule, both on the same random inputs."""
    gen, gen32 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    pool, exact = make_pool(bits), make_pool(0)
    err, total, n = 0.0, 0.0, 0
    for rows in SCHEDULE + [[(0, 16, 1), (1, 9, 1), (2, 13, 1), (3, 4, 1)]] * 6:
        outs, _ = run_step(pool, None, rows, gen, windows=(3, None))
        ref, _ = run_step(exact, None, rows, gen32, windows=(3, None))
        for o, r in zip(outs, ref):
            err = max(err, (o - r).abs().max().item())
            total, n = total + (o - r).abs().sum().item(), n + o.numel()
    return err, total / n


@pytest.mark.parametrize("bits,limit", [(8, 0.05), (4, 0.6)])
def test_quantized_outputs_close_to_fp32(bits, limit):
    err, mean = _quant_errors(bits)
    print(f"\n{bits}-bit KV: max abs error vs fp32 {err:.4f}, mean {mean:.4f}")
    assert 0 < err < limit and mean < limit / 8


@pytest.mark.parametrize("bits", [8, 4])
def test_block_written_row_by_row_stays_within_its_scale(bits):
    """Decode fills a block one row per step; each write requantizes it. The rows must stay
    within a small multiple of the final scale's step (one-shot rounding: half a step)."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(10):
        x = torch.randn(16, HK, D, generator=gen) * 3
        pool = make_pool(bits, n_blocks=2, block_size=16)
        for i in range(16):
            rows = [(0, i, 1)]
            assert pool.reserve(rows)
            view = pool.begin_step(rows)
            for layer in range(L):
                view.attend(layer, torch.randn(1, HQ, D, generator=gen), x[i:i + 1],
                            x[i:i + 1], window=None, scale=SCALE, softcap=None)
        block = torch.tensor(pool.block_table(0))
        got = pool.store.read(L - 1, 1, block)[0]                 # rows in the stored basis
        x = x @ pool.store.rotation
        step = pool.store.scales[L - 1, 1, block[0]]
        assert torch.allclose(step, x.abs().amax(dim=(0, 2)) / (127 if bits == 8 else 7))
        assert ((got - x).abs() / step[None, :, None]).max() <= 1.5


@pytest.mark.parametrize("head_dim", [64, 80])
def test_rotation_is_orthogonal_and_fixed(head_dim):
    """Parked files are read back by later runs: the basis must not change between them."""
    r = rotation(head_dim)
    assert torch.allclose(r @ r.T, torch.eye(head_dim), atol=1e-5)
    assert torch.equal(r, rotation(head_dim))
    assert r.abs().amax() < 0.5  # every channel spread over the others, none kept alone


def _outlier_attention_error(bits, rotated):
    """Mean |attention(bits) - attention(fp32)| for a real head width (64) whose keys have one
    channel 10x the others and one offset channel, as real models' keys do."""
    gen = torch.Generator().manual_seed(5)
    dims = dict(n_layers=1, n_kv_heads=2, head_dim=64, n_blocks=16, block_size=16,
                dtype=torch.float32, device=torch.device("cpu"))
    pool, exact = PagedKV(**dims, bits=bits), PagedKV(**dims)
    if not rotated:
        pool.store.rotation = torch.eye(64)
    k = torch.randn(64, 2, 64, generator=gen)
    k[..., 3] *= 10
    k[..., 7] += 5
    v = torch.randn(64, 2, 64, generator=gen)
    q = torch.randn(64, 4, 64, generator=gen)
    rows = [(0, 0, 64)]
    outs = []
    for p in (pool, exact):
        assert p.reserve(rows)
        outs.append(p.begin_step(rows).attend(0, q, k, v, window=None, scale=64 ** -0.5, softcap=None))
    return (outs[0] - outs[1]).abs().mean().item()


@pytest.mark.parametrize("bits", [8, 4])
def test_rotation_cuts_the_error_an_outlier_channel_causes(bits):
    """One absmax scale per block and head: an outlier K channel leaves the others a few levels,
    unless the rows are rotated first (kv_quant's docstring)."""
    plain, rotated = _outlier_attention_error(bits, False), _outlier_attention_error(bits, True)
    print(f"\n{bits}-bit attention error with an outlier K channel: {plain:.4f} plain, {rotated:.4f} rotated")
    assert rotated < plain / 2


@pytest.mark.parametrize("bits", [0, 8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_token_matches_tensors(bits, dtype):
    pool = make_pool(bits, n_blocks=10, dtype=dtype)
    per_token = PagedKV.bytes_per_token(L, HK, D, dtype, bits, block_size=BS)
    assert pool.store.nbytes == per_token * pool.n_blocks * pool.block_size
    bf16 = PagedKV.bytes_per_token(L, HK, D, torch.bfloat16, 0)
    if bits:
        assert per_token < bf16 * (bits / 16 + 0.2)
    # a 128-wide head in 16-token blocks, as a real model has
    print(f"\nbits {bits}: {PagedKV.bytes_per_token(32, 8, 128, dtype, bits):.0f} bytes/token "
          f"vs {PagedKV.bytes_per_token(32, 8, 128, torch.bfloat16, 0):.0f} at bf16")


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reads_dequantize_only_the_step_blocks(bits, monkeypatch):
    """The transient buffer is the blocks a step reads, never the whole pool."""
    gen = torch.Generator().manual_seed(10)
    pool = make_pool(bits, n_blocks=64)
    import superfluid.plugins.basert.kv_quant as kq
    seen = []
    real = kq.dequantize

    def spy(codes, scale, b, dtype):
        seen.append(codes.shape[:-3].numel())
        return real(codes, scale, b, dtype)

    monkeypatch.setattr(kq, "dequantize", spy)
    run_step(pool, None, [(0, 0, 6), (1, 0, 1)], gen)
    assert seen and max(seen) <= 3   # the 3 blocks the step writes, 2 per row read; 64 in the pool
