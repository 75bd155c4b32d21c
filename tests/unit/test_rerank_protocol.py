"""The rerank and score bodies (validation, vLLM's pairing rule), a pair's prompt tokens (with a
stand-in tokenizer that records what it was asked) and the llama.cpp classification head's
arithmetic against the formula llama.cpp's rank pooling uses. The real model, server and
clients are in tests/server/test_rerank.py."""

from __future__ import annotations

import numpy as np
import pytest

from superfluid.core.engine import RerankFormat
from superfluid.core.errors import ContextLengthExceeded, InvalidRequest
from superfluid.plugins.http.rerank.pairs import check_fits, pair_tokens
from superfluid.plugins.http.rerank.protocol import MAX_DOCUMENTS, RerankRequest, ScoreRequest
from superfluid.plugins.http.typed import parse
from superfluid.plugins.rank_head import RankHead


# ---- the bodies --------------------------------------------------------------------------------


def test_documents_as_strings_or_objects():
    req = parse(RerankRequest, {"query": "q", "documents": ["a", {"text": "b", "title": "ignored"}]})
    assert req.texts == ["a", "b"] and req.return_documents is True and req.top_n is None


@pytest.mark.parametrize("body, param, code", [
    ({"query": "q", "documents": []}, "documents", "invalid_value"),
    ({"query": "q", "documents": ["x"] * (MAX_DOCUMENTS + 1)}, "documents", "invalid_value"),
    ({"query": "q", "documents": ["a", ""]}, "documents", "invalid_value"),
    ({"query": "", "documents": ["a"]}, "query", "invalid_value"),
    ({"query": "q", "documents": [3]}, "documents", "invalid_type"),
    ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n", "invalid_value"),
    ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n", "invalid_type"),
    ({"query": "q", "documents": ["a"], "max_tokens_per_doc": 0}, "max_tokens_per_doc", "invalid_value"),
    ({"query": "q", "documents": ["a"], "rank_fields": ["text"]}, "rank_fields", "unknown_parameter"),
])
def test_bad_rerank_bodies(body, param, code):
    with pytest.raises(InvalidRequest) as err:
        parse(RerankRequest, body)
    assert err.value.param == param and err.value.code == code, err.value.message


def test_score_pairs_follow_vllm():
    one = parse(ScoreRequest, {"text_1": "q", "text_2": ["a", "b"]})
    assert one.pairs() == [("q", "a"), ("q", "b")]
    assert parse(ScoreRequest, {"text_1": ["q"], "text_2": ["a", "b"]}).pairs() == [("q", "a"), ("q", "b")]
    assert parse(ScoreRequest, {"text_1": ["p", "q"], "text_2": ["a", "b"]}).pairs() == [("p", "a"), ("q", "b")]
    assert parse(ScoreRequest, {"text_1": "q", "text_2": "a"}).pairs() == [("q", "a")]
    with pytest.raises(InvalidRequest) as err:
        parse(ScoreRequest, {"text_1": ["p", "q"], "text_2": "a"}).pairs()
    assert err.value.param == "text_1"
    with pytest.raises(InvalidRequest) as err:
        parse(ScoreRequest, {"text_1": "q", "text_2": ["a", ""]})
    assert err.value.param == "text_2"


# ---- a pair's tokens -----------------------------------------------------------------------------


class Recorder:
    """A stand-in tokenizer: one token per character, a special piece as one token (-1), and a
    log of (text, parse_special) calls."""

    def __init__(self):
        self.calls: list[tuple[str, bool]] = []

    def tokenize(self, text, add_special=True, parse_special=True):
        assert add_special is False
        self.calls.append((text, parse_special))
        if parse_special and text.startswith("<s>"):
            return [-1] + [ord(c) for c in text[3:]]
        return [ord(c) for c in text]


def test_template_pieces_are_markup_and_texts_are_text():
    rec = Recorder()
    fmt = RerankFormat(template="<s>Q: {query}\nD: {document}<s>")
    tokens = pair_tokens(rec, fmt, "hi <s>", "doc")
    # the space before a slot goes with the text; the client's "<s>" is characters, not the special token
    assert rec.calls == [("<s>Q:", True), (" hi <s>", False), ("\nD:", True), (" doc", False), ("<s>", True)]
    assert tokens.count(-1) == 2


def test_document_cut_and_plain_format():
    rec = Recorder()
    fmt = RerankFormat(prefix=(1,), middle=(2, 3), suffix=(2,))
    assert pair_tokens(rec, fmt, "ab", "cdef", max_doc_tokens=2) == [1, 97, 98, 2, 3, 99, 100, 2]
    assert pair_tokens(rec, RerankFormat(template="{query}|{document}"), "a", "xyz", 1) == [97, 124, 120]


def test_a_pair_past_the_context_names_it():
    check_fits([[1] * 9], 10, "documents")
    with pytest.raises(ContextLengthExceeded) as err:
        check_fits([[1] * 3, [1] * 10], 10, "documents")
    assert err.value.param == "documents" and "documents[1]" in err.value.message


# ---- the head ----------------------------------------------------------------------------------


def test_bert_style_head_is_dense_tanh_then_out():
    rng = np.random.default_rng(0)
    w, b, ow, ob = rng.normal(size=(4, 4)), rng.normal(size=4), rng.normal(size=(1, 4)), rng.normal(size=1)
    h = rng.normal(size=4)
    head = RankHead("bert", w, b, ow, ob)
    assert head.scores(h) == pytest.approx(list(ow @ np.tanh(w @ h + b) + ob))


def test_qwen3_head_is_softmax_over_yes_and_no():
    rng = np.random.default_rng(1)
    ow, h = rng.normal(size=(2, 4)), rng.normal(size=4)
    yes, no = ow @ h
    scores = RankHead("qwen3", None, None, ow, None).scores(h)
    assert scores[0] == pytest.approx(1 / (1 + np.exp(no - yes))) and sum(scores) == pytest.approx(1.0)


# ---- the lanes -----------------------------------------------------------------------------------


def _lane(**kw):
    from superfluid.core.lane import Lane
    from superfluid.core.request import Request
    from superfluid.core.textstream import TextStream

    req = Request(prompt_tokens=list(range(1, 21)), max_tokens=1, sink=lambda e: None, **kw)
    return Lane(request=req, text=TextStream(lambda t: b"x"))


def test_a_rank_lane_may_start_from_a_cached_prefix_an_embedding_may_not():
    """A rank lane reads only its last position (the pairs of one query share the rest); an
    embedding pools every position, so each must be computed in its own lane."""
    from superfluid.core.seeding import may_reuse

    assert may_reuse(_lane(embed=True, rank=True))
    assert not may_reuse(_lane(embed=True))
    assert not may_reuse(_lane(embed=True, rank=True, reuse_prefix=False))


def test_a_rank_lanes_scores_are_kept_as_computed():
    """Not averaged or normalised as an embedding is: the head's outputs are the scores."""
    from superfluid.core.prompt_work import embedding

    rank, embed = _lane(embed=True, rank=True), _lane(embed=True)
    for lane in (rank, embed):
        lane.embedding_sum, lane.pooled = np.array([0.8, 0.2]), 1
    assert embedding(rank) == (0.8, 0.2)
    assert embedding(embed) == pytest.approx((0.8 / np.hypot(0.8, 0.2), 0.2 / np.hypot(0.8, 0.2)))
