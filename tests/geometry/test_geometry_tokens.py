"""LayerGeometry, the one accumulator of token metrics: hand-known covariance PRs, the
Gram-trace logit PR against an SVD, attention against the entropy accumulator, GQA pairing,
and the long layer frame."""

from __future__ import annotations

import math

import pytest
import torch

from qkgeom.geometry import (
    LAYER,
    LAYER_ONLY_METRICS,
    METRIC_NAMES,
    POST_ROTARY_METRICS,
    TOKEN_METRICS,
    LayerGeometry,
    StreamingCovariance,
    StreamingEntropy,
    head_blocks,
    logit_pr,
    logit_singular_values,
    participation_ratio,
    records_to_frame,
    weight_records,
)


def _as_dict(records):
    out = {}
    for head, metric, value in records:
        assert (head, metric) not in out, f"duplicate record {(head, metric)}"
        out[(head, metric)] = value
    return out


def test_logit_pr_equals_the_svd_route_with_gqa() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 20, 8, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, 8)
    k = torch.randn(3, 2, 20, 8, generator=g, dtype=torch.float64)
    want = participation_ratio(logit_singular_values(q, k.repeat_interleave(2, dim=1)) ** 2)
    torch.testing.assert_close(logit_pr(q, k), want, rtol=1e-10, atol=1e-12)


def test_gqa_layer_pr_is_unchanged_by_repeating_the_keys() -> None:
    g = torch.Generator().manual_seed(3)
    k = torch.randn(500, 2, 8, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2, 8)
    distinct, repeated = StreamingCovariance(1, 16), StreamingCovariance(1, 32)
    distinct.update(k.reshape(1, 500, 16))
    repeated.update(k.repeat_interleave(2, dim=1).reshape(1, 500, 32))
    assert float(distinct.pr()[0]) == pytest.approx(float(repeated.pr()[0]), rel=1e-10)


def test_head_blocks_are_the_per_head_covariances() -> None:
    x = torch.randn(200, 3, 4, dtype=torch.float64)
    full = torch.cov(x.reshape(200, 12).T)
    per = torch.stack([torch.cov(x[:, h].T) for h in range(3)])
    torch.testing.assert_close(head_blocks(full, 3), per)


