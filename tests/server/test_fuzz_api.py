"""Fuzzing the HTTP API against its own description: schemathesis generates requests from
``GET /openapi.json`` of a real server (valid ones and ones that break the schema), and every
response must be no 5xx, a documented status and content type, and match its schema; schema-
breaking requests must be refused. The server is healthy afterwards.

Bounded for CI (SUPERFLUID_FUZZ_EXAMPLES per operation and mode, default 40) and cheap per
request: the server's context is small, so no generation runs long. The admin unload route is
left out (it would take the model away mid-run), and so is the endless ``GET /events`` stream;
``-s`` prints what was sent and found."""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import itertools
import multiprocessing
import os
import time

import pytest

from superfluid.core import lifeline

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "40"))
# GET /events is an endless stream (a request/response check cannot end it); its query and key
# rules are tested in tests/unit/test_events_access.py and tests/server/test_events.py
EXCLUDED = {("POST", "/admin/models/{name}/unload"), ("GET", "/events")}
# Schema-valid bodies the server refuses for what a schema cannot say (a prompt longer than the
# context, a tool message without tool_call_id, duplicate tool names, an unknown model) are 400s
# and 404s by design, so "positive data acceptance" is not checked; every other check is.
EXCLUDED_CHECKS = [schemathesis.checks.positive_data_acceptance]


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    # a small context bounds every generation; a generous FIM bucket lets /infill run, not 429
    return start_server("--max-batch", "4", "--max-context", "96", "--completion-rate", "1000/s",
                        "--completion-burst", "1000")


class Tally:
    def __init__(self):
        self.requests = 0
        self.statuses: collections.Counter = collections.Counter()
        self.by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failures: dict[tuple, str] = {}  # (operation, check, status) -> an example

    def record(self, label: str, exc: BaseException, case, response) -> None:
        for failure in getattr(exc, "exceptions", None) or [exc]:
            title = getattr(failure, "title", None) or type(failure).__name__
            key = (label, title, response.status_code)
            if key not in self.failures:
                body = case.body if not callable(getattr(case, "body", None)) else None
                self.failures[key] = (f"{str(failure)[:300]} | query={case.query!r} headers={case.headers!r} "
                                      f"body={str(body)[:300]} -> {response.text[:200]!r}")

    def merge(self, other: "Tally") -> None:
        self.requests += other.requests
        self.statuses.update(other.statuses)
        for op, counts in other.by_op.items():
            self.by_op[op].update(counts)
        for key, example in other.failures.items():
            self.failures.setdefault(key, example)

    def report(self) -> str:
        lines = [f"fuzz: {self.requests} requests sent, {len(self.failures)} distinct failures",
                 f"fuzz: statuses {dict(sorted(self.statuses.items()))}"]
        lines += [f"fuzz:   {op}: {dict(sorted(c.items()))}" for op, c in self.by_op.items()]
        lines += [f"fuzz: FAIL {op} [{title}] {status}: {example}"
                  for (op, title, status), example in self.failures.items()]
        return "\n".join(lines)


