"""Images on the MLX engine (plugins/mlx/vision.py): the tiny SmolVLM (tools/fixtures/tiny_vlm.py)
served from its Hugging Face directory, its vision half through mlx-vlm, its language half in the
MLX tick machinery, driven with TickPlans through the engine (its worker process, the plans
pickled over the pipe with their images) and through the runner in this process:

- greedy tokens for a red and a blue image equal transformers' (tests/vision_reference.py) and
  differ; two image lanes in one tick equal each alone; the same image twice is encoded once;
- an image fed in pieces (cut inside it, a single image row as a step of its own, small steps)
  equals it fed whole; penalties never see a placeholder;
- mlx-vlm is optional: without it a vision directory is a ConfigError naming the extra, and a
  text model serves with mlx-vlm unimportable in its worker."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'superfluid[mlx]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'superfluid[mlx]')")

from superfluid.core.config import ModelConfig  # noqa: E402
from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.core.media import Image, spans_within  # noqa: E402
from superfluid.core.request import SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, TickPlan  # noqa: E402
from superfluid.plugins.mlx import vision  # noqa: E402
from superfluid.plugins.mlx.engine import MlxEngine  # noqa: E402

from tests import vision_reference as ref  # noqa: E402
from tools.fixtures.tiny_vlm import build  # noqa: E402

from ..tinygguf import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

GREEDY = SamplingParams(temperature=0.0)
RED, BLUE, GREEN, YELLOW, GREY = (255, 0, 0), (0, 0, 255), (0, 160, 0), (230, 220, 0), (128, 128, 128)
MAX_NEW = 8

needs_mlx_vlm = pytest.mark.skipif(not vision.mlx_vlm_installed(),
                                   reason="mlx-vlm is not installed (pip install 'superfluid[mlx-vlm]')")


@pytest.fixture(scope="module")
def hf() -> str:
    return str(build(gguf=False)["hf"])


def _config(name: str, path: str, lanes: int = 4) -> ModelConfig:
    return ModelConfig(name, path, "mlx", {"max-batch": lanes, "max-context": 2048})


@pytest.fixture(scope="module")
def engine(hf):
    if not vision.mlx_vlm_installed():
        pytest.skip("mlx-vlm is not installed (pip install 'superfluid[mlx-vlm]')")
    eng = MlxEngine(model=_config("vlm", hf), config=None)
    eng.start()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def runner(hf):
    """A runner in this process (factory: a fresh one each call, sharing the loaded model).
    ``image_encoding="tick"`` for a test that reads one tick's result: with the default
    (background) encoding a tick may end while its image still encodes, having fed only the
    tokens before it, which is right for the scheduler and a race for such a test."""
    if not vision.mlx_vlm_installed():
        pytest.skip("mlx-vlm is not installed (pip install 'superfluid[mlx-vlm]')")
    from superfluid.plugins.mlx.runner import MlxRunner

    model, encoder = vision.load(hf)
    return lambda image_encoding=None: MlxRunner(model, set(), StopFlag(), 4 * 2048, encoder=encoder,
                                                 image_encoding=image_encoding)


def quadrants(size: int = 64) -> Image:
    """Four colours, one a quarter: unlike a solid image, its rows differ, so their order counts."""
    px = np.zeros((size, size, 3), np.uint8)
    half = size // 2
    px[:half, :half], px[:half, half:], px[half:, :half], px[half:, half:] = RED, BLUE, GREEN, YELLOW
    return Image.from_rgb(size, size, px.tobytes())


def _prompt(hf: str, rgb, before: str = "What colour is this?", after: str = " It is", size=ref.WIDE):
    return ref.prompt(hf, before, [ref.solid(rgb, size)], after)


def _generate(run, lanes: dict, n: int = MAX_NEW, grant: int = 3, sampling=GREEDY):
    """Drive ``run`` (a TickPlan to its TickResult) as the scheduler would: each lane's prompt
    (tokens, spans) prefilled with its first token (what a tick did not feed, e.g. past an image
    still encoding off the tick, is planned again), then decode grants, ``n`` tokens whatever
    they are. The tokens per lane and the images encoded over all ticks."""
    out = {s: [] for s in lanes}
    pos = {s: 0 for s in lanes}
    plans = [LanePlan(slot=s, pos=0, feed=list(t), sample=True, max_new=grant, reset=True, sampling=sampling,
                      ignore_eos=True, media=spans) for s, (t, spans) in lanes.items()]
    encoded = 0
    while plans:
        res = run(TickPlan(lanes=plans))
        encoded += res.encoded
        nxt = []
        for lp in plans:
            lr = res.lanes[lp.slot]
            assert not lr.restore_failed
            out[lp.slot] += lr.tokens
            pos[lp.slot] += lr.n_fed
            tokens, spans = lanes[lp.slot]
            if pos[lp.slot] < len(tokens):  # the prompt's rest
                nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=list(tokens[pos[lp.slot]:]), sample=True,
                                    max_new=grant, ignore_eos=True,
                                    media=spans_within(spans, pos[lp.slot], len(tokens))))
            elif len(out[lp.slot]) < n:
                nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=[out[lp.slot][-1]], sample=True,
                                    max_new=min(grant, n - len(out[lp.slot])), decode=True, ignore_eos=True))
        plans = nxt
    return out, encoded


# ---- what the engine declares ------------------------------------------------------------------

@needs_mlx_vlm
def test_a_vision_directory_declares_images_and_a_text_model_does_not(engine, hf, tmp_path):
    assert engine.capabilities.vision
    assert engine.info.vision == ref.layout(hf)
    assert engine.info.n_embd == 64 and engine.info.n_ctx_train == 8192  # the language half's
    assert engine.describe()["mlx_vlm"] == "0.7.10"
    text = MlxEngine(model=_config("tiny", str(write_tiny_llama(tmp_path / "t.gguf", quant="Q8_0"))), config=None)
    try:
        assert not text.capabilities.vision and text.info.vision is None
    finally:
        text.close()


# ---- through the engine (its worker) --------------------------------------------------------

@needs_mlx_vlm
@pytest.mark.parametrize("size", [ref.WIDE, ref.TALL], ids=["wide", "tall"])
def test_red_and_blue_equal_the_transformers_reference_and_differ(engine, hf, size):
    """Wide and tall images, split into 2 x 4 and 4 x 2 tiles plus the global image (36 rows)."""
    got = {}
    for rgb in (RED, BLUE):
        tokens, spans = _prompt(hf, rgb, size=size)
        assert len(spans) == 9 and sum(s.rows for s in spans) == 36
        out, encoded = _generate(engine.run_tick, {0: (tokens, spans)})
        assert out[0] == ref.greedy(hf, tokens, spans, MAX_NEW), rgb
        assert encoded == 1
        got[rgb] = out[0]
    assert got[RED] != got[BLUE]


@needs_mlx_vlm
def test_two_image_lanes_in_one_tick_equal_one_at_a_time(engine, hf):
    lanes = {1: _prompt(hf, GREEN, "Describe it."), 2: _prompt(hf, YELLOW, "And this one, please?", " Well,", ref.TALL)}
    alone = {slot: _generate(engine.run_tick, {slot: lane})[0][slot] for slot, lane in lanes.items()}
    together, encoded = _generate(engine.run_tick, lanes)
    assert together == alone
    assert encoded == 0  # both images were encoded alone, and are held by content
    assert alone[1] != alone[2]


@needs_mlx_vlm
def test_the_same_image_twice_encodes_once(engine, hf):
    image = ref.solid(GREY)
    a = ref.prompt(hf, "Once more:", [image], " ok")
    b = ref.prompt(hf, "The same picture, other words:", [image], " so")
    got, encoded = _generate(engine.run_tick, {0: a, 3: b})
    assert encoded == 1
    again, encoded = _generate(engine.run_tick, {1: a})
    assert encoded == 0 and again[1] == got[0]
    assert got[0] == ref.greedy(hf, *a, MAX_NEW) and got[3] == ref.greedy(hf, *b, MAX_NEW)


# ---- through the runner, in this process ----------------------------------------------------

@needs_mlx_vlm
def test_two_images_fed_in_pieces_equal_them_fed_whole(runner, hf):
    """Cuts before, inside and after each image (one image row alone as a single-token step), and
    small steps within a tick: the same tokens as one whole feed, which equal transformers'."""
    tokens, spans = ref.prompt(hf, "Two pictures:", [quadrants(), ref.solid(BLUE)], " Which is red?")
    want = ref.greedy(hf, tokens, spans, MAX_NEW)
    whole, _ = _generate(runner().run, {0: (tokens, spans)})
    assert whole[0] == want
    first, second = spans[0], spans[-1]  # the first image's first tile, the second's global image
    cuts = sorted({first.start - 1, first.start + 1, first.start + 2, second.start, second.start + 3, second.end + 1})
    r = runner("tick")
    pos, encoded = 0, 0
    for end in cuts:
        res = r.run(TickPlan(lanes=[LanePlan(slot=0, pos=pos, feed=tokens[pos:end], sample=False, reset=pos == 0,
                                             sampling=GREEDY, media=spans_within(spans, pos, end))]))
        assert res.lanes[0].n_fed == end - pos
        encoded += res.encoded
        pos = end
    lp = LanePlan(slot=0, pos=pos, feed=tokens[pos:], sample=True, max_new=MAX_NEW, ignore_eos=True,
                  media=spans_within(spans, pos, len(tokens)))
    res = r.run(TickPlan(lanes=[lp]))
    assert res.lanes[0].tokens == want
    assert encoded + res.encoded == 2
    # a whole feed in steps of 3 tokens: images split across steps
    r = runner("tick")
    res = r.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(tokens), sample=True, max_new=MAX_NEW, reset=True,
                                         sampling=GREEDY, ignore_eos=True, media=spans)], step_tokens=3))
    assert res.lanes[0].tokens == want and len(res.steps) > len(tokens) // 3


