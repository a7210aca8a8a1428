"""E3 paired effects: every controlled arm against its seed's ``none`` run (and its sham).

The runs of one pair group share init and data order, so every effect is a paired
difference within a seed, and the seed is the unit. Quantities are whole-model values
(the mean over layers, head −1) plus the validation loss; the windows (*early*, *whole*)
leave out step 0, where a pair is identical. Definitions: docs/report.md (E3).
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e3.arms import BASELINE, SHAM
from qkgeom.runs import read_log

EARLY_SHARE = 0.25
WINDOWS = ("early", "whole")

#: quantity (a metric of metrics.parquet, or val_loss of train_log.parquet) -> (level, label)
QUANTITIES: dict[str, tuple[str, str]] = {
    "attn_entropy_scalefree": ("token", "scale-free attention entropy (nats)"),
    "attn_entropy": ("token", "attention entropy (nats)"),
    "logit_std_row": ("token", "within-row logit scale"),
    "logit_std": ("token", "pooled logit scale (std of q·k·scale)"),
    "attn_entropy_norm": ("token", "normalised attention entropy"),
    "attn_max": ("token", "mean max attention weight"),
    "pr_qk_weight": ("weight", "pr_qk (QKᵀ interaction PR)"),
    "pr_qk_token": ("token", "pr_qk (QKᵀ interaction PR)"),
    "pr_k_weight": ("weight", "PR_K"), "pr_k_token": ("token", "PR_K"),
    "pr_q_weight": ("weight", "PR_Q"), "pr_q_token": ("token", "PR_Q"),
    "val_loss": ("—", "validation loss (nats/char)"),
}
#: The smallest effect of interest of each quantity with an equivalence test (nats):
#: docs/protocols.md#e3 gives the reason. Other quantities have none.
DELTA = {"attn_entropy_scalefree": 0.10, "attn_entropy": 0.10}
#: The control's flat records the manipulation check reads (per unit ``l{layer}`` or
#: ``l{layer}h{head}``): the dose, the bound share, and the PR it recorded (in sample on
#: Σ_ε; protocol 2 adds in sample without ε and out of sample).
_UNIT_RECORD = re.compile(
    r"^(ctl_dose|ctl_bound_share|ctl_pr|ctl_pr_raw|ctl_pr_oos)_(l\d+(?:h\d+)?)$")

#: Predicted sign of arm − baseline per (mode, quantity): the claims, plus the control's own
#: target (PR_K). Anything else (sham, expand, PR_Q, loss, logit scales) has no prediction.
PREDICTED: dict[tuple[str, str], int] = {
    (mode, q): sign
    for mode, sign in (("shrink", -1), ("hold", +1))
    for q in ("attn_entropy_scalefree", "attn_entropy", "pr_qk_weight", "pr_qk_token",
              "pr_k_weight", "pr_k_token")
}
SERIES_COLUMNS = ["run_id", "step", "quantity", "value"]
UNIT_COLUMNS = ["run_id", "step", "unit", "quantity", "value"]
#: Per-unit quantities the manipulation check reads.
UNIT_QUANTITIES = ("pr_k_token", "pr_k_weight", "pr_qk_token")


def e3_series(table: pd.DataFrame, members: pd.DataFrame) -> pd.DataFrame:
    """Whole-model values per run and step of the pair groups' runs: ``run_id, step,
    quantity, value`` (the quantities above and ``val_loss`` at eval steps)."""
    runs = set(members["run_id"])
    metrics = set(QUANTITIES) - {"val_loss"}
    mine = table[table["run_id"].isin(runs) & (table["head"] == -1)]
    sel = mine[mine["metric"].isin(metrics)]
    parts = [sel.groupby(["run_id", "step", "metric"])["value"].mean().reset_index()
             .rename(columns={"metric": "quantity"})]
    for r in members.itertuples():
        log = read_log(r.dir)
        if log is not None and "val_loss" in log:
            log = log[["step", "val_loss"]].dropna()
            parts.append(pd.DataFrame({"run_id": r.run_id, "step": log["step"].astype("int64"),
                                       "quantity": "val_loss", "value": log["val_loss"]}))
    return pd.concat(parts, ignore_index=True)[SERIES_COLUMNS]


def unit_series(table: pd.DataFrame, members: pd.DataFrame) -> pd.DataFrame:
    """Per run, step and control unit (``l{layer}``, or ``l{layer}h{head}`` for a run whose
    control scope is the head): the probe's ``pr_k_token``, ``pr_k_weight`` and
    ``pr_qk_token`` of that unit, and the control's per-unit records
    (``UNIT_COLUMNS``). The uncontrolled run of a group is given in the scope of its
    group's controlled runs (both, when they differ)."""
    mine = table[table["run_id"].isin(set(members["run_id"]))]
    controlled = members[members["mode"] != BASELINE]
    scopes = controlled.groupby("group")["scope"].agg(set).to_dict()
    run_scopes = {r.run_id: ({r.scope} if r.mode != BASELINE else scopes.get(r.group, set()))
                  for r in members.itertuples()}
    probe = mine[mine["metric"].isin(UNIT_QUANTITIES)]
    parts = []
    for scope, head_sel in (("layer", probe["head"] == -1), ("head", probe["head"] >= 0)):
        runs = [rid for rid, sc in run_scopes.items() if scope in sc]
        sel = probe[head_sel & probe["run_id"].isin(runs)]
        if sel.empty:
            continue
        unit = ("l" + sel["layer"].astype(str) if scope == "layer"
                else "l" + sel["layer"].astype(str) + "h" + sel["head"].astype(str))
        parts.append(pd.DataFrame({"run_id": sel["run_id"], "step": sel["step"], "unit": unit,
                                   "quantity": sel["metric"], "value": sel["value"]}))
    ctl = mine[mine["metric"].str.startswith("ctl_")]
    match = ctl["metric"].str.extract(_UNIT_RECORD)
    ok = match[0].notna()
    if ok.any():
        parts.append(pd.DataFrame({"run_id": ctl["run_id"][ok], "step": ctl["step"][ok],
                                   "unit": match[1][ok], "quantity": match[0][ok],
                                   "value": ctl["value"][ok]}))
    if not parts:
        return pd.DataFrame(columns=UNIT_COLUMNS)
    return pd.concat(parts, ignore_index=True)[UNIT_COLUMNS]


