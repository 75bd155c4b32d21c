"""Property-based fuzzing of the pure parsers: whatever comes in, only the errors they document
come out. Request bodies (parsed into the routes' typed requests, plugins/http/typed.py, then
turned into core's terms by plugins/http/prepare/) may raise only a 4xx SuperfluidError naming a
field; TOML configuration only ConfigError; chat messages only a 400
from validation or rendering; the key-policy file only ConfigError.

Bounded (max_examples, no deadline) so the file runs in well under a minute on two cores."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from superfluid.core import qos as qos_classes  # noqa: E402
from superfluid.core.chat import render_chat  # noqa: E402
from superfluid.core.config import Schema, build_config, core_options, read_toml  # noqa: E402
from superfluid.core.errors import ConfigError, InvalidRequest, SuperfluidError  # noqa: E402
from superfluid.core.formats.template_messages import template_messages  # noqa: E402
from superfluid.core.plugins import make_plugin_manager  # noqa: E402
from superfluid.plugins.http.body import read_body  # noqa: E402
from superfluid.plugins.http.info.openapi_requests import REQUESTS  # noqa: E402
from superfluid.plugins.http.openai.chat_protocol import ChatCompletionRequest  # noqa: E402
from superfluid.plugins.http.openai.protocol import CompletionRequest, InfillRequest  # noqa: E402
from superfluid.plugins.http.prepare import params, tool_plan  # noqa: E402
from superfluid.plugins.http.prepare.preparer import limit_field, max_tokens  # noqa: E402
from superfluid.plugins.http.prepare.tool_render import render_prompt  # noqa: E402
from superfluid.plugins.http.typed import parse  # noqa: E402

# derandomized: the same examples on every run, so CI is stable (raise max_examples locally to dig)
SCALE = float(os.environ.get("SUPERFLUID_FUZZ_SCALE", "1"))  # e.g. 10 to dig deeper locally
FUZZ = settings(max_examples=int(200 * SCALE), deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
FEW = settings(max_examples=int(100 * SCALE), deadline=None, derandomize=True, database=None,
               suppress_health_check=list(HealthCheck))

# ---- JSON values as a client can send them (json.loads gives NaN, Infinity and huge ints too) --

_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10 ** 300, max_value=10 ** 400)
            | st.integers(max_value=-(10 ** 300), min_value=-(10 ** 400))
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)

ROLES = ["system", "developer", "user", "assistant", "tool"]
_text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | json_values,
                                    "text": st.text(max_size=20) | json_values})
_call = st.fixed_dictionaries({}, optional={
    "id": st.text(max_size=6) | json_values, "type": st.just("function") | json_values,
    "function": st.fixed_dictionaries({}, optional={"name": st.text(max_size=8) | json_values,
                                                    "arguments": st.text(max_size=20) | json_values})})
message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(ROLES) | json_values,
    "content": st.text(max_size=40) | st.lists(_text_part, max_size=3) | json_values,
    "name": st.text(max_size=8) | json_values,
    "tool_calls": st.lists(_call, max_size=2) | json_values,
    "tool_call_id": st.text(max_size=8) | json_values,
})
messages = st.lists(message, max_size=4) | json_values
_schema = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["object", "string", ["object", "null"]]) | json_values,
    "properties": st.dictionaries(st.text(max_size=6), st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer", "number", "boolean", "array", "object"])})
        | json_values, max_size=3) | json_values,
    "required": st.lists(st.text(max_size=6), max_size=3) | json_values})
tool = st.fixed_dictionaries({}, optional={
    "type": st.just("function") | json_values,
    "function": st.fixed_dictionaries({}, optional={
        "name": st.from_regex(r"[A-Za-z0-9_.\-]{1,10}", fullmatch=True) | json_values,
        "description": st.text(max_size=10) | json_values, "parameters": _schema | json_values})})
tool_choice = (st.sampled_from(["none", "auto", "required", "other"])
               | st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries({"name": st.text(max_size=8)})})
               | json_values)

# Values close to valid for the fields that have a shape, random JSON for all of them.
NEAR = {
    "messages": messages, "tools": st.lists(tool, max_size=3) | json_values, "tool_choice": tool_choice,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 70000), max_size=4)
    | st.lists(st.text(max_size=5), max_size=2) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=4), max_size=20) | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}) | json_values,
    "max_tokens": st.integers(-3, 5000) | json_values, "n_predict": st.integers(-3, 5000) | json_values,
}


KINDS = {"chat": ChatCompletionRequest, "completion": CompletionRequest, "infill": InfillRequest}


def _fields(cls) -> list[str]:
    """The JSON names of a typed request's fields."""
    return sorted(field.alias or name for name, field in cls.model_fields.items())


def _body(cls):
    value = st.tuples(st.text(max_size=8), json_values)  # unknown fields too
    if _fields(cls):
        value = st.sampled_from(_fields(cls)).flatmap(lambda k: st.tuples(st.just(k), NEAR.get(k, json_values))) | value
    return st.lists(value, max_size=8).map(dict) | json_values  # and bodies that are no object


