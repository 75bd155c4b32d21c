"""A request's JSON constraint (``SamplingParams.json_schema``) as a llama.cpp GBNF grammar.

Front ends describe constrained output engine-neutrally, as JSON Schemas between literal text
(:class:`~superfluid.core.request.JsonConstraint`); the GBNF syntax and llama.cpp's own
JSON-Schema-to-GBNF converter (llama-cpp-python's port of it) belong to this engine alone. The
conversion runs where the sampler is built (the worker), once per distinct constraint: a lane
that resumes, or many requests forcing the same call, reuse the grammar."""

from __future__ import annotations

import functools
import json
import logging

from superfluid.core.request import JsonConstraint, SamplingParams

log = logging.getLogger("superfluid.llamacpp")

_ANY_OBJECT = {"type": "object"}
# As llama.cpp's own: no raw control characters in a JSON string.
_JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


def grammar_text(params: SamplingParams) -> str | None:
    """The GBNF a request's sampling is held to: its own grammar, else its JSON constraint's
    (None, with a warning, if that cannot be built: the lane samples unconstrained rather than
    failing the tick for every lane)."""
    if params.grammar:
        return params.grammar
    if params.json_schema is None:
        return None
    try:
        return gbnf(params.json_schema)
    except Exception:  # noqa: BLE001 - a converter bug must not take the worker's tick down
        log.warning("cannot build a grammar for a request's JSON constraint", exc_info=True)
        return None


def _literal(text: str) -> str:
    return json.dumps(text)  # a GBNF literal escapes as a JSON string does (ASCII: \\uXXXX)


def _value_rule(converter, schema: dict, rule: str) -> str:
    """Add the rules for a JSON value ``schema`` accepts under the name ``rule`` and return the
    rule's name: any JSON object where the schema is beyond the converter."""
    rules = dict(converter._rules)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), rule)
        return converter.visit(resolved, rule)
    except Exception as exc:  # noqa: BLE001 - unsupported keywords, remote refs, bad patterns
        log.info("JSON schema not expressible as a grammar (%s); constraining to any JSON object", exc)
        converter._rules = rules
        return converter.visit(_ANY_OBJECT, rule)


def _sequence(*parts: str) -> str:
    return " ".join(p for p in parts if p)


@functools.lru_cache(maxsize=128)
def gbnf(constraint: JsonConstraint) -> str:
    """GBNF (root rule ``root``) for ``constraint``: ``( lead value | ... ) tail``."""
    from llama_cpp.llama_grammar import SchemaConverter  # this engine's dependency

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    alternatives = []
    for i, choice in enumerate(constraint.choices):
        value = _value_rule(converter, choice.schema, f"choice{i}")
        alternatives.append(_sequence(_literal(choice.lead) if choice.lead else "", value))
    body = alternatives[0] if len(alternatives) == 1 else "( " + " | ".join(alternatives) + " )"
    converter._rules["root"] = _sequence(body, _literal(constraint.tail) if constraint.tail else "")
    if "char" in converter._rules:
        converter._rules["char"] = _JSON_CHAR
    return converter.format_grammar()
