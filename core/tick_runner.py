"""The tick as every engine runs it, in its worker process or on the model's thread: the plan's
prelude, seeding reset slots, the work list, the step loop with its stop, first-token and quiet
rules, and the result.

An engine subclasses :class:`TickRunner` and implements its primitives (its KV, its samplers
and its steps, and its parked copies if it declares parking); nothing here knows an engine."""

from __future__ import annotations

import abc
import time
from typing import Any, BinaryIO, Callable

import numpy as np

from . import media_encoding
from .artifact_writer import ArtifactWriter, write_atomically  # noqa: F401 (engines import it from here)
from .stop_flag import StopFlag
from .tick import LanePlan, LaneResult, TickPlan, TickResult


class PoolFull(Exception):
    """The KV pool has no room for a step's ``n_tokens`` (a pool shared by all lanes): nothing of
    the step was kept. The tick ends there with ``TickResult.rejected_tokens`` set."""

    def __init__(self, n_tokens: int):
        super().__init__(n_tokens)
        self.n_tokens = n_tokens


class Work:
    """A lane's remaining work within one tick.

    ``feed`` is what is left to append to the slot's KV at ``pos``; a step that feeds ``count``
    of it removes them, moves ``pos`` on and counts them in ``result.n_fed`` (and, unless the
    lane is ``decoding``, in ``result.n_prefill``); a lane with ``accept`` set hands them to its
    sampler. When a step empties the feed of a lane that ``sample``s, the engine samples after it
    and calls :meth:`sampled`. A lane is done when its feed is empty."""

    __slots__ = ("slot", "feed", "sample", "max_new", "ignore_eos", "accept", "result", "pos", "decoding",
                 "was_decoding", "replay_from", "targets", "score_top", "embed", "rank", "ends_prompt",
                 "media", "held")

    def __init__(self, lp: LanePlan, accept: bool):
        self.slot = lp.slot
        self.feed = list(lp.feed)
        self.sample = lp.sample
        self.max_new = lp.max_new
        self.ignore_eos = lp.ignore_eos
        self.accept = accept  # fed tokens go to the sampler (a fresh penalty or grammar sampler)
        self.pos = lp.pos
        self.decoding = lp.decode      # feeds back its own last sampled token
        self.was_decoding = lp.decode  # decoding when the tick began (it sampled no first token in it)
        self.replay_from = lp.replay_from
        self.targets = list(lp.targets) if lp.targets is not None else None
        self.score_top = lp.score_top
        self.embed = lp.embed
        self.rank = lp.rank  # (with embed) a reranker's lane: its head's scores, not hidden states
        self.media = lp.media  # the images whose rows the feed holds (its negative tokens)
        # how many of the feed's tokens may go before an image still encoding (None: all of them;
        # set before each step by media_encoding.runnable, which keeps a lane held at 0 waiting)
        self.held: int | None = None
        self.ends_prompt = lp.sample  # the feed reaches the end of the lane's tokens
        if lp.embed:
            self.sample = False
        self.result = LaneResult(slot=lp.slot)

    def scored(self, count: int) -> list[int | None]:
        """The targets of the next ``count`` fed tokens (None where the feed ends the prompt),
        taken off the list; [] for a lane that scores nothing."""
        if self.targets is None:
            return []
        got = self.targets[:count]
        del self.targets[:count]
        return got + [None] * (count - len(got))

    def add_pooled(self, hsum, count: int) -> None:
        """Add the sum of ``count`` fed tokens' final hidden states (a float vector) to an
        embedding lane's result, in float64 across steps."""
        r = self.result
        total = np.asarray(hsum, dtype=np.float64)
        if r.embedding_sum is not None:
            total = total + np.asarray(r.embedding_sum)
        r.embedding_sum = total.tolist()
        r.pooled += count

    def sampled(self, token: int, eog: bool, logprob=None) -> None:
        """Take a token sampled after the lane's feed (``eog``: it ends a generation; ``logprob``:
        its :class:`~superfluid.core.tick.TokenLogprob`, if the lane asks for them). The lane
        ends at an end-of-generation token unless ``ignore_eos``, or when ``max_new`` tokens are
        sampled; else the token is its next feed."""
        self.result.tokens.append(token)
        if logprob is not None:
            self.result.logprobs.append(logprob)
        self.accept = False  # tokens it sampled itself are already accepted
        self.decoding = True
        if eog and not self.ignore_eos:
            self.result.eog = True
        elif len(self.result.tokens) < self.max_new:
            self.feed = [token]


