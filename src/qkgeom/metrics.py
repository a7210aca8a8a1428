"""The names of every metric qkgeom records (docs/definitions.md#metrics), torch-free, so
that the alert rules and the analysis can check a name without importing the engine."""

from __future__ import annotations

WEIGHT_METRICS = ("pr_q_weight", "pr_k_weight", "contrast_weight", "pr_qk_weight",
                  "pr_qk_weight_full")
#: From the streamed softmax (:mod:`qkgeom.geometry.entropy`), means over query rows.
ATTENTION_METRICS = ("attn_entropy", "attn_entropy_norm", "attn_max", "attn_entropy_scalefree",
                     "logit_std_row", "sink_mass")
#: The largest query and key norms and the logit bound they give (fused attention's view).
NORM_METRICS = ("q_norm_max", "k_norm_max", "logit_bound")
POST_ROTARY_METRICS = ("pr_q_token_post", "pr_k_token_post", "contrast_token_post")
TOKEN_METRICS = ("pr_q_token", "pr_k_token", "contrast_token", "contrast_token_heads",
                 "pr_qk_token", "logit_std", *ATTENTION_METRICS, "logit_max", "logit_delta",
                 "entropy_min", *NORM_METRICS, *POST_ROTARY_METRICS)
METRIC_NAMES = WEIGHT_METRICS + TOKEN_METRICS
#: Metrics with a layer row (head −1) only: they describe the layer as a whole.
LAYER_ONLY_METRICS = ("pr_qk_weight_full", "contrast_token_heads", "entropy_min")
