"""POST /v1/rerank and /v1/score against the real server serving a reranker, on llama.cpp and basert.

The model is tools/fixtures/tiny_reranker.py's tiny random Qwen3-Reranker-style cross-encoder,
converted by llama.cpp's own converter (rank pooling, a "yes"/"no" head). The reference is
transformers on the fixture's own weights: the rerank template filled in, tokenized whole, and
softmax([logit(yes), logit(no)])[0] at the last position, as the model card scores a pair; and
llama-cpp-python's ``Llama`` with llama.cpp's own rank pooling. The Cohere Python client (v2 and
v1) drives /v1/rerank as a RAG stack would; /v1/score is plain HTTP (vLLM's shape)."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request

import numpy as np
import pytest

from superfluid.plugins.http.keys.policy import hash_secret

from ..llama_reference import in_child

pytestmark = pytest.mark.two_at_a_time  # tools/dev/test.sh may run it beside another module (pyproject.toml)

cohere = pytest.importorskip("cohere")
torch = pytest.importorskip("torch")

QUERY = "what is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris.",
        "print('hello')", "a", "Berlin is in Germany and has many museums", "12345"]
TOL = 1e-3  # transformers in float32 against llama.cpp's f32 GGUF, batched differently


@pytest.fixture(scope="module")
def fixture():
    from tools.fixtures import tiny_reranker

    return tiny_reranker.build()


@pytest.fixture(scope="module")
def template(fixture) -> str:
    import gguf

    return gguf.GGUFReader(str(fixture["gguf"])).fields["tokenizer.chat_template.rerank"].contents()


@pytest.fixture(scope="module")
def reference(fixture, template):
    """score(query, documents) by transformers on the fixture's weights."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(fixture["hf"]))
    model = Qwen3ForCausalLM.from_pretrained(str(fixture["hf"]), torch_dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")

    scores: dict[tuple[str, str], float] = {}  # a pair's score is its own: computed once a module

    def score(query: str, documents: list[str]) -> list[float]:
        out = []
        for doc in documents:
            if (query, doc) not in scores:
                ids = tok(template.replace("{query}", query).replace("{document}", doc),
                          add_special_tokens=False)["input_ids"]
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, -1]
                scores[query, doc] = torch.softmax(torch.stack([logits[yes], logits[no]]), 0)[0].item()
            out.append(scores[query, doc])
        return out

    return score


def llama_rank_scores(path: str, prompts: list[str]) -> list[list[float]]:
    """llama-cpp-python's own rank pooling (run in a child): each prompt's head outputs."""
    import llama_cpp

    from superfluid.plugins.llamacpp.extra_buffers import reference_llama

    llm = reference_llama(model_path=path, n_ctx=512, embedding=True, verbose=False, n_threads=2,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK)
    try:
        out = []
        for text in prompts:
            ids = llm.tokenize(text.encode(), add_bos=False, special=True)
            llm.reset()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
            llm.eval(ids)
            row = llama_cpp.llama_get_embeddings_seq(llm.ctx, 0)
            out.append([row[0], row[1]])
        return out
    finally:
        llm.close()


@pytest.fixture(scope="module", params=["llamacpp", "basert"])
def rr(request, start_server, fixture):
    """The reranker served on each engine (the same GGUF: basert reads its weights and head too)."""
    return start_server("--engine", request.param, "--max-batch", "4", "--max-context", "512",
                        model=str(fixture["gguf"]))


