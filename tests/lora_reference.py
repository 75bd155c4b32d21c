"""llama-cpp-python's own ``Llama(..., lora_path=...)`` as the reference of a LoRA adapter's
greedy replies (run through ``llama_reference.in_child``: a native crash fails one test)."""

from __future__ import annotations


def greedy_under_adapter(path: str, lora_path: str | None, prompts: list[str], max_tokens: int,
                         lora_scale: float = 1.0, n_batch: int = 512) -> dict:
    """Each prompt completed alone at temperature 0 on ``path`` with the adapter ``lora_path``
    (None: the base model): {prompt: (text, completion tokens, margins)}, where ``margins`` holds
    each generated token's text and the log-probability gap between it and the runner-up (how
    close a call the greedy choice was). Flash attention on, as the server's worker picks on a CPU.
    ``n_batch``: the prompt's micro-batches (a server run with ``--prefill-budget`` N prefills N
    tokens a step; the last digits, and a near-tie's greedy choice, depend on it)."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    kwargs = {"lora_path": lora_path, "lora_scale": lora_scale} if lora_path else {}
    llm = reference_llama(path, n_ctx=2048, flash_attn=True, verbose=False, seed=0, n_threads=2,
                          n_batch=n_batch, n_ubatch=n_batch, logits_all=True, **kwargs)
    try:
        refs = {}
        for p in prompts:
            out = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0, logprobs=2)
            lp = out["choices"][0]["logprobs"]
            margins = [(piece, _gap(top)) for piece, top in zip(lp["tokens"], lp["top_logprobs"])]
            refs[p] = (out["choices"][0]["text"], out["usage"]["completion_tokens"], margins)
        return refs
    finally:
        llm.close()


def _gap(top: dict) -> float:
    """The log-probability gap between the two best candidates of one position."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def agrees_up_to_a_close_call(got: str, ref: tuple, close: float) -> bool:
    """Whether ``got`` (a reply's text) is the reference's reply ``ref`` (text, tokens, margins),
    or follows it token for token up to a position where the reference's choice won by less than
    ``close`` (a log-probability gap): past such a near-tie the batch's shape may decide it the
    other way (llama.cpp's logits under a LoRA adapter depend on how tokens are batched), and
    nothing after it is compared."""
    text, _, margins = ref
    if got == text:
        return True
    done = 0
    for piece, gap in margins:
        if not got.startswith(text[:done + len(piece)]):  # the reply parts from the reference here
            return gap < close
        done += len(piece)
    return False
