"""basert's sampler: one token per lane from a step's logits rows, with llama.cpp's rules.

Where each row is sampled (the product's promise: "a lone sampled lane is sampled on the host,
cheaper than one GPU sampling pass; from two lanes up, rows are sampled on the GPU in one pass"):

* greedy lanes with nothing else (no penalties, bias, constraint or logprobs): one batched
  argmax on the device;
* constrained lanes: the row goes to the host, since llguidance's masks are numpy;
* every other lane ("processed": sampled, or greedy with bias, penalties or logprobs): alone in
  the call, its row goes to the host; two or more are processed on the device together, with
  no host round trip between the steps (one small upload of the lanes' parameters and
  uniforms, one download of every result).

The order is core's (:mod:`superfluid.core.logits`): logprobs read from the raw row, then
``logit_bias``, then the constraint's mask; then the sampler itself, in llama.cpp's chain order:
penalties (repeat as llama.cpp applies it, presence and frequency as OpenAI, over the last
``penalty_last_n`` tokens), top-k, top-p, min-p (on the softmax of the penalized logits), then
temperature, then the draw.

The draw is an inverse-CDF pick: the kept tokens sorted by probability (ties: lower id), one
uniform from the lane's own ``numpy.random.Generator`` (seeded from ``params.seed``), and the
first token whose cumulative tempered probability passes it. Both paths run the same function
(:func:`.sampling_math.choose`) on a sorted prefix of the row: the device sorts whole rows; the host (where a
full sort of a 150k row costs ~15 ms) sorts the best 256 tokens, and where they do not decide
the draw, the tokens above a cut found from a histogram of the row's mass, and the whole row
only if even that falls short. So a seeded lane gives the same tokens alone (host) or batched
(device), up to float rounding in the last place (a uniform within ~1e-7 of a boundary).
Measured on SmolLM2's real rows (49k tokens, one CPU thread): 0.8-1.5 ms a token on average.

:func:`sample_rows` moves no sampler state but the random generators: the caller calls
:meth:`LaneSampler.accept` with the tokens it keeps."""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch

from superfluid.core.constrain import LaneConstraint, apply_mask
from superfluid.core.logits import apply_bias, token_logprob
from superfluid.core.request import SamplingParams
from superfluid.core.tick import TokenLogprob

from .sampling_math import (PenaltyWindow, choose, draw_host, draw_params, penalize, penalty_tables, sorted_rows,
                            top_exact, totals)

DEVICE_CHUNK = 32  # rows sorted together on the device: bounds the transient memory (~4.5 MB a row at 150k)
EXACT_IDS = 1 << 24  # token ids travel as float32 in the packed transfers: exact below this


class _FixedDraw:
    """A generator that yields one known draw: a verify row's (:meth:`LaneSampler.verify_rows`)."""

    __slots__ = ("u",)

    def __init__(self, u: float):
        self.u = u

    def random(self) -> float:
        return self.u


class _FixedMask:
    """A grammar's mask at one verify position (:meth:`LaneSampler.verify_rows`), computed before
    the step's picks: the row is masked as the lane's constraint would have masked it there."""

    __slots__ = ("allowed",)

    def __init__(self, allowed: np.ndarray):
        self.allowed = allowed

    def mask(self, logits: np.ndarray) -> None:
        apply_mask(logits, self.allowed)


