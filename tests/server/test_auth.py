"""--key-policy against a real server: a real policy file, real clients (urllib and openai).

One test per rejection path (401 for a missing or unknown key, 403 for a model, route or grant
the key lacks, 404 for another key's session), the class ceiling and the x-superfluid-qos
response header, the max-tokens cap, SIGHUP reloads, /admin without a policy, and the open door
(a non-loopback --host without a policy exits before loading the model)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from superfluid.plugins.http.keys.policy import hash_secret

SECRETS = {"user": "sk-user-secret", "top": "sk-top-secret", "admin": "sk-admin-secret",
           "limited": "sk-limited-secret"}
POLICY = f"""# the test policy
[keys.user]
sha256 = "{hash_secret(SECRETS['user'])}"
class = "agent"
models = ["smollm2"]
max-tokens = 8

[keys.top]
sha256 = "{hash_secret(SECRETS['top'])}"
class = "interactive"

[keys.admin]
sha256 = "{hash_secret(SECRETS['admin'])}"
admin = true
batch-invariant = true

[keys.limited]
sha256 = "{hash_secret(SECRETS['limited'])}"
models = ["some-other-model"]
requests-per-minute = 60
lanes = 1
"""
ASK = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(POLICY)
    return path


@pytest.fixture(scope="module")
def keyed(start_server, policy_file):
    return start_server("--key-policy", str(policy_file), "--max-batch", "4")


def call(srv, method: str, path: str, body: dict | None = None, *, key: str | None = None,
         headers: dict | None = None, bearer: bool = True) -> tuple[int, dict, dict]:
    """(status, response headers, JSON body); ``key`` a name in SECRETS (or a raw secret)."""
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        secret = SECRETS.get(key, key)
        hdrs.update({"Authorization": f"Bearer {secret}"} if bearer else {"x-api-key": secret})
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(srv.base + path, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read()
            return r.status, {k.lower(): v for k, v in r.headers.items()}, _json(raw)
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, _json(exc.read())


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return {"raw": raw.decode(errors="replace")}


def chat(srv, key=None, headers=None, **extra):
    return call(srv, "POST", "/v1/chat/completions", {"model": "smollm2", "messages": ASK, "max_tokens": 2, **extra},
                key=key, headers=headers)


def error(body: dict) -> dict:
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
    return body["error"]


# ---- 401 ---------------------------------------------------------------------------------------

def test_missing_key_is_401(keyed):
    status, headers, body = chat(keyed)
    assert status == 401 and error(body)["code"] == "invalid_api_key"
    assert "Authorization" in error(body)["message"] and headers.get("www-authenticate") == "Bearer"
    assert headers["x-superfluid-qos"]  # even a refusal names a class


def test_unknown_key_is_401_and_the_secret_is_not_logged(keyed):
    status, _, body = chat(keyed, key="sk-guessed-wrong")
    assert status == 401 and error(body)["code"] == "invalid_api_key"
    assert "sk-guessed-wrong" not in error(body)["message"]
    time.sleep(0.2)
    assert "sk-guessed-wrong" not in keyed.log() and "unknown API key" in keyed.log()
    # /health stays open to probes
    assert call(keyed, "GET", "/health")[0] == 200


def test_open_probes_lets_gateways_scrape_without_a_key(keyed, start_server, policy_file):
    assert call(keyed, "GET", "/metrics")[0] == 401  # closed by default
    srv = start_server("--key-policy", str(policy_file), "--http-open-probes")
    assert call(srv, "GET", "/metrics")[0] == 200
    status, _, models = call(srv, "GET", "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "smollm2"
    assert call(srv, "GET", "/slots")[0] == 401 and chat(srv)[0] == 401  # only those two
    srv.stop()


def test_x_api_key_header_works(keyed):
    status, _, body = call(keyed, "POST", "/v1/chat/completions",
                           {"model": "smollm2", "messages": ASK, "max_tokens": 2}, key="user", bearer=False)
    assert status == 200, body


# ---- 403 ---------------------------------------------------------------------------------------

def test_model_the_key_lacks_is_403(keyed):
    status, _, body = chat(keyed, key="limited")
    assert status == 403 and error(body)["code"] == "model_not_allowed" and error(body)["param"] == "model"
    assert "limited" in error(body)["message"] and "smollm2" in error(body)["message"]
    status, _, body = call(keyed, "POST", "/v1/sessions", {"model": "smollm2"}, key="limited")
    assert status == 403 and error(body)["code"] == "model_not_allowed"


def test_admin_route_needs_an_admin_key(keyed):
    status, _, body = call(keyed, "GET", "/admin/models", key="top")
    assert status == 403 and error(body)["code"] == "admin_required" and error(body)["type"] == "permission_error"
    status, _, body = call(keyed, "POST", "/admin/models/smollm2/unload", {"drain_timeout_s": 0}, key="user")
    assert status == 403
    assert call(keyed, "GET", "/admin/models")[0] == 401
    status, _, body = call(keyed, "GET", "/admin/models", key="admin")
    assert status == 200 and body["models"]["smollm2"] == "ready"


def test_batch_invariant_needs_the_grant(keyed):
    status, _, body = chat(keyed, key="top", headers={"x-superfluid-batch-invariant": "true"})
    assert status == 403 and error(body)["code"] == "batch_invariant_not_allowed"
    assert "'top'" in error(body)["message"]
    # the grant decides, not --http-allow-batch-invariant (off on this server)
    status, _, body = chat(keyed, key="admin", headers={"x-superfluid-batch-invariant": "true"})
    assert status == 200, body


# ---- sessions ----------------------------------------------------------------------------------

def test_a_session_belongs_to_the_key_that_opened_it(keyed):
    status, _, made = call(keyed, "POST", "/v1/sessions", {"model": "smollm2"}, key="user")
    assert status == 201 and made["owner"] == "user"
    sid = made["id"]
    for method, path, body in (("GET", f"/v1/sessions/{sid}", None),
                               ("POST", f"/v1/sessions/{sid}/turns", {"messages": ASK, "max_tokens": 2}),
                               ("POST", f"/v1/sessions/{sid}/qos", {"qos": "background"}),
                               ("DELETE", f"/v1/sessions/{sid}", None)):
        status, _, err = call(keyed, method, path, body, key="top")
        assert status == 404 and error(err)["code"] == "session_not_found", (method, path, err)
    ids = lambda key: {s["id"] for s in call(keyed, "GET", "/v1/sessions", key=key)[2]["data"]}  # noqa: E731
    assert sid in ids("user") and sid not in ids("top") and sid in ids("admin")
    assert call(keyed, "GET", f"/v1/sessions/{sid}", key="admin")[0] == 200  # admin keys see every session
    status, _, turn = call(keyed, "POST", f"/v1/sessions/{sid}/turns", {"messages": ASK, "max_tokens": 2}, key="user")
    assert status == 200, turn
    assert call(keyed, "DELETE", f"/v1/sessions/{sid}", key="user")[0] == 200


def test_session_class_is_capped_too(keyed):
    status, headers, made = call(keyed, "POST", "/v1/sessions", {"model": "smollm2", "qos": "interactive"}, key="user")
    assert status == 201 and made["qos"] == "agent" and headers["x-superfluid-qos"] == "agent"
    status, headers, view = call(keyed, "POST", f"/v1/sessions/{made['id']}/qos", {"qos": "interactive"}, key="user")
    assert status == 200 and view["qos"] == "agent"
    call(keyed, "DELETE", f"/v1/sessions/{made['id']}", key="user")


# ---- classes -----------------------------------------------------------------------------------

def test_the_header_may_lower_a_class_never_raise_it(keyed):
    status, headers, body = chat(keyed, key="user", headers={"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "agent", body
    status, headers, _ = chat(keyed, key="user", headers={"x-superfluid-qos": "background"})
    assert status == 200 and headers["x-superfluid-qos"] == "background"
    status, headers, _ = chat(keyed, key="top")  # no header: the key's class
    assert status == 200 and headers["x-superfluid-qos"] == "interactive"
    status, headers, _ = chat(keyed, key="top", headers={"x-superfluid-qos": "agent"})
    assert headers["x-superfluid-qos"] == "agent"


def test_the_body_field_asks_for_a_class_as_the_header_does(keyed):
    """``superfluid: {"qos": …}`` (what a gateway that drops unknown headers still carries):
    capped at the key's class like the header, and it wins over the header."""
    status, headers, body = chat(keyed, key="user", superfluid={"qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "agent", body
    status, headers, _ = chat(keyed, key="top", superfluid={"qos": "background"})
    assert status == 200 and headers["x-superfluid-qos"] == "background"
    status, headers, _ = chat(keyed, key="top", headers={"x-superfluid-qos": "agent"}, superfluid={"qos": "completion"})
    assert status == 200 and headers["x-superfluid-qos"] == "completion"
    for bad, code in (({"qos": "urgent"}, "invalid_qos_class"), ({"qos": 3}, "invalid_type"),
                      ("interactive", "invalid_type"), ({"class": "agent"}, "unknown_parameter")):
        status, _, err = chat(keyed, key="top", superfluid=bad)
        assert status == 400 and error(err)["code"] == code, (bad, err)
    # the body's class wins, but an unknown class in the header is still the client's mistake
    # (found by test_fuzz_api: an embeddings request with x-superfluid-qos "Qa" was a 200)
    status, _, err = chat(keyed, key="top", headers={"x-superfluid-qos": "Qa"}, superfluid={"qos": "agent"})
    assert status == 400 and error(err)["code"] == "invalid_qos_class", err


def test_a_streamed_reply_names_its_class(keyed):
    data = json.dumps({"model": "smollm2", "messages": ASK, "max_tokens": 2, "stream": True}).encode()
    req = urllib.request.Request(keyed.base + "/v1/chat/completions", data=data, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {SECRETS['user']}",
        "x-superfluid-qos": "interactive"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["x-superfluid-qos"] == "agent"
        assert b"[DONE]" in r.read()


def test_qos_header_without_a_policy(server):
    status, headers, _ = chat(server)
    assert status == 200 and headers["x-superfluid-qos"] == "agent"  # --http-default-qos
    status, headers, _ = chat(server, headers={"x-superfluid-qos": "interactive"})
    assert status == 200 and headers["x-superfluid-qos"] == "interactive"
    assert call(server, "GET", "/health")[1]["x-superfluid-qos"] == "agent"
    assert call(server, "GET", "/v1/models")[1]["x-superfluid-qos"] == "agent"


def test_admin_without_a_policy_answers_loopback(server):
    status, _, body = call(server, "GET", "/admin/models")
    assert status == 200 and "smollm2" in body["models"]


# ---- max-tokens --------------------------------------------------------------------------------

def test_max_tokens_cap(keyed):
    """Asking for more than the key's max-tokens is a 400 naming the field; no ask is clamped."""
    status, _, body = chat(keyed, key="user", max_tokens=9)
    assert status == 400 and error(body)["param"] == "max_tokens" and error(body)["code"] == "max_tokens_exceeded"
    assert "8" in error(body)["message"]
    status, _, body = chat(keyed, key="user", max_tokens=None, max_completion_tokens=50)
    assert status == 400 and error(body)["param"] == "max_completion_tokens"
    status, _, body = chat(keyed, key="user", max_tokens=None, ignore_eos=True)
    assert status == 200 and body["usage"]["completion_tokens"] == 8, body
    status, _, body = chat(keyed, key="top", max_tokens=9, ignore_eos=True)  # no cap on this key
    assert status == 200 and body["usage"]["completion_tokens"] == 9


# ---- the openai client -------------------------------------------------------------------------

def test_openai_client_with_api_key(keyed):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=keyed.base + "/v1", api_key=SECRETS["top"], timeout=120, max_retries=0)
    reply = good.chat.completions.with_raw_response.create(model="smollm2", messages=ASK, max_tokens=2)
    assert reply.headers["x-superfluid-qos"] == "interactive" and reply.parse().choices
    bad = openai.OpenAI(base_url=keyed.base + "/v1", api_key="sk-nope", timeout=120, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    limited = openai.OpenAI(base_url=keyed.base + "/v1", api_key=SECRETS["limited"], timeout=120, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        limited.chat.completions.create(model="smollm2", messages=ASK, max_tokens=2)


# ---- SIGHUP (last: it rewrites the policy file) ------------------------------------------------

def _until(check, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_sighup_reload_picks_up_a_new_key_and_keeps_the_old_policy_on_a_bad_file(keyed, policy_file):
    new = "sk-new-secret"
    assert chat(keyed, key=new)[0] == 401
    with cf.ThreadPoolExecutor(1) as pool:  # a request in flight across the reload is not dropped
        running = pool.submit(chat, keyed, key="top", max_tokens=48, ignore_eos=True, stream=False)
        time.sleep(0.3)
        policy_file.write_text(POLICY + f'\n[keys.new]\nsha256 = "{hash_secret(new)}"\nclass = "background"\n')
        os.kill(keyed.proc.pid, signal.SIGHUP)
        assert _until(lambda: chat(keyed, key=new)[0] == 200), keyed.log()
        status, _, body = running.result(timeout=120)
        assert status == 200 and body["usage"]["completion_tokens"] == 48, body
    assert chat(keyed, key=new)[1]["x-superfluid-qos"] == "background"
    # a bad file: the old policy (with "new") stays, and the log names the key and the line
    lanes_line = POLICY.count("\n") + 4  # a blank line, the header, sha256, then lanes
    policy_file.write_text(POLICY + f'\n[keys.broken]\nsha256 = "{hash_secret("x")}"\nlanes = -1\n')
    os.kill(keyed.proc.pid, signal.SIGHUP)
    assert _until(lambda: "not reloaded" in keyed.log()), keyed.log()
    assert f"keys.toml:{lanes_line}: key 'broken'" in keyed.log()
    assert chat(keyed, key=new)[0] == 200 and chat(keyed, key="user")[0] == 200
    assert keyed.proc.poll() is None
    policy_file.write_text(POLICY)


# ---- the open door -----------------------------------------------------------------------------

def test_exposed_host_without_a_policy_exits_before_loading(model_path):
    cmd = [sys.executable, "-m", "superfluid.core.cli", "serve", "--host", "0.0.0.0", "--port", "0",
           "--model", model_path]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--key-policy" in done.stderr and "--insecure" in done.stderr
    assert "serving" not in done.stdout and "loading" not in (done.stdout + done.stderr).lower()
    assert time.monotonic() - started < 30
