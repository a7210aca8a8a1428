"""Q/K geometry: pure metrics, the one streaming measurement engine, and ``measure``.

From the bottom: :mod:`.spectra` (PRs of spectra), :mod:`.covariance` and :mod:`.entropy`
(the streamed sums), :mod:`.tokens` (a layer's token metrics), :mod:`.records` (the long
table), :mod:`.measure` (any supported model on token windows). docs/definitions.md.
"""

from qkgeom.geometry.covariance import StreamingCovariance, centred_scatter, head_blocks
from qkgeom.geometry.entropy import ATTENTION_METRICS, StreamingEntropy, visible_pairs
from qkgeom.geometry.measure import Measurement, measure, measure_batches, resolve_metrics
from qkgeom.geometry.records import (
    LAYER,
    LAYER_ONLY_METRICS,
    METRIC_NAMES,
    POST_ROTARY_METRICS,
    TOKEN_METRICS,
    WEIGHT_METRICS,
    Record,
    records_to_frame,
    token_records,
    weight_records,
)
from qkgeom.geometry.spectra import (
    NonFiniteError,
    gram_product_pr,
    interaction_singular_values,
    logit_singular_values,
    participation_ratio,
    pr_from_covariance,
    product_pr,
    product_singular_values,
    weight_pr,
)
from qkgeom.geometry.state import frozen_training_state
from qkgeom.geometry.tokens import LayerGeometry, logit_pr

__all__ = [
    "ATTENTION_METRICS", "LAYER", "LAYER_ONLY_METRICS", "METRIC_NAMES", "POST_ROTARY_METRICS",
    "TOKEN_METRICS", "WEIGHT_METRICS",
    "LayerGeometry", "Measurement", "NonFiniteError", "Record", "StreamingCovariance",
    "StreamingEntropy", "centred_scatter", "frozen_training_state", "gram_product_pr",
    "head_blocks", "interaction_singular_values", "logit_pr", "logit_singular_values",
    "measure", "measure_batches", "participation_ratio", "pr_from_covariance", "product_pr",
    "product_singular_values", "records_to_frame", "resolve_metrics", "token_records",
    "visible_pairs", "weight_pr", "weight_records",
]
