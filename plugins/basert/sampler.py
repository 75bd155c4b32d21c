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
(:func:`_choose`) on a sorted prefix of the row: the device sorts whole rows; the host (where a
full sort of a 150k row costs ~15 ms) sorts the best 256 tokens, and where they do not decide
the draw, the tokens above a cut found from a histogram of the row's mass, and the whole row
only if even that falls short. So a seeded lane gives the same tokens alone (host) or batched
(device), up to float rounding in the last place (a uniform within ~1e-7 of a boundary).
Measured on SmolLM2's real rows (49k tokens, one CPU thread): 0.8-1.5 ms a token on average.

:func:`sample_rows` moves no sampler state but the random generators: the caller calls
:meth:`LaneSampler.accept` with the tokens it keeps."""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np
import torch

from superfluid.core.constrain import LaneConstraint
from superfluid.core.logits import apply_bias, token_logprob
from superfluid.core.request import SamplingParams
from superfluid.core.tick import TokenLogprob

HOST_PREFIX = 256  # the host's first candidate prefix
DEVICE_CHUNK = 32  # rows sorted together on the device: bounds the transient memory (~4.5 MB a row at 150k)
EXACT_IDS = 1 << 24  # token ids travel as float32 in the packed transfers: exact below this


class _Window:
    """The last ``size`` tokens a lane saw (``None``: all of them) and how often each occurs
    there, kept incrementally so a step costs O(distinct tokens), not O(window)."""

    def __init__(self, size: int | None):
        self.size = size
        self.tokens: collections.deque[int] = collections.deque()
        self.counts: dict[int, int] = {}
        self._table: tuple[np.ndarray, np.ndarray] | None = None

    def extend(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        self._table = None
        for token in tokens:
            token = int(token)
            self.tokens.append(token)
            self.counts[token] = self.counts.get(token, 0) + 1
            if self.size is not None and len(self.tokens) > self.size:
                old = self.tokens.popleft()
                left = self.counts[old] - 1
                if left:
                    self.counts[old] = left
                else:
                    del self.counts[old]

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, counts), one entry per distinct token in the window."""
        if self._table is None:
            n = len(self.counts)
            self._table = (np.fromiter(self.counts.keys(), dtype=np.int64, count=n),
                           np.fromiter(self.counts.values(), dtype=np.float32, count=n))
        return self._table


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
        self.window = _Window(None if params.penalty_last_n < 0 else params.penalty_last_n) if self.penalized else None
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

    def advance(self, drawn: int) -> None:
        """Skip the uniforms of ``drawn`` tokens sampled before (one each): a seeded lane that
        resumes (preempted, worker restart) then draws what it would have drawn."""
        if self.rng is not None and drawn > 0:
            self.rng.random(drawn)


# --- the shared math -------------------------------------------------------------------------

def _penalize(rows: torch.Tensor, lanes: Sequence[LaneSampler | None], pack: dict | None = None) -> None:
    """llama.cpp's penalties, in place: a logit of a token in the window is divided by
    ``repeat_penalty`` if positive, multiplied if not, then lowered by ``count * frequency +
    presence``. ``pack``: the tables already on the device (:func:`_upload`)."""
    if pack is None:
        pack = _penalty_tables(lanes)
        if pack is None:
            return
        pack = {k: torch.from_numpy(v).to(rows.device) for k, v in pack.items()}
    if "pen_row" not in pack:
        return
    r, tok, count = pack["pen_row"].long(), pack["pen_tok"].long(), pack["pen_count"]
    rep, freq, pres = pack["pen_rep"][r], pack["pen_freq"][r], pack["pen_pres"][r]
    logit = rows[r, tok]
    logit = torch.where(logit <= 0, logit * rep, logit / rep) - count * freq - (count > 0).to(rows.dtype) * pres
    rows[r, tok] = logit


def _penalty_tables(lanes: Sequence[LaneSampler | None]) -> dict[str, np.ndarray] | None:
    rows, toks, counts = [], [], []
    rep = np.ones(len(lanes), np.float32)
    freq = np.zeros(len(lanes), np.float32)
    pres = np.zeros(len(lanes), np.float32)
    for i, lane in enumerate(lanes):
        if lane is None or lane.window is None or not lane.window.counts:
            continue
        t, c = lane.window.table()
        rows.append(np.full(t.shape[0], i, np.float32))
        toks.append(t.astype(np.float32))
        counts.append(c)
        p = lane.params
        rep[i], freq[i], pres[i] = p.repeat_penalty, p.frequency_penalty, p.presence_penalty
    if not rows:
        return None
    return {"pen_row": np.concatenate(rows), "pen_tok": np.concatenate(toks), "pen_count": np.concatenate(counts),
            "pen_rep": rep, "pen_freq": freq, "pen_pres": pres}


