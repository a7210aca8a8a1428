"""E1 sweep folders whose runs differ from one another (each has its own fluctuation), so
E2's cross-run null (protocol 2) has something to tell apart; on identical runs it takes
the whole within-run ρ, as it should."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from .conftest import Values, monotone_values, write_run, write_sweep


def with_pr_k_moved(values: Values, move: Callable[[int], float]) -> Values:
    """``values`` with PR_K moved by ``move(step)`` at both levels, and pr_qk, the entropy
    and the contrast moved with it as :func:`monotone_values` ties them (pr_qk = PR_K/2,
    entropy = 1 + pr_qk/10): within a run the changes of the three still agree."""

    def moved(layer: int, step: int, metric: str, head: int) -> float:
        d = move(step)
        v = values(layer, step, metric, head)
        if metric.startswith("pr_k_"):
            return v + d
        if metric.startswith("contrast_"):
            return v - d
        if metric.startswith("pr_qk_"):
            return v + d / 2
        if metric == "attn_entropy":
            return v + d / 20
        return v

    return moved


def own_fluctuation(values: Values, phase: float, size: float = 0.3) -> Values:
    """``values`` with PR_K (and what follows it) moved by ``size``·sin(1.3·step +
    ``phase``): across runs of other phases the fluctuations differ."""
    return with_pr_k_moved(values, lambda step: size * np.sin(1.3 * step + phase))


def distinct_sweep(root: Path, values: Values | None = None, depths=(4,),
                   inits=("normal", "orthogonal", "tied"), seeds=(0, 1), **kw) -> Path:
    """:func:`conftest.make_sweep`, each run with its own fluctuation (a phase per run)."""
    values = values or monotone_values(wiggle=0.3)
    runs = []
    for depth in depths:
        for i, init in enumerate(inits):
            for seed in seeds:
                rid = f"n_layer{depth}-qk_init-{init}-seed{seed}"
                write_run(root, rid, depth, init, seed,
                          own_fluctuation(values, 0.9 * seed + 2.3 * i + 0.4 * depth), **kw)
                runs.append({"run_id": rid, "axes": {"model.n_layer": depth,
                                                     "model.qk_init": init, "seed": seed}})
    return write_sweep(root, runs, {"model.n_layer": list(depths), "model.qk_init": list(inits),
                                    "seed": list(seeds)})
