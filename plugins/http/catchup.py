"""Lets the event loop catch up with a tick's events before the next tick starts.

On a machine with as many cores as engine threads, streaming a tick's tokens while the next
engine step runs takes a core from the engine mid-step. Waiting (at most a few ms) for the
loop to deliver them first keeps the daemon quiet while the engine computes. A tick that handed
the loop nothing (only replies sent whole were running) has nothing to wait for."""

from __future__ import annotations

import asyncio
import os
import threading

from . import bridge

MAX_WAIT_S = 0.003
_loop: asyncio.AbstractEventLoop | None = None
ENABLED = os.environ.get("SUPERFLUID_HTTP_CATCHUP", "1") != "0"
_seen = threading.local()  # per scheduler thread: bridge.posted() at its last catch-up


def attach(loop: asyncio.AbstractEventLoop | None) -> None:
    global _loop
    _loop = loop


def wait_for_loop() -> None:
    """Called on a scheduler thread after a tick: return once the loop has run what was queued
    (two hops: the deliveries, then the handlers they woke), or after MAX_WAIT_S; at once if no
    event reached the loop since this thread's last call."""
    loop = _loop
    if loop is None or not ENABLED or loop.is_closed():
        return
    posted = bridge.posted()
    if getattr(_seen, "posted", None) == posted:
        return
    _seen.posted = posted
    done = threading.Event()

    def second_hop():
        done.set()

    try:
        loop.call_soon_threadsafe(lambda: loop.call_soon(second_hop))
    except RuntimeError:  # the loop is closing
        return
    done.wait(MAX_WAIT_S)
