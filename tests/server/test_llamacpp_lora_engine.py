"""LoRA adapters on the llama.cpp worker, driven with TickPlans (no daemon, no HTTP).

The worker loads the fixture's adapters (tools/fixtures/tiny_lora.py) through
``TickPlan.load_adapters`` and applies each plan's lane set to its context. The reference is
llama-cpp-python's own ``Llama`` on the same base GGUF with ``lora_path`` (and ``lora_scale``),
greedy. Lanes of different sets run in alternating ticks in one worker, so the context switches
sets between ticks while every slot keeps the KV its own set computed. The daemon side (grouping
lanes by set, keying the cache) is tested in tests/server/test_lora.py and tests/unit."""

from __future__ import annotations

import pytest

from superfluid.core.errors import SuperfluidError
from superfluid.core.request import SamplingParams
from superfluid.core.tick import LanePlan, TickPlan

from ..llama_reference import in_child
from .test_llamacpp_runner import Worker

GREEDY = SamplingParams(temperature=0.0)
N = 20
TEXTS = ("The quick brown fox", "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module", params=["native", "python"])
def worker(request, model_path, tiny_lora):
    w = Worker(model_path, request.param == "native", max_context=256)
    loaded = w(TickPlan(load_adapters=[("a", str(tiny_lora["a_gguf"])), ("b", str(tiny_lora["b_gguf"]))]))
    assert loaded.adapter_errors == {}
    yield w
    w.close()


@pytest.fixture(scope="module")
def prompts(model_path):
    from llama_cpp import Llama

    llm = Llama(model_path, n_ctx=64, verbose=False, vocab_only=True)
    return [llm.tokenize(t.encode(), add_bos=False, special=True) for t in TEXTS]


TIE = 1e-3  # a reference margin (top1 - top2 logit) below this is a tie that rounding may break either way


def greedy_tokens(model_path: str, lora: str | None, prompts: list[list[int]], scale: float = 1.0) -> list[tuple]:
    """llama-cpp-python's own greedy tokens for each prompt, the adapter applied by ``Llama``
    itself, flash attention on as the worker's ``auto`` picks on a CPU (run in a child), with the
    logit margin (top1 - top2) behind each token: (tokens, margins) per prompt."""
    import llama_cpp
    import numpy as np

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(model_path, n_ctx=256, lora_path=lora, lora_scale=scale, flash_attn=True, n_threads=2,
                          verbose=False)
    try:
        outs = []
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt)
            tokens, margins = [], []
            while len(tokens) < N:
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
                token = int(row.argmax())  # the first maximum, as llama.cpp's greedy sampler takes
                top = np.partition(row, -2)[-2:]
                tokens.append(token)
                margins.append(float(top.max() - top.min()))
                llm.eval([token])
            outs.append((tokens, margins))
        return outs
    finally:
        llm.close()


def reference(model_path: str, lora: str | None, prompts: list[list[int]], scale: float = 1.0) -> list[tuple]:
    return in_child(greedy_tokens, model_path, lora, prompts, scale)


def same(got: list[int], ref: tuple) -> bool:
    """``got`` equals the reference's tokens, or up to a step where the reference's top two logits
    tie (a batch of another shape sums in another order, and a tie may break the other way)."""
    tokens, margins = ref
    for i, (mine, theirs) in enumerate(zip(got, tokens)):
        if mine != theirs:
            return margins[i] < TIE and i >= 4
    return len(got) == len(tokens)


@pytest.fixture(scope="module")
def references(model_path, tiny_lora, prompts):
    files = {"": None, "a": str(tiny_lora["a_gguf"]), "b": str(tiny_lora["b_gguf"])}
    return {(name, i): tokens for name, path in files.items()
            for i, tokens in enumerate(reference(model_path, path, prompts))}


def run_alternating(worker, lanes: dict[int, tuple], prompts, rounds: int = 3) -> dict[int, list[int]]:
    """Each slot's greedy tokens under its set (slot -> (adapter set, prompt index)), one slot a
    tick in turn, ``rounds`` decode rounds a tick: the context's set changes every tick."""
    out = {slot: [] for slot in lanes}
    while any(len(t) < N for t in out.values()):
        for slot, (adapters, which) in lanes.items():
            got, prompt = out[slot], prompts[which]
            if len(got) >= N:
                continue
            if not got:
                lp = LanePlan(slot=slot, pos=0, feed=list(prompt), sample=True, max_new=1, reset=True,
                              sampling=GREEDY, ignore_eos=True, adapters=adapters)
            else:
                lp = LanePlan(slot=slot, pos=len(prompt) + len(got) - 1, feed=[got[-1]], sample=True,
                              max_new=min(rounds, N - len(got)), decode=True, ignore_eos=True, adapters=adapters)
            got += worker(TickPlan(lanes=[lp])).lanes[slot].tokens
    worker(TickPlan(release=list(lanes)))
    return out


A, B = (("a", 1.0),), (("b", 1.0),)


