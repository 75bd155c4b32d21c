"""A prepared generation running, for every front end: admitted through the key limiter (a lane
slot per choice, the prompt's tokens once), its lanes submitted together, its events read, and
whatever happens (a reply sent, an error, a client that left) its unfinished lanes cancelled and
its tickets charged with what each lane generated.

A front end prepares its request (:class:`~.prepare.preparer.Prepared`), then::

    async with Generation(request, prep, key_limits) as run:
        async for index, event in run.events():
            ...  # shape its own reply from the lane events

and so answers with its own shapes while admission, cancellation and accounting stay one."""

from __future__ import annotations

from .keys.auth import door_time, request_key
from .keys.limits import HEADERS, KeyLimits


class Generation:
    """``prep``'s lanes running for ``request`` under ``key_limits``."""

    def __init__(self, request, prep, key_limits: KeyLimits):
        self.request = request
        self.prep = prep
        self.key_limits = key_limits
        self.tickets: list = []
        self.generated = [0] * len(prep.requests)  # completion tokens per lane: what each ticket is charged

    async def __aenter__(self) -> "Generation":
        prep, key = self.prep, request_key(self.request)
        if key is not None:
            self.request[HEADERS] = (self.key_limits, key)  # x-ratelimit-* on the response, 429 or not
        with door_time():  # per choice a lane slot and a request of the key's budgets, the prompt once; or a 429
            self.tickets = admit(self.key_limits, key, len(prep.requests[0].prompt_tokens), len(prep.requests))
        submit(prep.runtime.loop, prep.requests, self.tickets)  # a prompt longer than the context: a 400 here
        return self

    async def __aexit__(self, *exc) -> None:
        prep = self.prep
        for i, req in enumerate(prep.requests):
            if not prep.bridge.ended(i):  # the client left or the reply failed: free the KV at the next step
                prep.runtime.loop.cancel(req.id)
        with door_time():  # whatever the outcome: the lane slots back, the completions charged
            for ticket, generated in zip(self.tickets, self.generated):
                ticket.end(generated)

    async def events(self):
        """(lane index, event) as the lanes produce them, counting what each generated (a
        prompt scored with max_tokens 0 generated nothing)."""
        async for index, event in self.prep.bridge.tagged():
            if self.prep.score_only:
                pass
            elif event.kind == "delta":
                self.generated[index] += len(event.token_ids)
            elif event.kind == "finished":
                self.generated[index] = max(self.generated[index], event.completion_tokens)
            yield index, event


def admit(limits: KeyLimits, key, prompt_tokens: int, lanes: int) -> list:
    """One ticket per lane (a ticket holds one lane slot); the prompt is charged once, with the
    first, since the lanes share it (it is prefilled once). All or none: a refused one gives the
    others back."""
    tickets = []
    try:
        for i in range(lanes):
            tickets.append(limits.admit(key, prompt_tokens if i == 0 else 0))
    except BaseException:
        for ticket in tickets:
            ticket.end(0, refund_prompt=True)
        raise
    return tickets


def submit(scheduler, reqs, tickets) -> None:
    """Queue every choice's lane, together (so the others wait for the first's prefill and are
    seeded from it); if one is refused, none runs and the tickets cost a request, not tokens."""
    submitted = []
    try:
        for req in reqs:
            scheduler.submit(req)
            submitted.append(req)
    except BaseException:
        for req in submitted:
            scheduler.cancel(req.id)
        with door_time():
            for ticket in tickets:
                ticket.end(0, refund_prompt=True)  # never queued: it costs a request, not its tokens
        raise