def _post(srv, path: str, body: dict, secret: str | None = None, headers: dict | None = None):
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if secret:
        hdrs["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(srv.base + path, data=json.dumps(body).encode(), method="POST", headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read())


# ---- scores equal the references -------------------------------------------------------------


def test_the_fixture_is_a_reranker_that_llama_cpp_scores_as_transformers(fixture, template, reference):
    """The converted GGUF declares rank pooling and its head; llama.cpp's own rank pooling gives
    transformers' scores, and the documents score apart (else ordering would test nothing)."""
    import gguf

    fields = gguf.GGUFReader(str(fixture["gguf"])).fields
    assert int(fields["qwen3.pooling_type"].contents()) == 4
    ref = reference(QUERY, DOCS)
    prompts = [template.replace("{query}", QUERY).replace("{document}", d) for d in DOCS]
    ours = in_child(llama_rank_scores, str(fixture["gguf"]), prompts)
    np.testing.assert_allclose([s[0] for s in ours], ref, atol=TOL)
    assert max(ref) - min(ref) > 0.05 and len({round(s, 3) for s in ref}) == len(ref)


def test_cohere_v2_client_ranks_as_transformers(rr, reference):
    client = cohere.ClientV2(base_url=rr.base, api_key="unused")
    reply = client.rerank(model="smollm2", query=QUERY, documents=DOCS)
    ref = reference(QUERY, DOCS)
    assert [r.index for r in reply.results] == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    for r in reply.results:
        assert abs(r.relevance_score - ref[r.index]) < TOL, (r.index, r.relevance_score, ref[r.index])


def test_cohere_v1_client_top_n_and_documents(rr, reference):
    client = cohere.Client(base_url=rr.base, api_key="unused")
    reply = client.rerank(model="smollm2", query=QUERY, documents=[{"text": d} for d in DOCS], top_n=3,
                          return_documents=True)
    ref = reference(QUERY, DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -ref[i])[:3]
    assert [r.index for r in reply.results] == best
    assert [r.document.text for r in reply.results] == [DOCS[i] for i in best]
    assert reply.id and reply.id.startswith("rerank-")


def test_shuffled_documents_change_only_the_order(rr):
    """A document's score is its own: whatever its neighbours and position in the list (so in
    whatever lane and batch it ran), it gets the same score."""
    _, _, first = _post(rr, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    shuffled = DOCS[:]
    random.Random(7).shuffle(shuffled)
    _, _, second = _post(rr, "/v1/rerank", {"query": QUERY, "documents": shuffled, "return_documents": False})
    by_text = {r["document"]["text"]: r["relevance_score"] for r in first["results"]}
    assert all("document" not in r for r in second["results"])
    for r in second["results"]:
        assert abs(r["relevance_score"] - by_text[shuffled[r["index"]]]) < TOL  # batched differently
    assert [shuffled[r["index"]] for r in second["results"]] == [r["document"]["text"] for r in first["results"]]


def _hit_tokens(srv) -> float:
    return srv.settled_metric("superfluid_prefix_cache_hit_tokens_total")


def test_pairs_of_one_query_share_its_prefix(rr, reference):
    """A rank lane needs only its last position, so the pairs of one query start from the KV of
    the prompt up to the document (the instruction and the query) that an earlier pair left; the
    scores are the same as computed whole."""
    _post(rr, "/v1/rerank", {"query": QUERY, "documents": ["warm the cache with this query"]})
    before = _hit_tokens(rr)
    _, _, reply = _post(rr, "/v1/rerank", {"query": QUERY, "documents": DOCS[:3]})
    assert _hit_tokens(rr) > before
    ref = reference(QUERY, DOCS[:3])
    for r in reply["results"]:
        assert abs(r["relevance_score"] - ref[r["index"]]) < TOL


def test_score_pairs(rr, reference):
    status, _, reply = _post(rr, "/v1/score", {"model": "smollm2", "text_1": QUERY, "text_2": DOCS[:3]})
    assert status == 200 and reply["object"] == "list" and reply["usage"]["prompt_tokens"] > 0
    assert [d["index"] for d in reply["data"]] == [0, 1, 2] and {d["object"] for d in reply["data"]} == {"score"}
    np.testing.assert_allclose([d["score"] for d in reply["data"]], reference(QUERY, DOCS[:3]), atol=TOL)
    # two lists zipped: each pair its own query
    other = "which fruit is yellow?"
    status, _, zipped = _post(rr, "/score", {"text_1": [QUERY, other], "text_2": [DOCS[0], DOCS[1]]})
    assert status == 200
    want = [reference(QUERY, [DOCS[0]])[0], reference(other, [DOCS[1]])[0]]
    np.testing.assert_allclose([d["score"] for d in zipped["data"]], want, atol=TOL)


def test_pairs_are_the_template_tokenized_whole(rr, fixture, template):
    """The pair's tokens (client text never parsed as special tokens) are those of the whole
    filled-in template for plain text; a document holding special-token text stays text."""
    from transformers import AutoTokenizer

    from superfluid.core.engine import RerankFormat
    from superfluid.plugins.http.rerank.pairs import pair_tokens
    from superfluid.plugins.vocab.gguf import Vocab

    tok = AutoTokenizer.from_pretrained(str(fixture["hf"]))
    vocab = Vocab(str(fixture["gguf"]), "rr")

    class Engine:
        def tokenize(self, text, add_special=True, parse_special=True):
            return vocab.tokenize(text, add_special, parse_special)

    try:
        fmt = RerankFormat(template=template)
        for doc in DOCS + ["  two spaces", "ends with space "]:
            whole = tok(template.replace("{query}", QUERY).replace("{document}", doc), add_special_tokens=False)
            assert pair_tokens(Engine(), fmt, QUERY, doc) == whole["input_ids"], doc
        sneaky = pair_tokens(Engine(), fmt, QUERY, "x<|im_end|>")
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        assert sneaky.count(im_end) == template.count("<|im_end|>")
    finally:
        vocab.close()


# ---- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": ["x"] * 1001}, "documents"),
    ({"query": QUERY, "documents": ["ok", ""]}, "documents"),
    ({"query": QUERY, "documents": [{"text": ""}]}, "documents"),
    ({"query": "", "documents": ["x"]}, "query"),
    ({"documents": ["x"]}, "query"),
    ({"query": QUERY, "documents": "x"}, "documents"),
    ({"query": 1, "documents": ["x"]}, "query"),
    ({"query": QUERY, "documents": [{"title": "no text"}]}, "documents"),
    ({"query": QUERY, "documents": ["x"], "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": ["x"], "max_chunks_per_doc": 2}, "max_chunks_per_doc"),
])
def test_bad_rerank_bodies(rr, body, param):
    status, _, reply = _post(rr, "/v1/rerank", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


@pytest.mark.parametrize("body, param", [
    ({"text_1": [QUERY, QUERY], "text_2": DOCS[:3]}, "text_1"),
    ({"text_1": QUERY, "text_2": []}, "text_2"),
    ({"text_1": QUERY}, "text_2"),
    ({"text_1": QUERY, "text_2": [1]}, "text_2"),
])
def test_bad_score_bodies(rr, body, param):
    status, _, reply = _post(rr, "/v1/score", body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_a_pair_longer_than_the_context(rr):
    long_doc = "word " * 600
    status, _, reply = _post(rr, "/v1/rerank", {"query": QUERY, "documents": ["short", long_doc]})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "documents[1]" in reply["error"]["message"]
    # cut to fit (Cohere's max_tokens_per_doc): scored, and the cut document scores as its cut text
    status, _, cut = _post(rr, "/v1/rerank", {"query": QUERY, "documents": ["short", long_doc],
                                              "max_tokens_per_doc": 50})
    assert status == 200 and len(cut["results"]) == 2, cut


def test_a_model_that_is_not_a_reranker_is_refused(server):
    status, _, reply = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS})
    assert status == 400 and reply["error"]["code"] == "model_not_reranker", reply
    assert "(engine llamacpp)" in reply["error"]["message"]
    status, _, reply = _post(server, "/v1/score", {"text_1": QUERY, "text_2": "x"})
    assert status == 400 and reply["error"]["code"] == "model_not_reranker"


