"""basert against transformers on the same GGUF: the numbers behind "basert computes the model right".

    python -m tools.bench.basert_reference [--model PATH.gguf] [--steps 64] [--dtype float32] [--llama-cpp]

Both engines load the same file (transformers through its own GGUF conversion, so its
un-permuting and dequantizing are an independent check of basert's) and run in ``--dtype`` on
the CPU. For each prompt the table shows the largest |Δlogit| over every prompt position, the
largest over the greedy decode steps while both agree, how many of ``--steps`` greedy tokens
agree, and at the first divergence the reference's logit margin there (top1 - top2): a
divergence at a margin of 1e-5 is a tie broken by rounding, one at a margin of 1 is a bug.

basert decodes through DenseAttention one token at a time after the prompt; transformers through
its own KV cache. ``--llama-cpp`` adds llama.cpp on the same file (F32 KV cache) for scale: its
quantized dot products put it further from transformers than basert is. ``compare`` is also
what tests/server/test_basert_reference.py asserts on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import attrs
import torch

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Q: What is 12 times 7?\nA:",
    "The quick brown fox",
    "In 1969, the first humans landed on",
    "Here is a list of fruits: apple, banana,",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which plants",
    "SELECT name, age FROM users WHERE",
    "The best way to learn a new language is",
    "1, 1, 2, 3, 5, 8, 13,",
)


@attrs.define
class PromptResult:
    prompt: str
    n_prompt: int
    prompt_max_diff: float       # max |Δlogit| over all prompt positions
    decode_max_diff: float       # max |Δlogit| over greedy steps up to the first divergence
    agree: int                   # greedy tokens identical before the first divergence
    steps: int
    margin: float | None         # reference top1 - top2 at the first divergence, None if none
    ref_tokens: list[int]        # the reference's greedy tokens, all ``steps`` of them
    basert_tokens: list[int]     # basert's, up to and including its first divergence
    llama_cpp_prompt_diff: float | None = None
    llama_cpp_agree: int | None = None


def transformers_from_gguf(path: str, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' model of a GGUF, converted by transformers' own GGUF code.

    ``from_pretrained(gguf_file=...)`` insists on accelerate; the conversion underneath
    (``load_gguf_checkpoint``) does not, so it is called directly into a model built from the
    GGUF's config. The result is the same model with no extra package."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    result = model.load_state_dict({k: v.to(dtype) for k, v in parsed["tensors"].items()}, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing:
        raise RuntimeError(f"transformers left {missing} unloaded from {path}")
    model.tie_weights()
    return model.eval()


def transformers_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    folder, file = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(folder, gguf_file=file)


def _margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


@torch.no_grad()
def compare_prompt(ref_model: Any, model: Any, ids: list[int], steps: int, prompt: str = "",
                   llm: Any = None) -> PromptResult:
    """One prompt through both: prompt logits, then ``steps`` greedy tokens each on its own.

    The reference always decodes all ``steps``; basert stops at its first divergence. With
    ``llm`` (a llama_cpp.Llama on the same file) llama.cpp is measured against the reference too."""
    from transformers import DynamicCache

    from superfluid.plugins.basert.dense_attention import DenseAttention

    n = len(ids)
    tokens = torch.tensor(ids)
    cache = DynamicCache(config=ref_model.config)
    ref_logits = ref_model(tokens[None], cache=cache, use_cache=True).logits[0].float()
    attn = DenseAttention(model.shape, 1, n + steps + 1, "cpu", model.dtype)
    attn.begin([(0, 0, n)])
    logits = model.logits(model(tokens, torch.arange(n), attn))
    prompt_diff = float((logits - ref_logits).abs().max())

    ref_last, last = ref_logits[-1], logits[-1]
    ref_out: list[int] = []
    out: list[int] = []
    decode_diff, margin = 0.0, None
    for step in range(steps):
        ref_tok = int(ref_last.argmax())
        ref_out.append(ref_tok)
        if margin is None:
            decode_diff = max(decode_diff, float((last - ref_last).abs().max()))
            tok = int(last.argmax())
            out.append(tok)
            if tok != ref_tok:
                margin = _margin(ref_last)
        if step == steps - 1:
            break
        pos = n + step
        ref_last = ref_model(torch.tensor([[ref_tok]]), cache=cache, use_cache=True,
                             position_ids=torch.tensor([[pos]])).logits[0, -1].float()
        if margin is None:
            attn.begin([(0, pos, 1)])
            last = model.logits(model(torch.tensor([tok]), torch.tensor([pos]), attn))[0]
    agree = len(out) if margin is None else len(out) - 1
    result = PromptResult(prompt, n, prompt_diff, decode_diff, agree, steps, margin, ref_out, out)
    if llm is not None:
        result.llama_cpp_prompt_diff, result.llama_cpp_agree = _llama_cpp(llm, ids, ref_logits, ref_out)
    return result


@torch.no_grad()
def score_prompt(ref_model: Any, model: Any, ids: list[int], steps: int, prompt: str = "",
                 llm: Any = None) -> PromptResult:
    """``compare_prompt``'s result with transformers scoring basert's tokens instead of decoding
    its own: basert decodes ``steps`` greedy tokens one at a time as there, then transformers
    runs the prompt and those tokens in one forward, so each step's logits are compared with the
    reference's at the same position after the same tokens. Where basert takes the reference's
    argmax at every step, that is the reference's own greedy decode; from a divergence on, the
    reference decodes the rest itself through its KV cache. Same checks, up to transformers'
    full-forward-vs-cached rounding (about 1e-6), for one reference forward instead of ``steps``."""
    from transformers import DynamicCache

    from superfluid.plugins.basert.dense_attention import DenseAttention

    n = len(ids)
    attn = DenseAttention(model.shape, 1, n + steps + 1, "cpu", model.dtype)
    attn.begin([(0, 0, n)])
    logits = model.logits(model(torch.tensor(ids), torch.arange(n), attn))
    rows, out = [logits[-1]], [int(logits[-1].argmax())]
    for step in range(1, steps):
        pos = n + step - 1
        attn.begin([(0, pos, 1)])
        rows.append(model.logits(model(torch.tensor([out[-1]]), torch.tensor([pos]), attn))[0])
        out.append(int(rows[-1].argmax()))
    ref_logits = ref_model(torch.tensor([ids + out[:-1]])).logits[0].float()
    prompt_diff = float((logits - ref_logits[:n]).abs().max())

    decode_diff, margin, ref_out = 0.0, None, []
    for step in range(steps):
        ref_last = ref_logits[n - 1 + step]
        decode_diff = max(decode_diff, float((rows[step] - ref_last).abs().max()))
        ref_out.append(int(ref_last.argmax()))
        if out[step] != ref_out[-1]:
            margin = _margin(ref_last)
            break
    agree = len(ref_out) if margin is None else len(ref_out) - 1
    if len(ref_out) < steps:  # diverged: the reference's own tokens from there on
        cache = DynamicCache(config=ref_model.config)
        last = ref_model(torch.tensor([ids + ref_out]), cache=cache, use_cache=True).logits[0, -1]
        while len(ref_out) < steps:
            ref_out.append(int(last.argmax()))
            last = ref_model(torch.tensor([[ref_out[-1]]]), cache=cache, use_cache=True,
                             position_ids=torch.tensor([[n + len(ref_out) - 1]])).logits[0, -1]
    result = PromptResult(prompt, n, prompt_diff, decode_diff, agree, steps, margin, ref_out,
                          out[:agree + (margin is not None)])
    if llm is not None:
        result.llama_cpp_prompt_diff, result.llama_cpp_agree = _llama_cpp(llm, ids, ref_logits[:n], ref_out)
    return result


def _llama_cpp(llm: Any, ids: list[int], ref_logits: torch.Tensor, ref_out: list[int]) -> tuple[float, int]:
    """llama.cpp's prompt logits against the reference's, and how many reference tokens its own
    greedy decode reproduces before the first difference."""
    import numpy as np

    llm.reset()
    llm.eval(ids)
    scores = torch.from_numpy(np.array(llm.scores[:len(ids)], dtype=np.float32))
    diff = float((scores - ref_logits).abs().max())
    last, agree = scores[-1], 0
    for step, ref_tok in enumerate(ref_out):
        tok = int(last.argmax())
        if tok != ref_tok:
            break
        agree += 1
        if step < len(ref_out) - 1:
            llm.eval([tok])
            last = torch.from_numpy(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
    return diff, agree


def compare(path: str, prompts: tuple[str, ...] = PROMPTS, steps: int = 64,
            dtype: torch.dtype = torch.float32, llama_cpp: bool = False,
            converted: str | None = None, score: bool = False) -> list[PromptResult]:
    """basert and transformers on ``path`` (a GGUF), every prompt, in ``dtype`` on the CPU;
    with ``llama_cpp`` also llama.cpp (llama-cpp-python, F32 KV cache) on the same file.

    ``converted``: a directory where transformers' own conversion of ``path`` was saved
    (``transformers_from_gguf(path).save_pretrained`` and the tokenizer's, as the tiny-LoRA
    fixture's ``base-hf/`` is): the same reference, read from safetensors instead of converting
    the GGUF again (which takes most of a minute on two cores).

    ``score``: transformers scores basert's greedy tokens in one forward (``score_prompt``)
    instead of decoding its own one at a time; the same checks for about half the work."""
    from superfluid.plugins.basert import model as basert

    if converted is None:
        tokenizer = transformers_tokenizer(path)
        ref_model = transformers_from_gguf(path, dtype)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(converted)
        ref_model = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype).eval()
    model = basert.load(path, name=os.path.basename(path), device=torch.device("cpu"), dtype=dtype)
    llm = None
    if llama_cpp:
        from superfluid.plugins.llamacpp.extra_buffers import reference_llama
        llm = reference_llama(model_path=path, n_ctx=512, logits_all=True, verbose=False,
                              n_threads=max(1, torch.get_num_threads()), type_k=0, type_v=0)
    results = []
    for prompt in prompts:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        results.append((score_prompt if score else compare_prompt)(ref_model, model, ids, steps, prompt, llm))
    if llm is not None:
        llm.close()
    return results


def table(results: list[PromptResult]) -> str:
    with_llama = results[0].llama_cpp_agree is not None
    extra = f"  {'llama.cpp |Δ|':>13}  {'llama.cpp':>9}" if with_llama else ""
    lines = [f"{'#':>2}  {'tokens':>6}  {'prompt max|Δ|':>13}  {'decode max|Δ|':>13}  {'greedy':>7}  "
             f"{'margin@div':>10}{extra}  prompt"]
    for i, r in enumerate(results):
        margin = "-" if r.margin is None else f"{r.margin:.2e}"
        extra = (f"  {r.llama_cpp_prompt_diff:>13.2e}  {r.llama_cpp_agree:>4}/{r.steps:<4}"
                 if with_llama else "")
        lines.append(f"{i:>2}  {r.n_prompt:>6}  {r.prompt_max_diff:>13.2e}  {r.decode_max_diff:>13.2e}  "
                     f"{r.agree:>3}/{r.steps:<3}  {margin:>10}{extra}  {r.prompt[:40]!r}")
    worst = max(r.prompt_max_diff for r in results)
    full = sum(r.margin is None for r in results)
    lines.append(f"basert: worst prompt max|Δlogit| {worst:.2e}; greedy identical for {full}/{len(results)} prompts")
    if with_llama:
        worst = max(r.llama_cpp_prompt_diff for r in results)
        full = sum(r.llama_cpp_agree == r.steps for r in results)
        lines.append(f"llama.cpp: worst prompt max|Δlogit| {worst:.2e}; greedy identical for "
                     f"{full}/{len(results)} prompts")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF (default: the default model, SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also measure llama.cpp (llama-cpp-python) on the same file against transformers")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        from superfluid.core.default_model import default_model_path
        path = default_model_path()
    start = time.monotonic()
    results = compare(path, steps=args.steps, dtype=getattr(torch, args.dtype), llama_cpp=args.llama_cpp)
    print(f"basert vs transformers, {os.path.basename(path)}, {args.dtype}, CPU, "
          f"{len(results)} prompts, {args.steps} greedy steps ({time.monotonic() - start:.0f} s)")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
