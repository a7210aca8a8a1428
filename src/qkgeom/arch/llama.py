"""Hugging Face Llama-style decoders (Llama, Mistral, Qwen2/3, ...): separate ``q_proj`` /
``k_proj`` / ``v_proj`` per layer, rotary, grouped-query attention (``k_proj`` has H_kv
heads), and per-head ``q_norm`` / ``k_norm`` where the model has them (their outputs are
the pre-rotary q/k). Causal."""

from __future__ import annotations

from torch import nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, blocks_with, config_int
from qkgeom.arch.hf import capture_hf
from qkgeom.errors import QKGeomError

__all__ = ["detect"]


def detect(model: nn.Module) -> ModelAdapter | None:
    layers = blocks_with(model, ("model.layers", "layers", "model.model.layers"),
                         "self_attn.k_proj")
    if layers is None or not isinstance(layers[0].self_attn.k_proj, nn.Linear):
        return None
    cfg = model.config
    sites = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        hd = int(getattr(attn, "head_dim", 0) or cfg.hidden_size // cfg.num_attention_heads)
        n_q, n_kv = attn.q_proj.out_features // hd, attn.k_proj.out_features // hd
        if n_q % n_kv:
            raise QKGeomError(f"layer {i}: {n_q} query heads are not a multiple of {n_kv} "
                              "key heads")
        sites.append(AttentionSite(i, attn, attn.q_proj, attn.k_proj, attn.v_proj, n_q, n_kv,
                                   hd, attn.k_proj.in_features, getattr(attn, "q_norm", None),
                                   getattr(attn, "k_norm", None)))
    return ModelAdapter("llama", model, sites, causal=True, rotary=True,
                        max_positions=config_int(model, "max_position_embeddings"),
                        capture_fn=capture_hf)
