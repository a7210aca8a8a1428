"""The control's invariants after every step, at the width where the fast (float32) path runs.

Width 32 (the other control tests) decomposes the Gram matrices in float64; width 128 (the
small preset's) in float32. Each invariant is checked on the stored weights after every step, at
both levels: PR_K on target within 1e-3 (weight level: PR(σ²(W_K)); token level:
PR(W_K Σ_ε W_Kᵀ) on the control's own input covariance), the kept scale (the key spread
tr(W Σ Wᵀ), or ‖W_K‖_F²) within 1e-6, or the reference's spread when the data rule matches
it; W_Q and W_V untouched; sham is a round trip applied at every step; the data rule keeps
the key norm on low-dimensional inputs where the Frobenius rule does not.
"""

from __future__ import annotations

import pytest
import torch

from qkgeom.config import GPTConfig
from qkgeom.control import KeySpectrumControl
from qkgeom.geometry.spectra import participation_ratio
from qkgeom.model import GPT

V, T = 40, 16


def make_model(width: int, n_layer: int = 1) -> GPT:
    cfg = GPTConfig(n_layer=n_layer, n_head=4, n_embd=width, block_size=T, vocab_size=V)
    return GPT(cfg, generator=torch.Generator().manual_seed(0))


def key(model: GPT, layer: int = 0) -> torch.Tensor:
    return model.blocks[layer].attn.k_proj.weight.detach().clone()


def scale_of(w: torch.Tensor, s: torch.Tensor | None) -> float:
    w = w.double()
    return float((w * w).sum() if s is None else ((w @ s) * w).sum())


def level_pr(ctl: KeySpectrumControl, w: torch.Tensor, layer: int = 0) -> float:
    """PR_K of ``w`` at the control's level, computed here from its definition."""
    w = w.double()
    if ctl.level == "weight":
        return float(participation_ratio(torch.linalg.svdvals(w) ** 2))
    sig = ctl.moments.covariance(layer)
    sig = sig + 1e-3 * torch.trace(sig) / sig.shape[0] * torch.eye(sig.shape[0], dtype=sig.dtype)
    return float(participation_ratio(torch.linalg.eigvalsh(w @ sig @ w.T).clamp_min(0)))


