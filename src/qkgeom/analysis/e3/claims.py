"""The E3 claims, each gated by the manipulation check (docs/protocols.md).

- **E3.1** shrinking the key spectrum sharpens attention: arm − none entropy Δ < 0, one row
  per shrink arm (dose × scale rule) and window;
- **E3.2** holding it softens attention: Δ > 0, one row per hold arm (scale rule);
- **E3.3** shrinking narrows the QKᵀ spectrum: ``pr_qk`` Δ < 0 at the weight and token level;
- **E3.4** holding keeps it wider: ``pr_qk`` Δ > 0;
- **E3.5** dose-response: within each seed, Spearman ρ of the entropy effect (arm − none)
  against the dose r over the doses present (sham = 1, the shrink doses), predicted > 0;
  the sign-flip test over seeds; not evaluated with fewer than 3 doses.

The unit is the seed; the verdict is :func:`qkgeom.analysis.stats.verdict` on k of n seeds
and the sign-flip p. A row whose arm failed its manipulation check in the window (or whose
check could not be made) is *not evaluated*, with the reason. Each row shows beside it the
logit-scale effect (entropy rows) and the effect against the sham of the same scale rule;
:func:`mediation_table` puts entropy and logit-scale effects side by side for every arm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.e3.arms import BASELINE, SHAM
from qkgeom.analysis.e3.paired import QUANTITIES, WINDOWS, window_label
from qkgeom.analysis.kit import CLAIM_COLUMNS, fmt_p, signed

UNIT = "seeds"
MIN_DOSES = 3


@dataclass(frozen=True)
class E3Claim:
    """A predicted sign of the paired difference (arm − none) of some quantities."""

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
DOSE_CLAIM = ("E3.5", "The sharpening grows with the dose (dose-response)")


def with_ci(mean: float, lo: float, hi: float) -> str:
    """``+0.123 [+0.100, +0.146]`` (no bracket without an interval)."""
    return signed(mean) + (f" [{signed(lo)}, {signed(hi)}]" if np.isfinite(lo) else "")


Effects = dict[tuple[str, str, str, str], dict]
_KEY = ["arm", "baseline", "quantity", "window"]


def _index(eff: pd.DataFrame) -> Effects:
    """The effects by (arm, baseline, quantity, window)."""
    return {tuple(r[k] for k in _KEY): r for r in eff.to_dict("records")}


def _effect(eff: Effects, arm: str, baseline: str, quantity: str, window: str) -> dict | None:
    return eff.get((arm, baseline, quantity, window))


def _beside(eff: Effects, arm: str, quantity: str, window: str) -> str:
    parts = []
    if quantity == "attn_entropy":
        ls = _effect(eff, arm, BASELINE, "logit_std", window)
        parts.append("logit_std Δ " + (with_ci(ls["mean"], ls["ci_low"], ls["ci_high"])
                                        if ls is not None else "n/a (not recorded)"))
    vs = _effect(eff, arm, SHAM, quantity, window)
    if vs is not None:
        parts.append(f"vs sham Δ {with_ci(vs['mean'], vs['ci_low'], vs['ci_high'])}, "
                     f"{int(vs['k'])}/{int(vs['n_seeds'])} seeds, p {fmt_p(vs['p_value'])}")
    else:
        parts.append("no sham of this scale rule")
    return "; ".join(parts)


def _row(cid: str, text: str, level: str, window: str, where: str, criterion: str,
         u: dict, beside: str, reason: str, rel: str) -> dict:
    estimate = f"mean Δ {with_ci(u['mean'], u['ci_low'], u['ci_high'])}"
    return {"claim_id": cid, "claim": text, "level": level, "origin": window, "from": where,
            "criterion": criterion, "unit": UNIT, "k": u["k"], "n": u["n"],
            "share": u["share"], "measured": f"{u['k']}/{u['n']} {UNIT} ({rel})",
            "mean": u["mean"], "ci_low": u["ci_low"], "ci_high": u["ci_high"],
            "estimate": estimate, "test": stats.TEST_FLIP, "p_value": u["p_value"],
            "p_sign": u["p_sign"], "beside": beside,
            "verdict": stats.verdict(u["k"], u["n"], u["p_value"], reason=reason),
            "reason": reason}


_EMPTY = {"n": 0, "k": 0, "share": np.nan, "mean": np.nan, "ci_low": np.nan,
          "ci_high": np.nan, "p_value": np.nan, "p_sign": np.nan}


def _arms(eff: pd.DataFrame) -> dict[str, list[str]]:
    """The arms of each mode that have effects against none, by scale rule, then dose
    (largest first)."""
    if eff.empty:
        return {}
    sel = eff[eff["baseline"] == BASELINE].drop_duplicates("arm")
    sel = sel.sort_values(["scale", "dose"], ascending=[True, False])
    return {mode: list(g["arm"]) for mode, g in sel.groupby("mode", sort=False)}


def evaluate_e3_claims(eff: pd.DataFrame, windows: pd.DataFrame,
                       gate: dict[tuple[str, str], str]) -> pd.DataFrame:
    """The E3 claims table (:data:`qkgeom.analysis.kit.CLAIM_COLUMNS`) from
    :func:`~qkgeom.analysis.e3.paired.effects`, the seeds' window means and the
    manipulation gate."""
    rows = []
    by_key = _index(eff)
    arms_of = _arms(eff)
    for claim in E3_CLAIMS:
        arms = arms_of.get(claim.mode, [])
        rel = f"Δ {'<' if claim.sign < 0 else '>'} 0"
        for quantity in claim.quantities:
            _, level, label = QUANTITIES[quantity]
            if not arms:
                rows.append(_row(claim.id, claim.text, level, "—", "—",
                                 f"{claim.mode} − none: {label} {rel}", _EMPTY, "",
                                 f"no {claim.mode} arm paired with a none run", rel))
            for arm in arms:
                for window in WINDOWS:
                    e = _effect(by_key, arm, BASELINE, quantity, window)
                    u = ({k: e[c] for k, c in (("n", "n_seeds"), ("k", "k"), ("share", "share"),
                                                ("mean", "mean"), ("ci_low", "ci_low"),
                                                ("ci_high", "ci_high"), ("p_value", "p_value"),
                                                ("p_sign", "p_sign"))}
                         if e is not None else _EMPTY)
                    where = window_label(e["first_step"], e["last_step"], window) \
                        if e is not None else window_label(np.nan, np.nan, window)
                    reason = gate.get((arm, window), "")
                    if e is None and not reason:
                        reason = f"no {label} recorded in the window"
                    rows.append(_row(claim.id, f"{claim.text} ({arm})", level, window, where,
                                     f"{arm} − none: {label} {rel} (seed's mean paired "
                                     "difference over the window)", u,
                                     _beside(by_key, arm, quantity, window), reason, rel))
    rows += _dose_rows(windows, gate)
    return pd.DataFrame(rows, columns=CLAIM_COLUMNS)


def dose_effects(windows: pd.DataFrame) -> pd.DataFrame:
    """The entropy effects (arm − none) of the sham (dose r = 1) and the shrink arms: one
    row per seed's window mean, with ``r``."""
    if windows.empty:
        return windows.assign(r=np.nan)
    sel = windows[(windows["baseline"] == BASELINE) & (windows["quantity"] == "attn_entropy")
                  & windows["mode"].isin([SHAM, "shrink"])]
    return sel.assign(r=np.where(sel["mode"] == SHAM, 1.0, sel["dose"].astype(float)))


