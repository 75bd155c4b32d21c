"""plugins/http/keys/policy.py and the decisions in keys/auth.py: the policy file's parser (errors name the
key and the line), hashing, lookup by secret, the class ceiling, `superfluid keys new`, and the
open-door refusal. No server, no model."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys

import pytest

from superfluid.core.cli import main as cli_main
from superfluid.core.errors import ConfigError
from superfluid.plugins.http.keys import policy as keys_mod
from superfluid.plugins.http.keys.auth import KEY, is_loopback_host, open_door
from superfluid.plugins.http.keys.policy import Key, PolicyFile, hash_secret, load_policy, new_key, parse_policy
from superfluid.plugins.http.keys.rate_limit import RateLimited
from superfluid.plugins.http.prepare.fim import FimPolicy

H1, H2 = hash_secret("one"), hash_secret("two")
GOOD = f"""# two keys
[keys.chat-ui]
sha256 = "{H1}"
class = "interactive"
models = ["smollm2", "qwen-*"]
batch-invariant = true
requests-per-minute = 600
tokens-per-minute = 200000
max-tokens = 4096
lanes = 4

[keys.ops]
sha256 = "{H2.upper()}"
admin = true
"""


def test_good_file_parses_every_field():
    policy = parse_policy(GOOD, "p.toml")
    chat, ops = policy.keys["chat-ui"], policy.keys["ops"]
    assert (chat.qos, chat.models, chat.batch_invariant, chat.admin) == ("interactive", ("smollm2", "qwen-*"), True, False)
    assert (chat.requests_per_minute, chat.tokens_per_minute, chat.max_tokens, chat.lanes) == (600, 200000, 4096, 4)
    assert chat.line == 2 and ops.line == 12
    # defaults: the default class, every model, no grants, unlimited
    assert (ops.qos, ops.models, ops.batch_invariant, ops.admin) == ("agent", ("*",), False, True)
    assert (ops.requests_per_minute, ops.tokens_per_minute, ops.max_tokens, ops.lanes) == (0, 0, 0, 0)
    assert ops.sha256 == H2  # stored lower-case


def test_hash_is_sha256_hex():
    assert hash_secret("s3cret") == hashlib.sha256(b"s3cret").hexdigest()


def test_identify_by_secret():
    policy = parse_policy(GOOD)
    assert policy.identify("one").name == "chat-ui"
    assert policy.identify("two").name == "ops"
    assert policy.identify("three") is None and policy.identify("") is None


def test_identify_compares_every_key_in_constant_time(monkeypatch):
    """hmac.compare_digest over the hashes, for every key, even after a match."""
    calls = []
    real = keys_mod.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys_mod.hmac, "compare_digest", spy)
    policy = parse_policy(GOOD)
    assert policy.identify("one").name == "chat-ui"
    assert len(calls) == 2 and all(a == H1 for a, _ in calls)  # the secret itself is never compared
    calls.clear()
    assert policy.identify("nope") is None and len(calls) == 2


def test_class_ceiling():
    key = Key(name="k", sha256=H1, qos="agent")
    assert key.cap(None) == "agent"                # no header: the key's class
    assert key.cap("interactive") == "agent"       # raising is capped
    assert key.cap("completion") == "agent"
    assert key.cap("background") == "background"   # lowering is allowed
    top = Key(name="t", sha256=H1, qos="interactive")
    assert top.cap("background") == "background" and top.cap(None) == "interactive"


def test_model_patterns():
    key = parse_policy(GOOD).keys["chat-ui"]
    assert key.allows_model("smollm2") and key.allows_model("qwen-4b")
    assert not key.allows_model("llama") and not key.allows_model("smollm2-big")
    assert parse_policy(GOOD).keys["ops"].allows_model("anything")


@pytest.mark.parametrize("table, line, words", [
    ('class = "urgent"', 3, ["unknown QoS class", "'urgent'"]),
    ('sha256 = "abc"', 2, ["sha256 must be 64 hex digits"]),
    ('requests-per-minute = -1', 3, ["requests-per-minute", "non-negative integer"]),
    ('tokens-per-minute = 1.5', 3, ["tokens-per-minute", "non-negative integer"]),
    ('lanes = true', 3, ["lanes", "non-negative integer"]),
    ('max-tokens = "4096"', 3, ["max-tokens", "non-negative integer"]),
    ('admin = "yes"', 3, ["admin must be true or false"]),
    ('batch-invariant = 1', 3, ["batch-invariant must be true or false"]),
    ('models = "smollm2"', 3, ["models must be a non-empty list"]),
    ('models = []', 3, ["models must be a non-empty list"]),
    ('clas = "agent"', 3, ["unknown field 'clas'", "did you mean 'class'"]),
])
def test_bad_field_names_key_and_line(table, line, words):
    text = f'[keys.ok]\nsha256 = "{H2}"\n\n[keys.broken]\nsha256 = "{H1}"\n{table}\n'
    if table.startswith("sha256"):
        text = f'[keys.ok]\nsha256 = "{H2}"\n\n[keys.broken]\n{table}\n'
    with pytest.raises(ConfigError) as exc:
        parse_policy(text, "p.toml")
    message = str(exc.value)
    assert f"p.toml:{line + 3}:" in message and "'broken'" in message, message
    for word in words:
        assert word in message, message


def test_missing_sha256_names_the_header_line():
    with pytest.raises(ConfigError, match=r"p\.toml:3: key 'nohash': sha256 is required"):
        parse_policy('\n\n[keys.nohash]\nclass = "agent"\n', "p.toml")


def test_quoted_names_and_duplicate_secrets():
    text = f'[keys."my key"]\nsha256 = "{H1}"\n[keys.twin]\nsha256 = "{H1}"\n'
    with pytest.raises(ConfigError, match=r"p\.toml:4: key 'twin': has the same secret as key 'my key'"):
        parse_policy(text, "p.toml")


def test_not_toml_and_strange_layout():
    with pytest.raises(ConfigError, match=r"p\.toml: not valid TOML.*line 2"):
        parse_policy('[keys.a]\nsha256 = \n', "p.toml")
    with pytest.raises(ConfigError, match="unknown top-level key 'key'"):
        parse_policy(f'[key.a]\nsha256 = "{H1}"\n', "p.toml")
    with pytest.raises(ConfigError, match="key 'a': must be a table"):
        parse_policy('keys.a = 3\n', "p.toml")
    assert parse_policy("", "p.toml").keys == {}  # no keys: every request is refused


def test_load_missing_file():
    with pytest.raises(ConfigError, match="--key-policy: file not found"):
        load_policy("/nonexistent/keys.toml")


def test_reload_keeps_the_old_policy_on_a_bad_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(f'[keys.a]\nsha256 = "{H1}"\n')
    pf = PolicyFile(str(path))
    old = pf.current
    path.write_text(f'[keys.a]\nsha256 = "{H1}"\n[keys.b]\nsha256 = "{H2}"\nlanes = -2\n')
    assert pf.reload() is False and pf.current is old
    path.write_text(f'[keys.a]\nsha256 = "{H1}"\n[keys.b]\nsha256 = "{H2}"\n')
    assert pf.reload() is True and set(pf.current.keys) == {"a", "b"}


def test_new_key_writes_only_the_hash(tmp_path):
    path = str(tmp_path / "keys.toml")
    secret = new_key(path, "chat-ui", "interactive-chat")
    text = open(path).read()
    assert secret not in text and hash_secret(secret) in text
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    second = new_key(path, "batch", "background")
    policy = load_policy(path)
    assert policy.identify(secret).qos == "interactive" and policy.identify(second).name == "batch"
    with pytest.raises(ConfigError, match="already exists"):
        new_key(path, "batch")
    with pytest.raises(ConfigError, match="--class"):
        new_key(path, "other", "urgent")
    with pytest.raises(ConfigError, match="key name"):
        new_key(path, "has space")


def test_new_key_keeps_comments(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(f"# hand-written\n[keys.a]\nsha256 = \"{H1}\"  # alice\n")
    new_key(str(path), "b")
    text = path.read_text()
    assert text.startswith("# hand-written\n") and "# alice" in text and "[keys.b]" in text


def test_keys_new_command(tmp_path, capsys):
    path = str(tmp_path / "k.toml")
    assert cli_main(["keys", "new", "ci", "--class", "background", "--file", path]) == 0
    out, err = capsys.readouterr()
    secret = out.strip()
    assert secret.startswith("sk-sf-") and "\n" not in secret and secret not in err
    key = load_policy(path).identify(secret)
    assert key.name == "ci" and key.qos == "background"
    assert cli_main(["keys", "new", "ci", "--file", path]) == 2
    assert "already exists" in capsys.readouterr().err


def test_loopback_hosts():
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "", "192.168.1.5", "example.com"):
        assert not is_loopback_host(host), host


def test_open_door_decision():
    assert open_door("127.0.0.1", None, False) is None
    assert open_door("0.0.0.0", "keys.toml", False) is None
    assert open_door("0.0.0.0", None, True) is None  # --insecure
    refusal = open_door("0.0.0.0", None, False)
    assert "--key-policy" in refusal and "--insecure" in refusal


def test_serve_exposed_without_policy_exits_before_loading(tmp_path):
    """A model path that does not exist proves nothing was loaded: the refusal comes first."""
    cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--host", "0.0.0.0",
           "--model", str(tmp_path / "missing.gguf")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--key-policy" in done.stderr and "--insecure" in done.stderr and "missing.gguf" not in done.stderr


def test_serve_with_bad_policy_names_key_and_line(tmp_path):
    policy = tmp_path / "keys.toml"
    policy.write_text(f'[keys.a]\nsha256 = "{H1}"\nlanes = -1\n')
    cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--key-policy", str(policy),
           "--model", str(tmp_path / "missing.gguf")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{policy}:3: key 'a'" in done.stderr, done.stderr


def _admin_request(remote: str, path: str = "/admin/models"):
    """A mocked aiohttp request from ``remote`` (the middleware reads only the path, the
    matched route and the peer)."""
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (remote, 40000) if name == "peername" else default
    return make_mocked_request("GET", path, transport=transport)


@pytest.mark.parametrize("remote, allowed", [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
                                             ("10.0.0.5", False), ("192.168.1.9", False)])
def test_admin_without_policy_answers_loopback_only(remote, allowed):
    import asyncio

    from superfluid.plugins.http.keys.auth import Forbidden, middleware

    async def handler(request):
        return "handled"

    async def go(path):
        return await middleware(None, {})(_admin_request(remote, path), handler)

    if allowed:
        assert asyncio.run(go("/admin/models")) == "handled"
    else:
        with pytest.raises(Forbidden) as exc:
            asyncio.run(go("/admin/models"))
        assert exc.value.code == "admin_loopback_only" and "--key-policy" in exc.value.message
    assert asyncio.run(go("/v1/models")) == "handled"  # only /admin is held to loopback


class _Request(dict):
    """What FimPolicy.admit reads of an aiohttp request: headers, the peer, and the key the auth
    middleware stored on it."""

    def __init__(self, authorization: str, key=None):
        super().__init__()
        self.headers = {"Authorization": authorization}
        self.remote = "127.0.0.1"
        if key is not None:
            self[KEY] = key


def test_fim_buckets_are_per_key_not_per_secret_under_a_policy():
    fim = FimPolicy({"completion-rate": "1/h", "completion-burst": 1, "completion-deadline-ms": 0})
    key = Key(name="editor", sha256=H1, qos="completion")
    fim.admit(_Request("Bearer one-secret", key))
    with pytest.raises(RateLimited):  # the same key under another header: the same bucket
        fim.admit(_Request("Bearer x-api-key-variant", key))
    fim.admit(_Request("Bearer someone-else"))  # no policy: clients by what they send
