"""Runs ticks on a basert model: core's shared tick (:class:`~superfluid.core.tick_runner.TickRunner`)
over a paged KV pool.

One step is one forward pass over every lane with feed left: each decoding lane's last token
(with its drafted tokens, when it speculates), then prefill chunks up to the step's token budget,
all in one flat batch of tokens. A prompt's image rows (negative placeholder ids in the feed,
core/media.py) go in that batch too: the vision tower encodes each image once (``self.media``, an
:class:`~superfluid.core.media.EncoderCache`), and the image's rows replace the token embeddings
at those positions (``Transformer.forward``'s ``rows``). The pool (:mod:`.kv_pool`) gives every row its pages and the
attention reads them back; the head runs only on the rows something needs (the last row of a
lane that samples, every row of a lane that verifies a draft or scores its prompt). Rows are
then sampled together (:mod:`.sampler`: argmax on the device; a lone sampled lane on the host,
two or more on the device) and the tokens cross to the host once per step.

Slots map onto the pool's block tables (:mod:`.slots`: copies share full pages, parking keeps a
slot's pages in the pool), and a step the pool cannot hold raises
:class:`~superfluid.core.tick_runner.PoolFull` before anything of it is computed."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from superfluid.core import tick_runner
from superfluid.core.constrain import Constrainer
from superfluid.core.logits import token_logprob
from superfluid.core.media import Image
from superfluid.core.media_encoding import encoder_cache
from superfluid.core.stop_flag import StopFlag
from superfluid.core.tick import LanePlan, StepTiming, TickPlan, TickResult, TokenLogprob
from superfluid.core.tick_runner import PoolFull, Work, prefill_shares, takes_one

from .decode_graph import DecodeGraphs
from .kv_pool import PagedKV
from .lora import LoraSteps
from .rank import keep_pooled, pooled_rows
from .sampler import LaneSampler, sample_rows
from .slots import PagedSlots
from .speculate import Gate, propose, verify

Pick = tuple[int, TokenLogprob | None]  # a sampled token and its logprob entry (None unless asked)

PREFILL_STEP = 512  # prompt tokens per step at most (the plan's step_tokens may cut it further)


class _Row:
    """One lane's share of a step: ``count`` of its feed, then ``draft`` (tokens proposed for it
    to verify), starting at ``offset`` in the step's flat batch."""

    __slots__ = ("work", "count", "draft", "offset", "start")

    def __init__(self, work: Work, count: int, draft: list[int] | None = None):
        self.work = work
        self.count = count
        self.draft = draft or []
        self.offset = 0
        self.start = work.pos

    @property
    def width(self) -> int:
        return self.count + len(self.draft)

    @property
    def samples(self) -> bool:
        """The feed completes in this row and the lane samples after it."""
        w = self.work
        return w.sample and self.count == len(w.feed)

    def logit_rows(self) -> range:
        """The positions of this row (relative to ``offset``) whose logits the step needs."""
        w = self.work
        if self.draft:
            return range(self.width)
        if w.targets:
            return range(self.count)
        if self.samples:
            return range(self.count - 1, self.count)
        return range(0)


