"""The width ladder (docs/protocols.md#the-width-ladder): per-setting verdicts, the trend of
each primary effect with width and the tokens-per-step arm against its rung.

A sweep is a ladder when its runs, at one depth, Q/K init and batch × context, span two
widths or more (the **rungs**); settings at another batch × context are **arms**, compared
with the rung of their width by seed. Every setting's claims come from its own runs with the
usual rule; the trend is decided over seeds (each seed trains at every width): per seed the
OLS slope of its run-level value on log₂ width, the exact two-sided sign-flip test over
seeds, Holm over the six claims.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis import stats
from qkgeom.analysis.collate import GROUP, Collated
from qkgeom.analysis.e1.claims import CLAIMS, E1_CLAIM_COLUMNS, PRIMARY, evaluate_claims
from qkgeom.analysis.kit import fmt_p, signed, with_ci

#: The columns of :func:`ladder_settings`.
SETTING_COLUMNS = [*GROUP, "width", "batch_size", "block_size", "setting", "rung", "runs"]
#: The trend rows' verdicts.
MOVES, NO_TREND, NOT_EVALUATED = "moves with width", "no trend detected", "not evaluated"
#: The primary effects in the order the ladder's tables and figure show them: E1.2 first
#: (the claim whose verdict protocol 1 found to change with training length).
ORDER = ("E1.2", "E1.1", "E1.3", "E2.1", "E2.2", "E2.3")
_WIDTH_PART = re.compile(r"(^|,)n_embd=[^,]*")


def _family(variant: str) -> str:
    """The variant without its width: settings of one family differ by width only."""
    return _WIDTH_PART.sub("", str(variant)).strip(",")


def ladder_settings(data: Collated) -> pd.DataFrame:
    """One row per setting (depth × Q/K init × variant) of the included runs, with its
    ``width``, ``batch_size``, ``block_size``, a readable ``setting`` label, ``rung``
    (True: a rung of the ladder) and ``runs``; empty when the sweep is no ladder (fewer than
    two widths at one depth, init and batch × context)."""
    inc = data.included
    need = {"n_embd", "batch_size", "block_size", *GROUP}
    if inc.empty or not need <= set(inc.columns):
        return pd.DataFrame(columns=SETTING_COLUMNS)
    # whole numbers (a runs table with a pending run holds them as floats)
    runs = inc.assign(width=inc["n_embd"].astype(int), depth=inc["depth"].astype(int),
                      batch_size=inc["batch_size"].astype(int),
                      block_size=inc["block_size"].astype(int),
                      family=inc["variant"].map(_family))
    per = (runs.groupby([*GROUP, "width", "batch_size", "block_size", "family"], sort=True,
                        dropna=False)["run_id"].nunique().rename("runs").reset_index())
    fams = per.groupby(["depth", "qk_init", "family"], sort=True)
    widths = fams["width"].nunique()
    if widths.empty or widths.max() < 2:
        return pd.DataFrame(columns=SETTING_COLUMNS)
    best = max(widths.index, key=lambda k: (widths[k], fams["runs"].sum()[k]))
    rung = ((per["depth"] == best[0]) & (per["qk_init"] == best[1])
            & (per["family"] == best[2]))
    per["rung"] = rung
    base = per[rung].iloc[0]

    def label(r: pd.Series) -> str:
        text = f"width {r['width']}"
        if (r["batch_size"], r["block_size"]) != (base["batch_size"], base["block_size"]):
            text += f", {r['batch_size']} × {r['block_size']}"
        if (r["depth"], r["qk_init"]) != (base["depth"], base["qk_init"]):
            text += f", depth {r['depth']} {r['qk_init']}"
        return text

    per["setting"] = [label(r) for _, r in per.iterrows()]
    twice = per["setting"].duplicated(keep=False)  # arms that differ in something else too
    per.loc[twice, "setting"] += " (" + per.loc[twice, "family"].astype(str) + ")"
    per = per.sort_values(["rung", "width", "setting"], ascending=[False, True, True])
    return per[SETTING_COLUMNS].reset_index(drop=True)


def setting_of(frame: pd.DataFrame, settings: pd.DataFrame) -> pd.Series:
    """Each row's setting label (by its depth × init × variant), "" for none."""
    def keys(f: pd.DataFrame) -> pd.Series:
        return (f["depth"].astype(int).astype(str) + "|" + f["qk_init"].astype(str) + "|"
                + f["variant"].astype(str))

    labels = dict(zip(keys(settings), settings["setting"], strict=True))
    return keys(frame).map(labels).fillna("") if len(frame) else pd.Series([], dtype=str)


