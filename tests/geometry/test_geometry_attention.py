"""Attention entropy / max weight: uniform, one-hot, hand-computed and reference cases."""

from __future__ import annotations

import math

import pytest
import torch

from qkgeom.geometry import AttentionStats

# Hand-computed: p = (3/4, 1/4) -> H = 3/4·ln(4/3) + 1/4·ln 4 nats; in bits it is 0.811278...
H_34 = 0.5623351446188083
H_34_BITS = 0.8112781244591328


def _reference(q, k, causal, scale=None, mask=None):
    """Straightforward full-matrix softmax in float64 (the definition, no chunking)."""
    B, H, T, hd = q.shape
    scale = 1 / math.sqrt(hd) if scale is None else scale
    s = q.double() @ k.double().mT * scale  # (B, H, T, T)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(T, T, dtype=torch.bool).tril()
    if mask is not None:
        allowed &= mask.bool()[:, None, None, :]
    ent, norm, mx = [], [], []
    for b in range(B):
        for t in range(T):
            if mask is not None and not mask[b, t]:
                continue
            keys = allowed[b, 0, t]
            p = torch.softmax(s[b, :, t, keys], dim=-1)  # (H, n)
            h_t = -(p * p.log()).nan_to_num().sum(-1)  # (H,)
            ent.append(h_t)
            mx.append(p.amax(-1))
            if int(keys.sum()) >= 2:
                norm.append(h_t / math.log(int(keys.sum())))
    return {
        "attn_entropy": torch.stack(ent).mean(0),
        "attn_entropy_norm": torch.stack(norm).mean(0),
        "attn_max": torch.stack(mx).mean(0),
    }


def _close(a: dict, b: dict, **kw) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], **kw)


def test_uniform_causal_attention_has_entropy_log_t_plus_one() -> None:
    B, H, T, hd = 2, 3, 6, 4
    stats = AttentionStats(H, causal=True)
    stats.update(
        torch.zeros(B, H, T, hd, dtype=torch.float64), torch.randn(B, H, T, hd, dtype=torch.float64)
    )
    res = stats.result()
    logs = [math.log(t + 1) for t in range(T)]
    expected_max = sum(1 / (t + 1) for t in range(T)) / T
    for h in range(H):
        assert float(res["attn_entropy"][h]) == pytest.approx(sum(logs) / T, rel=1e-13)
        assert float(res["attn_entropy_norm"][h]) == pytest.approx(1.0, rel=1e-13)
        assert float(res["attn_max"][h]) == pytest.approx(expected_max, rel=1e-13)
    assert stats.n_queries == B * T and stats.n_queries_norm == B * (T - 1)
    assert all(v.dtype == torch.float64 and v.shape == (H,) for v in res.values())


def test_uniform_bidirectional_attention_has_entropy_log_t() -> None:
    B, H, T, hd = 2, 2, 5, 3
    stats = AttentionStats(H, causal=False)
    stats.update(torch.zeros(B, H, T, hd), torch.randn(B, H, T, hd))  # float32 path
    res = stats.result()
    torch.testing.assert_close(
        res["attn_entropy"], torch.full((H,), math.log(T), dtype=torch.float64)
    )
    torch.testing.assert_close(res["attn_entropy_norm"], torch.ones(H, dtype=torch.float64))
    torch.testing.assert_close(res["attn_max"], torch.full((H,), 1 / T, dtype=torch.float64))


@pytest.mark.parametrize("causal", [True, False])
def test_one_hot_attention_has_zero_entropy_and_max_one(causal: bool) -> None:
    B, H, T = 2, 2, 8
    hd = T
    k = torch.eye(T).expand(B, H, T, hd)  # key s = e_s
    q = 100.0 * math.sqrt(hd) * torch.eye(T).expand(B, H, T, hd)  # logit +100 on key t only
    stats = AttentionStats(H, causal=causal)
    stats.update(q, k)
    res = stats.result()
    assert float(res["attn_entropy"].abs().max()) < 1e-6
    assert float(res["attn_entropy_norm"].abs().max()) < 1e-6
    torch.testing.assert_close(res["attn_max"], torch.ones(H, dtype=torch.float64))


def test_hand_computed_two_key_case_causal() -> None:
    # hd = 1, scale 1: query 1 scores key 0 at ln 3 and key 1 at 0 -> p = (3/4, 1/4).
    q = torch.tensor([0.7, math.log(3.0)]).reshape(1, 1, 2, 1)  # (B, H, T, hd)
    k = torch.tensor([1.0, 0.0]).reshape(1, 1, 2, 1)  # (B, H, T, hd)
    stats = AttentionStats(1, causal=True)
    stats.update(q, k, scale=1.0)
    res = stats.result()
    # t = 0 sees one key: H = 0, max = 1 (and is left out of the normalised mean).
    assert float(res["attn_entropy"][0]) == pytest.approx((0.0 + H_34) / 2, rel=1e-6)
    assert float(res["attn_entropy_norm"][0]) == pytest.approx(H_34_BITS, rel=1e-6)
    assert float(res["attn_max"][0]) == pytest.approx((1.0 + 0.75) / 2, rel=1e-6)


