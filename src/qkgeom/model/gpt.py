"""A decoder-only GPT you can read in one sitting, with W_Q and W_K kept apart.

Queries, keys and values have their own ``nn.Linear`` per layer (no fused ``c_attn``), so
probes and the key control address W_Q and W_K of every head directly; probes read q/k
through each attention's ``tap``, set only while :mod:`qkgeom.arch.gpt` captures. The
architecture: docs/definitions.md#model; the remedies against attention-logit growth
(``qk_norm``, ``sigma_reparam``, ``logit_softcap``, QK-Clip, and :func:`z_loss` for the
trainer): docs/stability.md#remedies.
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


# Elements of one chunk of scores when QK-Clip's maxima are computed beside SDPA (64 MiB
# in fp32): the T×T scores of a whole batch are never held at once.
_MAX_CHUNK = 2**24


def soft_cap(scores: Tensor, cap: float) -> Tensor:
    """Attention-logit soft-capping, c·tanh(s/c) (Gemma 2: c = 50; Grok-1: 30): every logit
    inside (−c, c), those with |s| ≪ c nearly unchanged (s − s³/3c² + …)."""
    return cap * torch.tanh(scores / cap)


def z_loss(logits: Tensor) -> Tensor:
    """PaLM's auxiliary z-loss without its coefficient: the mean over tokens of (log Z)², Z
    = Σ_v exp(logit_v) the softmax normaliser of the output logits (B, T, V), in float32.
    Its gradient is 2·log Z·softmax(logits)/N per token (N tokens): it pulls log Z toward 0
    without moving the softmax. The trainer adds ``z_loss`` (the config's coefficient, 1e-4
    in PaLM, Wortsman et al. 2023 and OLMo) times this to the objective only."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def _future(T: int, like: Tensor) -> Tensor:
    """(T, T) additive causal mask: 0 where key j ≤ query i (visible), −inf above."""
    return torch.full((T, T), float("-inf"), dtype=like.dtype, device=like.device).triu(1)