def test_each_slot_equals_llama_with_its_adapter_while_the_sets_alternate(worker, prompts, references):
    for which in range(len(prompts)):
        got = run_alternating(worker, {0: (A, which), 1: (B, which), 2: ((), which)}, prompts)
        assert same(got[0], references[("a", which)])
        assert same(got[1], references[("b", which)])
        assert same(got[2], references[("", which)])
    # the adapters change the replies from their first tokens (else the checks above would hold
    # with no adapter applied)
    firsts = {name: references[(name, 0)][0][:4] for name in ("", "a", "b")}
    assert firsts[""] != firsts["a"] != firsts["b"] != firsts[""]


def test_lanes_of_one_set_share_a_tick(worker, prompts, references):
    """Two lanes of one set in one tick both run under it. Only their first tokens are compared,
    where the reference's margin is wide: under an adapter llama.cpp's logits depend on the batch's
    shape (measured with Llama itself: a prompt evaluated whole or a token at a time differs by up
    to 1.0 in a logit from the 10th position on under ``a``, by 0 without an adapter; the F32 LoRA
    product's rounding differs by batch width, and the Q4_1 layers' 8-bit activations then round
    apart), so two lanes decoded together follow the reference alone only so far."""
    plans = [LanePlan(slot=s, pos=0, feed=list(prompts[s]), sample=True, max_new=N, reset=True, sampling=GREEDY,
                      ignore_eos=True, adapters=B) for s in (0, 1)]
    result = worker(TickPlan(lanes=plans))
    worker(TickPlan(release=[0, 1]))
    checked = 0
    for s in (0, 1):
        tokens, margins = references[("b", s)]
        assert len(result.lanes[s].tokens) == N
        if margins[0] > 0.3:
            assert result.lanes[s].tokens[0] == tokens[0] != references[("", s)][0][0]
            checked += 1
    assert checked


def test_the_lane_scale_is_the_adapter_scale(worker, model_path, tiny_lora, prompts):
    half = run_alternating(worker, {0: ((("a", 0.5),), 0)}, prompts)[0]
    assert same(half, reference(model_path, str(tiny_lora["a_gguf"]), prompts[:1], scale=0.5)[0])


def test_lanes_of_two_sets_in_one_tick_are_refused(worker, prompts):
    plans = [LanePlan(slot=s, pos=0, feed=list(prompts[0]), sample=True, max_new=2, reset=True, sampling=GREEDY,
                      adapters=sets) for s, sets in ((0, A), (1, B))]
    with pytest.raises(SuperfluidError, match="adapter sets"):
        worker(TickPlan(lanes=plans))
    worker(TickPlan(release=[0, 1]))


def test_files_llama_cpp_refuses_are_adapter_errors(worker, tiny_lora, tmp_path, prompts, references):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    result = worker(TickPlan(load_adapters=[("wrong", str(tiny_lora["wrong_gguf"])), ("junk", str(junk)),
                                            ("peft", str(tiny_lora["a_peft"])), ("gone", str(tmp_path / "none"))]))
    errors = result.adapter_errors
    assert set(errors) == {"wrong", "junk", "peft", "gone"}
    assert "wrong base model" in errors["wrong"] and str(tiny_lora["wrong_gguf"]) in errors["wrong"]
    assert "cannot load" in errors["junk"]
    assert "convert_lora_to_gguf" in errors["peft"]
    assert "no such file" in errors["gone"]
    # nothing else changed: a and b still serve, the refused names are unknown
    assert same(run_alternating(worker, {0: (A, 0)}, prompts)[0], references[("a", 0)])
    lane = LanePlan(slot=0, pos=0, feed=list(prompts[0]), sample=True, max_new=1, reset=True, sampling=GREEDY,
                    adapters=(("wrong", 1.0),))
    with pytest.raises(SuperfluidError, match="not loaded"):
        worker(TickPlan(lanes=[lane]))
    worker(TickPlan(release=[0]))


def test_unload_then_load_again(worker, tiny_lora, prompts, references):
    assert worker(TickPlan(unload_adapters=["b"])).adapter_errors == {}
    lane = LanePlan(slot=0, pos=0, feed=list(prompts[0]), sample=True, max_new=1, reset=True, sampling=GREEDY,
                    adapters=B)
    with pytest.raises(SuperfluidError, match="not loaded"):
        worker(TickPlan(lanes=[lane]))
    worker(TickPlan(release=[0]))
    # loaded again in the same plan as its first lane (the load comes first)
    result = worker(TickPlan(load_adapters=[("b", str(tiny_lora["b_gguf"]))],
                             lanes=[LanePlan(slot=0, pos=0, feed=list(prompts[0]), sample=True, max_new=N, reset=True,
                                             sampling=GREEDY, ignore_eos=True, adapters=B)]))
    worker(TickPlan(release=[0]))
    assert result.adapter_errors == {} and same(result.lanes[0].tokens, references[("b", 0)])
