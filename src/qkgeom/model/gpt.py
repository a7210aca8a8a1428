"""A decoder-only GPT you can read in one sitting, with W_Q and W_K kept apart.

Queries, keys and values have their own ``nn.Linear`` per layer (no fused ``c_attn``), so
probes and the key control address W_Q and W_K of every head directly; probes read q/k
through each attention's ``tap``, set only while :mod:`qkgeom.arch.gpt` captures. The
architecture: docs/definitions.md#model; the remedies ``qk_norm`` and ``qk_reparam``:
docs/stability.md#remedies.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import spectral_norm

from qkgeom.config import GPTConfig

QKTap = Callable[[Tensor, Tensor], None]  # called with q, k of shape (B, nh, T, hs)


# LayerNorm gains (1 at init); every other 1-D parameter is a bias (0).
_NORM_GAINS = ("ln_1.weight", "ln_2.weight", "ln_f.weight", "q_norm.weight", "k_norm.weight")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        # nn.Linear layout: weight is (d_out, d_model); head h owns rows h*hs:(h+1)*hs.
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # qk-layernorm: one LayerNorm over the hs features of every head's q (and one of k)
        self.q_norm = nn.LayerNorm(cfg.head_dim, bias=cfg.bias) if cfg.qk_norm else None
        self.k_norm = nn.LayerNorm(cfg.head_dim, bias=cfg.bias) if cfg.qk_norm else None
        self.tap: QKTap | None = None  # set only while a capture runs (qkgeom.arch.gpt)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, nh, hs)
        k = self.k_proj(x).view(B, T, self.n_head, self.head_dim)  # (B, T, nh, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs)
        v = self.v_proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if self.tap is not None:
            self.tap(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """The model. ``GPT(cfg, generator=g)`` draws every initial weight from ``g``."""

    def __init__(self, cfg: GPTConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.reset_parameters(generator)
        if cfg.qk_reparam == "sigma":  # after the init: σReparam starts from these weights
            for block in self.blocks:
                sigma_reparam(block.attn.q_proj)
                sigma_reparam(block.attn.k_proj)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 init (N(0, 0.02), residual projections scaled by 1/sqrt(2L)), then the Q/K
        init."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:  # LayerNorm gains 1, every bias 0
                p.fill_(1.0 if name.endswith(_NORM_GAINS) else 0.0)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layer), generator=generator)
            else:
                nn.init.normal_(p, 0.0, std, generator=generator)
        for block in self.blocks:
            init_qk(block.attn.q_proj.weight, block.attn.k_proj.weight, self.config.qk_init,
                    std=std, generator=generator)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        B, T = idx.shape
        if self.config.block_size < T:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)  # (B, T, C)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    def qk_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        """(w_q, w_k) of a layer in nn.Linear layout, (d_out, d_model)."""
        attn = self.blocks[layer].attn
        return attn.q_proj.weight, attn.k_proj.weight


class _Gain(nn.Module):
    """γ·W: σReparam's learned scale of the spectrally normalised weight."""

    def __init__(self, gain: Tensor) -> None:
        super().__init__()
        self.gain = nn.Parameter(gain.detach().clone())

    def forward(self, w: Tensor) -> Tensor:
        return self.gain * w


@torch.no_grad()
def sigma_reparam(linear: nn.Linear) -> None:
    """σReparam (Zhai et al., 2023) of ``linear.weight``: ``spectral_norm``'s W/σ_max(W)
    (one power iteration per training forward) times a learned γ that starts at its estimate
    of σ_max(W₀), so step 0 is W₀ to rounding. The start vector comes from torch's global
    generator, which the trainer seeds."""
    w0 = linear.weight.detach().clone()
    spectral_norm(linear)
    sigma = torch.linalg.vector_norm(w0) / torch.linalg.vector_norm(linear.weight)
    parametrize.register_parametrization(linear, "weight", _Gain(sigma))


@torch.no_grad()
def init_qk(w_q: Tensor, w_k: Tensor, mode: str, *, std: float = 0.02,
            generator: torch.Generator | None = None) -> None:
    """Initialise one layer's W_Q and W_K in place: ``normal`` N(0, std) each;
    ``orthogonal`` with every singular value ``std * sqrt(d_model)`` (the normal init's
    Frobenius norm and logit scale); ``tied`` W_K := W_Q, trained apart afterwards
    (docs/definitions.md)."""
    if mode == "normal":
        nn.init.normal_(w_q, 0.0, std, generator=generator)
        nn.init.normal_(w_k, 0.0, std, generator=generator)
    elif mode == "orthogonal":
        gain = std * math.sqrt(w_q.shape[1])
        nn.init.orthogonal_(w_q, gain=gain, generator=generator)
        nn.init.orthogonal_(w_k, gain=gain, generator=generator)
    elif mode == "tied":
        nn.init.normal_(w_q, 0.0, std, generator=generator)
        w_k.copy_(w_q)
    else:
        raise ValueError(f"unknown qk_init {mode!r}")


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate: 6 × the
    matmul parameters (12 L d² and the tied d × V head) + 12 L T d for attention (not halved
    for the causal mask). For MFU and run sizing (docs/speed.md)."""
    n_matmul = 12 * cfg.n_layer * cfg.n_embd**2 + cfg.n_embd * cfg.vocab_size
    return 6.0 * n_matmul + 12.0 * cfg.n_layer * cfg.block_size * cfg.n_embd
