"""Synthetic sweep folders with known answers, written the way the trainer writes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from qkgeom.runs import FORMAT_VERSION

STEPS = list(range(0, 101, 10))  # probes at 0, 10, ..., 100
WARMUP = 20  # -> reference probe = step 20
LEVEL_METRICS = ("pr_q", "pr_k", "contrast", "pr_qk")

# values(layer, step, metric, head) -> float; metric is a recorded metric name.
Values = Callable[[int, int, str, int], float]


def monotone_values(q_sign: Callable[[int], int] = lambda layer: 1,
                    wiggle: float = 0.0) -> Values:
    """PR_Q = 10 ± 0.05·step (sign per layer), PR_K = 8 − 0.05·step + ``wiggle``·sin(step);
    pr_qk = PR_K / 2 and entropy = 1 + pr_qk / 10 move exactly with PR_K (Spearman 1, and
    with a wiggle their probe-to-probe changes too); across heads pr_qk and entropy both grow
    with the head index (Spearman 1)."""

    def values(layer: int, step: int, metric: str, head: int) -> float:
        q = 10.0 + q_sign(layer) * 0.05 * step + 0.1 * layer
        k = 8.0 - 0.05 * step + wiggle * np.sin(step)
        base = {"pr_q": q, "pr_k": k, "contrast": q - k, "pr_qk": k / 2 + 0.3 * max(head, 0)}
        base["attn_entropy"] = 1.0 + base["pr_qk"] / 10
        base["attn_entropy_norm"] = base["attn_entropy"] / 4
        base["attn_max"] = 1.0 / base["attn_entropy"]
        base["logit_std"] = 2.0 / base["attn_entropy"]
        base["attn_entropy_scalefree"] = base["attn_entropy"] + 0.5
        base["logit_std_row"] = 1.5 / base["attn_entropy"]
        name = metric.rsplit("_", 1)[0] if metric.endswith(("_weight", "_token")) else metric
        return base[name]

    return values


def write_run(root: Path, run_id: str, depth: int, qk_init: str, seed: int, values: Values,
              state: str = "done", n_head: int = 3, steps: list[int] = STEPS,
              warmup: int = WARMUP, reference_step: int = -1, levels=("weight", "token"),
              lr: float = 3e-3, extra_cfg: dict | None = None,
              val_loss: Callable[[int], float] | None = None,
              records: Callable[[int], dict[str, float]] | None = None,
              format_version: int = FORMAT_VERSION) -> Path:
    """One run folder: config.json, metrics.parquet, train_log.parquet, status.json.
    ``records(step)`` adds flat records (layer −1, head −1) the way a callback's
    ``on_probe`` does (``ctl_dose_l0``, ...); ``format_version`` is the run folder
    format config.json says it is written in (another than the current one is refused)."""
    out = root / "runs" / run_id
    out.mkdir(parents=True)
    cfg = {
        "model": {"n_layer": depth, "n_head": n_head, "n_embd": 24, "block_size": 16,
                  "vocab_size": 50, "qk_init": qk_init, "bias": False, "dropout": 0.0},
        "seed": seed, "steps": steps[-1], "batch_size": 4, "lr": lr, "warmup_steps": warmup,
        "reference_step": reference_step, "probe_every": 10, "probe_sequences": 2,
        "device": "cpu", "threads": 0, "data": "sample", **(extra_cfg or {}),
    }
    (out / "config.json").write_text(json.dumps({
        "run_id": run_id, "config": cfg, "config_hash": f"h{seed}", "data_dir": "/x",
        "data_source": "synthetic", "vocab_size": 50, "versions": {},
        "format_version": format_version}))
    names = [f"{m}_{lv}" for lv in levels for m in LEVEL_METRICS]
    if "token" in levels:
        names += ["attn_entropy", "attn_entropy_norm", "attn_max", "logit_std",
                  "attn_entropy_scalefree", "logit_std_row"]
    rows = [(run_id, s, layer, head, name, values(layer, s, name, head))
            for s in steps for layer in range(depth) for head in [*range(n_head), -1]
            for name in names]
    if records:
        rows += [(run_id, s, -1, -1, name, v) for s in steps for name, v in records(s).items()]
    pd.DataFrame(rows, columns=["run_id", "step", "layer", "head", "metric", "value"]) \
        .to_parquet(out / "metrics.parquet", index=False)
    log_steps = np.arange(0, steps[-1] + 1, 10)
    pd.DataFrame({"step": log_steps, "loss": np.linspace(4, 2, len(log_steps)),
                  "val_loss": (np.linspace(4.1, 2.1, len(log_steps)) if val_loss is None
                               else [val_loss(int(s)) for s in log_steps]),
                  "lr": np.full(len(log_steps), lr),
                  "tokens_per_s": np.full(len(log_steps), 640.0)}) \
        .to_parquet(out / "train_log.parquet", index=False)
    status = {"state": state, "step": steps[-1] if state == "done" else steps[-1] // 2,
              "steps": steps[-1]}
    if state == "diverged":
        status["diverged_step"] = status["step"] + 1
    (out / "status.json").write_text(json.dumps(status))
    return out


def write_sweep(root: Path, runs: list[dict], axes: dict | None = None) -> Path:
    """sweep.json as the sweep runner writes it: the grid (name, preset, base, axes) and
    every run with its axes and config hash."""
    root.mkdir(parents=True, exist_ok=True)
    grid = {"name": root.name, "preset": "smoke", "base": {}, "axes": axes or {}}
    runs = [{"config_hash": "h", "steps": STEPS[-1], "axes": {}, **r} for r in runs]
    (root / "sweep.json").write_text(json.dumps({"grid": grid, "runs": runs}))
    return root


def make_sweep(root: Path, values: Values, depths=(4,), inits=("normal", "orthogonal", "tied"),
               seeds=(0, 1), extra: Callable[[Path], list[dict]] | None = None,
               **kw) -> Path:
    """A full grid of synthetic runs, all following ``values``."""
    runs = []
    for depth in depths:
        for init in inits:
            for seed in seeds:
                rid = f"n_layer{depth}-qk_init-{init}-seed{seed}"
                write_run(root, rid, depth, init, seed, values, **kw)
                runs.append({"run_id": rid, "axes": {"model.n_layer": depth,
                                                     "model.qk_init": init, "seed": seed}})
    if extra:
        runs += extra(root)
    return write_sweep(root, runs, {"model.n_layer": list(depths), "model.qk_init": list(inits),
                                    "seed": list(seeds)})


def write_analysis(root: Path, metrics: pd.DataFrame, names: list[str], steps: list[int],
                   model: str = "tiny", step_source: str = "name") -> Path:
    """An E4 analysis folder as ``qkgeom analyze`` writes it: ``metrics`` (long rows with
    ``checkpoint``, ``step``, ``block``, ``in_trends``, ...), one checkpoint record per
    name (distinct Q/K weights, all in the trends) and ``analysis.json``."""
    root.mkdir(parents=True)
    metrics.to_parquet(root / "metrics.parquet", index=False)
    pd.DataFrame({"checkpoint": names, "step": steps, "arch": "gpt2", "n_head": 4,
                  "n_kv_head": 4, "seq_len": 64, "step_source": step_source, "tokens": 512,
                  "tokens_per_s": 1000.0, "duplicate_of": None, "qk_hash": "abcdef0123456789",
                  "in_trends": True}).to_parquet(root / "checkpoints.parquet", index=False)
    (root / "analysis.json").write_text(json.dumps({
        "model": model, "state": "done", "keep_duplicates": False,
        "settings": {"text": "sample", "max_tokens": 512, "qk_site": "pre-rotary",
                     "dtype": "float32"}}))
    return root


WIGGLE = 0.3  # PR_K's probe-to-probe changes vary, so E2.1/E2.2 can rank them


@pytest.fixture
def all_rise(tmp_path: Path) -> Path:
    """4 layers × 3 inits × 3 seeds (9 runs: the six primary rows, Holm-adjusted together,
    can reach 6/2^9 < 0.05): PR_Q rises and PR_K falls everywhere (12 trajectories), plus one
    diverged run whose (opposite) numbers must not count."""

    def diverged(root: Path) -> list[dict]:
        write_run(root, "n_layer4-qk_init-normal-seed9", 4, "normal", 9,
                  monotone_values(lambda layer: -1, WIGGLE), state="diverged")
        return [{"run_id": "n_layer4-qk_init-normal-seed9",
                 "axes": {"model.n_layer": 4, "model.qk_init": "normal", "seed": 9}}]

    return make_sweep(tmp_path / "all_rise", monotone_values(wiggle=WIGGLE),
                      seeds=(0, 1, 2), extra=diverged)


@pytest.fixture
def half_rise(tmp_path: Path) -> Path:
    """Same grid, PR_Q rises in layers 0–1 and falls in layers 2–3: 6 of 12 trajectories."""
    return make_sweep(tmp_path / "half_rise",
                      monotone_values(lambda layer: 1 if layer < 2 else -1, WIGGLE),
                      seeds=(0, 1, 2))
