"""The project's own GPT (:mod:`qkgeom.model`): separate ``q_proj`` / ``k_proj`` / ``v_proj``
per layer, no rotary, causal. Each attention layer hands its q/k to its ``tap`` (set only
during a capture); the model is also exported as a Hugging Face GPT-2 (:func:`to_gpt2`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from qkgeom.arch.base import AttentionSite, ModelAdapter, QKCallback
from qkgeom.model import GPT

__all__ = ["detect", "to_gpt2"]


@contextmanager
def _capture(adapter: ModelAdapter, on_qk: QKCallback, qk_site: str) -> Iterator[None]:
    """No rotary: the site q/k are the attention's whatever ``qk_site``; SDPA's default
    scale. The taps are removed whatever happens."""
    scale = 1.0 / math.sqrt(adapter.sites[0].head_dim)
    try:
        for site in adapter.sites:
            site.attention.tap = (lambda q, k, layer=site.layer:
                                  on_qk(layer, q, k, q, k, scale))
        yield
    finally:
        for site in adapter.sites:
            site.attention.tap = None


def detect(model: nn.Module) -> ModelAdapter | None:
    if not isinstance(model, GPT):
        return None
    cfg = model.config
    sites = [AttentionSite(i, b.attn, b.attn.q_proj, b.attn.k_proj, b.attn.v_proj, cfg.n_head,
                           cfg.n_head, cfg.head_dim, cfg.n_embd)
             for i, b in enumerate(model.blocks)]
    return ModelAdapter("qkgeom", model, sites, causal=True, rotary=False,
                        max_positions=cfg.block_size, capture_fn=_capture)


def to_gpt2(model: GPT) -> nn.Module:
    """A ``transformers.GPT2LMHeadModel`` computing the same logits as ``model``: ours is
    GPT-2 with separate q/k/v and (by default) no biases, so q/k/v fused into ``c_attn``,
    linear weights transposed for ``Conv1D``, zeros for absent biases, exact GELU, eps
    1e-5 and tied embeddings make it exact."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from qkgeom.arch.gpt2 import fuse_qkv
    from qkgeom.errors import QKGeomError

    cfg = model.config
    if cfg.qk_norm:
        raise QKGeomError("a model with qk_norm has no GPT-2 equivalent (GPT-2 has no "
                          "LayerNorm on q and k); it cannot be exported")
    d = cfg.n_embd
    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.block_size, n_embd=d, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=4 * d, activation_function="gelu", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
        bos_token_id=cfg.vocab_size - 1, eos_token_id=cfg.vocab_size - 1)
    hf = GPT2LMHeadModel(hf_cfg).eval()

    def bias(lin: nn.Module, n: int) -> torch.Tensor:
        b = getattr(lin, "bias", None)
        return b.detach().clone() if b is not None else torch.zeros(n)

    with torch.no_grad():
        tr = hf.transformer
        tr.wte.weight.copy_(model.wte.weight)
        tr.wpe.weight.copy_(model.wpe.weight)
        for blk, h in zip(model.blocks, tr.h, strict=True):
            a = blk.attn
            h.ln_1.weight.copy_(blk.ln_1.weight)
            h.ln_1.bias.copy_(bias(blk.ln_1, d))
            weight, b = fuse_qkv((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                                 (bias(a.q_proj, d), bias(a.k_proj, d), bias(a.v_proj, d)))
            h.attn.c_attn.weight.copy_(weight)
            h.attn.c_attn.bias.copy_(b)
            h.attn.c_proj.weight.copy_(a.c_proj.weight.T)
            h.attn.c_proj.bias.copy_(bias(a.c_proj, d))
            h.ln_2.weight.copy_(blk.ln_2.weight)
            h.ln_2.bias.copy_(bias(blk.ln_2, d))
            h.mlp.c_fc.weight.copy_(blk.mlp.c_fc.weight.T)  # (d, 4d)
            h.mlp.c_fc.bias.copy_(bias(blk.mlp.c_fc, 4 * d))
            h.mlp.c_proj.weight.copy_(blk.mlp.c_proj.weight.T)  # (4d, d)
            h.mlp.c_proj.bias.copy_(bias(blk.mlp.c_proj, d))
        tr.ln_f.weight.copy_(model.ln_f.weight)
        tr.ln_f.bias.copy_(bias(model.ln_f, d))
    hf.tie_weights()
    return hf
