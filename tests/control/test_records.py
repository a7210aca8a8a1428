"""What the control records about itself: the achieved token-level PR on its own Σ_ε (on
target by construction), on Σ without ε (in sample) and on the next batch's inputs (out of
sample), checked against direct computations on planted inputs (issues 36 and 40)."""

from __future__ import annotations

import pytest
import torch

from qkgeom.config import GPTConfig
from qkgeom.control import KeySpectrumControl
from qkgeom.model import GPT

D, N = 32, 256


def pr_of(w: torch.Tensor, cov: torch.Tensor) -> float:
    """Token-level PR of keys W x for inputs of covariance ``cov``, (Σλ)² / Σλ² of the
    eigenvalues (round-off may leave a float32-estimated Σ slightly indefinite)."""
    w = w.double()
    lam = torch.linalg.eigvalsh(w @ cov @ w.T)
    return float(lam.sum() ** 2 / (lam * lam).sum())


def inputs(gen: torch.Generator, rank: int) -> torch.Tensor:
    """N inputs (N, D) with an offset, spanning ``rank`` directions (D: full rank)."""
    basis = torch.randn(rank, D, generator=gen)
    return torch.randn(N, rank, generator=gen) @ basis + torch.randn(D, generator=gen)


def feed(ctl: KeySpectrumControl, x: torch.Tensor) -> None:
    """One training forward of the key projection on ``x`` (the control's hook sees it)."""
    with torch.enable_grad():
        ctl.sites[0].k_module(x)


@pytest.mark.parametrize("mode, how", [("hold", "post_step"), ("hold", "parametrize"),
                                       ("none", "parametrize")])
def test_out_of_sample_record_is_the_last_keys_on_the_next_batch(mode: str, how: str) -> None:
    """``ctl_pr_oos`` at step t and the ``pr_token_oos`` of row t − 1: the keys in effect
    after step t − 1 on the centred covariance of step t's inputs (a recording-only
    control has no ``ctl_`` records, only the rows)."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=D, block_size=8, vocab_size=20),
                generator=torch.Generator().manual_seed(0))
    ctl = KeySpectrumControl.attach(model, mode, how=how, record=True)
    gen = torch.Generator().manual_seed(1)
    keys = ctl.sites[0].key_effective().detach().clone()  # step 0's
    for step in range(1, 5):
        x = inputs(gen, D)
        feed(ctl, x)
        with torch.no_grad():  # an optimiser update of the stored weight
            ctl.sites[0].key_stored().add_(0.05 * torch.randn(D, D, generator=gen))
        rec = ctl.step(step)
        direct = pr_of(keys, torch.cov(x.double().T, correction=0))
        if mode != "none":
            assert rec["ctl_pr_oos_l0"] == pytest.approx(direct, rel=1e-5)
        steps, values = ctl.trajectory  # the previous step's row is whole now
        assert steps[-2] == step - 1
        assert float(values["pr_token_oos"][-2][0]) == pytest.approx(direct, rel=1e-5)
        assert torch.isnan(values["pr_token_oos"][-1]).all()  # this step's: one step later
        keys = ctl.sites[0].key_effective().detach().clone()


def test_the_records_on_sigma_and_on_sigma_eps_differ_where_the_inputs_are_rank_deficient(
        ) -> None:
    """Inputs spanning 3 of 32 directions, and a hold at PR 20 (planted: more than they
    allow): on its own Σ_ε the control is on target, reaching it through the ridge ε·I in
    directions the inputs never visit; on Σ the keys have at most 3 directions."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=D, block_size=8, vocab_size=20),
                generator=torch.Generator().manual_seed(0))
    ctl = KeySpectrumControl.attach(model, "hold")
    gen = torch.Generator().manual_seed(1)
    basis = torch.randn(3, D, generator=gen)
    for step in range(1, 6):
        feed(ctl, torch.randn(N, 3, generator=gen) @ basis)
        if step == 2:
            ctl.pr0 = torch.tensor([20.0], dtype=torch.float64)
        rec = ctl.step(step)
    w = ctl.sites[0].key_stored().detach()
    sigma = ctl.moments.covariance(0)
    assert rec["ctl_target_l0"] == 20.0
    assert rec["ctl_pr_l0"] == pytest.approx(20.0, rel=1e-3)
    assert rec["ctl_pr_raw_l0"] == pytest.approx(pr_of(w, sigma), rel=1e-5)
    assert rec["ctl_pr_raw_l0"] <= 3 + 1e-6


def test_sigma_is_the_running_average_of_the_batches_at_half_life_5() -> None:
    """Σ after four steps equals the exponential moving averages of E[x] and E[x xᵀ] with
    half-life 5 (decay 0.5^(1/5)) computed here from the batches, centred; Σ_ε adds
    10⁻³·tr(Σ)/d·I. Pins both parameters of the estimator docs/protocols.md fixes."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=D, block_size=8, vocab_size=20),
                generator=torch.Generator().manual_seed(0))
    ctl = KeySpectrumControl.attach(model, "hold")
    gen = torch.Generator().manual_seed(2)
    decay = 0.5 ** (1 / 5)
    mean = second = None
    for step in range(1, 5):
        x = inputs(gen, D) * step  # the scale moves, so the weights of the past matter
        feed(ctl, x)
        ctl.step(step)
        xd = x.double()
        m, s = xd.mean(0), xd.T @ xd / len(xd)
        mean = m if mean is None else decay * mean + (1 - decay) * m
        second = s if second is None else decay * second + (1 - decay) * s
    sigma = second - torch.outer(mean, mean)
    tol = {"rtol": 0.0, "atol": 1e-5 * float(second.abs().max())}  # float32 sums
    torch.testing.assert_close(ctl.moments.covariance(0), sigma, **tol)
    ridge = 1e-3 * torch.trace(sigma) / D * torch.eye(D, dtype=torch.float64)
    torch.testing.assert_close(ctl.moments.regularised(0), sigma + ridge, **tol)
    batch = torch.cov(xd.T, correction=0)  # the out-of-sample Σ: the last batch alone
    torch.testing.assert_close(ctl.moments.batch(0), batch, **tol)


def test_a_state_saved_before_the_out_of_sample_record_resumes_without_one_step_of_it(
        ) -> None:
    """A version-3 state (no keys of its last step) resumes; the first step after it has
    no ``pr_oos``, the next has."""
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=D, block_size=8, vocab_size=20),
                generator=torch.Generator().manual_seed(0))
    ctl = KeySpectrumControl.attach(model, "hold")
    gen = torch.Generator().manual_seed(3)
    for step in (1, 2):
        feed(ctl, inputs(gen, D))
        ctl.step(step)
    state = {k: v for k, v in ctl.state_dict().items() if k != "prev"}
    ctl.remove()
    again = KeySpectrumControl.attach(model, "hold", record_initial=False)
    again.load_state_dict({**state, "version": 3})
    feed(again, inputs(gen, D))
    assert "ctl_pr_oos_l0" not in again.step(3) and "ctl_pr_raw_l0" in again.last()
    feed(again, inputs(gen, D))
    assert "ctl_pr_oos_l0" in again.step(4)