def test_hand_computed_two_key_case_bidirectional() -> None:
    # Query 0 (q = 0) is uniform over both keys; query 1 gives (3/4, 1/4).
    q = torch.tensor([0.0, math.log(3.0)], dtype=torch.float64).reshape(1, 1, 2, 1)
    k = torch.tensor([1.0, 0.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    stats = AttentionStats(1, causal=False)
    stats.update(q, k, scale=1.0)
    res = stats.result()
    assert float(res["attn_entropy"][0]) == pytest.approx((math.log(2) + H_34) / 2, rel=1e-13)
    assert float(res["attn_entropy_norm"][0]) == pytest.approx((1 + H_34_BITS) / 2, rel=1e-13)
    assert float(res["attn_max"][0]) == pytest.approx((0.5 + 0.75) / 2, rel=1e-13)


@pytest.mark.parametrize("causal", [True, False])
def test_matches_full_matrix_reference_and_chunking_is_invisible(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    q = 2 * torch.randn(2, 3, 17, 4, generator=g, dtype=torch.float64)  # (B, H, T, hd)
    k = torch.randn(2, 3, 17, 4, generator=g, dtype=torch.float64)  # (B, H, T, hd)
    ref = _reference(q, k, causal)
    for chunk in (None, 1, 5, 17, 100):
        stats = AttentionStats(3, causal=causal)
        stats.update(q, k, chunk_size=chunk)
        _close(stats.result(), ref, rtol=1e-12, atol=1e-12)
    small = AttentionStats(3, causal=causal, max_chunk_elements=50)  # forces 1-row chunks
    small.update(q, k)
    _close(small.result(), ref, rtol=1e-12, atol=1e-12)
    f32 = AttentionStats(3, causal=causal)
    f32.update(q.float(), k.float())
    _close(f32.result(), ref, rtol=1e-5, atol=1e-5)
    bf16 = AttentionStats(3, causal=causal)
    bf16.update(q.bfloat16(), k.bfloat16())  # computed in float32 from bf16 inputs
    _close(bf16.result(), ref, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("causal", [True, False])
def test_padding_mask_equals_unpadded_sequences(causal: bool) -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 1, 2, 5, 3, generator=g, dtype=torch.float64)  # (q|k, B=1, H, T=5, hd)
    b = torch.randn(2, 1, 2, 3, 3, generator=g, dtype=torch.float64)  # (q|k, B=1, H, T=3, hd)
    separate = AttentionStats(2, causal=causal)
    separate.update(a[0], a[1])
    separate.update(b[0], b[1])
    # Batch them: b right-padded (bidirectional) or left-padded (causal) with garbage.
    junk = 50 * torch.randn(2, 1, 2, 2, 3, generator=g, dtype=torch.float64)
    b_pad = torch.cat([junk, b], dim=3) if causal else torch.cat([b, junk], dim=3)
    q = torch.cat([a[0], b_pad[0]])  # (2, H, 5, hd)
    k = torch.cat([a[1], b_pad[1]])  # (2, H, 5, hd)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0 if causal else 1
    mask[1, 3:] = 1 if causal else 0
    batched = AttentionStats(2, causal=causal)
    batched.update(q, k, attention_mask=mask, chunk_size=2)
    assert batched.n_queries == separate.n_queries == 8
    _close(batched.result(), separate.result(), rtol=1e-12, atol=1e-12)
    _close(batched.result(), _reference(q, k, causal, mask=mask), rtol=1e-12, atol=1e-12)


def test_accumulates_across_updates_as_one_mean() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 2, 6, 3, generator=g, dtype=torch.float64)  # (B, H, T, hd)
    k = torch.randn(4, 2, 6, 3, generator=g, dtype=torch.float64)  # (B, H, T, hd)
    once, twice = AttentionStats(2), AttentionStats(2)
    once.update(q, k)
    twice.update(q[:1], k[:1])
    twice.update(q[1:], k[1:])
    _close(twice.result(), once.result(), rtol=1e-13, atol=0)


def test_empty_and_single_token_cases() -> None:
    stats = AttentionStats(2)
    with pytest.raises(ValueError, match="update"):
        stats.result()
    stats.update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    res = stats.result()
    assert res["attn_entropy"].tolist() == [0.0, 0.0]
    assert res["attn_max"].tolist() == [1.0, 1.0]
    assert torch.isnan(res["attn_entropy_norm"]).all()  # undefined with a single key
    with pytest.raises(ValueError):
        stats.update(torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4))  # wrong head count
