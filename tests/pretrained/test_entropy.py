"""Ground truths for the streaming pieces: online-softmax entropy against the explicit
pattern, the Gram-trace logit PR against an SVD, and the GQA pairing invariance."""

from __future__ import annotations

import math

import pytest
import torch

from qkgeom.geometry import AttentionStats, StreamingCovariance, logit_singular_values
from qkgeom.geometry.spectra import participation_ratio
from qkgeom.pretrained.accumulate import head_blocks, logit_pr
from qkgeom.pretrained.entropy import StreamingEntropy


def explicit(q, k, causal, scale):
    """Entropy / max weight of the full (B, H, T, T) pattern, float64, by hand."""
    R = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(R, dim=1)
    s = (q @ k.mT) * scale
    T = q.shape[2]
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = s.softmax(-1)
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros(()))).sum(-1)  # (B, H, T)
    n = torch.arange(1, T + 1) if causal else torch.full((T,), T)
    ok = n >= 2
    norm = (ent / n.clamp_min(2).log() * ok).sum((0, 2)) / (q.shape[0] * int(ok.sum()))
    return ent.mean((0, 2)), norm, p.amax(-1).mean((0, 2))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("blocks", [None, (5, 7), (16, 16), (3, 64)])
def test_streaming_entropy_equals_the_explicit_pattern(causal, n_kv, blocks) -> None:
    g = torch.Generator().manual_seed(0)
    B, H, T, hd = 3, 4, 37, 8
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) * 3  # peaked rows too
    k = torch.randn(B, n_kv, T, hd, generator=g, dtype=torch.float64)
    scale = 0.7
    acc = StreamingEntropy(H, n_kv, causal)
    acc.update(q[:2], k[:2], scale, blocks=blocks)
    acc.update(q[2:], k[2:], scale, blocks=blocks)
    got = acc.result()
    ent, norm, pmax = explicit(q, k, causal, scale)
    torch.testing.assert_close(got["attn_entropy"], ent, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(got["attn_entropy_norm"], norm, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(got["attn_max"], pmax, rtol=1e-7, atol=1e-9)


def test_streaming_entropy_matches_the_trainer_probe_statistics_in_float32() -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 64, 16, generator=g), torch.randn(2, 3, 64, 16, generator=g)
    mine = StreamingEntropy(3, 3, True)
    mine.update(q, k, blocks=(16, 16))  # four key chunks per late query block: online path
    ref = AttentionStats(3, causal=True)
    ref.update(q, k)
    for name, value in ref.result().items():
        torch.testing.assert_close(mine.result()[name], value, rtol=2e-5, atol=2e-5)


def test_one_hot_and_uniform_rows() -> None:
    T, hd = 6, 4
    k = torch.eye(T, hd, dtype=torch.float64)[None, None] * 0  # all-zero keys: uniform rows
    q = torch.ones(1, 1, T, hd, dtype=torch.float64)
    acc = StreamingEntropy(1, 1, causal=False)
    acc.update(q, k)
    assert acc.result()["attn_entropy"].item() == pytest.approx(math.log(T))
    assert acc.result()["attn_max"].item() == pytest.approx(1 / T)


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