def per_setting(per_layer: pd.DataFrame, traj: pd.DataFrame, settings: pd.DataFrame,
                table: Callable[[pd.DataFrame, pd.DataFrame], pd.DataFrame]) -> pd.DataFrame:
    """``table(per_layer, traj)`` of each setting's own rows, stacked, with ``setting``
    and ``width``: never a number from runs pooled across settings."""
    frames = []
    by_layer = per_layer.assign(_s=setting_of(per_layer, settings))
    by_traj = traj.assign(_s=setting_of(traj, settings))
    for r in settings.itertuples():
        pl = by_layer[by_layer["_s"] == r.setting].drop(columns="_s")
        tr = by_traj[by_traj["_s"] == r.setting].drop(columns="_s")
        frames.append(table(pl, tr).assign(setting=r.setting, width=r.width))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def setting_claims(per_layer: pd.DataFrame, traj: pd.DataFrame,
                   settings: pd.DataFrame) -> pd.DataFrame:
    """Each setting's claims table from its own runs (:func:`evaluate_claims`, its six
    primary rows Holm-adjusted together), stacked, with ``setting`` and ``width``."""
    out = per_setting(per_layer, traj, settings, evaluate_claims)
    return out if len(out) else pd.DataFrame(columns=[*E1_CLAIM_COLUMNS, "setting", "width"])


def primary_statistic(claim_id: str) -> tuple[str, str, str, int]:
    """(statistic, level, origin in the run table, predicted sign) of a claim's primary row
    (E2.3, read at the last checkpoint, sits in the step-0 rows of the run table)."""
    claim = next(c for c in CLAIMS if c.id == claim_id)
    origin = PRIMARY[1] if claim.per_origin else "step0"
    return claim.statistic, PRIMARY[0], origin, claim.sign


def seed_effects(runs: pd.DataFrame, settings: pd.DataFrame) -> pd.DataFrame:
    """The primary statistic of every claim per setting and seed (one run each): columns
    ``setting, width, rung, seed, run_id, claim_id, statistic, value`` in :data:`ORDER`."""
    cols = ["setting", "width", "rung", "seed", "run_id", "claim_id", "statistic", "value"]
    if runs.empty or settings.empty:
        return pd.DataFrame(columns=cols)
    runs = runs.assign(setting=setting_of(runs, settings))
    runs = runs[runs["setting"] != ""].merge(settings[["setting", "width", "rung"]],
                                             on="setting")
    parts = []
    for claim_id in ORDER:
        statistic, level, origin, _ = primary_statistic(claim_id)
        sel = runs[(runs["level"] == level) & (runs["origin"] == origin)]
        parts.append(sel.assign(claim_id=claim_id, statistic=statistic,
                                value=sel.get(statistic, np.nan)))
    out = pd.concat(parts, ignore_index=True)[cols]
    return out.sort_values(["claim_id", "rung", "width", "setting", "seed"],
                           ascending=[True, False, True, True, True],
                           key=lambda c: c.map(ORDER.index) if c.name == "claim_id" else c,
                           kind="stable").reset_index(drop=True)


def e12_by_width(effects: pd.DataFrame) -> pd.DataFrame:
    """Per rung and seed, E1.2's primary effect (token ΔPR_K from the reference, layer
    mean): ``width, seed, effect`` (the README's verdict-by-width figure reads it beside
    E3's per-seed effects, :func:`qkgeom.analysis.e1.figures.fig_width_effects`)."""
    sel = effects[(effects["claim_id"] == "E1.2") & effects["rung"]]
    return (sel[["width", "seed", "value"]].rename(columns={"value": "effect"})
            .sort_values(["width", "seed"]).reset_index(drop=True))


