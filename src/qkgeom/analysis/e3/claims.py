"""The E3 claims: one declared primary row per claim, the other rows secondary, each gated by
the manipulation check (docs/protocols.md#e3-claims).

- **E3.1** shrinking the key spectrum sharpens attention: arm − none entropy Δ < 0;
- **E3.2** holding it softens attention: Δ > 0;
- **E3.3** shrinking narrows the QKᵀ spectrum: ``pr_qk`` Δ < 0;
- **E3.4** holding keeps it wider: ``pr_qk`` Δ > 0;
- **E3.5** dose-response: within each seed, Spearman ρ of the entropy effect (arm − none)
  against the dose r over the doses present (sham = 1, the shrink doses), predicted > 0;
  the sign-flip test over seeds; not evaluated with fewer than 3 doses.

The **primary row** of each claim (:data:`PRIMARY`) is fixed by the protocol: the
token-level arm with the data rule (dose 0.5 for shrink), against none, over the whole
run, on the scale-free entropy (E3.1, E3.2, E3.5) or ``pr_qk_token`` (E3.3, E3.4); it is
tested at α with its own verdict. Every other row (the raw entropy, the weight-level
``pr_qk``, the early window, other arms) is **secondary**: its p-values are Holm-adjusted
over all secondary rows, and it never decides the claim. Entropy rows also carry the
equivalence test (TOST within ±δ): "equivalent to no effect" is the one way a null is
claimed. The unit is the seed; a row whose arm failed its manipulation check in the
window is *not evaluated*, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e3.arms import BASELINE, SHAM
from qkgeom.analysis.e3.paired import DELTA, QUANTITIES, WINDOWS, window_label
from qkgeom.analysis.kit import CLAIM_COLUMNS, decide, signed

UNIT = "seeds"
MIN_DOSES = 3
PRIMARY_WINDOW = "whole"
PRIMARY_BASELINE = BASELINE
PRIMARY_ARMS = {"shrink": "shrink-0.5-token-data", "hold": "hold-token-data"}
PRIMARY_ENTROPY = "attn_entropy_scalefree"
#: E3.5's primary: the shrink doses at this level and scale rule.
PRIMARY_DOSES = ("token", "data")


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


def with_ci(mean: float, lo: float, hi: float) -> str:
    """``+0.123 [+0.100, +0.146]`` (no bracket without an interval)."""
    return signed(mean) + (f" [{signed(lo)}, {signed(hi)}]" if np.isfinite(lo) else "")


Effects = dict[tuple[str, str, str, str], dict]
_KEY = ["arm", "baseline", "quantity", "window"]


def _index(eff: pd.DataFrame) -> Effects:
    """The effects by (arm, baseline, quantity, window)."""
    return {tuple(r[k] for k in _KEY): r for r in eff.to_dict("records")}


def _beside(eff: Effects, arm: str, quantity: str, window: str) -> str:
    """The row's context in words: the within-row logit scale (entropy rows), the effect
    against the sham, the power."""
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


_EMPTY = {"n": 0, "k": 0, "share": np.nan, "mean": np.nan, "ci_low": np.nan,
          "ci_high": np.nan, "p_value": np.nan, "p_opposite": np.nan, "p_sign": np.nan,
          "p_equiv": np.nan, "detectable": np.nan}


def _unit(e: dict | None) -> dict:
    if e is None:
        return dict(_EMPTY)
    return {"n": e["n_seeds"], **{k: e[k] for k in ("k", "share", "mean", "ci_low", "ci_high",
                                                    "p_value", "p_opposite", "p_sign",
                                                    "p_equiv", "detectable")}}


def _row(cid: str, text: str, level: str, window: str, where: str, criterion: str,
         u: dict, beside: str, reason: str, rel: str, role: str, delta: float) -> dict:
    estimate = f"mean Δ {with_ci(u['mean'], u['ci_low'], u['ci_high'])}"
    return {"claim_id": cid, "claim": text, "level": level, "origin": window, "from": where,
            "criterion": criterion, "unit": UNIT, "k": u["k"], "n": u["n"],
            "share": u["share"], "measured": f"{u['k']}/{u['n']} {UNIT} ({rel})",
            "mean": u["mean"], "ci_low": u["ci_low"], "ci_high": u["ci_high"],
            "estimate": estimate, "test": stats.TEST_FLIP, "p_value": u["p_value"],
            "p_opposite": u["p_opposite"], "p_sign": u["p_sign"], "delta": delta,
            "p_equiv": u["p_equiv"], "detectable": u["detectable"], "role": role,
            "beside": beside, "reason": reason}


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


def evaluate_e3_claims(eff: pd.DataFrame, windows: pd.DataFrame,
                       gate: dict[tuple[str, str], str]) -> pd.DataFrame:
    """The E3 claims table (:data:`qkgeom.analysis.kit.CLAIM_COLUMNS`) from
    :func:`~qkgeom.analysis.e3.paired.effects`, the seeds' window means and the
    manipulation gate: every row against none, the primary rows first within each claim;
    verdicts by :func:`qkgeom.analysis.kit.decide` (Holm over the secondary rows)."""
    rows = []
    by_key = _index(eff)
    arms_of = _arms(eff)
    for claim in E3_CLAIMS:
        arms = arms_of.get(claim.mode, [])
        rel = f"Δ {'<' if claim.sign < 0 else '>'} 0"
        primary_arm = PRIMARY_ARMS[claim.mode]
        if primary_arm not in arms:  # the declared primary row, even when it cannot be read
            _, level, label = QUANTITIES[claim.quantities[0]]
            rows.append(_row(claim.id, f"{claim.text} ({primary_arm})", level, PRIMARY_WINDOW,
                             window_label(np.nan, np.nan, PRIMARY_WINDOW),
                             f"{primary_arm} − none: {label} {rel}", _EMPTY, "",
                             f"the sweep has no {primary_arm} arm paired with a none run", rel,
                             "primary", DELTA.get(claim.quantities[0], np.nan)))
        for arm in arms:
            for quantity in claim.quantities:
                _, level, label = QUANTITIES[quantity]
                for window in (PRIMARY_WINDOW, *(w for w in WINDOWS if w != PRIMARY_WINDOW)):
                    e = by_key.get((arm, BASELINE, quantity, window))
                    where = window_label(e["first_step"], e["last_step"], window) \
                        if e is not None else window_label(np.nan, np.nan, window)
                    reason = gate.get((arm, window), "")
                    if e is None and not reason:
                        reason = f"no {label} recorded in the window"
                    role = ("primary" if (arm, quantity, window) == (
                        primary_arm, claim.quantities[0], PRIMARY_WINDOW) else "secondary")
                    rows.append(_row(claim.id, f"{claim.text} ({arm})", level, window, where,
                                     f"{arm} − none: {label} {rel} (seed's mean paired "
                                     "difference over the window)", _unit(e),
                                     _beside(by_key, arm, quantity, window), reason, rel, role,
                                     DELTA.get(quantity, np.nan)))
    rows += _dose_rows(windows, gate)
    claims = pd.DataFrame(rows)
    return decide(claims, holm_primary=False)[CLAIM_COLUMNS]


def dose_effects(windows: pd.DataFrame, quantity: str = PRIMARY_ENTROPY) -> pd.DataFrame:
    """The ``quantity`` effects (arm − none) of the sham (dose r = 1) and the shrink arms:
    one row per seed's window mean, with ``r``."""
    if windows.empty:
        return windows.assign(r=np.nan)
    sel = windows[(windows["baseline"] == BASELINE) & (windows["quantity"] == quantity)
                  & windows["mode"].isin([SHAM, "shrink"])]
    return sel.assign(r=np.where(sel["mode"] == SHAM, 1.0, sel["dose"].astype(float)))


