"""The GPT probe: known weight spectra at init, train mode restored, determinism."""

from __future__ import annotations

import pytest
import torch

from qkgeom import GPT, GPTConfig, probe

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=40)


def model(qk_init: str) -> GPT:
    return GPT(GPTConfig(**{**CFG.__dict__, "qk_init": qk_init}),
               generator=torch.Generator().manual_seed(0))


def tokens() -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (6, CFG.block_size),
                         generator=torch.Generator().manual_seed(1))


def value(frame, layer: int, head: int, metric: str) -> float:
    row = frame[(frame.layer == layer) & (frame["head"] == head) & (frame.metric == metric)]
    assert len(row) == 1
    return float(row["value"].iloc[0])


def test_orthogonal_init_has_full_weight_pr_per_layer_and_head() -> None:
    f = probe(model("orthogonal"), tokens(), batch_size=4)
    for layer in range(CFG.n_layer):
        assert value(f, layer, -1, "pr_q_weight") == pytest.approx(CFG.n_embd, rel=1e-5)
        assert value(f, layer, -1, "pr_k_weight") == pytest.approx(CFG.n_embd, rel=1e-5)
        for head in range(CFG.n_head):
            # Rows of an orthogonal matrix are orthonormal: each head's slice is flat too.
            assert value(f, layer, head, "pr_k_weight") == pytest.approx(CFG.head_dim, rel=1e-5)


def test_tied_init_has_zero_contrast_and_equal_token_pr() -> None:
    f = probe(model("tied"), tokens())
    for layer in range(CFG.n_layer):
        assert value(f, layer, -1, "contrast_weight") == 0.0
        assert value(f, layer, -1, "contrast_token") == pytest.approx(0.0, abs=1e-9)


def test_probe_restores_train_mode_and_is_deterministic() -> None:
    m = model("normal").train()
    a = probe(m, tokens(), run_id="x", step=3)
    assert m.training
    b = probe(m.eval(), tokens(), run_id="x", step=3)
    assert not m.training
    assert a.equals(b)
    assert set(a.columns) >= {"run_id", "step", "layer", "head", "metric", "value"}
    assert (a["step"] == 3).all()


def test_batching_of_the_probe_set_does_not_change_results() -> None:
    a = probe(model("normal"), tokens(), batch_size=6)
    b = probe(model("normal"), tokens(), batch_size=4)
    torch.testing.assert_close(torch.tensor(a["value"].values), torch.tensor(b["value"].values),
                               rtol=1e-6, atol=1e-7)  # float32 forward


def test_uniform_attention_entropy_when_queries_are_zero() -> None:
    """W_Q = 0 makes every logit 0: entropy is the mean of log(t+1) (hand-computable)."""
    m = model("normal")
    with torch.no_grad():
        for block in m.blocks:
            block.attn.q_proj.weight.zero_()
    f = probe(m, tokens())
    T = CFG.block_size
    expected = sum(torch.log(torch.tensor(t + 1.0)).item() for t in range(T)) / T
    assert value(f, 0, -1, "attn_entropy") == pytest.approx(expected, rel=1e-6)
    assert value(f, 1, 2, "attn_entropy_norm") == pytest.approx(1.0, rel=1e-6)
