"""Synthetic stability runs (tables in memory, or written as a sweep folder) with a planted
remedy effect or none: what the stability analysis reads, without training."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis.stability.outcomes import StabilityRuns, stability_runs
from qkgeom.runs import FORMAT_VERSION

PROBES = np.arange(0, 101, 5)
EVALS = np.arange(0, 101, 10)
STABLE, HIGH = 3e-3, 3e-2
LEFT_OUT = pd.DataFrame(columns=["run_id", "state", "reason"])


def trajectory(collapse_at: float | None, rng: np.random.Generator,
               scale: float = 1.0) -> dict[str, np.ndarray]:
    """Layer-level metrics of 2 layers at PROBES: healthy (entropy ~2 nats, max logit ~20
    × ``scale``), or collapsing from step ``collapse_at`` (entropy to 0.02, attention
    one-hot, max logit to 1 000 × ``scale``, a jump of the logits)."""
    t = PROBES[None, :].astype(float)
    ent = 3.2 - 1.2 * (1 - np.exp(-t / 20)) + rng.normal(0, 0.05, (2, len(PROBES)))
    peak = 0.05 + 0.25 * (1 - np.exp(-t / 20)) + rng.uniform(0, 0.02, (2, len(PROBES)))
    top = 0.3 + 20 * (1 - np.exp(-t / 20)) + rng.normal(0, 1, (2, len(PROBES))) ** 2
    if collapse_at is not None:
        on = 1 / (1 + np.exp(-(t - collapse_at) / 2))  # 0 before, 1 after
        ent = ent * (1 - on) + 0.02 * on
        peak = peak * (1 - on) + 0.99 * on
        top = top * (1 - on) + 1000 * on
    top = top * scale
    delta = np.abs(np.diff(top, axis=1, prepend=top[:, :1])) / 10  # a change of the logits
    return {"attn_entropy": ent, "attn_entropy_norm": ent / 3.2, "attn_max": peak,
            "logit_max": top, "logit_delta": delta, "logit_bound": 1.5 * top}


def synthetic(seeds: int, planted: bool, seed: int = 0, lrs: Sequence[float] = (STABLE, HIGH),
              arms: Sequence[str] = ("none", "fix"), sizes: Sequence[str] = ("model",),
              scales: Sequence[float] | None = None, warmup: int = 0) -> StabilityRuns:
    """Sizes × seeds × ``lrs`` × ``arms``. Above the stable lr ``none`` collapses at step
    ~20 and its val loss departs by 0.3 nats; the other arms collapse too unless
    ``planted``. At and below the stable lr every run is healthy and the losses differ by
    noise only. ``scales``: each size's logit scale; ``warmup``: every run's LR warm-up."""
    rng = np.random.default_rng(seed)
    runs = []
    lay: dict[str, list] = {k: [] for k in ("run_id", "step", "layer", "metric", "value")}
    val: dict[str, list] = {k: [] for k in ("run_id", "step", "val_loss")}
    n = len(PROBES)
    for size, scale in zip(sizes, scales or [1.0] * len(sizes), strict=True):
        for s in range(seeds):
            base_loss = 2.5 + rng.normal(0, 0.02)
            for lr in lrs:
                for arm in arms:
                    collapses = lr > STABLE and (arm == "none" or not planted)
                    rid = f"size={size},lr={lr},seed={s},arm={arm}"
                    at = 20.0 + rng.normal(0, 1) if collapses else None
                    for metric, a in trajectory(at, rng, scale).items():
                        first = 1 if metric == "logit_delta" else 0  # from the 2nd probe
                        k = 2 * (n - first)
                        lay["run_id"] += [rid] * k
                        lay["metric"] += [metric] * k
                        lay["step"].append(np.tile(PROBES[first:], 2))
                        lay["layer"].append(np.repeat([0, 1], n - first))
                        lay["value"].append(a[:, first:].ravel())
                    loss = base_loss + 3.5 * np.exp(-EVALS / 10) + rng.normal(0, 0.005,
                                                                             len(EVALS))
                    if collapses:
                        loss = loss + 0.3 / (1 + np.exp(-(EVALS - 30) / 3))
                    val["run_id"] += [rid] * len(EVALS)
                    val["step"].append(EVALS)
                    val["val_loss"].append(loss)
                    runs.append({"run_id": rid, "arm": arm, "size": size, "lr": lr, "seed": s,
                                 "state": "done", "steps": 100, "diverged_step": np.nan,
                                 "warmup": warmup})
    layers = pd.DataFrame({k: v if k in ("run_id", "metric") else np.concatenate(v)
                           for k, v in lay.items()})
    vals = pd.DataFrame({k: v if k == "run_id" else np.concatenate(v) for k, v in val.items()})
    return stability_runs(pd.DataFrame(runs), layers, vals, LEFT_OUT.copy(), "synthetic")


def write_frame_run(folder: Path, run_id: str, config: dict, layers: pd.DataFrame,
              val: pd.DataFrame, state: str = "done", **record: object) -> None:
    """One run folder as the trainer (or a monitor) leaves it: config.json, status.json,
    metrics.parquet, train_log.parquet."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(
        {"run_id": run_id, "config": config, "format_version": FORMAT_VERSION, **record}))
    steps = int(config["steps"])
    (folder / "status.json").write_text(json.dumps(
        {"state": state, "step": steps, "steps": steps, "started": 0.0, "updated": 1.0,
         "wall_s": 12.5}))
    m = layers.assign(head=-1, run_id=run_id)[["run_id", "step", "layer", "head", "metric",
                                               "value"]]
    m.astype({"step": "int64", "layer": "int64", "head": "int64"}).to_parquet(
        folder / "metrics.parquet", index=False)
    log = val.assign(loss=val["val_loss"], lr=1e-3, tokens_per_s=1.0)[
        ["step", "loss", "val_loss", "lr", "tokens_per_s"]]
    log.astype({"step": "int64"}).to_parquet(folder / "train_log.parquet", index=False)


