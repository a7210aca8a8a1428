"""Attack 4: divergence. A learning rate that blows up and a NaN injected into one batch's
activations are recorded as ``diverged`` at the right step (exit 3); in a sweep the other
runs go on and the report lists the diverged ones and leaves them out of every average."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fault_helpers import assert_clean_error, cli, figure, status, train_args


def test_exploding_lr_is_diverged_not_a_crash(sample_data: Path, tmp_path: Path) -> None:
    """lr 1e6 without clipping: the first update leaves inf activations while its own loss
    was finite; the probe right after it must record the divergence, not crash in an SVD."""
    out = tmp_path / "run"
    res = cli(*train_args(sample_data, out, 10, 1, "--lr", "1e6", "--set", "grad_clip=0",
                          "--set", "warmup_steps=0"))
    assert_clean_error(res.returncode, res.stderr, expect=3, words=("diverged", "step 1"))
    st = status(out)
    assert (st["state"], st["diverged_step"]) == ("diverged", 1), st
    figure("divergence lr=1e6", f"exit {res.returncode}, diverged_step {st['diverged_step']} "
           "(expected 1)")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_batch_is_diverged_at_its_step(sample_data: Path, tmp_path: Path,
                                                 bad: float) -> None:
    """A callback poisons the embeddings of exactly one batch (update 7): diverged_step 7,
    the weights and the checkpoint before it stay finite."""
    import qkgeom
    from qkgeom.errors import DivergedError
    from qkgeom.training import Callback

    class Poison(Callback):
        def on_train_start(self, ctx) -> None:
            def hook(module, inputs, output):
                if ctx.step == 6 and module.training:  # the forward of update 7
                    return output + bad
                return output
            ctx.model.wte.register_forward_hook(hook)

    cfg = qkgeom.make_config("smoke", {"data": str(sample_data), "steps": 12,
                                       "checkpoint_every": 4, "probe_every": 4, "threads": 1})
    out = tmp_path / "run"
    with pytest.raises(DivergedError, match="step 7"):
        qkgeom.train(cfg, out, callbacks=[Poison()])
    st = status(out)
    assert (st["state"], st["diverged_step"]) == ("diverged", 7), st
    ckpt = torch.load(out / "checkpoints" / "ckpt_00000004.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    import pandas as pd

    assert pd.read_parquet(out / "metrics.parquet")["value"].notna().all()
    figure(f"divergence {bad} in batch 7", f"diverged_step {st['diverged_step']} (expected 7)")


@pytest.mark.slow
def test_two_sweeps_and_a_report_at_once_with_a_diverging_run(sample_data: Path,
                                                              tmp_path: Path) -> None:
    """Attacks 4 and 6 together: two ``sweep run`` on one folder while ``report`` reads it;
    one run of the grid diverges. No run is trained twice, no read is torn, the sweep goes
    on past the divergence and the report lists it and leaves it out."""
    import subprocess
    import sys

    import yaml

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({
        "name": "conc", "preset": "smoke",
        "base": {"data": str(sample_data), "steps": 8, "checkpoint_every": 4,
                 "probe_every": 4, "eval_every": 4, "grad_clip": 0.0, "warmup_steps": 0},
        "axes": {"lr": [0.003, 1.0e6], "seed": [0, 1]}}))
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "qkgeom.cli", "sweep", "run", str(grid), "--out", str(out),
           "--workers", "1", "--threads", "1", "--quiet"]
    sweeps = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    reports = []
    while any(p.poll() is None for p in sweeps):  # report while the sweeps write
        if (out / "sweep.json").exists():
            reports.append(cli("report", str(out)))
    results = [p.communicate() for p in sweeps]
    assert all(p.returncode == 0 for p in sweeps), results
    runs = sorted((out / "runs").iterdir())
    runs = [r for r in runs if r.is_dir()]
    attempts = {r.name: len((r / "attempts.jsonl").read_text().splitlines()) for r in runs}
    assert len(runs) == 4 and set(attempts.values()) == {1}, attempts  # none trained twice
    states = {r.name: status(r)["state"] for r in runs}
    assert sorted(states.values()) == ["diverged", "diverged", "done", "done"], states
    torn = [r for r in reports if r.returncode not in (0, 2) or "Traceback" in r.stderr]
    assert not torn, [r.stderr[-500:] for r in torn]
    final = cli("report", str(out))
    assert final.returncode == 0, final.stderr
    assert "2 run(s) left out" in final.stdout
    md = (out / "report" / "report.md").read_text()
    for rid, state in states.items():
        if state == "diverged":
            assert f"`{rid}`" in md and "diverged at step" in md
    claims = json.dumps(md)
    assert "left out of every average" in claims
    figure("concurrency", f"2 sweeps on one folder: {len(runs)} runs, attempts per run "
           f"{sorted(set(attempts.values()))}; {len(reports)} concurrent reports, "
           f"{len(torn)} torn/tracebacks")
    figure("divergence in a sweep", "2/4 runs diverged, the sweep finished the other 2; "
           "report lists both as left out of every average")
