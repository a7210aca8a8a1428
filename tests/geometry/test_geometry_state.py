"""The probe leaves training untouched: per-module modes and every RNG come back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from qkgeom.geometry import frozen_training_state


def model() -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
    net.train()
    net[2].eval()  # a submodule the user froze in eval mode
    return net


def draws() -> tuple:
    return torch.rand(3), random.random(), np.random.rand()


def test_modes_and_rng_are_restored_and_inside_is_eval_without_grad() -> None:
    net = model()
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = draws()
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    with frozen_training_state(net):
        assert not any(m.training for m in net.modules())
        assert not torch.is_grad_enabled()
        draws()  # consume every generator inside the probe
    got = draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    assert [m.training for m in net.modules()] == [True, True, True, False]
    assert torch.is_grad_enabled()


def test_restored_after_an_exception() -> None:
    net = model()
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError), frozen_training_state(net):
        torch.rand(5)
        raise RuntimeError("probe failed")
    assert torch.equal(torch.get_rng_state(), state)
    assert [m.training for m in net.modules()] == [True, True, True, False]
