"""The two model options against attention-logit growth: qk-layernorm and σReparam."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qkgeom.arch import adapter_for
from qkgeom.config import GPTConfig, make_config
from qkgeom.errors import QKGeomError
from qkgeom.model import GPT

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=16, vocab_size=50)


def build(seed: int = 0, **over) -> GPT:
    torch.manual_seed(seed)  # σReparam's power iteration starts from torch's generator
    return GPT(dataclasses.replace(CFG, **over), generator=torch.Generator().manual_seed(seed))


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (4, CFG.block_size),
                         generator=torch.Generator().manual_seed(seed))


def train_steps(model: GPT, n: int, lr: float = 1e-2) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for i in range(n):
        x = batch(i)
        _, loss = model(x, x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_qk_norm_hands_normalised_q_and_k_to_the_attention_and_the_probes() -> None:
    """At init (gain 1, no bias) every head's q and k have zero mean and unit variance over
    their hd features: what the probes capture is what the logits use."""
    model = build(qk_norm=True).eval()
    seen = {}

    def on_qk(layer, q, k, q_attn, k_attn, scale):
        seen[layer] = (q_attn, k_attn)

    with adapter_for(model).capture(on_qk, "post-rotary"), torch.no_grad():
        model(batch())
    for q, k in seen.values():
        for x in (q, k):
            torch.testing.assert_close(x.mean(-1), torch.zeros_like(x.mean(-1)), atol=1e-6,
                                       rtol=0)
            # LayerNorm's eps (1e-5) takes var/(var + eps) off 1: ~1e-3 for these small q/k
            torch.testing.assert_close(x.var(-1, unbiased=False), torch.ones_like(x[..., 0]),
                                       atol=5e-3, rtol=0)
    names = [n for n, _ in model.named_parameters() if "_norm" in n]
    assert names == [f"blocks.{i}.attn.{s}_norm.weight" for i in range(2) for s in "qk"]
    assert all(float(p.min()) == float(p.max()) == 1.0 for n, p in model.named_parameters()
               if "_norm" in n)


def test_qk_norm_leaves_every_other_initial_weight_as_it_was() -> None:
    plain, normed = build(), build(qk_norm=True)
    weights = dict(normed.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(weights[name], p), name


def test_sigma_reparam_starts_at_the_plain_weights_and_keeps_sigma_max_at_gamma() -> None:
    plain, sigma = build(), build(qk_reparam="sigma")
    for layer in range(CFG.n_layer):
        for a, b in zip(plain.qk_weights(layer), sigma.qk_weights(layer), strict=True):
            a, b = a.detach(), b.detach()
            assert float((a - b).norm() / a.norm()) < 0.02  # the power iteration's estimate
    train_steps(sigma, 30)
    sigma.eval()
    for block in sigma.blocks:
        for proj in (block.attn.q_proj, block.attn.k_proj):
            gain = float(proj.parametrizations.weight[1].gain)
            top = float(torch.linalg.matrix_norm(proj.weight.detach(), ord=2))
            assert top == pytest.approx(abs(gain), rel=0.02)


def test_sigma_reparam_round_trips_through_a_state_dict() -> None:
    """What a checkpoint saves (the weight, the power iteration's vectors, γ) rebuilds the
    same model: a resumed run computes what the uninterrupted one does."""
    model = build(qk_reparam="sigma")
    train_steps(model, 5)
    twin = build(seed=1, qk_reparam="sigma")
    twin.load_state_dict(model.state_dict())
    model.eval(), twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(twin(batch())[0], model(batch())[0], rtol=0, atol=0)


def test_configs_that_cannot_be_built() -> None:
    with pytest.raises(QKGeomError, match="unknown model.qk_reparam 'spectral'"):
        GPTConfig(qk_reparam="spectral")
    with pytest.raises(QKGeomError, match="key_control reshapes W_K, which model.qk_reparam"):
        make_config("smoke", {"model": {"qk_reparam": "sigma"}, "key_control": {"mode": "hold"}})
    with pytest.raises(QKGeomError, match="entropy_control reshapes W_K"):
        make_config("smoke", {"model": {"qk_reparam": "sigma"},
                              "entropy_control": {"target": 2.0}})
    with pytest.raises(QKGeomError, match="both reshape W_K"):
        make_config("smoke", {"key_control": {"mode": "hold"},
                              "entropy_control": {"target": 2.0}})
    with pytest.raises(QKGeomError, match="entropy_control.target must be finite"):
        make_config("smoke", {"entropy_control": {"target": -1.0}})
    with pytest.raises(QKGeomError, match="'entropy_control.target' must be a number or null"):
        make_config("smoke", {"entropy_control": {"target": "high"}})
    # recording the key PR beside σReparam is fine: nothing reshapes W_K
    make_config("smoke", {"model": {"qk_reparam": "sigma"}, "key_control": {"record": True}})


def test_a_qk_norm_model_has_no_gpt2_export() -> None:
    pytest.importorskip("transformers")
    from qkgeom.arch.gpt import to_gpt2

    with pytest.raises(QKGeomError, match="qk_norm has no GPT-2 equivalent"):
        to_gpt2(build(qk_norm=True))
