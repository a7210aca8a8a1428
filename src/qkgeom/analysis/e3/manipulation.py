"""The E3 manipulation check: did the key control change PR_K as intended, where attention
sees it (the token-level PR_K), in every seed and every unit it controls?

An intervention's claims are read only once it is shown to have happened: a gated arm
(shrink, hold) whose check fails in some seed and unit, or cannot be made, is *not
evaluated* in that window. The rule (achieved vs intended ratio, the halfway threshold,
units within :data:`EXEMPT` of 1 exempt) and why: docs/protocols.md#the-manipulation-check.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis.e3.arms import BASELINE
from qkgeom.analysis.e3.paired import UNIT_QUANTITIES, in_windows, pairs_of

GATED = ("shrink", "hold")
EXEMPT = 0.05  # |intended − 1| below this: no change to check
KEYS = ["group", "seed", "arm", "mode", "dose", "level", "scope", "scale"]
COLUMNS = [*KEYS, "window", "unit", "n_probes", "achieved", "achieved_weight", "qk_ratio",
           "intended", "threshold", "bound_share", "passed"]
SUMMARY_COLUMNS = [*KEYS, "window", "units", "checked", "units_passed", "achieved",
                   "achieved_weight", "qk_ratio", "intended", "bound_share", "passed"]


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
    wide = wide.reindex(columns=[*UNIT_QUANTITIES, "ctl_dose", "ctl_bound_share"]).reset_index()
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
    frame = frame.assign(
        ratio=frame["pr_k_token"] / frame["pr_k_token_base"],
        ratio_w=frame["pr_k_weight"] / frame["pr_k_weight_base"],
        ratio_qk=frame["pr_qk_token"] / frame["pr_qk_token_base"],
        hold=frame["start"] / frame["pr_k_token_base"])
    g = in_windows(frame, steps).groupby(["run_id", *KEYS, "window", "unit"], sort=True,
                                         dropna=False)
    out = pd.DataFrame({"n_probes": g["ratio"].count(), "achieved": g["ratio"].mean(),
                        "achieved_weight": g["ratio_w"].mean(),
                        "qk_ratio": g["ratio_qk"].mean(), "hold": g["hold"].mean(),
                        "ctl_dose": g["ctl_dose"].mean(),
                        "bound_share": g["ctl_bound_share"].mean()}).reset_index()
    dose = out["ctl_dose"].where(out["ctl_dose"].notna(), out["dose"])
    out["intended"] = np.select([out["mode"] == "hold", out["mode"].isin(["shrink", "expand"])],
                                [out["hold"], dose], 1.0)
    checked = (out["mode"].isin(GATED) & np.isfinite(out["intended"])
               & (out["n_probes"] > 0) & ((out["intended"] - 1).abs() >= EXEMPT))
    out["threshold"] = np.where(checked, (1.0 + out["intended"]) / 2.0, np.nan)
    ok = np.where(out["intended"] < 1, out["achieved"] <= out["threshold"],
                  out["achieved"] >= out["threshold"])
    out["passed"] = pd.Series(ok, index=out.index, dtype=object).where(checked, None)
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
        "achieved": g["achieved"].mean(), "achieved_weight": g["achieved_weight"].mean(),
        "qk_ratio": g["qk_ratio"].mean(), "intended": g["intended"].mean(),
        "bound_share": g["bound_share"].mean()}).reset_index()
    gated = out["mode"].isin(GATED)
    ok = (out["checked"] > 0) & (out["units_passed"] == out["checked"])
    out["passed"] = pd.Series(ok, index=out.index, dtype=object).where(gated, None)
    # in seed order within each arm and window (the pair groups are numbered by config hash)
    return out[SUMMARY_COLUMNS].sort_values(["arm", "window", "seed", "group"], kind="stable") \
        .reset_index(drop=True)


def manipulation_gate(table: pd.DataFrame) -> dict[tuple[str, str], str]:
    """``{(arm, window): reason}`` for every gated arm × window whose check failed in some
    seed and unit, or could not be made (no token-level PR_K of the pair in the window, or
    no unit with an intended change to check)."""
    reasons: dict[tuple[str, str], str] = {}
    gated = table[table["mode"].isin(GATED)]
    for (arm, window), g in gated.groupby(["arm", "window"], sort=True):
        failed = g[g["passed"].eq(False)]  # None: not checked
        seeds = int(g["seed"].nunique())
        if len(failed):
            f = failed.iloc[0]
            side = ">" if f["intended"] < 1 else "<"
            reasons[(arm, window)] = (
                f"manipulation check failed in {failed['seed'].nunique()}/{seeds} seeds "
                f"({len(failed)} unit(s)): seed {int(f['seed'])}, {f['unit']}: achieved "
                f"token-level PR_K ratio {f['achieved']:.3f} {side} {f['threshold']:.3f} = "
                f"(1 + intended {f['intended']:.3f})/2")
            continue
        unchecked = [s for s, gs in g.groupby("seed") if not gs["passed"].notna().any()]
        if unchecked:
            reasons[(arm, window)] = (
                f"manipulation check not possible for seed {int(unchecked[0])}: no unit with "
                f"a token-level PR_K of the pair in the window and an intended change of at "
                f"least {EXEMPT:.0%}")
    return reasons
