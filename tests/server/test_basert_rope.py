"""Rope scaling reaches basert through the server: SmolLM2 (the GGUF) served by basert with
``--rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 64`` and ``--max-context 16384`` (twice the
training window, accepted because scaling is on), a ~200-token prompt (past the 64-token original
window): the greedy reply through the openai client, and the logprob of each token it chose,
equal transformers' LlamaForCausalLM reading the same GGUF with ``rope_parameters`` set to that
YaRN. The math itself is tested on tiny models in tests/unit/test_basert_rope.py."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
openai = pytest.importorskip("openai")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
TOKENS = 8


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


def test_basert_served_with_yarn_equals_transformers(start_server, model_path):
    from superfluid.plugins.vocab import GGUFVocab

    srv = start_server("--engine", "basert", "--max-batch", "2", "--max-context", "16384", "--rope-scaling", "yarn",
                       "--rope-scale", "4", "--yarn-orig-ctx", "64")
    listed = {m["id"]: m for m in srv.get_json("/v1/models")["data"]}
    assert listed["smollm2"]["context_length"] == 16384  # twice the training window: scaling is on
    notes = " ".join(f"Note {i}: the team ships the {i}th part on day {i}." for i in range(14))
    prompt = f"<|im_start|>user\n{notes}\nWhich day is the 7th part shipped?<|im_end|>\n<|im_start|>assistant\n"
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", timeout=300, max_retries=0)
    r = client.completions.create(model="smollm2", prompt=prompt, max_tokens=TOKENS, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    served_text, served_lp = r.choices[0].text, r.choices[0].logprobs.token_logprobs
    srv.stop()

    vocab = GGUFVocab(model_path, "smollm2")
    try:
        ids = vocab.tokenize(prompt, True, True)
        assert len(ids) == r.usage.prompt_tokens > 150
        torch.set_num_threads(2)
        tokens, logprobs = greedy(reference(model_path, YARN), ids, TOKENS)
        text = b"".join(vocab.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")
        plain, _ = greedy(reference(model_path, None), ids, TOKENS)
    finally:
        vocab.close()
    assert served_text == text, (served_text, text)
    assert max(abs(a - b) for a, b in zip(served_lp, logprobs)) < 2e-3
    assert plain != tokens  # the unscaled model answers otherwise: the scaling reached the model
