"""Images on llama.cpp, through the ``openai`` client (and the ``anthropic`` SDK, and the
Responses API) against a real server serving the tiny SmolVLM the project builds
(tools/fixtures/tiny_vlm.py; its mmproj is found beside the GGUF):

- replies equal transformers' for a red and a blue image and differ; concurrent equals alone;
- the same image twice: encoded once, its KV reused past the image;
- a media lane is never preempted by interactive arrivals (a text lane in its place is);
- every bad image is a 400 naming the part, and the server is healthy afterwards;
- remote URLs: refused unless a prefix is allowed, then fetched under the same caps;
- a text-only model refuses images; image parts in sessions;
- served with a real VLM chat template that loops over typed parts (Mistral Small 3.2's), the
  image goes where that template writes its ``[IMG]``, and the chat answers 200."""

from __future__ import annotations

import base64
import http.server
import io
import json
import random
import threading
import time
import urllib.request

import pathlib

import pytest

from tests import vision_reference as ref
from tools.fixtures.tiny_vlm import build

from . import vision_cases as cases
from .serverproc import free_port

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

openai = pytest.importorskip("openai")
MODEL = "vlm"
TEMPLATES = pathlib.Path(__file__).resolve().parents[3] / "shared" / "templates"


@pytest.fixture(scope="module")
def vlm():
    return build()