PAIR_COLUMNS = ["run_id", "base_run", "baseline", "group", "seed", "arm", "mode", "dose",
                "level", "scope", "scale"]


def pairs_of(members: pd.DataFrame) -> pd.DataFrame:
    """The comparisons of the pair groups: one row per controlled run and baseline, with
    ``run_id, base_run, baseline`` (``none``, or ``sham`` for arms other than the sham when
    the group has a sham of the same level and scale rule) and the arm's settings."""
    runs = members.to_dict("records")
    shams = {(r["group"], r["level"], r["scale"]): r["run_id"] for r in runs
             if r["mode"] == SHAM}
    rows = []
    for r in runs:
        if r["arm"] == BASELINE:
            continue
        rows.append({**r, "base_run": r["baseline"], "baseline": BASELINE})
        sham = shams.get((r["group"], r["level"], r["scale"]))
        if r["mode"] != SHAM and sham is not None:
            rows.append({**r, "base_run": sham, "baseline": SHAM})
    return pd.DataFrame(rows, columns=PAIR_COLUMNS)


_ARM_KEYS = ["group", "seed", "arm", "mode", "dose", "level", "scope", "scale", "baseline"]


def paired_differences(series: pd.DataFrame, members: pd.DataFrame) -> pd.DataFrame:
    """``group, seed, arm, mode, dose, level, scope, scale, baseline, step, quantity,
    arm_value, base_value, diff``: every controlled run minus its group's ``none`` run
    (baseline ``none``) and, for arms other than the sham, minus the group's sham of the
    same level and scale rule (baseline ``sham``), at every step and quantity both have."""
    cols = [*_ARM_KEYS, "step", "quantity", "arm_value", "base_value", "diff"]
    data = series[series["quantity"].isin(set(QUANTITIES))]
    pairs = pairs_of(members)
    if pairs.empty or data.empty:
        return pd.DataFrame(columns=cols)
    arm = data.rename(columns={"value": "arm_value"})
    base = data.rename(columns={"run_id": "base_run", "value": "base_value"})
    out = pairs.merge(arm, on="run_id").merge(base, on=["base_run", "step", "quantity"])
    out["diff"] = out["arm_value"] - out["base_value"]
    return out[cols].sort_values(["arm", "baseline", "quantity", "seed", "step"]) \
        .reset_index(drop=True)


