"""Real VLM chat templates on a real server (llama.cpp engine, the tiny SmolVLM of
tools/fixtures/tiny_vlm.py), driven by the ``openai`` client: SmolVLM's own template as SmolVLM
publishes it (tests/data/templates/SmolVLM-Instruct.jinja), and three other VLMs' own templates
from the shared corpus (Gemma 4, LFM2.5, Kimi K2), each given with ``--chat-template-file``.

Each template loops over typed parts and writes its own placeholder for an image; superfluid puts
the image's tokens there. The greedy reply must equal transformers' for a red and a blue image
(and the two differ), and for two images in one message. The reference is computed here, on the
fixture's own weights, by transformers' own pipeline: the template rendered by transformers from
typed parts, the placeholder handed to SmolVLM's processor (``Idefics3Processor``) as its
``<image>``, which lays out the image's tokens and pixels, then ``generate``, greedy. For
SmolVLM's own template the processor renders the template itself (its ``apply_chat_template``).

The images are 64-pixel squares, the fixture's tile size. One server per template, module-wide."""

from __future__ import annotations

import functools
import pathlib

import pytest

from tests.server import vision_cases as cases
from tools.fixtures.tiny_vlm import ROWS, build

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")  # the reference (and the fixture's build)
pytest.importorskip("torch")

MODEL = "vlm"
TESTS = pathlib.Path(__file__).resolve().parents[1]
SHARED = TESTS.parents[1] / "shared" / "templates"
SMOLVLM = "SmolVLM-Instruct"
# the template's file and the placeholder it writes for an image part
TEMPLATES = {
    SMOLVLM: (TESTS / "data" / "templates" / f"{SMOLVLM}.jinja", "<image>"),
    "google-gemma-4-31B-it": (SHARED / "google-gemma-4-31B-it.jinja", "<|image|>"),
    "LFM2.5-8B-A1B": (SHARED / "LFM2.5-8B-A1B.jinja", "<image>"),
    "moonshotai-Kimi-K2": (SHARED / "moonshotai-Kimi-K2.jinja",
                           "<|media_start|>image<|media_content|><|media_pad|><|media_end|>"),
}
MAX_NEW = cases.MAX_NEW
TIE = 1e-4  # a top-2 logit margin below this is a tie


@pytest.fixture(scope="module")
def vlm():
    return build()


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, start_server, vlm):
    """(template name, client) of a server serving the fixture under that template."""
    name = request.param
    srv = start_server("--model-name", MODEL, "--max-batch", "2", "--chat-template-file", str(TEMPLATES[name][0]),
                       model=str(vlm["gguf"]))
    yield name, openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0)
    srv.stop()


# ---- transformers' reference ----------------------------------------------------------------------

@functools.cache
def _processor(hf_dir: str):
    """SmolVLM's processor over the fixture's image processor and tokenizer. ``Idefics3Processor``
    adds ``<end_of_utterance>`` to the tokenizer it is given; where the fixture's vocabulary lacks
    that token (the GGUF then reads it as text, and the model has no row for the id it would
    get), the processor tokenizes with an untouched copy of the fixture's own tokenizer."""
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

    processor = Idefics3Processor(Idefics3ImageProcessorPil.from_pretrained(hf_dir),
                                  AutoTokenizer.from_pretrained(hf_dir), image_seq_len=ROWS,
                                  chat_template=TEMPLATES[SMOLVLM][0].read_text())
    processor.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    return processor


@functools.cache
def _model(hf_dir: str):
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.set_num_threads(2)
    return Idefics3ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _typed(items) -> list[dict]:
    """One user message of typed parts: a string is text, a colour an image."""
    return [{"role": "user", "content": [{"type": "text", "text": item} if isinstance(item, str) else {"type": "image"}
                                         for item in items]}]


def _reference(hf_dir: str, name: str, items) -> tuple[str, int]:
    """(transformers' greedy reply, its prompt length) for the user message ``items`` under the
    template ``name``."""
    import torch
    from PIL import Image as PILImage
    from transformers.utils.chat_template_utils import render_jinja_template

    processor = _processor(hf_dir)
    messages = _typed(items)
    if name == SMOLVLM:
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
    else:
        path, placeholder = TEMPLATES[name]
        tok = processor.tokenizer
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=path.read_text(),
                                            add_generation_prompt=True, bos_token=tok.bos_token,
                                            eos_token=tok.eos_token)
        text = rendered[0].replace(placeholder, processor.image_token)
    images = [PILImage.new("RGB", (64, 64), item) for item in items if not isinstance(item, str)]
    assert text.count(processor.image_token) == len(images)
    inputs = processor(text=text, images=[images], return_tensors="pt")
    with torch.no_grad():
        out = _model(hf_dir).generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                      output_scores=True, return_dict_in_generate=True)
    margins = [float(top.values[0] - top.values[1]) for top in (torch.topk(step[0], 2) for step in out.scores)]
    # random weights can tie two tokens to float precision; then greedy has no one answer to equal
    assert min(margins) > TIE, f"transformers' greedy choice is a tie under {name} for {items}: {margins}"
    n_prompt = inputs["input_ids"].shape[1]
    reply = processor.tokenizer.decode(out.sequences[0, n_prompt:], skip_special_tokens=True,
                                       clean_up_tokenization_spaces=False)
    return reply, n_prompt


# ---- the server, through the openai client ----------------------------------------------------------

def _ask(client, items):
    content = [{"type": "text", "text": item} if isinstance(item, str)
               else {"type": "image_url", "image_url": {"url": cases.data_url(item)}} for item in items]
    return cases.ask(client, MODEL, [{"role": "user", "content": content}])


def _check(served, vlm, items) -> str:
    name, client = served
    reply = _ask(client, items)
    want, n_prompt = _reference(str(vlm["hf"]), name, items)
    assert reply.usage.prompt_tokens == n_prompt, (name, reply.usage.prompt_tokens, n_prompt)
    assert reply.usage.completion_tokens == MAX_NEW
    assert reply.choices[0].message.content == want, (name, reply.choices[0].message.content, want)
    return want


def test_red_and_blue_equal_transformers_under_the_models_own_template(served, vlm):
    # a wording whose greedy tokens are clear of float ties (with "Look:", LFM2.5 once tied at the 4th)
    got = {rgb: _check(served, vlm, ["Here is a picture:", rgb, " What colour is it?"])
           for rgb in (cases.RED, cases.BLUE)}
    assert got[cases.RED] != got[cases.BLUE]


def test_an_image_first_then_text(served, vlm):
    """SmolVLM's own template writes ``User:`` without its space before a leading image."""
    _check(served, vlm, [cases.BLUE, "What colour is this?"])


def test_two_images_in_one_message_equal_transformers(served, vlm):
    _check(served, vlm, ["Compare", cases.RED, " with", cases.BLUE, " please."])
