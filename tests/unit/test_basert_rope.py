"""basert's RoPE context extension (plugins/basert/rope.py) against transformers.

* The frequencies and attention factor of linear and YaRN scaling equal transformers' own rope
  init functions on the same parameters (several factors, original contexts, betas, explicit
  attention factors), and llama.cpp's extrapolation mix reduces to them at its defaults.
* A tiny random LlamaForCausalLM trained on 32 positions, with ``rope_scaling`` set (YaRN and
  linear), against basert loading the same weights with the equivalent --rope-scaling options:
  the logits of every position of a 150-token prompt (far past the original window) agree.
  Without the options basert's logits differ past the window, so the test sees the scaling.
* A config.json that states YaRN itself is read as the same scaling, and the options refuse what
  basert cannot combine (a llama3-scaled model) with a ConfigError naming the engine.
"""

from __future__ import annotations

import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.plugins.basert import model as basert  # noqa: E402
from superfluid.plugins.basert import rope  # noqa: E402
from superfluid.plugins.basert.dense_attention import DenseAttention  # noqa: E402
from superfluid.plugins.basert.shape import ModelShape, parse_rope_scaling  # noqa: E402

VOCAB = 300
TRAIN = 32        # the tiny model's original window
PROMPT = 150      # well past it
COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
              vocab_size=VOCAB, num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False)


def options(**kw) -> types.SimpleNamespace:
    """A model's core rope options at their defaults, ``kw`` set (CORE_OPTIONS.of(model)'s fields)."""
    base = dict(rope_scaling=None, rope_scale=0.0, rope_freq_base=0.0, yarn_orig_ctx=0, yarn_ext_factor=-1.0,
                yarn_attn_factor=-1.0, yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)
    return types.SimpleNamespace(**{**base, **kw})


def hf_init(scaling: dict, head_dim: int = 16, max_position: int = TRAIN * 4):
    """transformers' (inv_freq, attention factor) for ``scaling`` on a Llama config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": head_dim * 4}, max_position_embeddings=max_position,
                                      rope_scaling=scaling)
    inv, attention = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    return inv.float(), float(attention)


def ours(scaling: dict, head_dim: int = 16, base: float = 10000.0):
    shape = types.SimpleNamespace(head_dim=head_dim, rope_theta=base, local_rope_theta=None, rope_freq_factors=None,
                                  max_position=TRAIN * 4, rope_scaling=parse_rope_scaling(scaling, "t"))
    return basert.rope_inv_freq(shape, local=False), rope.attention_factor(shape.rope_scaling)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAIN},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0,
     "beta_slow": 2.0},
    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 2048, "attention_factor": 1.3},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.7,
     "mscale_all_dim": 0.5},
])
def test_frequencies_equal_transformers(scaling):
    for head_dim in (16, 64):
        want_inv, want_attention = hf_init(scaling, head_dim)
        got_inv, got_attention = ours(scaling, head_dim)
        assert torch.allclose(got_inv, want_inv, rtol=1e-6, atol=0), (scaling, head_dim)
        assert got_attention == pytest.approx(want_attention, rel=1e-9)


def _shape(scaling=None) -> ModelShape:
    return ModelShape(arch="llama", vocab_size=VOCAB, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, intermediate_size=96, rms_eps=1e-6, rope_theta=1e4, max_position=TRAIN,
                      tie_embeddings=False, windows=(None, None), attn_scale=0.25, rope_scaling=scaling)


def test_options_give_the_hf_scaling():
    """--rope-scaling yarn --rope-scale 4 is transformers' yarn {factor 4, original: the training
    window}; --yarn-attn-factor multiplies its mscale as llama.cpp's attn_factor does; an
    extrapolation mix of 0 is plain linear interpolation; --rope-scaling none drops a model's own."""
    shape = _shape()
    yarn = rope.with_options(shape, options(rope_scaling="yarn", rope_scale=4.0), "t").rope_scaling
    assert yarn == parse_rope_scaling({"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": TRAIN}, "t")
    scaled = rope.with_options(shape, options(rope_scaling="yarn", rope_scale=4.0, yarn_attn_factor=0.5), "t")
    assert rope.attention_factor(scaled.rope_scaling) == pytest.approx(0.5 * rope.mscale(4.0))
    flat = rope.with_options(shape, options(rope_scaling="yarn", rope_scale=4.0, yarn_ext_factor=0.0), "t")
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    assert torch.allclose(rope.scaled_inv_freq(inv, flat.rope_scaling, 16, 1e4, TRAIN), inv / 4)
    assert rope.attention_factor(flat.rope_scaling) == 1.0
    linear = rope.with_options(shape, options(rope_scaling="linear", rope_scale=2.0), "t").rope_scaling
    assert linear.kind == "linear" and linear.factor == 2.0 and not linear.ext_factor
    assert rope.with_options(shape, options(), "t") is shape
    assert rope.with_options(shape, options(rope_freq_base=5e5), "t").rope_theta == 5e5
    assert rope.with_options(_shape(yarn), options(rope_scaling="none"), "t").rope_scaling is None
    own = _shape(parse_rope_scaling({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                     "attention_factor": 1.25}, "t"))
    kept = rope.with_options(own, options(yarn_beta_fast=8.0), "t").rope_scaling  # the rest stays the model's
    assert (kept.factor, kept.original_max_position, kept.beta_fast, kept.attention) == (4.0, 16, 8.0, 1.25)
    llama3 = _shape(parse_rope_scaling({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, "t"))
    with pytest.raises(ConfigError, match="engine 'basert'"):
        rope.with_options(llama3, options(rope_scaling="yarn", rope_scale=2.0), "t")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random LlamaForCausalLM with a 32-position window (saved without scaling)."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, max_position_embeddings=TRAIN)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    folder = tmp_path_factory.mktemp("llama-rope")
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def _basert_logits(folder, core) -> torch.Tensor:
    model = basert.load(str(folder), name="t", device=torch.device("cpu"), dtype=torch.float32)
    rope.apply(model, core, "t", "cpu")
    tokens = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1))
    attn = DenseAttention(model.shape, 1, PROMPT, "cpu", torch.float32)
    attn.begin([(0, 0, PROMPT)])
    with torch.no_grad():
        return model.logits(model(tokens, torch.arange(PROMPT), attn))


