"""Park artifacts: cached KV written to a file (a session's KV, outliving the process) and read
back into the host tier, each carried out by the next tick."""

from __future__ import annotations

import logging
import threading

import attrs

from .prefix import MIN_REUSE, HostTier, SlotCache
from .tick import TickPlan, TickResult

log = logging.getLogger("superfluid.kv")


@attrs.define(eq=False)
class SaveOp:
    """A request to write cached KV to a park artifact, answered by the tick that does it."""

    tokens: list[int]
    path: str
    adapters: tuple = ()  # the LoRA adapter set its KV is computed under (only its caches are saved)
    saved: list[int] | None = None
    done: threading.Event = attrs.field(factory=threading.Event)


class Artifacts:
    """Saves and loads waiting for the next tick, and those the tick in flight carries."""

    def __init__(self, name: str):
        self.name = name
        self._saves: list[SaveOp] = []
        self._saving: dict[str, SaveOp] = {}
        self._temp_keys: set[str] = set()  # park keys that exist only for a save in the same tick
        self._loads: list[tuple[str, list[int], tuple]] = []
        self._staged: list[tuple[str, str]] = []

    def has_work(self) -> bool:
        return bool(self._saves or self._loads or self._saving)

    def has_saves(self) -> bool:
        """Saves asked for, or being written (the engine writes off its tick thread)."""
        return bool(self._saves or self._saving)

    def save(self, op: SaveOp) -> None:
        self._saves.append(op)

    def load(self, path: str, tokens: list[int], adapters: tuple = ()) -> None:
        """Bring an artifact (KV computed under ``adapters``) into the host tier at the next tick."""
        self._loads.append((path, list(tokens), adapters))

    def stage_loads(self, host: HostTier) -> None:
        """Artifacts to load enter the host tier before admission, so the lanes admitted in the
        same plan already restore from them (the engine loads before it seeds lanes)."""
        for path, tokens, adapters in self._loads:
            self._staged.append((path, host.add(tokens, force=True, adapters=adapters)))
        self._loads.clear()

    def fill_plan(self, plan: TickPlan, free: list[int], cache: SlotCache, host: HostTier) -> None:
        """A save copies the best cached free slot (or host prefix) for its tokens to a file; a
        load brings a file into the host tier under the key staged for it."""
        for op in self._saves:
            cached = [s for s in free if cache.tokens_for(s, op.adapters)]
            slot, n = cache.best_slot(op.tokens + [-1], cached, adapters=op.adapters) if cached else (None, 0)
            key, host_n = host.best(op.tokens + [-1], op.adapters) if len(host) else (None, 0)
            if key is not None and host_n > n:
                op.saved = host.tokens(key)
                plan.save.append((key, op.path))
            elif n >= MIN_REUSE:
                op.saved = list(cache.tokens(slot))
                tmp = f"save:{op.path}"
                self._temp_keys.add(tmp)
                plan.park.append((slot, tmp))
                plan.save.append((tmp, op.path))
                plan.drop_parked.append(tmp)
            else:
                op.done.set()
                continue
            self._saving[op.path] = op
        self._saves.clear()
        plan.collect_saves = bool(self._saving)
        plan.load.extend(self._staged)
        self._staged.clear()

    def tick_done(self, result: TickResult) -> None:
        """Answer the saves whose writes finished by this tick's end (asked by it or earlier)."""
        for path, size in result.saved.items():
            op = self._saving.pop(path, None)
            if op is not None:
                if size <= 0:
                    op.saved = None
                    log.warning("model %s: could not write park artifact %s", self.name, path)
                op.done.set()

    def is_temporary(self, key: str) -> bool:
        """A key parked only to be written to a file (and dropped in the same tick); forgotten."""
        if key in self._temp_keys:
            self._temp_keys.discard(key)
            return True
        return False

    def forget(self) -> None:
        """The engine lost its state: writes it had not finished are gone with it."""
        self._temp_keys.clear()
        for path, op in self._saving.items():
            op.saved = None
            log.warning("model %s: park artifact %s was not written (the engine was lost)", self.name, path)
            op.done.set()
        self._saving.clear()
