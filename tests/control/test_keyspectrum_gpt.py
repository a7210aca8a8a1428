"""Key-spectrum control on the project's GPT through real AdamW steps on random tokens.

Most tests here read the weight level (``level="weight"``: the spectrum of W_K itself,
whose PR they check with :func:`weight_pr`); the resume test runs both levels, and the
token level's own tests are in test_token_level.py and test_invariants.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from qkgeom.config import GPTConfig, KeyControlConfig
from qkgeom.control import KeyControlCallback, KeySpectrumControl, apply_target
from qkgeom.errors import QKGeomError
from qkgeom.geometry.spectra import weight_pr
from qkgeom.model import GPT
from qkgeom.training.callbacks import TrainContext

STEPS = 20
LR = 1e-3  # uncontrolled PR_K drifts by ~2 % in 20 steps at this rate (far beyond 1e-3)


def attach(model: torch.nn.Module, *args, **kw) -> KeySpectrumControl:
    """:meth:`KeySpectrumControl.attach` at the weight level unless ``level`` is given."""
    kw.setdefault("level", "weight")
    return KeySpectrumControl.attach(model, *args, **kw)


def make_model(qk_init: str = "normal") -> GPT:
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=40,
                    qk_init=qk_init)
    return GPT(cfg, generator=torch.Generator().manual_seed(0))


def layer_pr(model: GPT) -> list[float]:
    return [float(weight_pr(model.qk_weights(i)[1].detach())) for i in range(2)]


def head_pr(model: GPT) -> list[float]:
    return [float(weight_pr(model.qk_weights(i)[1].detach()[h * 16:(h + 1) * 16]))
            for i in range(2) for h in range(2)]


def run(model: GPT, ctl: KeySpectrumControl | None, steps: int = STEPS, *, start: int = 0,
        opt: torch.optim.Optimizer | None = None, check=None) -> list[dict]:
    """AdamW steps on seeded random tokens; ``check(model, before, rec)`` after each step."""
    opt = opt or torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(100 + start)
    records = []
    for s in range(start, start + steps):
        x = torch.randint(0, 40, (4, 16), generator=gen)
        y = torch.randint(0, 40, (4, 16), generator=gen)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        rec = ctl.step(s + 1) if ctl is not None else {}
        if check is not None:
            check(model, before, rec)
        records.append(rec)
    return records


def k_name(i: int) -> str:
    return f"blocks.{i}.attn.k_proj.weight"


def key_scale(w: torch.Tensor, s: torch.Tensor | None) -> float:
    """tr(W S Wᵀ) (the data rule's kept quantity), or ‖W‖_F² for S = None, in float64."""
    w = w.detach().double()
    return float((w * w).sum() if s is None else ((w @ s.double()) * w).sum())


@pytest.mark.parametrize("scale", ["frobenius", "data"])
def test_hold_keeps_pr_k_at_step_0_while_the_uncontrolled_run_drifts(scale: str) -> None:
    model = make_model()
    pr0 = layer_pr(model)
    ctl = attach(model, "hold", scale=scale)
    assert ctl.pr0.tolist() == pytest.approx(pr0, rel=1e-12)

    def check(m: GPT, before: dict, rec: dict) -> None:
        for i, pr in enumerate(layer_pr(m)):
            assert abs(pr - pr0[i]) / pr0[i] < 1e-3
            assert rec[f"ctl_pr_l{i}"] == pytest.approx(pr, rel=1e-9)
            s = ctl.moments.covariance(i) if scale == "data" else None  # S of this step
            kept = key_scale(m.qk_weights(i)[1], s) / key_scale(before[k_name(i)], s)
            assert abs(kept - 1) < 1e-6
        for name, p in m.named_parameters():  # only W_K moves: W_Q, W_V, the rest untouched
            if "k_proj" not in name:
                assert torch.equal(p, before[name]), name

    run(model, ctl, check=check)
    free = make_model()
    run(free, None)
    assert max(abs(a - b) / b for a, b in zip(layer_pr(free), pr0, strict=True)) > 1e-2


def test_shrink_follows_the_ramp_to_the_dose_and_never_expands() -> None:
    model = make_model()
    ctl = attach(model, "shrink", dose=0.5, ramp_steps=STEPS)
    pr0 = ctl.pr0.clone()
    recs = run(model, ctl)
    for s, rec in enumerate(recs, start=1):
        for i in range(2):
            sched = float(pr0[i]) * (1 - 0.5 * s / STEPS)
            assert rec[f"ctl_sched_l{i}"] == pytest.approx(sched, rel=1e-12)
            assert rec[f"ctl_dose_l{i}"] == pytest.approx(1 - 0.5 * s / STEPS, rel=1e-12)
            assert rec[f"ctl_base_l{i}"] == float(pr0[i])  # no reference: base = PR0
            assert rec[f"ctl_target_l{i}"] <= rec[f"ctl_pr_before_l{i}"] * (1 + 1e-12)
            assert abs(rec[f"ctl_pr_l{i}"] - rec[f"ctl_target_l{i}"]) / rec[f"ctl_target_l{i}"] < 1e-3
    final = layer_pr(model)
    for i in range(2):
        assert abs(final[i] - 0.5 * float(pr0[i])) / (0.5 * float(pr0[i])) < 1e-3


def test_shrink_leaves_a_matrix_alone_when_training_shrank_it_further() -> None:
    model = make_model()
    ctl = attach(model, "shrink", scale="frobenius", dose=0.9,
                                    ramp_steps=1000)
    with torch.no_grad():  # shrink layer 0 far below any scheduled target
        w = model.qk_weights(0)[1]
        w.copy_(torch.linalg.svd(w)[0][:, :1] @ torch.linalg.svd(w)[2][:1] * w.norm())
    w0 = model.qk_weights(0)[1].detach().clone()
    rec = ctl.step(1)
    assert torch.equal(model.qk_weights(0)[1], w0)  # not expanded back up: not even rewritten
    assert rec["ctl_target_l0"] == pytest.approx(rec["ctl_pr_before_l0"]) == pytest.approx(1.0)
    assert rec["ctl_gamma_l0"] == 1.0
    assert rec["ctl_bound_share_l0"] == 0.0 and rec["ctl_bound_share_l1"] == 1.0


def test_expand_mirrors_and_is_clamped_to_the_largest_pr() -> None:
    model = make_model()
    ctl = attach(model, "expand", dose=2.0, ramp_steps=STEPS)
    pr0 = ctl.pr0.clone()
    recs = run(model, ctl)
    for rec in recs:
        for i in range(2):
            assert rec[f"ctl_target_l{i}"] >= rec[f"ctl_pr_before_l{i}"] * (1 - 1e-12)
    final = layer_pr(model)
    for i in range(2):  # 2·PR0 ≈ 31.5 and 32.02: the second is capped at 32 = d_model
        want = min(2 * float(pr0[i]), 32.0)
        assert abs(final[i] - want) / want < 1e-3
    assert float(pr0[1]) * 2 > 32  # the cap was really exercised


@pytest.mark.parametrize("scope", ["layer", "head"])
def test_the_fast_projection_equals_apply_target(scope: str) -> None:
    """step() uses an eigendecomposition of W·Wᵀ; apply_target uses torch.linalg.svd."""
    model = make_model()
    before = [model.qk_weights(i)[1].detach().clone() for i in range(2)]
    ctl = attach(model, "shrink", scope=scope, scale="frobenius", dose=0.6,
                                    ramp_steps=4)
    ctl.step(4)
    for i in range(2):
        units = before[i].view(2, 16, 32) if scope == "head" else before[i][None]
        n_units = units.shape[0]
        targets = 0.6 * ctl.pr0[i * n_units:(i + 1) * n_units] if scope == "head" else \
            0.6 * ctl.pr0[i:i + 1]
        want, info = apply_target(units, targets)
        assert not info["clamped"].any()
        got = model.qk_weights(i)[1].detach().view(units.shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_head_scope_holds_every_head_separately() -> None:
    model = make_model()
    pr0 = head_pr(model)
    ctl = attach(model, "hold", scope="head", scale="frobenius")
    assert ctl.names == ["l0h0", "l0h1", "l1h0", "l1h1"]

    def check(m: GPT, before: dict, rec: dict) -> None:
        for j, pr in enumerate(head_pr(m)):
            assert abs(pr - pr0[j]) / pr0[j] < 1e-3
        for i in range(2):
            for h in range(2):  # each head's Frobenius norm is kept
                rows = slice(h * 16, (h + 1) * 16)
                n0 = before[k_name(i)][rows].double().norm()
                assert abs(float(m.qk_weights(i)[1].detach()[rows].double().norm() / n0) - 1) < 1e-6

    run(model, ctl, check=check)


def test_layers_subset_controls_only_those_layers() -> None:
    model = make_model()
    ctl = attach(model, "shrink", scale="frobenius", ramp_steps=STEPS,
                                    layers=[1])
    assert ctl.names == ["l1"]
    k0 = model.qk_weights(0)[1].detach().clone()
    ctl.step(STEPS)
    assert torch.equal(model.qk_weights(0)[1], k0)
    assert layer_pr(model)[1] == pytest.approx(0.5 * float(ctl.pr0[0]), rel=1e-3)


@pytest.mark.parametrize("record", [False, True])
def test_mode_none_is_bit_identical_to_no_control(record: bool) -> None:
    a, b = make_model(), make_model()
    ctl = attach(b, "none", record=record)
    assert ctl.last() == {} and ctl.targets() == {}
    run(a, None)
    recs = run(b, ctl)
    assert all(r == {} for r in recs)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    steps, values = ctl.trajectory  # with record: PR_K at step 0 and after every update
    if record:
        assert steps == list(range(STEPS + 1))
        assert values["pr"][-1].tolist() == pytest.approx(layer_pr(a), rel=1e-9)
        assert all(bool(torch.isfinite(v).all()) for f in ("pr_token", "spread")
                   for v in values[f])
    else:
        assert steps == [] and ctl.sites == []  # not even the lookup


def test_parametrize_puts_pr_on_target_like_post_step() -> None:
    post, par = make_model(), make_model()
    c_post = attach(post, "shrink", ramp_steps=STEPS)
    c_par = attach(par, "shrink", ramp_steps=STEPS, how="parametrize")
    assert "blocks.0.attn.k_proj.parametrizations.weight.original" in dict(par.named_parameters())
    run(post, c_post)
    recs = run(par, c_par)
    for rec in recs:  # the model sees a W_K on target after every step
        for i in range(2):
            assert abs(rec[f"ctl_pr_l{i}"] - rec[f"ctl_target_l{i}"]) / rec[f"ctl_target_l{i}"] < 1e-3
    for got, want in zip(layer_pr(par), layer_pr(post), strict=True):  # both at 0.5·PR0
        assert got == pytest.approx(want, rel=1e-3)
    c_par.remove()  # bakes the reshaped weight back into a plain parameter
    assert "blocks.0.attn.k_proj.weight" in dict(par.named_parameters())
    assert layer_pr(par) == pytest.approx(layer_pr(post), rel=1e-3)


def test_parametrize_hold_trains_from_an_orthogonal_init_without_nan() -> None:
    model = make_model("orthogonal")  # flat W_K spectra at step 0: SVD autograd would NaN
    ctl = attach(model, "hold", scope="head", how="parametrize")
    assert ctl.pr0.tolist() == pytest.approx([16.0] * 4, rel=1e-9)  # data scale: S in the graph
    run(model, ctl, steps=5)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert head_pr(model) == pytest.approx([16.0] * 4, rel=1e-3)


RESUMABLE = [("hold", "data", "post_step"), ("hold", "frobenius", "post_step"),
             ("shrink", "data", "post_step"), ("shrink", "frobenius", "post_step"),
             ("sham", "data", "post_step"), ("expand", "data", "post_step"),
             ("shrink", "data", "parametrize")]


@pytest.mark.parametrize("level", ["token", "weight"])
@pytest.mark.parametrize("mode, scale, how", RESUMABLE)
def test_state_dict_resume_reproduces_the_uninterrupted_run(mode: str, scale: str,
                                                            how: str, level: str) -> None:
    """Every mode: weights, records, counters and Σ after a resume equal the uninterrupted
    run's bit for bit (the state carries PR0, the step, the window counters and Σ)."""
    kw = dict(level=level, scale=scale, ramp_steps=STEPS, how=how)
    full = make_model()
    c_full = attach(full, mode, **kw)
    opt_full = torch.optim.AdamW(full.parameters(), lr=LR)
    run(full, c_full, steps=10, opt=opt_full)
    run(full, c_full, steps=10, start=10, opt=opt_full)

    first = make_model()
    c_first = attach(first, mode, **kw)
    opt_first = torch.optim.AdamW(first.parameters(), lr=LR)
    run(first, c_first, steps=10, opt=opt_first)
    saved = copy.deepcopy({"model": first.state_dict(), "opt": opt_first.state_dict(),
                           "ctl": c_first.state_dict()})
    assert saved["ctl"]["step"] == 10

    resumed = make_model()
    c_res = attach(resumed, mode, **kw, record_initial=False)
    resumed.load_state_dict(saved["model"])
    with pytest.raises(QKGeomError, match="step-0|key inputs"):
        c_res.step(11)  # no PR0 (nor Σ) yet
    c_res.load_state_dict(saved["ctl"])
    opt_res = torch.optim.AdamW(resumed.parameters(), lr=LR)
    opt_res.load_state_dict(saved["opt"])
    run(resumed, c_res, steps=10, start=10, opt=opt_res)
    assert torch.equal(c_res.pr0, c_full.pr0)
    for pa, pb in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert c_res.last() == c_full.last() and c_res.reshapes == c_full.reshapes
    if c_full.moments is not None:
        for j in range(2):
            assert torch.equal(c_res.moments.covariance(j), c_full.moments.covariance(j))
    other = attach(make_model(), "hold" if mode != "hold" else "shrink", level=level,
                   record_initial=False)
    with pytest.raises(QKGeomError, match="mode"):
        other.load_state_dict(saved["ctl"])


def test_bad_arguments_are_qkgeom_errors() -> None:
    model = make_model()
    cases = [dict(mode="squash"), dict(scope="neuron"), dict(how="hook"),
             dict(scale="norm"), dict(mode="shrink", dose=1.5), dict(mode="expand", dose=0.5),
             dict(mode="sham", dose=0.5), dict(dose=0.5), dict(reference="elsewhere"),
             dict(mode="shrink", ramp_steps=-1), dict(layers=[2]),
             dict(mode="shrink", reference="/no/such/run")]
    for kw in cases:
        args = {"mode": "hold", **kw}
        with pytest.raises(QKGeomError):
            attach(model, args.pop("mode"), **args)
    with pytest.raises(QKGeomError, match="supported"):
        attach(torch.nn.Sequential(torch.nn.Linear(4, 4)), "hold")
    attach(model, "hold", how="parametrize")
    with pytest.raises(QKGeomError, match="twice"):
        attach(model, "hold", how="parametrize")


# ------------------------------------------------------------------ the trainer callback


def ctx_for(model: GPT, step: int = 0) -> TrainContext:
    return TrainContext(config=SimpleNamespace(steps=STEPS, warmup_steps=STEPS), model=model,
                        optimizer=None, step=step)


def test_callback_attaches_to_the_built_model_steps_and_reports_on_probe() -> None:
    model = make_model()
    cb = KeyControlCallback(KeyControlConfig("shrink", level="weight", dose=0.5))  # ramp: warmup
    ctx = ctx_for(model)
    cb.on_model_built(ctx)
    cb.on_train_start(ctx)
    at0 = cb.on_probe(ctx, None)
    assert at0["ctl_target_l0"] == at0["ctl_pr_l0"] == pytest.approx(layer_pr(model)[0])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for s in range(1, STEPS + 1):
        _, loss = model(torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.step = s
        cb.on_step_end(ctx)
    out = cb.on_probe(ctx, None)
    assert out["ctl_pr_l1"] == pytest.approx(0.5 * at0["ctl_pr_l1"], rel=1e-3)
    assert out["ctl_bound_share_l1"] == 1.0  # the cap decided every step since the last probe
    assert cb.state_dict()["step"] == STEPS
    assert cb.state_dict()["window"] == 0  # the probe started a new window


def test_callback_resume_takes_pr0_from_the_state_not_from_the_weights() -> None:
    """A resumed run's targets come from the checkpoint's state (loaded after the model is
    built), never from the trained weights it attaches to."""
    hold = KeyControlConfig("hold", level="weight")
    model = make_model()
    cb = KeyControlCallback(hold)
    cb.on_model_built(ctx_for(model))
    state = cb.state_dict()
    with torch.no_grad():  # the resumed weights differ from step 0
        model.qk_weights(0)[1].mul_(torch.linspace(0.5, 1.5, 32)[:, None])
    resumed = KeyControlCallback(hold)
    resumed.on_model_built(ctx_for(model, step=7))
    assert not torch.equal(resumed.control.pr0, cb.control.pr0)  # measured on trained weights
    resumed.load_state_dict(state)
    resumed.on_train_start(ctx_for(model, step=7))
    assert torch.equal(resumed.control.pr0, cb.control.pr0)
    assert resumed.control.step_count == 0
    fresh = KeyControlCallback(hold)
    fresh.on_model_built(ctx_for(model, step=7))
    with pytest.raises(QKGeomError, match="no key-control state"):
        fresh.on_train_start(ctx_for(model, step=7))


def test_callback_none_does_nothing() -> None:
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    cb = KeyControlCallback(KeyControlConfig("none"))
    ctx = ctx_for(model, step=3)
    cb.on_model_built(ctx)
    cb.on_step_end(ctx)
    assert cb.on_probe(ctx, None) is None and cb.control.sites == []
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