class _Pictures(http.server.BaseHTTPRequestHandler):
    """Serves a red PNG at /ok/red.png and /elsewhere/red.png (the allow-list tells them apart)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = ref.png(cases.RED)
        self.send_response(200 if self.path.endswith("/red.png") else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def pictures():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def srv(start_server, vlm, pictures):
    return start_server("--model-name", MODEL, "--max-batch", "4", "--max-images", "2", "--max-image-mb", "1",
                        "--max-image-pixels", "1000000", "--image-url-allow", f"{pictures}/ok/", model=str(vlm["gguf"]))


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0)


def test_red_and_blue_equal_the_transformers_reference_and_differ(client, vlm):
    cases.check_reference_red_and_blue(client, MODEL, str(vlm["hf"]))


def test_two_concurrent_image_requests_equal_one_at_a_time(client):
    cases.check_concurrent_equals_alone(client, MODEL)


def test_the_same_image_twice_is_encoded_once_and_its_kv_reused(client, srv):
    got = cases.check_same_image_encodes_once(client, MODEL, srv)
    assert got["prefilled"][1] <= 1 < got["prefilled"][0]


def _raw(srv, body: dict) -> tuple[int, dict]:
    return srv.call("POST", "/v1/chat/completions", body)


def _with_image(url: str, count: int = 1) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(count)]
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "Hi"}]}]}


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _b64(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def _bad_cases(pictures: str) -> list[tuple[str, dict, str, str]]:
    from PIL import Image

    good = ref.png(cases.RED)
    noise = Image.frombytes("RGB", (700, 700), random.Random(0).randbytes(700 * 700 * 3))  # ~1.4 MiB as PNG
    url = "messages[0].content[0].image_url.url"
    return [
        ("malformed base64", _with_image("data:image/png;base64,@@not-base64@@"), url, "malformed base64"),
        ("not base64 at all", _with_image("data:image/png,rawbytes"), url, "must be base64"),
        ("an unknown format", _with_image(_b64(b"just some text, no image", "image/png")), url, "served format"),
        ("a format not served", _with_image(_b64(_png_as(Image.new("RGB", (8, 8)), "BMP"), "image/bmp")), url, "served format"),
        ("a truncated file", _with_image(_b64(good[: len(good) // 2])), url, "truncated"),
        ("a decompression bomb", _with_image(_b64(_png(Image.new("L", (4000, 4000))))), url, "pixels"),
        ("too many bytes", _with_image(_b64(_png(noise))), url, "larger than"),
        ("too many images", _with_image(_b64(good), 3), "messages[0].content[2].image_url.url", "at most 2"),
        ("a remote URL not allowed", _with_image(f"{pictures}/elsewhere/red.png"), url, "--image-url-allow"),
        ("another scheme", _with_image("file:///etc/passwd"), url, "data: URL"),
        ("an allowed URL that fails", _with_image(f"{pictures}/ok/missing.gif"), url, "HTTP 404"),
        ("an empty URL", _with_image(""), url, ""),
    ]


def _png_as(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def test_bad_images_are_400s_naming_the_part_and_change_nothing(srv, pictures, client):
    for name, body, param, words in _bad_cases(pictures):
        status, reply = _raw(srv, body)
        assert status == 400, (name, status, reply)
        assert reply["error"]["param"] == param, (name, reply)
        assert words in reply["error"]["message"], (name, reply)
    assert srv.get_json("/health")["status"] == "ok"
    assert cases.ask(client, MODEL, cases.image_messages(cases.RED)).usage.completion_tokens == cases.MAX_NEW


def test_an_allowed_remote_url_is_fetched_and_answers_as_its_data_url(client, pictures):
    remote = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{pictures}/ok/red.png"}},
                                           {"type": "text", "text": cases.QUESTION}]}]
    assert cases.ask(client, MODEL, remote).choices[0].message.content == \
        cases.ask(client, MODEL, cases.image_messages(cases.RED)).choices[0].message.content


def test_a_text_only_model_refuses_images(server):
    status, reply = server.call("POST", "/v1/chat/completions", {**_with_image(cases.data_url(cases.RED)),
                                                                 "model": "smollm2"})
    assert status == 400 and reply["error"]["code"] == "model_not_multimodal", reply
    assert "text-only" in reply["error"]["message"]


def test_anthropic_and_responses_images_answer_as_chat_does(srv, client):
    anthropic = pytest.importorskip("anthropic")
    png = base64.b64encode(ref.png(cases.BLUE)).decode()
    want = client.chat.completions.create(model=MODEL, messages=cases.image_messages(cases.BLUE),
                                          max_tokens=cases.MAX_NEW, temperature=0).choices[0].message.content
    a = anthropic.Anthropic(base_url=srv.base, api_key="x", max_retries=0)
    msg = a.messages.create(model=MODEL, max_tokens=cases.MAX_NEW, extra_body={"temperature": 0},
                            messages=[{"role": "user", "content": [
                                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                                {"type": "text", "text": cases.QUESTION}]}])
    assert msg.content[0].text == want
    r = client.responses.create(model=MODEL, max_output_tokens=cases.MAX_NEW, temperature=0,
                                input=[{"role": "user", "content": [
                                    {"type": "input_image", "image_url": cases.data_url(cases.BLUE)},
                                    {"type": "input_text", "text": cases.QUESTION}]}])
    assert r.output_text == want


def test_image_parts_in_a_session_are_kept_and_reused(srv):
    status, session = srv.call("POST", "/v1/sessions", {"model": MODEL})
    assert status == 201, session
    sid = session["id"]
    turn = {"messages": cases.image_messages(cases.RED, "What is this?"), "max_tokens": 4, "temperature": 0}
    status, first = srv.call("POST", f"/v1/sessions/{sid}/turns", turn)
    assert status == 200, first
    status, second = srv.call("POST", f"/v1/sessions/{sid}/turns", {
        "messages": [{"role": "user", "content": "And now?"}], "max_tokens": 4, "temperature": 0})
    assert status == 200, second
    # the second turn's prompt holds the first's image; all of the first turn's prompt is reused
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    srv.call("DELETE", f"/v1/sessions/{sid}")


# a template in the shape of SmolVLM's own: it reads typed parts only, so content flattened to a
# string loses its text and its image (the request was a 400: the template left the image out)
PARTS_ONLY = ("<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
              "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
              "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
              "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


@pytest.mark.parametrize("name, placed", [
    ("Mistral-Small-3.2-24B-Instruct-2506", f"[INST]\ue0000\ue001{cases.QUESTION}[/INST]"),
    ("parts-only", f"User: \ue0000\ue001{cases.QUESTION}<end_of_utterance>"),
])
def test_a_template_that_loops_over_typed_parts_gets_the_image_where_it_puts_it(start_server, vlm, tmp_path,
                                                                                  name, placed):
    """A VLM template reads a message's typed parts and writes its own placeholder for an image
    part (Mistral Small 3.2's ``[IMG]``, SmolVLM's ``<image>``). Served with it, the fixture
    answers an image chat through the openai client, and the prompt holds the image where the
    template put it (``/apply-template`` shows its marker there)."""
    template = TEMPLATES / f"{name}.jinja"
    if name == "parts-only":
        template = tmp_path / "parts-only.jinja"
        template.write_text(PARTS_ONLY)
    srv = start_server("--model-name", MODEL, "--max-batch", "1", "--chat-template-file", str(template),
                       model=str(vlm["gguf"]))
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=120, max_retries=0)
    reply = cases.ask(client, MODEL, cases.image_messages(cases.RED))
    assert reply.usage.completion_tokens == cases.MAX_NEW
    status, shown = srv.call("POST", "/apply-template", {"model": MODEL, "messages": cases.image_messages(cases.RED)})
    assert status == 200, shown
    assert placed in shown["prompt"] and "[IMG]" not in shown["prompt"] and "<image>" not in shown["prompt"]
    srv.stop()


# ---- a media lane is never preempted --------------------------------------------------------------

LONG = 1900  # tokens: the tiny model decodes fast, and the chat must arrive while this runs


@pytest.fixture(scope="module")
def one_lane(start_server, vlm):
    return start_server("--model-name", MODEL, "--max-batch", "1", "--prefill-budget", "64", model=str(vlm["gguf"]))


def _background(srv, messages, out: dict, tokens: int) -> threading.Thread:
    body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}

    def run():
        req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "x-superfluid-qos": "background"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out["reply"] = json.loads(r.read())
            out["done"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _decoding(srv) -> bool:
    slots = srv.get_json("/slots")["models"][MODEL]["slots"]
    return any(slot.get("generated_tokens", 0) > 0 for slot in slots)


def _preempted_while_a_chat_arrives(srv, messages) -> tuple[float, dict, float, float]:
    """(preemptions during the run, the background reply, when it ended, when the chat ended)."""
    before = srv.settled_metric("superfluid_preemptions_total")
    out: dict = {}
    thread = _background(srv, messages, out, LONG)
    deadline = time.monotonic() + 60
    while not _decoding(srv) and time.monotonic() < deadline:  # wait until it decodes
        time.sleep(0.05)
    req = urllib.request.Request(srv.base + "/v1/chat/completions", data=json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "Quick question."}], "max_tokens": 4,
        "temperature": 0}).encode(), headers={"Content-Type": "application/json", "x-superfluid-qos": "interactive"})
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
    chat_done = time.monotonic()
    thread.join(300)
    return srv.settled_metric("superfluid_preemptions_total") - before, out["reply"], out["done"], chat_done


def test_a_media_lane_is_not_preempted_by_interactive_work_a_text_lane_is(one_lane):
    preempted, reply, done, chat_done = _preempted_while_a_chat_arrives(one_lane, cases.image_messages(cases.RED))
    assert preempted == 0
    assert reply["usage"]["completion_tokens"] == LONG  # every token, none repeated or lost
    assert chat_done >= done - 0.5  # the chat waited for the lane: it was not preempted
    text_preempted, text_reply, _, _ = _preempted_while_a_chat_arrives(
        one_lane, [{"role": "user", "content": cases.QUESTION}])
    assert text_preempted >= 1  # the same shape without an image is preempted
    assert text_reply["usage"]["completion_tokens"] == LONG


def test_fuzzed_image_parts_get_200s_or_400s_and_the_server_stays_healthy(srv):
    """hypothesis drives the real server with mutated images and odd image parts: every answer
    is a reply or a 400 naming a field, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seed = ref.png(cases.GREEN, 16)
    parts = st.one_of(
        st.builds(lambda cut, at, v: bytes(b if i != at % max(cut, 1) else v for i, b in enumerate(seed[:cut])),
                  st.integers(1, len(seed)), st.integers(0, 10_000), st.integers(0, 255))
        .map(lambda data: {"type": "image_url", "image_url": {"url": _b64(data)}}),
        st.text(max_size=40).map(lambda url: {"type": "image_url", "image_url": {"url": url}}),
        st.fixed_dictionaries({"type": st.just("image_url"),
                               "image_url": st.one_of(st.none(), st.integers(), st.text(max_size=10),
                                                      st.fixed_dictionaries({"url": st.just(_b64(seed)),
                                                                             "detail": st.text(max_size=6)}))}))
    seen: dict[int, int] = {}

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(parts, min_size=1, max_size=3))
    def post(images):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [*images, {"type": "text",
                                                                                                   "text": "Hi"}]}]}
        status, reply = _raw(srv, body)
        seen[status] = seen.get(status, 0) + 1
        assert status in (200, 400), (status, reply)
        if status == 400:
            assert reply["error"]["param"].startswith("messages[0].content"), reply

    post()
    assert seen.get(400) and srv.get_json("/health")["status"] == "ok"