def _aimed(doc: dict, server, bounded: bool) -> dict:
    """The document with its free-form names narrowed to ones that exist (plus one that does
    not), so requests reach generation and sessions instead of all ending in 404s; ``bounded``
    (for schema-valid requests only): few tokens to generate, so most fit the small context."""
    doc = copy.deepcopy(doc)
    models = [m["id"] for m in server.get_json("/v1/models")["data"]]
    sids = [server.call("POST", "/v1/sessions", body)[1]["id"]
            for body in ({}, {"system": "Be brief.", "pin_system": True}, {"qos": "background"})]
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "InfillRequest", "SessionCreateRequest",
                 "EmbeddingRequest", "TokenizeRequest", "DetokenizeRequest", "ResponsesRequest",
                 "ResponsesInputTokensRequest", "MessagesRequest", "CountTokensRequest", "OllamaChatRequest",
                 "OllamaGenerateRequest", "OllamaEmbedRequest", "OllamaEmbeddingsRequest", "OllamaShowRequest"):
        schemas[name]["properties"]["model"] = {"type": "string", "enum": [*models, "", "no-such-model"],
                                                "nullable": True}
    if bounded:
        for name in ("ChatCompletionRequest", "CompletionRequest", "InfillRequest", "SessionTurnRequest",
                     "ResponsesRequest", "MessagesRequest"):
            for key in ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens"):
                if key in schemas[name]["properties"]:
                    schemas[name]["properties"][key] = {"type": "integer", "minimum": 1, "maximum": 8,
                                                        "nullable": key not in schemas[name].get("required", ())}
        # Ollama generates to the end of the context unless num_predict says otherwise
        schemas["OllamaOptions"]["properties"]["num_predict"] = {"type": "integer", "minimum": 1, "maximum": 8}
        schemas["OllamaOptions"]["required"] = ["num_predict"]
        for name in ("OllamaChatRequest", "OllamaGenerateRequest"):
            schemas[name]["required"] = [*schemas[name].get("required", []), "options"]
        # a response needs something to answer (the schema cannot say "input or instructions")
        schemas["ResponsesRequest"]["required"] = ["input"]
        for variant in schemas["EmbeddingRequest"]["properties"]["input"]["anyOf"]:
            if variant["type"] == "array":  # a few inputs per request, each a lane
                variant["maxItems"] = min(variant.get("maxItems", 8), 8)
    for item in doc["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                if param["in"] == "path" and param["name"] == "sid":
                    param["schema"] = {"type": "string", "enum": [*sids, "no-such-session"]}
                if param["in"] == "path" and param["name"] in ("name", "id"):
                    param["schema"] = {"type": "string", "enum": [*models, "no-such-model"]}
                if param["in"] == "query" and param["name"] == "model":
                    # "" is no name, as in a body: the first served model (Daemon.get)
                    param["schema"] = {"type": "string", "enum": [*models, "", "no-such-model"]}
    return doc


def _fuzz(docs: dict, base: str, operations: list[tuple[str, str]]) -> Tally:
    """Fuzz these (method, path) operations in both modes, one after another; run in a worker
    process (its own interpreter), so it gets only picklable things: the aimed documents by
    mode, the server's address, and the operations."""
    from schemathesis import GenerationMode

    schemas = {mode: schemathesis.openapi.from_dict(docs[mode.value]) for mode in GenerationMode}
    tally = Tally()
    for method, path in operations:
        label = f"{method} {path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            op = schemas[mode][path][method]

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=base, timeout=120)
                tally.requests += 1
                tally.statuses[response.status_code] += 1
                code = ""
                if response.status_code >= 400:
                    try:
                        error = response.json()["error"]
                        code = " " + str(error.get("code", error.get("type")))  # Anthropic's errors: a type
                    except Exception:
                        code = " ?"
                tally.by_op[label][f"{response.status_code}{code}"] += 1
                try:
                    case.validate_response(response, excluded_checks=EXCLUDED_CHECKS)
                except (Exception, BaseExceptionGroup) as exc:  # collected, not raised: each distinct one counts
                    tally.record(label, exc, case, response)

            try:
                run()
            except Unsatisfiable:  # nothing to break in an operation without parameters
                pass
    return tally


def _shares(operations: list[tuple[str, str]]) -> tuple[list[list[tuple[str, str]]], list[tuple[str, str]]]:
    """The operations as tasks that may run at once, and the ones to run after them all. A
    session's routes share the sessions made in ``_aimed``, so they stay one task in their own
    order (two turns at once on one session would be a conflict the fuzzing made, not the
    server); closing (DELETE) runs last, so the turns, QoS changes and parks find them open."""
    closing = [op for op in operations if op[0] == "DELETE"]
    rest = [op for op in operations if op[0] != "DELETE"]
    sessions = [op for op in rest if op[1].startswith("/v1/sessions")]
    return [sessions, *([op] for op in rest if op not in sessions)], closing


def test_fuzz_api(fuzz_server):
    from schemathesis import GenerationMode

    doc = fuzz_server.get_json("/openapi.json")
    docs = {mode.value: _aimed(doc, fuzz_server, mode == GenerationMode.POSITIVE) for mode in GenerationMode}
    operations = [(r.ok().method.upper(), r.ok().path)
                  for r in schemathesis.openapi.from_dict(docs[GenerationMode.POSITIVE.value]).get_all_operations()]
    parallel, closing = _shares([op for op in operations if op not in EXCLUDED])
    tally = Tally()
    started = time.monotonic()
    # Generating and checking cases is the client's CPU work, most of the run; two processes
    # (this machine's cores) each fuzz a share, and every operation gets the same examples.
    # Each worker ends with this process, even a SIGKILLed one (lifeline.watch_parent).
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"),
                                                initializer=lifeline.watch_parent) as pool:
        for share in pool.map(_fuzz, itertools.repeat(docs), itertools.repeat(fuzz_server.base), parallel):
            tally.merge(share)
        tally.merge(pool.submit(_fuzz, docs, fuzz_server.base, closing).result())
    print(f"\n{tally.report()}\nfuzz: {time.monotonic() - started:.0f} s", flush=True)
    health = fuzz_server.get_json("/health")
    assert health["status"] == "ok", health
    status, reply = fuzz_server.call("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    assert status == 200, reply
    assert tally.requests > 0 and not tally.failures, tally.report()