def _dose_rows(windows: pd.DataFrame, gate: dict[tuple[str, str], str]) -> list[dict]:
    cid, text = DOSE_CLAIM
    effects = dose_effects(windows)
    scales = sorted(effects.loc[effects["mode"] == "shrink", "scale"].unique())
    criterion = ("within seed, Spearman ρ of the entropy effect (arm − none) against the dose "
                 "r (sham = 1, shrink doses) > 0")
    if not scales:
        return [_row(cid, text, "token", "—", "—", criterion, _EMPTY, "",
                     "no shrink arm paired with a none run", "ρ > 0")]
    rows = []
    for (scale, window), sel in effects.groupby(["scale", "window"], sort=True):
        if scale not in scales:
            continue
        shrink_arms = sorted(sel.loc[sel["mode"] == "shrink", "arm"].unique())
        doses = sorted(sel["r"].unique())
        u, reason = dict(_EMPTY), ""
        if len(doses) < MIN_DOSES:
            reason = (f"{len(doses)} dose(s) present ({', '.join(f'{d:g}' for d in doses)}"
                      f"); dose-response needs ≥ {MIN_DOSES}")
        else:
            table = sel.pivot_table(index="group", columns="r", values="mean_diff")
            full = table.dropna()
            rho, _ = stats.spearman(np.broadcast_to(np.asarray(doses, float), full.shape),
                                    full.to_numpy())
            u = stats.unit_test(rho, +1)
            reason = next((gate[(a, window)] for a in shrink_arms if (a, window) in gate), "")
        means = sel.groupby("r")["mean_diff"].mean()
        beside = ("doses " + ", ".join(f"{d:g}" for d in doses) + "; mean entropy Δ per dose "
                  + ", ".join(signed(means[d]) for d in doses))
        rows.append(_row(cid, f"{text} ({scale} scale rule)", "token", window,
                         window_label(np.nan, np.nan, window), criterion, u, beside, reason,
                         "ρ > 0"))
    return rows


def mediation_table(eff: pd.DataFrame) -> pd.DataFrame:
    """Per arm and window: the entropy effect next to the logit-scale effect, against none
    and against the sham of the same scale rule (``mean, ci_low, ci_high`` of each), so a
    reader sees whether sharpening survives once the data rule holds the logit scale."""
    rows = []
    if eff.empty:
        return pd.DataFrame()
    by_key = _index(eff)
    arms = eff.drop_duplicates("arm").sort_values(["scale", "mode", "dose"])
    for a in arms.itertuples():
        for window in WINDOWS:
            row = {"arm": a.arm, "mode": a.mode, "dose": a.dose, "scale": a.scale,
                   "window": window}
            for baseline in (BASELINE, SHAM):
                for quantity in ("attn_entropy", "logit_std"):
                    e = _effect(by_key, a.arm, baseline, quantity, window)
                    for col in ("mean", "ci_low", "ci_high"):
                        row[f"{quantity}_vs_{baseline}_{col}"] = \
                            float(e[col]) if e is not None else np.nan
            rows.append(row)
    return pd.DataFrame(rows)
