"""What ``--kv-bits 8|4`` costs and saves on basert: KV memory, perplexity and greedy agreement
against full-width KV, on SmolLM2-135M-Instruct (the default model) on the CPU in fp32.

    python -m tools.bench.basert_kv_bits [--model PATH.gguf] [--tokens 64] [--chunk 64] [--json PATH]

Three tables:

(a) memory: device bytes one token's K and V take in every layer (``PagedKV.bytes_per_token``,
    scales included) and how many tokens a 1 GiB pool holds, for full width in fp32 (what runs
    here) and bf16 (what CUDA runs; its figures follow from the same formula, nothing is measured
    there), 8 and 4 bits. Quantized blocks store codes and scales whatever the compute dtype.
(b) perplexity of a fixed English passage (embedded below, ~600 tokens) scored with prompt
    logprobs through the tick runner in ``--chunk``-token steps, so every step's attention reads
    the earlier tokens back from the (quantized) pool, as a long prompt's prefill does.
(c) greedy agreement: 16 fixed ChatML prompts, ``--tokens`` greedy tokens each with 8 and 4
    bits against full width: tokens identical before the first divergence (mean, min) and how
    many prompts are identical throughout. The lanes run batched (the runner's tests check that
    batched lanes give each lane's own tokens).

A divergence is not by itself an error: a narrower KV moves the logits a little, and where the
top two are close greedy decoding takes the other branch. Perplexity says how much worse the
model predicts text; agreement says how soon the text changes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Sequence

import torch

from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, TickPlan

GREEDY = SamplingParams(temperature=0.0)
BITS = (0, 8, 4)
GIB = 1 << 30

PASSAGE = """\
The lighthouse on the northern cape was built in the winter of a year that nobody in the village
remembers clearly any more. The older fishermen say it took three months, the younger ones say
six, and the records that might settle the question were lost when the harbour office flooded.
What everyone agrees on is that the keeper who lived there for the longest time was a woman
named Agnes, who arrived with two trunks of books and a cat, and who stayed for forty-one years.

Agnes kept a logbook. Every evening she wrote down the weather, the ships she had seen, the state
of the lamp and the number of birds that had struck the glass. Most entries are short and plain:
wind from the west, rain after noon, two trawlers heading south, lamp cleaned, no birds. But now
and then she wrote more, and those pages are the reason the logbook is kept in the museum today.
She described the colour of the sea before a storm, a grey that was almost green, and the silence
of the gulls an hour before the wind arrived. She noted when the first swallows came back each
spring and when the last ones left in autumn, and over four decades those dates drifted, slowly
but clearly, by almost two weeks.

Scientists who study the climate of the coast have used her notes to check their models. A
measurement taken by one careful person at the same place and the same hour for forty years is
rare, and it turns out to be worth more than many scattered readings taken with better tools.
The lesson they draw from it is a simple one: consistency matters more than precision when you
want to see a slow change. A thermometer that is half a degree wrong is still useful if it is
always wrong in the same way, because the trend survives the error.

The village has changed since Agnes died. The fishing fleet is smaller, the cannery closed, and
the harbour now holds more sailing boats than working ones. In summer the streets fill with
visitors who walk up the cape to photograph the lighthouse, which has been automatic for many
years and no longer needs a keeper. A small electric lamp turns inside the old lens, and a
computer in a city two hundred miles away reports when the bulb fails. Nobody counts the birds.

