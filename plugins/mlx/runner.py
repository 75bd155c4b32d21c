"""Runs ticks on an mlx-lm model (inside the worker process).

Every slot has its own mlx-lm ``KVCache`` per layer. One tick is a loop of engine steps; one
step is

* one batched forward pass over every lane that feeds a single token (decoding lanes, and
  lanes replaying their generation after a restart), each row reading and extending its own
  slot's caches through :class:`~.batch_view.LaneBatchView` (left-padded to the longest, masked), then
* prefill chunks (up to 2048 tokens a step, the plan's ``step_tokens`` if smaller), one
  forward pass per prefilling lane on its own caches,

all evaluated as one MLX graph, then sampled per lane. Lanes whose sampling is ``plain`` are
sampled inside that graph; the others (logprobs, ``logit_bias``, a constraint) have their last
row brought to the host, read and shaped there (see ``sampling``) and are sampled in a second,
small evaluation. A lane that scores its prompt gets the logits of every fed position, and an
embedding lane the sum of its fed positions' final hidden states (the head's input), in the
same pass that fills the KV. Between steps the shared stop flag is
read, so a cancelled lane or an urgent newcomer ends the tick at the next step; MLX cannot
interrupt a step already running (``aborts_mid_step`` is False).

A model with a vision half (``vision``: SmolVLM through mlx-vlm) runs its language half here
like any text model; where a feed holds image placeholders (negative ids, core/media.py) the
pass takes input rows instead of token ids (mlx-lm's ``input_embeddings``): the token
embeddings, with the image's embedding rows (its encoder's, once per image: ``self.media``) at
the placeholders. Text and image rows go in one pass; a feed of tokens only is run as before.

Each layer's cache is mlx-lm's ``KVCache``, or its ``QuantizedKVCache`` under --kv-bits
(``kv_cells``). Parking copies a slot's arrays to numpy arrays (host memory; ``parking``);
restoring builds fresh caches from them. A copy from another slot slices that slot's arrays up
to the kept length.

The pool is sized in pool.py (the worker): with a shared pool (a sliding-window model) a step that
would take the slots past its cells is refused before anything is fed (``PoolFull``), as
llama.cpp's full pool refuses it, and the scheduler frees room.

The tick itself (prelude, seeding, stop and quiet rules, result) is core's
:class:`~superfluid.core.tick_runner.TickRunner`; this module holds MLX's primitives.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from superfluid.core import tick_runner
from superfluid.core.constrain import Constrainer
from superfluid.core.logits import token_logprob
from superfluid.core.media_encoding import encoder_cache
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import LanePlan, StepTiming, TickPlan, TickResult, TokenLogprob
from superfluid.core.tick_runner import PoolFull, Work, prefill_shares, takes_one

from . import kv_cells
from .batch_view import batch_views
from .constants import HIDDEN_STATE_MODELS, PREFILL_STEP
from .lora import MlxLoraTicks
from .parking import ParkedKV
from .sampling import LaneSampler


class MlxRunner(MlxLoraTicks, ParkedKV, tick_runner.TickRunner):
    """The MLX engine's primitives (see :class:`superfluid.core.tick_runner.TickRunner`)."""

    def __init__(self, model, eog: set[int], stop_flag: StopFlag, kv_capacity: int, step_tokens: int = PREFILL_STEP,
                 constrainer: Constrainer | None = None, encoder=None, shared_pool: bool = False,
                 image_encoding: str | None = None, kv_bits: int = 0):
        super().__init__(stop_flag, kv_capacity)
        self.kv_bits = kv_bits  # 0: full-width caches; 8 or 4: quantized (kv_cells)
        # a shared pool (pool.py): the slots together hold at most kv_capacity cells
        self.shared_pool = shared_pool
        if encoder is not None:  # a vision model: an image to its rows (vision.Encoder), off the tick
            self.media = encoder_cache(encoder, image_encoding)
        self._row_dtype = None  # image rows enter the model in the token embeddings' dtype
        self.constrainer = constrainer  # token masks for json_schema / grammar lanes (None: refused)
        self.model = model
        self.n_layers = len(model.layers)
        self.eog = eog
        self.step_tokens = step_tokens
        self.caches: dict[int, list] = {}  # slot -> a cache per layer (kv_cells)
        self.samplers: dict[int, LaneSampler]
        self.parked: dict[str, tuple[int, list]]  # key -> (tokens, [[(array, bf16)] per layer]): parking
        model_type = getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", "")
        self._last_only = model_type in HIDDEN_STATE_MODELS and hasattr(model, "model")

    # ---- slots ------------------------------------------------------------------------------

    def length(self, slot: int) -> int:
        caches = self.caches.get(slot)
        return caches[0].offset if caches else 0

    def _slot(self, slot: int) -> list:
        caches = self.caches.get(slot)
        if caches is None:
            caches = self.caches[slot] = [kv_cells.new_cache(self.kv_bits) for _ in range(self.n_layers)]
        return caches

    def cut(self, slot: int, pos: int) -> None:
        for cache in self.caches.get(slot, ()):
            if cache.offset > pos:
                cache.trim(cache.offset - pos)

    def clear_kv(self, slot: int) -> None:
        self.caches.pop(slot, None)

    def copy(self, src: int, dst: int, pos: int) -> None:
        """A copy of ``src``'s first ``pos`` tokens: slices of its arrays."""
        n = min(self.length(src), pos)
        if not n:
            self.caches[dst] = [kv_cells.new_cache(self.kv_bits) for _ in range(self.n_layers)]
            return
        self.caches[dst] = [kv_cells.from_arrays(self.kv_bits, kv_cells.arrays(c, n), n) for c in self.caches[src]]

    def keep_prefix(self, slot: int, pos: int) -> bool:
        if pos == 0:
            self.caches.pop(slot, None)
            return True
        self.cut(slot, pos)
        return self.length(slot) == pos

    def kv_used(self, touched: set[int] = frozenset()) -> int:
        """Every slot's cache length (cheap to read: ``touched`` is not needed)."""
        return sum(self.length(s) for s in self.caches)

    # ---- sampling and steps -----------------------------------------------------------------

    def new_sampler(self, lp: LanePlan) -> None:
        """A lane's sampler, with its constraint (if its sampling has one) moved past the tokens
        it generated before a restart (``lp.history`` from ``lp.replay_from`` on)."""
        constraint = None
        if lp.sampling.constrained:
            if self.constrainer is None:
                raise ValueError("a constrained lane reached an MLX runner built without a constrainer")
            generated = lp.history[lp.replay_from:] if lp.history and lp.replay_from is not None else ()
            constraint = self.constrainer.for_lane(lp.sampling, generated)
        self.samplers[lp.slot] = LaneSampler(lp.sampling, lp.history, constraint)

    def accepts(self, slot: int) -> bool:
        sampler = self.samplers.get(slot)
        return bool(sampler and sampler.sees_feed)

    def _head(self, h: mx.array) -> mx.array:
        """Logits from final hidden states (models in ``HIDDEN_STATE_MODELS``): the LM head, or the
        tied embedding read as a linear layer."""
        if getattr(self.model.args, "tie_word_embeddings", False) or not hasattr(self.model, "lm_head"):
            return self.model.model.embed_tokens.as_linear(h)
        return self.model.lm_head(h)

    # ---- model calls: ``emb`` (None: the tokens' own embeddings) is the input rows of a feed that
    # holds image placeholders (see _inputs); only then is mlx-lm's input_embeddings passed

    def _logits(self, tokens: mx.array, cache, emb: mx.array | None = None) -> mx.array:
        if emb is None:
            return self.model(tokens, cache=cache)
        return self.model(tokens, cache=cache, input_embeddings=emb)

    def _last_logits(self, tokens: mx.array, cache, emb: mx.array | None = None) -> mx.array:
        """Logits of each row's last position (the head runs on the last position only where the
        model's layout is known)."""
        if self._last_only:
            return self._head(self._hidden(tokens, cache, emb)[:, -1:, :])[:, -1, :]
        return self._logits(tokens, cache, emb)[:, -1, :]

    def _hidden(self, tokens: mx.array, cache, emb: mx.array | None = None) -> mx.array:
        """Final hidden states (after the final norm, before the head) of every position."""
        if not self._last_only:
            raise ValueError(f"embeddings need a model type in {sorted(HIDDEN_STATE_MODELS)}")
        if emb is None:
            return self.model.model(tokens, cache)
        return self.model.model(tokens, cache, input_embeddings=emb)

    def _inputs(self, w: Work, count: int) -> mx.array | None:
        """The input rows of a lane's next ``count`` fed tokens when they hold image placeholders
        (``count × hidden``): token embeddings, and at each placeholder the embedding row of the
        image span covering its position (encoded once per image, :class:`EncoderCache`); None
        for tokens only."""
        fed = w.feed[:count]
        if not w.media or min(fed) >= 0:
            return None
        if self.media is None:
            raise ValueError("a lane with images reached an MLX runner of a model without a vision half")
        embed = self.model.model.embed_tokens
        parts: list[mx.array] = []
        i = 0
        while i < count:
            image = fed[i] < 0
            j = i
            while j < count and (fed[j] < 0) == image:
                j += 1
            if image:
                parts.append(mx.array(self.media.row_block(w.media, w.pos + i, j - i)))
            else:
                parts.append(embed(mx.array(fed[i:j])))
            i = j
        if self._row_dtype is None:  # the token embeddings' (a quantized table's weight is packed)
            self._row_dtype = embed(mx.array([0])).dtype
        parts = [p.astype(self._row_dtype) for p in parts]
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def _chunk(self, w: Work, tokens: mx.array, caches, completes: bool, emb: mx.array | None = None) -> _Fed:
        """One prefilling lane's pass when something beyond the last row's logits is wanted:
        every row's logits for a scored prompt, the hidden states' sum for an embedding."""
        count = tokens.shape[1]
        if w.embed or self._last_only:
            h = self._hidden(tokens, caches, emb)
            hsum = h[0].astype(mx.float32).sum(axis=0) if w.embed else None
            rows = self._head(h)[0] if w.targets else None
            last = None
            if completes:
                last = rows[-1:] if rows is not None else self._head(h[:, -1:, :])[0]
            return _Fed(w, count, last, rows, hsum)
        logits = self._logits(tokens, caches, emb)[0]
        return _Fed(w, count, logits[-1:] if completes else None, logits, None)

    def advance(self, active: list[Work], plan: TickPlan, result: TickResult) -> bool:
        """One step (MLX cannot abort one): single-token lanes batched, then prefill chunks."""
        t0 = time.perf_counter()
        singles = [w for w in active if takes_one(w)]
        shares = prefill_shares(active, plan, self.step_tokens)
        if self.shared_pool:  # the pool's bound, kept as llama.cpp's full pool keeps it: nothing fed
            wanted = len(singles) + sum(count for _, count in shares)
            if self.kv_used() + wanted > self.kv_capacity:
                raise PoolFull(wanted)

        pending: list[_Fed] = []
        if singles:
            tokens = mx.array([[max(w.feed[0], 0)] for w in singles])
            rows = [self._inputs(w, 1) for w in singles]
            emb = None
            if any(r is not None for r in rows):  # an image row among them: every row as an embedding
                embed = self.model.model.embed_tokens
                emb = mx.stack([r if r is not None else embed(tokens[i]) for i, r in enumerate(rows)])
            if len(singles) == 1:
                cache = self._slot(singles[0].slot)
            else:
                cache = batch_views([self._slot(w.slot) for w in singles])
            if any(w.embed for w in singles):
                h = self._hidden(tokens, cache, emb)
                logits = self._head(h)[:, -1, :]
            else:
                h, logits = None, self._last_logits(tokens, cache, emb)
            for i, w in enumerate(singles):
                row = logits[i:i + 1]
                pending.append(_Fed(w, 1, row if w.sample and len(w.feed) == 1 else None,
                                    row if w.targets else None, h[i, -1].astype(mx.float32) if w.embed else None))
        for w, count in shares:
            caches = self._slot(w.slot)
            emb = self._inputs(w, count)
            tokens = mx.array([[max(t, 0) for t in w.feed[:count]] if emb is not None else w.feed[:count]])
            if emb is not None:
                emb = emb[None]
            completes = count == len(w.feed) and w.sample
            if w.embed or w.targets:
                pending.append(self._chunk(w, tokens, caches, completes, emb))
            elif completes:
                pending.append(_Fed(w, count, self._last_logits(tokens, caches, emb)))
            else:
                self._hidden(tokens, caches, emb) if self._last_only else self._logits(tokens, caches, emb)
                pending.append(_Fed(w, count))

        drawn: list[tuple[Work, mx.array]] = []  # plain lanes: tokens sampled in the step's graph
        shaped: list[tuple[Work, mx.array]] = []  # the others: rows to the host first
        scored: list[tuple[Work, list, mx.array]] = []
        outputs: list[mx.array] = []
        decode_tokens = 0
        n_fed = 0
        for f in pending:
            w, count = f.work, f.count
            fed = w.feed[:count]
            del w.feed[:count]
            start = w.pos
            w.pos += count
            n_fed += count
            w.result.n_fed += count
            if w.decoding:
                decode_tokens += 1
            else:
                w.result.n_prefill += count
            sampler = self.samplers.get(w.slot)
            if w.accept and sampler:
                sampler.accept_fed(fed, start, w.replay_from)
            for cache in self.caches[w.slot]:
                outputs += kv_cells.arrays(cache)
            targets = w.scored(count)
            if f.rows is not None and any(t is not None for t in targets):
                scored.append((w, targets, f.rows))
                outputs.append(f.rows)
            if f.hsum is not None:
                outputs.append(f.hsum)
            if f.last is not None and not w.feed:
                if sampler is None or sampler.plain:
                    token = sampler.sample(f.last) if sampler else mx.argmax(f.last, axis=-1)
                    drawn.append((w, token))
                    outputs.append(token)
                else:
                    shaped.append((w, f.last))
                    outputs.append(f.last)
        mx.eval(outputs)
        for w, targets, rows in scored:
            _score(w, targets, np.array(rows.astype(mx.float32)))
        for f in pending:
            if f.hsum is not None:
                f.work.add_pooled(np.array(f.hsum), f.count)
        got = [(w, int(token.item()), None) for w, token in drawn] + self._sample_on_host(shaped)
        for w, tok, logprob in got:
            sampler = self.samplers.get(w.slot)
            if sampler:
                sampler.accept([tok])
            w.sampled(tok, tok in self.eog, logprob)
        result.steps.append(StepTiming(prefill_tokens=n_fed - decode_tokens, decode_tokens=decode_tokens,
                                       seconds=time.perf_counter() - t0))
        return True

    def _sample_on_host(self, shaped: list[tuple[Work, mx.array]]) -> list[tuple[Work, int, TokenLogprob | None]]:
        """Lanes whose rows are read outside the sampler: logprobs from the raw row, then the
        sampler draws from the biased, masked row (core.logits' order)."""
        if not shaped:
            return []
        raws, draws = [], []
        for w, last in shaped:
            raw = np.array(last.astype(mx.float32))[0]
            sampler = self.samplers[w.slot]
            raws.append(raw)
            draws.append(sampler.sample(mx.array(sampler.shape(raw)[None, :])))
        mx.eval(draws)
        out = []
        for (w, _), raw, token in zip(shaped, raws, draws):
            tok = int(token.item())
            top = self.samplers[w.slot].params.logprobs
            out.append((w, tok, token_logprob(raw, tok, top) if top is not None else None))
        return out


class _Fed:
    """What one lane's share of a step computed: the row to sample from (None: it samples
    nothing this step), every fed position's logits (a scored prompt) and the sum of the fed
    positions' hidden states (an embedding lane)."""

    __slots__ = ("work", "count", "last", "rows", "hsum")

    def __init__(self, work: Work, count: int, last: mx.array | None = None, rows: mx.array | None = None,
                 hsum: mx.array | None = None):
        self.work, self.count, self.last, self.rows, self.hsum = work, count, last, rows, hsum


def _score(w: Work, targets: list[int | None], rows: np.ndarray) -> None:
    """Each fed position's target token's logprob (None: the feed ends the prompt there)."""
    for i, target in enumerate(targets):
        if target is not None and target >= 0:  # never a placeholder (images are not scored)
            w.result.prompt_logprobs.append(token_logprob(rows[i], target, w.score_top))
