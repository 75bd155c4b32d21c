"""LoRA adapters on MLX through the real server and the ``openai`` client: SmolLM2's Q4_1 GGUF
with the fixture's two adapter GGUFs (tools/fixtures/tiny_lora.py) as ``smollm2:a`` and
``smollm2:b`` beside the base model. Concurrent requests under the three sets take turns by
tick (one set a tick on MLX); each greedy reply equals mlx-lm's own ``LoRALinear`` holding the
same matrices, alone (tests/server/test_mlx_lora.py's reference, computed once a run: the first
prompt's are the ones that module checks). Two prompts a set, so two lanes of one set share its
ticks; the second is short, as SmolLM2 prefills a few tokens a second on MLX's CPU kernels. The
server starts (in a thread) while the references are computed: each takes a core of its own."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
openai = pytest.importorskip("openai")

from superfluid.plugins.vocab import GGUFVocab  # noqa: E402

from . import test_mlx_lora  # noqa: E402

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

PROMPTS = ["The quick brown fox", "Once upon a time"]
SETS = {"smollm2": None, "smollm2:a": "a", "smollm2:b": "b"}


@pytest.fixture(scope="module")
def served(start_server, tiny_lora):
    """(the server, the references): the server starts in a thread while this one computes the
    references, each on a core of its own."""
    with cf.ThreadPoolExecutor(1) as pool:
        srv = pool.submit(start_server, "--engine", "mlx", "--max-batch", "6", "--lora", f"a={tiny_lora['a_gguf']}",
                          "--lora", f"b={tiny_lora['b_gguf']}")
        try:
            ref = references(tiny_lora)
        finally:
            started = srv.result()  # a failed start raises here; a started one stops with the module
    return started, ref


def references(tiny_lora) -> dict[str, dict[str, str]]:
    """{model name: {prompt: text}}: test_mlx_lora's mlx-lm LoRALinear greedy tokens, decoded."""
    path = str(tiny_lora["base_gguf"])
    vocab = GGUFVocab(path, "smollm2")
    try:
        out = {}
        for name, adapter in SETS.items():
            out[name] = {}
            for p in PROMPTS:
                ids = vocab.tokenize(p, add_special=False, parse_special=True)
                lora = str(tiny_lora[f"{adapter}_gguf"]) if adapter else None
                tokens = test_mlx_lora.mlx_lm_reference(path, lora, ids)
                out[name][p] = b"".join(vocab.piece(t) for t in tokens).decode("utf-8", "replace")
        return out
    finally:
        vocab.close()


def test_concurrent_requests_under_three_sets_match_each_reference(served):
    srv, reference = served
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=600, max_retries=0)
    jobs = [(m, p) for m in SETS for p in PROMPTS]

    def ask(job):
        r = client.completions.create(model=job[0], prompt=job[1], max_tokens=test_mlx_lora.N, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    wrong = [(m, p, got, reference[m][p]) for (m, p), got in zip(jobs, answers) if got != reference[m][p]]
    assert not wrong, wrong
    assert len({reference[m][PROMPTS[0]] for m in SETS}) == 3  # the adapters change the replies
