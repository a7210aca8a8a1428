"""The model options against attention-logit growth: qk-layernorm, σReparam (qk and all),
the logit soft-cap, QK-Clip, and the z-loss the trainer adds (docs/stability.md#remedies)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from qkgeom.arch import adapter_for
from qkgeom.config import GPTConfig, from_dict, make_config
from qkgeom.errors import QKGeomError
from qkgeom.model import GPT, soft_cap, z_loss

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=16, vocab_size=50)


def build(seed: int = 0, q_scale: float = 1.0, **over) -> GPT:
    """The model of ``CFG`` with ``over``; ``q_scale`` multiplies every W_Q (logits of a few
    units instead of the init's hundredths; under σReparam through γ)."""
    torch.manual_seed(seed)  # σReparam's power iteration starts from torch's generator
    model = GPT(dataclasses.replace(CFG, **over), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for block in model.blocks:
            q = block.attn.q_proj
            if parametrize.is_parametrized(q, "weight"):
                q.parametrizations.weight[1].gain.mul_(q_scale)
            else:
                q.weight.mul_(q_scale)
    return model


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (4, CFG.block_size),
                         generator=torch.Generator().manual_seed(seed))


def train_steps(model: GPT, n: int, lr: float = 1e-2, clip: bool = False) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for i in range(n):
        x = batch(i)
        _, loss = model(x, x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if clip:
            model.qk_clip_()


@torch.no_grad()
def attention_inputs(model: GPT, x: torch.Tensor) -> list[torch.Tensor]:
    """What each attention layer receives (LN₁ of its block's input) on ``x``, eval mode."""
    seen: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
             for b in model.blocks]
    was = model.training
    model.eval()
    try:
        model(x)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return seen


@torch.no_grad()
def head_maxima(model: GPT, inputs: list[torch.Tensor]) -> torch.Tensor:
    """(L, nh) largest scaled logit q·k/√hd of each head over the causal pairs, each layer
    on its recorded ``inputs`` with the layer's present W_Q, W_K (and biases): the quantity
    QK-Clip bounds, computed apart from the model's own recording."""
    out = []
    for block, h in zip(model.blocks, inputs, strict=True):
        B, T, _ = h.shape
        q, k = (lin(h).view(B, T, CFG.n_head, CFG.head_dim).transpose(1, 2)
                for lin in (block.attn.q_proj, block.attn.k_proj))
        s = (q @ k.transpose(-2, -1)) / math.sqrt(CFG.head_dim)  # (B, nh, T, T)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out.append(s.amax(dim=(0, 2, 3)))
    return torch.stack(out)


def maxima(model: GPT, x: torch.Tensor) -> torch.Tensor:
    return head_maxima(model, attention_inputs(model, x))


# --- qk-layernorm ---------------------------------------------------------------------------


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


# --- σReparam -------------------------------------------------------------------------------


def linears(model: GPT) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("form", ["qk", "all"])
def test_sigma_reparam_is_the_plain_model_at_step_0(form: str) -> None:
    """Same seed: the logits equal the plain model's up to round-off, in eval mode and in
    the first training forward (which runs a power iteration)."""
    x = batch()
    with torch.no_grad():
        plain = build()(x)[0]
        model = build(sigma_reparam=form).eval()
        torch.testing.assert_close(model(x)[0], plain, rtol=0, atol=2e-6)
        model.train()
        torch.testing.assert_close(model(x)[0], plain, rtol=0, atol=2e-6)
        # at a logit scale where a 0.1 % error in σ would show, too
        plain, model = build(q_scale=30.0), build(q_scale=30.0, sigma_reparam=form)
        torch.testing.assert_close(model(x)[0], plain(x)[0], rtol=0, atol=2e-6)


def test_sigma_reparam_qk_parametrises_w_q_and_w_k_and_all_every_linear_of_the_blocks() -> None:
    expected = {
        "qk": {f"blocks.{i}.attn.{p}_proj" for i in range(2) for p in "qk"},
        "all": {f"blocks.{i}.{name}" for i in range(2) for name in
                ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.c_proj", "mlp.c_fc",
                 "mlp.c_proj")},
        "none": set()}
    for form, names in expected.items():
        model = build(sigma_reparam=form)
        found = {n for n, m in linears(model).items() if parametrize.is_parametrized(m, "weight")}
        assert found == names, form
        assert "lm_head" in linears(model) and "lm_head" not in found  # the tied embedding
        assert model.lm_head.weight is model.wte.weight