class LaneSampler:
    """One lane's sampling state: its parameters, penalty window, constraint and random
    generator. ``history`` (the prompt, and what the lane generated before) seeds the penalty
    window; ``constraint`` is the lane's :class:`LaneConstraint` (None: unconstrained)."""

    def __init__(self, params: SamplingParams, *, history: list[int] | None = None,
                 constraint: LaneConstraint | None = None):
        self.params = params
        self.greedy = params.greedy
        self.plain = params.plain
        self.constraint = constraint
        self.penalized = params.uses_penalties and params.penalty_last_n != 0
        self.window = PenaltyWindow(params) if self.penalized else None
        if self.window is not None and history:
            self.window.extend(history)
        seed = None if params.seed is None else params.seed & ((1 << 64) - 1)  # None: fresh entropy
        self.rng = None if self.greedy else np.random.default_rng(seed)
        self.bias = tuple(params.logit_bias)

    @property
    def fast(self) -> bool:
        """Argmax of the raw row is the whole job (the batched argmax path)."""
        return self.greedy and self.plain and not self.penalized and self.constraint is None

    @property
    def sees_feed(self) -> bool:
        """Whether the runner must pass the tokens it feeds to the KV: penalties count the prompt,
        a constraint the generated tokens a resumed lane replays."""
        return self.penalized or self.constraint is not None

    def accept(self, tokens: list[int]) -> None:
        """Tokens the lane generated (sampled now, or replayed): the penalty window and the
        constraint move past them."""
        if self.window is not None:
            self.window.extend(tokens)
        if self.constraint is not None:
            for token in tokens:
                self.constraint.accept(token)

    def accept_fed(self, tokens: list[int], start: int, generated_from: int | None) -> None:
        """Tokens fed to the KV at positions ``start, start+1, ...``: the penalties see them all,
        the constraint only those at or past ``generated_from`` (where the prompt ended; None:
        nothing generated yet), since it holds the generated text only."""
        if self.window is not None:
            self.window.extend(tokens)
        if self.constraint is not None and generated_from is not None:
            for i, token in enumerate(tokens):
                if start + i >= generated_from:
                    self.constraint.accept(token)

    def uniform(self) -> float:
        """This token's one draw."""
        return float(self.rng.random())

    def peek(self, n: int) -> list[float]:
        """The next ``n`` draws, left in the generator: a verify step samples its row after each
        drafted token with the draw that token would get without speculation, then takes only as
        many as it keeps (:meth:`advance`), so a seeded lane's text is the same either way."""
        twin = np.random.Generator(type(self.rng.bit_generator)())
        twin.bit_generator.state = self.rng.bit_generator.state
        return twin.random(n).tolist()

    def verify_rows(self, draft: Sequence[int]) -> list[LaneSampler]:
        """Samplers for the rows of a verify step over ``draft`` (one more than its tokens): row
        ``i`` is sampled as the token after ``draft[:i]`` would be without speculation, with the
        draw that token would use (:meth:`peek`; taken by :meth:`advance` once the lane knows how
        many it kept), its penalty window holding ``draft[:i]``, and its grammar's mask there
        (:meth:`LaneConstraint.masks_along`). The lane's own state does not move."""
        n = len(draft) + 1
        uniforms = self.peek(n) if self.rng is not None else None
        masks = self.constraint.masks_along(draft) if self.constraint is not None else None
        rows = []
        for i in range(n):
            twin = copy.copy(self)
            if uniforms is not None:
                twin.rng = _FixedDraw(uniforms[i])
            if self.window is not None:
                twin.window = self.window.extended(draft[:i])
            if masks is not None:
                twin.constraint = _FixedMask(masks[i])
            rows.append(twin)
        return rows

    def advance(self, drawn: int) -> None:
        """Skip the uniforms of ``drawn`` tokens sampled before (one each): a seeded lane that
        resumes (preempted, worker restart) then draws what it would have drawn."""
        if self.rng is not None and drawn > 0:
            self.rng.random(drawn)


# --- the paths --------------------------------------------------------------------------------

