"""An embedding model's declared pooling, on llama.cpp: a tiny written GGUF that says cls, last
or mean (``llama.pooling_type``) gets that pooling from the runner, whatever the chunks its
prompt is prefilled in. The reference is llama-cpp-python's own embedding mode, one hidden state
per token."""

from __future__ import annotations

import numpy as np
import pytest

from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, TickPlan
from superfluid.plugins.llamacpp.hidden import model_pooling

from ..llama_reference import hidden_states, in_child
from ..tinygguf import write_tiny_llama
from .test_llamacpp_runner import Worker

llama_cpp = pytest.importorskip("llama_cpp")
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 30, 31, 32, 33, 34, 35, 36, 37]


def start(path: str):
    worker = Worker(path, native_rounds=True, max_context=256)
    return worker, worker.close


@pytest.mark.parametrize("declared, name", [(None, "mean"), (1, "mean"), (2, "cls"), (3, "last")])
def test_the_gguf_pooling_is_honoured_across_chunks(tmp_path, declared, name):
    path = str(write_tiny_llama(tmp_path / f"pool-{name}.gguf", pooling=declared))
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    try:
        assert model_pooling(model) == name
    finally:
        llama_cpp.llama_model_free(model)
    tick, stop = start(path)
    try:
        a = tick(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=PROMPT[:4], sample=False, reset=True,
                                          sampling=GREEDY, embed=True)])).lanes[0]
        b = tick(TickPlan(lanes=[LanePlan(slot=0, pos=4, feed=PROMPT[4:], sample=True, max_new=1,
                                          sampling=GREEDY, embed=True)])).lanes[0]
    finally:
        stop()
    total = np.add(a.embedding_sum or 0.0, b.embedding_sum or 0.0)
    pooled = total / (a.pooled + b.pooled)
    ref = in_child(hidden_states, path, PROMPT, n_ctx=256)
    expected = {"mean": ref.mean(axis=0), "cls": ref[0], "last": ref[-1]}[name]
    assert (a.pooled + b.pooled) == {"mean": len(PROMPT), "cls": 1, "last": 1}[name]
    np.testing.assert_allclose(pooled, expected, rtol=1e-3, atol=1e-4)