def test_sigma_reparam_keeps_sigma_max_at_gamma_while_training() -> None:
    sigma = build(sigma_reparam="qk")  # each parametrised layer alike: the qk ones suffice
    train_steps(sigma, 30)
    sigma.eval()
    for name, lin in linears(sigma).items():
        if parametrize.is_parametrized(lin, "weight"):
            gain = float(lin.parametrizations.weight[1].gain)
            top = float(torch.linalg.matrix_norm(lin.weight.detach(), ord=2))
            assert top == pytest.approx(abs(gain), rel=0.02), name


def test_sigma_reparam_round_trips_through_a_state_dict() -> None:
    """What a checkpoint saves (the weight, the power iteration's vectors, γ) rebuilds the
    same model: a resumed run computes what the uninterrupted one does."""
    model = build(sigma_reparam="all")
    train_steps(model, 5)
    twin = build(seed=1, sigma_reparam="all")
    twin.load_state_dict(model.state_dict())
    model.eval(), twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(twin(batch())[0], model(batch())[0], rtol=0, atol=0)


def test_the_old_key_qk_reparam_sigma_is_sigma_reparam_qk_with_one_warning() -> None:
    with pytest.warns(FutureWarning, match="use model.sigma_reparam: qk instead of "
                                           "model.qk_reparam: sigma") as caught:
        old = make_config("smoke", {"model": {"qk_reparam": "sigma"}})
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    new = make_config("smoke", {"model": {"sigma_reparam": "qk"}})
    assert old == new and old.model.sigma_reparam == "qk" and old.model.qk_reparam == "none"
    assert old.config_hash() == new.config_hash()
    # a config.json recorded before the rename reads, and trains the same model
    recorded = make_config("smoke").to_dict()
    for key in ("sigma_reparam", "logit_softcap", "qk_clip_threshold", "qk_clip_alpha"):
        recorded["model"].pop(key)
    recorded.pop("z_loss")
    recorded["model"]["qk_reparam"] = "sigma"
    with pytest.warns(FutureWarning):
        assert from_dict(recorded) == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new key alone, or the old one at none: silent
        make_config("smoke", {"model": {"sigma_reparam": "all", "qk_reparam": "none"}})
    with pytest.raises(QKGeomError, match=r"^model.qk_reparam 'sigma' \(the old name of "
                                          "model.sigma_reparam: qk\\) contradicts "
                                          "model.sigma_reparam 'all'[^\n]*$"):
        make_config("smoke", {"model": {"qk_reparam": "sigma", "sigma_reparam": "all"}})


# --- logit soft-cap -------------------------------------------------------------------------


def test_soft_cap_bounds_every_logit_by_c_and_leaves_small_ones() -> None:
    s = torch.linspace(-1e4, 1e4, 20001)
    for c in (1.0, 30.0, 50.0):
        capped = soft_cap(s, c)
        assert float(capped.abs().max()) <= c
        assert bool((capped[1:] >= capped[:-1]).all())  # order kept (monotone)
    small = torch.linspace(-0.05, 0.05, 101)
    torch.testing.assert_close(soft_cap(small, 50.0), small, rtol=1e-6, atol=0)


def attention_by_hand(attn: nn.Module, x: torch.Tensor, cap: float) -> torch.Tensor:
    """softmax(mask(c·tanh(q·k/√hd / c))) @ v through c_proj, from the module's weights."""
    B, T, C = x.shape
    nh, hd = attn.n_head, attn.head_dim

    def heads(lin):
        return lin(x).view(B, T, nh, hd).transpose(1, 2)

    q, k, v = heads(attn.q_proj), heads(attn.k_proj), heads(attn.v_proj)
    s = cap * torch.tanh((q @ k.transpose(-2, -1)) / math.sqrt(hd) / cap)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.softmax(s, dim=-1) @ v
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))


