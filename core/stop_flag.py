"""The flag that ends a tick early: the model's thread raises it, the tick's step loop reads it.

An engine holds one :class:`StopFlag` and hands it to its runner. A worker engine's flag lives in
shared memory, made from the worker's ``multiprocessing`` context and passed to the spawned
worker; an in-process engine's is plain memory. Either way it is three bytes, laid out for
readers that are not Python:

* byte 0, the stop flag, with byte 1 always 0, so C code may read the pair as a string: llama.cpp's
  abort callback is libc's ``strlen`` on them, 1 while stop is raised
  (``plugins/llamacpp/worker.abort_on_flag``);
* byte 2, the yield flag, which only step loops read (core's, and ``_rounds.c`` between its
  decode rounds)."""

from __future__ import annotations

import ctypes

_STOP, _YIELD = 0, 2


class StopFlag:
    """Stop ends the tick now, aborting the step in flight where the engine can
    (``EngineCapabilities.aborts_mid_step``); yield ends it once that step is done, so nothing
    computed is thrown away. Either ends the tick before its next step. Raised from any thread,
    cleared by the model's thread before each tick."""

    __slots__ = ("buffer",)

    def __init__(self, mp_context=None):
        # ``mp_context``: shared with the processes it spawns (its RawArray); None: this process only
        self.buffer = mp_context.RawArray("b", 3) if mp_context is not None else (ctypes.c_byte * 3)()

    def request_stop(self) -> None:
        self.buffer[_STOP] = 1

    def request_yield(self) -> None:
        self.buffer[_YIELD] = 1

    def clear(self) -> None:
        self.buffer[_STOP] = 0
        self.buffer[_YIELD] = 0

    def stop_requested(self) -> bool:
        """Whether the tick should end before its next step (stop or yield raised)."""
        return bool(self.buffer[_STOP] or self.buffer[_YIELD])

    def abort_requested(self) -> bool:
        """Whether stop itself is raised: a step the engine reports aborted was aborted by it."""
        return bool(self.buffer[_STOP])

    @property
    def address(self) -> int:
        """The bytes' address, for C code that reads them (see the module docstring)."""
        return ctypes.addressof(self.buffer)
