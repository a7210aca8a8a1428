"""The per-head largest query and key norms, the logit bound they give, the layer's lowest
head entropy, the soft cap seen through ``measure``, and the new rows in a trained run's
``metrics.parquet``."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from qkgeom import GPT, GPTConfig, make_config, measure, train
from qkgeom.geometry import LAYER, LayerGeometry
from qkgeom.metrics import LAYER_ONLY_METRICS

NEW = ("sink_mass", "q_norm_max", "k_norm_max", "logit_bound", "logit_max", "entropy_min")


def records(geo: LayerGeometry) -> dict[tuple[int, str], float]:
    return {(h, m): v for h, m, v in geo.records()}


def all_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, T, T) scaled logits of every (query, key) pair, visible or not."""
    R = q.shape[1] // k.shape[1]
    return (q.double() @ k.double().repeat_interleave(R, dim=1).mT) * scale


def test_norm_maxima_of_known_vectors_under_gqa() -> None:
    """H = 4 query heads on H_kv = 2 key heads: the row of query head h holds key head
    h // 2's largest norm; the layer rows are the largest over heads."""
    B, H, Hk, T, hd = 2, 4, 2, 5, 2
    q = torch.zeros(B, H, T, hd, dtype=torch.float64)
    k = torch.zeros(B, Hk, T, hd, dtype=torch.float64)
    for h, (b, t, vec) in enumerate([(0, 3, (3.0, 4.0)), (1, 0, (0.0, -2.0)),
                                     (1, 4, (1.0, 1.0)), (0, 1, (-6.0, 8.0))]):
        q[b, h, t] = torch.tensor(vec)  # norms 5, 2, √2, 10
    k[1, 0, 2] = torch.tensor([0.0, 7.0])
    k[0, 0, 4] = torch.tensor([1.0, 1.0])  # smaller than 7: not the max
    k[0, 1, 0] = torch.tensor([0.6, 0.8])  # norm 1
    geo = LayerGeometry(H, Hk, hd)
    geo.update(q[:1], k[:1], scale=0.5)  # two batches: running maxima
    geo.update(q[1:], k[1:], scale=0.5)
    rec = records(geo)
    assert [rec[(h, "q_norm_max")] for h in range(H)] == pytest.approx([5, 2, math.sqrt(2), 10])
    assert [rec[(h, "k_norm_max")] for h in range(H)] == pytest.approx([7, 7, 1, 1])
    assert [rec[(h, "logit_bound")] for h in range(H)] == pytest.approx(
        [5 * 7 * 0.5, 2 * 7 * 0.5, math.sqrt(2) * 0.5, 10 * 0.5])
    assert rec[(LAYER, "q_norm_max")] == pytest.approx(10)
    assert rec[(LAYER, "k_norm_max")] == pytest.approx(7)
    assert rec[(LAYER, "logit_bound")] == pytest.approx(17.5)  # the largest head's, not 10·7·½


@pytest.mark.parametrize("causal", [True, False])
def test_logit_bound_bounds_every_logit_and_is_reached_by_parallel_vectors(causal) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, Hk, T, hd, scale = 3, 4, 2, 11, 8, 0.3
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, T, hd, generator=g, dtype=torch.float64) * 2
    geo = LayerGeometry(H, Hk, hd, causal=causal)
    geo.update(q, k, scale=scale)
    rec = records(geo)
    peak = all_logits(q, k, scale).abs().amax(dim=(0, 2, 3))  # (H,) every pair, |s|
    for h in range(H):
        assert rec[(h, "logit_bound")] >= float(peak[h])
        assert rec[(h, "logit_bound")] >= abs(rec[(h, "logit_max")])
    # one query and one key along u, each the longest of its head: the bound is reached
    u = torch.nn.functional.normalize(torch.randn(hd, generator=g, dtype=torch.float64), dim=0)
    q[1, 2, 7], k[1, 1, 3] = 40 * u, 30 * u  # query head 2 reads key head 1; key 3 <= query 7
    geo = LayerGeometry(H, Hk, hd, causal=causal)
    geo.update(q, k, scale=scale)
    rec = records(geo)
    assert rec[(2, "logit_bound")] == pytest.approx(40 * 30 * scale, rel=1e-12)
    assert rec[(2, "logit_max")] == pytest.approx(rec[(2, "logit_bound")], rel=1e-12)


