"""Runs ticks on an mlx-lm model (inside the worker process).

Every slot has its own mlx-lm ``KVCache`` per layer. One tick is a loop of engine steps; one
step is

* one batched forward pass over every lane that feeds a single token (decoding lanes, and
  lanes replaying their generation after a restart), each row reading and extending its own
  slot's caches through :class:`LaneBatchView` (left-padded to the longest, masked), then
* prefill chunks (up to 2048 tokens a step, the plan's ``step_tokens`` if smaller), one
  forward pass per prefilling lane on its own caches,

all evaluated as one MLX graph, then sampled per lane. Between steps the shared stop flag is
read, so a cancelled lane or an urgent newcomer ends the tick at the next step; MLX cannot
interrupt a step already running (``aborts_mid_step`` is False).

Parking copies a slot's keys and values to numpy arrays (host memory); restoring builds fresh
caches from them. A copy from another slot slices that slot's arrays up to the kept length.
"""

from __future__ import annotations

import os
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from superfluid.core.tick import LanePlan, LaneResult, StepTiming, TickPlan, TickResult
from superfluid.core.worker_process import stop_requested

from .sampling import LaneSampler
from .worker import PREFILL_STEP

_LAST_ONLY = {"llama", "mistral", "qwen2", "qwen3"}  # models whose head can run on the last row only


class LaneBatchView:
    """One layer's cache for a batched single-token step over several slots.

    mlx-lm's attention asks the cache for ``offset`` (RoPE positions, one per row here), calls
    ``update_and_fetch`` with the step's keys and values, and layer 0's cache for the mask.
    Each row is appended to its own slot's ``KVCache``; the rows' keys and values are then
    left-padded to the longest and stacked, and the mask hides the padding."""

    def __init__(self, caches: list[KVCache], pads: list[int], mask: mx.array):
        self.caches = caches
        self.pads = pads
        self.offset = mx.array([c.offset for c in caches])
        self.mask = mask

    def update_and_fetch(self, keys, values):
        ks, vs = [], []
        for i, cache in enumerate(self.caches):
            k, v = cache.update_and_fetch(keys[i:i + 1], values[i:i + 1])
            pad = self.pads[i]
            if pad:
                k = mx.pad(k, [(0, 0), (0, 0), (pad, 0), (0, 0)])
                v = mx.pad(v, [(0, 0), (0, 0), (pad, 0), (0, 0)])
            ks.append(k)
            vs.append(v)
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)

    def make_mask(self, n: int, return_array: bool = False, window_size=None):
        return self.mask


def _batch_views(slot_caches: list[list[KVCache]]) -> list[LaneBatchView]:
    lengths = [caches[0].offset + 1 for caches in slot_caches]
    longest = max(lengths)
    pads = [longest - n for n in lengths]
    mask = (mx.arange(longest)[None, :] >= mx.array(pads)[:, None]).reshape(len(pads), 1, 1, longest)
    n_layers = len(slot_caches[0])
    return [LaneBatchView([caches[layer] for caches in slot_caches], pads, mask) for layer in range(n_layers)]


class _Work:
    """A lane's remaining work within one tick."""

    __slots__ = ("slot", "feed", "sample", "max_new", "ignore_eos", "accept", "result", "pos", "decoding",
                 "was_decoding", "replay_from")

    def __init__(self, lp: LanePlan, accept: bool):
        self.slot = lp.slot
        self.feed = list(lp.feed)
        self.sample = lp.sample
        self.max_new = lp.max_new
        self.ignore_eos = lp.ignore_eos
        self.accept = accept
        self.pos = lp.pos
        self.decoding = lp.decode
        self.was_decoding = lp.decode
        self.replay_from = lp.replay_from
        self.result = LaneResult(slot=lp.slot)


def _takes_one(w: _Work) -> bool:
    """Feeds exactly one token this step: a decoding lane, or a lane replaying its generation."""
    return len(w.feed) == 1 or (w.replay_from is not None and w.pos >= w.replay_from)