def takes_one(w: Work) -> bool:
    """Feeds exactly one token this step: a decoding lane, or a lane replaying its generation."""
    return len(w.feed) == 1 or (w.replay_from is not None and w.pos >= w.replay_from)


def prefill_shares(active: list[Work], plan: TickPlan, step_tokens: int) -> list[tuple[Work, int]]:
    """How many tokens each lane that prefills (does not :func:`takes_one`) feeds in this step, in
    the plan's order, within the step's budget (the engine's ``step_tokens``, or the plan's if
    smaller). A lane replaying its generation feeds only up to where the replay starts: replayed
    tokens go one per step, as decoding fed them."""
    room = step_tokens if plan.step_tokens <= 0 else min(step_tokens, plan.step_tokens)
    shares: list[tuple[Work, int]] = []
    for w in active:
        if takes_one(w):
            continue
        if room <= 0:
            break
        count = min(len(w.feed), room)
        if w.replay_from is not None:
            count = min(count, w.replay_from - w.pos)
        if w.held is not None:  # its feed reaches an image still encoding: what comes before it
            count = min(count, w.held)
        if count <= 0:
            continue
        shares.append((w, count))
        room -= count
    return shares


SAVE_COLLECT_WAIT_S = 0.05  # a tick with no lanes waits this long for a write to finish


