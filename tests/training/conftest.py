"""Fixtures shared by the trainer tests."""

from __future__ import annotations

import pytest
import torch

import qkgeom.arch.gpt as gpt_family


@pytest.fixture
def probe_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The raw q/k dtypes (before any cast) every probe of the test sees, in order: the
    tap through which the measurement captures our GPT's q/k is wrapped for the test."""
    seen: list[torch.dtype] = []
    real = gpt_family.tap_qk

    def spy(model, fn):
        def wrapped(layer, q, k):
            seen.extend([q.dtype, k.dtype])
            fn(layer, q, k)
        return real(model, wrapped)

    monkeypatch.setattr(gpt_family, "tap_qk", spy)
    return seen
