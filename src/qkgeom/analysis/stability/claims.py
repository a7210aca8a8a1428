"""The stability claims (docs/stability.md#claims-and-statistics): per remedy, the paired
differences remedy − ``none`` of each seed (within a size), tested with the verdict rule
every experiment shares (:func:`qkgeom.analysis.kit.claim_row`, :func:`~qkgeom.analysis.kit.decide`).

Primary rows, each its own claim at α: S1 (each rate above the stable one: the remedy
lowers the final val loss), S2 (the stable rate: no cost, equivalence within
±:data:`DELTA_LOSS`) and S3 (the sweep: the remedy lowers the LR sensitivity). Secondary
rows, Holm over their family: Δ final val loss at the rates below the stable one (two-sided,
no prediction), Δ final entropy and Δ log₁₀ final max logit at every rate.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.kit import CLAIM_COLUMNS, claim_row, decide, signed
from qkgeom.analysis.stability.outcomes import NONE, StabilityRuns
from qkgeom.analysis.stability.sensitivity import lr_sensitivity

DELTA_LOSS = 0.05  # nats: S2's smallest effect of interest
LOW = "low"  # the claim id of the rows below the stable rate (secondary, no prediction)
#: (column of the run table, label, transform, predicted sign above / at-or-below the
#: stable lr)
QUANTITIES = {
    "final_val_loss": ("final val loss", None, -1, -1),
    "final_entropy": ("final entropy (mean over layers)", None, 1, 0),
    "final_logit_max": ("log10 final max logit", np.log10, -1, 0),
}
EXTRA_COLUMNS = ["quantity", "predicted", "sd", "arm", "size", "lr"]


def paired(stab: StabilityRuns, column: str) -> pd.DataFrame:
    """``arm, size, lr, seed, value, none, delta`` of one quantity: each remedy run against
    the ``none`` run of its seed and size at its learning rate (NaN where either is
    missing)."""
    runs = stab.runs
    base = runs[runs["arm"] == NONE].set_index(["size", "lr", "seed"])[column]
    mine = runs[runs["arm"] != NONE][["arm", "size", "lr", "seed", column]].rename(
        columns={column: "value"})
    mine["none"] = [base.get((size, lr, seed), np.nan) for size, lr, seed in
                    zip(mine["size"], mine["lr"], mine["seed"], strict=True)]
    transform = QUANTITIES[column][1]
    v, b = mine["value"].astype(float), mine["none"].astype(float)
    if transform is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            v, b = transform(v.where(v > 0)), transform(b.where(b > 0))
    mine["delta"] = v - b
    return mine.reset_index(drop=True)


def _beside(stab: StabilityRuns, arm: str, size: str, lr: float | None) -> str:
    runs = stab.runs[stab.runs["size"] == size]
    if lr is not None:
        runs = runs[np.isclose(runs["lr"], lr)]
    mine, base = runs[runs["arm"] == arm], runs[runs["arm"] == NONE]

    def count(g: pd.DataFrame, col: str) -> str:
        return f"{int(g[col].sum())}/{len(g)}"

    text = (f"collapsed: {arm} {count(mine, 'collapsed')}, none {count(base, 'collapsed')}; "
            f"diverged: {arm} {int((mine['state'] == 'diverged').sum())}, none "
            f"{int((base['state'] == 'diverged').sum())}")
    if not mine["acted"].all():
        text += f"; the remedy did not act in {int((~mine['acted']).sum())} seed(s)"
    return text


def _predicted(sign: int, delta: float | None) -> str:
    if delta:
        return f"no cost within ±{delta:g} (equivalence)"
    return {1: "Δ > 0", -1: "Δ < 0", 0: "no prediction (two-sided)"}[sign]


def _decided_row(stab: StabilityRuns, values: pd.Series, *, arm: str, size: str,
                 lr: float | None, level: str, quantity: str, sign: int,
                 delta: float | None, claim_id: str, claim: str, role: str) -> dict:
    """One claim row of paired ``values`` (one per seed)."""
    u = stats.unit_test(values, sign, delta=delta)
    mine = stab.runs[(stab.runs["arm"] == arm) & (stab.runs["size"] == size)]
    if lr is not None:
        mine = mine[np.isclose(mine["lr"], lr)]
    reason = "" if mine["acted"].all() else "the remedy did not act in every seed"
    if not u["n"] and not reason:
        diverged = int((mine["state"] == "diverged").sum())
        reason = (f"no seed has both final values ({arm}: {diverged} of {len(mine)} diverged)"
                  if lr is not None else "no seed has a run at every rate of both arms")
    estimate = (f"{signed(u['mean'])} [{signed(u['ci_low'])}, {signed(u['ci_high'])}]"
                if u["n"] else "n/a")
    test = (stats.TEST_FLIP if sign else stats.TEST_FLIP.replace("one-sided", "two-sided"))
    return claim_row(
        claim_id, claim, level, u, role=role, unit="seeds",
        measured=f"{u['k']}/{u['n']} seeds", estimate=estimate,
        test=test + (f"; TOST ±{delta:g}" if delta else ""),
        beside=_beside(stab, arm, size, lr), reason=reason, quantity=quantity,
        predicted=_predicted(sign, delta), sd=u["sd"], arm=arm, size=size,
        lr=np.nan if lr is None else lr, delta=delta if delta else np.nan)


def _rate_rows(stab: StabilityRuns, pairs: dict[str, pd.DataFrame], arm: str, size: str,
               lr: float, tag: str) -> list[dict]:
    """The rows of one remedy at one rate: Δ val loss (S1 above the stable rate, S2 at it,
    a secondary row below it), then Δ entropy and Δ log max logit (secondary)."""
    stable, above = bool(np.isclose(lr, stab.stable_lr)), lr > stab.stable_lr
    if stable:
        cid, text = "S2", f"{arm} costs nothing at the stable lr"
    elif above:
        cid, text = "S1", f"{arm} lowers the val loss at a high lr"
    else:
        cid, text = LOW, f"{arm} at a lr below the stable one (secondary, no prediction)"
    rows = []
    for col, (label, _, sign_high, sign_other) in QUANTITIES.items():
        loss = col == "final_val_loss"
        sign = sign_high if above else (sign_other if not (loss and not stable) else 0)
        p = pairs[col]
        values = p[(p["arm"] == arm) & (p["size"] == size) & np.isclose(p["lr"], lr)]["delta"]
        rows.append(_decided_row(
            stab, values, arm=arm, size=size, lr=lr, level=f"lr {lr:g}{tag}", quantity=label,
            sign=sign, delta=DELTA_LOSS if (stable and loss) else None, claim_id=cid,
            claim=text, role="primary" if (loss and cid != LOW) else "secondary"))
    return rows


def sensitivity_pairs(stab: StabilityRuns) -> pd.DataFrame:
    """``size, arm, seed, value, none, delta`` of the LR sensitivity: each remedy's LS
    against ``none``'s of the same seed and size."""
    ls = lr_sensitivity(stab)
    base = ls[ls["arm"] == NONE].set_index(["size", "seed"])["sensitivity"]
    mine = ls[ls["arm"] != NONE][["size", "arm", "seed", "sensitivity"]].rename(
        columns={"sensitivity": "value"})
    mine["none"] = [base.get((s, seed), np.nan) for s, seed in
                    zip(mine["size"], mine["seed"], strict=True)]
    mine["delta"] = mine["value"] - mine["none"]
    return mine.reset_index(drop=True)


