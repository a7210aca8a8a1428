"""Each architecture family's site is where the model really keeps W_Q, W_K and W_V, and its
capture hands over the q/k the model really attends with (tiny models built from configs,
nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from qkgeom.arch import adapter_for
from qkgeom.config import GPTConfig
from qkgeom.errors import QKGeomError
from qkgeom.model import GPT

transformers = pytest.importorskip("transformers")

from hf_models import ARCHS, V, build  # noqa: E402

T = 11


def _layer_inputs(adapter, ids: torch.Tensor) -> tuple[dict[int, torch.Tensor], object]:
    """The hidden states each attention module receives, and the model's output."""
    inputs: dict[int, torch.Tensor] = {}
    hooks = [site.attention.register_forward_pre_hook(
        lambda mod, args, kwargs, i=site.layer: inputs.__setitem__(
            i, (args[0] if args else kwargs["hidden_states"]).detach()), with_kwargs=True)
        for site in adapter.sites]
    try:
        with torch.no_grad():
            out = adapter.net(input_ids=ids, use_cache=adapter.causal) if adapter.causal \
                else adapter.net(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs, out


def _heads(x: torch.Tensor, site, which: str) -> torch.Tensor:
    """x @ Wᵀ + b through the site's weight and bias, as (B, heads, T, hd)."""
    y = x @ site.weight(which).T
    b = site.bias(which)
    y = y if b is None else y + b
    return y.view(x.shape[0], x.shape[1], -1, site.head_dim).transpose(1, 2)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "bert"])
