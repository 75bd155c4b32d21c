"""Anthropic's usage and stop reasons tell the truth, on the real server through the ``anthropic``
SDK: ``cache_read_input_tokens`` is what the prefix cache served (the server's own prefill counter
moves by exactly the rest), ``cache_creation_input_tokens`` the rest, prefilled and kept for the
next request (which then reads it), ``input_tokens`` 0 on this prefix-caching engine, the three
summing to count_tokens; the stream's message_start says the split is not known yet and
message_delta carries it; a reply cut by the context window stops with
``model_context_window_exceeded``, one cut by ``max_tokens`` with ``max_tokens``.

One small-context server (160 tokens) so a reply can fill the window quickly."""

from __future__ import annotations

import json

import pytest

anthropic = pytest.importorskip("anthropic")

CONTEXT = 160
SYSTEM = ("You are a patient assistant for a small bakery. Answer questions about bread, opening hours and "
          "orders in a friendly way. " * 3).strip()


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("--max-context", str(CONTEXT), "--max-batch", "2")


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key="none", max_retries=0, timeout=120)


def _prefilled(srv) -> float:
    return srv.settled_metric("superfluid_prefill_tokens_total")


def _ask(question: str) -> dict:
    return {"model": "smollm2", "system": SYSTEM, "messages": [{"role": "user", "content": question}]}


def test_cache_read_and_creation_are_what_the_prefix_cache_did(srv, client):
    body = _ask("When do you open on Sundays?")
    counted = client.messages.count_tokens(**body).input_tokens
    before = _prefilled(srv)
    cold = client.messages.create(max_tokens=2, extra_body={"temperature": 0}, **body).usage
    cold_prefill = _prefilled(srv) - before
    assert cold.cache_read_input_tokens + cold.cache_creation_input_tokens + cold.input_tokens == counted
    # what was not read from the cache was computed now, and is kept: created, not plain input
    assert cold_prefill == counted - cold.cache_read_input_tokens
    assert cold.cache_creation_input_tokens == counted - cold.cache_read_input_tokens and cold.input_tokens == 0

    before = _prefilled(srv)
    warm = client.messages.create(max_tokens=2, extra_body={"temperature": 0}, **_ask("Do you sell rye bread?")).usage
    warm_prefill = _prefilled(srv) - before
    assert warm.cache_read_input_tokens > 0.5 * counted  # the system prompt the first request created
    assert warm_prefill == warm.cache_creation_input_tokens  # exactly the rest was prefilled
    assert warm.input_tokens == 0


def test_the_stream_says_the_split_in_message_delta(client):
    body = _ask("Is the croissant vegan?")
    counted = client.messages.count_tokens(**body).input_tokens
    with client.messages.stream(max_tokens=3, extra_body={"temperature": 0}, **body) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    assert start.input_tokens == counted and start.cache_read_input_tokens is None
    assert start.cache_creation_input_tokens is None
    delta = next(e for e in events if e.type == "message_delta").usage
    assert delta.cache_read_input_tokens > 0  # the system prompt, cached by the earlier requests
    assert delta.cache_read_input_tokens + delta.cache_creation_input_tokens + delta.input_tokens == counted
    assert final.usage.cache_read_input_tokens == delta.cache_read_input_tokens


def test_a_reply_cut_by_the_context_window_says_so(srv, client):
    body = _ask("Count from 1 to 500, separated by commas, and nothing else.")
    cut = client.messages.create(max_tokens=4, extra_body={"temperature": 0}, **body)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 4
    full = client.messages.create(max_tokens=4000, extra_body={"temperature": 0}, **body)
    u = full.usage
    total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens + u.output_tokens
    assert total == CONTEXT, (full.content, u)  # the count runs until the window is full
    assert full.stop_reason == "model_context_window_exceeded"
    with client.messages.stream(max_tokens=4000, extra_body={"temperature": 0}, **body) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "model_context_window_exceeded"
    # and /openapi.json says a reply may stop so (the fuzz run's validator refused it when it did not)
    answer = srv.get_json("/openapi.json")["paths"]["/v1/messages"]["post"]["responses"]["200"]
    assert '"model_context_window_exceeded"' in json.dumps(answer)
