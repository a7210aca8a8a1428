"""The E3 manipulation check: did the key control change PR_K as intended, where attention
sees it (the token-level PR_K), in every seed and every unit it controls?

An intervention's claims are read only once it is shown to have happened: a gated arm
(shrink, hold) whose check fails in some seed and unit, or cannot be made, is *not
evaluated* in that window. The rule (achieved vs intended ratio, halfway on the log scale,
units within :data:`EXEMPT` of 1 exempt) and why: docs/protocols.md#the-manipulation-check;
protocol 1's gate (halfway on the plain ratio) is kept beside it (``*_p1``), and the
control's own records beside the probe's: docs/protocols.md#the-manipulation-record.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis.e3.arms import BASELINE
from qkgeom.analysis.e3.paired import UNIT_QUANTITIES, in_windows, pairs_of

GATED = ("shrink", "hold")
EXEMPT = 0.05  # |intended − 1| below this: no change to check
KEYS = ["group", "seed", "arm", "mode", "dose", "level", "scope", "scale"]
#: The control's per-unit PR records (protocol 2 adds the raw and out-of-sample ones) and
#: the column of their ratio to the none run's probe PR_K: docs/protocols.md#the-manipulation-record.
CONTROL_RECORDS = {"ctl_pr": "ctl_ratio", "ctl_pr_raw": "ctl_raw_ratio",
                   "ctl_pr_oos": "ctl_oos_ratio"}
RECORD_RATIOS = tuple(CONTROL_RECORDS.values())
COLUMNS = [*KEYS, "window", "unit", "n_probes", "achieved", "achieved_weight", "qk_ratio",
           "intended", *RECORD_RATIOS, "log_share", "threshold", "passed", "threshold_p1",
           "passed_p1", "bound_share"]
SUMMARY_COLUMNS = [*KEYS, "window", "units", "checked", "units_passed", "units_passed_p1",
                   "achieved", "achieved_weight", "qk_ratio", "intended", *RECORD_RATIOS,
                   "log_share", "bound_share", "passed", "passed_p1"]
#: The gate's column per protocol: 2 (log scale, decides) and 1 (plain ratio, beside).
GATE_COLUMN = {2: "passed", 1: "passed_p1"}


def log_share(achieved: np.ndarray | pd.Series, intended: np.ndarray | pd.Series
              ) -> np.ndarray:
    """ln achieved ÷ ln intended: the share of the intended log change achieved (1 on
    target, 0.5 halfway, negative the wrong way); NaN where intended is 1 or either is not
    positive."""
    a = np.asarray(achieved, dtype=float)
    i = np.asarray(intended, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.log(a) / np.log(i)
    return np.where(np.isfinite(out), out, np.nan)


def gate(achieved: np.ndarray | pd.Series, intended: np.ndarray | pd.Series,
         protocol: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """``(threshold, passed)`` of the manipulation check: halfway on the log scale, √intended
    (protocol 2: |ln achieved| ≥ ½|ln intended| in the intended direction), or on the plain
    ratio, (1 + intended)/2 (protocol 1); passed = achieved ≤ threshold below 1, ≥ above
    (exactly halfway passes)."""
    a = np.asarray(achieved, dtype=float)
    i = np.asarray(intended, dtype=float)
    with np.errstate(invalid="ignore"):
        threshold = np.sqrt(i) if protocol == 2 else (1.0 + i) / 2.0
    return threshold, np.where(i < 1, a <= threshold, a >= threshold)


def manipulation_units(units: pd.DataFrame, members: pd.DataFrame,
                       steps: dict[int, int]) -> pd.DataFrame:
    """One row per controlled run, window and unit (columns :data:`COLUMNS`) from the
    per-unit series (:func:`~qkgeom.analysis.e3.paired.unit_series`); ``passed`` is
    True/False for a checked unit of a shrink or hold run, else None."""
    pairs = pairs_of(members)
    pairs = pairs[pairs["baseline"] == BASELINE]
    if pairs.empty or units.empty:
        return pd.DataFrame(columns=COLUMNS)
    wide = units.pivot_table(index=["run_id", "step", "unit"], columns="quantity",
                             values="value", aggfunc="mean")
    wide = wide.reindex(columns=[*UNIT_QUANTITIES, "ctl_dose", "ctl_bound_share",
                                 *CONTROL_RECORDS]).reset_index()
    wide.columns.name = None
    arm = pairs[["run_id", "base_run", *KEYS]].merge(wide, on="run_id")
    base = wide[["run_id", "step", "unit", *UNIT_QUANTITIES]].rename(
        columns={"run_id": "base_run", **{q: f"{q}_base" for q in UNIT_QUANTITIES}})
    frame = arm.merge(base, on=["base_run", "step", "unit"])
    frame = frame[frame["pr_k_token"].notna()]
    if frame.empty:
        return pd.DataFrame(columns=COLUMNS)
    start = frame.loc[frame["step"] == 0, ["run_id", "unit", "pr_k_token"]].rename(
        columns={"pr_k_token": "start"})
    frame = frame.merge(start, on=["run_id", "unit"], how="left")
    # one denominator for every ratio: the none run's probe PR_K of the unit at the step
    frame = frame.assign(
        ratio=frame["pr_k_token"] / frame["pr_k_token_base"],
        ratio_w=frame["pr_k_weight"] / frame["pr_k_weight_base"],
        ratio_qk=frame["pr_qk_token"] / frame["pr_qk_token_base"],
        hold=frame["start"] / frame["pr_k_token_base"],
        **{col: frame[rec] / frame["pr_k_token_base"] for rec, col in CONTROL_RECORDS.items()})
    g = in_windows(frame, steps).groupby(["run_id", *KEYS, "window", "unit"], sort=True,
                                         dropna=False)
    out = pd.DataFrame({"n_probes": g["ratio"].count(), "achieved": g["ratio"].mean(),
                        "achieved_weight": g["ratio_w"].mean(),
                        "qk_ratio": g["ratio_qk"].mean(), "hold": g["hold"].mean(),
                        "ctl_dose": g["ctl_dose"].mean(),
                        **{col: g[col].mean() for col in RECORD_RATIOS},
                        "bound_share": g["ctl_bound_share"].mean()}).reset_index()
    dose = out["ctl_dose"].where(out["ctl_dose"].notna(), out["dose"])
    out["intended"] = np.select([out["mode"] == "hold", out["mode"].isin(["shrink", "expand"])],
                                [out["hold"], dose], 1.0)
    out["log_share"] = log_share(out["achieved"], out["intended"])
    checked = (out["mode"].isin(GATED) & np.isfinite(out["intended"])
               & (out["n_probes"] > 0) & ((out["intended"] - 1).abs() >= EXEMPT))
    for protocol, col in GATE_COLUMN.items():
        threshold, ok = gate(out["achieved"], out["intended"], protocol)
        out[col.replace("passed", "threshold")] = np.where(checked, threshold, np.nan)
        out[col] = pd.Series(ok, index=out.index, dtype=object).where(checked, None)
    return out[COLUMNS].sort_values(["arm", "window", "seed", "unit"], kind="stable") \
        .reset_index(drop=True)


def manipulation_summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per controlled run and window (:data:`SUMMARY_COLUMNS`): the units' mean
    achieved, weight-level and ``pr_qk_token`` ratios, the mean intended ratio, how many
    units were checked and passed, and ``passed`` (every checked unit passed, at least one
    was checked; None for arms that are not gated)."""
    if table.empty:
        return pd.DataFrame(columns=SUMMARY_COLUMNS)
    g = table.groupby([*KEYS, "window"], sort=True, dropna=False)
    out = pd.DataFrame({
        "units": g["unit"].nunique(), "checked": g["passed"].agg(lambda s: int(s.notna().sum())),
        "units_passed": g["passed"].agg(lambda s: int(s.eq(True).sum())),
        "units_passed_p1": g["passed_p1"].agg(lambda s: int(s.eq(True).sum())),
        **{col: g[col].mean() for col in ("achieved", "achieved_weight", "qk_ratio",
                                          "intended", *RECORD_RATIOS, "log_share",
                                          "bound_share")}}).reset_index()
    gated = out["mode"].isin(GATED)
    for col in GATE_COLUMN.values():
        ok = (out["checked"] > 0) & (out[col.replace("passed", "units_passed")]
                                     == out["checked"])
        out[col] = pd.Series(ok, index=out.index, dtype=object).where(gated, None)
    # in seed order within each arm and window (the pair groups are numbered by config hash)
    return out[SUMMARY_COLUMNS].sort_values(["arm", "window", "seed", "group"], kind="stable") \
        .reset_index(drop=True)


