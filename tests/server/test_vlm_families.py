"""Gemma 3, Qwen2.5-VL and Qwen3-VL on llama.cpp, through the ``openai`` client against a real
server serving the tiny fixtures (tools/fixtures/tiny_gemma3_vlm.py, tiny_qwen_vl.py; their
mmproj found beside the GGUF; the chat template the GGUF carries, SmolLM2's):

- greedy replies for a red and a blue image, wide and tall, equal transformers' processor and
  ``generate`` on the fixture's own weights (tests/vlm_families_reference.py), prompt length
  included, and red differs from blue;
- two lanes with images in one tick give what each gives alone (Gemma 3: both images in one
  non-causal step; Qwen: both lanes' M-RoPE positions in one embedding batch);
- the same tokens through a prefix-cache hit (the same prompt, and the same image with other
  text after it) and through the host tier (the prefix parked in host memory and restored):
  for Qwen (M-RoPE) a lane's next position is not its token count, for Gemma 3 the image's rows
  saw each other both ways, so a reused prefix must hold images whole;
- after the worker is SIGKILLed mid-stream, every lane's positions are recomputed from the
  request's images and the replies are an undisturbed run's.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import functools
import io

import pytest

from tests import vlm_families_reference as ref

from . import vision_cases as cases

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

MODEL = "vlm"
RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 160, 0)
QUESTION = "What colour is this?"
N_NEW = 10
# (wide, tall), (width, height): Qwen's sides are whole merged patches (28, 32 pixels), so the
# smart resize keeps them; Gemma 3 stretches any image to its 64-pixel tile
SIZES = {"gemma3": ((128, 64), (64, 128)), "qwen2.5-vl": ((168, 84), (84, 168)),
         "qwen3-vl": ((192, 96), (96, 192))}


def png(rgb, size) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return buf.getvalue()


def messages(rgb, size, text: str = QUESTION) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(png(rgb, size)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


# The tiny random models' logits are flat: transformers' top two are often within 3e-4 of each
# other, where llama.cpp's f16 KV and its kernels move a logit by about 1e-4, so a greedy
# continuation may part from transformers' at a near tie and then follow another, equally right,
# path. So each of the server's tokens is checked against transformers given the same tokens
# before it (one forward pass over the prompt and the reply): its logit must be transformers'
# largest, within TIE.
TIE = 1e-3  # (measured: at most 4e-4 off, 118 of 120 tokens transformers' argmax exactly)


def rendered_around(family: str, text: str = QUESTION) -> tuple[str, str]:
    """The GGUF's chat template (the fixture tokenizer's, SmolLM2's) rendered for one user turn,
    split where the image part goes (before the text)."""
    tok = ref.processor(family).tokenizer
    mark = "\x00IMAGE\x00"
    rendered = tok.apply_chat_template([{"role": "user", "content": mark + text}], tokenize=False,
                                       add_generation_prompt=True)
    before, after = rendered.split(mark)
    return before, after


@functools.cache
def byte_ids(family: str) -> dict[bytes, int]:
    """Each vocabulary token's bytes to its id (a reply's logprobs name tokens by their bytes)."""
    # byte-level BPE writes byte b as itself where it is printable, else as chr(256 + k) for the
    # k-th byte that is not
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    decoder = {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}
    tok = ref.processor(family).tokenizer
    out: dict[bytes, int] = {}
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        if piece and all(c in decoder for c in piece):
            out.setdefault(bytes(decoder[c] for c in piece), i)
    return out


def reply_ids(family: str, reply) -> list[int]:
    table = byte_ids(family)
    return [table[bytes(t.bytes)] for t in reply.choices[0].logprobs.content]


def transformers_gaps(family: str, rgb, size, ids: list[int], text: str = QUESTION) -> tuple[int, list[float]]:
    """(the prompt's length in transformers' processor; for each of ``ids``, how far its logit
    falls below transformers' largest given the prompt and the ids before it, end-of-sequence
    left out as the request's logit bias leaves it out)."""
    import torch
    from PIL import Image

    proc, m = ref.processor(family), ref.model(family)
    before, after = rendered_around(family, text)
    inputs = proc(text=ref.image_prompt(family, before, after), images=[Image.new("RGB", size, rgb)],
                  return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    more = torch.tensor([ids[:-1]], dtype=torch.long)
    for key in list(inputs):  # the reply's tokens after the prompt: text, attended to
        if inputs[key].shape[:2] == (1, n):
            fill = more if key == "input_ids" else torch.full_like(more, 1 if key == "attention_mask" else 0)
            inputs[key] = torch.cat([inputs[key], fill], 1)
    with torch.no_grad():
        logits = m(**inputs).logits[0, n - 1:].float()
    logits[:, list(eos_ids(family))] = -torch.inf
    return n, [float(row.max() - row[t]) for row, t in zip(logits, ids)]


def eos_ids(family: str) -> tuple[int, ...]:
    eos = ref.model(family).generation_config.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def ask(client, family: str, rgb, size, text: str = QUESTION, n_new: int = N_NEW, **extra):
    """A greedy chat completion of ``n_new`` tokens, end-of-sequence kept from winning as the
    reference's ``min_new_tokens`` does."""
    return client.chat.completions.create(model=MODEL, messages=messages(rgb, size, text), max_tokens=n_new,
                                          temperature=0, logit_bias={str(t): -100 for t in eos_ids(family)},
                                          logprobs=True, **extra)


def _client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=300, max_retries=0)


@pytest.fixture(scope="module", params=ref.FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def srv(start_server, family):
    return start_server("--model-name", MODEL, "--max-batch", "4", model=str(ref.fixture(family)["gguf"]))


def test_red_and_blue_wide_and_tall_equal_transformers(srv, family):
    """Every greedy token is transformers' choice given the same prompt (its processor's, length
    included) and the same tokens before it; red and blue reply differently."""
    client = _client(srv)
    for size in SIZES[family]:
        got = {}
        for rgb in (RED, BLUE):
            reply = ask(client, family, rgb, size)
            ids = reply_ids(family, reply)
            assert len(ids) == N_NEW
            n_prompt, gaps = transformers_gaps(family, rgb, size, ids)
            assert reply.usage.prompt_tokens == n_prompt, (size, rgb)
            assert max(gaps) <= TIE, (size, rgb, gaps)
            got[rgb] = ids
        assert got[RED] != got[BLUE], size


def test_two_lanes_with_images_in_one_tick_equal_each_alone(srv, family):
    client = _client(srv)
    wide, tall = SIZES[family]
    asks = [(RED, wide), (BLUE, tall), (GREEN, wide)]
    alone = [ask(client, family, rgb, size, "Describe it.").choices[0].message.content for rgb, size in asks]
    with cf.ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: ask(client, family, *a, "Describe it.").choices[0].message.content, asks))
    assert together == alone


