"""Gemma 3, Qwen2.5-VL and Qwen3-VL on basert and MLX, through the ``openai`` client against a
real server: neither engine has these families' vision towers, so each serves the language
half as text (greedy replies equal transformers' on the fixture's own weights,
tests/vlm_families_reference.py), and a request with an image is a 400 in OpenAI's shape,
code ``images_not_served``, naming the engine, the family and llama.cpp, after which the
server still answers. A model an engine cannot load at all (a Qwen-VL GGUF on basert, a Gemma 3
shallower than mlx-lm's Gemma 3 runs) stops ``superfluid serve`` with a ConfigError naming the
engine, the family and the engine that serves it, and no traceback. One server per engine
serves every form it can as a model of its own.

MLX serves Gemma 3's text from a six-layer copy of the fixture built here (transformers' own
class, seeded random weights, the fixture's tokenizer): mlx-lm's Gemma 3 needs a global layer
among every six, and the shared fixture has two sliding ones."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from tests import vlm_families_reference as ref

from . import vision_cases as cases
from .serverproc import ServerProcess

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

MODEL = "vlm"
NAMES = {"gemma3": "Gemma 3", "qwen2.5-vl": "Qwen2.5-VL", "qwen3-vl": "Qwen3-VL"}
CHAT = [{"role": "user", "content": "Hello there, who are you?"}]
N = 8

# (engine, family, form): the forms each engine can serve as text
SERVED = [("basert", "gemma3", "hf"), ("basert", "gemma3", "gguf"), ("basert", "qwen2.5-vl", "hf"),
          ("basert", "qwen3-vl", "hf"), ("mlx", "gemma3", "hf6"), ("mlx", "qwen2.5-vl", "hf"),
          ("mlx", "qwen3-vl", "hf")]
# (engine, family, form, words the ConfigError holds)
REFUSED = [("basert", "qwen2.5-vl", "gguf", "Qwen2-VL / Qwen2.5-VL"), ("basert", "qwen3-vl", "gguf", "Qwen3-VL"),
           ("mlx", "gemma3", "hf", "Gemma 3")]


def _six_layer_gemma3(root: Path) -> Path:
    """The Gemma 3 fixture's directory with six text layers (five sliding, one global), seeded
    random weights, saved by transformers (built once a session under ``root``)."""
    target = root / "gemma3-6-layers"
    if (target / "config.json").exists():
        return target
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    source = ref.fixture("gemma3")["hf"]
    config = Gemma3Config.from_pretrained(str(source))
    config.text_config.num_hidden_layers = 6
    config.text_config.layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    torch.manual_seed(1234)
    stage = root / "stage"
    Gemma3ForConditionalGeneration(config).eval().save_pretrained(stage, safe_serialization=True)
    for f in source.iterdir():  # the tokenizer, its chat template, the processor
        if not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, stage / f.name)
    stage.rename(target)
    return target


@pytest.fixture(scope="session")
def six_layer_gemma3(tmp_path_factory):
    return _six_layer_gemma3(tmp_path_factory.mktemp("gemma3-6"))


def _path(family: str, form: str, six_layer) -> str:
    if form == "hf6":
        return str(six_layer)
    paths = ref.fixture(family)
    return str(paths["hf"] if form == "hf" else paths["gguf"])


@functools.cache
def _reference_text(hf_dir: str) -> str:
    """transformers' greedy reply to ``CHAT`` (its chat template, its model class, no image);
    computed once per weights (basert and MLX serve the same fixture, Gemma 3's HF and GGUF forms
    the same weights)."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    cls = transformers.AutoModelForImageTextToText
    model = cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
    return tok.decode(out[0, len(ids):], skip_special_tokens=True)


def _model_name(family: str, form: str) -> str:
    return f"{MODEL}-{family}-{form}"