def _reference_logprobs(hf: str, tokens, spans) -> np.ndarray:
    """transformers' log-probabilities after the prompt (its last position), the image's pixels
    cut by its processor."""
    import torch

    from superfluid.core.media import images_of

    model = ref._model(hf)
    ids = torch.tensor([[model.config.image_token_id if t < 0 else t for t in tokens]])
    pixels = ref.processor(hf).image_processor([[ref.pil(i) for i in images_of(spans)]], return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels["pixel_values"],
                       pixel_attention_mask=pixels["pixel_attention_mask"]).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1).numpy()


@needs_mlx_vlm
def test_logprobs_after_an_image_equal_transformers(runner, hf):
    """Greedy tokens hardly see the order of an image's rows in a model this small (the last
    position's logits move by ~3e-3 when they are reversed); its log-probabilities do."""
    tokens, spans = ref.prompt(hf, "Look:", [quadrants()], " What is top left?")
    res = runner("tick").run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(tokens), sample=True, max_new=1,
                                                      reset=True, sampling=SamplingParams(temperature=0.0, logprobs=5),
                                                media=spans)], step_tokens=5))
    want = _reference_logprobs(hf, tokens, spans)
    got = res.lanes[0].logprobs[0]
    assert got.token == int(want.argmax())
    assert [t for t, _ in got.top] == [int(i) for i in np.argsort(-want)[:5]]
    assert max(abs(lp - want[t]) for t, lp in got.top) < 5e-5  # 5e-4 with the rows reversed


