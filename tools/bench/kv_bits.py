"""What ``--kv-bits 8|4`` saves and costs on any engine, through the real server.

    python -m tools.bench.kv_bits [--engine llamacpp] [--model PATH] [--bits 0,8,4]
        [--budget-mib 1024] [--max-context 2048] [--requests 8] [--tokens 64] [--json PATH]

For each width it starts ``superfluid serve --engine E --kv-bits B`` (``--max-batch`` =
``--requests``), and reports:

(a) memory: the bytes one cell takes (``/health``'s ``kv_pool.bytes_per_cell``, the figure the
    engine sized its pool with), bytes per lane (cell × ``--max-context``), and the largest
    ``--max-batch`` at each context that fits ``--budget-mib`` of KV (an engine's spare sequences,
    llama.cpp's two beyond the lanes in per-sequence buffers, are counted against the budget);
(b) speed: ``--requests`` concurrent greedy completions of ``--tokens`` tokens, completion tokens
    per second of wall time, against the first width in ``--bits`` (0: full width) in this run;
(c) agreement: each greedy reply against the reference at the same KV type (llama.cpp:
    llama-cpp-python's own ``Llama(type_k=..., type_v=..., flash_attn=True)``; ``--reference
    none`` or another engine: the full-width server's replies), as identical replies and the
    mean share of the reference's characters before the first difference.

Speed numbers need a quiet machine; on a shared one they say only that the path runs."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

PROMPTS = [
    "<|im_start|>user\nWrite a short poem about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a compiler does.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nGive me three tips for learning Python.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the difference between a list and a tuple?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "The three primary colors are",
]
CONTEXTS = (2048, 4096, 8192, 16384, 32768)
MIB = 1 << 20


def post(base: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())


def pool_figures(health_model: dict, max_context: int) -> dict:
    """Bytes per cell and the spare sequences from a model's ``/health`` entry (``kv_pool`` where
    the engine reports one; else its top-level ``bytes_per_cell``, or ``kv_bytes`` over blocks)."""
    pool = health_model.get("kv_pool") or {}
    per_cell = pool.get("bytes_per_cell") or health_model.get("bytes_per_cell")
    if not per_cell and health_model.get("kv_bytes") and health_model.get("kv_blocks"):
        per_cell = health_model["kv_bytes"] // (health_model["kv_blocks"] * health_model.get("block_size", 1))
    spares = 0 if pool.get("shared") else max(0, int(health_model.get("n_seq_max", 0)) - int(health_model.get("lanes", 0) or 0))
    return {"bytes_per_cell": int(per_cell or 0), "bytes_per_lane": int(per_cell or 0) * max_context,
            "kv_bytes": health_model.get("kv_bytes"), "type": (pool.get("shape") or {}).get("type_k"),
            "spare_sequences": spares}


def lanes_within(budget: int, bytes_per_cell: int, context: int, spares: int) -> int:
    """The most lanes of ``context`` tokens whose KV (with ``spares`` sequences beside them) fits."""
    if bytes_per_cell <= 0:
        return 0
    return max(0, budget // (bytes_per_cell * context) - spares)


def greedy(base: str, prompts: list[str], tokens: int, concurrent: int) -> tuple[dict, float, int]:
    """({prompt: text}, wall seconds, completion tokens) for every prompt at once."""
    def one(p):
        out = post(base, "/v1/completions", {"model": "smollm2", "prompt": p, "max_tokens": tokens,
                                             "temperature": 0})
        return p, out["choices"][0]["text"], out["usage"]["completion_tokens"]

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrent) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    return {p: t for p, t, _ in results}, wall, sum(n for _, _, n in results)


def llama_reference(model: str, prompts: list[str], tokens: int, bits: int) -> dict:
    """llama-cpp-python's own greedy replies at ``bits``' cache types (flash attention on)."""
    from superfluid.plugins.llamacpp.context_params import GGML_TYPES, KV_TYPES
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    kv = GGML_TYPES[KV_TYPES[bits]]
    llm = reference_llama(model, n_ctx=2048, flash_attn=True, type_k=kv, type_v=kv, verbose=False, seed=0)
    try:
        return {p: llm.create_completion(p, max_tokens=tokens, temperature=0.0, repeat_penalty=1.0)
                ["choices"][0]["text"] for p in prompts}
    finally:
        llm.close()


def agreement(replies: dict, reference: dict) -> dict:
    def shared(a: str, b: str) -> float:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(1, len(b))
    return {"identical": sum(replies[p] == reference[p] for p in reference), "of": len(reference),
            "mean_shared_prefix": round(sum(shared(replies[p], reference[p]) for p in reference) / len(reference), 3)}


def start_server(engine: str, model: str, bits: int, lanes: int, context: int, logs: Path, extra: list[str]):
    from tools.suite.targets import Server, free_port

    port = free_port()
    cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--model-name", "smollm2", "--engine", engine, "--max-batch", str(lanes),
           "--max-context", str(context), "--kv-bits", str(bits), *extra]
    return Server(f"superfluid-{engine}-kv{bits}", cmd, logs / f"{engine}-kv{bits}.log", "/health")


def run(args) -> dict:
    from superfluid.core.default_model import default_model_path

    model = args.model or default_model_path()
    bits_list = [int(b) for b in args.bits.split(",")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    unique = list(dict.fromkeys(prompts))
    budget = args.budget_mib * MIB
    logs = Path(args.logs or tempfile.mkdtemp(prefix="kv_bits_"))
    rows, full_replies = [], None
    for bits in bits_list:
        server = start_server(args.engine, model, bits, args.requests, args.max_context, logs, args.server_arg)
        try:
            health = get(server.base, "/health")["models"]["smollm2"]
            health.setdefault("lanes", args.requests)
            figures = pool_figures(health, args.max_context)
            greedy(server.base, unique[:1], 4, 1)  # warm-up
            replies, wall, produced = greedy(server.base, prompts, args.tokens, args.requests)
        finally:
            server.stop()
        if full_replies is None:
            full_replies = replies
        use_llama = args.reference == "llama" or (args.reference == "auto" and args.engine == "llamacpp")
        reference = llama_reference(model, unique, args.tokens, bits) if use_llama else full_replies
        rows.append({"bits": bits, **figures, "fits": {c: lanes_within(budget, figures["bytes_per_cell"], c,
                                                                      figures["spare_sequences"]) for c in CONTEXTS},
                     "tokens_per_s": round(produced / wall, 2), "wall_s": round(wall, 2),
                     "completion_tokens": produced, "reference": "llama" if use_llama else "full-width server",
                     "agreement": agreement(replies, reference)})
    base = rows[0]["tokens_per_s"] or 1.0
    for row in rows:
        row["speed_vs_first"] = round(row["tokens_per_s"] / base, 3)
    return {"engine": args.engine, "model": model, "budget_mib": args.budget_mib, "max_context": args.max_context,
            "requests": args.requests, "tokens": args.tokens, "rows": rows, "logs": str(logs)}


def markdown(result: dict) -> str:
    rows = result["rows"]
    out = [f"engine {result['engine']}, {result['requests']} concurrent greedy requests of {result['tokens']} tokens, "
           f"max-context {result['max_context']}, budget {result['budget_mib']} MiB of KV", "",
           "| kv-bits | type | bytes/cell | bytes/lane | " + " | ".join(f"lanes @ {c}" for c in CONTEXTS)
           + " | tokens/s | vs first | identical | shared prefix |",
           "|---|---|---|---|" + "---|" * len(CONTEXTS) + "---|---|---|---|"]
    for r in rows:
        a = r["agreement"]
        out.append(f"| {r['bits']} | {r['type'] or '?'} | {r['bytes_per_cell']} | {r['bytes_per_lane'] / MIB:.1f} MiB | "
                   + " | ".join(str(r["fits"][c]) for c in CONTEXTS)
                   + f" | {r['tokens_per_s']} | {r['speed_vs_first']}x | {a['identical']}/{a['of']} | "
                   f"{a['mean_shared_prefix']:.0%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="llamacpp")
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--bits", default="0,8,4", help="widths to run, the first is the speed baseline")
    ap.add_argument("--budget-mib", type=int, default=1024, help="the KV memory budget the fit table uses")
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests (and --max-batch)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    ap.add_argument("--reference", choices=("auto", "llama", "none"), default="auto",
                    help="auto: llama-cpp-python's Llama for llamacpp, the full-width server's replies otherwise")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for every server")
    ap.add_argument("--logs", default=None, help="directory for the servers' logs")
    ap.add_argument("--json", default=None, help="write the result here too")
    args = ap.parse_args(argv)
    result = run(args)
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
