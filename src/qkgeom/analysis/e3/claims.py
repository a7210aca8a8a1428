"""The E3 claims (E3.1–E3.5) and the mediation table, from the paired effects.

Each claim has one declared primary row (the token-level data-rule arm against none, over
the whole run), tested at α; every other row is secondary (Holm over all of them). A row
whose arm failed its manipulation check in the window is *not evaluated*, with the reason;
``verdict_gate_p1`` is the verdict protocol 1's gate would have given (shown beside, never
deciding). The rows and why: docs/protocols.md#e3-claims.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e3.arms import BASELINE, SHAM
from qkgeom.analysis.e3.paired import DELTA, QUANTITIES, WINDOWS, window_label
from qkgeom.analysis.kit import (
    CLAIM_COLUMNS,
    claim_row,
    decide,
    descriptive_reason,
    signed,
    with_ci,
)

UNIT = "seeds"
#: E3's claims.csv: the shared columns, the row's quantity and protocol 1's gate verdict.
E3_CLAIM_COLUMNS = [*CLAIM_COLUMNS, "quantity", "verdict_gate_p1"]
MIN_DOSES = 3
PRIMARY_WINDOW = "whole"
PRIMARY_ARMS = {"shrink": "shrink-0.5-token-data", "hold": "hold-token-data"}
PRIMARY_ENTROPY = "attn_entropy_scalefree"
#: E3.5's primary: the shrink doses at this level and scale rule.
PRIMARY_DOSES = ("token", "data")
#: The primary window first, as every claim lists its rows.
_WINDOWS = (PRIMARY_WINDOW, *(w for w in WINDOWS if w != PRIMARY_WINDOW))


@dataclass(frozen=True)
class E3Claim:
    """A predicted sign of the paired difference (arm − none) of some quantities; the first
    quantity is the primary one."""

    id: str
    text: str
    mode: str
    quantities: tuple[str, ...]
    sign: int


E3_CLAIMS = (
    E3Claim("E3.1", "Forcing the key spectrum to shrink sharpens attention", "shrink",
            (PRIMARY_ENTROPY, "attn_entropy"), -1),
    E3Claim("E3.2", "Holding the key spectrum at its initial dispersion softens attention",
            "hold", (PRIMARY_ENTROPY, "attn_entropy"), +1),
    E3Claim("E3.3", "Shrinking the key spectrum narrows the QKᵀ spectrum", "shrink",
            ("pr_qk_token", "pr_qk_weight"), -1),
    E3Claim("E3.4", "Holding the key spectrum keeps the QKᵀ spectrum wider", "hold",
            ("pr_qk_token", "pr_qk_weight"), +1),
)
DOSE_CLAIM = ("E3.5", "The sharpening grows with the dose (dose-response)")

Effects = dict[tuple[str, str, str, str], dict]
_KEY = ["arm", "baseline", "quantity", "window"]
_NO_UNIT = {"k": 0, "n": 0}


def _index(eff: pd.DataFrame) -> Effects:
    """The effects by (arm, baseline, quantity, window)."""
    return {tuple(r[k] for k in _KEY): r for r in eff.to_dict("records")}


def _row(cid: str, text: str, level: str, window: str, criterion: str, u: dict, *,
         rel: str, role: str, quantity: str, beside: str = "", reason: str = "",
         delta: float = np.nan) -> dict:
    """One E3 claims row (:func:`qkgeom.analysis.kit.claim_row`), seeds as the unit; its
    steps are those of the effect ``u`` where it has them."""
    ci = (u.get(k, np.nan) for k in ("mean", "ci_low", "ci_high"))
    where = window_label(u.get("first_step", np.nan), u.get("last_step", np.nan), window)
    return claim_row(cid, text, level, u, role=role, unit=UNIT,
                     measured=f"{u['k']}/{u['n']} {UNIT} ({rel})",
                     estimate=f"mean Δ {with_ci(*ci)}", test=stats.TEST_FLIP, beside=beside,
                     reason=reason, origin=window, criterion=criterion, delta=delta,
                     quantity=quantity, **{"from": where})


def _beside(eff: Effects, arm: str, quantity: str, window: str) -> str:
    """The row's context in words: the within-row logit scale (entropy rows) and the
    effect against the sham."""
    parts = []
    if quantity in DELTA:
        ls = eff.get((arm, BASELINE, "logit_std_row", window))
        parts.append("within-row logit scale Δ " + (
            with_ci(ls["mean"], ls["ci_low"], ls["ci_high"]) if ls is not None
            else "n/a (not recorded)"))
    vs = eff.get((arm, SHAM, quantity, window))
    if vs is not None:
        parts.append(f"vs sham Δ {with_ci(vs['mean'], vs['ci_low'], vs['ci_high'])}, "
                     f"{int(vs['k'])}/{int(vs['n_seeds'])} seeds")
    else:
        parts.append("no sham of this level and scale rule")
    return "; ".join(parts)


def _arms(eff: pd.DataFrame) -> dict[str, list[str]]:
    """The arms of each mode that have effects against none: the primary arm first, then
    by level, scale rule and dose (largest first)."""
    if eff.empty:
        return {}
    sel = eff[eff["baseline"] == BASELINE].drop_duplicates("arm")
    sel = sel.assign(primary=~sel["arm"].isin(PRIMARY_ARMS.values()))
    sel = sel.sort_values(["primary", "level", "scale", "dose"],
                          ascending=[True, True, True, False])
    return {mode: list(g["arm"]) for mode, g in sel.groupby("mode", sort=False)}


def _claim_rows(claim: E3Claim, arms: list[str], by_key: Effects,
                gate: dict[tuple[str, str], str]) -> list[dict]:
    """One claim's rows: every arm × quantity × window against none (the declared primary
    row, even when the sweep lacks its arm)."""
    rel = f"Δ {'<' if claim.sign < 0 else '>'} 0"
    primary = (PRIMARY_ARMS[claim.mode], claim.quantities[0], PRIMARY_WINDOW)
    rows = []
    if primary[0] not in arms:
        level, label = QUANTITIES[primary[1]]
        rows.append(_row(claim.id, f"{claim.text} ({primary[0]})", level, PRIMARY_WINDOW,
                         f"{primary[0]} − none: {label} {rel}", _NO_UNIT, rel=rel,
                         role="primary", quantity=primary[1],
                         delta=DELTA.get(primary[1], np.nan),
                         reason=f"the sweep has no {primary[0]} arm paired with a none run"))
    for arm in arms:
        for quantity in claim.quantities:
            level, label = QUANTITIES[quantity]
            for window in _WINDOWS:
                e = by_key.get((arm, BASELINE, quantity, window))
                reason = gate.get((arm, window), "")
                if e is None and not reason:
                    reason = f"no {label} recorded in the window"
                rows.append(_row(
                    claim.id, f"{claim.text} ({arm})", level, window,
                    f"{arm} − none: {label} {rel} (seed's mean paired difference over the "
                    "window)", _NO_UNIT if e is None else {**e, "n": e["n_seeds"]}, rel=rel,
                    role="primary" if (arm, quantity, window) == primary else "secondary",
                    quantity=quantity, beside=_beside(by_key, arm, quantity, window),
                    reason=reason,
                    delta=DELTA.get(quantity, np.nan)))
    return rows


def evaluate_e3_claims(eff: pd.DataFrame, windows: pd.DataFrame,
                       gate: dict[tuple[str, str], str],
                       gate_p1: dict[tuple[str, str], str] | None = None) -> pd.DataFrame:
    """The E3 claims table (:data:`E3_CLAIM_COLUMNS`) from
    :func:`~qkgeom.analysis.e3.paired.effects`, the seeds' window means and the
    manipulation gate: every row against none, the primary rows first within each claim;
    verdicts by :func:`qkgeom.analysis.kit.decide` (Holm over the secondary rows).
    ``verdict_gate_p1``: the verdicts the same rows get under protocol 1's gate
    ``gate_p1`` (None: the same gate), the rest of the rule unchanged."""
    def table(g: dict[tuple[str, str], str]) -> pd.DataFrame:
        by_key, arms_of = _index(eff), _arms(eff)
        rows = [row for claim in E3_CLAIMS
                for row in _claim_rows(claim, arms_of.get(claim.mode, []), by_key, g)]
        rows += _dose_rows(windows, g)
        return decide(pd.DataFrame(rows), holm_primary=False)

    out = table(gate)
    beside = out if gate_p1 is None or gate_p1 == gate else table(gate_p1)
    return out.assign(verdict_gate_p1=beside["verdict"].to_numpy())[E3_CLAIM_COLUMNS]


def dose_effects(windows: pd.DataFrame, quantity: str = PRIMARY_ENTROPY) -> pd.DataFrame:
    """The ``quantity`` effects (arm − none) of the sham (dose r = 1) and the shrink arms:
    one row per seed's window mean, with ``r``."""
    if windows.empty:
        return windows.assign(r=np.nan)
    sel = windows[(windows["baseline"] == BASELINE) & (windows["quantity"] == quantity)
                  & windows["mode"].isin([SHAM, "shrink"])]
    return sel.assign(r=np.where(sel["mode"] == SHAM, 1.0, sel["dose"].astype(float)))


