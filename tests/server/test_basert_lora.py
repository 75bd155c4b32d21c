"""LoRA adapters on basert, per row: rows of the base model, adapter ``a``, ``b``, both, and ``a``
at half scale in one forward pass, against transformers + peft on the fixture's own weights
(tools/fixtures/tiny_lora.py: ``base-hf`` is the server's Q4_1 SmolLM2 dequantized, the same
numbers basert reads from the GGUF).

Driven below the daemon: the model's forward with the adapters' row groups, and the tick runner
with ``TickPlan.load_adapters`` and lanes of different sets in one tick. The paged pool must not
share a page computed under one set with a lane of another."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from superfluid.core.request import SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, TickPlan  # noqa: E402
from superfluid.plugins.basert import model as models  # noqa: E402
from superfluid.plugins.basert.dense_attention import DenseAttention  # noqa: E402
from superfluid.plugins.basert.kv_pool import PagedKV  # noqa: E402
from superfluid.plugins.basert.lora import RowLora  # noqa: E402
from superfluid.plugins.basert.runner import BasertRunner  # noqa: E402

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)
LOGIT_TOL = 1e-3  # basert against transformers on the same weights, fp32 (measured without adapters: 1.9e-4)
TIE = 1e-3
A, B, AB, A_HALF = (("a", 1.0),), (("b", 1.0),), (("a", 1.0), ("b", 1.0)), (("a", 0.5),)
SETS = [(), A, B, AB, A_HALF]
TEXTS = ["The quick brown fox", "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
         "The capital of France is", "Once upon a time, in a small village by the sea,", "1, 1, 2, 3, 5, 8,"]


@pytest.fixture(scope="module")
def model(tiny_lora):
    return models.load(str(tiny_lora["base_gguf"]), name="smollm2", device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(tiny_lora):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_lora["base_hf"]))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def peft_model(tiny_lora):
    """transformers' SmolLM2 from the fixture's base directory with both adapters loaded by peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_lora["base_hf"]), dtype=torch.float32).eval()
    pm = PeftModel.from_pretrained(base, str(tiny_lora["a_peft"]), adapter_name="a")
    pm.load_adapter(str(tiny_lora["b_peft"]), adapter_name="b")
    return pm.eval()


@torch.no_grad()
def reference_logits(pm, adapters, tokens: list[int]) -> torch.Tensor:
    """peft's logits for ``tokens`` under ``adapters`` (a set of (name, scale)); () is the base."""
    from peft.tuners.lora import LoraLayer

    if not adapters:
        with pm.disable_adapter():
            return pm(torch.tensor([tokens])).logits[0].float()
    names = [name for name, _ in adapters]
    pm.base_model.set_adapter(names)
    layers = [m for m in pm.modules() if isinstance(m, LoraLayer)]
    saved = [(m, dict(m.scaling)) for m in layers]
    try:
        for m in layers:
            for name, scale in adapters:
                if name in m.scaling:
                    m.scaling[name] = m.scaling[name] * scale
        return pm(torch.tensor([tokens])).logits[0].float()
    finally:
        for m, scaling in saved:
            m.scaling.update(scaling)


def test_one_forward_of_mixed_rows_equals_peft_per_row(model, peft_model, tiny_lora, prompts):
    lora = RowLora(model)
    assert lora.load("a", str(tiny_lora["a_peft"])) is None
    assert lora.load("b", str(tiny_lora["b_peft"])) is None
    try:
        seqs = [(prompts[i % len(prompts)], s) for i, s in enumerate(SETS)]
        flat = [t for toks, _ in seqs for t in toks]
        positions = [p for toks, _ in seqs for p in range(len(toks))]
        attn = DenseAttention(model.shape, len(seqs), 128, CPU, torch.float32)
        attn.begin([(i, 0, len(toks)) for i, (toks, _) in enumerate(seqs)])
        assert lora.begin([s for toks, s in seqs for _ in toks])
        with torch.inference_mode():
            logits = model.logits(model(torch.tensor(flat), torch.tensor(positions), attn))
        lora.end()
        at = 0
        for toks, s in seqs:
            want = reference_logits(peft_model, s, toks)
            got = logits[at:at + len(toks)]
            assert (got - want).abs().max().item() < LOGIT_TOL, s
            at += len(toks)
        # the adapters move the logits far more than the tolerance (else the check above is empty)
        base = reference_logits(peft_model, (), prompts[0])
        for s in (A, B, AB):
            assert (reference_logits(peft_model, s, prompts[0]) - base).abs().max().item() > 1.0
    finally:
        lora.unload("a")
        lora.unload("b")
    assert not lora.hooks  # the last unload took the hooks off


def make_runner(model, n_blocks: int = 512) -> BasertRunner:
    s = model.shape
    pool = PagedKV(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, n_blocks=n_blocks,
                   block_size=16, dtype=torch.float32, device=CPU)
    return BasertRunner(model, pool, set(), StopFlag(), device=CPU)


@pytest.fixture(scope="module")
def runner(model, tiny_lora):
    r = make_runner(model)
    with torch.inference_mode():
        loaded = r.run(TickPlan(load_adapters=[("a", str(tiny_lora["a_peft"])), ("b", str(tiny_lora["b_peft"]))]))
    assert loaded.adapter_errors == {}
    return r


