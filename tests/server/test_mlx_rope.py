"""Rope scaling on the MLX engine (plugins/mlx/rope_config.py): the options become the
``rope_scaling`` mlx-lm builds its RoPE from, so the reference is mlx-lm itself loading a
config.json that says the same.

* The options' fields: yarn and linear from --rope-scale / --yarn-orig-ctx / betas, YaRN's
  attention factor as mlx-lm's ``mscale``, the model's own scaling kept or dropped, and what
  mlx-lm cannot run (an extrapolation mix other than 1, betas under linear) refused, naming the
  engine.
* A tiny random-weight llama GGUF (tests/tinygguf.py: a 64-token training window, weights spread
  enough that positions matter) with ``--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 64``:
  the logits of a 200-token prompt (past the 64-token window) equal mlx-lm's ``load_model`` of
  the same weights as a directory whose config.json states that YaRN, and differ from the
  unscaled model's.
* Served: --max-context 256 (four times the training window) is accepted with scaling, and a
  greedy reply through the openai client to a ~240-token prompt equals mlx-lm's
  ``generate_step`` on the YaRN-configured directory.

The tiny model takes the path SmolLM2 did (GGUF loader, rope overrides, mlx-lm's YarnRoPE) at a
fraction of the weights, so the cost is the server's start, not three 135M-parameter loads.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")

from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.plugins.mlx import loader, rope_config  # noqa: E402
from superfluid.plugins.vocab import GGUFVocab  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

WINDOW = 64  # the tiny model's training context, and the YaRN's original window
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}
TOKENS = 10
NOTES = 8    # a ~240-token prompt with the tiny vocabulary: past the window, and with the reply within 256


def options(**kw) -> types.SimpleNamespace:
    base = dict(rope_scaling=None, rope_scale=0.0, rope_freq_base=0.0, yarn_orig_ctx=0, yarn_ext_factor=-1.0,
                yarn_attn_factor=-1.0, yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)
    return types.SimpleNamespace(**{**base, **kw})


def test_options_become_mlx_lm_rope_fields(tmp_path, model_path):
    o = rope_config.overrides
    assert o(options(), model_path, 8192, "m") == {}
    assert o(options(rope_scaling="yarn", rope_scale=4.0, yarn_orig_ctx=64), model_path, 8192, "m") == \
        {"rope_scaling": YARN}
    assert o(options(rope_scaling="yarn", rope_scale=2.0), model_path, 8192, "m")["rope_scaling"][
        "original_max_position_embeddings"] == 8192  # the training window
    assert o(options(rope_scale=2.0), model_path, 8192, "m") == {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    betas = o(options(rope_scaling="yarn", rope_scale=4.0, yarn_beta_fast=8.0, yarn_beta_slow=2.0), model_path, 64, "m")
    assert betas["rope_scaling"]["beta_fast"] == 8.0 and betas["rope_scaling"]["beta_slow"] == 2.0
    assert o(options(rope_freq_base=5e5), model_path, 8192, "m") == {"rope_theta": 5e5}
    # --yarn-attn-factor A multiplies YaRN's 0.1 ln F + 1; mlx-lm takes it as mscale m: 0.1 m ln F + 1
    import math

    scaled = o(options(rope_scaling="yarn", rope_scale=4.0, yarn_attn_factor=0.5), model_path, 64, "m")["rope_scaling"]
    assert 0.1 * scaled["mscale"] * math.log(4.0) + 1 == pytest.approx(0.5 * (0.1 * math.log(4.0) + 1))
    assert scaled["mscale_all_dim"] == 0.0
    for refused in (options(rope_scaling="yarn", rope_scale=4.0, yarn_ext_factor=0.5),
                    options(rope_scaling="linear", rope_scale=2.0, yarn_beta_fast=8.0)):
        with pytest.raises(ConfigError, match="engine 'mlx'"):
            o(refused, model_path, 8192, "m")
    # a directory's own YaRN: kept where the options do not change it, dropped by --rope-scaling none
    folder = tmp_path / "own"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 256, "rope_scaling": {
        **YARN, "beta_fast": 16.0, "attention_factor": 1.2}}))
    kept = o(options(yarn_beta_slow=2.0), str(folder), 256, "m")["rope_scaling"]
    assert (kept["factor"], kept["original_max_position_embeddings"], kept["beta_fast"], kept["beta_slow"]) == \
        (4.0, 64, 16.0, 2.0)
    assert 0.1 * kept["mscale"] * math.log(4.0) + 1 == pytest.approx(1.2)
    assert o(options(rope_scaling="none"), str(folder), 256, "m") == {"rope_scaling": None}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The tiny llama GGUF with a 64-token training window; std 0.2 makes attention sharp enough
    that rope frequencies move the logits (at tinygguf's default 0.02 attention is nearly uniform)."""
    from ..tinygguf import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("rope") / "tiny-64.gguf", context_length=WINDOW, std=0.2))