def _upload(parts: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Small float32 arrays to the device in one transfer."""
    names = list(parts)
    flat = np.concatenate([parts[n].astype(np.float32, copy=False).ravel() for n in names]) if names else \
        np.zeros(0, np.float32)
    sent = torch.from_numpy(flat).to(device, non_blocking=False)
    out, at = {}, 0
    for n in names:
        size = parts[n].size
        out[n] = sent[at:at + size].view(parts[n].shape)
        at += size
    return out


def _bias_table(lanes: Sequence[LaneSampler], vocab: int) -> dict[str, np.ndarray]:
    rows, toks, adds = [], [], []
    for i, lane in enumerate(lanes):
        for token, value in lane.bias:
            if 0 <= token < vocab:
                rows.append(i)
                toks.append(token)
                adds.append(-np.inf if value <= -100 else value)
    if not rows:
        return {}
    return {"bias_row": np.asarray(rows, np.float32), "bias_tok": np.asarray(toks, np.float32),
            "bias_add": np.asarray(adds, np.float32)}


def _apply_bias(rows: torch.Tensor, sent: dict[str, torch.Tensor]) -> None:
    """OpenAI's logit_bias on the device, as :func:`superfluid.core.logits.apply_bias`: values
    add up, −100 bans (its entry adds −inf, which nothing finite undoes)."""
    if "bias_row" not in sent:
        return
    rows.index_put_((sent["bias_row"].long(), sent["bias_tok"].long()), sent["bias_add"], accumulate=True)


class _Device:
    """The processed lanes of a call together on the device: everything from the raw rows to
    the tokens and logprobs without a host round trip; :meth:`pending` is what the one download
    brings back and :meth:`read` unpacks it."""

    def __init__(self, logits: torch.Tensor, index: list[int], lanes: list[LaneSampler]):
        vocab = logits.shape[1]
        device = logits.device
        drawn = [j for j, s in enumerate(lanes) if not s.greedy]
        parts: dict[str, np.ndarray] = {"index": np.asarray(index, np.float32)}
        parts.update(_bias_table(lanes, vocab))
        pen = penalty_tables([s.window for s in lanes])
        if pen is not None:
            parts.update(pen)
        if drawn:
            parts.update({f"draw_{k}": v for k, v in
                          draw_params([lanes[j].params for j in drawn], [lanes[j].uniform() for j in drawn]).items()})
            parts["drawn"] = np.asarray(drawn, np.float32)
        self.want = [j for j, s in enumerate(lanes) if s.params.logprobs is not None]
        if self.want:
            parts["want"] = np.asarray(self.want, np.float32)
        sent = _upload(parts, device)
        raw = logits.index_select(0, sent["index"].long())
        rows = raw.clone() if self.want else raw  # raw stays the model's own for the logprobs
        _apply_bias(rows, sent)
        penalize(rows, sent)
        tokens = rows.argmax(dim=-1)
        if drawn:
            prm = {k[5:]: v for k, v in sent.items() if k.startswith("draw_")}
            where = sent["drawn"].long()
            picked = []
            for at in range(0, len(drawn), DEVICE_CHUNK):
                sub = rows.index_select(0, where[at:at + DEVICE_CHUNK])
                chunk = {k: v[at:at + DEVICE_CHUNK] for k, v in prm.items()}
                top, p_total, q_total, _ = totals(sub, chunk["inv_t"])
                vals, ids = sorted_rows(sub)
                full = torch.full((sub.shape[0],), vocab, device=device)
                floor = torch.zeros(sub.shape[0], device=device)
                picked.append(choose(vals, ids, full, floor, vocab, top, p_total, q_total, chunk)[0])
                del sub, vals, ids
            tokens = tokens.index_copy(0, where, torch.cat(picked))
        self.lanes = lanes
        self.tokens = tokens
        self.k = 0
        self.logprobs = self._logprobs(raw, tokens, sent["want"].long()) if self.want else []

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, sel: torch.Tensor) -> list[torch.Tensor]:
        """The sampled tokens' logprobs and the top candidates, from the raw rows, on the device."""
        rows = raw.index_select(0, sel)
        lse = torch.logsumexp(rows, dim=-1)
        own = rows.gather(1, tokens.index_select(0, sel)[:, None])[:, 0] - lse
        self.k = min(max(self.lanes[j].params.logprobs for j in self.want), rows.shape[1])
        if self.k <= 0:
            return [own]
        vals, ids = top_exact(rows, self.k)
        return [own, (vals - lse[:, None]).flatten(), ids.to(rows.dtype).flatten()]

    def pending(self) -> list[torch.Tensor]:
        """What comes back to the host, as float32 (token ids are exact below 2**24)."""
        return [self.tokens.to(torch.float32), *self.logprobs]

    def read(self, got: np.ndarray) -> list[tuple[int, TokenLogprob | None]]:
        """The lanes' tokens and logprob entries from the downloaded :meth:`pending`."""
        n, m, k = len(self.lanes), len(self.want), self.k
        tokens = got[:n].astype(np.int64)
        own = got[n:n + m]
        vals = got[n + m:n + m + m * k].reshape(m, k)
        ids = got[n + m + m * k:n + m + 2 * m * k].reshape(m, k).astype(np.int64)
        out: list[tuple[int, TokenLogprob | None]] = [(int(t), None) for t in tokens]
        for r, j in enumerate(self.want):
            top = tuple((int(ids[r, c]), float(vals[r, c])) for c in range(min(self.lanes[j].params.logprobs, k)))
            out[j] = (int(tokens[j]), TokenLogprob(token=int(tokens[j]), logprob=float(own[r]), top=top))
        return out


def _host_row(raw: np.ndarray, lane: LaneSampler) -> tuple[int, TokenLogprob | None]:
    """A row on the host: core's order (raw logprobs, bias, mask), then the shared math."""
    row = raw.copy() if lane.params.logprobs is not None else raw
    if lane.bias:
        apply_bias(row, lane.bias)
    if lane.constraint is not None:
        lane.constraint.mask(row)
    t = torch.from_numpy(row)[None]
    pen = penalty_tables([lane.window])
    if pen is not None:
        penalize(t, {k: torch.from_numpy(v) for k, v in pen.items()})
    if lane.greedy:
        token = int(t[0].argmax())
    else:
        prm = {k: torch.from_numpy(v) for k, v in draw_params([lane.params], [lane.uniform()]).items()}
        token = draw_host(t, prm)
    entry = None if lane.params.logprobs is None else token_logprob(raw, token, lane.params.logprobs)
    return token, entry


def sample_rows(logits: torch.Tensor, samplers: list[LaneSampler | None]) -> list[tuple[int, TokenLogprob | None]]:
    """One token per row of ``logits`` ([N, vocab] float32 on the model's device, one row per lane
    that samples this step) and its logprob entry (None unless the lane asked for logprobs).
    ``samplers[i]`` None means greedy with nothing else.

    Moves no sampler state except the random generators (one uniform per drawn token): the
    caller calls ``sampler.accept([token])`` for the tokens it keeps (a constraint must not move
    past a token the runner then drops)."""
    n, vocab = logits.shape
    if len(samplers) != n:
        raise ValueError(f"{n} logits rows for {len(samplers)} samplers")
    if vocab >= EXACT_IDS:
        raise ValueError(f"a vocabulary of {vocab} tokens is past what the packed transfers carry exactly")
    logits = logits.detach()
    if logits.dtype != torch.float32:
        logits = logits.float()
    fast = [i for i, s in enumerate(samplers) if s is None or s.fast]
    host = [i for i, s in enumerate(samplers) if s is not None and not s.fast and s.constraint is not None]
    dev = [i for i, s in enumerate(samplers) if s is not None and not s.fast and s.constraint is None]
    if len(dev) == 1:
        host, dev = sorted(host + dev), []
    out: list[tuple[int, TokenLogprob | None]] = [(0, None)] * n

    pending: list[torch.Tensor] = []
    if fast:
        if len(fast) == n:
            pending.append(logits.argmax(dim=-1).to(torch.float32))
        else:
            pending.append(logits.index_select(0, torch.tensor(fast, device=logits.device))
                           .argmax(dim=-1).to(torch.float32))
    batch = _Device(logits, dev, [samplers[i] for i in dev]) if dev else None
    if batch is not None:
        pending.extend(batch.pending())
    if host:
        index = torch.tensor(host, device=logits.device)
        rows = logits.index_select(0, index).to("cpu", copy=True).numpy()
        for j, i in enumerate(host):
            out[i] = _host_row(rows[j], samplers[i])
    if pending:
        got = torch.cat([t.flatten() for t in pending]).cpu().numpy()
        at = 0
        if fast:
            for j, i in enumerate(fast):
                out[i] = (int(got[at + j]), None)
            at += len(fast)
        if batch is not None:
            for i, result in zip(dev, batch.read(got[at:])):
                out[i] = result
    return out