def _designed_qk(n_head: int = 3, hd: int = 2, B: int = 2, T: int = 12):
    """q: every head carries the same x in {±2e1, ±e2}; k: ±√d e_i over all d_out coords.

    Both designs are exactly zero-mean with known covariances:
    q per head ∝ diag(4, 1) -> PR = 25/17, and identical heads -> layer PR = 25/17 too;
    k ∝ I_{d_out} -> PR = hd per head and n_head·hd for the layer.
    """
    d_out = n_head * hd
    n = B * T
    x_cycle = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 1.0], [0.0, -1.0]])  # (4, hd)
    x = x_cycle.repeat(n // 4, 1)  # (N, hd)
    q = x.reshape(B, T, 1, hd).expand(B, T, n_head, hd).permute(0, 2, 1, 3)  # (B, H, T, hd)
    eye = torch.eye(d_out) * math.sqrt(d_out)  # (d_out, d_out)
    k_rows = torch.cat([eye, -eye]).repeat(n // (2 * d_out), 1)  # (N, d_out)
    k = k_rows.reshape(B, T, n_head, hd).permute(0, 2, 1, 3)  # (B, H, T, hd)
    return q.contiguous(), k.contiguous()


def test_hand_known_covariance_prs() -> None:
    n_head, hd = 3, 2
    q, k = _designed_qk(n_head, hd)
    tg = LayerGeometry(n_head, n_head, hd)
    tg.update(q[:1].double(), k[:1].double())  # two updates: streaming must not matter
    tg.update(q[1:].double(), k[1:].double())
    rec = _as_dict(tg.records())
    assert set(rec) == {(h, m) for h in [*range(n_head), LAYER] for m in TOKEN_METRICS
                        if m not in POST_ROTARY_METRICS and m != "logit_delta"  # no previous
                        and (h == LAYER or m not in LAYER_ONLY_METRICS)}
    for h in range(n_head):
        assert rec[(h, "pr_q_token")] == pytest.approx(25 / 17, rel=1e-12)
        assert rec[(h, "pr_k_token")] == pytest.approx(hd, rel=1e-12)
    assert rec[(LAYER, "pr_q_token")] == pytest.approx(25 / 17, rel=1e-12)  # identical heads
    assert rec[(LAYER, "pr_k_token")] == pytest.approx(n_head * hd, rel=1e-12)  # isotropic
    for h in [*range(n_head), LAYER]:
        assert rec[(h, "contrast_token")] == rec[(h, "pr_q_token")] - rec[(h, "pr_k_token")]


@pytest.mark.parametrize("dtype, rel", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_qk_and_attention_match_direct_computation(dtype: torch.dtype, rel: float) -> None:
    """float64 input: float64 products (exact); float32: float32 products, float64 totals."""
    n_head, hd, B, T = 2, 3, 3, 7
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, n_head, T, hd, generator=g, dtype=torch.float64)  # (B, H, T, hd)
    k = torch.randn(B, n_head, T, hd, generator=g, dtype=torch.float64)  # (B, H, T, hd)
    tg = LayerGeometry(n_head, n_head, hd, causal=True)
    tg.update(q.to(dtype), k.to(dtype))
    rec = _as_dict(tg.records())
    logits = q @ k.mT / math.sqrt(hd)  # (B, H, T, T)
    pr_seq = participation_ratio(torch.linalg.svdvals(logits) ** 2)  # (B, H)
    for h in range(n_head):
        assert rec[(h, "pr_qk_token")] == pytest.approx(float(pr_seq[:, h].mean()), rel=rel)
    assert rec[(LAYER, "pr_qk_token")] == pytest.approx(float(pr_seq.mean()), rel=rel)
    cov_q = torch.cov(q.permute(0, 2, 1, 3).reshape(B * T, n_head * hd).T)
    assert rec[(LAYER, "pr_q_token")] == pytest.approx(
        float(participation_ratio(torch.linalg.eigvalsh(cov_q).clamp_min(0))), rel=rel)
    attn = StreamingEntropy(n_head, causal=True)
    attn.update(q, k)
    ref = attn.result()
    for name in ("attn_entropy", "attn_entropy_norm", "attn_max", "attn_entropy_scalefree",
                 "logit_std_row"):
        for h in range(n_head):
            assert rec[(h, name)] == pytest.approx(float(ref[name][h]), rel=rel)
        assert rec[(LAYER, name)] == pytest.approx(float(ref[name].mean()), rel=rel)


def test_rejects_bad_input() -> None:
    tg = LayerGeometry(2, 2, 3)
    with pytest.raises(ValueError, match="update"):
        tg.records()
    with pytest.raises(ValueError):
        tg.update(torch.zeros(1, 3, 4, 3), torch.zeros(1, 3, 4, 3))  # 3 heads, not 2


def test_end_to_end_layer_frame() -> None:
    n_head, hd, d_model = 2, 4, 8
    g = torch.Generator().manual_seed(4)
    w_q = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    w_k = torch.randn(n_head * hd, d_model, generator=g)  # (d_out, d_model)
    x = torch.randn(2, 5, d_model, generator=g)  # (B, T, d_model)
    q = (x @ w_q.T).reshape(2, 5, n_head, hd).transpose(1, 2)  # (B, H, T, hd)
    k = (x @ w_k.T).reshape(2, 5, n_head, hd).transpose(1, 2)  # (B, H, T, hd)
    tg = LayerGeometry(n_head, n_head, hd)
    tg.update(q, k)
    frame = records_to_frame({0: weight_records(w_q, w_k, n_head) + tg.records()}, run_id="x")
    # one site: no _post; one measurement: no logit_delta (nothing to compare with)
    per_layer = [m for m in METRIC_NAMES if m not in (*POST_ROTARY_METRICS, "logit_delta")]
    assert len(frame) == (n_head + 1) * len(per_layer) - n_head * len(LAYER_ONLY_METRICS)
    assert set(frame["metric"]) == set(per_layer)
    assert frame["value"].notna().all()
    # the values are where they belong: hand-computed ones at their (head, metric)
    got = frame.set_index(["head", "metric"])["value"]

    def pr(eig: torch.Tensor) -> float:
        return float(eig.sum() ** 2 / (eig ** 2).sum())

    assert got[(LAYER, "pr_q_weight")] == pytest.approx(pr(torch.linalg.svdvals(w_q.double()) ** 2))
    for h in range(n_head):
        k_h = k[:, h].reshape(-1, hd).double()  # the head's key tokens (B·T, hd)
        assert got[(h, "pr_k_token")] == pytest.approx(pr(torch.linalg.eigvalsh(torch.cov(k_h.T))))
        w_qh, w_kh = w_q[h * hd:(h + 1) * hd].double(), w_k[h * hd:(h + 1) * hd].double()
        assert got[(h, "pr_qk_weight")] == pytest.approx(
            pr(torch.linalg.svdvals(w_qh.T @ w_kh) ** 2), rel=1e-9)
    ent = StreamingEntropy(n_head, causal=True)
    ent.update(q.double(), k.double())
    assert got[(LAYER, "attn_entropy")] == pytest.approx(float(ent.result()["attn_entropy"].mean()))


def test_gqa_pairs_each_query_head_with_the_key_head_it_attends_with() -> None:
    g = torch.Generator().manual_seed(6)
    B, H, Hk, T, hd = 2, 4, 2, 9, 3
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, T, hd, generator=g, dtype=torch.float64) * torch.tensor(
        [[[[1.0]]], [[[3.0]]]]).view(1, Hk, 1, 1) * torch.linspace(0.2, 2, hd)
    tg = LayerGeometry(H, Hk, hd)
    tg.update(q, k)
    rec = _as_dict(tg.records())
    per_key = [float(participation_ratio(torch.linalg.eigvalsh(torch.cov(
        k[:, j].reshape(B * T, hd).T)).clamp_min(0))) for j in range(Hk)]
    for h in range(H):
        assert rec[(h, "pr_k_token")] == pytest.approx(per_key[h // 2], rel=1e-10)
    repeated = LayerGeometry(H, H, hd)
    repeated.update(q, k.repeat_interleave(2, dim=1))
    same = _as_dict(repeated.records())
    for key, value in rec.items():  # repeating the keys as the attention does changes nothing
        assert same[key] == pytest.approx(value, rel=1e-10), key


# --- logit_std, the GQA-fair layer contrast, post-rotary PRs, token blocks ----------------


def test_logit_std_per_head_and_pooled_layer_equal_the_masked_score_matrix() -> None:
    g = torch.Generator().manual_seed(7)
    B, H, Hk, T, hd = 3, 4, 2, 13, 5
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) * torch.tensor(
        [0.5, 1.0, 2.0, 4.0], dtype=torch.float64).view(1, H, 1, 1)  # heads of unlike spread
    k = torch.randn(B, Hk, T, hd, generator=g, dtype=torch.float64) + 0.5
    tg = LayerGeometry(H, Hk, hd)
    tg.update(q[:2], k[:2], scale=0.3)
    tg.update(q[2:], k[2:], scale=0.3)
    rec = _as_dict(tg.records())
    s = q @ k.repeat_interleave(H // Hk, dim=1).mT * 0.3  # (B, H, T, T)
    seen = s[:, :, torch.ones(T, T, dtype=torch.bool).tril()]  # (B, H, T(T+1)/2) causal pairs
    for h in range(H):
        want = float(seen[:, h].std(correction=0))
        assert rec[(h, "logit_std")] == pytest.approx(want, rel=1e-12)
    assert rec[(LAYER, "logit_std")] == pytest.approx(float(seen.std(correction=0)), rel=1e-12)
    assert rec[(LAYER, "logit_std")] > max(rec[(h, "logit_std")] for h in range(H)) / 4


def test_contrast_token_heads_is_fair_under_gqa() -> None:
    """Isotropic q and k: every head's PR_Q^h = PR_K^g = hd, so the paired contrast is 0;
    the concatenated layer contrast compares H·hd with H_kv·hd dimensions and is not."""
    g = torch.Generator().manual_seed(8)
    B, H, Hk, T, hd = 8, 4, 1, 64, 4
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hk, T, hd, generator=g, dtype=torch.float64)
    tg = LayerGeometry(H, Hk, hd)
    tg.update(q, k)
    rec = _as_dict(tg.records())
    per_head = [rec[(h, "contrast_token")] for h in range(H)]
    assert rec[(LAYER, "contrast_token_heads")] == pytest.approx(sum(per_head) / H, rel=1e-12)
    assert abs(rec[(LAYER, "contrast_token_heads")]) < 0.3  # ≈ 0: hd − hd up to sampling
    assert rec[(LAYER, "contrast_token")] > (H - Hk) * hd - 1.5  # ≈ 16 − 4: the GQA bias
    assert (0, "contrast_token_heads") not in rec  # a layer-row metric


def _rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (HF's rotate-half layout) of x (B, H, T, hd) at positions 0..T-1."""
    T, hd = x.shape[-2], x.shape[-1]
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (hd/2,)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv  # (T, hd/2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, hd)
    half = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + half * sin


def test_rotary_inflates_token_pr_and_post_metrics_keep_both() -> None:
    """A head with a power-law spectrum plus a mean: rotary turns the mean into a
    position-dependent direction, so the post-rotary PR is far larger (the issue's 4.65 vs
    17.4 at hd 64, T 512); the pre-rotary site records both."""
    g = torch.Generator().manual_seed(9)
    B, T, hd = 4, 64, 16
    spread = torch.arange(1, hd + 1, dtype=torch.float64) ** -1.0  # power-law std
    mean = torch.full((hd,), 2.0, dtype=torch.float64)
    pre = torch.randn(2, B, 1, T, hd, generator=g, dtype=torch.float64) * spread + mean
    q_pre, k_pre = pre[0], pre[1]  # (B, 1, T, hd)
    q_post, k_post = _rope(q_pre), _rope(k_pre)
    site = LayerGeometry(1, 1, hd, with_post=True)
    site.update(q_pre, k_pre, q_post, k_post)
    rec = _as_dict(site.records())
    post_only = LayerGeometry(1, 1, hd)
    post_only.update(q_post, k_post)
    ref = _as_dict(post_only.records())
    assert rec[(0, "pr_q_token")] < rec[(0, "pr_q_token_post")] / 2  # pre < post
    for h in (0, LAYER):
        for m in ("pr_q_token", "pr_k_token", "contrast_token"):
            assert rec[(h, m + "_post")] == pytest.approx(ref[(h, m)], rel=1e-12)
        for m in ("pr_qk_token", "logit_std", "attn_entropy"):  # always what attention uses
            assert rec[(h, m)] == pytest.approx(ref[(h, m)], rel=1e-12)
    assert not [m for _, m, _ in post_only.records() if m.endswith("_post")]


def test_token_blocks_equal_separate_measurements_and_leave_the_total_unchanged() -> None:
    g = torch.Generator().manual_seed(10)
    B, H, Hk, T, hd = 2, 4, 2, 9, 3
    batches = [(torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) + 0.1 * i,
                torch.randn(B, Hk, T, hd, generator=g, dtype=torch.float64)) for i in range(5)]
    plan = [[0, 1], [2], [3, 4]]  # three contiguous blocks of batches
    blocked, plain = LayerGeometry(H, Hk, hd), LayerGeometry(H, Hk, hd)
    got = []
    for members in plan:
        blocked.begin_block()
        for i in members:
            blocked.update(*batches[i])
            plain.update(*batches[i])
        got.append(blocked.end_block())
    assert blocked.records() == plain.records()  # all tokens: bit for bit
    for members, recs in zip(plan, got, strict=True):
        alone = LayerGeometry(H, Hk, hd)
        for i in members:
            alone.update(*batches[i])
        assert recs == alone.records()
    assert got[0] != got[2]
    with pytest.raises(ValueError, match="no token block"):
        blocked.end_block()