def train_step(model: GPT, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    x = torch.randint(0, V, (4, T), generator=gen)
    _, loss = model(x, torch.randint(0, V, (4, T), generator=gen))
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("width", [32, 128])
@pytest.mark.parametrize("mode, dose", [("hold", None), ("shrink", 0.5), ("expand", 2.0),
                                        ("sham", None)])
@pytest.mark.parametrize("scale", ["data", "frobenius"])
@pytest.mark.parametrize("level", ["token", "weight"])
def test_every_step_is_on_target_and_keeps_the_scale(width: int, mode: str, dose: float | None,
                                                     scale: str, level: str) -> None:
    model = make_model(width)
    ctl = KeySpectrumControl.attach(model, mode, level=level, scale=scale, dose=dose,
                                    ramp_steps=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        train_step(model, opt, gen)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rec = ctl.step(step)
        s = ctl.moments.covariance(0) if scale == "data" else None
        after = key(model)
        assert abs(scale_of(after, s) / scale_of(before["blocks.0.attn.k_proj.weight"], s)
                   - 1) < 1e-6
        target = rec["ctl_target_l0"]
        assert abs(level_pr(ctl, after) - target) / target < 1e-3
        assert rec["ctl_pr_l0"] == pytest.approx(level_pr(ctl, after), rel=1e-5)
        if mode == "shrink":  # the cap: dose x PR0, never above the current PR
            assert target == pytest.approx(min(0.5 * float(ctl.pr0[0]),
                                               rec["ctl_pr_before_l0"]), rel=1e-12)
        for name, p in model.named_parameters():  # W_Q, W_V and the rest untouched
            if "k_proj" not in name:
                assert torch.equal(p, before[name]), name


@pytest.mark.parametrize("width", [32, 128])
@pytest.mark.parametrize("scale", ["data", "frobenius"])
@pytest.mark.parametrize("level", ["token", "weight"])
def test_sham_is_a_round_trip_applied_at_every_step(width: int, scale: str, level: str) -> None:
    """Never a cap: every step reshapes every unit (the count says so), and the weights
    change by round-off only."""
    steps = 4
    model = make_model(width, n_layer=2)
    ctl = KeySpectrumControl.attach(model, "sham", level=level, scale=scale)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        train_step(model, opt, gen)
        before = [key(model, i) for i in range(2)]
        rec = ctl.step(step)
        for i in range(2):
            change = (key(model, i) - before[i]).double().norm() / before[i].double().norm()
            assert float(change) <= 1e-5
            assert rec[f"ctl_gamma_l{i}"] == 1.0 and rec[f"ctl_bound_share_l{i}"] == 0.0
    assert ctl.reshapes == 2 * steps  # both layers, every step


@pytest.mark.parametrize("scale, kept", [("data", True), ("frobenius", False)])
def test_the_data_rule_keeps_the_key_norm_on_low_dimensional_inputs(scale: str,
                                                                   kept: bool) -> None:
    """Inputs in 3 of 32 directions, and a W_K whose large singular directions are those 3:
    flattening its spectrum (expand to the largest PR) under the Frobenius rule moves its
    energy into directions the inputs never use, so the keys shrink (about 3/32 of it stays
    on the data); the data rule rescales so the mean squared key norm on a held-out batch
    stays (S is a running estimate, so about, not exactly)."""
    d = 32
    model = make_model(d)
    gen = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]  # orthonormal columns
    data_dirs = basis[:, :3]  # (d, 3) the only directions the key inputs use
    k_proj = model.blocks[0].attn.k_proj
    with torch.no_grad():  # W_K = U diag(s) Vᵀ with its 3 large values on the data
        u = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
        s = torch.tensor([4.0, 3.0, 2.0] + [0.05] * (d - 3))
        k_proj.weight.copy_(u @ torch.diag(s) @ basis.T)
    project = data_dirs @ data_dirs.T
    k_proj.register_forward_pre_hook(lambda m, args: (args[0] @ project,))
    keys: list[torch.Tensor] = []
    k_proj.register_forward_hook(lambda m, args, out: keys.append(out.detach()))

    def mean_key_norm2(tokens: torch.Tensor) -> float:
        keys.clear()
        model.eval()
        with torch.no_grad():
            model(tokens)
        model.train()
        return float((keys[0].double() ** 2).sum(-1).mean())

    held_out = torch.randint(0, V, (8, T), generator=torch.Generator().manual_seed(99))
    ctl = KeySpectrumControl.attach(model, "expand", level="weight", scale=scale, dose=100.0,
                                    layers=[0])
    for _ in range(3):  # training forwards fill S (no update: the weights stay as built)
        model(torch.randint(0, V, (8, T), generator=gen))
    before = mean_key_norm2(held_out)
    rec = ctl.step(1)
    assert rec["ctl_pr_l0"] == pytest.approx(float(d), rel=1e-3)  # flattened, as asked
    ratio = mean_key_norm2(held_out) / before
    if kept:
        assert abs(ratio - 1) < 0.05
    else:
        assert ratio < 0.3


@pytest.mark.parametrize("level", ["token", "weight"])
@pytest.mark.parametrize("mode", ["hold", "shrink", "sham"])
def test_the_data_rule_matches_the_reference_runs_key_spread_at_every_step(
        level: str, mode: str) -> None:
    """With a reference, every unit is rescaled to the reference's key spread at the same
    step (bound or not), on the control's own Σ: tr(W Σ Wᵀ) equals it within 1e-6."""
    steps = 4
    model = make_model(32, n_layer=2)
    ctl = KeySpectrumControl.attach(model, mode, level=level, scale="data", ramp_steps=0)
    spread = torch.linspace(0.5, 2.0, steps + 1, dtype=torch.float64)[:, None].repeat(1, 2)
    big = torch.full((steps + 1, 2), 1e9, dtype=torch.float64)  # a cap that never binds
    ctl.reference = {"pr": big, "pr_token": big, "spread": spread}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        train_step(model, opt, gen)
        rec = ctl.step(step)
        for i in range(2):
            got = scale_of(key(model, i), ctl.moments.covariance(i))
            assert got == pytest.approx(float(spread[step, i]), rel=1e-6)
            assert rec[f"ctl_spread_target_l{i}"] == float(spread[step, i])
            assert rec[f"ctl_spread_l{i}"] == pytest.approx(got, rel=1e-9)
