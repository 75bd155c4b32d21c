"""LLaVA-NeXT images on basert, through the ``openai`` client against a real server
(``--engine basert``) serving the tiny fixture's Hugging Face directory
(tools/fixtures/tiny_llava_next.py), with the fixture's own chat template: greedy tokens for a
red and a blue image, at a wide and a tall aspect ratio that both need resizing, padding and
unpadding, equal transformers' (its processor, its model, greedy, no end at end-of-text) and
differ by colour; two concurrent image requests give what each gives alone; Anthropic's
count_tokens (images counted from their headers, not loaded) equals the chat's usage; the same image
twice is encoded once and its KV reused past it."""

from __future__ import annotations

import base64
import functools
import io
import threading

import pytest

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MODEL = "llava"
RED, BLUE = (255, 0, 0), (0, 0, 255)
WIDE, TALL = (100, 40), (36, 100)  # 2 x 1 and 1 x 3 tiles, each with padding cut from its grid
QUESTION = "What colour is this?"
MAX_NEW = 8


@functools.cache
def _hf() -> str:
    from tools.fixtures import tiny_llava_next

    return str(tiny_llava_next.build()["hf"])


@pytest.fixture(scope="module")
def srv(start_server):
    server = start_server("--engine", "basert", "--model-name", MODEL, "--max-batch", "4", "--threads", "2",
                          "--max-context", "1024", model=_hf())
    yield server
    server.stop()


@pytest.fixture
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=300, max_retries=0)


def _pil(rgb, size):
    from PIL import Image as PILImage

    return PILImage.new("RGB", size, rgb)


def _png(rgb, size) -> str:
    buf = io.BytesIO()
    _pil(rgb, size).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _messages(rgb, size, text: str = QUESTION) -> list[dict]:
    url = "data:image/png;base64," + _png(rgb, size)
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def _ask(client, messages):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ignore_eos": True})


@functools.cache
def _transformers():
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    torch.set_num_threads(2)
    model = LlavaNextForConditionalGeneration.from_pretrained(_hf(), dtype=torch.float32).eval()
    return AutoProcessor.from_pretrained(_hf()), model


@functools.cache
def reference(rgb, size, text: str = QUESTION) -> tuple[str, int]:
    """(transformers' greedy reply, its prompt length): the fixture's chat template rendered by
    transformers with ``<image>`` where the image part was (as the server joins a message's
    parts), the processor's expansion and pixels, then greedy steps that take whatever the model
    picks, end-of-text included (the request's ignore_eos)."""
    proc, model = _transformers()
    rendered = proc.tokenizer.apply_chat_template([{"role": "user", "content": "<image>" + text}], tokenize=False,
                                                  add_generation_prompt=True)
    inputs = proc(text=rendered, images=[_pil(rgb, size)], return_tensors="pt")
    ids, out, cache = inputs["input_ids"], [], None
    step = dict(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
    with torch.no_grad():
        for _ in range(MAX_NEW):
            res = model(input_ids=ids, cache=cache, use_cache=True, **step)
            cache, step = res.past_key_values, {}
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return proc.tokenizer.decode(out, skip_special_tokens=True), int(inputs["input_ids"].shape[1])


def test_red_and_blue_wide_and_tall_equal_transformers_and_differ(client):
    got = {}
    for size in (WIDE, TALL):
        for rgb in (RED, BLUE):
            reply = _ask(client, _messages(rgb, size))
            want, n_prompt = reference(rgb, size)
            assert reply.usage.prompt_tokens == n_prompt, (size, rgb)
            assert reply.usage.completion_tokens == MAX_NEW
            assert reply.choices[0].message.content == want, (size, rgb)
            got[size, rgb] = want
        assert got[size, RED] != got[size, BLUE], size


def test_two_concurrent_image_requests_equal_each_alone(client):
    asks = {RED: _messages(RED, WIDE, "Describe it."), BLUE: _messages(BLUE, TALL, "Describe it.")}
    alone = {rgb: _ask(client, m).choices[0].message.content for rgb, m in asks.items()}
    together: dict = {}

    def run(rgb):
        together[rgb] = _ask(client, asks[rgb]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(rgb,)) for rgb in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together == alone


def test_count_tokens_equals_the_chats_usage(srv, client):
    for size in (WIDE, TALL):
        status, counted = srv.call("POST", "/v1/messages/count_tokens", {
            "model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _png(RED, size)}},
                {"type": "text", "text": QUESTION}]}]})
        assert status == 200, counted
        chat = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                              messages=_messages(RED, size))
        assert counted["input_tokens"] == chat.usage.prompt_tokens == reference(RED, size)[1], size


def test_the_same_image_twice_is_encoded_once_and_its_kv_reused(srv, client):
    from . import vision_cases as cases

    got = cases.check_same_image_encodes_once(client, MODEL, srv)
    assert got["encodes"] == (1, 0) and got["prefilled"][1] <= 1