@torch.no_grad()
def test_the_soft_capped_path_caps_before_the_softmax_and_is_sdpa_when_c_is_large() -> None:
    x = torch.randn(3, CFG.block_size, CFG.n_embd, generator=torch.Generator().manual_seed(1))
    plain = build(q_scale=30.0).eval().blocks[0].attn
    logits = maxima(build(q_scale=30.0), batch())
    assert float(logits.max()) > 3.0  # logits of a few units: a cap at 1 must show
    sdpa = plain(x)
    for cap, differs in ((1e6, False), (1.0, True)):
        attn = build(q_scale=30.0, logit_softcap=cap).eval().blocks[0].attn
        out = attn(x)
        torch.testing.assert_close(out, attention_by_hand(attn, x, cap), rtol=0, atol=1e-6)
        if differs:
            assert float((out - sdpa).abs().max()) > 1e-3
        else:
            torch.testing.assert_close(out, sdpa, rtol=0, atol=1e-6)


def test_a_soft_cap_trains_through_the_explicit_path_with_dropout() -> None:
    """Gradients flow through c·tanh; dropout acts on the attention weights in training."""
    model = build(q_scale=30.0, logit_softcap=2.0, dropout=0.5)
    x = batch()
    model.train()
    a, b = model(x)[0], model(x)[0]
    assert not torch.equal(a, b)  # dropout is on
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x)[0], model(x)[0])
    _, loss = model(x, x)
    loss.backward()
    assert float(model.blocks[0].attn.q_proj.weight.grad.abs().sum()) > 0


def test_the_adapter_reports_the_models_soft_cap() -> None:
    assert adapter_for(build()).logit_softcap is None
    assert adapter_for(build(logit_softcap=50.0)).logit_softcap == 50.0


# --- QK-Clip --------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha, bias", [(0.5, False), (0.5, True), (0.0, False), (1.0, True)])
def test_after_a_qk_clip_step_every_head_is_at_most_tau_and_those_above_end_at_tau(
        alpha: float, bias: bool) -> None:
    """Each layer's logits recomputed on the inputs it had in the step's forward (a later
    layer's inputs move with the clipped layers before it: the rule bounds each layer on
    what it saw)."""
    x = batch()
    model = build(q_scale=30.0, bias=bias, qk_clip_threshold=1.0, qk_clip_alpha=alpha)
    if bias:  # biases start at 0: give q and k some, so that their scaling is tested
        with torch.no_grad():
            for b in model.blocks:
                for lin in (b.attn.q_proj, b.attn.k_proj):
                    lin.bias.copy_(torch.randn(lin.bias.shape,
                                               generator=torch.Generator().manual_seed(2)))
    inputs = attention_inputs(model, x)
    before = head_maxima(model, inputs)  # (L, nh)
    tau = float(before.flatten().median())  # half the heads above it
    model.config = dataclasses.replace(model.config, qk_clip_threshold=tau)
    w_q = [b.attn.q_proj.weight.detach().clone() for b in model.blocks]
    w_k = [b.attn.k_proj.weight.detach().clone() for b in model.blocks]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # a step that leaves the weights
    model.train()
    _, loss = model(x, x)
    torch.testing.assert_close(torch.stack([b.attn.logit_max for b in model.blocks]), before,
                               rtol=1e-5, atol=1e-6)  # what the forward recorded
    loss.backward()
    opt.step()
    clipped = model.qk_clip_()
    over = before > tau
    assert 0 < int(clipped) == int(over.sum()) < over.numel()
    after = head_maxima(model, inputs)
    assert bool((after <= tau * (1 + 1e-5)).all())
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-5, atol=0)
    assert torch.equal(after[~over], before[~over])  # untouched heads: bit for bit
    hd = CFG.head_dim
    for layer, block in enumerate(model.blocks):
        gamma = torch.where(over[layer], tau / before[layer], 1.0)
        for w0, lin, power in ((w_q[layer], block.attn.q_proj, alpha),
                               (w_k[layer], block.attn.k_proj, 1 - alpha)):
            want = w0 * gamma.pow(power).repeat_interleave(hd)[:, None]
            torch.testing.assert_close(lin.weight.detach(), want, rtol=1e-6, atol=0)
        assert bool(torch.isneginf(block.attn.logit_max).all())  # the maxima are forgotten
    assert int(model.qk_clip_()) == 0  # nothing recorded since: nothing clipped


