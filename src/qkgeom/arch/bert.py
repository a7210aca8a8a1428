"""Hugging Face BERT-style encoders: ``encoder.layer[i].attention.self.{query, key,
value}`` (separate nn.Linear), no rotary, bidirectional attention."""

from __future__ import annotations

from torch import nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, config_int, layer_list
from qkgeom.arch.hf import capture_hf

__all__ = ["detect"]


def detect(model: nn.Module) -> ModelAdapter | None:
    layers = layer_list(model, ("encoder.layer", "bert.encoder.layer"))
    if layers is None or not hasattr(getattr(layers[0], "attention", None), "self"):
        return None
    sites = []
    for i, layer in enumerate(layers):
        att = layer.attention.self
        sites.append(AttentionSite(i, att, att.query, att.key, att.value,
                                   att.num_attention_heads, att.num_attention_heads,
                                   att.attention_head_size, att.query.in_features))
    causal = bool(getattr(layers[0].attention.self, "is_causal", False))
    return ModelAdapter("bert", model, sites, causal=causal, rotary=False,
                        max_positions=config_int(model, "max_position_embeddings"),
                        capture_fn=capture_hf)
