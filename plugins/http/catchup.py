"""Lets the event loop catch up with a tick's events before the next tick starts.

On a machine with as many cores as engine threads, streaming a tick's tokens while the next
engine step runs takes a core from the engine mid-step. Waiting (at most a few ms) for the
loop to deliver them first keeps the daemon quiet while the engine computes. A tick that handed
the loop nothing (only replies sent whole were running) has nothing to wait for.

One :class:`LoopCatchup` belongs to one front end and its event loop: the front end's bridges
count their wake-ups on it, and it is registered as a plugin while the front end serves, so the
models' threads reach it through their ``superfluid_tick_done`` hook, never a module global."""

from __future__ import annotations

import asyncio
import os
import threading

from superfluid.core.hookspecs import hookimpl

MAX_WAIT_S = 0.003


def enabled_by_env() -> bool:
    """``SUPERFLUID_HTTP_CATCHUP=0`` turns catching up off (docs/configuration.md)."""
    return os.environ.get("SUPERFLUID_HTTP_CATCHUP", "1") != "0"


class LoopCatchup:
    """Wake-ups handed to one event loop, and the wait for it after a tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop, enabled: bool | None = None):
        self.loop: asyncio.AbstractEventLoop | None = loop
        self.enabled = enabled_by_env() if enabled is None else enabled
        self.posted = 0  # wake-ups bridges handed to the loop so far
        self._seen = threading.local()  # per model's thread: ``posted`` at its last catch-up

    def note_post(self) -> None:
        """A bridge handed the loop an event (a racing thread may lose an increment: the count
        still moves, all the wait reads)."""
        self.posted += 1

    def detach(self) -> None:
        """The loop is going away: waits return at once from now on."""
        self.loop = None

    def wait_for_loop(self) -> None:
        """Called on a model's thread after a tick: return once the loop has run what was queued
        (two hops: the deliveries, then the handlers they woke), or after MAX_WAIT_S; at once if no
        event reached the loop since this thread's last call."""
        loop = self.loop
        if loop is None or not self.enabled or loop.is_closed():
            return
        posted = self.posted
        if getattr(self._seen, "posted", None) == posted:
            return
        self._seen.posted = posted
        done = threading.Event()

        def second_hop():
            done.set()

        try:
            loop.call_soon_threadsafe(lambda: loop.call_soon(second_hop))
        except RuntimeError:  # the loop is closing
            return
        done.wait(MAX_WAIT_S)

    @hookimpl(trylast=True)  # after the metrics of the same tick, as before
    def superfluid_tick_done(self, model, stats):
        self.wait_for_loop()
