"""Records ``(head, metric, value)`` of one layer (head −1 = the layer) and the long
``layer, head, metric, value`` table that ``metrics.parquet`` stores.

Every measurement goes through :func:`weight_records` and :func:`token_records`, so a layer's
metrics mean the same thing whatever model produced them. How each layer value is formed from
the heads: the table of docs/definitions.md#metrics.
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
    "LAYER", "LAYER_ONLY_METRICS", "METRIC_NAMES", "POST_ROTARY_METRICS", "TOKEN_METRICS",
    "WEIGHT_METRICS", "Record", "records_to_frame", "token_records", "weight_records"
]

Record = tuple[int, str, float]
LAYER = -1  # the ``head`` value of a whole-layer record


@torch.no_grad()
def weight_records(w_q: Tensor, w_k: Tensor, n_head: int) -> list[Record]:
    """Records of the ``WEIGHT_METRICS`` of one layer from its (d_out, d_model) ``w_q``,
    ``w_k``: heads 0..H−1, then the layer (``pr_qk_weight_full`` there only). Read from the raw
    weights, so cheap enough for every probe; NonFiniteError for inf/NaN weights."""
    if w_q.shape != w_k.shape or w_q.ndim != 2:
        raise ValueError(f"w_q {tuple(w_q.shape)} and w_k {tuple(w_k.shape)} must be equal 2-D")
    require_finite("W_Q/W_K weights", w_q, w_k)
    # Each factor divided by its largest |entry| (every PR is scale free): no overflow.
    wq = _unit_max(w_q.detach().to(torch.float64))  # (d_out, d_model)
    wk = _unit_max(w_k.detach().to(torch.float64))  # (d_out, d_model)
    pr_q = weight_pr(split_heads(wq, n_head))  # (H,)
    pr_k = weight_pr(split_heads(wk, n_head))  # (H,)
    pr_qk = product_pr(split_heads(wq, n_head), split_heads(wk, n_head))  # (H,)
    out: list[Record] = []
    for h in range(n_head):
        out += _weight_block(h, float(pr_q[h]), float(pr_k[h]), float(pr_qk[h]))
    # Layer: pr_qk is the heads' mean; the whole W_Q W_Kᵀ is pr_qk_weight_full.
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
    """The token records of one head (or the layer), in ``TOKEN_METRICS`` order, the contrasts
    derived here from their PRs (one definition). A missing or NaN value (not computed,
    undefined, no rotary) is left out, so a results file never holds a NaN without a reason."""
    vals = dict(values)
    for contrast, q, k in (("contrast_token", "pr_q_token", "pr_k_token"),
                           ("contrast_token_post", "pr_q_token_post", "pr_k_token_post")):
        if q in vals and k in vals:
            vals[contrast] = vals[q] - vals[k]
    return [(head, name, float(vals[name])) for name in TOKEN_METRICS
            if name in vals and not math.isnan(vals[name])]


def records_to_frame(records_by_layer: Mapping[int, Sequence[Record]], **columns: Any):
    """The long table ``[*columns], layer, head, metric, value`` (int64, int64, str, float64)
    of ``{layer: records}``; ``columns`` become constant columns in front, in order."""
    import pandas as pd

    for name in columns:
        if name in ("layer", "head", "metric", "value"):
            raise ValueError(f"constant column {name!r} clashes with a record column")
    rows = [(layer, head, metric, value) for layer, recs in records_by_layer.items()
            for head, metric, value in recs]
    frame = pd.DataFrame(rows, columns=["layer", "head", "metric", "value"]).astype(
        {"layer": "int64", "head": "int64", "metric": str, "value": "float64"})
    for i, (name, value) in enumerate(columns.items()):
        frame.insert(i, name, [value] * len(frame))
    return frame
