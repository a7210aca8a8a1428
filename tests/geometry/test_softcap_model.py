"""The measurement of a soft-capped GPT reads the capped logits attention uses: the model's
``logit_softcap`` reaches the probe through its adapter (arch/gpt.py) and the streamed
softmax (geometry/entropy.py), so entropy and the largest logit equal a brute-force softmax of
c·tanh(s/c) on the model's own q and k."""

from __future__ import annotations

import math

import pytest
import torch

from qkgeom import GPT
from qkgeom.config import GPTConfig
from qkgeom.geometry import measure


def _brute(model: GPT, ids: torch.Tensor, cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy per head, largest logit per head) of layer 0, by hand in float64."""
    B, T = ids.shape
    cfg = model.config
    blk = model.blocks[0]
    with torch.no_grad():
        h = blk.ln_1(model.wte(ids) + model.wpe(torch.arange(T)))
        shape = (B, T, cfg.n_head, cfg.head_dim)
        q = blk.attn.q_proj(h).view(shape).transpose(1, 2).double()  # (B, nh, T, hs)
        k = blk.attn.k_proj(h).view(shape).transpose(1, 2).double()  # (B, nh, T, hs)
    s = q @ k.transpose(-1, -2) / math.sqrt(cfg.head_dim)  # (B, nh, T, T)
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    seen = torch.ones(T, T, dtype=torch.bool).tril()
    p = s.masked_fill(~seen, -math.inf).softmax(-1)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))  # (nh,)
    return ent, s.masked_fill(~seen, -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("cap", [0.7, None])
def test_a_soft_capped_gpt_is_measured_on_its_capped_logits(cap: float | None) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11,
                    logit_softcap=cap)
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight.mul_(60)  # logits well beyond the cap
    ids = torch.randint(0, 11, (3, 8))
    frame = measure(model, ids, metrics=["attn_entropy", "logit_max"]).frame
    heads = frame[frame["head"] >= 0].set_index(["metric", "head"])["value"]
    ent, top = _brute(model, ids, cap)
    for h in range(2):
        assert heads["attn_entropy", h] == pytest.approx(float(ent[h]), rel=1e-9)
        assert heads["logit_max", h] == pytest.approx(float(top[h]), rel=1e-9)
    if cap is not None:
        assert float(top.max()) <= cap
        uncapped, _ = _brute(model, ids, None)
        assert not torch.allclose(ent, uncapped, rtol=1e-3)  # the cap matters here
