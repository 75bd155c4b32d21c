"""Parked KV on the MLX runner: a slot's caches copied to host memory, restored, written to and
read from park files (the runner's ``park`` / ``restore`` / ``load`` / ``save_writer``).

A parked entry is ``(n, layers)``: the tokens held and, per layer, the cache's arrays
(:func:`kv_cells.arrays`, cut to ``n`` cells) as numpy arrays with a bfloat16 flag each. A
quantized cache (--kv-bits) parks its packed ints, scales and biases as they are, so a parked
lane takes the narrow cache's bytes on the host tier too, and restores bit for bit. A park file
records the width it was written at; one of another width (the model served since with another
--kv-bits) is not read (``load`` returns 0, a miss)."""

from __future__ import annotations

import numpy as np

from . import kv_cells


class ParkedKV:
    """The runner's parking primitives (mixed into :class:`~.runner.MlxRunner`, which has
    ``caches``, ``parked``, ``n_layers``, ``kv_bits`` and ``length``)."""

    @staticmethod
    def _nbytes(entry: tuple[int, list]) -> int:
        return sum(a.nbytes for layer in entry[1] for a, _ in layer)

    def park(self, slot: int, key: str) -> int:
        """Copy a slot's KV to host memory; the bytes held."""
        n = self.length(slot)
        layers = []
        if n:
            layers = [[kv_cells.to_host(a) for a in kv_cells.arrays(cache, n)] for cache in self.caches[slot]]
        entry = self.parked[key] = (n, layers)
        return max(self._nbytes(entry), 1)

    def parked_bytes(self) -> int:
        return sum(self._nbytes(entry) for entry in self.parked.values())

    def restore(self, slot: int, entry: tuple[int, list]) -> bool:
        n, layers = entry
        if not n:
            self.caches[slot] = [kv_cells.new_cache(self.kv_bits) for _ in range(self.n_layers)]
            return True
        if len(layers) != self.n_layers:
            return False
        try:
            caches = [kv_cells.from_arrays(self.kv_bits, [kv_cells.from_host(a, bf) for a, bf in layer], n)
                      for layer in layers]
        except ValueError:  # another width's arrays
            return False
        self.caches[slot] = caches
        return True

    def load(self, path: str, key: str) -> int:
        """Read a park artifact (``save_writer``'s .npz) into host memory; its size, 0 if
        unreadable or written at another KV width."""
        try:
            with np.load(path, allow_pickle=False) as data:
                n = int(data["n"])
                bits = int(data["bits"]) if "bits" in data else 0
                if bits != self.kv_bits:
                    return 0
                # written before the per-array layout (keys, values and one "bf16" flag); a model
                # of 17 layers or more has a "bf16" in this layout too: layer 16's flags
                if "k0" in data or ("bf16" in data and "bf0" not in data):
                    bf16 = bool(data["bf16"])
                    layers = [[(data[f"k{i}"], bf16), (data[f"v{i}"], bf16)] for i in range(int(data["layers"]))]
                else:
                    layers = []
                    for i in range(int(data["layers"])):
                        flags = data[f"bf{i}"]
                        layers.append([(data[f"a{i}_{j}"], bool(flags[j])) for j in range(len(flags))])
        except (OSError, KeyError, ValueError):
            return 0
        if n and len(layers) != self.n_layers:
            return 0
        entry = self.parked[key] = (n, layers)
        return max(self._nbytes(entry), 1)

    def save_writer(self, key: str):
        """The arrays are numpy ones already (made on the tick thread, which alone drives MLX's
        streams); the writer thread only writes them."""
        entry = self.parked.get(key)
        if entry is None:
            return None
        n, layers = entry
        arrays = {"n": np.array(n), "layers": np.array(len(layers)), "bits": np.array(self.kv_bits)}
        for i, layer in enumerate(layers):
            arrays[f"bf{i}"] = np.array([bf for _, bf in layer], dtype=bool)
            for j, (a, _) in enumerate(layer):
                arrays[f"a{i}_{j}"] = np.asarray(a)
        return lambda f: np.savez(f, **arrays)
