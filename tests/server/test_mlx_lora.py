"""LoRA adapters on the MLX worker's runner, driven with TickPlans (no daemon): SmolLM2's Q4_1
GGUF with the fixture's adapters (tools/fixtures/tiny_lora.py) as llama.cpp GGUFs and as PEFT
directories. The reference is mlx-lm's own ``LoRALinear`` (mlx_lm.tuner) holding the same
matrices on a fresh model, decoding alone; in the runner lanes of different sets run in
alternating ticks, so the set changes between ticks while each slot keeps its own KV.

SmolLM2 decodes at a few tokens a second on MLX's CPU kernels, so the replies are N = 6 tokens:
a prefill tick and two decode ticks a lane (grants of 3), so each lane still meets two set changes,
and the adapters already change the first 4 tokens. A reference is computed once per run
(``mlx_lm_reference`` is memoized): test_mlx_lora_server.py asks for the same ones."""

from __future__ import annotations

import functools

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from superfluid.core.request import SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, TickPlan  # noqa: E402
from superfluid.plugins.mlx import loader  # noqa: E402
from superfluid.plugins.mlx.lora import MlxLora  # noqa: E402
from superfluid.plugins.mlx.runner import MlxRunner  # noqa: E402
from superfluid.plugins.vocab import GGUFVocab  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

GREEDY = SamplingParams(temperature=0.0)
N = 6  # 1 prefill token + two grants of 3 (see the docstring)
A, B = (("a", 1.0),), (("b", 1.0),)


@pytest.fixture(scope="module")
def smol(tiny_lora):
    path = str(tiny_lora["base_gguf"])
    vocab = GGUFVocab(path, "smollm2")
    yield path, vocab
    vocab.close()


@pytest.fixture(scope="module")
def prompt(smol):
    return smol[1].tokenize("The quick brown fox", add_special=False, parse_special=True)


def mlx_lm_reference(path: str, adapter: str | None, prompt: list[int]) -> list[int]:
    """Greedy tokens of a fresh model whose linear layers are mlx-lm's own LoRALinear holding the
    adapter GGUF's matrices (scale alpha / r), one token a step through mlx-lm's KV caches.
    Computed once a run for each (file, adapter, prompt): both LoRA modules use it."""
    return list(_reference(path, adapter, tuple(prompt)))


@functools.lru_cache(maxsize=None)
def _reference(path: str, adapter: str | None, prompt: tuple[int, ...]) -> tuple[int, ...]:
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tuner.lora import LoRALinear

    model = loader.load(path)
    if adapter:
        weights = MlxLora(model).read(adapter)  # only to read the file: the layers below are mlx-lm's
        model = loader.load(path)
        for (layer, module), (a, b, s) in weights.items():
            parent = model.layers[layer].self_attn if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else model.layers[layer].mlp
            lora = LoRALinear.from_base(getattr(parent, module), r=a.shape[0], scale=s, dropout=0.0)
            lora.lora_a, lora.lora_b = a.T, b.T
            setattr(parent, module, lora)
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(prompt)]), cache=cache)
    out = []
    while len(out) < N:
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        if len(out) < N:  # the last token's logits are never read
            logits = model(mx.array([[token]]), cache=cache)
    return tuple(out)


def run_alternating(runner, lanes: dict, prompt, grant: int = 3) -> dict[int, list[int]]:
    out = {s: [] for s in lanes}
    while any(len(t) < N for t in out.values()):
        for slot, adapters in lanes.items():
            got = out[slot]
            if len(got) >= N:
                continue
            if not got:
                lp = LanePlan(slot=slot, pos=0, feed=list(prompt), sample=True, max_new=1, reset=True,
                              sampling=GREEDY, ignore_eos=True, adapters=adapters)
            else:
                lp = LanePlan(slot=slot, pos=len(prompt) + len(got) - 1, feed=[got[-1]], sample=True,
                              max_new=min(grant, N - len(got)), decode=True, ignore_eos=True, adapters=adapters)
            got += runner.run(TickPlan(lanes=[lp])).lanes[slot].tokens
    runner.run(TickPlan(release=list(lanes)))
    return out


def test_alternating_sets_equal_mlx_lm_lora_per_slot(smol, tiny_lora, prompt):
    path, vocab = smol
    runner = MlxRunner(loader.load(path), vocab.eog, StopFlag(), 4096)
    loaded = runner.run(TickPlan(load_adapters=[("a", str(tiny_lora["a_gguf"])), ("b", str(tiny_lora["b_peft"]))]))
    assert loaded.adapter_errors == {}
    got = run_alternating(runner, {0: A, 1: B, 2: ()}, prompt)
    refs = {"a": mlx_lm_reference(path, str(tiny_lora["a_gguf"]), prompt),
            "b": mlx_lm_reference(path, str(tiny_lora["b_gguf"]), prompt),
            "": mlx_lm_reference(path, None, prompt)}
    assert got[0] == refs["a"] and got[1] == refs["b"] and got[2] == refs[""]
    assert refs["a"][:4] != refs[""][:4] != refs["b"][:4]  # the adapters change the replies
    # b's PEFT directory (permuted for the GGUF's rotary order) reads as b's GGUF
    peft_b, gguf_b = MlxLora(runner.model).read(str(tiny_lora["b_peft"])), runner.lora.read(str(tiny_lora["b_gguf"]))
    assert set(peft_b) == set(gguf_b)
    assert max(float(mx.abs(peft_b[k][1] - gguf_b[k][1]).max()) for k in gguf_b) < 1e-6


def test_files_that_do_not_fit_are_adapter_errors(smol, tiny_lora, tmp_path):
    path, vocab = smol
    runner = MlxRunner(loader.load(path), vocab.eog, StopFlag(), 4096)
    result = runner.run(TickPlan(load_adapters=[("wrong", str(tiny_lora["wrong_gguf"])),
                                                ("gone", str(tmp_path / "none"))]))
    assert set(result.adapter_errors) == {"wrong", "gone"}
    assert "another base model" in result.adapter_errors["wrong"]
    with pytest.raises(RuntimeError, match="not loaded"):
        runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=[1, 2], sample=True, max_new=1, reset=True,
                                            sampling=GREEDY, adapters=(("wrong", 1.0),))]))