# ---- QoS and the key policy, as for embeddings -------------------------------------------------

SECRETS = {"agent": "sk-rerank-agent", "other": "sk-rerank-other", "one": "sk-rerank-one"}
POLICY = f"""
[keys.agent]
sha256 = "{hash_secret(SECRETS['agent'])}"
class = "agent"

[keys.other]
sha256 = "{hash_secret(SECRETS['other'])}"
models = ["some-other-model"]

[keys.one]
sha256 = "{hash_secret(SECRETS['one'])}"
requests-per-minute = 2
"""


@pytest.fixture(scope="module")
def keyed(start_server, fixture, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(POLICY)
    return start_server("--key-policy", str(path), "--max-batch", "2", "--max-context", "512",
                        model=str(fixture["gguf"]))


def test_classes_keys_and_limits_apply(keyed):
    body = {"query": QUERY, "documents": DOCS[:2]}
    assert _post(keyed, "/v1/rerank", body)[0] == 401
    status, _, reply = _post(keyed, "/v1/rerank", body, SECRETS["other"])
    assert status == 403 and reply["error"]["code"] == "model_not_allowed"
    status, headers, _ = _post(keyed, "/v1/rerank", {**body, "superfluid": {"qos": "background"}}, SECRETS["agent"],
                               {"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "background"
    status, headers, _ = _post(keyed, "/v1/score", {"text_1": QUERY, "text_2": "x"}, SECRETS["agent"],
                               {"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "agent"  # the key's class is the ceiling
    statuses = [_post(keyed, "/v1/rerank", body, SECRETS["one"])[0] for _ in range(3)]
    assert statuses == [200, 200, 429]
