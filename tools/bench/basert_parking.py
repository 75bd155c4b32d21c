"""What parking a lane costs on basert's paged pool: a park and its restore with the pages kept
in the pool (``Parking.keep``, what the engine does) against the same through a host copy
(``export`` then ``import_``, what a spilled entry costs), on SmolLM2-135M's KV shape in fp32.

    python -m tools.bench.basert_parking [--tokens 512,2048,8192] [--bits 0] [--reps 11] [--json PATH]

Each cycle parks a filled slot, clears it (the preempting lane takes the slot) and restores it;
the table shows the median cycle over ``--reps`` for each lane length, and the bytes a host copy
of that lane takes. The kept cycle also lets go of the entry, as a restore does when the tick took
it out of the parked set.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from .basert_kv_bits import markdown, write_json

SMOLLM2 = {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64}


def filled_pool(tokens: int, bits: int, shape: dict[str, int]):
    """A pool with slot 0 holding ``tokens`` positions of random KV, noted and hashed."""
    from superfluid.plugins.basert.kv_pool import PagedKV

    pool = PagedKV(**shape, n_blocks=-(-tokens // 16) * 2 + 2, block_size=16, dtype=torch.float32,
                   device=torch.device("cpu"), bits=bits)
    assert pool.reserve([(0, 0, tokens)])
    pool.note_tokens(0, 0, list(range(tokens)))
    pool.step_done([(0, 0, tokens)])
    for t in vars(pool.store).values():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.normal_()
        elif isinstance(t, torch.Tensor) and t.dtype in (torch.int8, torch.uint8):
            t.random_(0, 100)
    return pool


def median_ms(cycle: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cycle()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def one_length(tokens: int, bits: int, reps: int, shape: dict[str, int]) -> dict[str, Any]:
    pool = filled_pool(tokens, bits, shape)
    want = pool.parking.export(0)

    def host_copy():
        entry = pool.parking.export(0)
        pool.clear(0)
        assert pool.parking.import_(0, entry)

    def kept():
        entry = pool.parking.keep(0)
        pool.clear(0)
        assert pool.parking.import_(0, entry)
        pool.parking.forget(entry)

    host_ms, kept_ms = median_ms(host_copy, reps), median_ms(kept, reps)
    got = pool.parking.export(0)
    same = all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
    return {"tokens": tokens, "bytes": want.nbytes, "host_copy_ms": host_ms, "kept_ms": kept_ms,
            "ratio": host_ms / kept_ms if kept_ms else float("inf"), "kv_unchanged": same}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="512,2048,8192", help="lane lengths, comma-separated")
    ap.add_argument("--bits", type=int, default=0, choices=(0, 8, 4), help="KV width (0: fp32)")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 1-head, 8-wide shape (the tests)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = {"n_layers": 2, "n_kv_heads": 1, "head_dim": 8} if args.tiny else SMOLLM2
    rows = [one_length(int(n), args.bits, args.reps, shape) for n in args.tokens.split(",")]
    print(f"## Parking a lane on basert ({'tiny shape' if args.tiny else 'SmolLM2-135M KV'}, "
          f"{'fp32' if args.bits == 0 else f'{args.bits}-bit'} KV, median of {args.reps}, torch {torch.__version__})\n")
    print(markdown(["lane tokens", "host copy MB", "park + restore, host copy (ms)", "park + restore, kept (ms)",
                    "ratio", "KV unchanged"],
                   [[r["tokens"], f"{r['bytes'] / 1e6:.1f}", f"{r['host_copy_ms']:.2f}", f"{r['kept_ms']:.3f}",
                     f"{r['ratio']:.0f}x", "yes" if r["kv_unchanged"] else "NO"] for r in rows]))
    out = {"bits": args.bits, "rows": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