def test_qk_clip_with_every_head_below_tau_changes_nothing() -> None:
    """Weights bit-identical to a run without QK-Clip, step after step; the recorded maxima
    are no checkpoint state."""
    plain, clipped = build(), build(qk_clip_threshold=1e9)
    train_steps(plain, 5)
    train_steps(clipped, 5, clip=True)
    a, b = plain.state_dict(), clipped.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_qk_clip_keeps_the_running_max_of_the_forwards_and_the_pre_cap_logits() -> None:
    """Two forwards before a step (gradient accumulation): the max of both; under a
    soft-cap the uncapped logits; eval forwards (probes) record nothing."""
    model = build(q_scale=30.0, logit_softcap=1.0, qk_clip_threshold=100.0)
    x, y = batch(0), batch(1)
    model.eval()
    with torch.no_grad():
        model(x)
    assert bool(torch.isneginf(model.blocks[0].attn.logit_max).all())
    model.train()
    with torch.no_grad():
        model(x), model(y)
    want = torch.maximum(maxima(model, x), maxima(model, y))
    assert float(want.max()) > 1.0  # above the cap: the recorded values are pre-cap
    got = torch.stack([b.attn.logit_max for b in model.blocks])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_qk_clip_needs_its_threshold() -> None:
    with pytest.raises(ValueError, match="qk_clip_threshold"):
        build().qk_clip_()


# --- z-loss ---------------------------------------------------------------------------------


def test_z_loss_is_the_mean_squared_log_normaliser() -> None:
    logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]]]))  # (1, 2, 4)
    want = (math.log(10.0) ** 2 + math.log(4.0) ** 2) / 2
    assert float(z_loss(logits)) == pytest.approx(want, rel=1e-6)


def test_z_loss_gradient_is_two_coef_log_z_softmax_over_n() -> None:
    coef = 1e-2
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)) * 3 + 2
    logits.requires_grad_(True)
    (coef * z_loss(logits)).backward()
    with torch.no_grad():
        log_z = torch.log(torch.exp(logits.double()).sum(-1, keepdim=True))
        want = 2 * coef * log_z * torch.softmax(logits.double(), -1) / 6  # N = 2·3 tokens
    torch.testing.assert_close(logits.grad.double(), want, rtol=1e-5, atol=1e-9)


# --- refusals and export --------------------------------------------------------------------


@pytest.mark.parametrize("over, words", [
    ({"model": {"sigma_reparam": "spectral"}}, "unknown model.sigma_reparam 'spectral'"),
    ({"model": {"qk_reparam": "spectral"}}, "unknown model.qk_reparam 'spectral'"),
    ({"model": {"logit_softcap": 0.0}}, "model.logit_softcap must be a finite number > 0"),
    ({"model": {"logit_softcap": -50.0}}, "model.logit_softcap must be a finite number > 0"),
    ({"model": {"logit_softcap": float("inf")}}, "model.logit_softcap must be a finite"),
    ({"model": {"qk_clip_threshold": 0.0}}, "model.qk_clip_threshold must be a finite"),
    ({"model": {"qk_clip_threshold": float("nan")}}, "model.qk_clip_threshold must be a "),
    ({"model": {"qk_clip_threshold": 100.0, "qk_clip_alpha": 1.5}},
     r"model.qk_clip_alpha must be in \[0, 1\], got 1.5"),
    ({"model": {"qk_clip_threshold": 100.0, "qk_clip_alpha": -0.1}},
     r"model.qk_clip_alpha must be in \[0, 1\]"),
    ({"model": {"qk_clip_alpha": 0.3}}, "model.qk_clip_alpha is read only by QK-Clip"),
    ({"z_loss": -1e-4}, "z_loss must be a finite number >= 0"),
    ({"z_loss": float("nan")}, "z_loss must be a finite number >= 0"),
    ({"model": {"qk_clip_threshold": 100.0, "qk_norm": True}},
     "QK-Clip cannot act on a model with qk_norm"),
    ({"model": {"qk_clip_threshold": 100.0, "sigma_reparam": "qk"}},
     "QK-Clip rescales the stored W_Q and W_K, but under model.sigma_reparam 'qk'"),
    ({"model": {"qk_clip_threshold": 100.0}, "key_control": {"mode": "hold"}},
     "key_control reshapes W_K, which QK-Clip"),
    ({"model": {"qk_clip_threshold": 100.0}, "entropy_control": {"target": 2.0}},
     "entropy_control reshapes W_K, which QK-Clip"),
    ({"model": {"sigma_reparam": "all"}, "key_control": {"mode": "hold"}},
     "key_control reshapes W_K, which model.sigma_reparam 'all' reparametrises"),
    ({"model": {"sigma_reparam": "qk"}, "entropy_control": {"target": 2.0}},
     "entropy_control reshapes W_K, which model.sigma_reparam 'qk'"),
    ({"key_control": {"mode": "hold"}, "entropy_control": {"target": 2.0}}, "both reshape W_K"),
    ({"entropy_control": {"target": -1.0}}, "entropy_control.target must be finite"),
    ({"entropy_control": {"target": "high"}}, "'entropy_control.target' must be a number or null"),
    ({"model": {"logit_softcap": "50"}}, "'model.logit_softcap' must be a number or null"),
])
def test_configs_that_cannot_be_built_are_one_line_errors(over: dict, words: str) -> None:
    with pytest.raises(QKGeomError, match=words) as err:
        make_config("smoke", over)
    assert "\n" not in str(err.value)