def _validate(kind: str, body) -> None:
    """What prepare() does with a body before it needs a model (prompts tokenized as bytes)."""
    req = parse(KINDS[kind], body)
    n_prompt = 0
    if kind == "chat":
        tool_plan.plan(req, grammars=True)
        template_messages(req.conversation)
    elif kind == "completion" and req.suffix is not None:
        n_prompt = len(params.fim_prefix(req.prompt)) + len(req.suffix)
    elif kind == "completion":
        n_prompt = len(params.completion_prompt(req.prompt, lambda s: list(s.encode())))
    else:
        n_prompt = len(req.input_prefix) + len(req.input_suffix) + len(req.prompt)
    wanted, field = limit_field(req)
    max_tokens(wanted, field, kind != "completion", n_prompt, 2048)
    params.sampling(req)
    params.stop_strings(req)
    params.logit_bias(req, 70000)


def _client_error(exc: SuperfluidError, body) -> None:
    assert 400 <= exc.status < 500, f"{type(exc).__name__} with status {exc.status}: {exc.message}"
    if exc.param is not None and isinstance(body, dict) and exc.code != "missing_required_parameter":
        top = exc.param.split("[")[0].split(".")[0]  # a 400 names a field the body has
        if top == "max_tokens" and "n_predict" in body:
            return  # /infill's n_predict is checked as max_tokens (and named so)
        assert exc.param in body or top in body, f"param {exc.param!r} names no field of the body: {exc.message}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_request_bodies(kind):
    @FUZZ
    @given(body=_body(KINDS[kind]))
    def check(body):
        try:
            _validate(kind, body)
        except SuperfluidError as exc:
            _client_error(exc, body)

    check()


# Every route's typed request on its own: whatever comes in, a value or a 400 naming a field.
@pytest.mark.parametrize("cls", REQUESTS, ids=lambda cls: cls.__name__)
def test_typed_requests(cls):
    @FEW
    @given(body=_body(cls))
    def check(body):
        try:
            parse(cls, body)
        except SuperfluidError as exc:
            _client_error(exc, body)

    check()


@pytest.mark.parametrize("body", [{"temperature": 10 ** 400}, {"repeat_penalty": "x"}],
                         ids=["huge-integer-was-an-overflow-500", "repeat-penalty-error-named-r"])
def test_sampling_found(body):
    """Found by this fuzzer, fixed in params.py: a huge integer reached math.isfinite (an
    OverflowError, a 500), and repeat_penalty's errors named param 'r'. Each is a 400 naming its
    field now."""
    with pytest.raises(SuperfluidError) as info:
        parse(CompletionRequest, {"prompt": "x", **body})
    assert info.value.status == 400 and info.value.param == next(iter(body)), info.value.message


def test_read_body_long_integer():
    """Found by this fuzzer (Python's 4300-digit limit: a ValueError, a 500), fixed in read_body."""
    with pytest.raises(SuperfluidError):
        asyncio.run(read_body(_Raw(b'{"seed": ' + b"1" * 5000 + b"}")))


class _Raw:
    def __init__(self, raw: bytes):
        self.raw = raw

    async def read(self) -> bytes:
        return self.raw


_bodies = (st.binary(max_size=64) | st.text(max_size=64).map(str.encode)
           | json_values.map(lambda v: json.dumps(v).encode())
           | st.integers(1, 500).map(lambda n: b"[" * n + b"]" * n)
           | st.integers(1, 500).map(lambda n: b'{"a":' * n + b"1" + b"}" * n))


@FEW
@given(raw=_bodies)
def test_read_body(raw):
    """Any bytes: a value, or a 400 (not UTF-8, empty, not JSON, nested past what we parse)."""
    try:
        asyncio.run(read_body(_Raw(raw)))
    except SuperfluidError as exc:
        assert exc.status == 400, exc.message


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000],
                         ids=["arrays", "objects"])
def test_read_body_deep_nesting(raw):
    """Found by this fuzzer (a RecursionError, a 500), fixed in read_body."""
    with pytest.raises(SuperfluidError) as info:
        asyncio.run(read_body(_Raw(raw)))
    assert info.value.status == 400


# ---- chat messages: validation, then rendering through a real template ------------------------

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@FUZZ
@given(msgs=messages, tools=st.lists(tool, max_size=2) | st.none(), choice=tool_choice | st.none())
def test_chat_messages(msgs, tools, choice):
    body = {"messages": msgs, "tools": tools, "tool_choice": choice}
    try:
        req = parse(ChatCompletionRequest, body)
        plan = tool_plan.plan(req, grammars=True)
        checked = req.conversation
        render_prompt(CHATML, checked, plan, add_generation_prompt=True)
        render_chat(CHATML, template_messages(checked))
    except SuperfluidError as exc:
        _client_error(exc, body)


# ---- TOML configuration -----------------------------------------------------------------------

def _schema() -> Schema:
    schema = Schema()
    for opt in core_options():
        schema.add(opt)
    make_plugin_manager([], source="fuzz").hook.superfluid_add_config(schema=schema)
    return schema