Some people in the village think this is a loss, and some think it is simply how things go. The
school teacher, who has read the whole logbook, tells her pupils that the point is not the
lighthouse or the lamp but the habit of paying attention. Each autumn she asks them to choose one
thing they can see from their window, a tree, a roof, a patch of sky, and to write one line about
it every day until the summer. Most of them give up by Christmas. A few keep going, and every
year one or two of them are surprised by what they find: the tree that loses its leaves in the
same week each year, the roof where the snow melts first, the hour at which the light comes back
in February. They learn, as Agnes did, that the world changes quietly, and that the only way to
notice is to look at the same thing for a long time and write down what you see.
"""

CHAT_PROMPTS = (
    "What is the capital of Australia?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "Give me three tips for sleeping better.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and French.",
    "Write a Python function that reverses a string.",
    "Why is the sky blue?",
    "Name five fruits that are red.",
    "Summarize the plot of Romeo and Juliet.",
    "What are the primary colors?",
    "How do I make a cup of tea?",
    "List the planets of the solar system in order.",
    "What does a CPU do?",
    "Write a short poem about autumn leaves.",
    "Tell me a fun fact about octopuses.",
)


def chat(text: str) -> str:
    """A one-turn ChatML prompt (SmolLM2-Instruct's template) ready for the assistant's reply."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def load(model_path: str | None, dtype: torch.dtype = torch.float32):
    """The model and its tokenizer on the CPU (the default model unless ``model_path``)."""
    from superfluid.core.default_model import default_model_path
    from superfluid.plugins.basert import model as models
    from superfluid.plugins.vocab import GGUFVocab

    path = model_path or default_model_path()
    return models.load(path, name="bench", device=torch.device("cpu"), dtype=dtype), GGUFVocab(path, "bench")


def make_runner(model, *, bits: int = 0, speculate: int = 0, step_tokens: int = 512, n_blocks: int = 1024,
                dtype: torch.dtype = torch.float32, constrainer=None):
    """A tick runner over a fresh paged pool (``bits`` 0: full width in ``dtype``); ``constrainer``
    for lanes held to a grammar."""
    from superfluid.core.stop_flag import StopFlag
    from superfluid.plugins.basert.kv_pool import PagedKV
    from superfluid.plugins.basert.runner import BasertRunner

    s = model.shape
    cpu = torch.device("cpu")
    pool = PagedKV(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, n_blocks=n_blocks,
                   block_size=16, dtype=dtype, device=cpu, bits=bits)
    return BasertRunner(model, pool, set(), StopFlag(), device=cpu, speculate=speculate, step_tokens=step_tokens,
                        constrainer=constrainer)


def generate(runner, prompts: Sequence[Sequence[int]], n: int, grant: int,
             sampling: SamplingParams = GREEDY) -> tuple[list[list[int]], float]:
    """``n`` tokens for every prompt (greedy unless ``sampling`` says otherwise), all lanes in
    the same ticks, as the scheduler plans them: one tick prefills and samples the first token,
    then decode ticks of ``grant`` rounds. Returns the tokens and the seconds the decode ticks
    took (the prefill tick is not timed)."""
    out: list[list[int]] = [[] for _ in prompts]
    pos = [0] * len(prompts)
    plans = [LanePlan(slot=s, pos=0, feed=list(p), sample=True, max_new=1, reset=True, sampling=sampling,
                      ignore_eos=True) for s, p in enumerate(prompts)]
    decode_s = 0.0
    first = True
    with torch.inference_mode():
        while plans:
            t0 = time.perf_counter()
            res = runner.run(TickPlan(lanes=plans))
            if not first:
                decode_s += time.perf_counter() - t0
            first = False
            nxt = []
            for lp in plans:
                lr = res.lanes[lp.slot]
                out[lp.slot] += lr.tokens
                pos[lp.slot] += lr.n_fed
                left = n - len(out[lp.slot])
                if left > 0:
                    nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=[out[lp.slot][-1]], sample=True,
                                        max_new=min(grant, left), decode=True, ignore_eos=True))
            plans = nxt
    return [o[:n] for o in out], decode_s


def memory_rows(model) -> list[dict[str, Any]]:
    """Table (a): bytes per token and tokens per GiB for full width (fp32, bf16) and 8/4 bits."""
    from superfluid.plugins.basert.kv_pool import PagedKV

    s = model.shape
    geo = dict(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim)
    fp32 = PagedKV.bytes_per_token(**geo, dtype=torch.float32, bits=0)
    bf16 = PagedKV.bytes_per_token(**geo, dtype=torch.bfloat16, bits=0)
    rows = []
    for label, bits, dtype in (("full fp32", 0, torch.float32), ("full bf16", 0, torch.bfloat16),
                               ("8-bit", 8, torch.float32), ("4-bit", 4, torch.float32)):
        b = PagedKV.bytes_per_token(**geo, dtype=dtype, bits=bits)
        rows.append({"kv": label, "bits": bits, "bytes_per_token": b, "tokens_per_gib": int(GIB // b),
                     "vs_fp32": fp32 / b, "vs_bf16": bf16 / b})
    return rows


def perplexity(model, tokens: list[int], bits: int, chunk: int) -> tuple[float, float]:
    """Perplexity of ``tokens`` (each scored given all before it) with a ``bits`` pool, the
    prompt fed ``chunk`` tokens a step; and the mean negative logprob (nats per token)."""
    runner = make_runner(model, bits=bits, step_tokens=chunk, n_blocks=len(tokens) // 16 + 4)
    with torch.inference_mode():
        res = runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(tokens), sample=False, reset=True,
                                                  sampling=GREEDY, targets=list(tokens[1:]), score_top=0)]))
    scores = res.lanes[0].prompt_logprobs
    if len(scores) != len(tokens) - 1:
        raise RuntimeError(f"{len(scores)} prompt logprobs for {len(tokens)} tokens")
    nll = -sum(e.logprob for e in scores) / len(scores)
    return math.exp(nll), nll


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens agree before the first difference (the common length if none)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(model, prompts: list[list[int]], n: int, grant: int) -> tuple[list[dict[str, Any]], dict]:
    """Table (c): greedy tokens with 8 and 4 bits against full width, per prompt and in sum."""
    full, _ = generate(make_runner(model, bits=0), prompts, n, grant)
    rows = []
    detail = {}
    for bits in (8, 4):
        narrow, _ = generate(make_runner(model, bits=bits), prompts, n, grant)
        agree = [first_divergence(f, q) for f, q in zip(full, narrow)]
        rows.append({"bits": bits, "mean_agree": sum(agree) / len(agree), "min_agree": min(agree),
                     "identical": sum(a == n for a in agree), "prompts": len(prompts), "tokens": n})
        detail[bits] = agree
    return rows, detail


