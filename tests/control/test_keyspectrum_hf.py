"""Key-spectrum control on tiny Hugging Face models built from configs (nothing downloaded).

Where W_K lives in each model is :mod:`qkgeom.arch`'s (tests/arch checks it against what
the models compute); here: the control rewrites that W_K and nothing else, and holds or
reaches its targets through training.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkgeom.control import KeySpectrumControl, apply_target  # noqa: E402
from qkgeom.geometry.spectra import participation_ratio, weight_pr  # noqa: E402

V, T, STEPS = 50, 12, 20


def gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=V, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def neox() -> torch.nn.Module:
    cfg = transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=64, vocab_size=V,
                                     max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPTNeoXForCausalLM(cfg)


def llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, intermediate_size=64, vocab_size=V,
                                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                                  intermediate_size=64, vocab_size=V, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


BUILDERS = {"gpt2": gpt2, "gpt_neox": neox, "llama": llama, "bert": bert}


def build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return BUILDERS[arch]().float()


def qv_slices(site, arch: str) -> list[torch.Tensor]:
    """The W_Q and W_V parts of a fused stored weight, read by hand (not through the site)."""
    w = site.key_stored().detach().clone()
    d = site.n_kv_head * site.head_dim
    if arch == "gpt2":
        return [w[:, :d], w[:, 2 * d:]]
    if arch == "gpt_neox":
        w4 = w.view(site.n_kv_head, 3, site.head_dim, site.d_model)
        return [w4[:, 0], w4[:, 2]]
    return []


def train_steps(model: torch.nn.Module, ctl: KeySpectrumControl, arch: str,
                steps: int = STEPS) -> list[dict]:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    recs = []
    for s in range(1, steps + 1):
        x = torch.randint(0, V, (4, T), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        before = [qv_slices(site, arch) for site in ctl.sites]
        k_before = [site.weight("k").clone() for site in ctl.sites]
        recs.append(ctl.step(s))
        for site, qv, kb in zip(ctl.sites, before, k_before, strict=True):
            for a, b in zip(qv, qv_slices(site, arch), strict=True):
                assert torch.equal(a, b)  # W_Q, W_V untouched by step()
            assert not torch.equal(kb, site.weight("k"))  # ... while W_K was rewritten
    return recs


def level_pr(ctl: KeySpectrumControl, w: torch.Tensor, j: int) -> float:
    """PR_K of the key rows ``w`` at the control's level, from its definition: the weight's
    singular values, or the keys' covariance W Σ_ε Wᵀ on the control's input moments."""
    w = w.double()
    if ctl.level == "weight":
        return float(weight_pr(w))
    sig = ctl.moments.covariance(j)
    sig = sig + 1e-3 * torch.trace(sig) / sig.shape[0] * torch.eye(sig.shape[0], dtype=sig.dtype)
    return float(participation_ratio(torch.linalg.eigvalsh(w @ sig @ w.mT).clamp_min(0)))


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "bert"])
@pytest.mark.parametrize("scope", ["layer", "head"])
@pytest.mark.parametrize("level", ["token", "weight"])
def test_hold_keeps_the_key_pr_on_target_through_training(arch: str, scope: str,
                                                          level: str) -> None:
    model = build(arch)
    ctl = KeySpectrumControl.attach(model, "hold", level=level, scope=scope)
    train_steps(model, ctl, arch)
    pr0 = ctl.pr0.clone()  # token level: W at step 0 on the first batch's Σ
    assert bool(torch.isfinite(pr0).all())
    now = ctl.current_pr()
    assert (((now - pr0).abs() / pr0) < 1e-3).all()
    # independently: PR of the key slice read straight from the weight
    site = ctl.sites[1]
    w = site.weight("k")
    if scope == "layer":
        assert level_pr(ctl, w, 1) == pytest.approx(float(pr0[1]), rel=1e-3)
    else:
        head0 = w[:site.head_dim]
        assert level_pr(ctl, head0, 1) == pytest.approx(float(pr0[site.n_kv_head]), rel=1e-3)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama", "bert"])
def test_the_data_rule_sees_each_familys_key_inputs_and_keeps_their_key_scale(
        arch: str) -> None:
    """The input hook sits on the module holding W_K (fused c_attn / query_key_value too):
    Σ is the centred covariance of every token that module receives, and each step keeps
    the key spread tr(W_K Σ W_Kᵀ) of every layer (GQA: the key heads' rows)."""
    model = build(arch)
    ctl = KeySpectrumControl.attach(model, "hold", scope="head")
    seen: dict[int, torch.Tensor] = {}
    for j, site in enumerate(ctl.sites):  # our own copy of what the key module receives
        site.k_module.register_forward_pre_hook(
            lambda m, args, j=j: seen.__setitem__(j, args[0].detach().reshape(
                -1, args[0].shape[-1]).double()))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(5))
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    before = [site.weight("k").double() for site in ctl.sites]
    ctl.step(1)
    for j, site in enumerate(ctl.sites):
        s = ctl.moments.covariance(j)
        xs = seen[j] - seen[j].mean(dim=0)  # 48 tokens: Σ is their covariance (ddof 0)
        torch.testing.assert_close(s, xs.mT @ xs / xs.shape[0], rtol=1e-5, atol=1e-6)
        after = site.weight("k").double()
        kept = ((after @ s) * after).sum() / ((before[j] @ s) * before[j]).sum()
        assert abs(float(kept) - 1) < 1e-6


@pytest.mark.parametrize("level", ["token", "weight"])
def test_parametrize_on_a_fused_gpt2_weight_changes_only_the_key(level: str) -> None:
    model = build("gpt2")
    ctl = KeySpectrumControl.attach(model, "shrink", level=level, ramp_steps=STEPS,
                                    how="parametrize")
    recs = train_steps(model, ctl, "gpt2", steps=5)
    for site in ctl.sites:
        eff, raw = site.key_effective().detach(), site.key_stored().detach()
        d = site.n_kv_head * site.head_dim
        assert torch.equal(eff[:, :d], raw[:, :d]) and torch.equal(eff[:, 2 * d:], raw[:, 2 * d:])
    for i in range(2):
        assert recs[-1][f"ctl_pr_l{i}"] == pytest.approx(recs[-1][f"ctl_target_l{i}"], rel=1e-3)
        assert recs[-1][f"ctl_target_l{i}"] == pytest.approx(float(ctl.pr0[i]) * (1 - 0.5 * 5 / STEPS),
                                                             rel=1e-9)


def test_a_tall_key_projection_is_reshaped_like_apply_target() -> None:
    """Llama with an explicit head_dim: W_K is (64, 32), taller than wide (the Wᵀ·W route)."""
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                                   head_dim=16, num_hidden_layers=1, intermediate_size=64,
                                   vocab_size=V, max_position_embeddings=64, bos_token_id=0,
                                   eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    w0 = model.model.layers[0].self_attn.k_proj.weight.detach().clone()
    assert w0.shape == (64, 32)
    ctl = KeySpectrumControl.attach(model, "shrink", level="weight", scale="frobenius", dose=0.7,
                                    ramp_steps=2)
    assert ctl.sites[0].n_kv_head == 4 and ctl.sites[0].head_dim == 16
    ctl.step(2)
    want, _ = apply_target(w0, 0.7 * float(ctl.pr0[0]))
    torch.testing.assert_close(model.model.layers[0].self_attn.k_proj.weight.detach(), want,
                               rtol=1e-5, atol=1e-7)
    assert float(weight_pr(want)) == pytest.approx(0.7 * float(ctl.pr0[0]), rel=1e-5)
