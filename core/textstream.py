"""Turns a lane's sampled tokens into text deltas, cutting at stop strings.

Token pieces can split a UTF-8 character, and a stop string can span tokens, so text is only
released once it can no longer become part of a stop string or an unfinished character. A
character still unfinished when the generation ends (cut by max_tokens, or at a stop) is dropped,
never sent as U+FFFD; bytes that can never form a character (invalid UTF-8 from the model) are.
"""

from __future__ import annotations

import codecs
from typing import Callable


class TextStream:
    def __init__(self, token_bytes: Callable[[int], bytes], stop: tuple[str, ...] = ()):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded text not yet released (could start a stop string)
        self.text = ""      # everything released so far
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once one did

    def push(self, token: int) -> str:
        """Add one token; return the text that is now safe to release ("" if none)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(self._token_bytes(token))
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended: release what is held back; the bytes of a character it did not
        finish are dropped."""
        if self.stopped:
            return ""
        self._decoder.reset()  # an unfinished character's bytes: dropped, not U+FFFD
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            hit = self._first_stop(self._pending)
            if hit is not None:
                self.stop_string = next(st for st in self._stop if self._pending.startswith(st, hit))
                out = self._pending[:hit]
                self._pending = ""
                self.stopped = True
                self.text += out
                return out
        keep = 0 if final else self._holdback(self._pending)
        out = self._pending[:len(self._pending) - keep] if keep else self._pending
        self._pending = self._pending[len(out):]
        self.text += out
        return out

    def _first_stop(self, text: str) -> int | None:
        best = None
        for s in self._stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