def test_norms_leave_out_padding() -> None:
    """A right-padded batch: the huge vectors at the padded positions do not count."""
    q = torch.ones(2, 1, 6, 2, dtype=torch.float64)
    k = torch.ones(2, 1, 6, 2, dtype=torch.float64)
    q[0, :, 4:] = k[0, :, 4:] = 1e6  # padding of the first sequence (4 real tokens)
    geo = LayerGeometry(1, 1, 2)
    geo.update(q, k, lengths=[4, 6])
    rec = records(geo)
    assert rec[(0, "q_norm_max")] == pytest.approx(math.sqrt(2))
    assert rec[(0, "k_norm_max")] == pytest.approx(math.sqrt(2))


def test_entropy_min_is_the_lowest_head_entropy_and_has_a_layer_row_only() -> None:
    g = torch.Generator().manual_seed(1)
    H = 3
    q = torch.randn(2, H, 9, 4, generator=g, dtype=torch.float64) * torch.tensor(
        [0.1, 5.0, 1.0], dtype=torch.float64).view(1, H, 1, 1)  # head 1: the most peaked
    k = torch.randn(2, H, 9, 4, generator=g, dtype=torch.float64)
    geo = LayerGeometry(H, H, 4)
    geo.update(q, k)
    rec = records(geo)
    heads = [rec[(h, "attn_entropy")] for h in range(H)]
    assert rec[(LAYER, "entropy_min")] == min(heads) == heads[1]
    assert rec[(LAYER, "entropy_min")] < rec[(LAYER, "attn_entropy")]
    assert not any((h, "entropy_min") in rec for h in range(H))
    assert "entropy_min" in LAYER_ONLY_METRICS


CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=40)


def test_measure_reads_the_adapters_soft_cap(monkeypatch) -> None:
    """A cap of 1e-3 flattens every row (normalised entropy 1 to ~1e-3, logits within the
    cap); the bound, the logit spectrum and the norms stay on the uncapped q·k."""
    import importlib

    measure_module = importlib.import_module("qkgeom.geometry.measure")  # not the function
    model = GPT(CFG, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for site in measure_module.adapter_for(model).sites:
            site.q_module.weight.mul_(100.0)  # logits of several units: peaked rows
    ids = torch.randint(0, CFG.vocab_size, (4, CFG.block_size),
                        generator=torch.Generator().manual_seed(1))
    plain = measure(model, ids).frame.set_index(["layer", "head", "metric"])["value"]
    found = measure_module.adapter_for
    monkeypatch.setattr(measure_module, "adapter_for", lambda m: dataclasses.replace(
        found(m), logit_softcap=1e-3))
    capped = measure(model, ids).frame.set_index(["layer", "head", "metric"])["value"]
    metric = capped.index.get_level_values("metric")
    assert (capped[metric == "attn_entropy_norm"] > 1 - 1e-3).all()
    assert (capped[metric == "logit_max"].abs() <= 1e-3 * (1 + 1e-9)).all()  # round-off
    assert (plain[metric == "logit_max"] > 1).all()  # without the cap: far above it
    assert (plain[metric == "attn_entropy_norm"] < 0.99).all()
    for name in ("logit_bound", "q_norm_max", "k_norm_max", "pr_qk_token", "pr_q_token"):
        pd.testing.assert_series_equal(capped[metric == name], plain[metric == name])


def test_a_trained_runs_metrics_have_the_new_head_and_layer_rows(sample_data: Path,
                                                                  tmp_path: Path) -> None:
    cfg = make_config("smoke", {"data": str(sample_data), "steps": 6, "probe_every": 3,
                                "eval_every": 6, "checkpoint_every": 6, "log_every": 3,
                                "threads": 1})
    train(cfg, tmp_path / "run")
    m = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    H, L = cfg.model.n_head, cfg.model.n_layer
    for step in (0, 3, 6):
        at = m[m["step"] == step]
        for name in NEW:
            rows = at[at["metric"] == name]
            heads = [LAYER] if name == "entropy_min" else [*range(H), LAYER]
            assert sorted(zip(rows["layer"], rows["head"], strict=True)) == sorted(
                (layer, h) for layer in range(L) for h in heads), (step, name)
        for layer in range(L):
            ent = at[(at["layer"] == layer) & (at["metric"] == "attn_entropy")]
            low = at[(at["layer"] == layer) & (at["metric"] == "entropy_min")]
            assert float(low["value"].iloc[0]) == ent[ent["head"] >= 0]["value"].min()