def seed_slopes(values: pd.DataFrame) -> pd.Series:
    """Per seed, the OLS slope of ``values`` (rows: seeds, columns: widths) on log₂ width
    over the widths where the seed has a finite value, at least two (NaN otherwise)."""
    x = np.log2(values.columns.to_numpy(dtype=float))
    y = values.to_numpy(dtype=float)
    ok = np.isfinite(y)
    n = ok.sum(axis=1)
    xs = np.where(ok, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        xm = xs.sum(axis=1) / n
        ym = np.where(ok, y, 0.0).sum(axis=1) / n
        dx = np.where(ok, x - xm[:, None], 0.0)
        slope = (dx * np.where(ok, y - ym[:, None], 0.0)).sum(axis=1) / (dx**2).sum(axis=1)
    return pd.Series(np.where(n >= 2, slope, np.nan), index=values.index, name="slope")


TREND_COLUMNS = ["claim_id", "claim", "statistic", "widths", "n", "k_up", "mean_slope",
                 "ci_low", "ci_high", "width_means", "p_value", "p_adj", "verdict",
                 "direction", "estimate"]


def trend_rows(effects: pd.DataFrame) -> pd.DataFrame:
    """The trend test per claim (docs/protocols.md#the-trend-test) on
    :func:`seed_effects`'s rung rows: :func:`trend_table` of each claim's seeds × widths."""
    rungs = effects[effects["rung"].astype(bool)] if len(effects) else effects
    wide: dict[str, pd.DataFrame] = {}
    if len(rungs):
        table = rungs.groupby(["claim_id", "seed", "width"])["value"].mean().unstack("width")
        wide = {cid: table.loc[cid] for cid in table.index.get_level_values(0).unique()}
    return trend_table(wide)


def trend_table(wide: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The trend rows from each claim's values (rows: seeds, columns: widths; a claim not
    given has no seed): ``n`` seeds with a slope, ``k_up`` of them positive, the mean slope
    per doubling of width with its t-interval, the two-sided sign-flip ``p_value``,
    ``p_adj`` (Holm over the claims), the ``verdict`` (:data:`MOVES` or :data:`NO_TREND`;
    :data:`NOT_EVALUATED` without seeds) and its ``direction`` (toward or away from the
    claim's predicted sign)."""
    rows = []
    for claim_id in ORDER:
        statistic, _, _, sign = primary_statistic(claim_id)
        table = wide.get(claim_id, pd.DataFrame())
        slopes = seed_slopes(table) if table.shape[1] >= 2 else pd.Series(dtype=float)
        u = stats.unit_test(slopes, 0)
        means = ", ".join(f"{w}: {signed(m)}" for w, m in table.mean().items()) \
            if len(table) else ""
        text = next(c.text for c in CLAIMS if c.id == claim_id)
        rows.append({"claim_id": claim_id, "claim": text, "statistic": statistic,
                     "widths": ", ".join(str(w) for w in table.columns), "n": u["n"],
                     "k_up": u["k"], "mean_slope": u["mean"], "ci_low": u["ci_low"],
                     "ci_high": u["ci_high"], "width_means": means, "p_value": u["p_value"],
                     "sign": sign})
    out = pd.DataFrame(rows)
    out["p_adj"] = stats.holm(out["p_value"])
    moves = out["p_adj"] < stats.ALPHA
    out["verdict"] = np.where(out["n"] == 0, NOT_EVALUATED, np.where(moves, MOVES, NO_TREND))
    toward = np.sign(out["mean_slope"]) == out["sign"]
    out["direction"] = np.where(moves, np.where(toward, "toward the claim",
                                                "away from the claim"), "")
    out["estimate"] = [f"slope per doubling {with_ci(m, lo, hi)}"
                       for m, lo, hi in zip(out["mean_slope"], out["ci_low"], out["ci_high"],
                                            strict=True)]
    return out[TREND_COLUMNS]


ARM_COLUMNS = ["setting", "rung_setting", "claim_id", "statistic", "n", "k_up", "mean",
               "ci_low", "ci_high"]


def arm_comparison(effects: pd.DataFrame, settings: pd.DataFrame) -> pd.DataFrame:
    """Each arm (a setting that is no rung) against the rung of its width, paired by
    seed: per claim the mean of arm − rung over the seeds both have, its t-interval and
    the seeds where it is positive. Descriptive: no p, no verdict."""
    rows = []
    for arm in settings[~settings["rung"]].itertuples():
        rung = settings[settings["rung"] & (settings["width"] == arm.width)]
        if rung.empty:
            continue
        rung_label = str(rung["setting"].iloc[0])
        for claim_id in ORDER:
            sel = effects[effects["claim_id"] == claim_id]
            a = sel[sel["setting"] == arm.setting].groupby("seed")["value"].mean()
            b = sel[sel["setting"] == rung_label].groupby("seed")["value"].mean()
            diff = (a - b).dropna()
            mean, lo, hi, n = stats.t_interval(diff)
            rows.append({"setting": arm.setting, "rung_setting": rung_label,
                         "claim_id": claim_id, "statistic": sel["statistic"].iloc[0]
                         if len(sel) else "", "n": n,
                         "k_up": int((stats.finite(diff) > 0).sum()), "mean": mean,
                         "ci_low": lo, "ci_high": hi})
    return pd.DataFrame(rows, columns=ARM_COLUMNS)


def ladder_summary(claims: pd.DataFrame, trend: pd.DataFrame,
                   settings: pd.DataFrame) -> str:
    """The ladder report's opening line: how many primary effects move with width, and
    per setting how many of its primary rows are supported."""
    moving = trend[trend["verdict"] == MOVES] if len(trend) else trend
    measured = int((trend["verdict"] != NOT_EVALUATED).sum()) if len(trend) else 0
    parts = []
    for r in settings.itertuples():
        prim = claims[(claims["setting"] == r.setting) & (claims["role"] == "primary")]
        parts.append(f"{r.setting}: {int((prim['verdict'] == stats.SUPPORTED).sum())}"
                     f"/{len(prim)} supported")
    which = (" (" + ", ".join(f"{c} {d}" for c, d in zip(moving["claim_id"],
                                                       moving["direction"], strict=True))
             + ")") if len(moving) else ""
    return (f"E1/E2 width ladder: {len(moving)} of {measured} primary effects move with "
            f"width{which}; " + "; ".join(parts))


def trend_cell(r: pd.Series) -> str:
    """A trend row as one cell: its verdict, direction and Holm p."""
    what = r["verdict"] + (f" ({r['direction']})" if r["direction"] else "")
    return f"{what}, p (Holm) {fmt_p(r['p_adj'])}"


def e3_by_width(windows: pd.DataFrame, width: int, arm: str = "shrink-0.5-token-data",
                quantity: str = "attn_entropy_scalefree", window: str = "whole",
                baseline: str = "none") -> pd.DataFrame:
    """E3.1's per-seed effect at one width from an E3 report's ``e3_windows.csv`` (each
    seed's mean paired difference arm − baseline over the window): ``width, seed,
    effect``, for :func:`qkgeom.analysis.e1.figures.fig_width_effects` beside
    :func:`e12_by_width`."""
    need = {"arm", "baseline", "quantity", "window", "seed", "mean_diff"}
    if not need <= set(windows.columns):
        missing = ", ".join(sorted(need - set(windows.columns)))
        raise ValueError(f"not an E3 per-seed table (e3_windows.csv): no {missing}")
    sel = windows[(windows["arm"] == arm) & (windows["baseline"] == baseline)
                  & (windows["quantity"] == quantity) & (windows["window"] == window)]
    return pd.DataFrame({"width": int(width), "seed": sel["seed"].astype(int).to_numpy(),
                         "effect": sel["mean_diff"].astype(float).to_numpy()}) \
        .sort_values("seed").reset_index(drop=True)


def ladder_summary_of(report_dir: Path) -> str | None:
    """:func:`ladder_summary` of a written ladder report, from its CSVs; None when the
    folder holds no ladder report."""
    files = {name: report_dir / f"{name}.csv" for name in ("claims", "ladder_trend",
                                                           "ladder_settings")}
    if not all(p.is_file() for p in files.values()):
        return None
    frames = {name: pd.read_csv(p) for name, p in files.items()}
    frames["ladder_trend"]["direction"] = frames["ladder_trend"]["direction"].fillna("")
    return ladder_summary(frames["claims"], frames["ladder_trend"], frames["ladder_settings"])