class BasertRunner(LoraSteps, PagedSlots, tick_runner.TickRunner):
    """basert's primitives (see :class:`superfluid.core.tick_runner.TickRunner`)."""

    def __init__(self, model, pool: PagedKV, eog: set[int], stop_flag: StopFlag, *, device: torch.device,
                 speculate: int = 0, constrainer: Constrainer | None = None, step_tokens: int = PREFILL_STEP,
                 decoder: DecodeGraphs | None = None, encoder: Callable[[Image], np.ndarray] | None = None,
                 image_encoding: str | None = None):
        """``encoder``: an image to its embedding rows (:func:`.vision.encoder`), run on a background
        thread (``image_encoding`` "tick": on the tick); without one, placeholders are an error."""
        super().__init__(stop_flag, pool.n_blocks * pool.block_size)
        if encoder is not None:
            self.media = encoder_cache(encoder, image_encoding)
        self.model = model
        self.rank_head = None  # a reranker's classification head (rank.py), set by the engine
        self.pool = pool
        self.decoder = decoder  # decode-only steps: FlexAttention on the pages, CUDA graphs
        self.eog = eog
        self.device = device
        self.constrainer = constrainer
        self.step_tokens = step_tokens
        self.gate = Gate(speculate) if speculate else None
        self.samplers: dict[int, LaneSampler]
        self.parked: dict[str, object]

    # ---- sampling ---------------------------------------------------------------------------

    def new_sampler(self, lp: LanePlan) -> None:
        """A lane's sampler, its constraint (if any) moved past the tokens it generated before it
        was resumed (``lp.history`` from ``lp.replay_from`` on)."""
        constraint = None
        if lp.sampling.constrained:
            if self.constrainer is None:
                raise ValueError("a constrained lane reached a basert runner built without a constrainer")
            generated = lp.history[lp.replay_from:] if lp.history and lp.replay_from is not None else ()
            constraint = self.constrainer.for_lane(lp.sampling, generated)
        sampler = self.samplers[lp.slot] = LaneSampler(lp.sampling, history=lp.history, constraint=constraint)
        if lp.replay_from is not None and lp.sample:  # a seeded lane resumes its own sequence of draws
            sampler.advance(lp.pos + len(lp.feed) - lp.replay_from)
        if self.gate:
            self.gate.forget(lp.slot)

    def accepts(self, slot: int) -> bool:
        sampler = self.samplers.get(slot)
        return bool(sampler and sampler.sees_feed)

    def _draft(self, w: Work, n_decoding: int) -> list[int]:
        """Prompt-lookup drafts for a lane that decodes (:mod:`.speculate`)."""
        if self.gate is None or not w.decoding or not w.sample or w.embed or w.targets:
            return []
        sampler = self.samplers.get(w.slot)
        if sampler is None:
            return []
        left = w.max_new - len(w.result.tokens) - 1  # the step always adds the model's own next token
        k = min(self.gate.draft_len(w.slot, n_decoding), left)
        if k <= 0:
            return []
        draft = propose(self.pool.tokens(w.slot) + w.feed, k)
        # the history holds an image's placeholders: a draft never proposes one (no token is
        # negative, and there is no image row to feed for it), so it ends before the first
        for i, token in enumerate(draft):
            if token < 0:
                return draft[:i]
        return draft

    # ---- the step ---------------------------------------------------------------------------

    def _rows(self, active: list[Work], plan: TickPlan) -> list[_Row]:
        singles = [w for w in active if takes_one(w)]
        rows = [_Row(w, 1, self._draft(w, len(singles))) for w in singles]
        rows += [_Row(w, count) for w, count in prefill_shares(active, plan, self.step_tokens)]
        offset = 0
        for row in rows:
            row.offset = offset
            offset += row.width
        return rows

    def advance(self, active: list[Work], plan: TickPlan, result: TickResult) -> bool:
        """One forward pass over every row, then every row's sampling in one go."""
        t0 = time.perf_counter()
        rows = self._rows(active, plan)
        spans = [(r.work.slot, r.start, r.width) for r in rows]
        if not self.pool.reserve(spans):
            raise PoolFull(sum(r.width for r in rows))
        fed_tokens = [r.work.feed[:r.count] + r.draft for r in rows]
        flat = [t for toks in fed_tokens for t in toks]
        positions = [p for r in rows for p in range(r.start, r.start + r.width)]
        hidden = self._forward(rows, spans, flat, positions, self._image_rows(rows, fed_tokens))

        wanted = [r.offset + i for r in rows for i in r.logit_rows()]
        logits = self.model.logits(hidden[wanted]) if wanted else None
        at = 0
        row_logits: dict[int, torch.Tensor] = {}
        for i, r in enumerate(rows):
            n = len(r.logit_rows())
            if n:
                row_logits[i] = logits[at:at + n]
                at += n
        pooled = pooled_rows(rows, hidden, self.rank_head)  # embedding sums, rank lanes' scores (rank.py)

        picks, drawn = self._sample(rows, row_logits)
        decode_tokens = prefill_tokens = drafted = accepted = 0
        for i, r in enumerate(rows):
            w = r.work
            if r.draft:
                emitted = verify(r.draft, [token for token, _ in picks[i]])
                n_acc = len(emitted) - 1
                drafted += len(r.draft)
                accepted += n_acc
                self.gate.record(w.slot, len(r.draft), n_acc)
                decode_tokens += 1  # one decode round for the cost model, however many tokens it gave
                self._emit(w, r, picks[i][:len(emitted)])
                continue
            fed = fed_tokens[i]
            start = w.pos
            del w.feed[:r.count]
            w.pos += r.count
            w.result.n_fed += r.count
            if w.decoding:
                decode_tokens += r.count
            else:
                w.result.n_prefill += r.count
                prefill_tokens += r.count
            self.pool.note_tokens(w.slot, start, fed)
            sampler = self.samplers.get(w.slot)
            if w.accept and sampler:
                if w.media:
                    self._accept_fed(sampler, fed, start, w.replay_from)
                else:
                    sampler.accept_fed(fed, start, w.replay_from)
            targets = w.scored(r.count)
            if any(t is not None for t in targets):
                host = row_logits[i].float().cpu().numpy()
                for j, target in enumerate(targets):
                    if target is not None:
                        w.result.prompt_logprobs.append(token_logprob(host[j], target, w.score_top))
            keep_pooled(w, pooled.get(i), r.count)
            if i in drawn:
                token, logprob = drawn[i]
                if sampler:
                    sampler.accept([token])
                w.sampled(token, token in self.eog, logprob)
        result.steps.append(StepTiming(prefill_tokens=prefill_tokens, decode_tokens=decode_tokens,
                                       seconds=time.perf_counter() - t0, drafted=drafted, accepted=accepted))
        return True

    def _sample(self, rows: list[_Row], row_logits: dict[int, torch.Tensor]
                ) -> tuple[dict[int, list[Pick]], dict[int, Pick]]:
        """Every row's picks in one call (one transfer): for a row that verifies a draft, what its
        lane's sampling picks after each position, as it would have picked there without
        speculation (:meth:`.sampler.LaneSampler.verify_rows`); for a row that samples, its one
        pick. A pick is a token and its logprob entry (None unless the lane asked)."""
        to_sample = [i for i, r in enumerate(rows) if r.samples and not r.draft]  # (an embedding lane samples nothing)
        verify_rows = [i for i, r in enumerate(rows) if r.draft]
        if not to_sample and not verify_rows:
            return {}, {}
        parts = [row_logits[i][-1:] for i in to_sample] + [row_logits[i] for i in verify_rows]
        samplers = [self.samplers.get(rows[i].work.slot) for i in to_sample]
        for i in verify_rows:
            samplers += self.samplers[rows[i].work.slot].verify_rows(rows[i].draft)
        got = sample_rows(torch.cat(parts), samplers)
        drawn = dict(zip(to_sample, got))
        picks, at = {}, len(to_sample)
        for i in verify_rows:
            picks[i] = got[at:at + rows[i].width]
            at += rows[i].width
        return picks, drawn

    @staticmethod
    def _accept_fed(sampler: LaneSampler, fed: list[int], start: int, replay_from: int | None) -> None:
        """Hand fed tokens to a sampler that sees the feed, leaving out image placeholders (a
        penalty or a grammar counts tokens, and no image row is one); each run of real tokens
        keeps its own positions."""
        i = 0
        while i < len(fed):
            if fed[i] < 0:
                i += 1
                continue
            j = i
            while j < len(fed) and fed[j] >= 0:
                j += 1
            sampler.accept_fed(fed[i:j], start + i, replay_from)
            i = j

    def _image_rows(self, rows: list[_Row], fed_tokens: list[list[int]]
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat indices, embedding rows) of the step's image placeholders, None if it has none:
        each run of placeholders in a row's feed takes the rows of the images that cover its
        prompt positions (``Work.media``), encoded once per image by ``self.media``."""
        index: list[int] = []
        blocks: list[np.ndarray] = []
        for r, toks in zip(rows, fed_tokens):
            if not r.work.media:  # no image in this feed (core sets media wherever it holds one)
                continue
            i = 0
            while i < r.count:
                if toks[i] >= 0:
                    i += 1
                    continue
                j = i
                while j < r.count and toks[j] < 0:
                    j += 1
                if self.media is None:
                    raise ValueError(f"slot {r.work.slot}: an image placeholder reached a basert model without "
                                     "a vision half")
                blocks.append(self.media.row_block(r.work.media, r.start + i, j - i))
                index.extend(range(r.offset + i, r.offset + j))
                i = j
        if not index:
            return None
        values = torch.from_numpy(np.concatenate(blocks) if len(blocks) > 1 else blocks[0])
        return (torch.tensor(index, dtype=torch.long, device=self.device),
                values.to(device=self.device, dtype=self.model.dtype))

    def _forward(self, rows: list[_Row], spans, flat: list[int], positions: list[int],
                 image_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's final hidden states: a decode-only step (one token per row) that fits the
        decoder's buckets and holds no image row goes through it; any other through the gather
        path's ``StepView``, image rows in place of their placeholders' embeddings."""
        decoder = None if self.lora_step(rows) else self.decoder  # (no captured graph holds an adapter)
        if (decoder is not None and image_rows is None and rows and len(rows) <= decoder.max_rows
                and all(r.width == 1 for r in rows)):
            hidden = decoder.hidden(flat, positions, self.pool.step_tables(spans))
            self.pool.step_done(spans)
            return hidden
        if image_rows is not None:
            flat = [max(t, 0) for t in flat]  # placeholders' embeddings are replaced: any valid id
        tokens_t = torch.tensor(flat, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        return self.model(tokens_t, pos_t, self.pool.begin_step(spans), rows=image_rows)

    def _emit(self, w: Work, r: _Row, emitted: list[Pick]) -> None:
        """A verified row: the lane takes the emitted tokens (the accepted drafts, then the pick
        after them) with their logprob entries until it ends; its KV keeps its last token and the
        drafts it went past, the rejected rest is cut."""
        start = w.pos
        last = w.feed[0]
        w.feed = []
        sampler = self.samplers.get(w.slot)
        taken = 0
        for token, logprob in emitted:
            taken += 1
            if sampler:
                sampler.accept([token])
            w.sampled(token, token in self.eog, logprob)
            if not w.feed:  # it ended (end of generation or its grant)
                break
            if taken < len(emitted):
                w.feed = []
        if sampler:
            sampler.advance(taken)  # a sampled lane's draws: one per token it took (peek left them)
        kept = taken  # the last token plus the taken tokens but the final one, all in the KV
        self.pool.truncate(w.slot, start + kept)
        self.pool.note_tokens(w.slot, start, [last] + [token for token, _ in emitted[:kept - 1]])
        w.pos = start + kept
        w.result.n_fed += kept
