"""Mixed precision, the compiled step and the prefetching batch stream (issue 6).

What must hold whatever the speed settings: probes measure in fp32/fp64, weights and AdamW
state stay fp32, precision is part of the run's identity and ``compile`` is not, and the
data order does not depend on prefetching.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from qkgeom import make_config, train
from qkgeom.arch import adapter_for
from qkgeom.config import GPTConfig
from qkgeom.data.batches import BatchStream, sample_batch
from qkgeom.geometry import measure
from qkgeom.model import GPT
from qkgeom.training.checkpoint import load_latest_checkpoint


def smoke(data: Path, **over: object):
    return make_config("smoke", {"data": str(data), **over})


def test_auto_precision_resolves_by_device_and_hashes_as_resolved() -> None:
    cpu = make_config("smoke")
    assert cpu.precision == "auto" and cpu.effective_precision == "fp32"
    assert make_config("smoke", {"device": "cuda"}).effective_precision == "bf16"
    assert make_config("smoke", {"device": "cuda", "precision": "fp32"}).effective_precision \
        == "fp32"
    # auto on CPU is the same run as explicit fp32; bf16 changes the numbers, so the hash.
    assert cpu.config_hash() == make_config("smoke", {"precision": "fp32"}).config_hash()
    assert cpu.config_hash() != make_config("smoke", {"precision": "bf16"}).config_hash()
    # compile changes speed, not the run: same hash, so a run can be resumed either way.
    assert cpu.config_hash() == make_config("smoke", {"compile": True}).config_hash()


def test_cli_maps_flags_onto_config_keys() -> None:
    from qkgeom.cli.train import train_overrides

    assert train_overrides(compile=True, precision="bf16") == {"compile": True,
                                                               "precision": "bf16"}
    assert train_overrides(compile=None) == {}
    assert train_overrides(depth=6, key_control="shrink", dose=0.3) == {
        "model": {"n_layer": 6}, "key_control": {"mode": "shrink", "dose": 0.3}}


def test_bf16_run_probes_in_fp32_keeps_fp32_master_weights_and_learns(
        sample_data: Path, tmp_path: Path, probe_dtypes: list[torch.dtype]) -> None:
    seen = probe_dtypes
    res = train(smoke(sample_data, precision="bf16"), tmp_path / "bf16")
    assert seen and set(seen) == {torch.float32}  # probes never ran in bf16
    assert np.isfinite(res.metrics["value"]).all()
    cfg = json.loads((res.out_dir / "config.json").read_text())
    assert cfg["config"]["precision"] == "bf16"

    state = load_latest_checkpoint(res.out_dir)
    assert {v.dtype for v in state["model"].values()} == {torch.float32}
    opt_dtypes = {v.dtype for s in state["optimizer"]["state"].values() for k, v in s.items()
                  if k in ("exp_avg", "exp_avg_sq")}
    assert opt_dtypes == {torch.float32}

    val = res.log.dropna(subset=["val_loss"])["val_loss"]
    assert val.iloc[-1] < val.iloc[0] - 0.8  # learns like the fp32 smoke run


def test_bf16_is_really_applied_and_stays_close_to_fp32(sample_data: Path,
                                                        tmp_path: Path) -> None:
    a = train(smoke(sample_data, steps=20), tmp_path / "fp32").log
    b = train(smoke(sample_data, steps=20, precision="bf16"), tmp_path / "bf16").log
    la, lb = a["loss"].dropna().to_numpy(), b["loss"].dropna().to_numpy()
    assert not np.array_equal(la, lb)  # autocast changed the arithmetic ...
    np.testing.assert_allclose(lb, la, rtol=0.03)  # ... but not the run


def test_probe_disables_an_enclosing_autocast() -> None:
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
    model = GPT(cfg, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    train_dtypes: list[torch.dtype] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with adapter_for(model).capture(lambda layer, q, *_: train_dtypes.append(q.dtype)):
            model(tokens)
        inside = measure(model, tokens, batch_size=2).frame
    assert set(train_dtypes) == {torch.bfloat16}  # the training forward is bf16 here
    outside = measure(model, tokens, batch_size=2).frame
    pd.testing.assert_frame_equal(inside, outside, check_exact=True)  # probe: never autocast


def test_batch_stream_prefetch_gives_the_same_batches_and_resumable_state() -> None:
    tokens = np.arange(10_000, dtype=np.uint16) % 251
    plain = torch.Generator().manual_seed(3)
    ahead = torch.Generator().manual_seed(3)
    stream = BatchStream(tokens, 4, 16, ahead, prefetch=True)
    for i in range(5):
        x, y = stream.next()
        stream.prefetch()
        ex, ey = sample_batch(tokens, 4, 16, plain)
        assert torch.equal(x, ex) and torch.equal(y, ey)
        # The saved state is the one before the batch drawn ahead: resuming from it gives
        # the next batch the run would have used.
        assert torch.equal(stream.generator_state(), plain.get_state()), i
    resumed = torch.Generator()
    resumed.set_state(stream.generator_state())
    assert torch.equal(BatchStream(tokens, 4, 16, resumed).next()[0], stream.next()[0])


@pytest.mark.slow
def test_compiled_step_on_cpu_learns_is_deterministic_resumes_and_matches_eager(
        sample_data: Path, tmp_path: Path) -> None:
    """torch.compile on CPU (inductor, C++ codegen): tens of seconds for the first compile.
    Bit-identical reruns hold at a fixed single thread (as sweeps run); with several
    threads inductor's parallel reductions may differ in the last bits between runs."""
    cols = ["step", "layer", "head", "metric", "value"]
    a = train(smoke(sample_data, compile=True, threads=1), tmp_path / "a")
    val = a.log.dropna(subset=["val_loss"])["val_loss"]
    assert val.iloc[-1] < val.iloc[0] - 0.8
    assert all(math.isfinite(v) for v in a.metrics["value"])
    b = train(smoke(sample_data, compile=True, threads=1), tmp_path / "b")  # same seed, same numbers
    pd.testing.assert_frame_equal(a.metrics[cols], b.metrics[cols], check_exact=True)

    # Interrupted after the step-20 checkpoint, resumed: the uninterrupted run's records.
    (b.out_dir / "checkpoints" / "ckpt_00000040.pt").unlink()
    c = train(smoke(sample_data, compile=True, threads=1), b.out_dir, resume=True)
    pd.testing.assert_frame_equal(a.metrics[cols], c.metrics[cols], check_exact=True)
    pd.testing.assert_frame_equal(a.log[["step", "loss", "val_loss"]],
                                  c.log[["step", "loss", "val_loss"]], check_exact=True)

    eager = train(smoke(sample_data, threads=1), tmp_path / "eager")
    la, le = a.log["loss"].dropna().to_numpy(), eager.log["loss"].dropna().to_numpy()
    np.testing.assert_allclose(la, le, rtol=1e-3)  # same maths, fp32 rounding apart