def write_stability_sweep(out: Path, stab: StabilityRuns, name: str,
                shapes: dict[str, tuple[int, int, int]] | None = None) -> Path:
    """``stab`` as a stability sweep folder called ``name`` (sweep.json naming each run's
    size, lr, seed and arm); ``shapes``: size -> (n_layer, n_embd, block_size)."""
    out.mkdir(parents=True)
    entries = []
    for r in stab.runs.itertuples():
        n_layer, n_embd, block = (shapes or {}).get(r.size, (2, 32, 32))
        config = {"model": {"n_layer": n_layer, "n_head": 2, "n_embd": n_embd,
                            "block_size": block}, "lr": float(r.lr), "seed": int(r.seed),
                  "steps": int(r.steps), "warmup_steps": int(r.warmup), "batch_size": 8}
        write_frame_run(out / "runs" / r.run_id, r.run_id, config,
                  stab.layers[stab.layers["run_id"] == r.run_id].drop(columns="run_id"),
                  stab.val[stab.val["run_id"] == r.run_id].drop(columns="run_id"), r.state)
        entries.append({"run_id": r.run_id, "axes": {"size": r.size, "lr": float(r.lr),
                                                     "seed": int(r.seed), "arm": r.arm},
                        "steps": int(r.steps)})
    grid = {"name": name, "preset": "smoke", "experiment": "stability", "base": {},
            "axes": {"lr": sorted(set(stab.runs["lr"])), "seed": sorted(set(stab.runs["seed"]))}}
    (out / "sweep.json").write_text(json.dumps({"grid": grid, "runs": entries}))
    return out


def write_trial_runs(out: Path, stab: StabilityRuns, warmup_in: str = "trial") -> Path:
    """``stab``'s runs as Hugging Face trial runs of the monitor: each size a family,
    ``trial`` in config.json beside a config of the model and steps (no sweep.json); each
    run's warm-up as ``trial.warmup_steps`` or (``warmup_in="config"``) as the config's
    ``warmup_steps``."""
    for r in stab.runs.itertuples():
        config = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
                  "steps": int(r.steps),
                  **({"warmup_steps": int(r.warmup)} if warmup_in == "config" else {})}
        trial = {"family": r.size, "lr": float(r.lr), "seed": int(r.seed),
                 "steps": int(r.steps),
                 **({"warmup_steps": int(r.warmup)} if warmup_in == "trial" else {})}
        write_frame_run(out / "runs" / f"{r.size}-lr{r.lr:g}-s{r.seed}", r.run_id, config,
                  stab.layers[stab.layers["run_id"] == r.run_id].drop(columns="run_id"),
                  stab.val[stab.val["run_id"] == r.run_id].drop(columns="run_id"), r.state,
                  source="qkgeom.monitor", trial=trial)
    return out
