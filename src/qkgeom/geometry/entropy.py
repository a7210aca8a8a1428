"""Attention entropy, the logit scales, the largest logit and the sink mass, streamed from
captured q/k.

Why from q/k: training's fused ``scaled_dot_product_attention`` returns no weights. Why
streamed: long contexts never form the (B, H, T, T) pattern; scores come in blocks, whole
rows get an explicit log softmax, longer rows an online one over key chunks (running m, Z
and A = Σ e^(s−m)(s − m), so H = log Z − A/Z without cancellation). Rows are centred first
(the softmax ignores the shift). A soft-capped attention (``softcap`` c) has its scores
replaced by c·tanh(s/c) as they are formed, so every statistic here reads the capped logits;
the causal shortcut through key sums is linear and is taken only without a cap. The
recurrence and every metric: docs/definitions.md#how-the-metrics-are-computed,
#attention-entropy, #logit-scale and #attention-sinks-and-norms.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from qkgeom.geometry.workspace import Workspace
from qkgeom.metrics import ATTENTION_METRICS

__all__ = ["ATTENTION_METRICS", "StreamingEntropy", "logit_std_from_moments", "softcap_",
           "visible_pairs"]


_MAX_BLOCK_ELEMENTS = 2**22  # scores per block: 16 MiB in float32
_LOG_TINY = {dt: math.log(torch.finfo(dt).tiny) + 1.0 for dt in (torch.float32, torch.float64)}
_NEG = -1e30  # masked score: exp(−1e30 − m) is exactly 0 and (−1e30 − m)·0 = 0 (no NaN)
# per head: Σ H_t, Σ H_t / log n_t, Σ max p, Σ s, Σ s² (s = visible scaled logits),
# Σ σ_t (rows with n_t >= 2), Σ H_t of softmax(s_t / σ_t), Σ p_t0 (rows with n_t >= 2);
# then the largest s (a max, not a sum)
_SUMS = 8
_MAX = _SUMS  # the row of batch_sums that holds the largest logit
# per row: Σ p log p, max p, σ_t, Σ p′ log p′ of the scale-free softmax, max s, p_t0
_ROWS = 6
_TINY_STD = 1e-30  # a row std at or below this is a row of equal logits (left unscaled)


@functools.lru_cache(maxsize=64)
def _row_weights(T: int, causal: bool, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(3, T) weights turning per-row values into sums: −1 (Σ p log p into Σ H_t),
    −1/log n_t (into Σ H_t / log n_t) and 1 where n_t >= 2 (Σ σ_t), 0 on rows with one key."""
    with torch.inference_mode(False):
        n_vis = (torch.arange(1, T + 1, dtype=dtype, device=device) if causal
                 else torch.full((T,), float(T), dtype=dtype, device=device))  # (T,) keys
        two = n_vis >= 2
        inv_log = torch.where(two, n_vis.clamp_min(2).log().reciprocal(), 0.0)  # (T,)
        return torch.stack([-torch.ones_like(n_vis), -inv_log, two.to(dtype)])  # (3, T)


