"""basert's GPU check: random-weight models of real shapes, driven tick by tick through basert's
own runner, with the memory-bandwidth roofline beside every figure.

Weights cannot travel to a lent GPU machine, so the models are Llama-3.2-1B and Llama-3.1-8B
shapes with random bf16 weights: the arithmetic and memory traffic of the real models, not their
text. For each shape and lane count (512-token prompts, 256-token replies by default) it reports
aggregate tok/s (every generated token over the whole run), decode tok/s, TTFT (prefill in
ticks that end at a first token, as the scheduler runs them) with and without ``--speculate``
and ``--kv-bits 8``, and a plain PyTorch loop over contiguous caches (no paging) at the largest
lane count as the figure from the same run to compare against. The roofline is the batch-1
decode bound: measured device copy bandwidth over the bytes one token must read (every weight
but the embedding table, plus the KV of the context).

Decode-only steps run as basert's default runs them on the device (on CUDA: FlexAttention on the
pages, CUDA graphs), and on CUDA also on the gather path (``--attention sdpa``) and as flex
without graphs: the measurement that chooses the kernel. Before the table, one decode step of 8
lanes is computed both ways on the same pages, and its logits compared: a captured graph that
computed something else would show there.

    python tools/gpu/check.py                       # on a GPU machine: both shapes, under 8 minutes
    python tools/gpu/check.py --tiny --device cpu   # the same code on a tiny shape, in seconds

It needs only torch and superfluid's core (numpy, pluggy, attrs, psutil; no llama-cpp-python, no
model file); ``tools/gpu/run.sh`` runs it from a checkout that is not installed."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from superfluid.core.request import SamplingParams
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import LanePlan, TickPlan
from superfluid.plugins.basert.decode_graph import DecodeGraphs
from superfluid.plugins.basert.dense_attention import DenseAttention
from superfluid.plugins.basert.device import resolve_decode
from superfluid.plugins.basert.kv_pool import PagedKV
from superfluid.plugins.basert.model import random_model
from superfluid.plugins.basert.runner import BasertRunner
from superfluid.plugins.basert.shape import ModelShape

LLAMA_3_2_1B = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "num_hidden_layers": 16,
                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                "tie_word_embeddings": True,
                "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
LLAMA_3_1_8B = {**LLAMA_3_2_1B, "hidden_size": 4096, "num_hidden_layers": 32, "head_dim": 128,
                "intermediate_size": 14336, "tie_word_embeddings": False,
                "rope_scaling": {**LLAMA_3_2_1B["rope_scaling"], "factor": 8.0}}
TINY = {**LLAMA_3_2_1B, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position_embeddings": 4096}
SHAPES = {"llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B, "tiny": TINY}
GREEDY = SamplingParams(temperature=0.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Bytes per second of a device-to-device copy (read + write), the roofline's bandwidth."""
    n = megabytes * 2**20 // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * reps / (time.perf_counter() - t0)


