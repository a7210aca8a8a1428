"""The stability claims (docs/stability.md#claims-and-statistics): per remedy and learning
rate, the paired differences remedy − ``none`` of each seed, tested with the verdict rule
every experiment shares (:func:`qkgeom.analysis.kit.claim_row`, :func:`~qkgeom.analysis.kit.decide`).

Primary rows, each its own claim at α: S1 (a high learning rate: the remedy lowers the
final val loss) and S2 (the stable learning rate: it does not raise it, equivalence within
±:data:`DELTA_LOSS`). Secondary rows, Holm over their family: Δ final entropy and
Δ log₁₀ final max logit.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.kit import CLAIM_COLUMNS, claim_row, decide, signed
from qkgeom.analysis.stability.outcomes import NONE, StabilityRuns

DELTA_LOSS = 0.05  # nats: S2's smallest effect of interest
#: (column of the run table, label, transform, predicted sign at high / at the stable lr)
QUANTITIES = {
    "final_val_loss": ("final val loss", None, -1, -1),
    "final_entropy": ("final entropy (mean over layers)", None, 1, 0),
    "final_logit_max": ("log10 final max logit", np.log10, -1, 0),
}


def paired(stab: StabilityRuns, column: str) -> pd.DataFrame:
    """``arm, lr, seed, value, none, delta`` of one quantity: each remedy run against the
    ``none`` run of its seed at its learning rate (NaN where either is missing)."""
    runs = stab.runs
    base = runs[runs["arm"] == NONE].set_index(["lr", "seed"])[column]
    mine = runs[runs["arm"] != NONE][["arm", "lr", "seed", column]].rename(
        columns={column: "value"})
    mine["none"] = [base.get((lr, seed), np.nan) for lr, seed in
                    zip(mine["lr"], mine["seed"], strict=True)]
    transform = QUANTITIES[column][1]
    v, b = mine["value"].astype(float), mine["none"].astype(float)
    if transform is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            v, b = transform(v.where(v > 0)), transform(b.where(b > 0))
    mine["delta"] = v - b
    return mine.reset_index(drop=True)


def _beside(stab: StabilityRuns, arm: str, lr: float) -> str:
    runs = stab.runs[np.isclose(stab.runs["lr"], lr)]
    mine, base = runs[runs["arm"] == arm], runs[runs["arm"] == NONE]

    def count(g: pd.DataFrame, col: str) -> str:
        return f"{int(g[col].sum())}/{len(g)}"

    text = (f"collapsed: {arm} {count(mine, 'collapsed')}, none {count(base, 'collapsed')}; "
            f"diverged: {arm} {int((mine['state'] == 'diverged').sum())}, none "
            f"{int((base['state'] == 'diverged').sum())}")
    if not mine["acted"].all():
        text += f"; the remedy did not act in {int((~mine['acted']).sum())} seed(s)"
    return text


def _row(stab: StabilityRuns, pairs: pd.DataFrame, arm: str, lr: float, column: str,
         claim_id: str, claim: str, role: str) -> dict:
    label, _, sign_high, sign_stable = QUANTITIES[column]
    stable = bool(np.isclose(lr, stab.stable_lr))
    sign = sign_stable if stable else sign_high
    delta = DELTA_LOSS if (stable and column == "final_val_loss") else None
    values = pairs[(pairs["arm"] == arm) & np.isclose(pairs["lr"], lr)]["delta"]
    u = stats.unit_test(values, sign, delta=delta)
    mine = stab.runs[(stab.runs["arm"] == arm) & np.isclose(stab.runs["lr"], lr)]
    reason = "" if mine["acted"].all() else "the remedy did not act in every seed"
    if not u["n"] and not reason:
        diverged = int((mine["state"] == "diverged").sum())
        reason = f"no seed has both final values ({arm}: {diverged} of {len(mine)} diverged)"
    pred = {1: "Δ > 0", -1: "Δ < 0", 0: "no prediction"}[sign]
    estimate = (f"{signed(u['mean'])} [{signed(u['ci_low'])}, {signed(u['ci_high'])}]"
                if u["n"] else "n/a")
    return claim_row(
        claim_id, claim, f"lr {lr:g}", u, role=role, unit="seeds",
        measured=f"{u['k']}/{u['n']} seeds", estimate=estimate,
        test=stats.TEST_FLIP + (f"; TOST ±{delta:g}" if delta else ""),
        beside=_beside(stab, arm, lr), reason=reason, quantity=label, predicted=pred,
        arm=arm, lr=lr, delta=delta if delta else np.nan)


def stability_claims(stab: StabilityRuns) -> pd.DataFrame:
    """Every claim row of the sweep, decided (:func:`~qkgeom.analysis.kit.decide`)."""
    pairs = {col: paired(stab, col) for col in QUANTITIES}
    arms = [a for a in dict.fromkeys(stab.runs["arm"]) if a != NONE]
    lrs = sorted(stab.runs["lr"].unique())
    rows = []
    for arm in arms:
        for lr in lrs:
            stable = bool(np.isclose(lr, stab.stable_lr))
            cid = "S2" if stable else "S1"
            text = (f"{arm} does not raise the val loss at the stable lr" if stable
                    else f"{arm} lowers the val loss at a high lr")
            rows.append(_row(stab, pairs["final_val_loss"], arm, lr, "final_val_loss",
                             cid, text, "primary"))
            for col in ("final_entropy", "final_logit_max"):
                rows.append(_row(stab, pairs[col], arm, lr, col, cid, text, "secondary"))
    if not rows:  # a calibration sweep: no remedy to compare
        return pd.DataFrame(columns=[*CLAIM_COLUMNS, "quantity", "predicted", "arm", "lr"])
    return decide(pd.DataFrame(rows), holm_primary=False)