def _dose_rows(windows: pd.DataFrame, gate: dict[tuple[str, str], str]) -> list[dict]:
    """E3.5 per entropy, level and scale rule with shrink arms, and window."""
    cid, text = DOSE_CLAIM
    rows = []
    for quantity in (PRIMARY_ENTROPY, "attn_entropy"):
        effects = dose_effects(windows, quantity)
        criterion = (f"within seed, Spearman ρ of the {QUANTITIES[quantity][1]} effect (arm − "
                     "none) against the dose r (sham = 1, shrink doses) > 0")
        shrink = effects[effects["mode"] == "shrink"]
        families = set(zip(shrink["level"], shrink["scale"], strict=True))
        if PRIMARY_DOSES not in families and quantity == PRIMARY_ENTROPY:
            rows.append(_row(cid, f"{text} ({'-'.join(PRIMARY_DOSES)})", "token",
                             PRIMARY_WINDOW, criterion, _NO_UNIT, rel="ρ > 0", role="primary",
                             quantity=quantity,
                             reason="no shrink arm at the token level with the data rule "
                                    "paired with a none run"))
        for (level, scale), fam in effects.groupby(["level", "scale"], sort=True):
            if (level, scale) in families:
                rows += [_dose_row(fam[fam["window"] == window], gate, level, scale, window,
                                   quantity, criterion) for window in _WINDOWS]
    return rows


