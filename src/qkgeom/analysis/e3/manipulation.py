"""The E3 manipulation check: did the key control change PR_K as intended, in every seed?

An intervention's claims are only read once the intervention is shown to have happened
(docs/protocols.md). Per controlled run and window (:func:`manipulation_table`):

- **achieved** = the mean over the window's probes of PR_K(arm) ÷ PR_K(none of the same
  seed), PR_K at the weight level as a whole-model value (the mean over layers);
- **intended**: shrink and expand: the dose the control aimed at over the window, the mean
  of its recorded ``ctl_dose`` (r(t), which ramps from 1 to r), or the configured dose when
  the run recorded none; hold: the mean over the window of PR_K(0) ÷ PR_K(none, t) (holding
  PR_K at its step-0 value); sham: 1;
- ``bound_share``: the mean recorded ``ctl_bound_share`` (share of steps the cap bound);
- the **check**: a shrink run passes when achieved ≤ (1 + intended)/2 (at least half the
  intended reduction), a hold run when achieved ≥ (1 + intended)/2; sham and expand runs
  are reported, not gated (the sham is expected at ≈ 1).

:func:`manipulation_gate` turns the table into the reason each (arm, window) is *not
evaluated*: a check that fails in any seed, or cannot be made.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis.e3.arms import BASELINE
from qkgeom.analysis.e3.paired import CONTROL_RECORDS, WINDOWS, in_windows, pairs_of

PR_K = "pr_k_weight"
GATED = ("shrink", "hold")
COLUMNS = ["group", "seed", "arm", "mode", "dose", "scale", "window", "n_probes", "achieved",
           "intended", "threshold", "bound_share", "passed"]


def manipulation_table(series: pd.DataFrame, paired: pd.DataFrame, members: pd.DataFrame,
                       steps: dict[int, int]) -> pd.DataFrame:
    """One row per controlled run and window (columns :data:`COLUMNS`) from the whole-model
    ``series`` (the control's records) and the ``paired`` values (PR_K of each arm and its
    ``none``); ``passed`` is True/False for shrink and hold runs whose ratio could be
    measured, else None."""
    pairs = pairs_of(members)
    pairs = pairs[pairs["baseline"] == BASELINE]
    if pairs.empty:
        return pd.DataFrame(columns=COLUMNS)
    keys = ["group", "arm"]
    pk = paired[(paired["quantity"] == PR_K) & (paired["baseline"] == BASELINE)]
    start = pk.loc[pk["step"] == 0, [*keys, "arm_value"]].rename(columns={"arm_value": "s0"})
    pk = pk.merge(start, on=keys, how="left")
    pk["ratio"] = pk["arm_value"] / pk["base_value"]
    pk["hold"] = pk["s0"] / pk["base_value"]
    g = in_windows(pk, steps).groupby([*keys, "window"])
    ratios = pd.DataFrame({"n_probes": g["ratio"].count(), "achieved": g["ratio"].mean(),
                           "hold": g["hold"].mean()})
    ctl = series[series["quantity"].isin(CONTROL_RECORDS)].merge(
        pairs[["run_id", *keys]], on="run_id")
    records = in_windows(ctl, steps).groupby([*keys, "window", "quantity"])["value"].mean() \
        .unstack("quantity").reindex(columns=list(CONTROL_RECORDS))
    grid = pd.concat([pairs.assign(window=w) for w in WINDOWS], ignore_index=True)
    out = grid.join(ratios, on=[*keys, "window"]).join(records, on=[*keys, "window"])
    out["n_probes"] = out["n_probes"].fillna(0).astype(int)
    dose = out["ctl_dose"].where(out["ctl_dose"].notna(), out["dose"])
    out["intended"] = np.select([out["mode"] == "hold", out["mode"].isin(["shrink", "expand"])],
                                [out["hold"], dose], 1.0)
    out["bound_share"] = out["ctl_bound_share"]
    gated = out["mode"].isin(GATED) & np.isfinite(out["intended"]) & (out["n_probes"] > 0)
    out["threshold"] = np.where(gated, (1.0 + out["intended"]) / 2.0, np.nan)
    ok = np.where(out["mode"] == "shrink", out["achieved"] <= out["threshold"],
                  out["achieved"] >= out["threshold"])
    out["passed"] = pd.Series(ok, index=out.index, dtype=object).where(gated, None)
    out.loc[out["n_probes"] == 0, ["achieved", "intended"]] = np.nan
    return out[COLUMNS].sort_values(["arm", "window", "seed"], kind="stable") \
        .reset_index(drop=True)


def manipulation_gate(table: pd.DataFrame) -> dict[tuple[str, str], str]:
    """``{(arm, window): reason}`` for every gated arm × window whose check failed in some
    seed or could not be made (missing PR_K, no probe in the window, no step-0 probe)."""
    reasons: dict[tuple[str, str], str] = {}
    gated = table[table["mode"].isin(GATED)]
    for (arm, window), g in gated.groupby(["arm", "window"], sort=True):
        failed = g[g["passed"].eq(False)]  # None: not checked
        unchecked = g[g["passed"].isna()]
        if len(failed):
            f = failed.iloc[0]
            side = ">" if f["mode"] == "shrink" else "<"
            reasons[(arm, window)] = (
                f"manipulation check failed in {len(failed)}/{len(g)} seeds: seed "
                f"{int(f['seed'])} achieved PR_K ratio {f['achieved']:.3f} {side} "
                f"{f['threshold']:.3f} = (1 + intended {f['intended']:.3f})/2")
        elif len(unchecked):
            u = unchecked.iloc[0]
            reasons[(arm, window)] = (
                f"manipulation check not possible for seed {int(u['seed'])} (no weight "
                "PR_K of the pair in the window, or no step-0 probe)")
    return reasons
