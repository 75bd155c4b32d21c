"""llama-cpp-python's own ``Llama`` as the reference for a narrow KV cache (``type_k``/``type_v``)
and for rope scaling (the YaRN context params). Run them through
``tests.llama_reference.in_child`` (a native crash fails one test, not the run)."""

from __future__ import annotations

KV_TYPES = {0: 1, 8: 8, 4: 2}  # --kv-bits → ggml_type: F16, Q8_0, Q4_0


def greedy_at_kv_bits(path: str, prompts: list[str], max_tokens: int, kv_bits: int, n_ctx: int = 2048) -> dict:
    """Each prompt completed alone at temperature 0 with K and V at ``kv_bits``' type and flash
    attention on (as the server's context has it): {prompt: (text, completion tokens)}."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    kv = KV_TYPES[kv_bits]
    llm = reference_llama(path, n_ctx=n_ctx, flash_attn=True, type_k=kv, type_v=kv, verbose=False, seed=0,
                          n_threads=2)
    try:
        refs = {}
        for p in prompts:
            out = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
            refs[p] = (out["choices"][0]["text"], out["usage"]["completion_tokens"])
        return refs
    finally:
        llm.close()


def tokenize(path: str, text: str) -> list[int]:
    """``text`` as the model's tokens (with BOS), from the vocabulary alone."""
    import llama_cpp

    llm = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    try:
        return llm.tokenize(text.encode(), add_bos=True)
    finally:
        llm.close()


def token_logprobs(path: str, tokens: list[int], start: int, count: int, n_ctx: int, **rope) -> list[float]:
    """The log-probability of ``tokens[j]`` given the tokens before it, for ``start <= j <
    start + count``, from a ``Llama`` with ``rope`` (rope_scaling_type, rope_freq_scale,
    yarn_orig_ctx, ...) and flash attention on. The prefix is fed without logits; each scored
    position is then fed one token at a time, so only ``count`` rows of logits are ever held."""
    import numpy as np

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(path, n_ctx=n_ctx, flash_attn=True, verbose=False, n_threads=2, n_batch=512, **rope)
    try:
        llm.eval(tokens[:start])
        out = []
        for j in range(start, start + count):
            logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
            top = logits.max()
            out.append(float(logits[tokens[j]] - top - np.log(np.exp(logits - top).sum())))
            llm.eval([tokens[j]])
        return out
    finally:
        llm.close()
