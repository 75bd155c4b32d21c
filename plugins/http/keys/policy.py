"""The key policy (``--key-policy FILE.toml``): which API keys exist and what each may do.

One ``[keys.NAME]`` table per key. The file holds only the SHA-256 of each secret, so a leaked
policy file leaks no secret; a request's secret is hashed and compared with every key's hash in
constant time (``hmac.compare_digest``, no early exit), so response timing tells an attacker
nothing about how close a guess was. A key carries its QoS *ceiling* (the most urgent class it
may use, also its default), the models it may call, its grants (batch-invariant lanes, admin)
and the per-key limits another module enforces. The grants: ``batch-invariant``,
``admin`` (the /admin routes, and watching) and ``dashboard`` (GET /events and /dashboard only).
Errors name the file, the line and the key: tomllib gives no line per table, so the
``[keys.NAME]`` header (or the field) is found in the text."""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import hmac
import logging
import os
import re
import secrets
import sys

import attrs

from superfluid.core import qos as qos_classes
from superfluid.core.errors import ConfigError, SuperfluidError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("superfluid.http")

LIMIT_FIELDS = ("requests-per-minute", "tokens-per-minute", "max-tokens", "lanes")
FIELDS = ("sha256", "class", "models", "batch-invariant", "admin", "dashboard", *LIMIT_FIELDS)
NEW_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # names `keys new` writes as bare TOML keys
SECRET_PREFIX = "sk-sf-"


