"""basert serving the tiny SmolVLM (tools/fixtures/tiny_vlm.py) from both of its forms, the
Hugging Face directory and the text GGUF with its mmproj beside it: the engine is configured
as ``superfluid serve`` configures it and driven with tick plans as the scheduler drives it
(image placeholders in the feed, ``LanePlan.media`` naming the spans the feed touches).

Greedy tokens for a red and a blue image equal transformers' (``tests/vision_reference.py``)
and differ; two image lanes in one tick give what each gives alone; the same image is encoded
once; a prompt cut inside an image (across ticks and across steps) gives the same tokens;
speculation never drafts a placeholder and penalties never count one; a text-only model
declares no vision."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from superfluid.core.cli import load  # noqa: E402
from superfluid.core.errors import ConfigError  # noqa: E402
from superfluid.core.media import MediaSpan, spans_within  # noqa: E402
from superfluid.core.request import SamplingParams  # noqa: E402
from superfluid.core.stop_flag import StopFlag  # noqa: E402
from superfluid.core.tick import LanePlan, TickPlan  # noqa: E402
from superfluid.plugins.basert import create_engine, vision  # noqa: E402
from superfluid.plugins.basert.kv_pool import PagedKV  # noqa: E402
from superfluid.plugins.basert.runner import BasertRunner  # noqa: E402
from tests import vision_reference as ref  # noqa: E402
from tools.fixtures.tiny_vlm import build  # noqa: E402

from ..tinygguf import write_tiny_llama  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)
GREEDY = SamplingParams(temperature=0.0)
N = 8


@pytest.fixture(scope="module", autouse=True)
def _threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def vlm():
    return build()


def engine_for(path, *flags: str, name: str = "vlm"):
    """A BasertEngine configured exactly as ``superfluid serve --model PATH --engine basert FLAGS``."""
    config, _pm = load(["serve", "--model", str(path), "--model-name", name, "--engine", "basert", "--threads", "2",
                        "--device", "cpu", "--max-context", "512", "--max-batch", "4", *flags])
    return create_engine(model=config.models[0], config=config)


@pytest.fixture(scope="module", params=["hf", "gguf"])
def engine(request, vlm):
    """A started engine on the HF directory, or on the text GGUF (its mmproj found beside it)."""
    e = engine_for(vlm[request.param])
    e.start()
    yield e
    e.close()


@functools.cache
def prompt(hf_dir: str, rgb, text: str = " What colour is this?\nAssistant:", size=ref.WIDE):
    """Our layout of a chat with a one-colour image (checked equal to transformers' processor's)."""
    return ref.prompt(hf_dir, "<|im_start|>User:", [ref.solid(rgb, size)], text)


@functools.cache
def want(hf_dir: str, rgb, text: str = " What colour is this?\nAssistant:", size=ref.WIDE) -> list[int]:
    """transformers' greedy tokens for it: its processor's text and pixels, its model's generate."""
    return ref.generate(hf_dir, "<|im_start|>User:<image>" + text, [ref.solid(rgb, size)], N)[0]


def generate(run, lanes: dict[int, tuple[list[int], tuple[MediaSpan, ...]]], n: int = N, *, chunk: int = 0,
             grant: int = 4, step_tokens: int = 0, sampling=GREEDY, ticks: list | None = None):
    """Greedy tokens per slot, as the scheduler plans them: the prompt (in ``chunk``-token ticks
    if set, each feed with the spans it touches), the first token, then decode grants. ``run``
    runs one TickPlan (an engine's ``run_tick`` or a runner's ``run``); ``ticks`` gathers the
    results."""
    out = {s: [] for s in lanes}
    pos = {s: 0 for s in lanes}

    def prefill(slot):
        tokens, spans = lanes[slot]
        start = pos[slot]
        end = len(tokens) if not chunk else min(len(tokens), start + chunk)
        return LanePlan(slot=slot, pos=start, feed=tokens[start:end], sample=end == len(tokens), max_new=grant,
                        reset=start == 0, sampling=sampling if start == 0 else None, ignore_eos=True,
                        media=spans_within(spans, start, end))

    plans = [prefill(s) for s in lanes]
    with torch.inference_mode():
        while plans:
            res = run(TickPlan(lanes=plans, step_tokens=step_tokens))
            if ticks is not None:
                ticks.append(res)
            nxt = []
            for lp in plans:
                lr = res.lanes[lp.slot]
                assert not lr.restore_failed
                out[lp.slot] += lr.tokens
                pos[lp.slot] += lr.n_fed
                if not lp.sample:
                    nxt.append(prefill(lp.slot))
                elif len(out[lp.slot]) < n:
                    nxt.append(LanePlan(slot=lp.slot, pos=pos[lp.slot], feed=[out[lp.slot][-1]], sample=True,
                                        max_new=min(grant, n - len(out[lp.slot])), decode=True, ignore_eos=True))
            plans = nxt
    return out