def stability_claims(stab: StabilityRuns) -> pd.DataFrame:
    """Every claim row of the sweep, decided (:func:`~qkgeom.analysis.kit.decide`)."""
    pairs = {col: paired(stab, col) for col in QUANTITIES}
    ls = sensitivity_pairs(stab)
    arms = [a for a in dict.fromkeys(stab.runs["arm"]) if a != NONE]
    sizes = [s for s in stab.sizes if (stab.runs[stab.runs["size"] == s]["arm"] == NONE).any()]
    rows = []
    for size in sizes:
        tag = f", {size}" if len(sizes) > 1 else ""
        lrs = sorted(stab.runs.loc[stab.runs["size"] == size, "lr"].unique())
        for arm in arms:
            if not ((stab.runs["arm"] == arm) & (stab.runs["size"] == size)).any():
                continue
            for lr in lrs:
                rows += _rate_rows(stab, pairs, arm, size, lr, tag)
            if len(lrs) > 1:
                values = ls[(ls["arm"] == arm) & (ls["size"] == size)]["delta"]
                rows.append(_decided_row(
                    stab, values, arm=arm, size=size, lr=None,
                    level=f"{len(lrs)} rates{tag}", quantity="LR sensitivity (nats)",
                    sign=-1, delta=None, claim_id="S3",
                    claim=f"{arm} lowers the LR sensitivity", role="primary"))
    if not rows:  # a calibration sweep: no remedy to compare
        return pd.DataFrame(columns=[*CLAIM_COLUMNS, *EXTRA_COLUMNS])
    return decide(pd.DataFrame(rows), holm_primary=False)
