"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import pytest
import torch

from qkgeom.arch import ModelAdapter


@pytest.fixture
def probe_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The raw q/k dtypes (before any cast) every probe of the test sees, in order: the
    capture through which the measurement receives our GPT's q/k is wrapped for the test."""
    seen: list[torch.dtype] = []
    real = ModelAdapter.capture

    def spy(adapter, on_qk, qk_site="post-rotary"):
        def wrapped(layer, q, k, *rest):
            seen.extend([q.dtype, k.dtype])
            on_qk(layer, q, k, *rest)
        return real(adapter, wrapped, qk_site)

    monkeypatch.setattr(ModelAdapter, "capture", spy)
    return seen
