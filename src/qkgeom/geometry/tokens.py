"""The one streaming accumulator of a layer's token metrics: :class:`LayerGeometry`.

Every token metric (trainer probes, monitor, checkpoint analysis) goes through it, so a
number means the same thing whichever path produced it. Per batch of captured q (B, H, T,
hd) and k (B, H_kv, T, hd) it folds in the q/k covariances of the heads concatenated (each
head's is a diagonal block), each sequence's logit PR, the streamed softmax sums
(:class:`~qkgeom.geometry.entropy.StreamingEntropy`, through the attention's soft cap if
any), the largest query and key norms, and keeps the first window for the next
measurement's ``logit_delta``. Token blocks, precision, the overflow bounds and GQA:
docs/definitions.md#how-the-metrics-are-computed and #grouped-query-attention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from qkgeom.geometry.covariance import StreamingCovariance, centred_scatter, head_blocks
from qkgeom.geometry.entropy import StreamingEntropy, logit_std_from_moments
from qkgeom.geometry.records import LAYER, Record, token_records
from qkgeom.geometry.spectra import (
    NonFiniteError,
    gram_product_pr,
    pr_from_covariance,
    pr_of_sums,
)
from qkgeom.geometry.workspace import Workspace

__all__ = ["LayerGeometry", "logit_delta", "logit_pr"]

# Largest |activation| whose float64 scatter (sums of squares over ~1e9 tokens) stays finite.
_MAX_ABS_ACTIVATION = 1e140
# |score| bound above which float32 scores, or the sums of their squares (logit_std) over a
# block of up to 2**22 scores, could overflow (float32 max 3.4e38).
_FLOAT32_SAFE = 1e15
_FLOAT32_SCATTER_SAFE = 1e14  # |activation| above which a float32 scatter could overflow


def logit_pr(q: Tensor, k: Tensor) -> Tensor:
    """(B, H) float64 PR of the squared singular values of each sequence's ``Q_h K_hᵀ`` (q
    (B, H, T, hd), k (B, H_kv, T, hd), head h paired with key head h // R); 0.0 for a zero
    matrix.

    Why no SVD: they are the eigenvalues of ``G_q G_k`` (hd × hd Gram matrices), so two
    traces give the PR (:func:`~qkgeom.geometry.spectra.gram_product_pr`; equal to the SVD,
    tested)."""
    B, H, T, hd = q.shape
    Hk = k.shape[1]
    # Gram matrices in the activations' precision (at least float32: T-term sums of
    # products, relative error ~1e-7·√T), everything after in float64.
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.detach().to(dt).unflatten(1, (Hk, H // Hk)).transpose(2, 3)  # (B, Hk, T, R, hd)
    return _logit_pr_prepared(qg.reshape(B * Hk, T, H // Hk, hd),
                              k.detach().to(dt).reshape(B * Hk, T, hd), B)


def _logit_pr_prepared(qg: Tensor, kk: Tensor, B: int) -> Tensor:
    """:func:`logit_pr` from the layouts of :meth:`StreamingEntropy.prepare`: ``qg``
    (B·Hk, T, R, hd) (any common scale), ``kk`` (B·Hk, T, hd). Returns (B, H) float64."""
    BHk, T, R, hd = qg.shape
    if R == 1:
        q2 = qg.view(BHk, T, hd)  # (B·H, T, hd)
        g_q = torch.bmm(q2.mT, q2).view(B, BHk // B, 1, hd, hd)  # (B, Hk, 1, hd, hd)
    else:
        q2 = qg.permute(0, 2, 1, 3)  # (B·Hk, R, T, hd)
        g_q = (q2.mT @ q2).view(B, BHk // B, R, hd, hd)  # (B, Hk, R, hd, hd)
    g_k = torch.bmm(kk.mT, kk).view(B, BHk // B, 1, hd, hd)  # shared by the R query heads
    if qg.dtype == torch.float64:
        return gram_product_pr(g_q, g_k).flatten(1)  # (B, H), rescaled against overflow
    # float32 Grams: products of four of their entries (~1e±180 at worst) stay within
    # float64's range, so the traces need no rescaling (gram_product_pr's formula).
    m = g_q.double() @ g_k.double()  # (B, Hk, R, hd, hd) = G_q G_k
    s1 = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # (B, Hk, R) Σσ²
    s2 = (m * m.mT).sum(dim=(-2, -1))  # (B, Hk, R) Σσ⁴
    return pr_of_sums(s1, s2).flatten(1)  # (B, H)


#: ``logit_delta`` reads the pairs among the first window's first positions: a bounded
#: cost at any context (benchmarks/logit_metrics_cost.py).
DELTA_POSITIONS = 128


def logit_delta(before: tuple[Tensor, Tensor], now: tuple[Tensor, Tensor],
                causal: bool) -> Tensor:
    """(H,) float64 RMS change, over the visible pairs, of one window's row-centred logits
    between ``before`` and ``now`` (each: scaled q (1, H, T, hd), k (1, H_kv, T, hd)); a row
    is centred because the softmax ignores its shift (docs/definitions.md#logit-growth).
    Centring is linear, so the change is centred once: per row Σ c² = Σ d² − (Σ d)²/n."""
    (q0, k0), (q1, k1) = before, now
    R, T = q1.shape[1] // k1.shape[1], q1.shape[2]
    k0, k1 = (k[0].double().repeat_interleave(R, dim=0) for k in (k0, k1))  # (H, T, hd)
    d = torch.baddbmm(q1[0].double() @ k1.mT, q0[0].double(), k0.mT, alpha=-1)  # (H, T, T)
    if causal:
        d.mul_(torch.ones(T, T, dtype=d.dtype, device=d.device).tril_())
    n = (torch.arange(1, T + 1, dtype=d.dtype, device=d.device) if causal
         else torch.full((T,), float(T), dtype=d.dtype, device=d.device))  # (T,) visible keys
    rows = d.sum(dim=-1)  # (H, T)
    ss = d.square_().sum(dim=-1) - rows.square_() / n  # (H, T) Σ c² per row
    return (ss.sum(dim=-1).clamp_min_(0.0) / n.sum()).sqrt_().cpu()


def _peaks(tensors: tuple[Tensor, ...]) -> tuple[dict[int, float], float]:
    """``({id(t): max |t|}, overall max)`` of the distinct tensors in one host sync;
    NonFiniteError for an entry that is non-finite or beyond 1e140."""
    distinct = {id(t): t for t in tensors}  # site = attn: once
    amax = dict(zip(distinct, torch.stack([torch.stack(t.detach().aminmax()).abs().amax()
                                           .double() for t in distinct.values()]).tolist(),
                    strict=True))  # max |x| in one pass, no |x| temporary; NaN stays NaN
    peak = max(amax.values())
    if not peak <= _MAX_ABS_ACTIVATION:  # NaN fails this too
        raise NonFiniteError(f"queries/keys are non-finite or beyond {_MAX_ABS_ACTIVATION:g} "
                             f"(max |entry| {peak:g}): their covariance would overflow")
    return amax, peak


def _length_groups(lengths: Sequence[int] | Tensor, B: int, T: int
                   ) -> list[tuple[int, list[int]]] | None:
    """``[(length, rows)]`` of the sequences of each real length (in order of first
    appearance), or None when every sequence is whole (no padding)."""
    sizes = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    if len(sizes) != B or not all(1 <= n <= T for n in sizes):
        raise ValueError(f"lengths must be {B} numbers in 1..{T}, got {sizes}")
    if all(n == T for n in sizes):
        return None
    groups: dict[int, list[int]] = {}
    for row, n in enumerate(sizes):
        groups.setdefault(n, []).append(row)
    return list(groups.items())


def _cut(tensors: tuple[Tensor, ...], rows: list[int], n: int) -> tuple[Tensor, ...]:
    """The ``rows`` of each (B, heads, T, hd) tensor cut to their first ``n`` positions; a
    tensor passed twice (site = attention q/k) is cut once and stays one tensor."""
    cut: dict[int, Tensor] = {}
    for t in tensors:
        if id(t) not in cut:
            part = t if len(rows) == t.shape[0] else t[torch.tensor(rows, device=t.device)]
            cut[id(t)] = part[:, :, :n]
    return tuple(cut[id(t)] for t in tensors)


class _Totals:
    """The additive state of :class:`LayerGeometry` over some tokens (all of them, or one
    token block): covariances, the entropy/logit sums, the sum of logit PRs, the largest
    query (H,) and key (H_kv,) norms and |scale|, counts."""

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int, causal: bool,
                 post: bool, softcap: float | None) -> None:
        dims = {"q": n_head * head_dim, "k": n_kv_head * head_dim}
        names = ("q", "k", "q_post", "k_post") if post else ("q", "k")
        self.cov = {name: StreamingCovariance(1, dims[name[0]]) for name in names}
        self.entropy = StreamingEntropy(n_head, n_kv_head, causal, softcap=softcap)
        self.sum_pr_qk = torch.zeros(n_head, dtype=torch.float64)
        self.q_norm_max = torch.zeros(n_head, dtype=torch.float64)
        self.k_norm_max = torch.zeros(n_kv_head, dtype=torch.float64)
        self.scale = 0.0  # the largest |scale| seen (one per layer in practice)
        self.n_sequences = 0
        self.n_tokens = 0

    def add(self, B: int, T: int, moments: dict[str, tuple[Tensor, Tensor]],
            pr_qk: Tensor | None, sums: Tensor, norms: tuple[Tensor, Tensor],
            scale: float) -> None:
        """Fold in one batch of ``B`` windows of ``T`` tokens, computed once by the caller."""
        for name, (mean, m2) in moments.items():
            self.cov[name].add_moments(B * T, mean[None], m2[None])  # one group: all heads
        if pr_qk is not None:
            self.sum_pr_qk = self.sum_pr_qk.to(pr_qk.device)
            self.sum_pr_qk += pr_qk
        self.entropy.add_sums(sums, B, T)
        self.q_norm_max = torch.maximum(self.q_norm_max.to(norms[0].device), norms[0])
        self.k_norm_max = torch.maximum(self.k_norm_max.to(norms[1].device), norms[1])
        self.scale = max(self.scale, abs(scale))
        self.n_sequences += B
        self.n_tokens += B * T


class LayerGeometry:
    """Streams one layer's q/k into the token metrics (module docstring).

    ``with_logit_spectrum``: compute ``pr_qk_token`` (else left out). ``workspace``: scratch
    buffers shared by all layers of one measurement. ``with_post``: also keep the covariances
    of the attention's (post-rotary) q/k, for a site whose q/k differ from them.
    ``previous``: the :attr:`window` of the previous measurement, for ``logit_delta``.
    ``softcap``: the attention's c of c·tanh(s/c) on the scaled logits (None: no cap), which
    the softmax statistics read; ``pr_qk_token``, ``logit_delta`` and the norms do not."""

    def __init__(self, n_head: int, n_kv_head: int, head_dim: int, causal: bool = True,
                 with_logit_spectrum: bool = True, workspace: Workspace | None = None,
                 with_post: bool = False,
                 previous: tuple[Tensor, Tensor] | None = None,
                 softcap: float | None = None) -> None:
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.causal, self.with_post, self.softcap = causal, with_post, softcap
        self.with_logit_spectrum = with_logit_spectrum
        self.workspace = workspace
        self.previous = previous
        #: scaled q (1, H, n, hd) and k (1, H_kv, n, hd) of the first window's first
        #: n = min(T, DELTA_POSITIONS) positions, float64
        self.window: tuple[Tensor, Tensor] | None = None
        self._all = self._new_totals()
        self._block: _Totals | None = None

    def _new_totals(self) -> _Totals:
        return _Totals(self.n_head, self.n_kv_head, self.head_dim, self.causal, self.with_post,
                       self.softcap)

    @property
    def n_sequences(self) -> int:
        """Windows measured (all tokens)."""
        return self._all.n_sequences

    @property
    def n_tokens(self) -> int:
        """Token positions measured (all tokens)."""
        return self._all.n_tokens

    @torch.no_grad()
    def update(self, q_site: Tensor, k_site: Tensor, q_attn: Tensor | None = None,
               k_attn: Tensor | None = None, scale: float | None = None,
               lengths: Sequence[int] | Tensor | None = None) -> None:
        """Add a batch: covariances from ``q_site``/``k_site``; logit spectrum, moments and
        entropy from ``q_attn``/``k_attn`` (what the attention computes with, default the same).
        ``scale`` defaults to 1/√hd.

        ``lengths`` (B,): a right-padded batch (:mod:`qkgeom.geometry.padding`). The sequences
        of each length are added as one unpadded batch cut to it, so every statistic of the
        unpadded path holds for padded input with no masked variant. Every part is checked
        finite before any is added, so the accumulator stays usable after a NonFiniteError."""
        q_attn = q_site if q_attn is None else q_attn
        k_attn = k_site if k_attn is None else k_attn
        B, H, T, hd = q_attn.shape
        if (H, hd) != (self.n_head, self.head_dim) or k_attn.shape != (B, self.n_kv_head, T, hd):
            raise ValueError(f"expected q (B, {self.n_head}, T, {self.head_dim}) and k (B, "
                             f"{self.n_kv_head}, T, {self.head_dim}), got {tuple(q_attn.shape)} "
                             f"and {tuple(k_attn.shape)}")
        scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
        groups = _length_groups(lengths, B, T) if lengths is not None else None
        if groups is None:
            self._add(q_site, k_site, q_attn, k_attn, scale)
            return
        parts = [_cut((q_site, k_site, q_attn, k_attn), rows, n) for n, rows in groups]
        for part in parts:  # every group checked before any is added
            _peaks(part)
        for part in parts:
            self._add(*part, scale)

    def _add(self, q_site: Tensor, k_site: Tensor, q_attn: Tensor, k_attn: Tensor,
             scale: float) -> None:
        """:meth:`update` of an unpadded batch (arguments checked)."""
        B, H, T, hd = q_attn.shape
        amax, peak = _peaks((q_site, k_site, q_attn, k_attn))
        bound = amax[id(q_attn)] * amax[id(k_attn)] * hd * abs(scale)  # |score| bound
        post = (q_attn, k_attn)  # the covariances of the post-rotary q/k (with_post)
        if q_attn.dtype != torch.float64 and bound > _FLOAT32_SAFE:
            q_attn, k_attn = q_attn.double(), k_attn.double()  # float32 scores would overflow
        if q_site.dtype != torch.float64 and peak > _FLOAT32_SCATTER_SAFE:
            q_site, k_site = q_site.double(), k_site.double()  # so would a float32 scatter
            post = (post[0].double(), post[1].double())
        ws = self.workspace or Workspace()
        sources = {"q": q_site, "k": k_site}
        if self.with_post:
            sources.update(q_post=post[0], k_post=post[1])
        moments = {name: centred_scatter(x.transpose(1, 2), ws, f"cov.{name}", 2)
                   for name, x in sources.items()}  # rows (B, T), heads·hd
        if self.window is None:  # the first window, for the next measurement's logit_delta
            n = DELTA_POSITIONS  # its first positions: a bounded cost at any context
            self.window = ((q_attn[:1, :, :n] * scale).detach().double().clone(),
                           k_attn[:1, :, :n].detach().double().clone())
        qg, kk = self._all.entropy.prepare(q_attn, k_attn, scale, ws)  # (B·Hk, T, R, hd), (B·Hk, T, hd)
        pr_qk = _logit_pr_prepared(qg, kk, B).sum(dim=0) if self.with_logit_spectrum else None
        sums = self._all.entropy.batch_sums(qg, kk, B, workspace=ws)  # (9, H)
        norms = tuple(torch.linalg.vector_norm(x.detach(), dim=-1, dtype=torch.float64)
                      .amax(dim=(0, 2)) for x in (q_attn, k_attn))  # (H,), (H_kv,): ‖q‖, ‖k‖
        for totals in (self._all, self._block):
            if totals is not None:
                totals.add(B, T, moments, pr_qk, sums, norms, scale)

    def begin_block(self) -> None:
        """Start a token block: the next batches also count towards it, until
        :meth:`end_block` (blocks do not overlap)."""
        if self._block is not None:
            raise ValueError("a token block is open; end_block() it first")
        self._block = self._new_totals()

    def end_block(self) -> list[Record]:
        """Records of the token block that is open (as :meth:`records`), which is closed."""
        if self._block is None:
            raise ValueError("no token block is open; call begin_block() first")
        block, self._block = self._block, None
        return self._records(block)

    def records(self) -> list[Record]:
        """Records of the token metrics over all tokens, query heads 0..H−1 then −1 (layer)."""
        return self._records(self._all)

    def _records(self, t: _Totals) -> list[Record]:
        if t.n_sequences == 0:
            raise ValueError("LayerGeometry has no tokens; call update() first")
        H, R = self.n_head, self.n_head // self.n_kv_head
        scatter = {name: cov.scatter()[0] for name, cov in t.cov.items()}  # up to a scale
        heads = {name: pr_from_covariance(head_blocks(m, H if name[0] == "q" else self.n_kv_head))
                 .cpu().repeat_interleave(1 if name[0] == "q" else R)
                 for name, m in scatter.items()}  # (H,) per query head: key head h // R
        layer = {name: float(pr_from_covariance(m)) for name, m in scatter.items()}
        pr_qk = (t.sum_pr_qk.cpu() / t.n_sequences if self.with_logit_spectrum
                 else torch.full((H,), float("nan"), dtype=torch.float64))
        attn = t.entropy.result()
        s1, s2, pairs = t.entropy.logit_moments()
        q_norm, k_norm = t.q_norm_max.cpu(), t.k_norm_max.cpu().repeat_interleave(R)  # (H,)
        per_head = {"pr_qk_token": pr_qk, "logit_std": logit_std_from_moments(s1, s2, pairs),
                    "logit_max": t.entropy.logit_max(), **attn, "q_norm_max": q_norm,
                    "k_norm_max": k_norm, "logit_bound": q_norm * k_norm * t.scale,
                    **{f"pr_{name[0]}_token" + name[1:]: v for name, v in heads.items()}}
        delta = self._delta() if t is self._all else None
        if delta is not None:
            per_head["logit_delta"] = delta
        out: list[Record] = []
        for h in range(H):
            out += token_records(h, {name: float(v[h]) for name, v in per_head.items()})
        whole = {name: float(v.mean()) for name, v in per_head.items()}  # head means...
        whole.update({f"pr_{name[0]}_token" + name[1:]: v for name, v in layer.items()})
        whole["contrast_token_heads"] = float((heads["q"] - heads["k"]).mean())
        whole["logit_std"] = float(logit_std_from_moments(s1.sum(), s2.sum(), pairs * H))
        whole["entropy_min"] = float(attn["attn_entropy"].min())
        for name in ("logit_max", "q_norm_max", "k_norm_max", "logit_bound"):
            whole[name] = float(per_head[name].max())
        if delta is not None:  # RMS over every head's pairs
            whole["logit_delta"] = float(delta.square().mean().sqrt())
        return out + token_records(LAYER, whole)

    def _delta(self) -> Tensor | None:
        """``logit_delta`` per head against :attr:`previous`, or None without one (or when
        its window is not this measurement's shape)."""
        if self.previous is None or self.window is None or any(
                a.shape != b.shape for a, b in zip(self.previous, self.window, strict=True)):
            return None
        before = tuple(t.to(self.window[0].device) for t in self.previous)
        return logit_delta(before, self.window, self.causal)

    def key_covariance(self) -> Tensor:
        """(H_kv·hd, H_kv·hd) float64 covariance of the layer's keys (all tokens)."""
        return self._all.cov["k"].covariance()[0]