@functools.lru_cache(maxsize=64)
def _upper(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(n, 1, n) additive causal mask of the diagonal square of a query block: −1e30 where
    the key comes after the query, else 0 (broadcast over the R query heads of a key head)."""
    with torch.inference_mode(False):
        above = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)[:, None, :]
        return torch.zeros(n, 1, n, dtype=dtype, device=device).masked_fill_(above, _NEG)


@functools.lru_cache(maxsize=64)
def _lower(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(n, 1, n) 0/1 mask of the keys a query of the diagonal square sees (key ≤ query)."""
    with torch.inference_mode(False):
        return torch.ones(n, n, dtype=dtype, device=device).tril_()[:, None, :]


def softcap_(s: Tensor, cap: float) -> Tensor:
    """``cap·tanh(s/cap)`` in place (Gemma 2's attention-logit soft cap); returns ``s``."""
    return s.div_(cap).tanh_().mul_(cap)


def visible_pairs(T: int, causal: bool) -> int:
    """(query, key) pairs of one window the softmax uses: T(T+1)/2 causally, else T²."""
    return T * (T + 1) // 2 if causal else T * T


class StreamingEntropy:
    """Per-head attention entropy, max weight, sink mass and logit moments over batches:
    ``n_head`` query heads, ``n_kv_head`` key heads (default the same), ``causal`` or
    bidirectional, at most ``max_block_elements`` scores (all B·H) per block; ``softcap``:
    the attention's c of c·tanh(s/c) on the scaled logits (None: no cap)."""

    def __init__(self, n_head: int, n_kv_head: int | None = None, causal: bool = True,
                 max_block_elements: int = _MAX_BLOCK_ELEMENTS,
                 softcap: float | None = None) -> None:
        n_kv_head = n_kv_head or n_head
        if n_head < 1 or n_head % n_kv_head:
            raise ValueError(f"n_head={n_head} must be a positive multiple of n_kv_head={n_kv_head}")
        if softcap is not None and not 0 < softcap < math.inf:
            raise ValueError(f"softcap must be a positive finite number or None, got {softcap}")
        self.n_head, self.n_kv_head, self.causal = n_head, n_kv_head, causal
        self.softcap = None if softcap is None else float(softcap)
        self.max_block_elements = max_block_elements
        self._sums = torch.zeros(_SUMS, n_head, dtype=torch.float64)  # see _SUMS
        self._max = torch.full((n_head,), -math.inf, dtype=torch.float64)  # largest s
        self.n_queries = 0
        self.n_queries_norm = 0
        self.n_pairs = 0  # visible (query, key) pairs per head

    def blocks(self, B: int, T: int) -> tuple[int, int]:
        """(query rows, key columns) per block: whole key rows when 16 query rows fit the
        bound (causally about T/4 rows, so skipping each block's later keys saves ~3/8 of
        the scores), else 16 rows and key chunks that fit (the online path)."""
        per_row = max(1, self.max_block_elements // max(1, B * self.n_head))  # scores/row-set
        fit = per_row // T  # query rows whose whole key row fits the bound
        if fit >= 16:
            return min(T, fit, max(16, -(-T // 4)) if self.causal else T), T
        return min(T, 16), max(16, per_row // 16)

    def prepare(self, q: Tensor, k: Tensor, scale: float | None = None,
                workspace: Workspace | None = None) -> tuple[Tensor, Tensor]:
        """The layouts of :meth:`batch_sums`, in the softmax dtype (float64 for float64
        input, else float32): queries times ``scale`` (default 1/√hd) as (B·H_kv, T, R, hd),
        keys as (B·H_kv, T, hd), so one block of every query head of a key head is one bmm
        operand."""
        B, H, T, hd = q.shape
        if self.n_head != H or k.shape != (B, self.n_kv_head, T, hd):
            raise ValueError(f"expected q (B, {self.n_head}, T, hd) and k (B, {self.n_kv_head}, "
                             f"T, hd), got {tuple(q.shape)} and {tuple(k.shape)}")
        ws = workspace or Workspace()
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        Hk, R = self.n_kv_head, H // self.n_kv_head
        scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
        qg = ws.get("entropy.q", (B, Hk, T, R, hd), dtype, q.device)
        torch.mul(q.detach().unflatten(1, (Hk, R)).transpose(2, 3), scale, out=qg)
        kk = ws.get("entropy.k", (B, Hk, T, hd), dtype, q.device)
        kk.copy_(k.detach())
        return qg.view(B * Hk, T, R, hd), kk.view(B * Hk, T, hd)

    @torch.no_grad()
    def update(self, q: Tensor, k: Tensor, scale: float | None = None,
               blocks: tuple[int, int] | None = None) -> None:
        """Add an unpadded batch ``q`` (B, H, T, hd), ``k`` (B, H_kv, T, hd); ``blocks``
        overrides :meth:`blocks`. No host copy (no device sync)."""
        ws = Workspace()
        qg, kk = self.prepare(q, k, scale, ws)
        self.add_sums(self.batch_sums(qg, kk, q.shape[0], blocks, ws), q.shape[0], q.shape[2])

    @torch.no_grad()
    def batch_sums(self, qg: Tensor, kk: Tensor, B: int,
                   blocks: tuple[int, int] | None = None,
                   workspace: Workspace | None = None) -> Tensor:
        """The (9, H) float64 sums of one batch, not yet added: Σ H_t, Σ H_t / log n_t, Σ
        max p, Σ s, Σ s², Σ σ_t, Σ H_t of the scale-free softmax, Σ p_t0, and the largest s.

        Apart from :meth:`add_sums` so that a caller keeping several totals (all tokens and
        a token block) computes a batch once."""
        ws = workspace or Workspace()
        BHk, T, R, hd = qg.shape
        Hk, H = BHk // B, BHk // B * R
        dtype, dev = qg.dtype, qg.device
        c, kc = blocks or self.blocks(B, T)
        rows = ws.get("entropy.rows", (_ROWS, BHk, T * R), dtype, dev)  # see _ROWS
        moments = ws.get("entropy.moments", (2, BHk, R), dtype, dev).zero_()  # Σ s, Σ s²
        for t0 in range(0, T, c):
            t1 = min(T, t0 + c)
            n, nk = t1 - t0, (t1 if self.causal else T)  # query rows, visible keys
            qb = qg[:, t0:t1].reshape(BHk, n * R, hd)  # (B·Hk, n·R, hd), a view
            out = rows[:, :, t0 * R : t1 * R]  # (_ROWS, B·Hk, n·R)
            n_vis = (torch.arange(t0 + 1, t1 + 1, dtype=dtype, device=dev) if self.causal
                     else torch.full((n,), float(T), dtype=dtype, device=dev))  # (n,) keys
            if nk <= kc:
                self._whole_rows(qb, kk[:, :nk], t0, n, R, n_vis, out, moments, ws)
            else:
                self._online_rows(qb, kk, t0, n, R, nk, kc, n_vis, out, moments)
        w = _row_weights(T, self.causal, dtype, dev)  # (3, T): −1, −1/log n_t, 1{n_t ≥ 2}
        per_row = rows.view(_ROWS, B, Hk, T, R)
        sums = torch.empty(_SUMS + 1, H, dtype=torch.float64, device=dev)
        sums[:2] = torch.einsum("bgtr,wt->wgr", per_row[0], w[:2]).reshape(2, H)
        sums[2] = per_row[1].sum(dim=(0, 2)).reshape(H)
        sums[3:5] = moments.view(2, B, Hk, R).sum(dim=1).reshape(2, H)
        sums[5] = torch.einsum("bgtr,t->gr", per_row[2], w[2]).reshape(H)  # Σ σ_t, n_t ≥ 2
        sums[6] = torch.einsum("bgtr,t->gr", per_row[3], w[0]).reshape(H)  # Σ H_t, scale-free
        sums[7] = torch.einsum("bgtr,t->gr", per_row[5], w[2]).reshape(H)  # Σ p_t0, n_t ≥ 2
        sums[_MAX] = per_row[4].amax(dim=(0, 2)).reshape(H)  # largest visible s
        return sums

    def add_sums(self, sums: Tensor, B: int, T: int) -> None:
        """Add the :meth:`batch_sums` of ``B`` windows of ``T`` positions."""
        self._sums = self._sums.to(sums.device)
        self._sums += sums[:_SUMS]
        self._max = torch.maximum(self._max.to(sums.device), sums[_MAX])
        self.n_queries += B * T
        self.n_queries_norm += B * (T - 1 if self.causal else (T if T >= 2 else 0))
        self.n_pairs += B * visible_pairs(T, self.causal)

    @staticmethod
    def _row_moments(r1: Tensor, r2c: Tensor, n_vis: Tensor, R: int, out: Tensor,
                     moments: Tensor) -> Tensor:
        """From each row's Σ s (``r1``) and Σ (s − mean)² (``r2c``), both (B·Hk, n·R), and
        its visible keys ``n_vis`` (n,): σ_t into ``out[2]``, the pooled Σ s and Σ s² into
        ``moments`` (2, B·Hk, R); returns 1/σ_t (1 for a row of equal logits), (B·Hk, n·R, 1)."""
        nv = n_vis.repeat_interleave(R)  # (n·R,) rows in (position, head) order
        mean = r1 / nv
        sd = (r2c / nv).clamp_min_(0.0).sqrt_()
        out[2].copy_(sd)
        BHk = r1.shape[0]
        moments[0].add_(r1.view(BHk, -1, R).sum(dim=1))
        moments[1].add_((r2c + nv * mean * mean).view(BHk, -1, R).sum(dim=1))
        return torch.where(sd > _TINY_STD, sd.reciprocal(), torch.ones_like(sd))[..., None]

    @staticmethod
    def _entropy_rows(s: Tensor, logp: Tensor, neg_ent: Tensor, top: Tensor | None,
                      peak: Tensor | None = None, first: Tensor | None = None) -> None:
        """Σ p log p of ``softmax(s)`` per row into ``neg_ent`` (non-positive terms: no
        cancellation), with ``top`` the largest weight, with ``peak`` the largest s
        (``log Z + log max p``, ``log Z = s_0 − log p_0``), with ``first`` the weight p_0 of
        column 0; ``s`` is spent (holds p)."""
        torch.log_softmax(s, dim=-1, out=logp)
        if peak is not None:
            torch.sub(s[..., 0], logp[..., 0], out=peak)  # log Z, before the clamp below
        # log p >= log(smallest normal) + 1 keeps p and p log p out of the subnormal range,
        # where exp and mul are far slower on x86; the nats lost are far below round-off.
        logp.clamp_(min=_LOG_TINY[s.dtype])
        p = torch.exp(logp, out=s)
        if first is not None:
            first.copy_(p[..., 0])
        if top is not None:
            torch.amax(p, dim=-1, out=top)
            if peak is not None:
                peak.add_(top.log())
        torch.sum(p.mul_(logp), dim=-1, out=neg_ent)

    def _whole_rows(self, qb: Tensor, kb: Tensor, t0: int, n: int, R: int, n_vis: Tensor,
                    out: Tensor, moments: Tensor, ws: Workspace) -> None:
        """Rows whose visible keys ``kb`` fit one block: the row moments (then the row is centred
        in place) and explicit log softmaxes of the row and of the row divided by σ_t, into
        ``out`` (per row) and ``moments`` (pooled Σ s, Σ s²)."""
        shape = (qb.shape[0], qb.shape[1], kb.shape[1])  # (B·Hk, n·R, nk)
        s = torch.bmm(qb, kb.mT, out=ws.get("entropy.s", shape, qb.dtype, qb.device))
        grid = s.view(-1, n, R, shape[2])  # (B·Hk, n, R, nk)
        causal_block = self.causal and n > 1
        if causal_block:  # keys after the query, only in the last n columns
            lower = _lower(n, s.dtype, s.device)
            diag = ws.get("entropy.diag", (shape[0], n, R, n), s.dtype, s.device)
        if self.softcap is not None:  # not linear in k: the row sums from the capped scores
            softcap_(s, self.softcap)
            if causal_block:
                r1 = torch.mul(grid[..., t0:], lower, out=diag).sum(dim=-1)
                if t0:
                    r1.add_(grid[..., :t0].sum(dim=-1))
                r1 = r1.view(shape[0], -1)
            else:
                r1 = s.sum(dim=-1)
        elif causal_block:
            pre = kb[:, :t0].sum(dim=1) if t0 else None  # (B·Hk, hd): seen by every query
            r1 = torch.bmm(qb, pre[:, :, None])[..., 0] if t0 else None
            d1 = torch.mul(grid[..., t0:], lower, out=diag).sum(dim=-1).view(shape[0], -1)
            r1 = d1 if r1 is None else r1.add_(d1)
        else:
            r1 = torch.bmm(qb, kb.sum(dim=1)[:, :, None])[..., 0]  # (B·Hk, n·R)
        mean = r1 / n_vis.repeat_interleave(R)  # (B·Hk, n·R)
        s.sub_(mean[..., None])  # centred rows: same softmax
        if causal_block:
            r2c = torch.linalg.vector_norm(
                torch.mul(grid[..., t0:], lower, out=diag), dim=-1).square_()
            if t0:
                r2c.add_(torch.linalg.vector_norm(grid[..., :t0], dim=-1).square_())
            r2c = r2c.view(shape[0], -1)
            grid[..., t0:].add_(_upper(n, s.dtype, s.device))
        else:
            r2c = torch.linalg.vector_norm(s, dim=-1).square_()
        inv = self._row_moments(r1, r2c, n_vis, R, out, moments)
        logp = ws.get("entropy.logp", shape, s.dtype, s.device)
        scaled = torch.mul(s, inv, out=ws.get("entropy.sf", shape, s.dtype, s.device))
        self._entropy_rows(scaled, logp, out[3], None)
        self._entropy_rows(s, logp, out[0], out[1], out[4], out[5])
        out[4].add_(mean)  # the largest centred score + the row mean = the largest score

    def _online_rows(self, qb: Tensor, kk: Tensor, t0: int, n: int, R: int, nk: int, kc: int,
                     n_vis: Tensor, out: Tensor, moments: Tensor) -> None:
        """Rows longer than a block, in two passes over key chunks: the row moments (shifted
        by the score of key 0, against cancellation), then the online softmax of the rows
        and of the rows divided by σ_t; ``out`` and ``moments`` as in
        :meth:`_whole_rows`."""
        qpos = torch.arange(t0, t0 + n, device=qb.device)[:, None, None]  # (n, 1, 1)

        def chunks():
            for s0 in range(0, nk, kc):
                s1 = min(nk, s0 + kc)
                s = torch.bmm(qb, kk[:, s0:s1].mT)  # (B·Hk, n·R, kc)
                if self.softcap is not None:
                    softcap_(s, self.softcap)
                later = None
                if self.causal and s1 > t0 + 1:  # keys after a query
                    later = torch.arange(s0, s1, device=s.device) > qpos  # (n, 1, kc)
                yield s, later

        shift = r1 = r2 = None
        for s, later in chunks():
            if shift is None:
                shift = s[..., :1].clone()  # key 0: visible to every query
            d = s.sub_(shift)
            if later is not None:
                d.view(d.shape[0], n, R, -1).masked_fill_(later, 0.0)
            r1 = d.sum(dim=-1) if r1 is None else r1.add_(d.sum(dim=-1))
            sq = torch.linalg.vector_norm(d, dim=-1).square_()
            r2 = sq if r2 is None else r2.add_(sq)
        nv = n_vis.repeat_interleave(R)
        mean_d = r1 / nv  # mean − shift
        r2c = r2 - nv * mean_d * mean_d  # Σ (s − mean)²: the shift keeps it well conditioned
        inv = self._row_moments(r1 + nv * shift[..., 0], r2c, n_vis, R, out, moments)
        raw, scaled = _OnlineSoftmax(), _OnlineSoftmax()
        for s, later in chunks():
            if later is not None:
                s.view(s.shape[0], n, R, -1).masked_fill_(later, _NEG)
            scaled.add((s * inv).clamp_(min=_NEG))  # a masked −1e30 / small σ: not −inf
            raw.add(s)
        out[0].copy_(raw.neg_entropy())
        out[1].copy_(raw.z.reciprocal())  # largest weight
        out[3].copy_(scaled.neg_entropy())
        out[4].copy_(raw.m)  # the largest (raw) score of the row
        torch.exp(shift[..., 0] - raw.m, out=out[5]).div_(raw.z)  # p_0 = e^(s_0 − m) / Z

    def result(self) -> dict[str, Tensor]:
        """``{name: (H,) float64}`` means for the ``ATTENTION_METRICS``."""
        self._require()
        sums = self._sums.cpu()  # (_SUMS, H)
        nan = torch.full((self.n_head,), float("nan"), dtype=torch.float64)
        per_row = self.n_queries_norm
        return dict(zip(ATTENTION_METRICS,
                        (sums[0] / self.n_queries, sums[1] / per_row if per_row else nan,
                         sums[2] / self.n_queries, sums[6] / self.n_queries,
                         sums[5] / per_row if per_row else nan,
                         sums[7] / per_row if per_row else nan), strict=True))

    def _require(self) -> None:
        if self.n_queries == 0:
            raise ValueError("StreamingEntropy has no query positions; call update() first")

    def logit_moments(self) -> tuple[Tensor, Tensor, int]:
        """(Σ s (H,), Σ s² (H,), visible pairs per head) of the scaled logits, float64."""
        self._require()
        sums = self._sums.cpu()
        return sums[3].clone(), sums[4].clone(), self.n_pairs

    def logit_max(self) -> Tensor:
        """(H,) float64 largest visible scaled logit of each head (``logit_max``)."""
        self._require()
        return self._max.cpu().clone()

    def logit_std(self) -> Tensor:
        """(H,) float64 population standard deviation of each head's visible scaled logits
        (``logit_std``); NaN when the sums overflowed (|scores| beyond ~1e150)."""
        s1, s2, n = self.logit_moments()
        return logit_std_from_moments(s1, s2, n)


class _OnlineSoftmax:
    """Running (m, Z, A) of rows of scores seen chunk by chunk (module docstring)."""

    def __init__(self) -> None:
        self.m: Tensor | None = None
        self.z: Tensor | None = None
        self.a: Tensor | None = None

    def add(self, s: Tensor) -> None:
        """Fold in a chunk ``s`` (..., kc) of every row (spent: it is overwritten)."""
        m_new = s.amax(dim=-1) if self.m is None else torch.maximum(self.m, s.amax(dim=-1))
        d = s.sub_(m_new[..., None])  # <= 0 (masked: ≈ −1e30)
        e = d.exp()  # masked entries underflow to exactly 0, so e·d = 0 there
        z_blk, a_blk = e.sum(dim=-1), e.mul_(d).sum(dim=-1)
        if self.m is None:
            self.z, self.a = z_blk, a_blk
        else:
            shift = self.m - m_new  # <= 0
            alpha = shift.exp()
            self.a = alpha * (self.a + shift * self.z) + a_blk
            self.z = alpha * self.z + z_blk
        self.m = m_new

    def neg_entropy(self) -> Tensor:
        """Σ p log p per row = A/Z − log Z."""
        return self.a / self.z - self.z.log()


def logit_std_from_moments(s1: Tensor, s2: Tensor, n: int) -> Tensor:
    """√(Σs²/n − (Σs/n)²) (clamped at 0 against round-off), elementwise, float64; NaN where
    the sums are not finite."""
    mean = s1 / n
    var = (s2 / n - mean * mean).clamp_min(0.0)
    return torch.where(torch.isfinite(s1) & torch.isfinite(s2), var.sqrt(), float("nan"))