class TickRunner(abc.ABC):
    """Runs one :class:`~superfluid.core.tick.TickPlan` at a time on an engine (``run``).

    The shared tick, in the plan's documented order: ``park``, ``load``, ``save``,
    ``drop_parked``, ``release``; then per lane either a reset (the slot seeded from
    ``lp.seed`` and cut to ``lp.pos``, a fresh sampler; a seed that cannot give those tokens is a
    ``restore_failed`` and the slot is cleared) or a cut back to ``lp.pos``; then the step loop
    over the lanes with feed left: before each step the stop or yield flag ends the tick; after
    it, in an ``end_after_first_token`` tick a lane's first sampled token ends it, and in a
    ``quiet`` tick so does a lane that ended. Last the result: each lane's counts, parked bytes,
    seconds and the KV held.

    An engine implements the primitives below. Those a capability gates have defaults for an
    engine that does not declare it, so it writes none of them: the parked-KV ones
    (``supports_parking``, and ``persists_kv`` for ``load``/``save``) answer that nothing is
    parked or could be, and ``copy`` (``prefix_cache``) raises. ``self.parked`` (park key -> the
    engine's host copy of a slot's KV, in whatever form it keeps) and ``self.samplers`` (slot ->
    its sampler) are shared so that the tick can restore parked KV and drop samplers; the
    engine's own state (caches, batches, flags per slot) is its own.

    The step primitive is :meth:`advance`: one call may run one step or many. The loop calls it
    while lanes have feed, one call per round of the loop; an engine that runs several steps in
    one call (llama.cpp's decode rounds in C) asks ``self.stop_flag.stop_requested()`` between
    them and returns after a step in which a lane sampled its first token (if
    ``plan.end_after_first_token``) or a lane ended (if ``plan.quiet``), so the loop's rules see
    that step as they would a single one.

    A third engine (basert: paged KV, batched decode, rows sampled on a device) plugs in the same
    way: ``clear_kv``/``cut``/``keep_prefix`` free pages past a position (``keep_prefix`` says
    whether the slot then holds exactly ``pos`` usable tokens); ``copy`` may share the source's
    pages up to ``pos`` instead of copying them; ``park``/``restore``/``load``/``save`` move
    pages to and from host memory and files; ``new_sampler`` writes the lane's sampling
    parameters into its device row; ``advance`` builds the batch from the active lanes, runs
    forward passes and samples every row on the device, bringing tokens to the host once per
    step (or once per several steps, when it finishes the tick itself as above), and updates
    each :class:`Work` as its docstring says (:meth:`Work.sampled` per sampled token). A step the
    page pool cannot hold raises :class:`PoolFull`; a step the stop flag aborted returns False."""

    #: an engine that takes images sets this to its encoder's cache (see core/media.py): the
    #: tick reports how many images it encoded
    media: media_encoding.ImageEncoder | None = None

    def __init__(self, stop_flag: StopFlag, kv_capacity: int):
        self.stop_flag = stop_flag  # the engine's (a worker engine's is shared with the daemon)
        self.kv_capacity = kv_capacity
        self.parked: dict[str, Any] = {}
        self.samplers: dict[int, Any] = {}
        self.writer = ArtifactWriter()  # park artifacts are written off the tick thread

    # ---- primitives: parked KV (supports_parking; load and save: persists_kv) ------------------

    def park(self, slot: int, key: str) -> int:
        """Copy a slot's KV into ``self.parked[key]``; the bytes held (0: it could not, as
        always without parking)."""
        return 0

    def load(self, path: str, key: str) -> int:
        """Read a park artifact file (``save``'s) into ``self.parked[key]``; its size (0: it could
        not, as always without persisted KV)."""
        return 0

    def save_writer(self, key: str) -> Callable[[BinaryIO], object] | None:
        """What writes ``self.parked[key]`` to a file, holding (or copying) its bytes now, so the
        tick's writer thread can write it while the next ticks run (:mod:`.artifact_writer`).
        None: nothing parked under ``key``, or the engine writes in place with :meth:`save`."""
        return None

    def save(self, key: str, path: str) -> int:
        """Write ``self.parked[key]`` to a park artifact file on the tick thread (whole or not at
        all), for an engine without a ``save_writer``; the bytes written (0: nothing parked
        under ``key``, or it failed, as always without persisted KV)."""
        return 0

    def drop(self, key: str) -> None:
        """Forget parked KV."""
        self.parked.pop(key, None)

    def parked_bytes(self) -> int:
        """All parked KV held in host memory, in bytes (asked after every tick; 0 without
        parking)."""
        return 0

    def restore(self, slot: int, entry: Any) -> bool:
        """Set a cleared slot's KV from a parked entry (a value of ``self.parked``; the tick has
        taken it out, or left it there for other lanes); False if it does not fit the slot, as
        nothing does without parking."""
        return False

    # ---- primitives: slots ---------------------------------------------------------------------

    @abc.abstractmethod
    def clear_kv(self, slot: int) -> None:
        """Drop all of a slot's KV."""

    def drop_sampler(self, slot: int) -> None:
        """Forget a slot's sampler."""
        self.samplers.pop(slot, None)

    def copy(self, src: int, dst: int, pos: int) -> None:
        """Replace ``dst``'s KV with ``src``'s, at least its first ``pos`` tokens (``keep_prefix``
        cuts the rest). Only a ``prefix_cache`` engine is asked to, and no no-op could stand in
        for a copy, so by default it raises."""
        raise NotImplementedError(f"{type(self).__name__} copies no KV between slots: its engine declares "
                                  "no prefix_cache")

    @abc.abstractmethod
    def keep_prefix(self, slot: int, pos: int) -> bool:
        """Cut a just-seeded slot to its first ``pos`` tokens (0: clear it); whether it then holds
        exactly those, all usable for the next token."""

    @abc.abstractmethod
    def cut(self, slot: int, pos: int) -> None:
        """Drop a slot's KV from position ``pos`` on, if it holds any there."""

    @abc.abstractmethod
    def kv_used(self, touched: set[int]) -> int:
        """Cells held by all slots after the tick; ``touched`` are the slots it fed, seeded, cut
        or released (no other slot's count can have changed)."""

    # ---- primitives: sampling and steps --------------------------------------------------------

    @abc.abstractmethod
    def new_sampler(self, lp: LanePlan) -> None:
        """Put a fresh sampler for ``lp.sampling`` in ``self.samplers[lp.slot]``, caught up on
        the tokens already in the KV (``lp.history``, generated from ``lp.replay_from``)."""

    @abc.abstractmethod
    def accepts(self, slot: int) -> bool:
        """Whether the slot's sampler must see the prompt tokens fed to the KV (penalties, a
        grammar): sets ``Work.accept`` for lanes that are not decoding."""

    @abc.abstractmethod
    def advance(self, active: list[Work], plan: TickPlan, result: TickResult) -> bool:
        """Run one step, or several, over the lanes with feed left (``active``, in the plan's
        order; a step holds at most ``plan.step_tokens`` prefill tokens where that is set), update
        their :class:`Work` and append a :class:`~superfluid.core.tick.StepTiming` per step to
        ``result.steps``. False if the stop flag aborted a step (nothing of it kept); raises
        :class:`PoolFull` if the KV pool cannot hold a step."""

    # ---- the tick ------------------------------------------------------------------------------

    def clear(self, slot: int) -> None:
        """A released slot, or one whose seed failed: no KV, no sampler."""
        self.clear_kv(slot)
        self.drop_sampler(slot)

    def seed(self, lp: LanePlan) -> bool:
        """Set up a reset slot's KV from ``lp.seed`` so it holds exactly the lane's first
        ``lp.pos`` tokens; False if the seed cannot give them."""
        slot, seed = lp.slot, lp.seed
        self.drop_sampler(slot)
        if seed.key is not None:
            self.clear_kv(slot)
            entry = self.parked.get(seed.key) if seed.shared else self.parked.pop(seed.key, None)
            if entry is None or not self.restore(slot, entry):
                return False
        elif seed.slot is not None:
            self.copy(seed.slot, slot, lp.pos)
        return self.keep_prefix(slot, lp.pos)

    def run(self, plan: TickPlan) -> TickResult:
        t_start = time.perf_counter()
        result = TickResult()
        encodes = self.media.encodes if self.media is not None else 0
        if self.media is not None:  # the lanes' images start encoding while the tick runs
            media_encoding.prefetch(self.media, plan.lanes)
        for slot, key in plan.park:
            result.parked[key] = self.park(slot, key)
        for path, key in plan.load:
            result.parked[key] = self.load(path, key)
        for key, path in plan.save:
            write = self.save_writer(key)
            if write is None:
                result.saved[path] = self.save(key, path)
            else:
                self.writer.submit(path, write)
        for key in plan.drop_parked:
            self.drop(key)
        for slot in plan.release:
            self.clear(slot)
        work = self._work(plan, result)
        self._steps(work, plan, result)
        for w in work:
            result.lanes[w.slot] = w.result
        result.parked_bytes = self.parked_bytes()
        # a plan with no lanes may be there only to collect writes: wait a little for one
        result.saved.update(self.writer.finished(wait_s=0.0 if plan.lanes else SAVE_COLLECT_WAIT_S))
        result.saves_pending = self.writer.pending()
        if self.media is not None:
            result.encoded = self.media.encodes - encodes
        result.seconds = time.perf_counter() - t_start
        result.kv_used = self.kv_used({lp.slot for lp in plan.lanes}.union(plan.release))
        result.kv_capacity = self.kv_capacity
        return result

    def _work(self, plan: TickPlan, result: TickResult) -> list[Work]:
        """Each lane's slot made ready (seeded and a fresh sampler, or cut back to ``pos``) and its
        work; a failed seed is reported and gets none."""
        work: list[Work] = []
        for lp in plan.lanes:
            if lp.reset:
                if not self.seed(lp):
                    self.clear(lp.slot)
                    result.lanes[lp.slot] = LaneResult(slot=lp.slot, restore_failed=True)
                    continue
                self.new_sampler(lp)
            else:
                self.cut(lp.slot, lp.pos)
            work.append(Work(lp, not lp.decode and self.accepts(lp.slot)))
        return work

    def _steps(self, work: list[Work], plan: TickPlan, result: TickResult) -> None:
        active = [w for w in work if w.feed]
        images = self.media is not None and any(w.media for w in work)
        started = time.perf_counter()
        while active:
            if self.stop_flag.stop_requested():
                result.stopped_early = True
                break
            stepping = active
            if images:  # a lane whose next rows are an image still encoding waits; the others step
                stepping = media_encoding.runnable(active, self.media)
                active = [w for w in active if w.feed]  # (a lane whose image failed has ended)
                if not stepping:
                    others = any(w.result.n_fed for w in work if not w.feed)  # their tokens can go out now
                    if active and media_encoding.wait(active, self.media, others, started, plan.target_s,
                                                      self.stop_flag):
                        continue
                    result.stopped_early = bool(active)
                    break
            try:
                went_on = self.advance(stepping, plan, result)
            except PoolFull as full:  # the scheduler frees room and plans the rest again
                result.rejected_tokens = full.n_tokens
                result.stopped_early = True
                break
            if not went_on:  # aborted mid-step by the stop flag: nothing of that step was kept
                result.stopped_early = True
                break
            if plan.end_after_first_token and any(w.result.tokens and not w.was_decoding for w in work):
                result.stopped_early = any(w.feed for w in active)
                break
            still = [w for w in active if w.feed]
            if plan.quiet and len(still) < len(active):  # a reply is complete: its client is waiting
                result.stopped_early = bool(still)
                break
            active = still
