"""``logit_max`` and ``logit_delta`` against logits computed by hand and by the full masked
score matrix, whatever the blocking, GQA grouping, dtype or padding."""

from __future__ import annotations

import math

import pytest
import torch

from qkgeom.geometry import LayerGeometry, StreamingEntropy
from qkgeom.geometry.tokens import DELTA_POSITIONS, logit_delta


def explicit_max(q, k, causal, scale):
    """(H,) largest visible scaled logit of each head, from the full (B, H, T, T) scores."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q.double() @ k.double().mT) * scale
    T = q.shape[2]
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return s.amax(dim=(0, 2, 3))


def test_logit_max_by_hand() -> None:
    # hd = 1, scale 1, causal: scores q0·k0 = 0.7 | q1·k0 = ln 3, q1·k1 = 0; the invisible
    # pair (query 0, key 1) scores 0.7·5 = 3.5 and must not count; bidirectionally it does.
    q = torch.tensor([0.7, math.log(3.0)], dtype=torch.float64).reshape(1, 1, 2, 1)
    k = torch.tensor([1.0, 5.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    causal = StreamingEntropy(1, causal=True)
    causal.update(q, k, scale=1.0)
    assert float(causal.logit_max()[0]) == pytest.approx(max(0.7, math.log(3.0), 5 * math.log(3)),
                                                         rel=1e-14)
    q = torch.tensor([0.7, -1.0], dtype=torch.float64).reshape(1, 1, 2, 1)
    causal = StreamingEntropy(1, causal=True)
    causal.update(q, k, scale=1.0)  # visible: 0.7 | -1, -5
    assert float(causal.logit_max()[0]) == pytest.approx(0.7, rel=1e-14)
    both = StreamingEntropy(1, causal=False)
    both.update(q, k, scale=1.0)  # + (query 0, key 1): 3.5
    assert float(both.logit_max()[0]) == pytest.approx(3.5, rel=1e-14)
    negative = StreamingEntropy(1, causal=True)  # every logit below zero: the max is too
    negative.update(-q.abs() - 1, k, scale=1.0)
    assert float(negative.logit_max()[0]) == pytest.approx(-1.7, rel=1e-14)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("blocks", [None, (5, 7), (16, 16), (3, 64), (1, 1)])
def test_logit_max_equals_the_explicit_scores_whatever_the_blocks(causal, n_kv, blocks) -> None:
    """Whole rows (read off the softmax: log Z + log max p + the row mean) and the online
    softmax over key chunks (its running maximum) give the full matrix's maximum."""
    g = torch.Generator().manual_seed(0)
    B, H, T, hd = 3, 4, 37, 8
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) * torch.linspace(
        0.5, 30, H, dtype=torch.float64).view(1, H, 1, 1)  # peaked heads: logits in the hundreds
    k = torch.randn(B, n_kv, T, hd, generator=g, dtype=torch.float64) - 0.5
    acc = StreamingEntropy(H, n_kv, causal)
    acc.update(q[:2], k[:2], 0.7, blocks=blocks)
    acc.update(q[2:], k[2:], 0.7, blocks=blocks)
    torch.testing.assert_close(acc.logit_max(), explicit_max(q, k, causal, 0.7), rtol=1e-12,
                               atol=1e-12)
    f32 = StreamingEntropy(H, n_kv, causal)
    f32.update(q.float(), k.float(), 0.7, blocks=blocks)
    torch.testing.assert_close(f32.logit_max(), explicit_max(q.float(), k.float(), causal, 0.7),
                               rtol=1e-5, atol=1e-4)


