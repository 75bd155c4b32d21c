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
            # no logprobs asked: llama-cpp-python sorts the whole vocabulary in Python for each
            # token's (2.6 s of the 5.7 s of one adapter's prompts); the margins are read from the
            # logits it keeps (logits_all) instead
            out = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
            usage = out["usage"]
            refs[p] = (out["choices"][0]["text"], usage["completion_tokens"],
                       _margins(llm, usage["prompt_tokens"], usage["completion_tokens"]))
        return refs
    finally:
        llm.close()


def _margins(llm, n_prompt: int, n_completion: int) -> list[tuple[str, float]]:
    """Each generated token's text and the log-probability gap between it and the runner-up,
    from the logits llama-cpp-python kept: a greedy reply's token i is the best of the logits of
    position n_prompt - 1 + i. A token's text is what ``logprobs`` would name it, and the gap is
    taken as ``logprobs`` gives it (two candidates whose texts are the same count as one: no gap)."""
    import numpy as np

    rows = llm.scores[n_prompt - 1:n_prompt - 1 + n_completion]
    tokens = [int(np.argmax(row)) for row in rows]
    margins = []
    for i, (token, row) in enumerate(zip(tokens, rows)):
        logprobs = row - row.max() - np.log(np.exp(row - row.max()).sum())
        first, second = np.lexsort((-np.arange(len(row)), -logprobs))[:2]  # as sorted((lp, id), reverse=True)

        def piece(t: int) -> str:
            return llm.detokenize([int(t)], prev_tokens=tokens[:i]).decode("utf-8", errors="ignore")
        top = {piece(first): float(logprobs[first]), piece(second): float(logprobs[second])}
        top[piece(token)] = float(logprobs[token])
        margins.append((piece(token), _gap(top)))
    return margins


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
