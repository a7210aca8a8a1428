"""Attention entropy and peakedness from captured queries and keys.

Why from q/k and not from the model's attention weights: training uses fused
``scaled_dot_product_attention`` (and HF models their ``sdpa`` path), which return no
weights, so probes recompute the explicit softmax on the probe set only.

Per head and query position t with ``n_t`` visible keys (causal: ``t + 1``; bidirectional:
the number of non-padding keys), ``H_t = −Σ_s p_ts log p_ts`` in nats (``0·log 0 = 0``).
Reported means over every (sequence, valid query position):

- ``attn_entropy``: mean ``H_t`` (nats; 0 = one-hot, ``log n_t`` = uniform),
- ``attn_entropy_norm``: mean of ``H_t / log n_t`` over positions with ``n_t ≥ 2``
  (dimensionless, in [0, 1]; causally this is the SPEC's ``t ≥ 1``),
- ``attn_max``: mean of ``max_s p_ts`` (dimensionless, in [1/n_t, 1]).

Memory: the (B, H, T, T) score tensor for T = 1024 is never formed; query positions are
processed in chunks so that one chunk's scores stay under ``max_chunk_elements``
(default 2**22, i.e. 16 MiB in float32; the softmax holds a few such buffers). Causally,
a chunk of queries ending at t1 only multiplies against keys [0, t1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkgeom.geometry.spectra import NonFiniteError

__all__ = ["ATTENTION_METRICS", "AttentionStats"]

ATTENTION_METRICS = ("attn_entropy", "attn_entropy_norm", "attn_max")

_MAX_CHUNK_ELEMENTS = 2**22
_FLOAT32_SAFE = 1e37  # |score| bound above which float32 scores could overflow (max 3.4e38)


class AttentionStats:
    """Accumulates per-head attention entropy and max weight over many batches.

    Args:
        n_head: number of heads H.
        causal: causal (decoder) mask; ``False`` for bidirectional encoders.
        max_chunk_elements: bound on B·H·chunk·T_keys per score chunk.
    """

    def __init__(
        self, n_head: int, causal: bool = True, max_chunk_elements: int = _MAX_CHUNK_ELEMENTS
    ):
        if n_head < 1:
            raise ValueError(f"n_head must be >= 1, got {n_head}")
        self.n_head = n_head
        self.causal = causal
        self.max_chunk_elements = max_chunk_elements
        self._sum_entropy = torch.zeros(n_head, dtype=torch.float64)  # (H,) nats
        self._sum_entropy_norm = torch.zeros(n_head, dtype=torch.float64)  # (H,)
        self._sum_max = torch.zeros(n_head, dtype=torch.float64)  # (H,)
        self.n_queries = 0  # (sequence, position) pairs counted in attn_entropy / attn_max
        self.n_queries_norm = 0  # those with >= 2 visible keys (attn_entropy_norm)

    @torch.no_grad()
    def update(
        self,
        q: Tensor,
        k: Tensor,
        scale: float | None = None,
        attention_mask: Tensor | None = None,
        chunk_size: int | None = None,
    ) -> None:
        """Add one batch of sequences.

        Args:
            q, k: (B, H, T, hd) per-head queries and keys (after bias/rotary), any float
                dtype; the softmax runs in float64 for float64 input, else float32.
            scale: logit scale, default 1/√hd.
            attention_mask: optional (B, T), nonzero/True = real token, 0/False = padding
                (the Hugging Face convention). Padding is masked as a key and not counted
                as a query.
            chunk_size: query positions per chunk; default from ``max_chunk_elements``.

        Scores that could overflow float32 (|q|·|k|·hd·scale beyond ~1e37, e.g. activations
        of 1e30) are computed in float64, where such a softmax is a finite one-hot.

        Raises:
            NonFiniteError: if q or k is non-finite or the scores overflow float64 too.
        """
        if q.ndim != 4 or k.shape != q.shape:
            raise ValueError(
                f"q {tuple(q.shape)} and k {tuple(k.shape)} must be equal (B, H, T, hd)"
            )
        B, H, T, hd = q.shape
        if self.n_head != H:
            raise ValueError(f"expected {self.n_head} heads, got {H}")
        scale = 1.0 / math.sqrt(hd) if scale is None else float(scale)
        # Bound on |score|: one host sync per batch, not per chunk.
        bound = float(q.detach().abs().amax()) * float(k.detach().abs().amax()) * hd * abs(scale)
        if not math.isfinite(bound):
            raise NonFiniteError("non-finite queries/keys, or attention scores beyond float64")
        wide = q.dtype == torch.float64 or bound > _FLOAT32_SAFE
        dtype = torch.float64 if wide else torch.float32
        q = q.detach().to(dtype)  # (B, H, T, hd)
        k = k.detach().to(dtype)  # (B, H, T, hd)
        valid = None
        if attention_mask is not None:
            if attention_mask.shape != (B, T):
                raise ValueError(
                    f"attention_mask must be (B={B}, T={T}), got {tuple(attention_mask.shape)}"
                )
            valid = attention_mask.to(q.device).bool()  # (B, T)
        if chunk_size is None:
            chunk_size = max(1, self.max_chunk_elements // max(1, B * H * T))
        device = q.device
        sums = torch.zeros(3, H, dtype=torch.float64, device=device)  # entropy, norm, max
        n_q = torch.zeros((), dtype=torch.int64, device=device)
        n_norm = torch.zeros((), dtype=torch.int64, device=device)
        for t0 in range(0, T, chunk_size):
            t1 = min(T, t0 + chunk_size)
            n_keys = t1 if self.causal else T  # keys that any query of this chunk can see
            s = (q[:, :, t0:t1] @ k[:, :, :n_keys].mT) * scale  # (B, H, c, S)
            allowed = torch.ones(
                1, 1, t1 - t0, n_keys, dtype=torch.bool, device=device
            )  # (1, 1, c, S)
            if self.causal:
                qpos = torch.arange(t0, t1, device=device)[:, None]  # (c, 1)
                kpos = torch.arange(n_keys, device=device)[None, :]  # (1, S)
                allowed = allowed & (kpos <= qpos)  # (1, 1, c, S)
            if valid is not None:
                allowed = allowed & valid[:, None, None, :n_keys]  # (B, 1, c, S)
            n_vis = allowed.sum(dim=-1)  # (B|1, 1, c) visible keys per query
            row_ok = n_vis > 0  # (B|1, 1, c)
            if valid is not None:
                row_ok = row_ok & valid[:, None, t0:t1]  # (B, 1, c)
            s = s.masked_fill(~allowed, float("-inf"))  # (B, H, c, S)
            # Rows with no visible key would be NaN; give them a harmless 0 row, then drop.
            s = s.masked_fill(~row_ok[..., None], 0.0)  # (B, H, c, S)
            logp = torch.log_softmax(s, dim=-1)  # (B, H, c, S)
            p = logp.exp()  # (B, H, c, S)
            plogp = torch.where(p > 0, p * logp, torch.zeros((), dtype=dtype, device=device))
            ent = -plogp.sum(dim=-1)  # (B, H, c) nats
            pmax = p.amax(dim=-1)  # (B, H, c)
            norm_ok = row_ok & (n_vis >= 2)  # (B|1, 1, c)
            log_n = torch.log(n_vis.clamp_min(2).to(dtype))  # (B|1, 1, c)
            w = row_ok.to(dtype).expand(B, H, t1 - t0)  # (B, H, c)
            w_norm = norm_ok.to(dtype).expand(B, H, t1 - t0)  # (B, H, c)
            sums[0] += (ent * w).sum(dim=(0, 2)).double()
            sums[1] += (ent / log_n * w_norm).sum(dim=(0, 2)).double()
            sums[2] += (pmax * w).sum(dim=(0, 2)).double()
            n_q += row_ok.expand(B, 1, t1 - t0).sum()
            n_norm += norm_ok.expand(B, 1, t1 - t0).sum()
        sums = sums.cpu()
        self._sum_entropy += sums[0]
        self._sum_entropy_norm += sums[1]
        self._sum_max += sums[2]
        self.n_queries += int(n_q)
        self.n_queries_norm += int(n_norm)

    def result(self) -> dict[str, Tensor]:
        """Means per head: ``{name: (H,) float64}`` for the three ``ATTENTION_METRICS``.

        ``attn_entropy_norm`` is NaN only if no query ever saw two or more keys (e.g. all
        sequences of length 1): it is undefined there, not zero.

        Raises:
            ValueError: if no query position has been accumulated.
        """
        if self.n_queries == 0:
            raise ValueError("AttentionStats has no query positions; call update() first")
        norm = (
            self._sum_entropy_norm / self.n_queries_norm
            if self.n_queries_norm
            else torch.full((self.n_head,), float("nan"), dtype=torch.float64)
        )
        return {
            "attn_entropy": self._sum_entropy / self.n_queries,
            "attn_entropy_norm": norm,
            "attn_max": self._sum_max / self.n_queries,
        }
