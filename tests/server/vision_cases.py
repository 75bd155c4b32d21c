"""What every engine that takes images must show through the ``openai`` client against a real
server, shared by the per-engine test modules: greedy replies for a red and a blue image equal
the transformers reference (computed here, from the fixture's own weights) and differ; two
concurrent image requests give the replies one at a time gives; the same image sent twice is
encoded once and its KV reused past the image."""

from __future__ import annotations

import base64
import functools
import threading

from tests import vision_reference as ref

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)
QUESTION = "What colour is this?"
MAX_NEW = 8


def data_url(rgb: tuple[int, int, int], size: int = 64) -> str:
    return "data:image/png;base64," + base64.b64encode(ref.png(rgb, size)).decode()


def image_messages(rgb, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(rgb)}},
                                         {"type": "text", "text": text}]}]


def ask(client, model: str, messages, max_tokens: int = MAX_NEW, **extra):
    """A greedy chat completion that runs ``max_tokens`` tokens whatever it samples."""
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True}, **extra)


@functools.cache
def _tokenizer(hf_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def reference(hf_dir: str, rgb, text: str = QUESTION, max_new: int = MAX_NEW) -> tuple[str, int]:
    """(transformers' greedy reply text, its prompt length) for :func:`image_messages`: the
    chat template rendered by transformers with the image where the part was, laid out as
    SmolVLM lays one out (``vision_reference.prompt``)."""
    tok = _tokenizer(hf_dir)
    mark = "<<IMAGE>>"
    rendered = tok.apply_chat_template([{"role": "user", "content": mark + text}], tokenize=False,
                                       add_generation_prompt=True)
    before, after = rendered.split(mark)
    tokens, spans = ref.prompt(hf_dir, before, [ref.solid(rgb)], after)
    out = ref.greedy(hf_dir, tokens, spans, max_new)
    return tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(tokens)


def check_reference_red_and_blue(client, model: str, hf_dir: str) -> dict:
    """Replies for red and blue equal the reference and differ; returns them."""
    got = {}
    for rgb in (RED, BLUE):
        reply = ask(client, model, image_messages(rgb))
        want, n_prompt = reference(hf_dir, rgb)
        assert reply.usage.prompt_tokens == n_prompt
        assert reply.usage.completion_tokens == MAX_NEW
        assert reply.choices[0].message.content == want, (rgb, reply.choices[0].message.content, want)
        got[rgb] = reply.choices[0].message.content
    assert got[RED] != got[BLUE]
    return got


def check_concurrent_equals_alone(client, model: str) -> None:
    """Two image requests at once give what each gives alone."""
    alone = {rgb: ask(client, model, image_messages(rgb, "Describe it.")).choices[0].message.content
             for rgb in (RED, BLUE)}
    together: dict = {}

    def run(rgb):
        together[rgb] = ask(client, model, image_messages(rgb, "Describe it.")).choices[0].message.content

    threads = [threading.Thread(target=run, args=(rgb,)) for rgb in (RED, BLUE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


def check_same_image_encodes_once(client, model: str, server, rgb=GREEN) -> dict:
    """The same image and prompt twice: the encoder runs once and the second request's prompt is
    served from the prefix cache past the image. Returns the figures."""
    metric = "superfluid_images_encoded_total"
    before = server.settled_metric(metric)
    first = ask(client, model, image_messages(rgb, "Once more."))
    after_first = server.settled_metric(metric)
    second = ask(client, model, image_messages(rgb, "Once more."))
    after_second = server.settled_metric(metric)
    assert after_first - before == 1 and after_second == after_first
    assert first.choices[0].message.content == second.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 1  # everything but the last token, image rows included
    return {"encodes": (after_first - before, after_second - after_first),
            "prefilled": (first.usage.prompt_tokens - (first.usage.prompt_tokens_details.cached_tokens or 0),
                          second.usage.prompt_tokens - cached)}