def explicit_delta(before, now, causal):
    """Per head: RMS over visible pairs of the change of the row-centred logits, by loops."""
    (q0, k0), (q1, k1) = before, now
    H, T = q1.shape[1], q1.shape[2]
    R = H // k1.shape[1]
    out = []
    for h in range(H):
        total, pairs = 0.0, 0
        for t in range(T):
            keys = range(t + 1) if causal else range(T)
            rows = []
            for q, k in ((q0, k0), (q1, k1)):
                s = [float(q[0, h, t] @ k[0, h // R, j]) for j in keys]
                mean = sum(s) / len(s)
                rows.append([v - mean for v in s])
            total += sum((b - a) ** 2 for a, b in zip(*rows, strict=True))
            pairs += len(rows[0])
        out.append(math.sqrt(total / pairs))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_kv", [2, 1])
def test_logit_delta_by_loops(causal, n_kv) -> None:
    g = torch.Generator().manual_seed(1)
    H, T, hd = 2, 6, 3
    before = (torch.randn(1, H, T, hd, generator=g, dtype=torch.float64),
              torch.randn(1, n_kv, T, hd, generator=g, dtype=torch.float64))
    now = (before[0] * 2 + 0.1, before[1] - 0.3)
    torch.testing.assert_close(logit_delta(before, now, causal),
                               explicit_delta(before, now, causal), rtol=1e-12, atol=1e-14)


def test_logit_delta_ignores_a_shift_of_a_row_and_counts_a_change_of_scale() -> None:
    """The softmax ignores adding a constant to a query's logits: so does logit_delta. A key
    vector added to every key shifts each row by q·c; doubling q doubles every centred logit."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 5, 2, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 2, generator=g, dtype=torch.float64)
    shifted = (q, k + torch.tensor([0.4, -1.3], dtype=torch.float64))
    assert float(logit_delta((q, k), shifted, True)[0]) == pytest.approx(0.0, abs=1e-14)
    doubled = logit_delta((q, k), (2 * q, k), True)  # = the RMS of the centred logits
    rms = explicit_delta((0 * q, k), (q, k), True)
    torch.testing.assert_close(doubled, rms, rtol=1e-12, atol=0)


def test_layer_geometry_keeps_the_first_window_and_compares_with_the_previous() -> None:
    """The window is the first sequence of the first batch, scaled; the layer row is the
    RMS over every head's pairs; without a previous window there is no logit_delta, and a
    window of another shape gives none either."""
    g = torch.Generator().manual_seed(3)
    B, H, T, hd = 3, 2, 7, 4
    q = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, T, hd, generator=g, dtype=torch.float64)
    first = LayerGeometry(H, H, hd)
    first.update(q[:2], k[:2])
    first.update(q[2:], k[2:])
    scale = 1 / math.sqrt(hd)
    torch.testing.assert_close(first.window[0], q[:1] * scale, rtol=0, atol=0)
    assert "logit_delta" not in {m for _, m, _ in first.records()}
    second = LayerGeometry(H, H, hd, previous=first.window)
    second.update(1.5 * q, k)
    rec = {(h, m): v for h, m, v in second.records()}
    want = explicit_delta(first.window, (1.5 * q[:1] * scale, k[:1]), True)
    for h in range(H):
        assert rec[(h, "logit_delta")] == pytest.approx(float(want[h]), rel=1e-12)
    assert rec[(-1, "logit_delta")] == pytest.approx(float(want.square().mean().sqrt()),
                                                     rel=1e-12)
    assert rec[(-1, "logit_max")] == pytest.approx(max(rec[(h, "logit_max")] for h in range(H)))
    other = LayerGeometry(H, H, hd, previous=(q[:1, :, :5], k[:1, :, :5]))
    other.update(q, k)
    assert "logit_delta" not in {m for _, m, _ in other.records()}


def test_a_padded_batch_keeps_the_real_tokens_of_its_window() -> None:
    """A right-padded first sequence: its window is cut to its real tokens, like every
    other statistic of a padded batch."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64)
    geo = LayerGeometry(2, 2, 4)
    geo.update(q, k, lengths=[4, 6])
    assert geo.window[0].shape == (1, 2, 4, 4)
    long = LayerGeometry(1, 1, 2)  # a long context: its first DELTA_POSITIONS positions
    long.update(torch.randn(1, 1, DELTA_POSITIONS + 40, 2, dtype=torch.float64),
                torch.randn(1, 1, DELTA_POSITIONS + 40, 2, dtype=torch.float64))
    assert [t.shape[2] for t in long.window] == [DELTA_POSITIONS] * 2