def test_configs_that_can_be_built() -> None:
    # recording the key PR beside σReparam or QK-Clip is fine: nothing reshapes W_K
    make_config("smoke", {"model": {"sigma_reparam": "all"}, "key_control": {"record": True}})
    make_config("smoke", {"model": {"qk_clip_threshold": 100.0},
                          "key_control": {"record": True}})
    # the soft-cap and the z-loss fight nothing; QK-Clip reads the pre-cap logits
    cfg = make_config("smoke", {"model": {"logit_softcap": 30, "qk_clip_threshold": 100,
                                          "qk_clip_alpha": 0.0, "bias": True},
                                "z_loss": 1e-4})
    assert cfg.model.qk_clip and cfg.active_features() == ["qk_clip"]
    make_config("smoke", {"model": {"logit_softcap": 50.0, "qk_norm": True}, "z_loss": 1e-4,
                          "key_control": {"mode": "hold"}})


def test_export_refuses_what_gpt2_cannot_represent() -> None:
    pytest.importorskip("transformers")
    from qkgeom.arch.gpt import to_gpt2

    with pytest.raises(QKGeomError, match="qk_norm has no GPT-2 equivalent"):
        to_gpt2(build(qk_norm=True))
    with pytest.raises(QKGeomError, match=r"^a model with logit_softcap 50 has no GPT-2 "
                                          r"equivalent \(GPT-2's attention has no soft-cap"):
        to_gpt2(build(logit_softcap=50.0))


@pytest.mark.parametrize("over", [{"sigma_reparam": "qk"}, {"sigma_reparam": "all"},
                                  {"qk_clip_threshold": 1.0}])
def test_export_computes_what_the_model_uses(over: dict) -> None:
    """σReparam exports γ·W/σ̂ (the weight the model computes with), in both forms, and
    reading it does not run the power iteration of a model left in training mode; QK-Clip
    needs nothing."""
    pytest.importorskip("transformers")
    from qkgeom.arch.gpt import to_gpt2

    model = build(q_scale=10.0, **over)
    train_steps(model, 3, clip="qk_clip_threshold" in over)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hf = to_gpt2(model)
    assert model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(batch(7)).logits, model(batch(7))[0], rtol=1e-5,
                                   atol=1e-5)


def test_a_plain_model_trains_as_before() -> None:
    """The options off: SDPA, no buffer, no parametrisation (what every earlier run ran)."""
    model = build()
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert all(b.attn.logit_max is None and b.attn.softcap is None for b in model.blocks)
    assert not list(model.buffers())
    x = batch()
    with torch.no_grad():
        attn = model.blocks[0].attn
        h = torch.randn(2, CFG.block_size, CFG.n_embd)
        B, T, C = h.shape
        q, k, v = (lin(h).view(B, T, 4, 16).transpose(1, 2)
                   for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.equal(attn(h), attn.c_proj(y.transpose(1, 2).reshape(B, T, C)))
    assert model(x)[0].shape == (4, CFG.block_size, CFG.vocab_size)
