"""What ``--speculate K`` (prompt-lookup drafts verified in the step's own forward pass) does on
basert on the CPU: decode speed with and without, greedy and sampled, on SmolLM2-135M-Instruct in
fp32.

    python -m tools.bench.basert_speculation [--model PATH.gguf] [--k 4] [--tokens 128] [--rounds 3] [--json PATH]

Cases, each ``--tokens`` tokens a lane, greedy unless named "sampled":

(a) one lane, a repetitive prompt (copy a list twice: the reply repeats its own tokens, which is
    what prompt lookup drafts from);
(b) one lane, a free-form prompt (little to look up);
(c) ``--lanes`` (8) lanes at once: more decoding lanes than the gate's ``max_lanes`` (4), so
    speculation should switch itself off (drafted ~0; a lane that finishes early can leave fewer
    than 4 behind, which then draft) and cost nothing;
(d), (e) as (a) and (b), sampled (temperature 0.7, top-p 0.95, a fixed seed): a sampled lane
    verifies by drawing each row with the uniform its token would get, so its seeded tokens are
    the same with and without speculation, and it keeps fewer drafts than a greedy lane.
(f) one lane, greedy, its reply held to a JSON schema (a list of objects, whose keys repeat):
    each verify row is masked as the grammar would have masked it there.

Each round runs plain then speculating, on fresh runners, so load from other processes on a
shared machine falls on both sides alike; the table shows the medians over ``--rounds`` and the
ratio speculate/plain of those medians, with the acceptance rate (accepted/drafted), the accepted
drafts per verify step (each verify step also emits the model's own next token) and whether the
greedy tokens are identical with and without speculation (they must be: the verify keeps only
what decoding without speculation gives, seeded sampling included). Only the decode ticks are timed (the prefill tick is not);
tok/s counts every lane's tokens from those ticks. An untimed warm-up generation runs first, so
first-call costs (allocator, thread pool) fall on neither side.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from superfluid.core.constrain import Constrainer
from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams
from superfluid.plugins.vocab.constraints import lltokenizer

from .basert_kv_bits import GREEDY, chat, generate, load, make_runner, markdown, write_json

SAMPLED = SamplingParams(temperature=0.7, top_p=0.95, seed=1234)
FRUITS = {"type": "object", "properties": {"fruits": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "colour": {"type": "string"}},
    "required": ["name", "colour"]}}}, "required": ["fruits"]}
HELD_TO_JSON = SamplingParams(temperature=0.0, json_schema=JsonConstraint(choices=(JsonChoice("", FRUITS),)))
JSON_PROMPT = "List twelve fruits and their colours as JSON."

REPETITIVE = ("Copy this list twice, one item per line: apple, banana, cherry, date, elderberry, fig, "
              "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya.")
FREE_FORM = "Write a short story about a fox who learns to swim."
LANE_PROMPTS = (
    REPETITIVE,
    FREE_FORM,
    "Repeat this sentence three times: the quick brown fox jumps over the lazy dog.",
    "Explain how a bicycle works.",
    "Write a Python class Point with x and y, and methods add, sub and scale that return a new Point.",
    "What are some good habits for studying?",
    "List the days of the week, then list them again in reverse order.",
    "Describe a sunset over the mountains.",
)


def one_case(model, prompts: list[list[int]], n: int, k: int, rounds: int, grant: int,
             sampling: SamplingParams = GREEDY, constrainer: Constrainer | None = None) -> dict[str, Any]:
    """``rounds`` of plain then speculating decode over ``prompts`` (all lanes in the same ticks)."""
    plain_tps, spec_tps = [], []
    drafted = accepted = verify_steps = 0
    identical = True
    decoded = len(prompts) * (n - 1)  # the first token of each lane comes from the untimed prefill tick
    for _ in range(rounds):
        plain, secs = generate(make_runner(model, constrainer=constrainer), prompts, n, grant, sampling)
        plain_tps.append(decoded / secs)
        runner = make_runner(model, speculate=k, constrainer=constrainer)
        spec, secs = generate(runner, prompts, n, grant, sampling)
        spec_tps.append(decoded / secs)
        identical &= spec == plain
        drafted += runner.gate.drafted
        accepted += runner.gate.accepted
        verify_steps += runner.gate.verify_steps
    plain_med, spec_med = statistics.median(plain_tps), statistics.median(spec_tps)
    return {"lanes": len(prompts), "tokens": n, "rounds": rounds, "plain_tok_s": plain_med, "spec_tok_s": spec_med,
            "ratio": spec_med / plain_med, "plain_all": plain_tps, "spec_all": spec_tps,
            "drafted": drafted // rounds, "accepted": accepted // rounds,
            "acceptance": accepted / drafted if drafted else 0.0,
            "accepted_per_verify": accepted / verify_steps if verify_steps else 0.0,
            "verify_steps": verify_steps // rounds, "identical": identical}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path (default: the default model, SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify step (--speculate K)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per lane")
    ap.add_argument("--rounds", type=int, default=3, help="plain/speculate rounds (medians reported)")
    ap.add_argument("--lanes", type=int, default=8, help="lanes in the concurrent case (c)")
    ap.add_argument("--grant", type=int, default=16, help="decode rounds per tick")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (the first token comes from the untimed prefill)")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, vocab = load(args.model)

    def tok(text: str) -> list[int]:
        return vocab.tokenize(chat(text), True, True)

    lanes = [tok(LANE_PROMPTS[i % len(LANE_PROMPTS)]) for i in range(args.lanes)]
    cases = {"(a) 1 lane, repetitive": ([tok(REPETITIVE)], GREEDY), "(b) 1 lane, free-form": ([tok(FREE_FORM)], GREEDY),
             f"(c) {args.lanes} lanes": (lanes, GREEDY),
             "(d) 1 lane, repetitive, sampled": ([tok(REPETITIVE)], SAMPLED),
             "(e) 1 lane, free-form, sampled": ([tok(FREE_FORM)], SAMPLED),
             "(f) 1 lane, JSON held to a schema": ([tok(JSON_PROMPT)], HELD_TO_JSON)}
    n_vocab = model.shape.vocab_size
    constrainer = Constrainer(lltokenizer(vocab, n_vocab), n_vocab, tuple(sorted(vocab.eog)))
    generate(make_runner(model, speculate=args.k), [tok(REPETITIVE)], 8, 8)  # warm-up: first-call costs
    results = {name: one_case(model, prompts, args.tokens, args.k, args.rounds, args.grant, sampling,
                              constrainer if sampling.constrained else None)
               for name, (prompts, sampling) in cases.items()}

    print(f"## --speculate {args.k} on the CPU ({args.model or 'SmolLM2-135M-Instruct'}, fp32, {args.threads} "
          f"threads, {args.tokens} tokens a lane, median of {args.rounds} alternating rounds)\n")
    print(markdown(
        ["case", "plain tok/s", "speculate tok/s", "ratio", "drafted", "acceptance", "accepted / verify step",
         "tokens identical"],
        [[name, f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}", f"{r['ratio']:.2f}x", r["drafted"],
          f"{r['acceptance']:.0%}", f"{r['accepted_per_verify']:.2f}", "yes" if r["identical"] else "NO"]
         for name, r in results.items()]))
    print("\n(drafted: draft tokens per run, mean over rounds; per-round tok/s plain / speculate:)")
    for name, r in results.items():
        print(f"- {name}: {[round(x, 1) for x in r['plain_all']]} / {[round(x, 1) for x in r['spec_all']]}")
    elapsed = time.perf_counter() - t0
    print(f"\n({elapsed:.0f} s, torch {torch.__version__})")
    out = {"k": args.k, "cases": results, "seconds": elapsed}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
