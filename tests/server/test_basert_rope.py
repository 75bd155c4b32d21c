"""Rope scaling reaches basert through the server: a tiny random-weight llama GGUF
(tests/tinygguf.py: a 64-token training window, weights spread enough that positions matter)
served by basert with ``--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 64`` and
``--max-context 256`` (four times the training window, accepted because scaling is on), a
~240-token prompt (past the 64-token window): the greedy reply through the openai client, and
the logprob of each token it chose, equal transformers' LlamaForCausalLM reading the same GGUF
with ``rope_parameters`` set to that YaRN. The tiny model takes SmolLM2's path (GGUF loader, the
options' YaRN, the served sampler) at a fraction of the reference's cost. The math itself is
tested on tiny models in tests/unit/test_basert_rope.py."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

WINDOW = 64  # the tiny model's training context, and the YaRN's original window
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW}
TOKENS = 10  # the tiny model's 8th token starts a multi-byte character the server holds back; its 10th ends clean
NOTES = 8    # a ~240-token prompt with the tiny vocabulary: past the window, and with the reply within 256


def reference(path: str, scaling: dict | None):
    """transformers' model of the GGUF (its own GGUF conversion), with ``scaling`` as its rope."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, file = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    if scaling:
        config.rope_parameters = {**scaling, "rope_theta": config.rope_parameters["rope_theta"]}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    model.load_state_dict({k: v.float() for k, v in parsed["tensors"].items()}, strict=False)
    model.tie_weights()
    return model.eval()


def greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq).logits[0, -1].float()
            tok = int(logits.argmax())
            tokens.append(tok)
            logprobs.append(float(torch.log_softmax(logits, -1)[tok]))
            seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
    return tokens, logprobs


@pytest.fixture
def tiny(tmp_path) -> str:
    """The tiny llama GGUF with a 64-token training window; std 0.2 makes attention sharp enough
    that rope frequencies change the reply (at tinygguf's default 0.02 attention is nearly uniform)."""
    from ..tinygguf import write_tiny_llama

    return str(write_tiny_llama(tmp_path / "tiny-64.gguf", context_length=WINDOW, std=0.2))


def test_basert_served_with_yarn_equals_transformers(start_server, tiny):
    from superfluid.plugins.vocab import GGUFVocab

    srv = start_server("--engine", "basert", "--max-batch", "2", "--max-context", str(4 * WINDOW), "--rope-scaling",
                       "yarn", "--rope-scale", "4", "--yarn-orig-ctx", str(WINDOW), model=tiny)
    listed = {m["id"]: m for m in srv.get_json("/v1/models")["data"]}
    assert listed["smollm2"]["context_length"] == 4 * WINDOW  # four times the training window: scaling is on
    notes = " ".join(f"Note {i}: the team ships the {i}th part on day {i}." for i in range(NOTES))
    prompt = f"<|im_start|>user\n{notes}\nWhich day is the 7th part shipped?<|im_end|>\n<|im_start|>assistant\n"
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300, max_retries=0)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    served_text, served_lp = r.choices[0].text, r.choices[0].logprobs.token_logprobs
    srv.stop()

    vocab = GGUFVocab(tiny, "smollm2")
    threads = torch.get_num_threads()
    try:
        ids = vocab.tokenize(prompt, True, True)
        assert 4 * WINDOW - TOKENS >= len(ids) == r.usage.prompt_tokens > 150
        # one thread: the tiny model's forward is ~1 ms of work, and on a busy 2-core machine two
        # threads wait on each other for most of a second a step (13 s against 0.25 s for the 20)
        torch.set_num_threads(1)
        tokens, logprobs = greedy(reference(tiny, YARN), ids, TOKENS)
        text = b"".join(vocab.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")
        plain, _ = greedy(reference(tiny, None), ids, TOKENS)
    finally:
        torch.set_num_threads(threads)
        vocab.close()
    assert served_text == text, (served_text, text)
    assert max(abs(a - b) for a, b in zip(served_lp, logprobs)) < 2e-3
    assert plain != tokens  # the unscaled model answers otherwise: the scaling reached the model
