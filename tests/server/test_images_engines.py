"""Images on basert and MLX, through the ``openai`` client against a real server serving the tiny
SmolVLM's transformers directory (tools/fixtures/tiny_vlm.py): replies equal transformers' for a
red and a blue image and differ, two concurrent image requests equal one at a time, and the same
image twice is encoded once with its KV reused past the image (llama.cpp's are in
test_images.py)."""

from __future__ import annotations

import pytest

from tools.fixtures.tiny_vlm import build

from . import vision_cases as cases

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

openai = pytest.importorskip("openai")
MODEL = "vlm"


@pytest.fixture(scope="module", params=["basert", "mlx"])
def engine_server(request, start_server):
    if request.param == "mlx":
        pytest.importorskip("mlx_vlm")
    else:
        pytest.importorskip("torch")
    hf = build(gguf=False)["hf"]
    srv = start_server("--engine", request.param, "--model-name", MODEL, "--max-batch", "4", model=str(hf))
    yield srv, str(hf)
    srv.stop()


@pytest.fixture
def client(engine_server):
    return openai.OpenAI(base_url=engine_server[0].base + "/v1", api_key="x", timeout=300, max_retries=0)


def test_red_and_blue_equal_the_transformers_reference_and_differ(engine_server, client):
    cases.check_reference_red_and_blue(client, MODEL, engine_server[1])


def test_two_concurrent_image_requests_equal_one_at_a_time(client):
    cases.check_concurrent_equals_alone(client, MODEL)


def test_the_same_image_twice_is_encoded_once_and_its_kv_reused(engine_server, client):
    got = cases.check_same_image_encodes_once(client, MODEL, engine_server[0])
    assert got["encodes"] == (1, 0) and got["prefilled"][1] <= 1
