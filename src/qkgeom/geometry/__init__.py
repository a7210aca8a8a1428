"""Pure tensor geometry metrics of attention queries and keys.

Nothing here knows about training or a model class: functions take tensors (weights in
``nn.Linear`` layout, per-head q/k activations ``(B, H, T, hd)``) and return numbers,
tensors or long records ``(head, metric, value)`` (head −1 = whole layer). Metric names
follow SPEC section 2 exactly (see ``METRIC_NAMES``).
"""

from qkgeom.geometry.attention import ATTENTION_METRICS, AttentionStats
from qkgeom.geometry.covariance import StreamingCovariance
from qkgeom.geometry.records import (
    LAYER,
    METRIC_NAMES,
    TOKEN_METRICS,
    WEIGHT_METRICS,
    Record,
    TokenGeometry,
    records_to_frame,
    weight_records,
)
from qkgeom.geometry.spectra import (
    NonFiniteError,
    interaction_singular_values,
    logit_singular_values,
    participation_ratio,
    pr_from_covariance,
    product_singular_values,
    weight_pr,
)

__all__ = [
    "ATTENTION_METRICS",
    "LAYER",
    "METRIC_NAMES",
    "TOKEN_METRICS",
    "WEIGHT_METRICS",
    "AttentionStats",
    "NonFiniteError",
    "Record",
    "StreamingCovariance",
    "TokenGeometry",
    "interaction_singular_values",
    "logit_singular_values",
    "participation_ratio",
    "pr_from_covariance",
    "product_singular_values",
    "records_to_frame",
    "weight_pr",
    "weight_records",
]
