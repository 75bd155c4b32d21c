"""Llama 3.1 / 3.2 / 3.3: a call is the JSON object ``{"name": ..., "parameters": {...}}``, the
whole reply (or after ``<|python_tag|>``).

Meta's templates render a call as nothing but that object and tell the model to answer with it,
so the object is read as a call where the reply begins with it; anywhere else only after
``<|python_tag|>``. Several objects one after another (``;`` or whitespace between them) are
parallel calls, as some fine-tunes write them, though Meta's templates allow one.

Llama 3.1's built-in tools are called as ``<|python_tag|>brave_search.call(query="...")``;
keyword arguments with JSON literal values (strings, numbers, ``true``/``false``/``null``) are
read, so a call to ``brave_search`` or ``wolfram_alpha`` comes back like any other."""

from __future__ import annotations

import json
import re

from superfluid.core.formats.family import ToolFormat, safe_content
from superfluid.core.formats.jsonscan import read_call_object, skip_ws, value_end
from superfluid.core.formats.reply import ParsedCall, arguments_json
from superfluid.plugins.formats.hermes import json_call

PYTHON_TAG = "<|python_tag|>"
_BUILTIN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\.call\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
#: Python's spelling of JSON's literals, as a model may write them in a built-in call
_PY_LITERALS = {"True": True, "False": False, "None": None}


class Llama3(ToolFormat):
    name = "llama3"
    description = '{"name": ..., "parameters": {...}} or <|python_tag|>tool.call(...) (Llama 3.1, 3.2, 3.3)'
    call_tail = "}"

    def detect(self, template: str) -> int:
        # Meta's header tokens and the "parameters" key its templates write a call with;
        # families built on Llama 3 with their own markers (Firefunction, Functionary) score higher
        if "<|start_header_id|>" in template and '"parameters": ' in template:
            return 8 + (2 if PYTHON_TAG in template else 0)
        return 0

    def call_lead(self, name: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def parse(self, text: str, partial: bool):
        head = skip_ws(text, 0)
        if text.startswith("{", head):
            return self._json_calls(text, head, "", partial)
        tag = text.find(PYTHON_TAG)
        if tag < 0:
            return safe_content(text, partial, PYTHON_TAG), []
        content, pos = text[:tag], skip_ws(text, tag + len(PYTHON_TAG))
        if pos >= len(text):
            return (safe_content(content, True), []) if partial else (content, None)
        if text[pos] == "{":
            return self._json_calls(text, pos, content, partial)
        return self._builtin(text, pos, content, partial)

    def _json_calls(self, text: str, pos: int, content: str, partial: bool):
        """Call objects from ``pos`` on, ``;`` or whitespace between them."""
        calls = []
        while True:
            call = read_call_object(text, pos)
            parsed = json_call(call, partial)
            if parsed is None:
                if partial and call is not None:
                    return safe_content(content, True), calls
                return content, None
            calls.append(parsed)
            if not call.complete:
                return safe_content(content, True), calls
            pos = skip_ws(text, call.end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
            if not text.startswith("{", pos):
                return safe_content(content, partial), calls  # what follows the calls is not read

    def _builtin(self, text: str, pos: int, content: str, partial: bool):
        """``name.call(key=value, ...)``: the call once its name is read, its arguments once the
        parenthesis closes."""
        match = _BUILTIN.match(text, pos)
        if match is None:
            if partial and re.fullmatch(r"[A-Za-z0-9_]*(\.(c(a(l(l)?)?)?)?)?", text[pos:]):
                return safe_content(content, True), []  # may still become name.call(
            return content, None
        name, pos, args = match.group(1), match.end(), {}
        while True:
            pos = skip_ws(text, pos)
            if text.startswith(")", pos):
                return safe_content(content, partial), [ParsedCall(name, arguments_json(args))]
            if args:
                if not text.startswith(",", pos):
                    break
                pos = skip_ws(text, pos + 1)
            keyword = _KEYWORD.match(text, pos)
            if keyword is None or keyword.end() >= len(text):
                break
            value, pos = self._literal(text, keyword.end())
            if pos is None:
                break
            args[keyword.group(1)] = value
        if partial:
            return safe_content(content, True), [ParsedCall(name, "")]
        return content, None

    @staticmethod
    def _literal(text: str, pos: int):
        """(value, index after it) of a JSON or Python literal at ``pos``; (None, None) if none
        is there (or it is cut off)."""
        end = value_end(text, pos)
        if end is not None:
            return json.loads(text[pos:end]), end
        word = re.match(r"True|False|None", text[pos:])
        if word:
            return _PY_LITERALS[word.group(0)], pos + word.end()
        return None, None


FORMATS = (Llama3(),)
