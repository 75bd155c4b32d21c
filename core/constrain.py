"""Constrained sampling for every engine: a request's JSON constraint (or GBNF grammar) as token
masks, computed by llguidance.

An engine builds one :class:`Constrainer` from its vocabulary (``llguidance``'s tokenizer for
llama.cpp's vocab or a Hugging Face tokenizer) and asks it for a :class:`LaneConstraint` per
constrained lane. Before sampling the lane's token it calls :meth:`LaneConstraint.mask` on the
logits row (disallowed tokens become −inf), then :meth:`LaneConstraint.accept` with the token it
sampled. llguidance computes a mask in tens of microseconds (measured: 0.04 ms a token on
SmolLM2's 49,152-token vocabulary, against 7–11 ms for llama.cpp's GBNF sampler), so a
constrained lane costs about what a free one does; see docs/api.md, "Structured output".

Front ends call :func:`check` before submitting: a schema llguidance cannot enforce is refused
with its reason, never served unconstrained."""

from __future__ import annotations

import functools
import json
import logging
from typing import Sequence

import numpy as np

from .request import JsonConstraint, SamplingParams, is_text

log = logging.getLogger("superfluid.constrain")

# JSON as json.dumps writes it: ", " and ": " between items, no other whitespace. A small model
# given free whitespace inside a constrained value can pad it with newlines until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class UnsupportedConstraint(ValueError):
    """llguidance cannot enforce this schema or grammar; the message says which part."""


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema):
    """``schema`` with every object that lists ``properties`` but says nothing of others closed
    to them (``additionalProperties: false``), as llama.cpp's converter reads such a schema: a
    model held to a function's parameters should not invent more. A schema that states
    ``additionalProperties`` keeps what it states."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: ({name: closed(sub) for name, sub in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict)
               else closed(v)) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _json_value(schema: dict) -> str:
    """A Lark ``%json`` value for ``schema`` (closed, see :func:`closed`), laid out as
    :data:`JSON_LAYOUT`."""
    guided = closed(schema)
    if isinstance(guided, dict):
        guided["x-guidance"] = {**JSON_LAYOUT, **(guided.get("x-guidance") or {})}
    return "%json " + json.dumps(guided, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _choice_body(choice) -> str:
    """One :class:`~.request.JsonChoice` as a Lark sequence: its lead, its value, its rest."""
    pieces = [_literal(choice.lead)] if choice.lead else []
    if is_text(choice.schema):
        limit = choice.schema.get("maxLength")
        pieces.append(r"/[^<\n\x00-\x1f]" + (f"{{1,{limit}}}/" if limit else "+/"))
    elif choice.schema is not None:
        pieces.append(_json_value(choice.schema))
    for part in choice.rest:
        body = _choice_body(part)
        pieces.append(f"({body})?" if part.optional else body)
    return " ".join(pieces) or '""'


def _constraint_body(constraint: JsonConstraint) -> str:
    parts = [_choice_body(choice) for choice in constraint.choices]
    body = parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"
    tail = " " + _literal(constraint.tail) if constraint.tail else ""
    return body + tail


@functools.lru_cache(maxsize=256)
def _constraint_grammar(constraint: JsonConstraint) -> str:
    return "start: " + _constraint_body(constraint) + "\n"


def grammar(params: SamplingParams) -> str | None:
    """llguidance's grammar text for a lane's constraint (None: it has none)."""
    import llguidance

    if params.think_budget is not None:
        if params.grammar or params.json_schema is not None:
            raise UnsupportedConstraint("a thinking budget cannot be combined with a grammar, a JSON schema or a "
                                        "forced tool call yet")
        return None  # enforced by core/think_budget.py, not a grammar
    if params.json_schema is not None:
        return llguidance.LLMatcher.grammar_from_lark(_constraint_grammar(params.json_schema))
    if params.grammar:
        return llguidance.LLMatcher.grammar_from_lark(_gbnf_as_lark(params.grammar))
    return None


@functools.lru_cache(maxsize=64)
def _gbnf_as_lark(gbnf: str) -> str:
    # the function, from its module: once that submodule is imported, the package attribute of the
    # same name is the module, not the function
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(gbnf)


@functools.lru_cache(maxsize=256)
def _problem(text: str) -> str:
    import llguidance

    return llguidance.LLMatcher.validate_grammar(text)


def check(params: SamplingParams) -> None:
    """Raise :class:`UnsupportedConstraint` (its message llguidance's reason) if a lane's
    constraint cannot be enforced: an unknown ``format``, a remote ``$ref``, a bad pattern..."""
    try:
        text = grammar(params)
    except Exception as exc:  # noqa: BLE001 - a schema that is not even JSON-serialisable
        raise UnsupportedConstraint(str(exc)) from None
    if text is None:
        return
    problem = _problem(text)
    if problem:
        raise UnsupportedConstraint(problem)


def apply_mask(logits: np.ndarray, allowed: np.ndarray) -> None:
    """Set ``logits`` to −inf, in place, where ``allowed`` (a bool per vocabulary token) is False,
    and past its end (padding rows of a wider logits row)."""
    n = allowed.shape[0]
    logits[:n][~allowed] = -np.inf
    logits[n:] = -np.inf


class LaneConstraint:
    """One lane's place in its grammar."""

    def __init__(self, matcher, n_vocab: int, eos: tuple[int, ...]):
        import llguidance.numpy as lln

        self._lln = lln
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.eos = eos
        self.bits = lln.allocate_token_bitmask(1, n_vocab)

    def allowed(self) -> np.ndarray:
        """A bool per token: whether it may come next (the end-of-generation tokens once the
        grammar is complete)."""
        self._lln.fill_next_token_bitmask(self.matcher, self.bits)
        allowed = np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:self.n_vocab].astype(bool)
        if self.matcher.is_error():  # nothing may follow a broken state but the end
            allowed[:] = False
            allowed[list(self.eos)] = True
        return allowed

    def mask(self, logits: np.ndarray) -> None:
        """Set the logits of tokens that may not come next to −inf, in place (``logits`` a row
        of at least ``n_vocab`` values; the rest are padding, masked too)."""
        apply_mask(logits, self.allowed())

    def accept(self, token: int) -> bool:
        """Move past a sampled (or replayed) token; False if the grammar did not allow it."""
        if self.matcher.is_stopped() and token in self.eos:
            return True
        ok = self.matcher.consume_token(token)
        if not ok:
            log.warning("constrained lane took token %d its grammar refused: %s", token, self.matcher.get_error())
        return ok

    def masks_along(self, tokens: Sequence[int]) -> list[np.ndarray]:
        """What :meth:`allowed` says before each of ``tokens`` and after the last (one more than
        ``tokens``), as the lane would see it taking them one by one: what a verify step masks its
        rows with when the lane speculates. The lane's own place is left where it was (moved along,
        then rolled back). From a token the grammar refuses (or an end-of-generation token) on,
        the rest repeat the last one: the pick there cannot be that token, so nothing after it is
        kept."""
        masks = [self.allowed()]
        valid = self.matcher.validate_tokens(list(tokens)) if tokens else 0
        taken = 0
        for token in tokens[:valid]:
            if token in self.eos or not self.matcher.consume_token(token):
                break
            taken += 1
            masks.append(self.allowed())
        if taken:
            self.matcher.rollback(taken)
        masks += [masks[-1]] * (len(tokens) + 1 - len(masks))
        return masks

    @property
    def done(self) -> bool:
        """The grammar is complete: only end of generation may follow."""
        return self.matcher.is_stopped()


class Constrainer:
    """Token masks for one vocabulary. ``tokenizer`` is an ``llguidance.LLTokenizer`` (the
    engine builds it from its own vocabulary); ``n_vocab`` the logits row's length."""

    def __init__(self, tokenizer, n_vocab: int, eos: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.eos = tuple(eos)

    def for_lane(self, params: SamplingParams, generated: list[int] | tuple[int, ...] = ()) -> LaneConstraint | None:
        """A fresh constraint for a lane's sampling (None if it has none), moved past the tokens it
        already generated (a resumed lane)."""
        import llguidance

        if params.think_budget is not None:
            lane = self._budget_lane(params.think_budget)
            for token in generated:
                lane.accept(token)
            return lane
        text = grammar(params)
        if text is None:
            return None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            log.warning("cannot enforce a lane's constraint: %s", matcher.get_error())
        lane = LaneConstraint(matcher, self.n_vocab, self.eos)
        for token in generated:
            lane.accept(token)
        return lane

    def _budget_lane(self, budget):
        from .think_budget import ThinkBudgetLane

        return ThinkBudgetLane(budget, lambda text: list(self.tokenizer.tokenize_str(text)),
                               lambda token: bytes(self.tokenizer.decode_bytes([token])), self.n_vocab)