def manipulation_gate(table: pd.DataFrame, protocol: int = 2) -> dict[tuple[str, str], str]:
    """``{(arm, window): reason}`` for every gated arm × window whose check failed in some
    seed and unit, or could not be made (no token-level PR_K of the pair in the window, or
    no unit with an intended change to check); ``protocol`` 2 (the log-scale gate, which
    decides) or 1 (the plain-ratio gate, for the verdicts shown beside)."""
    reasons: dict[tuple[str, str], str] = {}
    col = GATE_COLUMN[protocol]
    gated = table[table["mode"].isin(GATED)]
    for (arm, window), g in gated.groupby(["arm", "window"], sort=True):
        failed = g[g[col].eq(False)]  # None: not checked
        seeds = int(g["seed"].nunique())
        if len(failed):
            f = failed.iloc[0]
            side = ">" if f["intended"] < 1 else "<"
            threshold = f[col.replace("passed", "threshold")]
            rule = (f"√(intended {f['intended']:.3f}); {f['log_share']:.0%} of the log change"
                    if protocol == 2 else f"(1 + intended {f['intended']:.3f})/2")
            reasons[(arm, window)] = (
                f"manipulation check failed in {failed['seed'].nunique()}/{seeds} seeds "
                f"({len(failed)} unit(s)): seed {int(f['seed'])}, {f['unit']}: achieved "
                f"token-level PR_K ratio {f['achieved']:.3f} {side} {threshold:.3f} = {rule}")
            continue
        unchecked = [s for s, gs in g.groupby("seed") if not gs[col].notna().any()]
        if unchecked:
            reasons[(arm, window)] = (
                f"manipulation check not possible for seed {int(unchecked[0])}: no unit with "
                f"a token-level PR_K of the pair in the window and an intended change of at "
                f"least {EXEMPT:.0%}")
    return reasons