@pytest.fixture(scope="module")
def engine_servers(tmp_path_factory, six_layer_gemma3):
    """One server per engine serving each of its forms as a model of its own ([[models]] tables:
    one start, and for basert one torch import, instead of one a form), started when a test
    first needs it. A model's requests and refusals touch no other model's lanes."""
    servers: dict[str, ServerProcess] = {}

    def get(engine: str) -> ServerProcess:
        if engine not in servers:
            tmp = tmp_path_factory.mktemp(f"server-{engine}")
            tables = "".join(f'\n[[models]]\nname = "{_model_name(f, form)}"\npath = "{_path(f, form, six_layer_gemma3)}"\n'
                             for e, f, form in SERVED if e == engine)
            cfg = tmp / "superfluid.toml"
            cfg.write_text(f'engine = "{engine}"\nmax-context = 1024\nmax-batch = 2\nthreads = 2\n{tables}')
            servers[engine] = ServerProcess(["--config", str(cfg)], tmp / "server.log",
                                            startup_timeout=300)  # loads them in turn
        return servers[engine]

    yield get
    for srv in servers.values():
        srv.stop()


@pytest.fixture(scope="module", params=SERVED, ids=["-".join(c) for c in SERVED])
def served(request, engine_servers, six_layer_gemma3):
    engine, family, form = request.param
    if engine == "mlx":
        pytest.importorskip("mlx_lm")
    hf_dir = str(six_layer_gemma3) if form == "hf6" else str(ref.fixture(family)["hf"])
    return engine_servers(engine), engine, family, hf_dir, _model_name(family, form)


def _client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="x", timeout=300, max_retries=0)


def _chat(client, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=N, temperature=0)
    return reply.choices[0].message.content


def test_text_chat_equals_transformers(served):
    srv, _engine, _family, hf_dir, model = served
    assert _chat(_client(srv), model) == _reference_text(hf_dir)


def test_an_image_is_a_400_naming_engine_and_family_and_the_server_stays_healthy(served):
    srv, engine, family, _hf, model = served
    client = _client(srv)
    before = _chat(client, model)
    with pytest.raises(openai.BadRequestError) as caught:
        cases.ask(client, model, cases.image_messages(cases.RED))
    error = caught.value.body
    assert error["code"] == "images_not_served" and error["param"] == "messages", error
    message = error["message"]
    assert f"{engine} does not serve {NAMES[family]} images" in message and "llama.cpp" in message, message
    assert srv.get_json("/health")["status"] == "ok"
    assert _chat(client, model) == before  # the refused request left nothing behind


def test_a_streamed_image_request_is_the_same_400(served):
    srv, engine, family, _hf, model = served
    with pytest.raises(openai.BadRequestError) as caught:
        _client(srv).chat.completions.create(model=model, messages=cases.image_messages(cases.BLUE),
                                             max_tokens=N, stream=True)
    assert caught.value.body["code"] == "images_not_served"
    assert NAMES[family] in caught.value.body["message"] and engine in caught.value.body["message"]


@pytest.mark.parametrize("engine,family,form,words", REFUSED, ids=["-".join(c[:3]) for c in REFUSED])
def test_a_model_the_engine_cannot_load_is_a_config_error_naming_who_serves_it(engine, family, form, words,
                                                                                tmp_path):
    if engine == "mlx":
        pytest.importorskip("mlx_lm")
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="server exited with 2"):
        ServerProcess(["--model", _path(family, form, None), "--model-name", MODEL, "--engine", engine,
                       "--max-context", "1024", "--threads", "2"], log, startup_timeout=120)
    text = log.read_text()
    assert f"{engine} does not serve {words} models" in text and "--engine llamacpp" in text, text
    assert "Traceback" not in text, text


def test_the_messages_and_responses_apis_refuse_an_image_with_the_same_reason(served):
    srv, engine, family, _hf, model = served
    png = cases.data_url(cases.RED).split(",", 1)[1]
    status, reply = srv.call("POST", "/v1/messages", {
        "model": model, "max_tokens": N, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
            {"type": "text", "text": cases.QUESTION}]}]})
    assert status == 400 and reply["type"] == "error", reply
    assert f"{engine} does not serve {NAMES[family]} images" in reply["error"]["message"], reply
    status, reply = srv.call("POST", "/v1/responses", {
        "model": model, "max_output_tokens": N, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": cases.data_url(cases.RED)},
            {"type": "input_text", "text": cases.QUESTION}]}]})
    assert status == 400 and reply["error"]["code"] == "images_not_served", reply
    assert NAMES[family] in reply["error"]["message"], reply
