"""Layer-level assembly of the geometry metrics into long records.

Every measurement goes through :func:`weight_records` and
:class:`~qkgeom.geometry.tokens.LayerGeometry` (whose records :func:`token_records` lays
out), so one layer's metrics mean the same thing whichever model produced them. A record is ``(head, metric, value)`` with
``head = -1`` for the whole layer; :func:`records_to_frame` turns ``{layer: records}`` into
the long ``layer, head, metric, value`` table that ``metrics.parquet`` stores.

Layer-level definitions (head = −1):

- ``pr_q_weight`` / ``pr_k_weight``: PR of the squared singular values of the full
  ``W_Q`` / ``W_K`` (d_model × d_out).
- ``pr_qk_weight``: mean over heads of the head values, the same rule as ``pr_qk_token``;
  ``pr_qk_weight_full`` (layer row only): PR of the squared singular values of the whole
  ``W_Q W_Kᵀ`` (d_model × d_model).
- ``pr_q_token`` / ``pr_k_token``: PR of the covariance of all heads concatenated (d_out;
  the H_kv distinct key heads under GQA); ``contrast_token`` their difference (biased
  upwards under GQA: the key side has fewer dimensions).
- ``contrast_token_heads`` (layer row only): mean over query heads h of
  ``pr_q_token[h] − pr_k_token[h]`` (key head h // R), the GQA-fair layer contrast.
- ``pr_qk_token`` and ``attn_*``: mean over heads of the per-head values.
- ``logit_std``: standard deviation of the scaled logits over all heads' pairs pooled.
- ``logit_max``: the largest scaled logit of any head; ``logit_delta``: the RMS over every
  head's pairs of the heads' change since the previous measurement (per head: the change
  of that head's row-centred logits on the probe set's first window).
- ``pr_q_token_post`` / ``pr_k_token_post`` / ``contrast_token_post``: the token PRs of the
  post-rotary q/k, recorded only when the token PRs come from another site (pre-rotary on
  a rotary model).
- ``contrast_*`` = ``pr_q_*`` − ``pr_k_*`` at every level.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from qkgeom.geometry.spectra import product_pr, require_finite, split_heads, weight_pr
from qkgeom.metrics import (
    LAYER_ONLY_METRICS,
    METRIC_NAMES,
    POST_ROTARY_METRICS,
    TOKEN_METRICS,
    WEIGHT_METRICS,
)

__all__ = [
    "LAYER",
    "LAYER_ONLY_METRICS",
    "METRIC_NAMES",
    "POST_ROTARY_METRICS",
    "TOKEN_METRICS",
    "WEIGHT_METRICS",
    "Record",
    "records_to_frame",
    "token_records",
    "weight_records",
]

Record = tuple[int, str, float]
LAYER = -1  # the ``head`` value of a whole-layer record




@torch.no_grad()
def weight_records(w_q: Tensor, w_k: Tensor, n_head: int) -> list[Record]:
    """Weight-level geometry of one attention layer, per head and for the layer.

    Why: the weight PRs, paired contrast and interaction PR read straight from the
    raw projection weights (no LayerNorm folding), so they are cheap enough to log at every
    probe step.

    Args:
        w_q, w_k: (d_out, d_model) nn.Linear weights, d_out = n_head * head_dim.
    Returns:
        Records ``(head, metric, value)`` of the ``WEIGHT_METRICS``, heads 0..H−1 then −1
        (layer; ``pr_qk_weight_full`` there only). PR values are dimensionless "numbers of
        directions".
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
    pr_q = weight_pr(split_heads(wq, n_head))  # (H,)
    pr_k = weight_pr(split_heads(wk, n_head))  # (H,)
    # Interaction PRs from hd × hd Gram products (no QR/SVD; equal to the SVD route).
    pr_qk = product_pr(split_heads(wq, n_head), split_heads(wk, n_head))  # (H,)
    out: list[Record] = []
    for h in range(n_head):
        out += _weight_block(h, float(pr_q[h]), float(pr_k[h]), float(pr_qk[h]))
    # Layer: pr_qk is the mean of the heads (the rule of pr_qk_token); the full
    # W_Q W_Kᵀ = w_q.T @ w_k (d_model × d_model, rank <= d_out) is pr_qk_weight_full.
    out += _weight_block(LAYER, float(weight_pr(wq)), float(weight_pr(wk)), float(pr_qk.mean()))
    out.append((LAYER, "pr_qk_weight_full", float(product_pr(wq.mT, wk.mT))))
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


def token_records(head: int, values: Mapping[str, float]) -> list[Record]:
    """The token records of one head (or the layer), in ``TOKEN_METRICS`` order.

    ``values`` holds the measured quantities by metric name; the contrasts
    ``contrast_token`` and ``contrast_token_post`` are derived here from their PRs (one
    definition). A value that is missing or undefined (NaN: ``pr_qk_token`` not computed,
    ``attn_entropy_norm`` when no query ever saw two keys, the ``_post`` metrics of a model
    without rotary) is left out, so a results file never holds a NaN without a reason.
    """
    vals = dict(values)
    for contrast, q, k in (("contrast_token", "pr_q_token", "pr_k_token"),
                           ("contrast_token_post", "pr_q_token_post", "pr_k_token_post")):
        if q in vals and k in vals:
            vals[contrast] = vals[q] - vals[k]
    return [(head, name, float(vals[name])) for name in TOKEN_METRICS
            if name in vals and not math.isnan(vals[name])]


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