SCHEMA = _schema()
_toml_scalars = (st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.floats() | st.text(max_size=12)
                 | st.sampled_from(["nan", "inf", "85%", "0.5", "10/s", "agent", "interactive=2", "-1", ""])
                 | st.datetimes() | st.dates() | st.times())
toml_values = st.recursive(_toml_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
_keys = st.sampled_from(sorted(SCHEMA.options)) | st.sampled_from(sorted(SCHEMA.options)).map(
    lambda k: k.replace("-", "_")) | st.text(max_size=10)
_model_table = st.dictionaries(st.sampled_from(["path", "name", "engine", "max-batch", "park", "threads"]) | _keys,
                               toml_values | st.text(max_size=10), max_size=5)
toml_tables = st.dictionaries(_keys | st.sampled_from(["plugins", "models"]), toml_values, max_size=6).flatmap(
    lambda d: st.lists(_model_table, max_size=3).map(lambda models: {**d, "models": models})
    | st.just(d))


@FUZZ
@given(toml=toml_tables)
def test_toml_config(toml):
    try:
        config = build_config(SCHEMA, toml, {}, source="fuzz.toml")
    except ConfigError:
        return
    for model in config.models:
        assert isinstance(model.name, str)
        for key in ("pressure-high", "pressure-low"):
            value = model.values[key]
            assert 0.0 <= value <= 1.0, f"{key} = {value!r} accepted"


_toml_text = (st.text(max_size=80)
              | st.lists(st.tuples(_keys, st.sampled_from(["1", "true", '"x"', "[1, 2]", "{a = 1}", "1979-05-27",
                                                           "nan", "inf", "'85%'", '"""a"""', "[[", "="])),
                         max_size=5).map(lambda kv: "\n".join(f'"{k}" = {v}' for k, v in kv))
              | st.integers(1, 200).map(lambda n: "a = " + "[" * n + "]" * n))


@FEW
@given(text=_toml_text)
def test_toml_file(text):
    """Any file: a table, or ConfigError naming the file; then build_config only ConfigError."""
    fd, path = tempfile.mkstemp(suffix=".toml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as fh:
            fh.write(text)
        try:
            build_config(SCHEMA, read_toml(path), {}, source=path)
        except ConfigError:
            pass
    finally:
        os.unlink(path)


def test_toml_deep_nesting(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000)
    with pytest.raises(ConfigError):
        read_toml(str(path))


@pytest.mark.parametrize("key", ["pressure-high", "pressure-low", "shutdown-timeout"])
def test_toml_nan_fraction(key):
    with pytest.raises(ConfigError):
        build_config(SCHEMA, {key: "nan"}, {}, source="fuzz.toml")


def test_toml_model_name_type():
    with pytest.raises(ConfigError):
        build_config(SCHEMA, {"models": [{"path": "x.gguf", "name": [1]}]}, {}, source="fuzz.toml")


# ---- the key-policy file (plugins/http/keys/policy.py, when present) --------------------------------

def _keys_module():
    try:
        from superfluid.plugins.http.keys import policy as keys
    except ImportError:
        return None
    return keys if hasattr(keys, "parse_policy") else None


_key_fields = st.sampled_from(["sha256", "class", "models", "batch-invariant", "admin", "requests-per-minute",
                               "tokens-per-minute", "max-tokens", "lanes", "other"])
_key_values = st.sampled_from(['"' + "a" * 64 + '"', '"' + "0" * 63 + '"', '"agent"', '"interactive"', '"nope"',
                               '["*"]', '["smollm2", "x*"]', "[1]", "true", "false", "0", "-1", "10", "1e3",
                               '"10"', "{}", "nan"])
_policy_text = (st.lists(st.tuples(st.text(max_size=6) | st.sampled_from(["a", "b", "k-1"]),
                                   st.lists(st.tuples(_key_fields, _key_values), max_size=6)), max_size=3).map(
    lambda keys: "\n".join(f'[keys."{name}"]\n' + "\n".join(f"{f} = {v}" for f, v in fields)
                           for name, fields in keys))
                | st.text(max_size=60))


@FEW
@given(text=_policy_text)
def test_key_policy(text):
    keys = _keys_module()
    if keys is None:
        pytest.skip("plugins/http/keys/policy.py (the key policy) is not there yet")
    try:
        keys.parse_policy(text, source="fuzz.toml")
    except ConfigError:
        pass


def test_qos_names_are_what_the_schema_lists():
    """The OpenAPI document's QoS enum is the resolver's vocabulary."""
    from superfluid.plugins.http.info.openapi import document
    enum = document()["paths"]["/v1/chat/completions"]["post"]["parameters"][0]["schema"]["enum"]
    assert sorted(enum) == sorted(qos_classes.ALIASES)
    for name in enum:
        qos_classes.resolve(name)


@pytest.mark.parametrize("key", ["name", "tool_call_id"])
def test_message_string_fields_are_type_checked(key):
    """Found by the API fuzzer: these were passed to the chat template unchecked."""
    with pytest.raises(InvalidRequest) as exc:
        parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi", key: [1]}]})
    assert exc.value.param == f"messages[0].{key}"

