"""basert's fixed-size decode attention (FlexAttention reading the pool's pages in place) against
the same dense reference as the gather path: decode rows padded up to a bucket, sliding windows
and soft-caps, shared prefix pages, rows whose window starts and ends in one block; the padding
rows write only the scratch block, and nothing else in the pool changes but the rows' own cells.

On the CPU FlexAttention runs unfused and evaluates the mask on every cell of the pool, so these
tests check the mask and the block lists' inputs; the compiled kernel, which reads only the
listed blocks, and the CUDA graphs over it are checked on a GPU by tools/gpu/check.py."""

from __future__ import annotations

import pytest
import torch

from superfluid.plugins.basert.decode_graph import DecodeGraphs, buckets_for
from superfluid.plugins.basert.kv_pool import PagedKV
from superfluid.plugins.basert.paged_decode import PagedDecode

from .test_basert_kv import BS, HK, HQ, D, L, SCALE, Dense, assert_close, run_step

torch.set_num_threads(1)


def scratch_pool(n_blocks: int = 64) -> PagedKV:
    return PagedKV(n_layers=L, n_kv_heads=HK, head_dim=D, n_blocks=n_blocks, block_size=BS,
                   dtype=torch.float32, device=torch.device("cpu"), scratch=True)


def decode_step(pool, ref, decode: PagedDecode, rows, gen, *, windows, softcap):
    """One decode step (every row one token) through ``decode`` and through the reference."""
    assert pool.reserve(rows)
    tables = pool.step_tables(rows)
    for slot, start, _ in rows:
        ref.truncate(slot, start)
    decode.load([0] * len(rows), [start for _, start, _ in rows], tables)
    decode.prepare()
    outs, refs = [], []
    for layer in range(L):
        q = torch.randn(decode.batch, HQ, D, generator=gen)
        k, v = torch.randn(decode.batch, HK, D, generator=gen), torch.randn(decode.batch, HK, D, generator=gen)
        out = decode.attend(layer, q, k, v, window=windows[layer], scale=SCALE, softcap=softcap)
        n = len(rows)
        outs.append(out[:n])
        refs.append(ref.step(rows, layer, q[:n], k[:n], v[:n], windows[layer], softcap))
    pool.step_done(rows)
    return outs, refs


@pytest.mark.parametrize("windows,softcap", [
    ((None, None), None),
    ((3, None), None),       # a window inside one block, then global
    ((6, 2), None),          # windows that start in an earlier block
    ((None, None), 2.0),
    ((5, None), 1.5),
])
def test_decode_rows_match_the_dense_reference(windows, softcap):
    gen = torch.Generator().manual_seed(0)
    pool, ref = scratch_pool(), Dense()
    run_step(pool, ref, [(0, 0, 9), (1, 0, 3), (2, 0, 4), (3, 0, 1)], gen, windows=windows, softcap=softcap)
    decode = PagedDecode(pool.store, batch=8, max_blocks=8, scratch=pool.scratch_block,
                         windows=set(windows), device=torch.device("cpu"))
    lengths = {0: 9, 1: 3, 2: 4, 3: 1}
    for step in range(6):  # rows cross block boundaries (BS = 4) at different steps
        rows = [(s, lengths[s], 1) for s in sorted(lengths) if not (step == 2 and s == 1)]
        outs, refs = decode_step(pool, ref, decode, rows, gen, windows=windows, softcap=softcap)
        assert_close(outs, refs)
        for s, start, _ in rows:
            lengths[s] = start + 1


def test_compiled_flex_reads_the_block_lists_and_matches_the_reference():
    """FlexAttention compiled by inductor (its C++ kernel here, Triton on CUDA): unlike the unfused
    reference it reads only the listed blocks, so this checks the lists as a kernel uses them, over
    windows that start and end in different blocks and steps that cross block boundaries. One
    compile (both layers share the window), about 15 s."""
    gen = torch.Generator().manual_seed(3)
    pool, ref = scratch_pool(), Dense()
    windows = (6, 6)
    run_step(pool, ref, [(0, 0, 11), (1, 0, 2), (2, 0, 7)], gen, windows=windows)
    decode = PagedDecode(pool.store, batch=4, max_blocks=8, scratch=pool.scratch_block, windows={6},
                         device=torch.device("cpu"), compiled=True)
    lengths = {0: 11, 1: 2, 2: 7}
    for _ in range(4):
        rows = [(s, lengths[s], 1) for s in sorted(lengths)]
        outs, refs = decode_step(pool, ref, decode, rows, gen, windows=windows, softcap=None)
        assert_close(outs, refs)
        for s, start, _ in rows:
            lengths[s] = start + 1
    # and it reads only the lists: the same step with the partial blocks struck off differs
    q, k, v = (torch.randn(4, h, D, generator=gen) for h in (HQ, HK, HK))
    listed = decode.attend(0, q, k, v, window=6, scale=SCALE, softcap=None)
    decode.masks[6].kv_num.zero_()
    struck = decode.attend(0, q, k, v, window=6, scale=SCALE, softcap=None)
    assert (listed[:3] - struck[:3]).abs().amax(dim=(1, 2)).min() > 1e-3


