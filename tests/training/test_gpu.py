"""CUDA checks (``pytest -m gpu``; skipped without a CUDA device). benchmarks/gpu_check.sh
runs them on a GPU machine: bf16 + compile training, key control, probes in fp32, SDPA's
flash kernel, and a hot loop that never waits on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from qkgeom import make_config, train
from qkgeom.config import GPTConfig
from qkgeom.model import GPT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def smoke(data: Path, **over: object):
    return make_config("smoke", {"data": str(data), "device": "cuda", **over})


def test_auto_precision_is_bf16_and_compiled_training_learns(sample_data: Path,
                                                              tmp_path: Path) -> None:
    res = train(smoke(sample_data, compile=True, steps=60, probe_every=20), tmp_path / "r")
    val = res.log.dropna(subset=["val_loss"])["val_loss"]
    assert val.iloc[-1] < val.iloc[0] - 0.8
    assert np.isfinite(res.metrics["value"]).all()
    assert '"precision": "bf16"' in (res.out_dir / "config.json").read_text()


def test_probes_run_in_fp32_during_a_bf16_run(sample_data: Path, tmp_path: Path,
                                              probe_dtypes: list[torch.dtype]) -> None:
    seen = probe_dtypes
    res = train(smoke(sample_data, precision="bf16", steps=20), tmp_path / "r")
    assert seen and set(seen) == {torch.float32}
    assert np.isfinite(res.metrics["value"]).all()


def test_key_control_holds_its_target_on_cuda(sample_data: Path, tmp_path: Path) -> None:
    res = train(smoke(sample_data, key_control={"mode": "hold"}, steps=20, compile=True),
                tmp_path / "hold")
    m = res.metrics
    last = m[m["step"] == 20]
    pr = last[last["metric"].str.startswith("ctl_pr_l")].sort_values("metric")["value"]
    target = last[last["metric"].str.startswith("ctl_target_l")].sort_values("metric")["value"]
    assert len(pr) and len(pr) == len(target)
    np.testing.assert_allclose(pr.to_numpy(), target.to_numpy(), rtol=1e-3)


def test_sdpa_flash_kernel_serves_the_bf16_paper_model() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = GPTConfig(n_layer=2, n_head=6, n_embd=384, block_size=256, vocab_size=200)
    model = GPT(cfg).cuda()
    x = torch.randint(0, 200, (4, 256), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", torch.bfloat16):
        _, loss = model(x, x)  # raises if flash cannot serve these shapes/dtypes
    loss.backward()
    assert torch.isfinite(loss)


def test_hot_loop_does_not_sync_with_the_device(sample_data: Path, tmp_path: Path) -> None:
    """Between records the loop must not wait for the GPU: with records only at the end,
    torch's sync debug mode must see no synchronising call in the training steps."""
    from qkgeom.training import Callback, TrainContext

    class Arm(Callback):
        def on_step_end(self, ctx: TrainContext) -> None:
            if ctx.step == 2:  # after warm-up (the first steps allocate and may sync)
                torch.cuda.set_sync_debug_mode("error")
            if ctx.step == ctx.config.steps - 1:
                torch.cuda.set_sync_debug_mode("default")

    cfg = smoke(sample_data, steps=12, probe_every=12, eval_every=12, log_every=12,
                checkpoint_every=12, warmup_steps=2)
    try:
        train(cfg, tmp_path / "nosync", callbacks=[Arm()])
    finally:
        torch.cuda.set_sync_debug_mode("default")
