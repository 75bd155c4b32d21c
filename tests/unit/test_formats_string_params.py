"""Formats that write values raw (XML parameters) read a value that looks like a number as the
string the tool's schema declares, once the request's tools are known: a zip code stays "75001"
whole and streamed; without the schema (``superfluid template parse``) it reads as JSON."""

from __future__ import annotations

import json

import pytest

from superfluid.core.formats.reader import ReplyReader
from superfluid.core.formats.stream import StreamReader
from superfluid.plugins.formats import builtin_registry
from superfluid.plugins.http.prepare.reply_read import string_parameters

REG = builtin_registry()
ZIP = {"type": "function", "function": {"name": "zip", "parameters": {"type": "object", "properties": {
    "code": {"type": "string"}, "n": {"type": "integer"}}}}}
CALLS = {
    "qwen3-coder": "<tool_call>\n<function=zip>\n<parameter=code>\n75001\n</parameter>\n<parameter=n>\n3\n"
                   "</parameter>\n</function>\n</tool_call>",
    "glm-4.5": "<tool_call>zip\n<arg_key>code</arg_key>\n<arg_value>75001</arg_value>\n<arg_key>n</arg_key>\n"
               "<arg_value>3</arg_value>\n</tool_call>",
    "minimax-m2": '<minimax:tool_call>\n<invoke name="zip">\n<parameter name="code">75001</parameter>\n'
                  '<parameter name="n">3</parameter>\n</invoke>\n</minimax:tool_call>',
    "seed-oss": "<seed:tool_call>\n<function=zip>\n<parameter=code>75001</parameter>\n<parameter=n>3</parameter>\n"
                "</function>\n</seed:tool_call>",
}


@pytest.mark.parametrize("name", CALLS)
def test_a_string_parameter_that_looks_like_a_number_stays_a_string(name):
    fmt = REG.tool_format(name)
    assert string_parameters([ZIP]) == {"zip": frozenset({"code"})}
    typed = ReplyReader(fmt.knowing_strings(string_parameters([ZIP])), None, tools=frozenset({"zip"}))
    (call,) = typed.read(CALLS[name]).calls
    assert json.loads(call.arguments) == {"code": "75001", "n": 3}
    stream = StreamReader(typed)
    pieces = [stream.feed(ch) for ch in CALLS[name]] + [stream.finish()[0]]
    args = "".join(c.arguments for p in pieces for c in p.calls)
    assert json.loads(args) == {"code": "75001", "n": 3}
    (untyped,) = ReplyReader(fmt, None).read(CALLS[name]).calls  # no schema: JSON where it reads as JSON
    assert json.loads(untyped.arguments)["code"] == 75001


def test_json_formats_are_not_copied():
    hermes = REG.tool_format("hermes")
    assert hermes.knowing_strings({"zip": frozenset({"code"})}) is hermes