LONG_TEXT = "Tell me more about the colour of this picture, " * 6  # past the host tier's 64 tokens


def _ids_and_cached(reply) -> tuple[list[int], int]:
    return [bytes(t.bytes) for t in reply.choices[0].logprobs.content], \
        reply.usage.prompt_tokens_details.cached_tokens or 0


@pytest.mark.parametrize("pool", ["per-sequence", "unified"])
@pytest.mark.parametrize("fam", ref.FAMILIES)
def test_the_same_tokens_through_a_prefix_cache_hit(start_server, fam, pool):
    """The KV past an image is reused (its rows placed by M-RoPE, the text after it at the
    image's start plus max(nx, ny)): the same prompt again, and the same image with other text
    after it (its shared part copied into another slot: in a unified pool, cells up to the
    prefix's last position), give what a prompt computed whole gives."""
    unified = ["--kv-unified"] if pool == "unified" else []
    srv = start_server("--model-name", MODEL, "--max-batch", "2", *unified, model=str(ref.fixture(fam)["gguf"]))
    client = _client(srv)
    size = SIZES[fam][0]
    first = ask(client, fam, GREEN, size, LONG_TEXT)
    again = ask(client, fam, GREEN, size, LONG_TEXT)
    ids, cached = _ids_and_cached(again)
    assert cached >= again.usage.prompt_tokens - 1  # everything but the last token, image rows included
    assert ids == _ids_and_cached(first)[0]
    other = "Tell me more about the colour of this picture, " * 5 + "and its shape."
    reused = ask(client, fam, GREEN, size, other)
    whole = ask(client, fam, GREEN, size, other, extra_body={"cache_prompt": False})
    assert _ids_and_cached(reused)[1] > 40 and _ids_and_cached(whole)[1] == 0  # past the image's rows
    assert _ids_and_cached(reused)[0] == _ids_and_cached(whole)[0]
    assert max(transformers_gaps(fam, GREEN, size, reply_ids(fam, reused), other)[1]) <= TIE