def hash_secret(secret: str) -> str:
    """The hex SHA-256 a policy file stores for ``secret``."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@attrs.define(frozen=True)
class Key:
    """One API key: what it may do. ``qos`` is both its ceiling and its default class; the
    limits are 0 for unlimited."""

    name: str
    sha256: str = attrs.field(repr=False)
    qos: str = qos_classes.DEFAULT_CLASS
    models: tuple[str, ...] = ("*",)
    batch_invariant: bool = False
    admin: bool = False
    dashboard: bool = False  # may watch the server: GET /events and /dashboard (admin may too)
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    max_tokens: int = 0
    lanes: int = 0
    line: int = 0  # where its table starts in the file (for messages)

    def allows_model(self, model: str) -> bool:
        """Whether this key may call ``model`` (its patterns are shell-style: ``*``, ``qwen-*``)."""
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    def cap(self, cls: str | None) -> str:
        """The class a request asking for ``cls`` gets: a header may lower the key's class,
        never raise it (None: the key's own class)."""
        if cls is None or qos_classes.priority(cls) < qos_classes.priority(self.qos):
            return self.qos
        return cls


@attrs.define(frozen=True)
class KeyPolicy:
    """The keys of one policy file, as read at startup or at the last good reload."""

    path: str
    keys: dict[str, Key]

    def identify(self, secret: str) -> Key | None:
        """The key whose hash matches ``secret``'s, or None. Every key is compared (no early
        exit) so the time taken does not depend on which key, if any, matched."""
        digest = hash_secret(secret)
        found = None
        for key in self.keys.values():
            if hmac.compare_digest(digest, key.sha256):
                found = key
        return found


# ---- parsing ---------------------------------------------------------------------------------

def _header_line(lines: list[str], name: str) -> int:
    """The 1-based line of ``[keys.NAME]`` (bare or quoted), or 0 if it cannot be found (an
    inline table, say)."""
    quoted = re.escape(name)
    pattern = re.compile(r"^\s*\[\s*keys\s*\.\s*(?:" + quoted + r"|\"" + quoted + r"\"|'" + quoted + r"')\s*\]")
    for i, text in enumerate(lines, 1):
        if pattern.match(text):
            return i
    return 0


def _field_line(lines: list[str], start: int, field: str) -> int:
    """The line of ``field = …`` in the table starting at ``start`` (else ``start``)."""
    if not start:
        return 0
    pattern = re.compile(r"^\s*[\"']?" + re.escape(field) + r"[\"']?\s*=")
    for i in range(start, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        if pattern.match(lines[i]):
            return i + 1
    return start


class _Table:
    """One key's table being validated; its errors name the file, line and key."""

    def __init__(self, source: str, lines: list[str], name: str, table: dict):
        self.source, self.lines, self.name = source, lines, name
        self.line = _header_line(lines, name)
        self.values = {}
        for raw, value in table.items():
            field = raw.replace("_", "-")
            if field not in FIELDS:
                close = difflib.get_close_matches(field, FIELDS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else f"; known fields: {', '.join(FIELDS)}"
                self.fail(raw, f"unknown field {raw!r}{hint}")
            self.values[field] = (raw, value)

    def fail(self, field: str | None, problem: str):
        line = _field_line(self.lines, self.line, field) if field else self.line
        where = f"{self.source}:{line}" if line else self.source
        raise ConfigError(f"{where}: key {self.name!r}: {problem}")

    def get(self, field: str, default):
        return self.values.get(field, (field, default))

    def boolean(self, field: str) -> bool:
        raw, value = self.get(field, False)
        if not isinstance(value, bool):
            self.fail(raw, f"{field} must be true or false, got {value!r}")
        return value

    def count(self, field: str) -> int:
        raw, value = self.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.fail(raw, f"{field} must be a non-negative integer (0: unlimited), got {value!r}")
        return value

    def key(self) -> Key:
        raw, digest = self.get("sha256", None)
        if digest is None:
            self.fail(None, "sha256 is required (the hex SHA-256 of the secret; `superfluid keys new` writes it)")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
            self.fail(raw, f"sha256 must be 64 hex digits (the SHA-256 of the secret), got {digest!r}")
        raw, cls = self.get("class", qos_classes.DEFAULT_CLASS)
        try:
            cls = qos_classes.resolve(cls, param="class") if isinstance(cls, str) else None
        except SuperfluidError as exc:
            self.fail(raw, exc.message)
        if cls is None:
            self.fail(raw, "class must be a QoS class name")
        raw, models = self.get("models", ["*"])
        if (not isinstance(models, list) or not models
                or not all(isinstance(m, str) and m for m in models)):
            self.fail(raw, f"models must be a non-empty list of model names or patterns, got {models!r}")
        return Key(name=self.name, sha256=digest.lower(), qos=cls, models=tuple(models),
                   batch_invariant=self.boolean("batch-invariant"), admin=self.boolean("admin"),
                   dashboard=self.boolean("dashboard"),
                   requests_per_minute=self.count("requests-per-minute"),
                   tokens_per_minute=self.count("tokens-per-minute"),
                   max_tokens=self.count("max-tokens"), lanes=self.count("lanes"), line=self.line)


def parse_policy(text: str, source: str = "key policy") -> KeyPolicy:
    """A :class:`KeyPolicy` from a policy file's text; a :class:`ConfigError` naming the line
    and the key if anything is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    extra = sorted(set(data) - {"keys"})
    if extra:
        raise ConfigError(f"{source}: unknown top-level key {extra[0]!r}; a key policy has only [keys.NAME] tables")
    tables = data.get("keys", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{source}: keys must be tables: [keys.NAME]")
    lines = text.splitlines()
    keys: dict[str, Key] = {}
    owners: dict[str, str] = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            line = next((i for i, t in enumerate(lines, 1) if re.match(r"^\s*keys\s*\.", t)), 0)
            raise ConfigError(f"{source}:{line}: key {name!r}: must be a table ([keys.{name}])")
        key = _Table(source, lines, name, table).key()
        if key.sha256 in owners:
            _Table(source, lines, name, {}).fail("sha256", f"has the same secret as key {owners[key.sha256]!r}")
        owners[key.sha256] = name
        keys[name] = key
    return KeyPolicy(path=source, keys=keys)


def load_policy(path: str) -> KeyPolicy:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--key-policy: file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--key-policy: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_policy(text, path)


class PolicyFile:
    """The policy in force, re-read on demand (SIGHUP). A reload swaps one reference, so a
    request in flight keeps the key it was admitted with and none is dropped; a bad file keeps
    the old policy."""

    def __init__(self, path: str):
        self.path = path
        self.current = load_policy(path)

    def reload(self) -> bool:
        try:
            policy = load_policy(self.path)
        except ConfigError as exc:
            log.error("key policy not reloaded, keeping the old one (%d keys): %s", len(self.current.keys), exc)
            return False
        self.current = policy
        log.info("key policy reloaded from %s: %d keys (%s)", self.path, len(policy.keys),
                 ", ".join(policy.keys) or "none")
        return True


# ---- `superfluid keys new` -------------------------------------------------------------------

def new_key(path: str, name: str, cls: str = qos_classes.DEFAULT_CLASS) -> str:
    """Add key ``name`` to the policy file at ``path`` (created if missing) and return its
    secret, which is stored nowhere: only its hash goes into the file."""
    if not NEW_NAME.match(name):
        raise ConfigError(f"key name {name!r}: use letters, digits, '-' and '_'")
    try:
        cls = qos_classes.resolve(cls, param="--class")
    except SuperfluidError as exc:
        raise ConfigError(f"--class: {exc.message}") from None
    old = ""
    if os.path.exists(path):
        old = open(path, encoding="utf-8").read()
        if name in parse_policy(old, path).keys:
            raise ConfigError(f"{path}: key {name!r} already exists")
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    sep = "" if not old or old.endswith("\n\n") else ("\n" if old.endswith("\n") else "\n\n")
    text = old + sep + f'[keys.{name}]\nsha256 = "{hash_secret(secret)}"\nclass = "{cls}"\n'
    parse_policy(text, path)  # never write a file the server would refuse
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return secret
