"""Closed loop: the proportional law by hand, the key control hitting the setpoints, and
both wirings (``qkgeom.train`` callback, ``GeometryMonitor(control=...)``)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from qkgeom.errors import QKGeomError
from qkgeom.monitor import EntropyControlCallback, EntropyController, GeometryMonitor

from .conftest import tiny_gpt2


def gpt():
    from qkgeom import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=64),
               generator=torch.Generator().manual_seed(0))


def test_proportional_update_and_projection() -> None:
    model = gpt()
    # frobenius: no forward pass here, and ‖W_K‖_F is what it keeps (checked below)
    ctl = EntropyController([1.0, 2.0], gain=0.5, max_step=0.2, scale="frobenius")
    control = ctl.attach(model)
    pr0 = control.pr0.clone()
    norms = [b.attn.k_proj.weight.norm().item() for b in model.blocks]
    rec = ctl.update({0: 0.8, 1: 3.0})  # layer 0: +0.2 nats short -> up; layer 1: far above
    want = torch.tensor([pr0[0] * math.exp(0.5 * 0.2), pr0[1] * math.exp(-0.2)])  # clipped
    assert torch.allclose(control.setpoint, want.double())
    assert rec["ctl_setpoint_l0"] == pytest.approx(float(want[0]))
    assert rec["ctl_entropy_l1"] == 3.0 and rec["ctl_entropy_target_l1"] == 2.0
    ctl.after_step(1)
    assert torch.allclose(control.current_pr(), want.double(), rtol=1e-3)  # the control's invariant
    for block, norm in zip(model.blocks, norms, strict=True):
        assert block.attn.k_proj.weight.norm().item() == pytest.approx(norm, rel=1e-6)
    assert ctl.records()["ctl_pr_l1"] == pytest.approx(float(want[1]), rel=1e-3)


def test_controller_arguments() -> None:
    with pytest.raises(QKGeomError, match="target entropy"):
        EntropyController(-1.0)
    with pytest.raises(QKGeomError, match="3 target entropies for 2"):
        EntropyController([1.0, 2.0, 3.0]).attach(gpt())
    with pytest.raises(QKGeomError, match="not attached"):
        EntropyController(1.0).update({0: 1.0})


@pytest.mark.slow
def test_callback_in_qkgeom_train(tmp_path, sample_data) -> None:
    import qkgeom

    cfg = qkgeom.make_config("smoke", {"data": str(sample_data), "steps": 20,
                                       "probe_every": 10, "checkpoint_every": 20})
    cb = EntropyControlCallback(EntropyController(0.5, gain=1.0))  # far below: shrink keys
    res = qkgeom.train(cfg, tmp_path / "run", callbacks=[cb])
    m = pd.read_parquet(tmp_path / "run" / "metrics.parquet")
    sp = m[m["metric"] == "ctl_setpoint_l0"].set_index("step")["value"]
    assert list(sp.index) == [0, 10, 20] and sp.is_monotonic_decreasing
    assert res.status == "done"
    pr = m[m["metric"] == "ctl_pr_l0"].set_index("step")["value"]
    assert pr[10] == pytest.approx(sp[0], rel=1e-3)  # steps 1..10 held the step-0 setpoint


def test_monitor_drives_the_controller(probe_tokens, corpus) -> None:
    model = tiny_gpt2(corpus.vocab.vocab_size)
    mon = GeometryMonitor(model, probe_tokens, every=2, control=EntropyController(5.0),
                          wandb=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    mon.start(0)
    for step in range(1, 5):
        x = probe_tokens[:2]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        mon.step(step)
    h = mon.history
    sp = h[h["metric"] == "ctl_setpoint_l0"].set_index("step")["value"]
    assert list(sp.index) == [0, 2, 4] and sp.is_monotonic_increasing  # entropy below 5 nats
    assert "attn_entropy" in set(h["metric"])
    pr = h[h["metric"] == "ctl_pr_l0"].set_index("step")["value"]
    assert pr[4] == pytest.approx(sp[2], rel=1e-3)  # steps 3..4 held probe 2's setpoint
