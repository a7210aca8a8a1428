"""Hugging Face GPT-2: one fused ``c_attn`` per layer, a ``Conv1D`` of weight
(d_model, 3·d_model) computing ``y = x @ W``, columns ``[q | k | v]``, head ``h`` owning
columns ``h·hd:(h+1)·hd`` of each part. No rotary; causal."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, blocks_with, config_int
from qkgeom.arch.hf import capture_hf

__all__ = ["FusedConv1DSite", "detect", "fuse_qkv"]

_PART = {"q": 0, "k": 1, "v": 2}


class FusedConv1DSite(AttentionSite):
    """q, k and v side by side in the columns of one ``Conv1D`` weight."""

    def _columns(self, which: str) -> slice:
        d_out = self.n_head * self.head_dim
        return slice(_PART[which] * d_out, (_PART[which] + 1) * d_out)

    def heads(self, w: Tensor, which: str) -> Tensor:
        return w[:, self._columns(which)].T.unflatten(0, (self.n_head, self.head_dim))

    def bias_heads(self, b: Tensor, which: str) -> Tensor:
        return b.view(3, self.n_head, self.head_dim)[_PART[which]]

    def split(self, out: Tensor, which: str) -> Tensor:
        return super().split(out[..., self._columns(which)], which)


def fuse_qkv(weights: tuple[Tensor, Tensor, Tensor],
             biases: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """``c_attn`` weight (d_model, 3·d) and bias (3·d) from nn.Linear-layout W_Q, W_K, W_V
    (d, d_model each) and their biases: the inverse of :class:`FusedConv1DSite`'s split."""
    return torch.cat(weights, dim=0).T, torch.cat(biases)


def _site(i: int, attn: nn.Module) -> FusedConv1DSite | None:
    c_attn = attn.c_attn
    d = c_attn.weight.shape[0]
    if type(c_attn).__name__ != "Conv1D" or c_attn.weight.shape[1] != 3 * d:
        return None
    return FusedConv1DSite(i, attn, c_attn, c_attn, c_attn, attn.num_heads, attn.num_heads,
                           attn.head_dim, d)


def detect(model: nn.Module) -> ModelAdapter | None:
    layers = blocks_with(model, ("transformer.h", "h"), "attn.c_attn")
    sites = [_site(i, block.attn) for i, block in enumerate(layers or [])]
    if not sites or None in sites:
        return None
    return ModelAdapter("gpt2", model, sites, causal=True, rotary=False,
                        max_positions=config_int(model, "n_positions", "max_position_embeddings"),
                        capture_fn=capture_hf)