def _dose_row(sel: pd.DataFrame, gate: dict[tuple[str, str], str], level: str, scale: str,
              window: str, quantity: str, criterion: str) -> dict:
    cid, text = DOSE_CLAIM
    shrink_arms = sorted(sel.loc[sel["mode"] == "shrink", "arm"].unique())
    doses = sorted(sel["r"].unique())
    u, reason = _NO_UNIT, ""
    if len(doses) < MIN_DOSES:
        reason = (f"{len(doses)} dose(s) present ({', '.join(f'{d:g}' for d in doses)}); "
                  f"dose-response needs ≥ {MIN_DOSES}")
    else:
        full = sel.pivot_table(index="group", columns="r", values="mean_diff").dropna()
        rho, _ = stats.spearman(np.broadcast_to(np.asarray(doses, float), full.shape),
                                full.to_numpy())
        u = stats.unit_test(rho, +1)
        reason = next((gate[(a, window)] for a in shrink_arms if (a, window) in gate), "")
    means = sel.groupby("r")["mean_diff"].mean()
    beside = ("doses " + ", ".join(f"{d:g}" for d in doses) + "; mean effect per dose "
              + ", ".join(signed(means[d]) for d in doses))
    role = ("primary" if (level, scale) == PRIMARY_DOSES and window == PRIMARY_WINDOW
            and quantity == PRIMARY_ENTROPY else "secondary")
    return _row(cid, f"{text} ({level}-{scale})", "token", window, criterion, u,
                rel="ρ > 0", role=role, quantity=quantity, beside=beside, reason=reason)


#: The claims whose primary (scale-free) entropy reading is shown with the raw one.
ENTROPY_CLAIMS = ("E3.1", "E3.2")


def raw_entropy_lines(claims: pd.DataFrame) -> list[str]:
    """One line per entropy claim (E3.1, E3.2) with its primary row: the scale-free reading
    (which decides) and the raw-entropy reading of the same arm and window, each with its
    estimate and verdict (protocol 2: every E3 summary shows both); [] for a table that is
    not E3's (no ``quantity`` column) or has neither row. A descriptive table (too few
    seeds for a verdict) shows no verdicts here either."""
    if claims.empty or "quantity" not in claims:
        return []
    verdicts = not descriptive_reason(claims)
    lines = []
    for cid in ENTROPY_CLAIMS:
        primary = claims[(claims["claim_id"] == cid) & (claims["role"] == "primary")
                         & (claims["quantity"] == PRIMARY_ENTROPY)]
        if primary.empty:
            continue
        p = primary.iloc[0]
        raw = claims[(claims["claim_id"] == cid) & (claims["claim"] == p["claim"])
                     & (claims["origin"] == p["origin"]) & (claims["quantity"] == "attn_entropy")]
        arm = str(p["criterion"]).split(" − none", 1)[0]

        def reading(r: pd.Series) -> str:
            said = f"{r['role']}: {r['verdict']}" if verdicts else str(r["role"])
            return f"{str(r['estimate']).removeprefix('mean ')} nats ({said})"

        text = (f"{cid} ({arm} − none, {window_label(np.nan, np.nan, str(p['origin']))}): "
                f"scale-free entropy {reading(p)}")
        text += f"; raw entropy {reading(raw.iloc[0])}" if len(raw) else \
            "; raw entropy not measured"
        lines.append(text)
    return lines


MEDIATION_QUANTITIES = ("attn_entropy", "attn_entropy_scalefree", "logit_std_row",
                        "logit_std")


def mediation_table(eff: pd.DataFrame) -> pd.DataFrame:
    """Per arm and window: the raw entropy effect, the scale-free entropy effect, the
    within-row and the pooled logit scale, against none and against the sham of the same
    level and scale rule (``mean, ci_low, ci_high`` of each). A sharpening through the
    spectrum survives in the scale-free entropy; one the within-row scale explains is a
    change of temperature."""
    if eff.empty:
        return pd.DataFrame()
    by_key = _index(eff)
    rows = []
    for a in eff.drop_duplicates("arm").sort_values(["level", "scale", "mode", "dose"]) \
            .itertuples():
        for window in WINDOWS:
            row = {"arm": a.arm, "mode": a.mode, "dose": a.dose, "level": a.level,
                   "scale": a.scale, "window": window}
            for baseline in (BASELINE, SHAM):
                for quantity in MEDIATION_QUANTITIES:
                    e = by_key.get((a.arm, baseline, quantity, window))
                    for col in ("mean", "ci_low", "ci_high"):
                        row[f"{quantity}_vs_{baseline}_{col}"] = \
                            float(e[col]) if e is not None else np.nan
            rows.append(row)
    return pd.DataFrame(rows)