def _draw_params(lanes: Sequence[LaneSampler], uniforms: Sequence[float]) -> dict[str, np.ndarray]:
    """Per row: the uniform, 1/temperature, top-k, top-p and min-p, float32 as both paths use them."""
    return {"u": np.asarray(uniforms, np.float32),
            "inv_t": np.asarray([1.0 / s.params.temperature for s in lanes], np.float32),
            "top_k": np.asarray([s.params.top_k for s in lanes], np.float32),
            "top_p": np.asarray([s.params.top_p for s in lanes], np.float32),
            "min_p": np.asarray([s.params.min_p for s in lanes], np.float32)}


def _totals(rows: torch.Tensor, inv_t: torch.Tensor, keep_p: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row: the top logit (0 for a row with none finite), the sums over the whole row of
    exp(logit - top) and of exp((logit - top) / temperature), and (``keep_p``) the first of
    those per token."""
    top = rows.max(dim=-1).values
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    d = rows - top[:, None]
    p = torch.exp(d)
    p_total = p.sum(dim=-1)
    d.mul_(inv_t[:, None])
    q_total = d.exp_().sum(dim=-1)
    return top, p_total, q_total, (p if keep_p else None)


def _choose(vals: torch.Tensor, ids: torch.Tensor, n_pre: torch.Tensor, floor: torch.Tensor, vocab: int,
            top: torch.Tensor, p_total: torch.Tensor, q_total: torch.Tensor, prm: dict[str, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each row draws, from a prefix of its tokens sorted best first (ties: lower id):
    ``vals``/``ids`` [n, C], of which the first ``n_pre`` per row are exactly the row's best
    (``n_pre == vocab``: the whole row), and every token past them has exp(logit - top) at most
    ``floor``. Returns (tokens, ok): ``ok`` False where the prefix was too short to decide (the
    host widens it and asks again); the device passes whole rows, always decided.

    top-k keeps the k best; top-p then the fewest best whose probability (renormalized over the
    top-k survivors, as llama.cpp's chain does) reaches top_p; min-p those with probability at
    least min_p times the best's; at least one token. The kept tokens' tempered weights
    exp((logit - top) / T) are summed and the first whose running sum passes u times the total
    is the draw."""
    n, width = vals.shape
    pos = torch.arange(width, device=vals.device)
    valid = pos[None, :] < n_pre[:, None]
    whole = n_pre >= vocab
    d = vals - top[:, None]
    p = torch.exp(d).masked_fill_(~valid, 0.0)
    q = d.mul_(prm["inv_t"][:, None]).exp_().masked_fill_(~valid, 0.0)
    cp = torch.cumsum(p, dim=-1)
    cq = torch.cumsum(q, dim=-1)
    last = width - 1

    k = prm["top_k"].long()
    has_k = (k > 0) & (k < vocab)
    k_len = torch.where(has_k, k, torch.full_like(k, vocab))  # exact, prefix or not
    known_k = ~has_k | (k_len <= n_pre)  # the survivors' mass (top-p's normalizer) is known
    p_k = torch.where(has_k, cp.gather(1, (k_len - 1).clamp(0, last)[:, None])[:, 0], p_total)

    has_p = prm["top_p"] < 1.0
    cnt_p = ((cp < (prm["top_p"] * p_k)[:, None]) & valid).sum(dim=-1)
    known_p = ~has_p | (((cnt_p < n_pre) | whole) & known_k)
    p_len = torch.where(has_p & known_p, cnt_p + 1, torch.full_like(cnt_p, vocab))

    has_m = prm["min_p"] > 0.0
    cnt_m = ((p >= prm["min_p"][:, None]) & valid).sum(dim=-1)
    known_m = ~has_m | (cnt_m < n_pre) | whole | (prm["min_p"] > floor)
    m_len = torch.where(has_m & known_m, cnt_m, torch.full_like(cnt_m, vocab))

    # A cut not found in the prefix lies past it (top-p's only if its normalizer is known), so
    # a known cut inside the prefix decides the kept set; with no cut at all, the draw decides.
    keep = torch.minimum(torch.minimum(k_len, p_len), m_len).clamp(1, vocab)
    ok = (keep <= n_pre) | whole | ((keep >= vocab) & known_p & known_m)
    ok &= ~has_p | known_p | known_k
    q_kept = torch.where(keep < vocab, cq.gather(1, (keep - 1).clamp(0, last)[:, None])[:, 0], q_total)
    kept = (pos[None, :] < keep[:, None]) & valid
    below = ((cq <= (prm["u"] * q_kept)[:, None]) & kept).sum(dim=-1)
    found = below < torch.minimum(keep, n_pre)
    ok &= found | (keep <= n_pre)
    # rounding left the pick past the end: the last kept token with any weight
    fallback = (((q > 0) & kept).sum(dim=-1) - 1).clamp(min=0)
    pick = torch.where(found, below, fallback).clamp(0, last)
    return ids.gather(1, pick[:, None])[:, 0], ok


def _sorted_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted best first, ties by lower id (the device's sort)."""
    return torch.sort(rows, dim=-1, descending=True, stable=True)


def _host_order(vals: np.ndarray) -> np.ndarray:
    """The order that sorts a float32 vector best first, ties by lower position, on the CPU:
    each value's bits made an order-preserving integer, paired with its position into one int64
    key, sorted by numpy's (SIMD) sort, ~2x torch's stable float sort."""
    bits = (vals + np.float32(0.0)).view(np.int32)  # + 0.0: -0.0 ties with 0.0, as in a float sort
    key = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).astype(np.int64)
    key = (~key << 32) | np.arange(vals.shape[0], dtype=np.int64)
    key.sort()
    return key & 0xFFFFFFFF


def _prefix(rows: torch.Tensor, top: torch.Tensor, width: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best ``width`` tokens of each row in exact order, how many of them are surely the
    row's best (those strictly above the ``width``-th value: tokens tied with it may have been
    left out of ``topk``'s pick), and the floor past them (that value's weight)."""
    vals, ids = torch.topk(rows, width, dim=-1)
    n_pre = (vals > vals[:, -1:]).sum(dim=-1)
    floor = torch.exp(vals[:, -1] - top)
    order = ids.argsort(dim=-1)
    ids, vals = ids.gather(1, order), vals.gather(1, order)
    order = vals.argsort(dim=-1, descending=True, stable=True)
    return vals.gather(1, order), ids.gather(1, order), n_pre, floor


MASS_BIN = 0.25  # nats per bin of the host's mass histogram
MASS_BINS = 128


def _mass_cut(d: torch.Tensor, weight: torch.Tensor, need: float) -> float:
    """A threshold on logit - top such that the tokens at or above it surely hold ``need`` of
    ``weight``'s mass: a histogram of the row's mass by distance from the top, the first bin where
    the running mass reaches it, and one bin more for rounding (-inf: none short of all)."""
    bins = (d * (-1.0 / MASS_BIN)).floor_().clamp_(max=MASS_BINS - 1).long()
    mass = torch.bincount(bins, weights=weight, minlength=MASS_BINS).cumsum(0)
    at = int(torch.searchsorted(mass, torch.tensor([need], dtype=mass.dtype))[0]) + 2
    return -at * MASS_BIN if at < MASS_BINS else float("-inf")


def _decisive_cut(d: torch.Tensor, p: torch.Tensor, p_total: float, q_total: float,
                  prm: dict[str, torch.Tensor]) -> float:
    """A threshold on logit - top above which the tokens surely decide the draw: enough mass to
    reach top-p's cut, or everything min-p keeps (the least inclusive of the two suffices, as
    the earlier cut decides), or, with no filter, enough tempered mass to hold the uniform's
    point. -inf where none is known (a lone top-k past the first prefix)."""
    top_p, min_p, u, inv_t = (float(prm[n][0]) for n in ("top_p", "min_p", "u", "inv_t"))
    cuts = []
    if top_p < 1.0:
        cuts.append(_mass_cut(d, p, top_p * p_total))
    if min_p > 0.0:
        cuts.append(float(np.log(min_p)) - 0.01)
    if not cuts and int(prm["top_k"][0]) <= 0:
        cuts.append(_mass_cut(d, torch.exp(d * inv_t), u * q_total))
    return max(cuts) if cuts else float("-inf")


def _draw_host(row: torch.Tensor, prm: dict[str, torch.Tensor]) -> int:
    """One CPU row's draw (row [1, vocab]), without sorting the whole row (~15 ms at 150k): the
    best few hundred usually decide it; if not, the tokens above a cut that surely decides it
    (:func:`_decisive_cut`), sorted; the whole sorted row only if even that falls short."""
    vocab = row.shape[1]
    top, p_total, q_total, p = _totals(row, prm["inv_t"], keep_p=True)
    if HOST_PREFIX < vocab:
        vals, ids, n_pre, floor = _prefix(row, top, HOST_PREFIX)
        token, ok = _choose(vals, ids, n_pre, floor, vocab, top, p_total, q_total, prm)
        if bool(ok[0]):
            return int(token[0])
        d = row[0] - top[0]
        cut = _decisive_cut(d, p[0], float(p_total[0]), float(q_total[0]), prm)
        ids = torch.nonzero(d >= cut)[:, 0] if cut > float("-inf") else ids[:0]
        if 0 < ids.shape[0] < vocab:
            vals = row[0, ids]
            order = torch.from_numpy(_host_order(vals.numpy()))
            floor = torch.tensor([np.exp(cut)], dtype=row.dtype)
            token, ok = _choose(vals[order][None], ids[order][None], torch.tensor([ids.shape[0]]), floor,
                                vocab, top, p_total, q_total, prm)
            if bool(ok[0]):
                return int(token[0])
    ids = torch.from_numpy(_host_order(row[0].numpy()))
    token, _ = _choose(row[0, ids][None], ids[None], torch.full((1,), vocab), torch.zeros(1, dtype=row.dtype),
                       vocab, top, p_total, q_total, prm)
    return int(token[0])


def _top_exact(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of each row (values, ids), best first, ties by lower id, exactly as
    :func:`superfluid.core.logits.top_candidates` orders them (``topk`` alone breaks ties at the
    k-th value as it likes)."""
    vals = torch.topk(raw, k, dim=-1).values
    kth = vals[:, -1:]
    above = raw > kth
    need = k - above.sum(dim=-1, keepdim=True)
    tied = raw == kth
    sel = above | (tied & (tied.cumsum(dim=-1, dtype=torch.int32) <= need))
    ids = torch.topk(sel.to(raw.dtype), k, dim=-1).indices  # exactly k selected per row
    order = ids.argsort(dim=-1)
    ids = ids.gather(1, order)
    vals = raw.gather(1, ids)
    order = vals.argsort(dim=-1, descending=True, stable=True)
    return vals.gather(1, order), ids.gather(1, order)


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
        pen = _penalty_tables(lanes)
        if pen is not None:
            parts.update(pen)
        if drawn:
            parts.update({f"draw_{k}": v for k, v in
                          _draw_params([lanes[j] for j in drawn], [lanes[j].uniform() for j in drawn]).items()})
            parts["drawn"] = np.asarray(drawn, np.float32)
        self.want = [j for j, s in enumerate(lanes) if s.params.logprobs is not None]
        if self.want:
            parts["want"] = np.asarray(self.want, np.float32)
        sent = _upload(parts, device)
        raw = logits.index_select(0, sent["index"].long())
        rows = raw.clone() if self.want else raw  # raw stays the model's own for the logprobs
        _apply_bias(rows, sent)
        _penalize(rows, lanes, sent)
        tokens = rows.argmax(dim=-1)
        if drawn:
            prm = {k[5:]: v for k, v in sent.items() if k.startswith("draw_")}
            where = sent["drawn"].long()
            picked = []
            for at in range(0, len(drawn), DEVICE_CHUNK):
                sub = rows.index_select(0, where[at:at + DEVICE_CHUNK])
                chunk = {k: v[at:at + DEVICE_CHUNK] for k, v in prm.items()}
                top, p_total, q_total, _ = _totals(sub, chunk["inv_t"])
                vals, ids = _sorted_rows(sub)
                full = torch.full((sub.shape[0],), vocab, device=device)
                floor = torch.zeros(sub.shape[0], device=device)
                picked.append(_choose(vals, ids, full, floor, vocab, top, p_total, q_total, chunk)[0])
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
        vals, ids = _top_exact(rows, self.k)
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
    _penalize(t, [lane])
    if lane.greedy:
        token = int(t[0].argmax())
    else:
        prm = {k: torch.from_numpy(v) for k, v in _draw_params([lane], [lane.uniform()]).items()}
        token = _draw_host(t, prm)
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
