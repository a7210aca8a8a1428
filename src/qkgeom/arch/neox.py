"""Hugging Face GPT-NeoX / Pythia: one fused ``query_key_value`` (nn.Linear of weight
(3·d_model, d_model)) per layer, interleaved per head: the model views its output as
(…, H, 3·hd), so head ``h`` owns rows ``[q_h; k_h; v_h]`` = ``h·3hd : (h+1)·3hd``. Partial
rotary on the first ``rotary_ndims`` dims of each head; causal."""

from __future__ import annotations

from torch import Tensor, nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, config_int, layer_list
from qkgeom.arch.hf import capture_hf

__all__ = ["InterleavedQKVSite", "detect"]

_PART = {"q": 0, "k": 1, "v": 2}


class InterleavedQKVSite(AttentionSite):
    """q_h, k_h, v_h consecutive per head in the rows of one ``nn.Linear`` weight."""

    def heads(self, w: Tensor, which: str) -> Tensor:
        return w.view(self.n_head, 3, self.head_dim, self.d_model)[:, _PART[which]]

    def bias_heads(self, b: Tensor, which: str) -> Tensor:
        return b.view(self.n_head, 3, self.head_dim)[:, _PART[which]]

    def split(self, out: Tensor, which: str) -> Tensor:
        B, T = out.shape[0], out.shape[1]
        hd = self.head_dim
        qkv = out.reshape(B, T, self.n_head, 3 * hd).transpose(1, 2)  # (B, H, T, 3hd)
        return qkv[..., _PART[which] * hd:(_PART[which] + 1) * hd]  # (B, H, T, hd)


def detect(model: nn.Module) -> ModelAdapter | None:
    layers = layer_list(model, ("gpt_neox.layers", "layers"))
    if layers is None or not hasattr(getattr(layers[0], "attention", None), "query_key_value"):
        return None
    sites = []
    for i, layer in enumerate(layers):
        attn = layer.attention
        w = attn.query_key_value.weight
        hd = attn.head_size
        n_head = w.shape[0] // (3 * hd)
        sites.append(InterleavedQKVSite(i, attn, attn.query_key_value, attn.query_key_value,
                                        attn.query_key_value, n_head, n_head, hd, w.shape[1]))
    return ModelAdapter("gpt_neox", model, sites, causal=True, rotary=True,
                        max_positions=config_int(model, "max_position_embeddings"),
                        capture_fn=capture_hf)