@torch.no_grad()
def causal_head_max(scores: Tensor) -> Tensor:
    """(nh,) largest value of each head over the visible (causal: key j ≤ query i) pairs of
    ``scores`` (B, nh, T, T), in float32."""
    return (scores + _future(scores.shape[-1], scores)).flatten(2).amax(-1).amax(0).float()


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention: SDPA, or with ``logit_softcap`` the explicit path
    (scores, c·tanh(s/c), mask, softmax, dropout, @ v), since SDPA has no soft-cap. With
    QK-Clip on, every training forward keeps the largest scaled logit of each head (pre-cap)
    in the buffer ``logit_max`` (the running max until :meth:`GPT.qk_clip_` reads it)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.softcap = cfg.logit_softcap
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
        # QK-Clip's per-head maxima; not persistent: reset after every step, not checkpointed
        self.logit_max: Tensor | None
        self.register_buffer("logit_max", torch.full((cfg.n_head,), float("-inf"))
                             if cfg.qk_clip else None, persistent=False)

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
        record = self.training and self.logit_max is not None
        dropout = self.dropout if self.training else 0.0
        if self.softcap is None:
            if record:
                self._record(self._head_max(q, k))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = self._capped(q, k, v, dropout, record)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_drop(self.c_proj(y))

    def _capped(self, q: Tensor, k: Tensor, v: Tensor, dropout: float, record: bool) -> Tensor:
        """Soft-capped causal attention (B, nh, T, hs): SDPA's scale 1/√hs, then c·tanh(s/c)
        before the mask and the softmax; dropout on the weights as SDPA drops them."""
        T = q.shape[2]
        # the scale folded into q: T×T passes are what this path pays for
        scores = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)  # (B, nh, T, T)
        if record:  # QK-Clip reads the pre-cap logits
            self._record(causal_head_max(scores.detach()))
        scores = soft_cap(scores, self.softcap) + _future(T, scores)
        att = torch.softmax(scores, dim=-1)
        if dropout > 0:
            att = F.dropout(att, p=dropout)
        return att.to(v.dtype) @ v

    @torch.no_grad()
    def _head_max(self, q: Tensor, k: Tensor) -> Tensor:
        """(nh,) largest scaled logit of each head over the batch's visible pairs, beside
        SDPA: q·kᵀ recomputed a few sequences at a time without autograd, masked in place,
        only the maxima kept, scaled by 1/√hs last (a positive scale keeps the max)."""
        T = q.shape[2]
        per = max(1, _MAX_CHUNK // (self.n_head * T * T))
        future = _future(T, q)
        maxima = []
        for qc, kc in zip(q.split(per), k.split(per), strict=True):
            raw = qc @ kc.transpose(-2, -1)  # (b, nh, T, T)
            raw += future
            maxima.append(raw.flatten(2).amax(-1).amax(0))
        return torch.stack(maxima).amax(0).float() * (1.0 / math.sqrt(self.head_dim))

    @torch.no_grad()
    def _record(self, head_max: Tensor) -> None:
        torch.maximum(self.logit_max, head_max, out=self.logit_max)


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
    """The model. ``GPT(cfg, generator=g)`` draws every initial weight from ``g``.

    ``cfg.sigma_reparam``: σReparam (:func:`sigma_reparam`) of W_Q and W_K (``qk``) or of
    every ``nn.Linear`` of the blocks (``all``: q, k, v, the attention's and the MLP's
    projections, as Zhai et al. 2023 do); the tied embedding / output head stays plain in
    both (it is an embedding). With QK-Clip (``cfg.qk_clip_threshold``) call
    :meth:`qk_clip_` after every optimiser step."""

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
        for block in self.blocks:  # after the init: σReparam starts from these weights
            for linear in _reparametrised(block, cfg.sigma_reparam):
                sigma_reparam(linear)

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

    @torch.no_grad()
    def qk_clip_(self) -> Tensor:
        """QK-Clip (the MuonClip of Kimi K2, 2025; Megatron-LM's ``qk_clip_threshold`` 100
        and ``qk_clip_alpha`` 0.5), in place; call it right after ``optimizer.step()``.

        For each head h whose largest scaled logit S_h = max q·k/√hd over the visible pairs
        of the training forwards since the last call exceeds τ, with γ = τ/S_h: the head's
        rows of W_Q (and of the q bias) are multiplied by γ^α and those of W_K (and the k
        bias) by γ^(1−α), so its logits on that batch, with these weights, become γ times
        what they were: S_h becomes τ. Heads at or below τ are multiplied by exactly 1 (bit
        for bit unchanged); the forward pass itself is untouched. Returns the number of
        heads clipped (a tensor on the model's device: no host sync), then forgets the
        maxima. A plain loop: ``loss.backward(); opt.step(); model.qk_clip_()``.

        Grouped-query attention (not in this model; how the rule reads there): each query
        head h scales its W_Q rows by γ_h^α with γ_h = τ/S_h; a key head g shared by the
        query heads G(g) scales its W_K rows by γ_g^(1−α), γ_g = τ/S_g with S_g = max over
        G(g) of S_h. Every head then stays ≤ τ: its new max is γ_h^α·γ_g^(1−α)·S_h ≤
        γ_h^α·γ_h^(1−α)·S_h = τ, since S_g ≥ S_h gives γ_g ≤ γ_h.

        Why a method of the model (the trainer's callback calls it, :mod:`qkgeom.launch`):
        the maxima are recorded inside the attention, and so the same one call serves the
        trainer and anyone's own loop, while the trainer knows no feature."""
        tau, alpha = self.config.qk_clip_threshold, self.config.qk_clip_alpha
        if tau is None:
            raise ValueError("qk_clip_ needs model.qk_clip_threshold (QK-Clip is off)")
        clipped = []
        for block in self.blocks:
            attn = block.attn
            over = attn.logit_max > tau  # (nh,); a NaN maximum clips nothing
            gamma = torch.where(over, tau / attn.logit_max, 1.0)
            for proj, power in ((attn.q_proj, alpha), (attn.k_proj, 1.0 - alpha)):
                factor = gamma.pow(power).to(proj.weight.dtype)  # γ = 1: exactly 1
                proj.weight.view(self.config.n_head, self.config.head_dim, -1) \
                    .mul_(factor[:, None, None])
                if proj.bias is not None:
                    proj.bias.view(self.config.n_head, -1).mul_(factor[:, None])
            attn.logit_max.fill_(float("-inf"))
            clipped.append(over.sum())
        return torch.stack(clipped).sum()


def _reparametrised(block: Block, form: str) -> list[nn.Linear]:
    """The linear layers of ``block`` that σReparam ``form`` parametrises, in a fixed order
    (each draws its power iteration's start vector from torch's generator in turn)."""
    if form == "none":
        return []
    if form == "qk":
        return [block.attn.q_proj, block.attn.k_proj]
    return [m for m in block.modules() if isinstance(m, nn.Linear)]  # q, k, v, c_proj, MLP


class _Gain(nn.Module):
    """γ·W: σReparam's learned scale of the spectrally normalised weight."""

    def __init__(self, gain: Tensor) -> None:
        super().__init__()
        self.gain = nn.Parameter(gain.detach().clone())

    def forward(self, w: Tensor) -> Tensor:
        return self.gain * w


@torch.no_grad()
def sigma_reparam(linear: nn.Linear) -> None:
    """σReparam (Zhai et al., 2023) of ``linear.weight``: Ŵ = γ·W/σ̂(W), ``spectral_norm``'s
    W/σ̂ (σ̂ by one power iteration per training forward) times a learned scalar γ.

    The power iteration starts from W₀'s exact top singular vectors and γ from σ_max(W₀)
    (one SVD at build time), so Ŵ = W₀ up to round-off at step 0, in training and in eval
    mode: from random start vectors σ̂ would still be off by 0.1–2 % (the top singular
    values of a random matrix lie close together, so the iteration converges slowly), and
    step 0 would not be the plain model. torch's start vectors are still drawn (from its
    global generator, which the trainer seeds), so the random streams after the build are
    the same whatever the start."""
    w0 = linear.weight.detach().clone()
    spectral_norm(linear)
    u, s, vh = torch.linalg.svd(w0.double(), full_matrices=False)
    power = linear.parametrizations.weight[0]  # torch's _SpectralNorm: its u, v buffers
    power._u.copy_(u[:, 0])
    power._v.copy_(vh[0])
    parametrize.register_parametrization(linear, "weight", _Gain(s[0].to(w0.dtype)))


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
