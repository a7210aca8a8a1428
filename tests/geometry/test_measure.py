"""``measure``, the one measurement path: known spectra of our GPT at init, train mode and
RNG restored, determinism, HF models (key spectra, GQA), metric names."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from qkgeom import GPT, GPTConfig, measure
from qkgeom.errors import QKGeomError
from qkgeom.geometry import METRIC_NAMES, measure_batches, resolve_metrics


def probe(model, ids, **kw):
    return measure(model, ids, **kw).frame

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


def test_float32_products_agree_with_float64_to_float32_round_off() -> None:
    exact = probe(model("normal"), tokens(), precision="float64")
    fast = probe(model("normal"), tokens(), precision="float32")
    torch.testing.assert_close(torch.tensor(fast["value"].values),
                               torch.tensor(exact["value"].values), rtol=1e-4, atol=1e-6)
    assert not fast["value"].equals(exact["value"])  # it really ran another path
    with pytest.raises(QKGeomError, match="precision"):
        probe(model("normal"), tokens(), precision="float16")


def test_metric_subsets_and_names() -> None:
    f = probe(model("normal"), tokens(), metrics=["contrast", "pr_qk_weight"])
    assert set(f["metric"]) == {"contrast_token", "pr_qk_weight"}
    assert resolve_metrics(["pr_q_token", "contrast", "contrast_token"]) == (
        "pr_q_token", "contrast_token")
    assert resolve_metrics("all") == METRIC_NAMES
    with pytest.raises(QKGeomError, match="unknown metric 'pr_v'"):
        resolve_metrics(["pr_v"])
    with pytest.raises(QKGeomError, match="integer"):
        measure(model("normal"), torch.rand(2, 3))


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


def test_key_spectra_of_gpt2_match_its_weights_and_cached_keys() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    got = measure(model, ids, metrics=["pr_k_token"], spectra=True)
    d = model.config.n_embd
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    for layer, block in enumerate(model.transformer.h):
        w_k = block.attn.c_attn.weight[:, d:2 * d].double()  # (d, d_k), y = x @ W
        assert torch.allclose(got.key_sv_weight[layer], torch.linalg.svdvals(w_k), rtol=1e-6)
        keys = cache.layers[layer].keys  # (B, H, T, hd), GPT-2: no rotary
        k = keys.permute(0, 2, 1, 3).reshape(-1, d).double()  # (B·T, d_k)
        want = torch.linalg.eigvalsh(torch.cov(k.T)).flip(0)
        assert torch.allclose(got.key_eig_token[layer], want, rtol=1e-4, atol=1e-9)
    assert set(got.frame["metric"]) == {"pr_k_token"}
    assert got.tokens == 64 and got.sequences == 4 and got.adapter.arch == "gpt2"


def test_grouped_query_attention_pairs_query_heads_with_their_key_head() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=1, intermediate_size=64, vocab_size=50,
                                   max_position_embeddings=16, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(0))
    frame = measure(model, ids, metrics=["pr_k_token", "pr_k_weight"]).frame
    pr_k = frame[(frame["head"] >= 0) & (frame["metric"] == "pr_k_token")].set_index("head")
    pr_k = pr_k["value"]
    assert pr_k[0] == pr_k[1] and pr_k[2] == pr_k[3] and pr_k[0] != pr_k[2]
    w = frame[(frame["head"] >= 0) & (frame["metric"] == "pr_k_weight")].set_index("head")
    assert w["value"][0] == w["value"][1] and w["value"][2] == w["value"][3]


def test_blocked_measurement_holds_the_unblocked_one_and_each_block_alone() -> None:
    """block −1 equals the unblocked measurement bit for bit; block k equals measuring the
    windows of block k alone (the engine keeps two sets of totals, never reruns)."""
    m, ids = model("normal"), tokens()  # 6 windows
    plan = [(0, ids[:2]), (0, ids[2:3]), (1, ids[3:5]), (2, ids[5:])]
    got = measure_batches(m, plan, blocked=True, run_id="x")
    f = got.frame
    assert list(f.columns) == ["run_id", "layer", "head", "metric", "value", "block"]
    assert sorted(f["block"].unique()) == [-1, 0, 1, 2]
    assert got.block_tokens == {0: 3 * CFG.block_size, 1: 2 * CFG.block_size,
                                2: CFG.block_size}
    plain = measure_batches(m, [b for _, b in plan], run_id="x").frame
    pd.testing.assert_frame_equal(f[f["block"] == -1].drop(columns="block"), plain,
                                  check_exact=True)
    for block in (0, 1, 2):
        alone = measure_batches(m, [b for k, b in plan if k == block], run_id="x").frame
        pd.testing.assert_frame_equal(
            f[f["block"] == block].drop(columns="block").reset_index(drop=True), alone,
            check_exact=True)
    layer = plain[(plain["head"] == -1) & (plain["metric"] == "attn_entropy")]
    assert got.layer_values("attn_entropy") == dict(zip(layer["layer"], layer["value"], strict=True))
    with pytest.raises(QKGeomError, match="contiguous"):
        measure_batches(m, [(1, ids[:2]), (0, ids[2:])], blocked=True)
    with pytest.raises(QKGeomError, match="pair"):
        measure_batches(m, [ids[:2]], blocked=True)


def test_pre_rotary_site_records_the_post_rotary_prs_of_a_llama() -> None:
    pytest.importorskip("transformers")
    from hf_models import V, build

    llama = build("llama")  # 2 layers, 4 query heads, 2 key heads (GQA), rotary
    ids = torch.randint(0, V, (3, 32), generator=torch.Generator().manual_seed(0))
    pre = measure(llama, ids, qk_site="pre-rotary").frame.set_index(["layer", "head", "metric"])
    post = measure(llama, ids).frame.set_index(["layer", "head", "metric"])
    assert not [m for m in post.index.get_level_values("metric") if m.endswith("_post")]
    for name in ("pr_q_token", "pr_k_token", "contrast_token"):
        sel = post.xs(name, level="metric")["value"]
        got = pre.xs(name + "_post", level="metric")["value"].loc[sel.index]
        np.testing.assert_allclose(got.to_numpy(), sel.to_numpy(), rtol=1e-12, atol=1e-12)
        assert not np.allclose(pre.xs(name, level="metric")["value"].loc[sel.index], sel)
    for name in ("pr_qk_token", "logit_std", "attn_entropy", "pr_qk_weight"):  # not the site's
        a, b = pre.xs(name, level="metric")["value"], post.xs(name, level="metric")["value"]
        np.testing.assert_allclose(a.loc[b.index].to_numpy(), b.to_numpy(), rtol=1e-12)
