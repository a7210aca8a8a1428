"""Hugging Face GPT-NeoX / Pythia: one fused ``query_key_value`` (nn.Linear of weight
(3·d_model, d_model)) per layer, interleaved per head: the model views its output as
(…, H, 3·hd), so head ``h`` owns rows ``[q_h; k_h; v_h]`` = ``h·3hd : (h+1)·3hd``. Partial
rotary on the first ``rotary_ndims`` dims of each head; causal."""

from __future__ import annotations

from torch import Tensor, nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, blocks_with, config_int
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


def _site(i: int, attn: nn.Module) -> InterleavedQKVSite:
    qkv, hd = attn.query_key_value, attn.head_size
    n_head = qkv.weight.shape[0] // (3 * hd)
    return InterleavedQKVSite(i, attn, qkv, qkv, qkv, n_head, n_head, hd, qkv.weight.shape[1])


def detect(model: nn.Module) -> ModelAdapter | None:
    layers = blocks_with(model, ("gpt_neox.layers", "layers"), "attention.query_key_value")
    if layers is None:
        return None
    sites = [_site(i, layer.attention) for i, layer in enumerate(layers)]
    return ModelAdapter("gpt_neox", model, sites, causal=True, rotary=True,
                        max_positions=config_int(model, "max_position_embeddings"),
                        capture_fn=capture_hf)
