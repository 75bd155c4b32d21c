"""llama.cpp's own output as a test reference, computed in a child process.

A native crash in llama.cpp inside the test process (its AMX path faults on Intel CPUs,
llama.cpp #20824) would take the whole pytest run with it and report nothing. In a child, a crash
fails the one test that asked for the reference, and names the signal. The child dies with the
test process (``lifeline.watch_parent``), and it loads its models under the same extra-buffer
decision the server's worker makes (``reference_llama``).

``fn`` must be importable by name (a module-level function), since the child is spawned."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any, Callable

import pytest

from superfluid.core import lifeline
from superfluid.core.worker_process import exit_text


def _child(conn, fn: Callable, args: tuple, kwargs: dict) -> None:
    lifeline.watch_parent()
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 - the test process reports it
        conn.send(("error", traceback.format_exc()))


def in_child(fn: Callable, *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run in a fresh spawned process; its return value (picklable).
    A crash, an exception or a timeout in the child fails the calling test."""
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, fn, args, kwargs), daemon=True,
                       name=f"llama-reference-{fn.__name__}")
    proc.start()
    send.close()
    try:
        if not receive.poll(timeout):
            pytest.fail(f"llama.cpp reference {fn.__qualname__} gave no answer in {timeout:.0f} s")
        kind, value = receive.recv()
    except EOFError:
        proc.join(5)
        pytest.fail(f"llama.cpp reference {fn.__qualname__} died ({exit_text(proc.exitcode)})")
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        receive.close()
    if kind == "error":
        pytest.fail(f"llama.cpp reference {fn.__qualname__} raised:\n{value}")
    return value


# ---- the references (each runs in the child: call them through ``in_child``) ----------------

def hidden_states(path: str, tokens: list[int], n_ctx: int = 512):
    """llama-cpp-python's own embedding mode with no pooling: one hidden state per token."""
    import llama_cpp
    import numpy as np

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(model_path=path, n_ctx=n_ctx, embedding=True, verbose=False, n_threads=2,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_NONE, flash_attn=True)
    try:
        llm.reset()
        llm.eval(tokens)
        return np.array([llama_cpp.llama_get_embeddings_ith(llm.ctx, i)[:llm.n_embd()] for i in range(len(tokens))])
    finally:
        llm.close()


def all_logits(path: str, tokens: list[int], n_ctx: int = 512, **settings):
    """llama-cpp-python's own high-level model: every position's logits for ``tokens``. By default
    with flash attention on, as the worker's ``auto`` picks on a CPU; ``settings`` go to ``Llama``."""
    import numpy as np

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    settings = {"n_threads": 2, "flash_attn": True, **settings}
    llm = reference_llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False, **settings)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[:len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def greedy_completions(path: str, prompts: list[str], max_tokens: int, flash_attn: bool) -> dict:
    """Each prompt completed alone at temperature 0: {prompt: (text, completion tokens)}."""
    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(path, n_ctx=2048, flash_attn=flash_attn, verbose=False, seed=0)
    try:
        refs = {}
        for p in prompts:
            out = llm.create_completion(p, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
            refs[p] = (out["choices"][0]["text"], out["usage"]["completion_tokens"])
        return refs
    finally:
        llm.close()


def text_logits(path: str, text: bytes, n_ctx: int = 128):
    """``text`` tokenized (with BOS) by llama.cpp, and every position's logits: (tokens, logits)."""
    import numpy as np

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(path, n_ctx=n_ctx, logits_all=True, verbose=False)
    try:
        tokens = llm.tokenize(text, add_bos=True)
        llm.eval(tokens)
        return tokens, np.array(llm.scores[:len(tokens)])
    finally:
        llm.close()