def markdown(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | None, results: dict[str, Any]) -> None:
    """The results as JSON at ``path`` (``--json``), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path (default: the default model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per chat prompt")
    ap.add_argument("--prompts", type=int, default=len(CHAT_PROMPTS), help="how many of the 16 chat prompts")
    ap.add_argument("--chunk", type=int, default=64, help="prompt tokens per step when scoring the passage")
    ap.add_argument("--passage-tokens", type=int, default=0, help="score only this many passage tokens (0: all)")
    ap.add_argument("--grant", type=int, default=16, help="decode rounds per tick")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, vocab = load(args.model)

    mem = memory_rows(model)
    print(f"## (a) KV memory ({args.model or 'SmolLM2-135M-Instruct'}: {model.shape.n_layers} layers, "
          f"{model.shape.n_kv_heads} KV heads x {model.shape.head_dim})\n")
    print(markdown(["KV", "bytes/token", "tokens in 1 GiB", "x vs fp32", "x vs bf16"],
                   [[r["kv"], f"{r['bytes_per_token']:.0f}", f"{r['tokens_per_gib']:,}", f"{r['vs_fp32']:.2f}",
                     f"{r['vs_bf16']:.2f}"] for r in mem]))

    passage = vocab.tokenize(PASSAGE, True, True)
    if args.passage_tokens:
        passage = passage[:args.passage_tokens]
    ppl = []
    for bits in BITS:
        p, nll = perplexity(model, passage, bits, args.chunk)
        ppl.append({"bits": bits, "ppl": p, "nll": nll})
    base = ppl[0]["ppl"]
    print(f"\n## (b) perplexity of the fixed passage ({len(passage)} tokens, {args.chunk} a step)\n")
    print(markdown(["KV", "perplexity", "nats/token", "Δ vs full"],
                   [[("full fp32" if r["bits"] == 0 else f"{r['bits']}-bit"), f"{r['ppl']:.4f}", f"{r['nll']:.5f}",
                     f"{(r['ppl'] / base - 1) * 100:+.3f}%"] for r in ppl]))

    prompts = [vocab.tokenize(chat(t), True, True) for t in CHAT_PROMPTS[:args.prompts]]
    agree, detail = agreement(model, prompts, args.tokens, args.grant)
    print(f"\n## (c) greedy agreement with full-width KV ({len(prompts)} chat prompts, {args.tokens} tokens each)\n")
    print(markdown(["KV", "agree before 1st divergence: mean", "min", "identical prompts"],
                   [[f"{r['bits']}-bit", f"{r['mean_agree']:.1f}", r["min_agree"],
                     f"{r['identical']}/{r['prompts']}"] for r in agree]))
    for bits, a in detail.items():
        print(f"\n{bits}-bit agreement per prompt: {a}")
    elapsed = time.perf_counter() - t0
    print(f"\n({elapsed:.0f} s, torch {torch.__version__}, {args.threads} threads, fp32, CPU)")
    result = {"memory": mem, "perplexity": ppl, "agreement": agree, "agreement_per_prompt": detail,
              "passage_tokens": len(passage), "chunk": args.chunk, "seconds": elapsed}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