def test_shared_prefix_pages_are_read_by_both_rows():
    gen = torch.Generator().manual_seed(1)
    pool, ref = scratch_pool(), Dense()
    run_step(pool, ref, [(0, 0, 10)], gen)
    pool.share(0, 1, 8)       # two full blocks by reference
    ref.share(0, 1, 8)
    assert pool.block_table(1) == pool.block_table(0)[:2]
    decode = PagedDecode(pool.store, batch=4, max_blocks=8, scratch=pool.scratch_block, windows={None},
                         device=torch.device("cpu"))
    outs, refs = decode_step(pool, ref, decode, [(0, 10, 1), (1, 8, 1)], gen, windows=(None, None), softcap=None)
    assert_close(outs, refs)


def test_padding_rows_write_only_the_scratch_block():
    gen = torch.Generator().manual_seed(2)
    pool, ref = scratch_pool(n_blocks=16), Dense()
    run_step(pool, ref, [(0, 0, 5), (1, 0, 2)], gen)
    before = pool.store.data.clone()
    decode = PagedDecode(pool.store, batch=8, max_blocks=4, scratch=pool.scratch_block, windows={None},
                         device=torch.device("cpu"))
    decode_step(pool, ref, decode, [(0, 5, 1), (1, 2, 1)], gen, windows=(None, None), softcap=None)
    changed = (pool.store.data != before).any(dim=(0, 1, 4, 5))   # [block, offset] cells written
    written = {(b, o) for b, o in changed.nonzero().tolist()}
    own = {(pool.block_table(0)[1], 1), (pool.block_table(1)[0], 2)}  # positions 5 and 2
    assert written - {(pool.scratch_block, 0)} == own
    assert pool.scratch_block not in pool.block_table(0) + pool.block_table(1)


def test_a_row_that_does_not_fit_its_bucket_is_refused():
    pool = scratch_pool()
    decode = PagedDecode(pool.store, batch=2, max_blocks=2, scratch=pool.scratch_block, windows={None},
                         device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        decode.load([1, 2, 3], [0, 0, 0], [[0], [1], [2]])
    with pytest.raises(ValueError, match="position 9"):
        decode.load([1], [9], [[0, 1]])


def test_buckets_and_what_the_decoder_needs():
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(12) == [1, 2, 4, 8, 12]
    plain = PagedKV(n_layers=L, n_kv_heads=HK, head_dim=D, n_blocks=8, block_size=BS, dtype=torch.float32,
                    device=torch.device("cpu"))
    with pytest.raises(ValueError, match="scratch"):
        DecodeGraphs(None, plain, max_lanes=4, max_context=32, graphs=False)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(None, scratch_pool(), max_lanes=4, max_context=32, graphs=True)


@pytest.mark.parametrize("window", [None, 3, 6, 13])
def test_block_lists_name_exactly_the_blocks_each_row_reads(window):
    """What the compiled kernel reads: the partial blocks (masked) and the full ones (not): together
    every block holding a visible key, once, and every cell of a full block visible."""
    pool = scratch_pool()
    lengths = [1, 4, 5, 9, 16, 17]
    rows = [(s, 0, n) for s, n in enumerate(lengths)]
    assert pool.reserve(rows)
    tables = pool.step_tables(rows)
    decode = PagedDecode(pool.store, batch=8, max_blocks=8, scratch=pool.scratch_block, windows={window},
                         device=torch.device("cpu"))
    decode.load([0] * len(rows), [n - 1 for n in lengths], tables)
    decode.prepare()
    mask = decode.masks[window]
    for i, (n, table) in enumerate(zip(lengths, tables)):
        pos = n - 1
        first = 0 if window is None else max(0, pos - window + 1)
        want = {table[p // BS] for p in range(first, pos + 1)}
        partial = mask.kv_idx[i, 0, 0, :int(mask.kv_num[i, 0, 0])].tolist()
        full = mask.full_idx[i, 0, 0, :int(mask.full_num[i, 0, 0])].tolist()
        assert len(partial) + len(full) == len(want) and set(partial) | set(full) == want
        visible = mask.block_mask.mask_mod
        for block in full:
            cells = torch.arange(block * BS, (block + 1) * BS)
            assert visible(torch.tensor(i), 0, 0, cells).all()