def _hf_logits(folder, scaling: dict) -> torch.Tensor:
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, rope_parameters={**scaling, "rope_theta": 10000.0},
                                                       max_position_embeddings=TRAIN * 8).eval()
    tokens = torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return hf(tokens[None]).logits[0].float()


@pytest.mark.parametrize("kind,core,scaling", [
    ("yarn", options(rope_scaling="yarn", rope_scale=4.0),
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAIN}),
    ("yarn-betas", options(rope_scaling="yarn", rope_scale=8.0, yarn_orig_ctx=TRAIN, yarn_beta_fast=8.0,
                           yarn_beta_slow=2.0),
     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": TRAIN, "beta_fast": 8.0,
      "beta_slow": 2.0}),
    ("linear", options(rope_scaling="linear", rope_scale=4.0), {"rope_type": "linear", "factor": 4.0}),
])
def test_logits_past_the_window_equal_transformers(tiny_dir, kind, core, scaling):
    want = _hf_logits(tiny_dir, scaling)
    got = _basert_logits(tiny_dir, core)
    assert want.abs().max() > 0.1
    diff = (got - want).abs().max().item()
    assert diff < 1e-4, f"{kind}: max |Δlogit| {diff:.2e}"
    unscaled = _basert_logits(tiny_dir, options())
    assert (unscaled[TRAIN:] - want[TRAIN:]).abs().max().item() > 1e-2  # the options changed the model


def test_config_yarn_is_read(tmp_path, tiny_dir):
    """A config.json that states YaRN (as Qwen's long-context configs do) runs it without options."""
    import json
    import shutil

    folder = tmp_path / "yarn-config"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": TRAIN}
    config.update(rope_scaling=scaling, max_position_embeddings=TRAIN * 4)
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps(config))
    diff = (_basert_logits(folder, options()) - _hf_logits(tiny_dir, scaling)).abs().max().item()
    assert diff < 1e-4
