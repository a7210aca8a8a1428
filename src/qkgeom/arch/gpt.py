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
from qkgeom.model.gpt import GPTConfig

__all__ = ["detect", "gpt2_refusal", "to_gpt2"]


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
                        max_positions=cfg.block_size, capture_fn=_capture,
                        logit_softcap=cfg.logit_softcap)


def gpt2_refusal(cfg: GPTConfig) -> str | None:
    """Why a model of ``cfg`` has no GPT-2 equivalent (one line), or None when it has one.
    QK-Clip needs nothing (it only rescales W_Q and W_K rows); σReparam exports the weight
    the model computes with."""
    if cfg.qk_norm:
        return ("a model with qk_norm has no GPT-2 equivalent (GPT-2 has no LayerNorm on q "
                "and k); it cannot be exported")
    if cfg.logit_softcap is not None:
        return (f"a model with logit_softcap {cfg.logit_softcap:g} has no GPT-2 equivalent "
                "(GPT-2's attention has no soft-cap on its logits); it cannot be exported")
    return None


def to_gpt2(model: GPT) -> nn.Module:
    """A ``transformers.GPT2LMHeadModel`` computing the same logits as ``model``: ours is
    GPT-2 with separate q/k/v and (by default) no biases, so q/k/v fused into ``c_attn``,
    linear weights transposed for ``Conv1D``, zeros for absent biases, exact GELU, eps
    1e-5 and tied embeddings make it exact. Under σReparam each weight is the one the model
    computes with in eval mode, γ·W/σ̂ (read in eval mode: no power iteration runs)."""
    from qkgeom.errors import QKGeomError

    cfg = model.config
    refusal = gpt2_refusal(cfg)
    if refusal is not None:
        raise QKGeomError(refusal)
    was_training = model.training
    model.eval()  # a parametrised weight read in training mode runs a power iteration
    try:
        return _gpt2_of(model)
    finally:
        model.train(was_training)


def _gpt2_of(model: GPT) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    from qkgeom.arch.gpt2 import fuse_qkv

    cfg = model.config
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

    def copy(dst: nn.Module, src: nn.Module) -> None:
        """A LayerNorm as it is; a linear layer into a ``Conv1D`` (its weight transposed)."""
        w = src.weight
        dst.weight.copy_(w.T if w.dim() == 2 else w)
        dst.bias.copy_(bias(src, dst.bias.numel()))

    with torch.no_grad():
        tr = hf.transformer
        tr.wte.weight.copy_(model.wte.weight)
        tr.wpe.weight.copy_(model.wpe.weight)
        for blk, h in zip(model.blocks, tr.h, strict=True):
            a = blk.attn
            weight, b = fuse_qkv((a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                                 (bias(a.q_proj, d), bias(a.k_proj, d), bias(a.v_proj, d)))
            h.attn.c_attn.weight.copy_(weight)
            h.attn.c_attn.bias.copy_(b)
            for dst, src in ((h.ln_1, blk.ln_1), (h.attn.c_proj, a.c_proj), (h.ln_2, blk.ln_2),
                             (h.mlp.c_fc, blk.mlp.c_fc), (h.mlp.c_proj, blk.mlp.c_proj)):
                copy(dst, src)
        copy(tr.ln_f, model.ln_f)
    hf.tie_weights()
    return hf