def test_the_engine_declares_vision_and_the_layout(engine, vlm):
    assert engine.capabilities.vision
    assert engine.info.vision == ref.layout(vlm["hf"])
    assert engine.info.n_embd == 64
    assert engine.describe()["vision"]["rows"] == 4


@pytest.mark.parametrize("size", [ref.WIDE, ref.TALL], ids=["wide", "tall"])
def test_red_and_blue_give_transformers_tokens_and_differ(engine, vlm, size):
    """Wide and tall images: 2 x 4 and 4 x 2 tiles plus the global image, 9 spans of 4 rows."""
    hf = str(vlm["hf"])
    got = {}
    for rgb in (RED, BLUE):
        lane = prompt(hf, rgb, size=size)
        assert [s.rows for s in lane[1]] == [4] * 9
        got[rgb] = generate(engine.run_tick, {0: lane})[0]
        assert got[rgb] == want(hf, rgb, size=size), rgb
    assert got[RED] != got[BLUE]


def test_two_image_lanes_in_one_tick_equal_each_alone(engine, vlm):
    hf = str(vlm["hf"])
    text_only = ref.prompt(hf, "<|im_start|>User: Name a colour.\nAssistant:", [])
    lanes = {0: prompt(hf, RED, " Describe it."), 1: prompt(hf, BLUE, " Describe it.", ref.TALL), 2: text_only}
    ticks: list = []
    together = generate(engine.run_tick, lanes, ticks=ticks)
    assert ticks[0].lanes[0].n_prefill == len(lanes[0][0]) and ticks[0].lanes[1].n_prefill == len(lanes[1][0])
    for slot, lane in lanes.items():
        assert together[slot] == generate(engine.run_tick, {3: lane})[3], slot
    assert together[0] == want(hf, RED, " Describe it.")
    assert together[0] != together[1]


def test_the_same_image_is_encoded_once(engine, vlm):
    hf = str(vlm["hf"])
    before = engine.runner.media.encodes
    ticks: list = []
    first = generate(engine.run_tick, {0: prompt(hf, GREEN, " Once.")}, ticks=ticks)[0]
    assert ticks[0].encoded == 1 and engine.runner.media.encodes == before + 1
    ticks.clear()
    # the same image again, in two lanes at once and behind other text: no encoder run
    again = generate(engine.run_tick, {1: prompt(hf, GREEN, " Once."), 2: prompt(hf, GREEN, " Twice.")}, ticks=ticks)
    assert [t.encoded for t in ticks] == [0] * len(ticks)
    assert engine.runner.media.encodes == before + 1
    assert again[1] == first


@pytest.mark.parametrize("chunk,step_tokens", [(3, 0), (0, 2), (5, 3)])
def test_a_prompt_cut_inside_the_image_gives_the_same_tokens(engine, vlm, chunk, step_tokens):
    """Ticks of ``chunk`` tokens and steps of ``step_tokens``: the image's rows are fed a few
    at a time, from the middle of its spans, in several steps (any 3 or 2 positions in a row hold a
    cut, so one falls inside every tile's 4 rows)."""
    hf = str(vlm["hf"])
    lane = prompt(hf, BLUE)
    got = generate(engine.run_tick, {0: lane, 1: prompt(hf, RED)}, chunk=chunk, step_tokens=step_tokens)
    assert got[0] == want(hf, BLUE) and got[1] == want(hf, RED)


