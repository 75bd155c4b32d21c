"""Runs ticks on a llama.cpp context (inside the worker process).

One tick is a loop of engine steps. Each step is one ``llama_decode`` of at most ``n_ubatch``
tokens holding one token for every decoding lane plus prefill chunks, so prefill and decode of
all lanes share forward passes. Between steps the shared stop flag is read: a cancelled lane or
urgent newcomer ends the tick at the next step, and the prefill it did not reach is planned again.
Steps where every lane feeds back its last token run in C (``_rounds.c``), many to a call.

The tick itself (prelude, seeding, stop and quiet rules, result) is core's
:class:`~superfluid.core.tick_runner.TickRunner`; this module holds llama.cpp's primitives.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

import llama_cpp

from superfluid.core import tick_runner
from superfluid.core.logits import LaneRow, token_logprob
from superfluid.core.media import leading_tokens
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import LanePlan, StepTiming, TickPlan, TickResult
from superfluid.core.tick_runner import PoolFull, Work, takes_one

from . import native
from .buffers import LogitRows, host_buffer
from .hidden import HiddenStates
from .image_steps import ImageSteps
from .kv_positions import KvPositions
from .lora import LoraAdapters, LoraTicks
from .sampling import build_sampler, free_sampler


def _slot(w: Work) -> int:
    return w.slot


class LlamaCppRunner(LoraTicks, ImageSteps, KvPositions, tick_runner.TickRunner):
    """The llama.cpp engine's primitives (see :class:`superfluid.core.tick_runner.TickRunner`)."""

    def __init__(self, model, ctx, n_seq: int, n_ubatch: int, stop_flag: StopFlag, kv_capacity: int, *,
                 unified: bool = False, n_swa: int = 0, recurrent: bool = False, native_rounds: bool = True,
                 pooling: str = "mean"):
        super().__init__(stop_flag, kv_capacity)
        self.model = model
        self.ctx = ctx
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.mem = llama_cpp.llama_get_memory(ctx)
        self.n_seq = n_seq
        self.n_ubatch = n_ubatch
        self.unified = unified      # one pool for all sequences: a copy shares cells instead of buffers
        self.n_swa = n_swa          # sliding window: cells older than it may be gone
        self.recurrent = recurrent  # a recurrent state cannot be cut back
        self.batch = llama_cpp.llama_batch_init(n_ubatch, 0, 1)
        self.penalized: set[int] = set()
        self.greedy: set[int] = set()  # argmax lanes (no penalties): sampled with numpy, no chain
        # lanes whose logits row is worked on around the sampler (bias, constraint, logprobs)
        self.rows: dict[int, LaneRow] = {}
        self._constrainer = None  # built on the first constrained lane (about 0.25 s)
        self.parked: dict[str, ctypes.Array]  # park key -> a sequence's KV state, in host memory
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.logits = LogitRows(self.n_vocab)
        # asked for every sampled token; the answer per token never changes
        self.is_eog = functools.cache(lambda token: bool(llama_cpp.llama_vocab_is_eog(self.vocab, token)))
        # slot -> cells it holds (a new context holds none), re-read only for slots a tick touched
        self.used: dict[int, int] = dict.fromkeys(range(n_seq), 0)
        # steps where every lane feeds back its last token run in C when the extension is built
        lib = native.load() if native_rounds else None
        self.rounds = native.DecodeRounds(lib, ctx, self.vocab, self.batch, self.n_vocab, stop_flag) if lib else None
        self.hidden = HiddenStates(ctx, llama_cpp.llama_model_n_embd(model), pooling)
        self.lora = LoraAdapters(model, ctx)  # the tick's LoRA adapter set (lora.py)

    def close(self) -> None:
        for chain in self.samplers.values():
            free_sampler(chain)
        self.samplers.clear()
        llama_cpp.llama_batch_free(self.batch)
        self.free_images()

    # ---- slots ---------------------------------------------------------------------------

    def clear_kv(self, slot: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, slot, -1, -1)

    def drop_sampler(self, slot: int) -> None:
        free_sampler(self.samplers.pop(slot, None))
        self.penalized.discard(slot)
        self.greedy.discard(slot)
        self.rows.pop(slot, None)

    # ---- parked KV -------------------------------------------------------------------------

    def park(self, slot: int, key: str) -> int:
        """Copy a sequence's KV to host memory; the bytes held (0 if it could not)."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, slot)
        if size <= 0:
            return 0
        buf = host_buffer(size)
        n = llama_cpp.llama_state_seq_get_data(self.ctx, buf, size, slot)
        if n <= 0:
            return 0
        if n < size:  # a reused mapping holds an older state's bytes: the tail reads as zeros, as a fresh one's
            ctypes.memset(ctypes.addressof(buf) + n, 0, size - n)
        self.parked[key] = buf
        return n

    def load(self, path: str, key: str) -> int:
        """Read a park artifact into host memory; its size (0 if unreadable). A corrupt or foreign
        file is caught when it is restored: llama.cpp checks the state's layout then."""
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size <= 0:
                    return 0
                buf = host_buffer(size)
                if f.readinto(buf) != size:  # truncated while reading
                    return 0
        except OSError:
            return 0
        self.parked[key] = buf
        return size

    def save_writer(self, key: str):
        """Parked KV is a host buffer nothing writes into again (a park makes a new one), so the
        writer thread can write it as it is, even after the key is dropped."""
        buf = self.parked.get(key)
        if buf is None:
            return None
        return lambda f: f.write(memoryview(buf))

    def parked_bytes(self) -> int:
        return sum(len(b) for b in self.parked.values())

    def restore(self, slot: int, entry: ctypes.Array) -> bool:
        return llama_cpp.llama_state_seq_set_data(self.ctx, entry, len(entry), slot) > 0

    # ---- sampling --------------------------------------------------------------------------

    def new_sampler(self, lp: LanePlan) -> None:
        params = lp.sampling
        chain = self.samplers[lp.slot] = build_sampler(params, self.vocab)
        if params.uses_penalties:
            self.penalized.add(lp.slot)
        elif params.greedy:
            self.greedy.add(lp.slot)
        if not params.plain:
            generated = lp.history[lp.replay_from:] if lp.history and lp.replay_from is not None else ()
            constraint = self.constrainer().for_lane(params, generated) if params.constrained else None
            self.rows[lp.slot] = LaneRow(params, constraint)
        # A fresh sampler catches up on the tokens already in the KV: penalties see them all (a
        # constraint, above, only the generated ones: from ``replay_from``, the prompt's end).
        if lp.slot in self.penalized:
            for token in lp.history or ():
                llama_cpp.llama_sampler_accept(chain, token)

    def constrainer(self):
        """Token masks for this vocabulary (llguidance), built once per worker."""
        if self._constrainer is None:
            from .constraints import constrainer

            self._constrainer = constrainer(self.vocab, self.n_vocab)
        return self._constrainer

    def accepts(self, slot: int) -> bool:
        row = self.rows.get(slot)
        return slot in self.penalized or (row is not None and row.constrained)

    def _accept(self, slot: int, chain, token: int, pos: int, generated_from: int | None) -> None:
        """Feed a token already in the KV (at ``pos``) to a fresh sampler: a chain with penalties
        takes every token; a constraint only generated ones (``pos`` at or past
        ``generated_from``, the prompt's length; None: nothing generated yet)."""
        if slot in self.penalized:
            llama_cpp.llama_sampler_accept(chain, token)
        row = self.rows.get(slot)
        if row is not None and generated_from is not None and pos >= generated_from:
            row.accept(token)

    def _sample(self, slot: int, chain, index: int):
        """(token, its TokenLogprob or None). Greedy lanes take the argmax of the logits directly
        (the first maximum, as llama.cpp's greedy sampler does) instead of building a candidate
        array for the whole vocabulary. A lane with a bias, a constraint or logprobs has its row
        worked on first, in place (llama.cpp's sampler reads the same buffer)."""
        row = self.rows.get(slot)
        if row is None:
            if slot in self.greedy:
                return int(self.logits.row(self.ctx, index).argmax()), None
            return llama_cpp.llama_sampler_sample(chain, self.ctx, index), None
        logits = self.logits.row(self.ctx, index)
        row.before(logits)
        if slot in self.greedy:
            token = int(logits.argmax())
        else:
            token = llama_cpp.llama_sampler_sample(chain, self.ctx, index)
        return token, row.after(token)

    # ---- steps -----------------------------------------------------------------------------

    def advance(self, active: list[Work], plan: TickPlan, result: TickResult) -> bool:
        """Decode rounds in C while every lane feeds back its last token (each feeds one), else
        one step in Python."""
        if self.rounds is not None and all(w.decoding and w.slot not in self.rows for w in active):
            return self._decode_rounds(active, plan.quiet, result.steps)
        if self.media is not None:
            images = [w for w in active if w.feed and w.feed[0] < 0]
            if self.image_step_now(images, len(images) < len(active)):
                return self._image_step(images, plan.step_tokens, result.steps)
        return self._step(active, plan.step_tokens, result.steps)

    def _step(self, active: list[Work], limit: int, steps: list[StepTiming]) -> bool:
        """One forward pass: a token for each decoding lane first, then prefill up to ``limit``.
        Appends its timing; False if the stop flag aborted it."""
        batch = self.batch
        singles = sum(takes_one(w) for w in active)
        room = max(self.n_ubatch - singles, 0)
        if limit > 0:  # the limit bounds prefill; every decoding lane still gets its token
            room = min(room, limit)
        room += singles
        taken: list[tuple[Work, int, int]] = []  # (work, first batch index, count)
        n = 0
        decode_tokens = 0
        # Who gets room: decoding lanes first, then prefill in the planner's order ...
        shares: list[tuple[Work, int]] = []
        for w in sorted(active, key=lambda w: not takes_one(w)):
            if room <= 0:
                break
            count = min(len(w.feed), room)
            if w.media:  # token rows only: an image's rows go in a step of their own (_image_step)
                count = min(count, leading_tokens(w.feed))
            if w.replay_from is not None:  # replayed tokens go one per step, as decoding fed them
                count = 1 if w.pos >= w.replay_from else min(count, w.replay_from - w.pos)
            shares.append((w, count))
            room -= count
        # ... but the batch itself goes in sequence order: with per-sequence KV buffers an
        # unsorted batch is split into several forward passes (measured: 73 ms vs 40 ms a step).
        shares.sort(key=lambda share: share[0].slot)
        scores: list[tuple[Work, int, list]] = []  # (work, first batch index, targets)
        for w, count in shares:
            last = count == len(w.feed) and w.sample
            at = self.at(w.slot, w.pos)  # (a text run never holds an image: one position a token)
            for i in range(count):
                batch.token[n + i] = w.feed[i]
                batch.pos[n + i] = at + i
                batch.n_seq_id[n + i] = 1
                batch.seq_id[n + i][0] = w.slot
                batch.logits[n + i] = w.embed and not w.rank  # an embedding lane needs every token's hidden state
            if last or (w.rank and count == len(w.feed) and w.ends_prompt):  # a rank lane its last one's (hidden.py)
                batch.logits[n + count - 1] = True
            targets = w.scored(count)
            if targets:
                for i, target in enumerate(targets):
                    if target is not None:
                        batch.logits[n + i] = True
                scores.append((w, n, targets))
            taken.append((w, n, count))
            if w.decoding:
                decode_tokens += 1
            n += count
        batch.n_tokens = n
        embedding = any(w.embed for w, _, _ in taken)
        t0 = time.perf_counter()
        if embedding:
            llama_cpp.llama_set_embeddings(self.ctx, True)
        try:
            if not self._decode(n):
                return False
        finally:
            if embedding:
                llama_cpp.llama_set_embeddings(self.ctx, False)
        for w, first, targets in scores:
            for i, target in enumerate(targets):
                if target is not None:
                    w.result.prompt_logprobs.append(
                        token_logprob(self.logits.row(self.ctx, first + i), target, w.score_top))
        for w, first, count in taken:
            if w.embed:
                self.hidden.pool(w, first, count)
            fed = w.feed[:count]
            del w.feed[:count]
            start = w.pos
            w.pos += count
            w.result.n_fed += count
            if not w.decoding:
                w.result.n_prefill += count
            smpl = self.samplers.get(w.slot)
            if w.accept and smpl:
                for i, t in enumerate(fed):
                    self._accept(w.slot, smpl, t, start + i, w.replay_from)
            if w.feed or not w.sample:
                continue
            token, logprob = self._sample(w.slot, smpl, first + count - 1)
            w.sampled(token, self.is_eog(token), logprob)
        seconds = time.perf_counter() - t0
        steps.append(StepTiming(prefill_tokens=n - decode_tokens, decode_tokens=decode_tokens, seconds=seconds))
        return True

    def _decode_rounds(self, active: list[Work], quiet: bool, steps: list[StepTiming]) -> bool:
        """The steady state, where every lane feeds back the one token it sampled last: as many
        decode steps as the lanes' grants allow, in one call into C (``_rounds.c``), until every
        lane has ended, the stop or yield flag is raised, or (in a quiet tick) a lane ends. The
        batches and tokens are those :meth:`_step` would make. Appends a timing per step; False if
        the stop flag aborted one."""
        lanes = sorted(active, key=_slot)
        got = self.rounds.run(
            [w.slot for w in lanes], [self.at(w.slot, w.pos) for w in lanes], [w.feed[0] for w in lanes],
            [None if w.slot in self.greedy else self.samplers.get(w.slot) for w in lanes],
            [w.max_new - len(w.result.tokens) for w in lanes], [w.ignore_eos for w in lanes], quiet)
        for w, tokens, ended in zip(lanes, got.tokens, got.ended):
            w.pos += len(tokens)
            w.result.n_fed += len(tokens)
            w.result.tokens.extend(tokens)
            if ended:
                w.result.eog = ended == 1
                w.feed = []
            elif tokens:
                w.feed = [tokens[-1]]
        steps.extend(StepTiming(prefill_tokens=0, decode_tokens=n, seconds=s)
                     for n, s in zip(got.round_lanes, got.round_seconds))
        if got.rc:
            return self._decode_failed(got.rc, sum(1 for w in lanes if w.feed))
        return True

    def _decode(self, n: int) -> bool:
        """``llama_decode`` the batch's ``n`` tokens; False if the stop flag aborted it (llama.cpp
        kept nothing of it)."""
        rc = llama_cpp.llama_decode(self.ctx, self.batch)
        return rc == 0 or self._decode_failed(rc, n)

    def _decode_failed(self, rc: int, n: int) -> bool:
        """A non-zero ``llama_decode`` code for a batch of ``n`` tokens: False if the stop flag
        aborted it, else the error (no KV room for it: PoolFull)."""
        if rc == 2 and self.stop_flag.abort_requested():
            return False
        if rc == 1:  # no KV slot for the batch: llama.cpp kept nothing of it
            raise PoolFull(n)
        raise RuntimeError(f"llama_decode failed ({rc}) on a batch of {n} tokens")