@pytest.mark.parametrize("fam", ref.FAMILIES)
def test_an_image_prefix_parked_in_the_host_tier_comes_back(start_server, fam):
    """One lane: a text request takes the slot the image conversation's KV was cached in, which
    parks that prefix in host memory; the image conversation then comes back from there (its
    cells' M-RoPE rows and columns restored with it) and gives the same tokens, its image not
    encoded again."""
    srv = start_server("--model-name", MODEL, "--max-batch", "1", "--prefill-budget", "64",
                       model=str(ref.fixture(fam)["gguf"]))
    client = _client(srv)
    size = SIZES[fam][1]
    first = ask(client, fam, (200, 100, 0), size, LONG_TEXT)
    client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Something else entirely, please."}])
    assert srv.settled_metric("superfluid_host_cache_entries") >= 1  # the image prefix moved there
    encoded = srv.settled_metric("superfluid_images_encoded_total")
    again = ask(client, fam, (200, 100, 0), size, LONG_TEXT)
    ids, cached = _ids_and_cached(again)
    assert cached >= again.usage.prompt_tokens - 1
    assert ids == _ids_and_cached(first)[0]
    assert srv.settled_metric("superfluid_images_encoded_total") == encoded


def test_a_prompt_only_counted_counts_its_image_rows_exactly(srv, family):
    """Messages' count_tokens prepares a prompt without loading its image: its rows follow from
    the size in the PNG's header (Qwen: the smart-resized grid; Gemma 3: the tile's), as the chat
    that loads it counts them."""
    client = _client(srv)
    for size in (*SIZES[family], (300, 200)):
        status, counted = srv.call("POST", "/v1/messages/count_tokens", {
            "model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(png(RED, size)).decode()}},
                {"type": "text", "text": QUESTION}]}]})
        assert status == 200, counted
        chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages(RED, size))
        assert counted["input_tokens"] == chat.usage.prompt_tokens, size


KILLED_LONG = 40


def test_a_killed_worker_loses_no_image_lane(srv, family):
    """SIGKILL the llama.cpp worker while three image lanes stream: the new worker encodes the
    images again and places every lane's tokens from the request's images (nothing of the
    positions lived only in the dead worker), and every reply is the one an undisturbed run
    gives. On the family's shared server (the flags this test needs): defined last, so it runs
    last of the tests on that server (pytest groups them by family), the only one that kills
    its worker."""
    fam = family
    wide, tall = SIZES[fam]
    asks = [(RED, wide), (BLUE, tall), (GREEN, wide)]

    bodies = [{"model": MODEL, "messages": messages(rgb, size, "Describe it."), "max_tokens": KILLED_LONG,
               "temperature": 0, "ignore_eos": True, "cache_prompt": False} for rgb, size in asks]
    undisturbed, texts, at_kill = cases.killed_mid_stream(srv, MODEL, bodies)
    assert texts == undisturbed
    assert min(at_kill) > 0 and max(at_kill) < KILLED_LONG  # killed mid-stream
    assert srv.get_json("/health")["models"][MODEL]["restarts"] == 1