def test_speculation_never_drafts_a_placeholder(engine, vlm):
    """A lane whose history holds the image: its prompt-lookup drafts stop before a placeholder
    (decoding ``<global-img>``, whose earlier occurrence is followed by the image's rows, would
    otherwise draft them), and the tokens stay the greedy ones."""
    hf = str(vlm["hf"])
    s = engine.model.shape
    pool = PagedKV(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, n_blocks=64, block_size=16,
                   dtype=torch.float32, device=torch.device("cpu"))
    r = BasertRunner(engine.model, pool, set(), StopFlag(), device=torch.device("cpu"), speculate=4,
                     encoder=vision.encoder(engine.vision))
    lane = prompt(hf, RED)
    assert generate(r.run, {0: lane}, 12) == generate(engine.run_tick, {0: lane}, 12)
    tokens, spans = lane
    glob = engine.info.vision.before[-1]
    with torch.inference_mode():
        r.run(TickPlan(lanes=[LanePlan(slot=1, pos=0, feed=tokens, sample=True, max_new=1, reset=True,
                                       sampling=GREEDY, ignore_eos=True, media=spans)]))
        res = r.run(TickPlan(lanes=[LanePlan(slot=1, pos=len(tokens), feed=[glob], sample=True, max_new=3,
                                             decode=True, ignore_eos=True)]))
    assert len(res.lanes[1].tokens) == 3 and all(t >= 0 for t in res.lanes[1].tokens)
    assert all(t >= 0 for t in r.pool.tokens(1)[len(tokens):])


def test_image_rows_one_a_step_leave_the_flex_decoder_for_the_gather_path(engine, vlm):
    """Prefill one token a step: every step is one row one token wide, the decode-only path's
    shape, but a step holding an image row goes through the gather path (the decoder embeds
    tokens only); the tokens stay transformers'."""
    from superfluid.plugins.basert.decode_graph import DecodeGraphs

    hf = str(vlm["hf"])
    s = engine.model.shape
    pool = PagedKV(n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, n_blocks=64, block_size=16,
                   dtype=torch.float32, device=torch.device("cpu"), scratch=True)
    decoder = DecodeGraphs(engine.model, pool, max_lanes=2, max_context=512, graphs=False)
    r = BasertRunner(engine.model, pool, set(), StopFlag(), device=torch.device("cpu"), decoder=decoder,
                     encoder=vision.encoder(engine.vision))
    assert generate(r.run, {0: prompt(hf, BLUE)}, step_tokens=1) == {0: want(hf, BLUE)}


def test_penalties_never_count_a_placeholder(engine, vlm):
    hf = str(vlm["hf"])
    lane = prompt(hf, RED)
    penalized = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5)
    got = generate(engine.run_tick, {0: lane}, 6, sampling=penalized)[0]
    window = engine.runner.samplers[0].window
    real = [t for t in lane[0] if t >= 0]
    assert list(window.tokens)[:len(real)] == real and list(window.tokens)[len(real):] == got
    assert all(t >= 0 for t in window.counts)


def test_a_text_only_model_declares_no_vision(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf", n_layer=1, n_embd=32)
    e = engine_for(path, name="text")
    try:
        assert not e.capabilities.vision and e.info.vision is None and e.vision_src is None
    finally:
        e.close()


def test_an_mmproj_that_is_missing_or_no_mmproj_fails_naming_it(vlm):
    with pytest.raises(ConfigError, match="'vlm'.*not found.*nowhere.gguf"):
        engine_for(vlm["gguf"], "--mmproj", "/nowhere.gguf")
    with pytest.raises(ConfigError, match="'vlm'.*not a vision mmproj"):
        engine_for(vlm["hf"], "--mmproj", str(vlm["gguf"]))