class TickRunner:
    def __init__(self, model, eog: set[int], stop_flag, kv_capacity: int, step_tokens: int = PREFILL_STEP):
        self.model = model
        self.n_layers = len(model.layers)
        self.eog = eog
        self.stop_flag = stop_flag
        self.kv_capacity = kv_capacity
        self.step_tokens = step_tokens
        self.caches: dict[int, list[KVCache]] = {}
        self.samplers: dict[int, LaneSampler] = {}
        self.parked: dict[str, tuple[int, list]] = {}  # key -> (tokens, [(keys, values, dtype) per layer])
        model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "")
        self._last_only = model_type in _LAST_ONLY and hasattr(model, "model")

    # ---- slots ------------------------------------------------------------------------------

    def length(self, slot: int) -> int:
        caches = self.caches.get(slot)
        return caches[0].offset if caches else 0

    def _slot(self, slot: int) -> list[KVCache]:
        caches = self.caches.get(slot)
        if caches is None:
            caches = self.caches[slot] = [KVCache() for _ in range(self.n_layers)]
        return caches

    def _cut(self, slot: int, pos: int) -> None:
        for cache in self.caches.get(slot, ()):
            if cache.offset > pos:
                cache.trim(cache.offset - pos)

    def _clear(self, slot: int) -> None:
        self.caches.pop(slot, None)
        self.samplers.pop(slot, None)

    def kv_used(self) -> int:
        return sum(self.length(s) for s in self.caches)

    # ---- parking ----------------------------------------------------------------------------

    @staticmethod
    def _to_host(a: mx.array) -> tuple[np.ndarray, object]:
        if a.dtype == mx.bfloat16:  # numpy has no bfloat16: keep the bits
            return np.array(a.view(mx.uint16)), mx.bfloat16
        return np.array(a), None

    @staticmethod
    def _from_host(a: np.ndarray, dtype) -> mx.array:
        arr = mx.array(a)
        return arr.view(dtype) if dtype is not None else arr

    def park(self, slot: int, key: str) -> int:
        """Copy a slot's KV to host memory; the bytes held."""
        n = self.length(slot)
        layers = []
        for cache in self.caches.get(slot, ()):
            if n == 0:
                break
            k, kd = self._to_host(cache.keys[..., :n, :])
            v, _ = self._to_host(cache.values[..., :n, :])
            layers.append((k, v, kd))
        self.parked[key] = (n, layers)
        return max(self._parked_size(key), 1)

    def _parked_size(self, key: str) -> int:
        _, layers = self.parked.get(key, (0, []))
        return sum(k.nbytes + v.nbytes for k, v, _ in layers)

    def restore(self, slot: int, key: str, keep: bool = False) -> bool:
        entry = self.parked.get(key) if keep else self.parked.pop(key, None)
        if entry is None:
            return False
        n, layers = entry
        caches = [KVCache() for _ in range(self.n_layers)]
        if n:
            if len(layers) != self.n_layers:
                return False
            for cache, (k, v, dtype) in zip(caches, layers):
                cache.state = (self._from_host(k, dtype), self._from_host(v, dtype), n)
        self.caches[slot] = caches
        return True

    def load(self, path: str, key: str) -> int:
        """Read a park artifact (``save``'s .npz) into host memory; its size, 0 if unreadable."""
        try:
            with np.load(path, allow_pickle=False) as data:
                n = int(data["n"])
                bf16 = bool(data["bf16"])
                layers = [(data[f"k{i}"], data[f"v{i}"], mx.bfloat16 if bf16 else None)
                          for i in range(int(data["layers"]))]
        except (OSError, KeyError, ValueError):
            return 0
        if n and len(layers) != self.n_layers:
            return 0
        self.parked[key] = (n, layers)
        return max(self._parked_size(key), 1)

    def save(self, key: str, path: str) -> int:
        entry = self.parked.get(key)
        if entry is None:
            return 0
        n, layers = entry
        arrays = {"n": np.array(n), "layers": np.array(len(layers)),
                  "bf16": np.array(any(d is not None for _, _, d in layers))}
        for i, (k, v, _) in enumerate(layers):
            arrays[f"k{i}"], arrays[f"v{i}"] = k, v
        tmp = f"{path}.tmp"
        try:
            with open(tmp, "wb") as fh:
                np.savez(fh, **arrays)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            return os.path.getsize(path)
        except OSError:
            return 0

    def _copy(self, src: int, dst: int, pos: int) -> None:
        n = min(self.length(src), pos)
        caches = [KVCache() for _ in range(self.n_layers)]
        if n:
            for cache, s in zip(caches, self.caches[src]):
                cache.state = (s.keys[..., :n, :], s.values[..., :n, :], n)
        self.caches[dst] = caches

    def _seed(self, lp: LanePlan) -> bool:
        """Set up a reset slot's KV so it holds exactly the lane's first ``lp.pos`` tokens."""
        slot = lp.slot
        self.samplers.pop(slot, None)
        seed = lp.seed
        if seed.key is not None:
            self.caches.pop(slot, None)
            if not self.restore(slot, seed.key, keep=seed.shared):
                return False
        elif seed.slot is not None:
            self._copy(seed.slot, slot, lp.pos)
        if lp.pos == 0:
            self.caches.pop(slot, None)
            return True
        self._cut(slot, lp.pos)
        return self.length(slot) == lp.pos

    # ---- one tick ---------------------------------------------------------------------------

    def run(self, plan: TickPlan) -> TickResult:
        t_start = time.perf_counter()
        result = TickResult()
        for slot, key in plan.park:
            result.parked[key] = self.park(slot, key)
        for path, key in getattr(plan, "load", ()):
            result.parked[key] = self.load(path, key)
        for key, path in getattr(plan, "save", ()):
            result.saved[path] = self.save(key, path)
        for key in plan.drop_parked:
            self.parked.pop(key, None)
        for slot in plan.release:
            self._clear(slot)
        work: list[_Work] = []
        for lp in plan.lanes:
            if lp.reset:
                if not self._seed(lp):
                    self._clear(lp.slot)
                    result.lanes[lp.slot] = LaneResult(slot=lp.slot, restore_failed=True)
                    continue
                self.samplers[lp.slot] = LaneSampler(lp.sampling, lp.history)
            elif self.length(lp.slot) > lp.pos:
                self._cut(lp.slot, lp.pos)
            sampler = self.samplers.get(lp.slot)
            accept = bool(sampler and sampler.penalized and not lp.decode)
            work.append(_Work(lp, accept))

        active = [w for w in work if w.feed]
        while active:
            if stop_requested(self.stop_flag):
                result.stopped_early = True
                break
            result.steps.append(self._step(active, plan.step_tokens))
            if plan.end_after_first_token and any(w.result.tokens and not w.was_decoding for w in work):
                result.stopped_early = any(w.feed for w in active)
                break
            still = [w for w in active if w.feed]
            if plan.quiet and len(still) < len(active):  # a reply is complete: its client is waiting
                result.stopped_early = bool(still)
                break
            active = still
        for w in work:
            result.lanes[w.slot] = w.result
        result.parked_bytes = sum(self._parked_size(k) for k in self.parked)
        result.seconds = time.perf_counter() - t_start
        result.kv_used = self.kv_used()
        result.kv_capacity = self.kv_capacity
        return result

    def _last_logits(self, tokens: mx.array, cache) -> mx.array:
        """Logits of each row's last position (the head runs on the last position only where the
        model's layout is known)."""
        if self._last_only:
            h = self.model.model(tokens, cache)[:, -1:, :]
            if getattr(self.model.args, "tie_word_embeddings", False) or not hasattr(self.model, "lm_head"):
                return self.model.model.embed_tokens.as_linear(h)[:, -1, :]
            return self.model.lm_head(h)[:, -1, :]
        return self.model(tokens, cache=cache)[:, -1, :]

    def _step(self, active: list[_Work], limit: int) -> StepTiming:
        t0 = time.perf_counter()
        singles = [w for w in active if _takes_one(w)]
        room = self.step_tokens if limit <= 0 else min(self.step_tokens, limit)
        shares: list[tuple[_Work, int]] = []
        for w in active:
            if _takes_one(w):
                continue
            if room <= 0:
                break
            count = min(len(w.feed), room)
            if w.replay_from is not None:  # replayed tokens go one per step, as decoding fed them
                count = min(count, w.replay_from - w.pos)
            shares.append((w, count))
            room -= count

        pending: list[tuple[_Work, int, mx.array | None]] = []  # (work, tokens fed, last logits)
        if singles:
            tokens = mx.array([[w.feed[0]] for w in singles])
            if len(singles) == 1:
                cache = self._slot(singles[0].slot)
            else:
                cache = _batch_views([self._slot(w.slot) for w in singles])
            logits = self._last_logits(tokens, cache)
            for i, w in enumerate(singles):
                pending.append((w, 1, logits[i:i + 1] if w.sample and len(w.feed) == 1 else None))
        for w, count in shares:
            caches = self._slot(w.slot)
            tokens = mx.array([w.feed[:count]])
            if count == len(w.feed) and w.sample:
                pending.append((w, count, self._last_logits(tokens, caches)))
            else:
                self.model.model(tokens, caches) if self._last_only else self.model(tokens, cache=caches)
                pending.append((w, count, None))

        drawn: list[tuple[_Work, mx.array]] = []
        outputs: list[mx.array] = []
        decode_tokens = 0
        n_fed = 0
        for w, count, logits in pending:
            fed = w.feed[:count]
            del w.feed[:count]
            w.pos += count
            n_fed += count
            w.result.n_fed += count
            if w.decoding:
                decode_tokens += 1
            else:
                w.result.n_prefill += count
            sampler = self.samplers.get(w.slot)
            if w.accept and sampler:
                sampler.accept(fed)
            for cache in self.caches[w.slot]:
                outputs += (cache.keys, cache.values)
            if logits is not None and not w.feed:
                token = sampler.sample(logits) if sampler else mx.argmax(logits, axis=-1)
                drawn.append((w, token))
                outputs.append(token)
        mx.eval(outputs)
        for w, token in drawn:
            tok = int(token.item())
            w.result.tokens.append(tok)
            sampler = self.samplers.get(w.slot)
            if sampler:
                sampler.accept([tok])
            w.accept = False  # tokens it sampled itself are already accepted
            w.decoding = True
            if tok in self.eog and not w.ignore_eos:
                w.result.eog = True
            elif len(w.result.tokens) < w.max_new:
                w.feed = [tok]
        return StepTiming(prefill_tokens=n_fed - decode_tokens, decode_tokens=decode_tokens,
                          seconds=time.perf_counter() - t0)
