"""The KV manager's one LoRA duty beyond keying (every cached prefix carries its adapter set:
``core/prefix.py``): when an adapter is unloaded, the prefixes cached under it go.

Why: a cached prefix is matched by the adapter set's names and scales. An adapter loaded later
under the same name may be another file, and the KV computed under the old one must never
seed a lane of the new one. Dropping them at the unload is also what frees their memory."""

from __future__ import annotations

from .kv import KVManager


class AdapterKV(KVManager):
    def drop_adapter(self, name: str) -> int:
        """Forget every prefix cached under a set holding adapter ``name``: free slots' caches
        (their slots released) and host-tier entries (their parked KV dropped). How many went."""
        slots = [s for s in self.cache.lru_slots() if name in dict(self.cache.adapters(s))]
        for slot in slots:
            self.cache.forget(slot)
            self._release.append(slot)
            self._report("removed", slot)
        keys = self.host.keys_under(name)
        for key in keys:
            self.host.remove(key)
            self._drop_parked.append(key)
        return len(slots) + len(keys)