def bytes_per_decode_token(shape: ModelShape, dtype: torch.dtype, context: int, kv_bits: int) -> float:
    """What one batch-1 decode step must read: every weight but the embedding table's unused rows
    (a tied table is read whole, as the head), plus the context's K and V."""
    bpv = torch.finfo(dtype).bits / 8
    weights = shape.weight_bytes(bpv)
    if not shape.tie_embeddings:
        weights -= shape.vocab_size * shape.hidden_size * bpv
    kv = PagedKV.bytes_per_token(shape.n_layers, shape.n_kv_heads, shape.head_dim, dtype, kv_bits) * context
    return weights + kv


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase (prompt lookup then has something to find)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        phrase = torch.randint(3, vocab, (32,), generator=g).tolist()
        out.append((phrase * (length // 32 + 1))[:length])
    return out


class Pools:
    """One KV pool (and its decoder) per KV width and decode mode, sized for the most lanes and
    reused by every run of a shape: FlexAttention compiles once per bucket and the graphs are
    captured once (``setup_s`` says how long that took)."""

    def __init__(self, model, device, dtype, max_lanes: int, context: int) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.max_lanes, self.context = max_lanes, context
        self.made: dict[tuple[int, str], tuple[PagedKV, DecodeGraphs | None]] = {}
        self.setup_s: dict[str, float] = {}

    def get(self, bits: int, mode: str) -> tuple[PagedKV, DecodeGraphs | None]:
        key = (bits, mode)
        if key not in self.made:
            shape, block = self.model.shape, 16
            pool = PagedKV(n_layers=shape.n_layers, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
                           n_blocks=self.max_lanes * -(-self.context // block), block_size=block,
                           dtype=self.dtype, device=self.device, bits=bits, scratch=mode != "sdpa")
            decoder = None
            if mode != "sdpa":
                t0 = time.perf_counter()
                decoder = DecodeGraphs(self.model, pool, max_lanes=self.max_lanes, max_context=self.context,
                                       graphs=mode == "graphs")
                with torch.inference_mode():
                    decoder.warm_up()
                sync(self.device)
                self.setup_s[mode] = time.perf_counter() - t0
            self.made[key] = (pool, decoder)
        return self.made[key]


def run_paged(model, device, lanes: int, prompt: int, reply: int, *, speculate: int, pool: PagedKV,
              decoder: DecodeGraphs | None) -> dict:
    """Prefill every lane (ticks that end at a first token) then decode them all, through basert's
    runner on a paged pool; the figures of one run. The pool is left empty."""
    shape = model.shape
    runner = BasertRunner(model, pool, set(), StopFlag(), device=device, speculate=speculate,
                          step_tokens=max(512, min(8192, lanes * prompt)), decoder=decoder)
    feeds = prompts(lanes, prompt, shape.vocab_size)
    pos = {s: 0 for s in range(lanes)}
    last: dict[int, int] = {}
    ttft: list[float] = []
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        while len(last) < lanes:
            plans = [LanePlan(slot=s, pos=pos[s], feed=feeds[s][pos[s]:], sample=True, max_new=1,
                              reset=pos[s] == 0, sampling=GREEDY, ignore_eos=True)
                     for s in range(lanes) if s not in last]
            res = runner.run(TickPlan(lanes=plans, end_after_first_token=True))
            sync(device)
            now = time.perf_counter() - t0
            for lp in plans:
                lr = res.lanes[lp.slot]
                pos[lp.slot] += lr.n_fed
                if lr.tokens:
                    last[lp.slot] = lr.tokens[-1]
                    ttft.append(now)
        t_prefill = time.perf_counter() - t0
        plans = [LanePlan(slot=s, pos=pos[s], feed=[last[s]], sample=True, max_new=reply - 1, decode=True,
                          sampling=GREEDY, ignore_eos=True) for s in range(lanes)]
        t1 = time.perf_counter()
        res = runner.run(TickPlan(lanes=plans))
        sync(device)
    t_decode = time.perf_counter() - t1
    for s in range(lanes):
        pool.clear(s)
    generated = sum(len(lr.tokens) for lr in res.lanes.values())
    drafted = sum(s.drafted for s in res.steps)
    accepted = sum(s.accepted for s in res.steps)
    return {"aggregate": (generated + lanes) / (t_prefill + t_decode), "decode": generated / t_decode,
            "ttft_p50": statistics.median(ttft), "ttft_max": max(ttft),
            "acceptance": accepted / drafted if drafted else None}


def decode_agreement(model, device, pool: PagedKV, decoder: DecodeGraphs, lanes: int = 8,
                     prompt: int = 64) -> tuple[float, int, int]:
    """One decode step of ``lanes`` lanes on the same pages, on the gather path and through
    ``decoder``: (max |logit difference|, rows whose argmax agrees, rows)."""
    lanes = min(lanes, decoder.max_rows)
    feeds = prompts(lanes, prompt, model.shape.vocab_size, seed=1)
    rows = [(s, 0, prompt) for s in range(lanes)]
    with torch.inference_mode():
        assert pool.reserve(rows)
        flat = torch.tensor([t for f in feeds for t in f], device=device)
        positions = torch.arange(prompt, device=device).repeat(lanes)
        model(flat, positions, pool.begin_step(rows))
        step = [(s, prompt, 1) for s in range(lanes)]
        tokens, at = [f[0] for f in feeds], [prompt] * lanes
        out = []
        for path in ("gather", "decoder"):
            for s in range(lanes):
                pool.truncate(s, prompt)
            assert pool.reserve(step)
            if path == "gather":
                hidden = model(torch.tensor(tokens, device=device), torch.tensor(at, device=device),
                               pool.begin_step(step))
            else:
                hidden = decoder.hidden(tokens, at, pool.step_tables(step))
                pool.step_done(step)
            out.append(model.logits(hidden))
        sync(device)
    for s in range(lanes):
        pool.clear(s)
    diff = float((out[0] - out[1]).abs().max())
    agree = int((out[0].argmax(-1) == out[1].argmax(-1)).sum())
    return diff, agree, lanes


def run_dense(model, shape, device, dtype, lanes: int, prompt: int, reply: int) -> dict:
    """The same work as a plain PyTorch loop: contiguous per-sequence caches, each prompt
    prefilled whole, then batched greedy decode steps; no paging, no scheduler."""
    attn = DenseAttention(shape, lanes, prompt + reply, device, dtype)
    feeds = prompts(lanes, prompt, shape.vocab_size)
    sync(device)
    t0 = time.perf_counter()
    last = []
    with torch.inference_mode():
        for s in range(lanes):
            attn.begin([(s, 0, prompt)])
            h = model(torch.tensor(feeds[s], device=device), torch.arange(prompt, device=device), attn)
            last.append(int(model.logits(h[-1:]).argmax(-1)))
        t_prefill = time.perf_counter() - t0
        tokens = torch.tensor(last, device=device)
        for step in range(reply - 1):
            p = prompt + step
            attn.begin([(s, p, 1) for s in range(lanes)])
            h = model(tokens, torch.full((lanes,), p, device=device), attn)
            tokens = model.logits(h).argmax(-1)
        sync(device)
    t_total = time.perf_counter() - t0
    return {"aggregate": lanes * reply / t_total, "decode": lanes * (reply - 1) / (t_total - t_prefill),
            "ttft_p50": None, "ttft_max": t_prefill, "acceptance": None}


def fmt(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def variants(device: torch.device, speculate: int) -> list[tuple[str, str, int, int, set | None]]:
    """(label, decode mode, speculate, kv bits, lane counts or None for all): basert as it runs by
    default on ``device`` first, then, on CUDA, the decode kernels it chose between."""
    default, graphs = resolve_decode("auto", "auto", device, 0, "check")
    mode = "graphs" if graphs else default
    out = [("basert", mode, 0, 0, None), ("basert --speculate", mode, speculate, 0, None),
           ("basert --kv-bits 8", "sdpa", 0, 8, None)]
    if device.type == "cuda":
        out += [("basert --attention sdpa", "sdpa", 0, 0, None),
                ("basert --cuda-graphs off", "flex", 0, 0, {1, 8, 64})]
    else:
        out += [("basert --attention flex", "flex", 0, 0, None)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape only (tests, CPU)")
    ap.add_argument("--lanes", default="1,8,32,64,128")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reply", type=int, default=256)
    ap.add_argument("--speculate", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=450.0, help="stop starting runs after this long")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    names = ["tiny"] if args.tiny else args.shapes.split(",")
    lane_counts = [int(x) for x in args.lanes.split(",")]
    context = args.prompt + args.reply + 32
    started = time.perf_counter()
    bw = copy_bandwidth(device, 64 if args.tiny else 2048)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"# basert GPU check on {name}, torch {torch.__version__}, {args.dtype}, prompts {args.prompt}, "
          f"replies {args.reply}; copy bandwidth {bw / 1e12:.2f} TB/s")
    table = ["| shape | lanes | variant | aggregate tok/s | decode tok/s | TTFT p50 s | TTFT max s | accept | "
             "batch-1 roofline tok/s | decode / roofline (batch 1) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape_name in names:
        shape = ModelShape.from_hf_config(SHAPES[shape_name], name=shape_name)
        model = random_model(shape, device=device, dtype=dtype)
        pools = Pools(model, device, dtype, max(lane_counts), context)
        todo = variants(device, args.speculate)
        for mode in dict.fromkeys(m for _, m, _, _, _ in todo):
            if mode == "sdpa":
                continue
            try:
                pool, decoder = pools.get(0, mode)
                diff, agree, n = decode_agreement(model, device, pool, decoder, prompt=min(64, context - 1))
            except Exception as exc:  # a kernel that fails to compile or capture costs its rows, not the check
                print(f"# {shape_name}: decode {mode} FAILED: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
                todo = [v for v in todo if v[1] != mode]
                pools.made.pop((0, mode), None)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            print(f"# {shape_name}: decode {mode} ready in {pools.setup_s[mode]:.1f} s; one decode step of "
                  f"{n} lanes against the gather path: max |logit difference| {diff:.3g}, argmax agrees "
                  f"{agree}/{n}", flush=True)
        # warm-up: kernels, allocator and caches, so the first row is not paying for them
        for _, mode, spec, bits, _ in todo:
            pool, decoder = pools.get(bits, mode)
            run_paged(model, device, 2, min(args.prompt, 64), 4, speculate=spec, pool=pool, decoder=decoder)
        for lanes in lane_counts:
            for label, mode, spec, bits, only in todo:
                if only is not None and lanes not in only:
                    continue
                if time.perf_counter() - started > args.budget_s:
                    table.append(f"| {shape_name} | {lanes} | {label} | skipped: past --budget-s | | | | | | |")
                    continue
                pool, decoder = pools.get(bits, mode)
                r = run_paged(model, device, lanes, args.prompt, args.reply, speculate=spec, pool=pool,
                              decoder=decoder)
                roof = bw / bytes_per_decode_token(shape, dtype, args.prompt + args.reply // 2, bits)
                share = f"{r['decode'] / roof:.0%}" if lanes == 1 else ""
                table.append(f"| {shape_name} | {lanes} | {label} | {fmt(r['aggregate'])} | {fmt(r['decode'])} | "
                             f"{fmt(r['ttft_p50'], '.3f')} | {fmt(r['ttft_max'], '.3f')} | "
                             f"{fmt(r['acceptance'], '.2f')} | {roof:.0f} | {share} |")
                print(table[-1], flush=True)
        dense_lanes = 64 if 64 in lane_counts else max(lane_counts)
        if time.perf_counter() - started <= args.budget_s:
            del pools
            r = run_dense(model, shape, device, dtype, dense_lanes, args.prompt, args.reply)
            table.append(f"| {shape_name} | {dense_lanes} | plain PyTorch loop, no paging | {fmt(r['aggregate'])} | "
                         f"{fmt(r['decode'])} | - | {fmt(r['ttft_max'], '.3f')} | - | | |")
            print(table[-1], flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(table))
    print(f"# done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