def _dose_rows(windows: pd.DataFrame, gate: dict[tuple[str, str], str]) -> list[dict]:
    cid, text = DOSE_CLAIM
    rows = []
    for quantity in (PRIMARY_ENTROPY, "attn_entropy"):
        effects = dose_effects(windows, quantity)
        label = QUANTITIES[quantity][2]
        criterion = (f"within seed, Spearman ρ of the {label} effect (arm − none) against "
                     "the dose r (sham = 1, shrink doses) > 0")
        families = sorted({(lv, sc) for lv, sc in zip(
            effects.loc[effects["mode"] == "shrink", "level"],
            effects.loc[effects["mode"] == "shrink", "scale"], strict=True)})
        if PRIMARY_DOSES not in families and quantity == PRIMARY_ENTROPY:
            rows.append(_row(cid, f"{text} ({'-'.join(PRIMARY_DOSES)})", "token",
                             PRIMARY_WINDOW, window_label(np.nan, np.nan, PRIMARY_WINDOW),
                             criterion, _EMPTY, "", "no shrink arm at the token level with the "
                             "data rule paired with a none run", "ρ > 0", "primary", np.nan))
        for (level, scale), fam in effects.groupby(["level", "scale"], sort=True):
            if (level, scale) not in families:
                continue
            for window in (PRIMARY_WINDOW, *(w for w in WINDOWS if w != PRIMARY_WINDOW)):
                rows.append(_dose_row(fam[fam["window"] == window], gate, level, scale,
                                      window, quantity, criterion))
    return rows