SHARES = {"early": EARLY_SHARE, "whole": 1.0}


def in_windows(frame: pd.DataFrame, steps: dict[int, int]) -> pd.DataFrame:
    """The rows of ``frame`` (with ``group`` and ``step``) inside each window, labelled
    ``window``: early = 0 < step ≤ 25 % of the group's run, whole = 0 < step ≤ its run
    (``steps``: each group's run length). A row of the early window is in the whole too."""
    run_len = frame["group"].map(steps).astype(float)
    parts = [frame[(frame["step"] > 0) & (frame["step"] <= share * run_len)]
             .assign(window=window) for window, share in SHARES.items()]
    return pd.concat(parts, ignore_index=True)


def window_means(diffs: pd.DataFrame, steps: dict[int, int]) -> pd.DataFrame:
    """Each seed's mean paired difference per window: the arm keys, ``quantity, window,
    mean_diff, rel_diff, n_points, first_step, last_step`` (``rel_diff`` = mean of
    diff / baseline value). ``steps``: each group's run length."""
    keys = [*_ARM_KEYS, "quantity", "window"]
    cols = [*keys, "mean_diff", "rel_diff", "n_points", "first_step", "last_step"]
    if diffs.empty:
        return pd.DataFrame(columns=cols)
    sel = in_windows(diffs, steps)
    sel["rel"] = sel["diff"] / sel["base_value"].where(sel["base_value"] != 0)
    g = sel.groupby(keys, sort=True)
    agg = pd.DataFrame({"mean_diff": g["diff"].mean(), "rel_diff": g["rel"].mean(),
                        "n_points": g["diff"].size(), "first_step": g["step"].min(),
                        "last_step": g["step"].max()}).reset_index()
    return agg[cols]


EFFECT_COLUMNS = ["arm", "baseline", "quantity", "window", "mode", "dose", "level", "scale",
                  "n_seeds", "k", "share", "mean", "ci_low", "ci_high", "sd", "rel_mean",
                  "predicted", "p_value", "p_opposite", "p_sign", "delta", "p_equiv",
                  "detectable", "first_step", "last_step"]


def effects(windows: pd.DataFrame) -> pd.DataFrame:
    """Per ``arm, baseline, quantity, window``: the arm's settings, the seeds' test
    (:func:`qkgeom.analysis.stats.unit_test`: ``n_seeds, k, share, mean``, t-interval,
    sign-flip and sign-test p's, TOST within ±``delta`` where one is declared,
    ``detectable``), ``rel_mean``, ``predicted`` (+1/−1/0 = none) and the steps."""
    rows = []
    keys = ["arm", "baseline", "quantity", "window"]
    for (arm, baseline, quantity, window), g in windows.groupby(keys, sort=True):
        first = g.iloc[0]
        sign = PREDICTED.get((str(first["mode"]), quantity), 0)
        delta = DELTA.get(quantity)
        u = stats.unit_test(g["mean_diff"], sign, delta)
        rows.append({**u, "arm": arm, "baseline": baseline, "quantity": quantity,
                     "window": window, "mode": str(first["mode"]),
                     "dose": float(first["dose"]), "level": str(first["level"]),
                     "scale": str(first["scale"]), "n_seeds": u["n"],
                     "rel_mean": float(g["rel_diff"].mean()), "predicted": sign,
                     "delta": np.nan if delta is None else delta,
                     "first_step": int(g["first_step"].min()),
                     "last_step": int(g["last_step"].max())})
    return pd.DataFrame(rows, columns=EFFECT_COLUMNS)


def window_label(first: float, last: float, window: str) -> str:
    """``first 25 % (steps 10–20)`` / ``whole run (steps 10–100)``."""
    name = "first 25 %" if window == "early" else "whole run"
    if not (np.isfinite(first) and np.isfinite(last)):
        return name
    lo, hi = int(first), int(last)
    return f"{name} (step {lo})" if lo == hi else f"{name} (steps {lo}–{hi})"
