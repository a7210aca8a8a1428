"""Collated tables built in memory (no files): many synthetic sweeps per second, for the
planted-effect and null simulations that go through the real E1 and E3 statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qkgeom.analysis.collate import COLUMNS, Collated


@dataclass
class Run:
    """One synthetic run: its identity and config facts as ``collate`` records them, and
    its metrics as arrays over (layer, step) (layer rows) and (layer, head, step) (heads).
    Runs with equal ``pair_key`` (default: the run's id) pair in E3."""

    run_id: str
    seed: int
    layers: dict[str, np.ndarray]  # metric -> (L, T)
    heads: dict[str, np.ndarray] = field(default_factory=dict)  # metric -> (L, H, T)
    depth: int = 2
    qk_init: str = "normal"
    variant: str = ""
    control: dict[str, Any] = field(default_factory=dict)
    pair_key: str = ""
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # flat record -> (T,)


def _blocks(run: Run, t: np.ndarray):
    """(metric, layer, head, step, value) arrays of every record of one run."""
    for metric, a in run.layers.items():
        n_layers = a.shape[0]
        yield (metric, np.repeat(np.arange(n_layers), len(t)), np.full(a.size, -1),
               np.tile(t, n_layers), a.ravel())
    for metric, a in run.heads.items():
        n_layers, n_heads, _ = a.shape
        yield (metric, np.repeat(np.arange(n_layers), n_heads * len(t)),
               np.tile(np.repeat(np.arange(n_heads), len(t)), n_layers),
               np.tile(t, n_layers * n_heads), a.ravel())
    for metric, a in run.extra.items():
        yield metric, np.full(len(t), -1), np.full(len(t), -1), t, np.asarray(a, dtype=float)


def table_of(runs: list[Run], steps: list[int], ref_step: int) -> Collated:
    """What :func:`qkgeom.analysis.collate` would return for these runs, all finished,
    ``steps[-1]`` steps long."""
    t = np.asarray(steps)
    cols: dict[str, list] = {c: [] for c in COLUMNS}
    records = []
    for run in runs:
        for metric, layer, head, step, value in _blocks(run, t):
            n = len(value)
            for name, v in (("run_id", run.run_id), ("depth", run.depth),
                            ("qk_init", run.qk_init), ("variant", run.variant),
                            ("seed", run.seed),
                            ("state", "done"), ("metric", metric)):
                cols[name].append(np.full(n, v, dtype=object if isinstance(v, str) else int))
            for name, v in (("step", step), ("layer", layer), ("head", head),
                            ("value", value)):
                cols[name].append(v)
        config = {"seed": run.seed, "pair": run.pair_key or run.run_id,
                  **{f"key_control.{k}": v for k, v in run.control.items()}}
        records.append({"run_id": run.run_id, "dir": f"/nonexistent/{run.run_id}",
                        "depth": run.depth, "qk_init": run.qk_init, "variant": run.variant,
                        "seed": run.seed, "state": "done", "steps": int(t[-1]),
                        "ref_step": ref_step, "config": config, "excluded": ""})
    table = pd.DataFrame({c: np.concatenate(v) for c, v in cols.items()})
    return Collated(table, pd.DataFrame(records), {}, "synthetic", Path("synthetic"))
