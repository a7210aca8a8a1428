"""Hugging Face BERT-style encoders: ``encoder.layer[i].attention.self.{query, key,
value}`` (separate nn.Linear), no rotary, bidirectional attention."""

from __future__ import annotations

from torch import nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, blocks_with, config_int
from qkgeom.arch.hf import capture_hf

__all__ = ["detect"]


def _site(i: int, att: nn.Module) -> AttentionSite:
    return AttentionSite(i, att, att.query, att.key, att.value, att.num_attention_heads,
                         att.num_attention_heads, att.attention_head_size, att.query.in_features)


def detect(model: nn.Module) -> ModelAdapter | None:
    layers = blocks_with(model, ("encoder.layer", "bert.encoder.layer"), "attention.self")
    if layers is None:
        return None
    sites = [_site(i, layer.attention.self) for i, layer in enumerate(layers)]
    causal = bool(getattr(layers[0].attention.self, "is_causal", False))
    return ModelAdapter("bert", model, sites, causal=causal, rotary=False,
                        max_positions=config_int(model, "max_position_embeddings"),
                        capture_fn=capture_hf)
