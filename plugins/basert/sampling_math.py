"""The sampling math basert's host and device paths share (:mod:`.sampler` says where each row
goes): llama.cpp's penalties and the window of tokens they count, the filter chain's totals, and
the inverse-CDF pick over a sorted prefix of a row, so one seeded lane draws the same token
whichever path samples it. It reads lanes' parameters (``SamplingParams``) and windows, never a
sampler: the sampler builds on it, not the other way round."""

from __future__ import annotations

import collections
from typing import Sequence

import numpy as np
import torch

from superfluid.core.request import SamplingParams

HOST_PREFIX = 256  # the host's first candidate prefix


class PenaltyWindow:
    """The tokens a lane's penalties see: the last ``params.penalty_last_n`` it saw (all of
    them when negative) and how often each occurs there, kept incrementally so a step costs
    O(distinct tokens), not O(window); ``params`` also holds the penalties themselves."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.size = None if params.penalty_last_n < 0 else params.penalty_last_n
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

    def extended(self, tokens: Sequence[int]) -> PenaltyWindow:
        """A copy with ``tokens`` added (this window unchanged)."""
        twin = PenaltyWindow(self.params)
        twin.tokens = collections.deque(self.tokens)
        twin.counts = dict(self.counts)
        twin._table = self._table
        twin.extend(tokens)
        return twin

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, counts), one entry per distinct token in the window."""
        if self._table is None:
            n = len(self.counts)
            self._table = (np.fromiter(self.counts.keys(), dtype=np.int64, count=n),
                           np.fromiter(self.counts.values(), dtype=np.float32, count=n))
        return self._table


def penalize(rows: torch.Tensor, pack: dict[str, torch.Tensor]) -> None:
    """llama.cpp's penalties, in place: a logit of a token in the window is divided by
    ``repeat_penalty`` if positive, multiplied if not, then lowered by ``count * frequency +
    presence``. ``pack``: :func:`penalty_tables` as tensors on the rows' device (no ``pen_row``:
    no row is penalized)."""
    if "pen_row" not in pack:
        return
    r, tok, count = pack["pen_row"].long(), pack["pen_tok"].long(), pack["pen_count"]
    rep, freq, pres = pack["pen_rep"][r], pack["pen_freq"][r], pack["pen_pres"][r]
    logit = rows[r, tok]
    logit = torch.where(logit <= 0, logit * rep, logit / rep) - count * freq - (count > 0).to(rows.dtype) * pres
    rows[r, tok] = logit


def penalty_tables(windows: Sequence[PenaltyWindow | None]) -> dict[str, np.ndarray] | None:
    """Row i's penalized tokens, their counts and its penalties (None: no row is penalized)."""
    rows, toks, counts = [], [], []
    rep = np.ones(len(windows), np.float32)
    freq = np.zeros(len(windows), np.float32)
    pres = np.zeros(len(windows), np.float32)
    for i, window in enumerate(windows):
        if window is None or not window.counts:
            continue
        t, c = window.table()
        rows.append(np.full(t.shape[0], i, np.float32))
        toks.append(t.astype(np.float32))
        counts.append(c)
        p = window.params
        rep[i], freq[i], pres[i] = p.repeat_penalty, p.frequency_penalty, p.presence_penalty
    if not rows:
        return None
    return {"pen_row": np.concatenate(rows), "pen_tok": np.concatenate(toks), "pen_count": np.concatenate(counts),
            "pen_rep": rep, "pen_freq": freq, "pen_pres": pres}


def draw_params(params: Sequence[SamplingParams], uniforms: Sequence[float]) -> dict[str, np.ndarray]:
    """Per row: the uniform, 1/temperature, top-k, top-p and min-p, float32 as both paths use them."""
    return {"u": np.asarray(uniforms, np.float32),
            "inv_t": np.asarray([1.0 / p.temperature for p in params], np.float32),
            "top_k": np.asarray([p.top_k for p in params], np.float32),
            "top_p": np.asarray([p.top_p for p in params], np.float32),
            "min_p": np.asarray([p.min_p for p in params], np.float32)}


def totals(rows: torch.Tensor, inv_t: torch.Tensor, keep_p: bool = False
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


def choose(vals: torch.Tensor, ids: torch.Tensor, n_pre: torch.Tensor, floor: torch.Tensor, vocab: int,
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


def sorted_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def draw_host(row: torch.Tensor, prm: dict[str, torch.Tensor]) -> int:
    """One CPU row's draw (row [1, vocab]), without sorting the whole row (~15 ms at 150k): the
    best few hundred usually decide it; if not, the tokens above a cut that surely decides it
    (:func:`_decisive_cut`), sorted; the whole sorted row only if even that falls short."""
    vocab = row.shape[1]
    top, p_total, q_total, p = totals(row, prm["inv_t"], keep_p=True)
    if HOST_PREFIX < vocab:
        vals, ids, n_pre, floor = _prefix(row, top, HOST_PREFIX)
        token, ok = choose(vals, ids, n_pre, floor, vocab, top, p_total, q_total, prm)
        if bool(ok[0]):
            return int(token[0])
        d = row[0] - top[0]
        cut = _decisive_cut(d, p[0], float(p_total[0]), float(q_total[0]), prm)
        ids = torch.nonzero(d >= cut)[:, 0] if cut > float("-inf") else ids[:0]
        if 0 < ids.shape[0] < vocab:
            vals = row[0, ids]
            order = torch.from_numpy(_host_order(vals.numpy()))
            floor = torch.tensor([np.exp(cut)], dtype=row.dtype)
            token, ok = choose(vals[order][None], ids[order][None], torch.tensor([ids.shape[0]]), floor,
                                vocab, top, p_total, q_total, prm)
            if bool(ok[0]):
                return int(token[0])
    ids = torch.from_numpy(_host_order(row[0].numpy()))
    token, _ = choose(row[0, ids][None], ids[None], torch.full((1,), vocab), torch.zeros(1, dtype=row.dtype),
                       vocab, top, p_total, q_total, prm)
    return int(token[0])


def top_exact(raw: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
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