def _dose_row(sel: pd.DataFrame, gate: dict[tuple[str, str], str], level: str, scale: str,
              window: str, quantity: str, criterion: str) -> dict:
    cid, text = DOSE_CLAIM
    shrink_arms = sorted(sel.loc[sel["mode"] == "shrink", "arm"].unique())
    doses = sorted(sel["r"].unique())
    u, reason = dict(_EMPTY), ""
    if len(doses) < MIN_DOSES:
        reason = (f"{len(doses)} dose(s) present ({', '.join(f'{d:g}' for d in doses)}); "
                  f"dose-response needs ≥ {MIN_DOSES}")
    else:
        table = sel.pivot_table(index="group", columns="r", values="mean_diff")
        full = table.dropna()
        rho, _ = stats.spearman(np.broadcast_to(np.asarray(doses, float), full.shape),
                                full.to_numpy())
        u = stats.unit_test(rho, +1)
        reason = next((gate[(a, window)] for a in shrink_arms if (a, window) in gate), "")
    means = sel.groupby("r")["mean_diff"].mean()
    beside = ("doses " + ", ".join(f"{d:g}" for d in doses) + "; mean effect per dose "
              + ", ".join(signed(means[d]) for d in doses))
    role = ("primary" if (level, scale) == PRIMARY_DOSES and window == PRIMARY_WINDOW
            and quantity == PRIMARY_ENTROPY else "secondary")
    return _row(cid, f"{text} ({level}-{scale})", "token", window,
                window_label(np.nan, np.nan, window), criterion, u, beside, reason, "ρ > 0",
                role, np.nan)


MEDIATION_QUANTITIES = ("attn_entropy", "attn_entropy_scalefree", "logit_std_row",
                        "logit_std")


def mediation_table(eff: pd.DataFrame) -> pd.DataFrame:
    """Per arm and window: the raw entropy effect, the scale-free entropy effect, the
    within-row logit scale and the pooled logit scale, against none and against the sham of
    the same level and scale rule (``mean, ci_low, ci_high`` of each). A sharpening through
    the spectrum is one that survives in the scale-free entropy; one that the within-row
    scale explains is a change of temperature."""
    rows = []
    if eff.empty:
        return pd.DataFrame()
    by_key = _index(eff)
    arms = eff.drop_duplicates("arm").sort_values(["level", "scale", "mode", "dose"])
    for a in arms.itertuples():
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