@needs_mlx_vlm
@pytest.mark.parametrize("size", [(200, 64), (64, 200), (600, 300), (64, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_encoders_rows_equal_transformers_image_features(hf, size):
    """mlx-vlm's tower over every tile and the global image, as the processor cuts a noise image:
    transformers' ``get_image_features`` row for row."""
    _, encoder = vision.load(hf)
    image = ref.noise(size)
    got = encoder(ref.fit(hf, image))
    want = ref.features(hf, [image])[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


@needs_mlx_vlm
def test_penalties_never_see_a_placeholder(runner, hf):
    tokens, spans = _prompt(hf, RED)
    r = runner("tick")
    sampling = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5, penalty_last_n=64)
    res = r.run(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=list(tokens), sample=True, max_new=4, reset=True,
                                         sampling=sampling, ignore_eos=True, media=spans)]))
    out = res.lanes[0].tokens
    assert len(out) == 4
    assert r.samplers[0].tokens == [t for t in tokens if t >= 0] + out


@needs_mlx_vlm
def test_a_quantized_mlx_vlm_directory_runs_its_language_half_quantized(hf, tmp_path):
    """mlx-vlm's own conversion (8 bits, groups of 32): the language half moves into mlx-lm's
    model as the quantized modules mlx-vlm loaded, and its first tokens are the float model's."""
    from mlx_vlm.convert import convert

    from superfluid.plugins.mlx.runner import MlxRunner

    out = tmp_path / "q8"
    convert(hf_path=hf, mlx_path=str(out), quantize=True, q_group_size=32, q_bits=8)
    model, encoder = vision.load(str(out))
    kinds = {type(m).__name__ for _, m in model.named_modules()}
    assert {"QuantizedLinear", "QuantizedEmbedding"} <= kinds and "Linear" not in kinds
    assert model.model.layers[0].self_attn.q_proj.bits == 8
    for rgb in (RED, BLUE):
        tokens, spans = _prompt(hf, rgb)
        got, _ = _generate(MlxRunner(model, set(), StopFlag(), 4096, encoder=encoder).run, {0: (tokens, spans)}, n=3)
        assert got[0][:3] == ref.greedy(hf, tokens, spans, 3), rgb


