"""The HTTP front end's options, declared once and read back as one frozen, typed object.

The accessor, for every module of this plugin::

    from superfluid.plugins.http.options import OPTIONS     # (inside the plugin: from ..options import OPTIONS)

    opts = OPTIONS.of(config)      # config: the Config (or a test's dict of key -> value)
    opts.completion_burst          # an int, validated; each key's dashes are underscores
    opts.http_default_qos          # a class name, resolved from its aliases

``OPTIONS.of`` takes the :class:`~superfluid.core.config.Config` the front end was built with
(a plain dict of key to value also works: missing keys read as their defaults), or an object it
returned itself, so a function can take either; build it once per front end where a request path
reads it. Options the core owns (``host``, ``port``, ``session-overflow``, ``max-batch``...) are
``CORE_OPTIONS.of(config)`` (:mod:`superfluid.core.config`); the qos plugin's and the KV events
plugin's are theirs, never read here."""

from __future__ import annotations

from superfluid.core import qos
from superfluid.core.options import Option, PluginOptions, in_range

from .aliases import parse_alias
from .cors import parse_origin
from .keys.rate_limit import parse_rate

MAX_FIM_CONTEXT = 8192
STOP_CAP = 64     # --max-stop at most this (the typed stop field's own bound: openai/protocol.py)
TOOLS_CAP = 128   # --max-tools at most this (chat_protocol.MAX_TOOLS)


def _rate(text: str) -> str:
    parse_rate(text)  # validates
    return text


OPTIONS = PluginOptions("http", [
    Option("http-default-qos", str, qos.DEFAULT_CLASS,
           "QoS class for requests that name none", parse=lambda v: qos.resolve(v, param="http-default-qos"),
           metavar="CLASS"),
    Option("model-alias", list, [], "another name for a served model, optionally at a QoS class of "
           "its own: NAME=MODEL or NAME=MODEL@CLASS (e.g. claude-haiku=smollm2@background for an agent's "
           "side requests); repeatable; TOML: model-alias = [...]", parse=parse_alias,
           metavar="NAME=MODEL[@CLASS]"),
    Option("http-qos-header", bool, True,
           "honor the x-superfluid-qos request header (--no-http-qos-header ignores it)"),
    Option("http-allow-batch-invariant", bool, False,
           "allow x-superfluid-batch-invariant: true (such a lane ticks alone; any client "
           "allowed to ask can serialize the server)"),
    Option("http-open-probes", bool, False,
           "with a key policy, let /metrics and /v1/models answer without a key too, like "
           "/health (an inference gateway's endpoint picker and superfluid fleet read them "
           "without one); keep such a node's port on a network only they reach"),
    Option("max-body-mb", int, 16, "largest request body in MiB; larger is a 413 request_too_large",
           in_range(1, 4096), metavar="MB"),
    Option("max-header-kb", int, 16, "largest request head (request line and headers) in KiB; "
           "larger is a 431", in_range(1, 1024), metavar="KB"),
    Option("max-messages", int, 2048, "most messages in one request body (more: 400 naming messages)",
           in_range(1, 1 << 20), metavar="N"),
    Option("max-stop", int, 16, f"most stop strings in one request (more: 400 naming stop; at most "
           f"{STOP_CAP})", in_range(1, STOP_CAP), metavar="N"),
    Option("max-tools", int, 128, f"most tools in one request (more: 400 naming tools; at most "
           f"{TOOLS_CAP})", in_range(1, TOOLS_CAP), metavar="N"),
    Option("max-images", int, 8, "most images in one request (more: 400 too_many_images naming the first "
           "one over)", in_range(1, 256), metavar="N"),
    Option("max-image-mb", int, 10, "largest image in MiB, decoded from base64 or fetched (larger: 400 "
           "image_too_large); a request body still stops at --max-body-mb", in_range(1, 1024), metavar="MB"),
    Option("max-image-pixels", int, 32 << 20, "most pixels (width x height) an image may have, read from its "
           "header before it is decompressed, so a decompression bomb is refused without being inflated",
           in_range(1, 1 << 31), metavar="N"),
    Option("image-url-allow", list, [], "an http(s) URL prefix images may be fetched from (e.g. "
           "https://images.example.com/); repeatable; default none: remote image URLs are refused, since a "
           "server that fetches what clients name is a server-side request forgery hole",
           lambda v: None if all(isinstance(x, str) and x.startswith(("http://", "https://")) for x in v)
           else "must be http:// or https:// URL prefixes", metavar="PREFIX"),
    Option("image-fetch-timeout", float, 10.0, "seconds to fetch an allowed remote image (then 400 "
           "image_fetch_failed)", in_range(0.1, 600.0), metavar="S"),
    Option("header-timeout", float, 10.0, "seconds a client has to send a request's head, from its "
           "first byte (or the connection's opening); then 408 and the connection is closed",
           in_range(0.1, 3600.0), metavar="S"),
    Option("body-timeout", float, 60.0, "seconds a client has to send a request's body; then 408",
           in_range(0.1, 3600.0), metavar="S"),
    Option("keepalive-timeout", float, 15.0, "seconds an idle keep-alive connection stays open",
           in_range(0.1, 3600.0), metavar="S"),
    Option("stream-stall-timeout", float, 30.0, "seconds a streamed reply may wait on a client that "
           "reads nothing; then the stream is closed and its lanes cancelled (logged)",
           in_range(0.1, 3600.0), metavar="S"),
    Option("max-connections", int, 1024, "open client connections at most; one more is a 503 "
           "with Retry-After, closed at once", in_range(1, 1 << 20), metavar="N"),
    Option("completion-rate", str, "10/s", "fill-in-the-middle requests per client: the token "
           "bucket's refill rate (N/s, N/m, N/h)", parse=_rate, metavar="RATE"),
    Option("completion-burst", int, 20, "fill-in-the-middle requests per client: the bucket's size",
           in_range(1, 100000), metavar="N"),
    Option("completion-deadline-ms", int, 0, "a fill-in-the-middle request not started within this "
           "many ms fails fast (0: no deadline)", in_range(0, 3_600_000), metavar="MS"),
    Option("fim-model", str, None, "run fill-in-the-middle requests on this dedicated model "
           "(a GGUF with FIM tokens), with lanes of its own", metavar="PATH"),
    Option("fim-max-batch", int, 2, "lanes of --fim-model", in_range(1, 256), metavar="N"),
    Option("fim-max-context", int, 0, f"context of --fim-model (0: the model's, at most {MAX_FIM_CONTEXT})",
           in_range(0, MAX_FIM_CONTEXT), metavar="N"),
    Option("key-policy", str, None, "API keys and what each may do (TOML, [keys.NAME] tables; "
           "see `superfluid keys new`); re-read on SIGHUP", metavar="FILE.toml"),
    Option("insecure", bool, False, "serve a non-loopback --host without a --key-policy (anyone "
           "who reaches the port may use every model and /admin)"),
    Option("reasoning-field", str, "reasoning_content", "the name chat completions give a reasoning "
           "model's reasoning, in message and delta: reasoning_content (DeepSeek's, vLLM's) or reasoning "
           "(OpenRouter's, newer vLLM's); requests' history may use either",
           lambda v: None if v in ("reasoning_content", "reasoning") else "must be reasoning_content or reasoning",
           metavar="reasoning_content|reasoning"),
    Option("cors-origins", list, [], "a web origin whose pages may call the API from a browser "
           "(https://app.example.com, http://localhost:3000), or * for any (only with --key-policy or "
           "a loopback --host); repeatable; TOML: cors-origins = [...]; default none",
           parse=parse_origin, metavar="ORIGIN"),
])
