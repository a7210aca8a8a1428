"""E3, the causal experiment: paired effects of key-spectrum control, and claims.

For each seed the runs ``key_control`` ∈ {none, hold, shrink} share init and data order, so
every effect is a **paired difference** ``controlled − none`` within a seed. The unit of
analysis is the seed (5 in the paper's protocol): whole-model quantities are the mean over
layers of each layer's value (head −1), so one number per (seed, mode, step).

Quantities (``QUANTITIES``): attention entropy (and its normalised form and the mean max
weight), the interaction PR ``pr_qk`` and PR_Q / PR_K at the weight and token levels, and the
validation loss (from ``train_log.parquet``, at eval steps) — a control that buys sharper
attention by wrecking the loss must show it.

Windows: the **early** phase is the probes with 0 < step ≤ 25 % of the run's steps, the
**whole** run the probes with 0 < step ≤ steps (step 0 is left out: before the first
update every pair is identical, so its difference is 0 by construction). A seed's effect in
a window is the plain mean of its paired differences at those probes (probes are evenly
spaced).

Directional confidence per mode × quantity × window: the share of seeds with the predicted
sign, the exact one-sided sign-test p (``qkgeom.analysis.stats.count_test``), and the seed-bootstrap
95 % CI of the mean paired difference (percentile interval, ``N_BOOT`` resamples of the seeds,
fixed RNG seed). Quantities with no prediction get the share of seeds with Δ > 0 and a
two-sided sign-test p, and no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import runs_of
from qkgeom.analysis.kit import CLAIM_COLUMNS, TEST_SIGN, signed

BASELINE = "none"
EARLY_SHARE = 0.25
WINDOWS = ("early", "whole")

# quantity -> (metric in metrics.parquet, or "val_loss"; level; label)
QUANTITIES: dict[str, tuple[str, str, str]] = {
    "attn_entropy": ("attn_entropy", "token", "attention entropy (nats)"),
    "attn_entropy_norm": ("attn_entropy_norm", "token", "normalised attention entropy"),
    "attn_max": ("attn_max", "token", "mean max attention weight"),
    "pr_qk_weight": ("pr_qk_weight", "weight", "pr_qk (QKᵀ interaction PR)"),
    "pr_qk_token": ("pr_qk_token", "token", "pr_qk (QKᵀ interaction PR)"),
    "pr_k_weight": ("pr_k_weight", "weight", "PR_K"),
    "pr_k_token": ("pr_k_token", "token", "PR_K"),
    "pr_q_weight": ("pr_q_weight", "weight", "PR_Q"),
    "pr_q_token": ("pr_q_token", "token", "PR_Q"),
    "val_loss": ("val_loss", "—", "validation loss (nats/char)"),
}


@dataclass(frozen=True)
class E3Claim:
    """A predicted sign of the paired difference (mode − none) of some quantities."""

    id: str
    text: str
    mode: str
    quantities: tuple[str, ...]
    sign: int


E3_CLAIMS = (
    E3Claim("E3.1", "Forcing the key spectrum to shrink sharpens attention", "shrink",
            ("attn_entropy",), -1),
    E3Claim("E3.2", "Holding the key spectrum at its initial dispersion softens attention",
            "hold", ("attn_entropy",), +1),
    E3Claim("E3.3", "Shrinking the key spectrum narrows the QKᵀ spectrum", "shrink",
            ("pr_qk_weight", "pr_qk_token"), -1),
    E3Claim("E3.4", "Holding the key spectrum keeps the QKᵀ spectrum wider", "hold",
            ("pr_qk_weight", "pr_qk_token"), +1),
)
# Predicted signs of the effects table (claims above, plus the control's own target).
PREDICTED: dict[tuple[str, str], int] = {
    **{(c.mode, q): c.sign for c in E3_CLAIMS for q in c.quantities},
    ("shrink", "pr_k_weight"): -1,
}


def run_modes(table: pd.DataFrame) -> pd.DataFrame:
    """``run_id, seed, mode, steps, dir`` of the analysed (not excluded) runs."""
    runs = runs_of(table)
    if not runs.empty:
        runs = runs[runs["excluded"] == ""].copy()
    if runs.empty:  # e.g. a report while a sweep's first runs have not started
        return pd.DataFrame(columns=["run_id", "seed", "mode", "steps", "dir"])
    mode = runs["key_control"] if "key_control" in runs else pd.Series("none", index=runs.index)
    runs["mode"] = mode.fillna("none").astype(str)
    return runs[["run_id", "seed", "mode", "steps", "dir"]].reset_index(drop=True)


def is_e3(table: pd.DataFrame) -> bool:
    """True when the analysed runs include uncontrolled and controlled runs of one seed."""
    modes = run_modes(table)
    if modes.empty or BASELINE not in set(modes["mode"]):
        return False
    paired = modes.groupby("seed")["mode"].agg(lambda m: BASELINE in set(m) and len(set(m)) > 1)
    return bool(paired.any())


def e3_series(table: pd.DataFrame) -> pd.DataFrame:
    """Whole-model quantities per run and step: ``run_id, seed, mode, step, quantity,
    value`` (layer mean of each layer's head −1 value; ``val_loss`` at eval steps)."""
    modes = run_modes(table)
    metrics = {m for m, _, _ in QUANTITIES.values() if m != "val_loss"}
    sel = table[(table["head"] == -1) & table["metric"].isin(metrics)]
    per = (sel.groupby(["run_id", "step", "metric"])["value"].mean().reset_index()
           .rename(columns={"metric": "quantity"}))
    logs = []
    for r in modes.itertuples():
        path = Path(r.dir) / "train_log.parquet"
        if path.exists():
            log = pd.read_parquet(path, columns=["step", "val_loss"]).dropna()
            logs.append(pd.DataFrame({"run_id": r.run_id, "step": log["step"].astype("int64"),
                                      "quantity": "val_loss", "value": log["val_loss"]}))
    series = pd.concat([per, *logs], ignore_index=True)
    series = series.merge(modes[["run_id", "seed", "mode"]], on="run_id")
    return series[["run_id", "seed", "mode", "step", "quantity", "value"]]


def paired_differences(series: pd.DataFrame) -> pd.DataFrame:
    """``seed, mode, step, quantity, controlled, none, diff`` (diff = controlled − none),
    for every controlled run with an uncontrolled partner of the same seed at that step."""
    base = series[series["mode"] == BASELINE][["seed", "step", "quantity", "value"]]
    ctl = series[series["mode"] != BASELINE]
    out = ctl.merge(base, on=["seed", "step", "quantity"], suffixes=("", "_none"))
    out = out.rename(columns={"value": "controlled", "value_none": "none"})
    out["diff"] = out["controlled"] - out["none"]
    return out[["seed", "mode", "step", "quantity", "controlled", "none", "diff"]] \
        .sort_values(["mode", "quantity", "seed", "step"]).reset_index(drop=True)


def window_means(diffs: pd.DataFrame, steps: int) -> pd.DataFrame:
    """Each seed's mean paired difference per window: ``seed, mode, quantity, window,
    mean_diff, rel_diff, n_points, first_step, last_step`` (``rel_diff`` = mean of
    diff / none)."""
    rows = []
    bounds = {"early": EARLY_SHARE * steps, "whole": steps}
    for window, hi in bounds.items():
        sel = diffs[(diffs["step"] > 0) & (diffs["step"] <= hi)]
        if sel.empty:
            continue
        rel = sel["diff"] / sel["none"].where(sel["none"] != 0)
        g = sel.assign(rel=rel).groupby(["seed", "mode", "quantity"])
        agg = g.agg(mean_diff=("diff", "mean"), rel_diff=("rel", "mean"),
                    n_points=("diff", "size"), first_step=("step", "min"),
                    last_step=("step", "max")).reset_index()
        agg["window"] = window
        rows.append(agg)
    cols = ["seed", "mode", "quantity", "window", "mean_diff", "rel_diff", "n_points",
            "first_step", "last_step"]
    return pd.concat(rows, ignore_index=True)[cols] if rows else pd.DataFrame(columns=cols)


def seed_bootstrap(values: np.ndarray, n_boot: int = stats.N_BOOT,
                   rng_seed: int = stats.BOOT_SEED, ci: float = 0.95) -> tuple[float, float]:
    """Percentile CI of the mean of ``values`` (one per seed) over seed resamples; NaN with
    fewer than 2 finite values (nothing to resample)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) < 2:
        return np.nan, np.nan
    rng = np.random.default_rng(rng_seed)
    means = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(axis=1)
    return (float(np.percentile(means, 100 * (1 - ci) / 2)),
            float(np.percentile(means, 100 * (1 + ci) / 2)))


def effects(windows: pd.DataFrame, n_boot: int = stats.N_BOOT,
            rng_seed: int = stats.BOOT_SEED) -> pd.DataFrame:
    """Directional confidence per ``mode, quantity, window``: ``n_seeds, mean, ci_low,
    ci_high, rel_mean, predicted`` (+1/−1/0 = none), ``k`` seeds with the predicted sign
    (with Δ > 0 when there is no prediction), ``share``, ``p_value`` (one-sided sign test;
    two-sided when there is no prediction), ``first_step, last_step``."""
    rows = []
    for (mode, quantity, window), g in windows.groupby(["mode", "quantity", "window"], sort=True):
        v = g["mean_diff"].to_numpy(dtype=float)
        sign = PREDICTED.get((mode, quantity), 0)
        ct = stats.count_test(v, sign or 1)
        p = ct["p_value"]
        if sign == 0:  # no prediction: two-sided, the larger side doubled
            other = stats.count_test(v, -1)
            p = min(1.0, 2 * min(ct["p_value"], other["p_value"]))
        lo, hi = seed_bootstrap(v, n_boot, rng_seed)
        rows.append({"mode": mode, "quantity": quantity, "window": window,
                     "n_seeds": ct["n"], "mean": float(np.nanmean(v)) if len(v) else np.nan,
                     "ci_low": lo, "ci_high": hi,
                     "rel_mean": float(g["rel_diff"].mean()), "predicted": sign,
                     "k": ct["k"], "share": ct["share"], "p_value": p,
                     "first_step": int(g["first_step"].min()),
                     "last_step": int(g["last_step"].max())})
    return pd.DataFrame(rows)


def _window_label(eff: pd.DataFrame, window: str) -> str:
    name = "first 25 %" if window == "early" else "whole run"
    if eff.empty:
        return name
    lo, hi = int(eff["first_step"].min()), int(eff["last_step"].max())
    return f"{name} (step {lo})" if lo == hi else f"{name} (steps {lo}–{hi})"


def evaluate_e3_claims(eff: pd.DataFrame) -> pd.DataFrame:
    """The E3 rows of the claims table, in the columns of the E1/E2 table
    (:data:`qkgeom.analysis.kit.CLAIM_COLUMNS`): one row per claim × quantity × window;
    ``k`` of ``n`` seeds show the predicted sign; ``verdict`` is
    :func:`qkgeom.analysis.stats.verdict`."""
    rows = []
    for claim in E3_CLAIMS:
        for quantity in claim.quantities:
            for window in WINDOWS:
                sel = eff[(eff["mode"] == claim.mode) & (eff["quantity"] == quantity)
                          & (eff["window"] == window)] if not eff.empty else eff
                r = sel.iloc[0] if len(sel) else None
                k, n = (int(r["k"]), int(r["n_seeds"])) if r is not None else (0, 0)
                p = float(r["p_value"]) if r is not None else np.nan
                mean, lo, hi = ((float(r["mean"]), float(r["ci_low"]), float(r["ci_high"]))
                                if r is not None else (np.nan, np.nan, np.nan))
                rel = f"Δ {'<' if claim.sign < 0 else '>'} 0"
                estimate = f"mean Δ {signed(mean)}"
                if np.isfinite(lo):
                    estimate += f" [{signed(lo)}, {signed(hi)}]"
                rows.append({
                    "claim_id": claim.id, "claim": claim.text, "level": QUANTITIES[quantity][1],
                    "origin": window, "from": _window_label(sel, window),
                    "criterion": f"{claim.mode} − none: {QUANTITIES[quantity][2]} {rel} "
                                 "(seed's mean paired difference over the window)",
                    "k": k, "n": n, "share": k / n if n else np.nan,
                    "measured": f"{k}/{n} seeds ({rel})", "mean": mean, "ci_low": lo,
                    "ci_high": hi, "estimate": estimate, "test": TEST_SIGN, "p_value": p,
                    "verdict": stats.verdict(k, n, p),
                })
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def e3_analysis(table: pd.DataFrame, n_boot: int = stats.N_BOOT,
                rng_seed: int = stats.BOOT_SEED) -> dict[str, pd.DataFrame]:
    """Everything the E3 report shows: ``series``, ``paired``, ``windows``, ``effects``,
    ``claims`` (see the functions above). The run length is the longest analysed run's."""
    series = e3_series(table)
    paired = paired_differences(series)
    modes = run_modes(table)
    steps = int(modes["steps"].max()) if len(modes) else 0
    windows = window_means(paired, steps)
    eff = effects(windows, n_boot, rng_seed)
    return {"series": series, "paired": paired, "windows": windows, "effects": eff,
            "claims": evaluate_e3_claims(eff)}
