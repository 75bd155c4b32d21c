"""core/constrain.py: JSON constraints as llguidance grammars and token masks, on the real
SmolLM2 vocabulary (read vocab-only: no weights)."""

from __future__ import annotations

import pytest

from superfluid.core.constrain import UnsupportedConstraint, check, closed
from superfluid.core.request import JsonChoice, JsonConstraint, SamplingParams

from ..constraint_walk import takes, tokens_of

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("llguidance")

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def held_to(schema, lead: str = "", tail: str = "") -> SamplingParams:
    return SamplingParams(json_schema=JsonConstraint(choices=(JsonChoice(lead, schema),), tail=tail))


@pytest.fixture(scope="module")
def vocab(model_path):
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    yield llama_cpp.llama_model_get_vocab(model)
    llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def model_path():
    from superfluid.core.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def constrainer(vocab):
    from superfluid.plugins.llamacpp.constraints import constrainer

    return constrainer(vocab, llama_cpp.llama_vocab_n_tokens(vocab))


def test_objects_that_list_properties_are_closed_unless_they_say():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {}}}}
    got = closed(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in got["properties"]  # a property map is not a schema
    assert "additionalProperties" not in schema  # the caller's schema is not changed


@pytest.mark.parametrize("schema, reason", [
    ({"type": "string", "format": "made-up"}, "made-up"),
    ({"$ref": "https://example.com/s.json"}, "example.com"),
])
def test_a_schema_llguidance_cannot_enforce_is_refused_with_its_reason(schema, reason):
    with pytest.raises(UnsupportedConstraint, match=reason):
        check(held_to(schema))


def test_a_plain_sampling_has_nothing_to_check():
    check(SamplingParams())


def test_masks_follow_the_schema_lead_and_tail(constrainer, vocab):
    params = held_to(PERSON, lead="<x>", tail="</x>")
    assert takes(constrainer, vocab, params, '<x>{"name": "Bo", "age": 7}</x>')
    assert not takes(constrainer, vocab, params, '<x>{"name": "Bo"}</x>')  # age is required
    assert not takes(constrainer, vocab, params, '<x>{"name": "Bo", "age": 7, "x": 1}</x>')  # closed
    assert not takes(constrainer, vocab, params, '{"name": "Bo", "age": 7}')  # no lead


def test_a_complete_value_allows_only_the_end(constrainer, vocab):
    lane = constrainer.for_lane(held_to({"type": "integer", "maximum": 9}))
    for token in tokens_of(vocab, "7"):
        lane.accept(token)
    allowed = lane.allowed()
    assert set(allowed.nonzero()[0]) <= set(constrainer.eos) and allowed[constrainer.eos[0]]


def test_a_resumed_lane_continues_where_its_tokens_left_it(constrainer, vocab):
    generated = tokens_of(vocab, '{"name": "Al')
    fresh = constrainer.for_lane(held_to(PERSON))
    for token in generated:
        fresh.accept(token)
    resumed = constrainer.for_lane(held_to(PERSON), generated=generated)
    assert (fresh.allowed() == resumed.allowed()).all()


def test_masks_along_a_draft_are_the_masks_the_lane_meets_and_leave_it_in_place(constrainer, vocab):
    """A speculating lane's verify rows: the mask before each drafted token and after the last,
    as taking them one by one gives; from a token the grammar refuses on, that token's mask
    repeats; the lane's own place does not move."""
    start = tokens_of(vocab, '{"name": "Al')
    draft = tokens_of(vocab, 'ice", "age": 3')
    lane = constrainer.for_lane(held_to(PERSON), generated=start)
    before = lane.allowed()
    masks = lane.masks_along(draft)
    assert len(masks) == len(draft) + 1
    assert (lane.allowed() == before).all()
    walker = constrainer.for_lane(held_to(PERSON), generated=start)
    for i, token in enumerate(draft):
        assert (masks[i] == walker.allowed()).all()
        walker.accept(token)
    assert (masks[-1] == walker.allowed()).all()
    refused = tokens_of(vocab, 'ice", "x')  # "x" is no property of PERSON
    masks = lane.masks_along(refused)
    assert not masks[len(refused) - 1][refused[-1]]
    assert (masks[-1] == masks[len(refused) - 1]).all() and (lane.allowed() == before).all()


# ---- a thinking budget ----------------------------------------------------------------------------

def _allows(lane, tokens) -> list[bool]:
    out = []
    for t in tokens:
        out.append(bool(lane.allowed()[t]))
        if not out[-1]:
            break
        lane.accept(t)
    return out


@pytest.mark.parametrize("budget", [1, 4, 9])
def test_a_think_budget_allows_only_the_end_marker_after_its_tokens(constrainer, vocab, budget):
    from superfluid.core.request import ThinkBudget

    lane = constrainer.for_lane(SamplingParams(think_budget=ThinkBudget(budget)))
    opening = tokens_of(vocab, "<think>")
    thought = tokens_of(vocab, " I am thinking about many many things in the world right now and more")
    assert all(_allows(lane, opening + thought[:budget]))
    if budget < len(thought):
        assert not _allows(lane, thought[budget:budget + 1])[0]  # one token more of thinking: refused
    closing = tokens_of(vocab, "</think>")
    assert all(_allows(lane, closing + tokens_of(vocab, " The answer.")))


def test_a_think_budget_lets_the_model_close_early_and_answer_freely(constrainer, vocab):
    from superfluid.core.request import ThinkBudget

    lane = constrainer.for_lane(SamplingParams(think_budget=ThinkBudget(6, open=None)))
    answer = " and then the answer runs on well past the budget of six tokens, as long as it likes."
    assert all(_allows(lane, tokens_of(vocab, " short</think>" + answer)))


def test_a_think_budget_with_a_grammar_or_a_schema_is_refused():
    from superfluid.core.request import ThinkBudget

    with pytest.raises(UnsupportedConstraint, match="thinking budget"):
        check(SamplingParams(think_budget=ThinkBudget(8), grammar='root ::= "a"'))
    with pytest.raises(UnsupportedConstraint, match="thinking budget"):
        check(held_to(PERSON).__class__(think_budget=ThinkBudget(8), json_schema=held_to(PERSON).json_schema))