# ---- mlx-vlm is optional ------------------------------------------------------------------------

def test_without_mlx_vlm_a_vision_model_is_a_config_error_naming_the_extra(hf, monkeypatch):
    monkeypatch.setattr(vision, "mlx_vlm_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"mlx-vlm is not installed \(pip install 'superfluid\[mlx-vlm\]'\)"):
        MlxEngine(model=_config("vlm", hf), config=None)


def test_a_vision_model_of_another_family_is_refused(hf, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(hf, other, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "llava"  # (Gemma 3 and Qwen-VL serve their text half: test_vlm_families_other_engines)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="does not serve.*idefics3"):
        MlxEngine(model=_config("other", str(other)), config=None)


def test_a_text_model_serves_with_mlx_vlm_unimportable(tmp_path, monkeypatch):
    """A shim that fails to import stands first on the path the spawned worker inherits."""
    shim = tmp_path / "shim" / "mlx_vlm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('mlx-vlm is blocked in this test')\n")
    monkeypatch.syspath_prepend(str(shim.parent))
    path = str(write_tiny_llama(tmp_path / "t.gguf", quant="Q8_0", n_layer=2, n_embd=64, n_ff=128))
    eng = MlxEngine(model=_config("tiny", path, lanes=1), config=None)
    try:
        assert not eng.capabilities.vision
        eng.start()
        prompt = eng.tokenize("the water is")
        res = eng.run_tick(TickPlan(lanes=[LanePlan(slot=0, pos=0, feed=prompt, sample=True, max_new=4, reset=True,
                                                    sampling=GREEDY, ignore_eos=True)]))
        assert len(res.lanes[0].tokens) == 4 and res.encoded == 0
    finally:
        eng.close()
