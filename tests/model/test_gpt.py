"""The GPT: shapes, the three Q/K inits, determinism of init, SDPA vs explicit attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from qkgeom.arch import adapter_for
from qkgeom.config import GPTConfig
from qkgeom.model import GPT

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=50)


def make(qk_init: str, seed: int = 0) -> GPT:
    return GPT(CFG.__class__(**{**CFG.__dict__, "qk_init": qk_init}),
               generator=torch.Generator().manual_seed(seed))


def test_forward_shapes_and_initial_loss_near_log_vocab() -> None:
    model = make("normal")
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, CFG.vocab_size, (3, CFG.block_size), generator=gen)
    y = torch.randint(0, CFG.vocab_size, (3, CFG.block_size), generator=gen)
    logits, loss = model(x, y)
    assert logits.shape == (3, CFG.block_size, CFG.vocab_size)
    # Small init -> nearly uniform predictions.
    assert abs(float(loss.detach()) - math.log(CFG.vocab_size)) < 0.3


def test_tied_init_has_identical_q_and_k_at_step_0() -> None:
    model = make("tied")
    for layer in range(CFG.n_layer):
        w_q, w_k = model.qk_weights(layer)
        assert torch.equal(w_q, w_k)
        assert w_q.data_ptr() != w_k.data_ptr()  # separate parameters, trained separately


def test_orthogonal_init_has_all_singular_values_equal() -> None:
    model = make("orthogonal")
    for layer in range(CFG.n_layer):
        for w in model.qk_weights(layer):
            s = torch.linalg.svdvals(w.double())
            assert torch.allclose(s, torch.full_like(s, 0.02 * math.sqrt(CFG.n_embd)), rtol=1e-5)


def test_normal_init_is_not_orthogonal() -> None:
    s = torch.linalg.svdvals(make("normal").qk_weights(0)[0].double())
    assert s.max() / s.min() > 5  # a Marchenko-Pastur spread, not a flat spectrum


def test_init_logit_scale_comparable_across_inits() -> None:
    """The Frobenius norm of W_Q and W_K (the initial logit scale) matches across inits."""
    norms = {m: [float(w.norm()) for w in make(m, seed=1).qk_weights(0)]
             for m in ("normal", "orthogonal", "tied")}
    expected = 0.02 * CFG.n_embd  # sqrt(d*d) * std
    for values in norms.values():
        for v in values:
            assert v == pytest.approx(expected, rel=0.05)


def test_same_generator_seed_gives_same_weights() -> None:
    a, b, c = make("normal", 3), make("normal", 3), make("normal", 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.qk_weights(0)[0], c.qk_weights(0)[0])


def test_tap_sees_q_and_k_and_matches_explicit_attention() -> None:
    """The tapped q/k (through the adapter's capture, which sets each layer's tap) reproduce
    SDPA's output with an explicit causal softmax."""
    model = make("normal").eval()
    x = torch.randint(0, CFG.vocab_size, (2, 16))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with adapter_for(model).capture(lambda layer, q, k, *_: seen.__setitem__(layer, (q, k))):
        model(x)
    assert sorted(seen) == [0, 1]
    q, k = seen[0]
    assert q.shape == (2, CFG.n_head, 16, CFG.n_embd // CFG.n_head)
    attn = model.blocks[0].attn
    assert attn.tap is None  # removed after the block
    h = model.blocks[0].ln_1(model.wte(x) + model.wpe(torch.arange(16)))
    v = attn.v_proj(h).view(2, 16, CFG.n_head, -1).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    explicit = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(explicit, sdpa, rtol=1e-5, atol=1e-6)


def test_tap_removed_when_forward_raises() -> None:
    model = make("normal")
    with pytest.raises(ValueError), adapter_for(model).capture(lambda *a: None):
        model(torch.zeros(1, CFG.block_size + 1, dtype=torch.long))
    assert all(b.attn.tap is None for b in model.blocks)


def test_lm_head_is_tied_to_embedding() -> None:
    model = make("normal")
    assert model.lm_head.weight is model.wte.weight
