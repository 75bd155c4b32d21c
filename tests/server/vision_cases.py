"""What every engine that takes images must show through the ``openai`` client against a real
server, shared by the per-engine test modules: greedy replies for a red and a blue image, at a
wide and a tall aspect ratio (split into 2 x 4 and 4 x 2 tiles plus the global image), equal the
transformers reference (its own processor and ``generate``, computed here from the fixture's own
files) and differ; two concurrent image requests give the replies one at a time gives; the same
image sent twice is encoded once and its KV reused past the image."""

from __future__ import annotations

import base64
import functools
import threading

from tests import vision_reference as ref

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)
QUESTION = "What colour is this?"
MAX_NEW = 8


SIZES = (ref.WIDE, ref.TALL)


def data_url(rgb: tuple[int, int, int], size: int | tuple[int, int] = 64) -> str:
    return "data:image/png;base64," + base64.b64encode(ref.png(rgb, size)).decode()


def image_messages(rgb, text: str = QUESTION, size: int | tuple[int, int] = 64) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(rgb, size)}},
                                         {"type": "text", "text": text}]}]


def ask(client, model: str, messages, max_tokens: int = MAX_NEW, **extra):
    """A greedy chat completion that runs ``max_tokens`` tokens whatever it samples."""
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True}, **extra)


@functools.cache
def reference(hf_dir: str, rgb, text: str = QUESTION, max_new: int = MAX_NEW, size=ref.WIDE) -> tuple[str, int]:
    """(transformers' greedy reply text, its prompt length) for :func:`image_messages`: the
    chat template rendered by transformers with SmolVLM's ``<image>`` where the part was, then
    its processor (resize, tiles, image tokens) and its model's ``generate``."""
    tok = ref.processor(hf_dir).tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": "<image>" + text}], tokenize=False,
                                       add_generation_prompt=True)
    out, n_prompt = ref.generate(hf_dir, rendered, [ref.solid(rgb, size)], max_new)
    return tok.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False), n_prompt


def check_reference_red_and_blue(client, model: str, hf_dir: str) -> dict:
    """Replies for red and blue, wide and tall, equal the reference and differ by colour;
    returns them."""
    got = {}
    for size in SIZES:
        for rgb in (RED, BLUE):
            reply = ask(client, model, image_messages(rgb, size=size))
            want, n_prompt = reference(hf_dir, rgb, size=size)
            assert reply.usage.prompt_tokens == n_prompt, (size, rgb)
            assert reply.usage.completion_tokens == MAX_NEW
            assert reply.choices[0].message.content == want, (size, rgb, reply.choices[0].message.content, want)
            got[size, rgb] = reply.choices[0].message.content
        assert got[size, RED] != got[size, BLUE]
    return got


def check_concurrent_equals_alone(client, model: str) -> None:
    """Two image requests at once (a wide red and a tall blue) give what each gives alone."""
    asks = {RED: image_messages(RED, "Describe it.", ref.WIDE), BLUE: image_messages(BLUE, "Describe it.", ref.TALL)}
    alone = {rgb: ask(client, model, messages).choices[0].message.content for rgb, messages in asks.items()}
    together: dict = {}

    def run(rgb):
        together[rgb] = ask(client, model, asks[rgb]).choices[0].message.content

    threads = [threading.Thread(target=run, args=(rgb,)) for rgb in asks]
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


def streamed_text(base: str, body: dict, on_chunk=None) -> str:
    """The content a streamed chat completion sends (``on_chunk()`` after each content chunk)."""
    import json
    import urllib.request

    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
                    if on_chunk is not None:
                        on_chunk()
    return "".join(text)


def killed_mid_stream(srv, model: str, bodies: list[dict]) -> tuple[list[str], list[str], list[int]]:
    """(the replies of ``bodies`` streamed side by side, the same while the model's worker is
    SIGKILLed once every stream is under way, how many chunks each had streamed at the kill)."""
    import concurrent.futures as cf
    import os
    import signal
    import time

    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        undisturbed = list(pool.map(lambda b: streamed_text(srv.base, b), bodies))
    pid = srv.get_json("/health")["models"][model]["worker_pid"]
    seen = [0] * len(bodies)

    def counted(i):
        def bump():
            seen[i] += 1
        return streamed_text(srv.base, bodies[i], bump)

    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(counted, i) for i in range(len(bodies))]
        deadline = time.monotonic() + 60
        while not all(seen) and time.monotonic() < deadline:  # every stream under way
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        at_kill = list(seen)
        texts = [f.result(timeout=300) for f in futures]
    return undisturbed, texts, at_kill