def test_an_image_prefix_comes_back_from_the_host_tier_without_encoding(one_lane):
    """One lane: a text request takes the slot an image conversation's KV was cached in, which
    moves that prefix to host memory; the image conversation then comes back from there, keyed
    by the image's content, and its image is not encoded again."""
    client = openai.OpenAI(base_url=one_lane.base + "/v1", api_key="x", timeout=120, max_retries=0)
    # long enough for the host tier (64 tokens or more); the text request shares no prefix with it
    image = cases.image_messages((200, 100, 0), "Tell me more about the colour of this picture, " * 6)
    first = cases.ask(client, MODEL, image)
    cases.ask(client, MODEL, [{"role": "system", "content": "Be terse."},
                              {"role": "user", "content": "Something else entirely, please."}])
    assert one_lane.settled_metric("superfluid_host_cache_entries") >= 1  # the image prefix moved there
    encoded = one_lane.settled_metric("superfluid_images_encoded_total")
    again = cases.ask(client, MODEL, image)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1
    assert one_lane.settled_metric("superfluid_images_encoded_total") == encoded


def test_mmproj_is_set_per_model_or_found_beside_the_gguf(start_server, vlm, tmp_path):
    """A GGUF with no mmproj beside it is text-only, unless --mmproj (TOML ``mmproj``) names one."""
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "tiny.gguf").symlink_to(vlm["gguf"])
    body = {**_with_image(cases.data_url(cases.RED)), "max_tokens": 2}
    text_only = start_server("--model-name", MODEL, "--max-batch", "1", model=str(lonely / "tiny.gguf"))
    status, reply = text_only.call("POST", "/v1/chat/completions", body)
    assert status == 400 and reply["error"]["code"] == "model_not_multimodal"
    text_only.stop()
    named = start_server("--model-name", MODEL, "--max-batch", "1", "--mmproj", str(vlm["mmproj"]),
                         model=str(lonely / "tiny.gguf"))
    status, reply = named.call("POST", "/v1/chat/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply


# llama.cpp's CPU kernels are not batch-invariant: a lane's logits move in the last bits with how
# many lanes share its decode, and a restored lane re-joins the others a tick or two apart. On
# this random model some lanes meet a near-tie about 200 tokens in (with images of 17 tiles, as
# the processor splits them, the lanes' compositions differ more than with one tile), so the
# replies compared here stop before that; the kill still lands while they stream.
KILLED_LONG = 150


def test_a_killed_worker_loses_no_image_lane(start_server, vlm):
    """SIGKILL the llama.cpp worker while image lanes stream: the new worker encodes the images
    again and every reply is the one an undisturbed run gives."""
    srv = start_server("--model-name", MODEL, "--max-batch", "4", model=str(vlm["gguf"]))
    colours = [cases.RED, cases.BLUE, cases.GREEN, (90, 40, 200)]
    bodies = [{"model": MODEL, "messages": cases.image_messages(rgb), "max_tokens": KILLED_LONG, "temperature": 0,
               "ignore_eos": True, "cache_prompt": False} for rgb in colours]
    reference, texts, at_kill = cases.killed_mid_stream(srv, MODEL, bodies)
    assert texts == reference
    assert min(at_kill) > 0 and max(at_kill) < KILLED_LONG // 2  # every lane was mid-stream
    assert srv.get_json("/health")["models"][MODEL]["restarts"] == 1


def test_a_prompt_only_counted_counts_its_images_tiles_exactly(srv, client):
    """Anthropic's count_tokens prepares a prompt without loading its images: each counts the
    tiles its size gives (read from the PNG's header), as the chat that loads it does."""
    for size in cases.SIZES + (64,):
        png = base64.b64encode(ref.png(cases.RED, size)).decode()
        status, counted = srv.call("POST", "/v1/messages/count_tokens", {
            "model": MODEL, "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
                {"type": "text", "text": cases.QUESTION}]}]})
        assert status == 200, counted
        chat = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, extra_body={"ignore_eos": True},
                                              messages=cases.image_messages(cases.RED, size=size))
        assert counted["input_tokens"] == chat.usage.prompt_tokens, size
    assert chat.usage.prompt_tokens > 100  # a square image: 4 x 4 tiles and the global image, 68 rows
