"""llama-cpp-python's own ``Llama(..., lora_path=...)`` as the reference of a LoRA adapter's
greedy replies (run through ``llama_reference.in_child``: a native crash fails one test)."""

from __future__ import annotations


def greedy_under_adapter(path: str, lora_path: str | None, prompts: list[str], max_tokens: int,
                         lora_scale: float = 1.0, n_batch: int = 512) -> dict:
    """Each prompt completed alone at temperature 0 on ``path`` with the adapter ``lora_path``
    (None: the base model): {prompt: (text, completion tokens)}. Flash attention on, as the
    server's worker picks on a CPU. ``n_batch``: the prompt's micro-batches (a server run with
    ``--prefill-budget`` N prefills N tokens a step; the last digits, and a near-tie's greedy
    choice, depend on it)."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    kwargs = {"lora_path": lora_path, "lora_scale": lora_scale} if lora_path else {}
    llm = reference_llama(path, n_ctx=2048, flash_attn=True, verbose=False, seed=0, n_threads=2,
                          n_batch=n_batch, n_ubatch=n_batch, **kwargs)
    try:
        refs = {}
        for p in prompts:
            out = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
            refs[p] = (out["choices"][0]["text"], out["usage"]["completion_tokens"])
        return refs
    finally:
        llm.close()