@pytest.fixture(scope="module")
def yarn_dir(tmp_path_factory, tiny):
    """The tiny GGUF as an mlx-lm directory whose config.json states YaRN x4 over 64: its weights
    and model arguments as plugins/mlx/convert writes them (convert's tokenizer is byte-level BPE
    only, and load_model needs none)."""
    raw, meta = mx.load(tiny, return_metadata=True)
    folder = tmp_path_factory.mktemp("tiny-mlx") / "yarn"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), loader.rename_gguf(raw), metadata={"format": "mlx"})
    config = dict(loader.gguf_model_args(meta, raw), architectures=["LlamaForCausalLM"], rope_scaling=YARN)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_logits_past_the_window_equal_mlx_lm(tiny, yarn_dir):
    import numpy as np
    from mlx_lm.utils import load_model

    core = options(rope_scaling="yarn", rope_scale=4.0, yarn_orig_ctx=WINDOW)
    fields = rope_config.overrides(core, tiny, WINDOW, "m")
    reference, _ = load_model(Path(yarn_dir))
    tokens = mx.array([list(range(200, 400))])
    want = np.array(reference(tokens).astype(mx.float32))[0]
    got = np.array(loader.load(tiny, fields)(tokens).astype(mx.float32))[0]
    plain = np.array(loader.load(tiny)(tokens).astype(mx.float32))[0]
    assert np.abs(got - want).max() < 1e-4
    assert np.abs(plain[WINDOW:] - want[WINDOW:]).max() > 1.0  # the scaling changed the model past the window


def test_served_with_yarn_equals_mlx_lm_generate(start_server, tiny, yarn_dir):
    openai = pytest.importorskip("openai")
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    srv = start_server("--engine", "mlx", "--max-batch", "2", "--max-context", str(4 * WINDOW), "--rope-scaling",
                       "yarn", "--rope-scale", "4", "--yarn-orig-ctx", str(WINDOW), model=tiny)
    listed = {m["id"]: m for m in srv.get_json("/v1/models")["data"]}
    assert listed["smollm2"]["context_length"] == 4 * WINDOW  # four times the training window: scaling is on
    notes = " ".join(f"Note {i}: the team ships the {i}th part on day {i}." for i in range(NOTES))
    prompt = f"<|im_start|>user\n{notes}\nWhich day is the 7th part shipped?<|im_end|>\n<|im_start|>assistant\n"
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300, max_retries=0)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    served, n_prompt = r.choices[0].text, r.usage.prompt_tokens
    srv.stop()

    vocab = GGUFVocab(tiny, "smollm2")
    try:
        ids = vocab.tokenize(prompt, True, True)
        assert 4 * WINDOW - TOKENS >= len(ids) == n_prompt > 150
        model, _ = load_model(Path(yarn_dir))
        toks = [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=TOKENS), range(TOKENS))]
        own = b"".join(vocab.token_bytes(t) for t in toks).decode("utf-8", errors="replace")
    finally:
        vocab.close()
    assert served == own, (served, own)