def test_site_weights_give_the_keys_and_values_the_model_caches(arch: str) -> None:
    """The cache holds k (after rotary for NeoX/Llama, the identity at position 0; NeoX
    leaves the dims past rotary_ndims unrotated) and v, per key head."""
    adapter = adapter_for(build(arch))
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    inputs, out = _layer_inputs(adapter, ids)
    cache = out.past_key_values
    for site in adapter.sites:
        k, v = _heads(inputs[site.layer], site, "k"), _heads(inputs[site.layer], site, "v")
        assert k.shape[1] == site.n_kv_head
        cached = cache.layers[site.layer]
        torch.testing.assert_close(cached.values, v, rtol=1e-5, atol=1e-6)
        if not adapter.rotary:
            torch.testing.assert_close(cached.keys, k, rtol=1e-5, atol=1e-6)
            continue
        torch.testing.assert_close(cached.keys[:, :, 0], k[:, :, 0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(cached.keys[:, :, 1:], k[:, :, 1:])  # rotary really acts
        if arch == "gpt_neox":
            r = site.attention.rotary_ndims
            torch.testing.assert_close(cached.keys[..., r:], k[..., r:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_pre_rotary_capture_is_the_projection_of_the_layer_input(arch: str) -> None:
    """The q/k the pre-rotary capture hands over (the projection outputs split by the site's
    layout) equal x @ W_Qᵀ + b and x @ W_Kᵀ + b from the site's own weights."""
    adapter = adapter_for(build(arch))
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    inputs, _ = _layer_inputs(adapter, ids)
    seen: dict[int, tuple] = {}
    with torch.no_grad(), adapter.capture(lambda i, *t: seen.__setitem__(i, t), "pre-rotary"):
        adapter.forward(ids)
    assert set(seen) == {site.layer for site in adapter.sites}
    for site in adapter.sites:
        q_site, k_site = seen[site.layer][:2]
        x = inputs[site.layer]
        assert site.q_out is None  # these families have no q/k norm after the projection
        torch.testing.assert_close(q_site, _heads(x, site, "q"), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k_site, _heads(x, site, "k"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_qk_reproduce_the_models_attention(arch: str) -> None:
    """One head's attention probabilities rebuilt from the post-rotary capture equal the
    model's own ``output_attentions`` (eager attention)."""
    model = build(arch, attn="eager")
    adapter = adapter_for(model)
    assert adapter.arch == arch and adapter.n_layer == 2
    assert adapter.causal == (arch != "bert")
    got: dict[int, tuple] = {}
    ids = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), adapter.capture(
            lambda i, qs, ks, q, k, sc: got.__setitem__(i, (q, k, sc))):
        out = model(input_ids=ids, output_attentions=True)
    for layer in range(2):
        q, k, scale = got[layer]
        site = adapter.sites[layer]
        assert k.shape[1] == site.n_kv_head and q.shape[1] == site.n_head
        for h in (0, site.n_head - 1):
            s = q[:, h] @ k[:, h // site.group].mT * scale  # (B, T, T)
            if adapter.causal:
                s = s.masked_fill(torch.ones(19, 19, dtype=torch.bool).triu(1), float("-inf"))
            torch.testing.assert_close(s.softmax(-1), out.attentions[layer][:, h],
                                       rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["gpt_neox", "llama"])
def test_pre_rotary_equals_post_rotary_at_position_0_only(arch: str) -> None:
    adapter = adapter_for(build(arch))
    seen: dict[int, tuple] = {}
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), adapter.capture(lambda i, *t: seen.__setitem__(i, t), "pre-rotary"):
        adapter.forward(ids)
    q_pre, k_pre, q_post, k_post, _ = seen[0]
    torch.testing.assert_close(q_pre[:, :, 0], q_post[:, :, 0])  # rotary is the identity at 0
    torch.testing.assert_close(k_pre[:, :, 0], k_post[:, :, 0])
    assert not torch.allclose(q_pre[:, :, 1:], q_post[:, :, 1:])


def test_our_gpt_sites_are_its_projections_and_its_taps() -> None:
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=V),
                generator=torch.Generator().manual_seed(0))
    adapter = adapter_for(model)
    assert (adapter.arch, adapter.causal, adapter.rotary, adapter.max_positions) == \
        ("qkgeom", True, False, 16)
    site = adapter.sites[1]
    attn = model.blocks[1].attn
    assert torch.equal(site.weight("q"), attn.q_proj.weight)
    assert torch.equal(site.weight("v"), attn.v_proj.weight)
    assert site.key_stored() is attn.k_proj.weight
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    seen: dict[int, tuple] = {}
    with torch.no_grad(), adapter.capture(lambda i, *t: seen.__setitem__(i, t)):
        model(ids)
        x = model.blocks[1].ln_1(model.blocks[0](model.wte(ids) + model.wpe(torch.arange(16))))
    q_site, k_site, q_attn, k_attn, scale = seen[1]
    torch.testing.assert_close(k_site, _heads(x, site, "k"), rtol=1e-5, atol=1e-6)
    assert q_site is q_attn and k_site is k_attn and scale == pytest.approx(8 ** -0.5)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_fused_layouts_address_views_into_the_stored_weight(arch: str) -> None:
    """Writing through ``k_heads`` of the stored parameter changes W_K and nothing else."""
    site = adapter_for(build(arch)).sites[0]
    q0, v0 = site.weight("q").clone(), site.weight("v").clone()
    with torch.no_grad():
        site.k_heads(site.key_stored()).zero_()
    assert torch.count_nonzero(site.weight("k")) == 0
    assert torch.equal(site.weight("q"), q0) and torch.equal(site.weight("v"), v0)


def test_unknown_architecture_names_what_is_supported() -> None:
    with pytest.raises(QKGeomError, match="unsupported architecture Sequential.*GPT-2.*BERT"):
        adapter_for(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_capture_leaves_the_attention_registry_as_it_was() -> None:
    from transformers.modeling_utils import AttentionInterface

    before = dict(AttentionInterface._global_mapping)
    adapter = adapter_for(build("gpt2"))
    with pytest.raises(RuntimeError), adapter.capture(lambda *a: None):
        raise RuntimeError("boom")
    assert AttentionInterface._global_mapping == before
    with pytest.raises(QKGeomError, match="unknown qk site"):
        adapter.capture(lambda *a: None, "mid-rotary")
