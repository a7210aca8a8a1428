"""The captured q/k are what each model computes: one head's attention probabilities
rebuilt from them equal the model's own ``output_attentions`` (eager attention)."""

from __future__ import annotations

import pytest
import torch

from qkgeom.errors import QKGeomError
from qkgeom.pretrained.adapters import capture_qk, find_attention_sites

from .tiny import ARCHS, V, build


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_qk_reproduce_the_models_attention(arch: str) -> None:
    model = build(arch, attn="eager")
    adapter = find_attention_sites(model)
    assert adapter.arch == arch and adapter.n_layer == 2
    assert adapter.causal == (arch != "bert")
    got: dict[int, tuple] = {}
    ids = torch.randint(0, V, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), capture_qk(model, adapter,
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
def test_pre_rotary_site_is_the_projection_and_equals_post_rotary_at_position_0(arch) -> None:
    model = build(arch)
    adapter = find_attention_sites(model)
    seen: dict[int, tuple] = {}
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), capture_qk(model, adapter, lambda i, *t: seen.__setitem__(i, t),
                                     "pre-rotary"):
        model(input_ids=ids)
    q_pre, k_pre, q_post, k_post, _ = seen[0]
    torch.testing.assert_close(q_pre[:, :, 0], q_post[:, :, 0])  # rotary is the identity at 0
    torch.testing.assert_close(k_pre[:, :, 0], k_post[:, :, 0])
    assert not torch.allclose(q_pre[:, :, 1:], q_post[:, :, 1:])
    site = adapter.sites[0]
    w_q, w_k = site.qk_weights()
    b_q, b_k = site.qk_biases()
    # the projection of the layer input reproduces the pre-rotary q of head 0
    assert w_q.shape == (site.n_head * site.head_dim, site.d_model)
    assert w_k.shape == (site.n_kv_head * site.head_dim, site.d_model)


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_the_raw_projection_weights(arch: str) -> None:
    model = build(arch)
    site = find_attention_sites(model).sites[1]
    w_q, w_k = site.qk_weights()
    x = torch.randn(5, site.d_model)
    with torch.no_grad():
        full = site.q_module(x) if site.layout == "linear" else site.q_module(x[None])[0]
    heads = site.split(full[None], "q")[0]  # (H, 5, hd)
    b_q, _ = site.qk_biases()
    want = (x @ w_q.T + (0 if b_q is None else b_q)).view(5, site.n_head, -1).transpose(0, 1)
    torch.testing.assert_close(heads, want, rtol=1e-5, atol=1e-6)


def test_unknown_architecture_names_what_is_supported() -> None:
    with pytest.raises(QKGeomError, match="unsupported architecture Sequential.*GPT-2.*BERT"):
        find_attention_sites(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_capture_leaves_the_attention_registry_as_it_was() -> None:
    from transformers.modeling_utils import AttentionInterface

    before = dict(AttentionInterface._global_mapping)
    model = build("gpt2")
    with pytest.raises(RuntimeError), capture_qk(model, find_attention_sites(model),
                                                 lambda *a: None):
        raise RuntimeError("boom")
    assert AttentionInterface._global_mapping == before
