"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import pytest
import torch

import qkgeom.geometry.probe as probe_module


@pytest.fixture
def probe_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The raw q/k dtypes (before any cast) every probe of the test sees, in order: the
    probe's tap is wrapped for the duration of the test."""
    seen: list[torch.dtype] = []
    real = probe_module.tap_qk

    def spy(model, fn):
        def wrapped(layer, q, k):
            seen.extend([q.dtype, k.dtype])
            fn(layer, q, k)
        return real(model, wrapped)

    monkeypatch.setattr(probe_module, "tap_qk", spy)
    return seen
