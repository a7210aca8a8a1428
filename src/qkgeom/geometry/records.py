"""Layer-level assembly of the geometry metrics into long records.

Every caller (our GPT's probes during training, the HF checkpoint analysis) goes through
:func:`weight_records` and :class:`TokenGeometry`, so one layer's metrics mean the same
thing whichever model produced them. A record is ``(head, metric, value)`` with
``head = -1`` for the whole layer; :func:`records_to_frame` turns ``{layer: records}`` into
the long ``layer, head, metric, value`` table that ``metrics.parquet`` stores.

Layer-level definitions (head = −1):

- ``pr_q_weight`` / ``pr_k_weight``: PR of the squared singular values of the full
  ``W_Q`` / ``W_K`` (d_model × d_out).
- ``pr_qk_weight``: PR of the squared singular values of ``W_Q W_Kᵀ`` (d_model × d_model).
- ``pr_q_token`` / ``pr_k_token``: PR of the covariance of all heads concatenated (d_out).
- ``pr_qk_token`` and ``attn_*``: mean over heads of the per-head values.
- ``contrast_*`` = ``pr_q_*`` − ``pr_k_*`` at every level.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from qkgeom.geometry.attention import ATTENTION_METRICS, AttentionStats
from qkgeom.geometry.covariance import StreamingCovariance
from qkgeom.geometry.spectra import (
    NonFiniteError,
    _split_heads,
    logit_singular_values,
    participation_ratio,
    product_pr,
    require_finite,
    weight_pr,
)

__all__ = [
    "LAYER",
    "METRIC_NAMES",
    "TOKEN_METRICS",
    "WEIGHT_METRICS",
    "Record",
    "TokenGeometry",
    "records_to_frame",
    "weight_records",
]

Record = tuple[int, str, float]
LAYER = -1  # the ``head`` value of a whole-layer record

WEIGHT_METRICS = ("pr_q_weight", "pr_k_weight", "contrast_weight", "pr_qk_weight")
TOKEN_METRICS = ("pr_q_token", "pr_k_token", "contrast_token", "pr_qk_token", *ATTENTION_METRICS)
METRIC_NAMES = WEIGHT_METRICS + TOKEN_METRICS

# Bound on the float64 elements one chunk of the per-sequence logit SVD may hold.
_MAX_SVD_ELEMENTS = 2**22
# Largest |activation| whose float64 scatter (sums of squares over ~1e9 tokens) stays finite.
_MAX_ABS_ACTIVATION = 1e140


@torch.no_grad()
def weight_records(w_q: Tensor, w_k: Tensor, n_head: int) -> list[Record]:
    """Weight-level geometry of one attention layer, per head and for the layer.

    Why: the SPEC's weight PRs, paired contrast and interaction PR read straight from the
    raw projection weights (no LayerNorm folding), so they are cheap enough to log at every
    probe step.

    Args:
        w_q, w_k: (d_out, d_model) nn.Linear weights, d_out = n_head * head_dim.
    Returns:
        Records ``(head, metric, value)`` for the four ``WEIGHT_METRICS``, heads 0..H−1
        then −1 (layer). PR values are dimensionless "numbers of directions".
    Raises:
        NonFiniteError: if a weight is inf or NaN (a diverged model has no geometry).
    """
    if w_q.shape != w_k.shape or w_q.ndim != 2:
        raise ValueError(f"w_q {tuple(w_q.shape)} and w_k {tuple(w_k.shape)} must be equal 2-D")
    require_finite("W_Q/W_K weights", w_q, w_k)
    # Each factor divided by its largest |entry|: every PR is scale invariant, and the
    # interaction spectrum of weights near 1e±200 neither overflows nor underflows.
    wq = _unit_max(w_q.detach().to(torch.float64))  # (d_out, d_model)
    wk = _unit_max(w_k.detach().to(torch.float64))  # (d_out, d_model)
    pr_q = weight_pr(_split_heads(wq, n_head))  # (H,)
    pr_k = weight_pr(_split_heads(wk, n_head))  # (H,)
    # Interaction PRs from hd × hd Gram products (no QR/SVD; equal to the SVD route).
    pr_qk = product_pr(_split_heads(wq, n_head), _split_heads(wk, n_head))  # (H,)
    out: list[Record] = []
    for h in range(n_head):
        out += _weight_block(h, float(pr_q[h]), float(pr_k[h]), float(pr_qk[h]))
    # Layer: W_Q W_Kᵀ = w_q.T @ w_k, d_model × d_model, rank <= d_out.
    out += _weight_block(
        LAYER, float(weight_pr(wq)), float(weight_pr(wk)), float(product_pr(wq.mT, wk.mT))
    )
    return out


def _unit_max(x: Tensor) -> Tensor:
    """``x`` divided by its largest |entry| (unchanged when all zero)."""
    m = x.abs().amax()
    return x / m if bool(m > 0) else x


def _weight_block(head: int, pr_q: float, pr_k: float, pr_qk: float) -> list[Record]:
    return [
        (head, "pr_q_weight", pr_q),
        (head, "pr_k_weight", pr_k),
        (head, "contrast_weight", pr_q - pr_k),
        (head, "pr_qk_weight", pr_qk),
    ]


class TokenGeometry:
    """Per-layer accumulator of the token-level metrics over a probe set or corpus.

    Streams, per head and for the layer (heads concatenated), the float64 covariance of
    queries and of keys; per head the mean over sequences of the PR of the squared
    singular values of ``Q_h K_hᵀ/√hd``; and the attention statistics of
    :class:`AttentionStats`. Memory is O(d_out² + H·hd²) whatever the number of tokens.

    Args:
        n_head, head_dim: layout of the q/k tensors passed to :meth:`update`.
        causal: causal attention (decoders); ``False`` for bidirectional encoders.
    """

    def __init__(self, n_head: int, head_dim: int, causal: bool = True):
        self.n_head = n_head
        self.head_dim = head_dim
        self.causal = causal
        d_out = n_head * head_dim
        self.cov_q_head = StreamingCovariance(n_head, head_dim)
        self.cov_k_head = StreamingCovariance(n_head, head_dim)
        self.cov_q_layer = StreamingCovariance(1, d_out)
        self.cov_k_layer = StreamingCovariance(1, d_out)
        self.attention = AttentionStats(n_head, causal=causal)
        self._sum_pr_qk = torch.zeros(n_head, dtype=torch.float64)  # (H,)
        self.n_sequences = 0  # sequences with at least one real token

    @torch.no_grad()
    def update(
        self,
        q: Tensor,
        k: Tensor,
        attention_mask: Tensor | None = None,
        scale: float | None = None,
    ) -> None:
        """Add a batch of sequences.

        Args:
            q, k: (B, H, T, hd) per-head queries and keys, after bias (and rotary, if the
                caller wants it), any float dtype and device.
            attention_mask: optional (B, T), nonzero = real token (HF convention). Padding
                tokens are left out of the covariances, the logit matrices and the
                attention statistics.
            scale: logit scale for the attention softmax and the logit matrix, default
                1/√hd (PR of the logit spectrum does not depend on it).

        Raises:
            NonFiniteError: if q or k holds inf or NaN or entries beyond 1e140 (checked
                before anything is accumulated, so the accumulator stays usable).
        """
        if q.ndim != 4 or k.shape != q.shape:
            raise ValueError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} must be equal (B, H, T, hd)"
            )
        B, H, T, hd = q.shape
        if (H, hd) != (self.n_head, self.head_dim):
            raise ValueError(f"expected (H, hd) = {(self.n_head, self.head_dim)}, got {(H, hd)}")
        q = q.detach()
        k = k.detach()
        peak = max(float(q.abs().amax()), float(k.abs().amax())) if q.numel() else 0.0
        if not peak <= _MAX_ABS_ACTIVATION:  # NaN fails this too
            raise NonFiniteError(f"queries/keys are non-finite or beyond {_MAX_ABS_ACTIVATION:g} "
                                 f"(max |entry| {peak:g}): their covariance would overflow")
        valid = None if attention_mask is None else attention_mask.to(q.device).bool()  # (B, T)

        # Covariances: one row per real token.
        q_heads = q.permute(1, 0, 2, 3).reshape(H, B * T, hd)  # (H, B*T, hd)
        k_heads = k.permute(1, 0, 2, 3).reshape(H, B * T, hd)  # (H, B*T, hd)
        q_layer = q.permute(0, 2, 1, 3).reshape(1, B * T, H * hd)  # (1, B*T, d_out)
        k_layer = k.permute(0, 2, 1, 3).reshape(1, B * T, H * hd)  # (1, B*T, d_out)
        if valid is not None:
            keep = valid.reshape(B * T)  # (B*T,)
            q_heads, k_heads = q_heads[:, keep], k_heads[:, keep]  # (H, N, hd)
            q_layer, k_layer = q_layer[:, keep], k_layer[:, keep]  # (1, N, d_out)
        self.cov_q_head.update(q_heads)
        self.cov_k_head.update(k_heads)
        self.cov_q_layer.update(q_layer)
        self.cov_k_layer.update(k_layer)

        # Logit spectra, per sequence; padding rows zeroed only add zero singular values.
        if valid is not None:
            zero = valid[:, None, :, None]  # (B, 1, T, 1)
            q = q * zero  # (B, H, T, hd)
            k = k * zero  # (B, H, T, hd)
            seq_ok = valid.any(dim=1)  # (B,)
        else:
            seq_ok = torch.ones(B, dtype=torch.bool, device=q.device)  # (B,)
        # QR route holds O(T·hd) per head; the explicit route (hd >= T) O(T²) <= O(T·hd).
        # PR is scale invariant: unit-max factors keep huge/tiny activations in range.
        qn, kn = _unit_max(q.to(torch.float64)), _unit_max(k.to(torch.float64))  # (B, H, T, hd)
        step = max(1, _MAX_SVD_ELEMENTS // (H * T * hd))
        sum_pr = torch.zeros(H, dtype=torch.float64)  # (H,)
        for b0 in range(0, B, step):
            sv = logit_singular_values(qn[b0 : b0 + step], kn[b0 : b0 + step], scale)  # (b, H, r)
            pr = participation_ratio(sv**2)  # (b, H)
            sum_pr += (pr * seq_ok[b0 : b0 + step, None]).sum(dim=0).cpu()
        self._sum_pr_qk += sum_pr
        self.n_sequences += int(seq_ok.sum())

        self.attention.update(q, k, scale=scale, attention_mask=valid)

    def records(self) -> list[Record]:
        """Records for the seven ``TOKEN_METRICS``, heads 0..H−1 then −1 (layer).

        PR values are dimensionless; ``attn_entropy`` is in nats.

        Raises:
            ValueError: if nothing has been accumulated.
        """
        if self.n_sequences == 0:
            raise ValueError("TokenGeometry has no tokens; call update() first")
        pr_q = self.cov_q_head.pr().cpu()  # (H,)
        pr_k = self.cov_k_head.pr().cpu()  # (H,)
        pr_qk = self._sum_pr_qk / self.n_sequences  # (H,)
        attn = {name: v.cpu() for name, v in self.attention.result().items()}  # (H,) each
        out: list[Record] = []
        for h in range(self.n_head):
            out += _token_block(
                h,
                float(pr_q[h]),
                float(pr_k[h]),
                float(pr_qk[h]),
                {n: float(v[h]) for n, v in attn.items()},
            )
        layer_attn = {n: float(v.mean()) for n, v in attn.items()}
        out += _token_block(
            LAYER,
            float(self.cov_q_layer.pr()[0]),
            float(self.cov_k_layer.pr()[0]),
            float(pr_qk.mean()),
            layer_attn,
        )
        return out


def _token_block(
    head: int, pr_q: float, pr_k: float, pr_qk: float, attn: Mapping[str, float]
) -> list[Record]:
    """The token records of one head (or the layer). ``attn_entropy_norm`` is left out
    when it is undefined (NaN: no query ever saw two keys, e.g. length-1 sequences), so a
    results file never holds a NaN without a reason."""
    return [
        (head, "pr_q_token", pr_q),
        (head, "pr_k_token", pr_k),
        (head, "contrast_token", pr_q - pr_k),
        (head, "pr_qk_token", pr_qk),
        *((head, name, attn[name]) for name in ATTENTION_METRICS if not math.isnan(attn[name])),
    ]


def records_to_frame(records_by_layer: Mapping[int, Sequence[Record]], **columns: Any):
    """Long-format table ``[*columns], layer, head, metric, value`` of layer records.

    Why: ``metrics.parquet`` and every analysis read this one shape. Keyword arguments
    become constant columns in front (e.g. ``run_id="r1", step=500``), in the order given.

    Returns:
        pandas.DataFrame with int64 ``layer``/``head``, str ``metric``, float64 ``value``.
    """
    import pandas as pd

    for name in columns:
        if name in ("layer", "head", "metric", "value"):
            raise ValueError(f"constant column {name!r} clashes with a record column")
    rows = [
        (layer, head, metric, value)
        for layer, recs in records_by_layer.items()
        for head, metric, value in recs
    ]
    frame = pd.DataFrame(
        {
            "layer": pd.Series([r[0] for r in rows], dtype="int64"),
            "head": pd.Series([r[1] for r in rows], dtype="int64"),
            "metric": pd.Series([r[2] for r in rows], dtype=str),
            "value": pd.Series([float(r[3]) for r in rows], dtype="float64"),
        }
    )
    for i, (name, value) in enumerate(columns.items()):
        frame.insert(i, name, [value] * len(frame))
    return frame