def generate(r, lanes: dict[int, tuple], n: int, grant: int = 4) -> dict[int, list[int]]:
    """Greedy tokens for each slot (slot -> (prompt, adapter set)), every lane in every tick."""
    out = {s: [] for s in lanes}
    plans = [LanePlan(slot=s, pos=0, feed=list(p), sample=True, max_new=grant, reset=True, sampling=GREEDY,
                      ignore_eos=True, adapters=a) for s, (p, a) in lanes.items()]
    with torch.inference_mode():
        while plans:
            res = r.run(TickPlan(lanes=plans))
            nxt = []
            for lp in plans:
                out[lp.slot] += res.lanes[lp.slot].tokens
                got = out[lp.slot]
                if len(got) < n:
                    nxt.append(LanePlan(slot=lp.slot, pos=lp.pos + res.lanes[lp.slot].n_fed, feed=[got[-1]],
                                        sample=True, max_new=min(grant, n - len(got)), decode=True, ignore_eos=True,
                                        adapters=lp.adapters))
            plans = nxt
        r.run(TickPlan(release=list(lanes)))
    return out


def agrees(pm, adapters, prompt: list[int], tokens: list[int]) -> bool:
    """Every token is peft's argmax after the prompt and the tokens before it (teacher-forced),
    but where peft's top two logits tie."""
    logits = reference_logits(pm, adapters, prompt + tokens[:-1])[len(prompt) - 1:]
    for row, token in zip(logits, tokens):
        top = torch.topk(row, 2).values
        if int(row.argmax()) != token and float(top[0] - top[1]) >= TIE:
            return False
    return True


def test_lanes_of_every_set_in_one_tick_decode_as_peft(runner, peft_model, prompts):
    lanes = {slot: (prompts[slot % len(prompts)], s) for slot, s in enumerate(SETS)}
    out = generate(runner, lanes, 16)
    for slot, (prompt, s) in lanes.items():
        assert len(out[slot]) == 16
        assert agrees(peft_model, s, prompt, out[slot]), s
    # the same prompt under a and under the base model: different replies
    alone = generate(runner, {0: (prompts[1], ()), 1: (prompts[1], A)}, 16)
    assert alone[0] != alone[1] and alone[1] == out[1]


def test_a_page_computed_under_one_set_is_never_shared_with_another(runner, prompts):
    """Equal tokens under equal sets share their full pages; under different sets they never do.
    Without the set's root in the page names, the b lane's pages would be the a lane's."""
    long = (prompts[3] * 4)[:48]  # three full pages of 16
    with torch.inference_mode():
        runner.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(long), sample=False, reset=True, sampling=GREEDY, adapters=A)]))
        runner.run(TickPlan(lanes=[LanePlan(slot=1, pos=0, feed=list(long), sample=False, reset=True, sampling=GREEDY, adapters=A)]))
        runner.run(TickPlan(lanes=[LanePlan(slot=2, pos=0, feed=list(long), sample=False, reset=True, sampling=GREEDY, adapters=B)]))
        runner.run(TickPlan(lanes=[LanePlan(slot=3, pos=0, feed=list(long), sample=False, reset=True, sampling=GREEDY)]))
    pool = runner.pool
    tables = {s: pool.block_table(s)[:3] for s in range(4)}
    assert tables[0] == tables[1]  # same set: shared
    assert not set(tables[2]) & set(tables[0]) and not set(tables[3]) & (set(tables[0]) | set(tables[2]))
    with torch.inference_mode():
        runner.run(TickPlan(release=[0, 1, 2, 3]))


def test_a_gguf_adapter_reads_as_its_peft_directory(model, tiny_lora, prompts):
    """llama.cpp's conversion of ``a`` (q rows permuted for its rotary order, un-permuted here)
    gives the PEFT directory's logits."""
    out = {}
    for source in ("a_peft", "a_gguf"):
        lora = RowLora(model)
        assert lora.load("a", str(tiny_lora[source])) is None
        attn = DenseAttention(model.shape, 1, 64, CPU, torch.float32)
        attn.begin([(0, 0, len(prompts[0]))])
        lora.begin([A] * len(prompts[0]))
        with torch.inference_mode():
            out[source] = model.logits(model(torch.tensor(prompts[0]), torch.arange(len(prompts[0])), attn))
        lora.unload("a")
    assert (out["a_peft"] - out["a_gguf"]).abs().max().item() < 1e-4


def test_files_that_do_not_fit_are_adapter_errors(runner, tiny_lora, tmp_path, prompts):
    (tmp_path / "empty").mkdir()
    with torch.inference_mode():
        result = runner.run(TickPlan(load_adapters=[("wrong", str(tiny_lora["wrong_peft"])),
                                                    ("wrong_gguf", str(tiny_lora["wrong_gguf"])),
                                                    ("empty", str(tmp_path / "empty")),
                                                    ("gone", str(tmp_path / "none"))]))
    errors = result.adapter_errors
    assert set(errors) == {"wrong", "wrong_gguf", "empty", "gone"}
    assert "another base model" in errors["wrong"] and "another base model" in errors["wrong_gguf"]
    assert "adapter_config.json" in errors["empty"]
    assert "no such file" in errors["gone"]
    with pytest.raises(RuntimeError, match="not loaded"):
        generate(runner, {0: (prompts[0], (("wrong", 1.0),))}, 2)
    runner.run(TickPlan(release=[0]))
