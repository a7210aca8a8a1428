"""What `qkgeom report` (and `reproduce stability`) prints at the end of a stability
report: one compact, labelled table read back from the report's CSVs, then one line of
alerts. The full claims table (with the secondary Δ entropy and Δ max logit rows) stays in
report.md; the terminal shows what a practitioner asks first: per remedy and learning rate
how many runs collapsed and diverged, what the remedy did to the final val loss against
`none`, and its LR sensitivity, each row labelled primary or secondary with one p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from qkgeom.analysis.kit import descriptive_reason, fmt_p
from qkgeom.analysis.stability.alerts import alert_summary, warned_sentence
from qkgeom.analysis.stability.claims import DELTA_LOSS, LOW
from qkgeom.analysis.stability.outcomes import COLLAPSE_NATS, NONE, stable_lr
from qkgeom.analysis.stability.transfer import requirements
from qkgeom.errors import QKGeomError

LOSS = "final val loss"  # the claims' quantity of the loss rows
#: Claim id -> (its label: id, role and, for S2, what it tests; its one p: the claims.csv
#: column and the p's name).
ROWS = {"S1": ("S1 primary", "p_adj", "p"),
        "S2": (f"S2 primary: equivalence ±{DELTA_LOSS:g}", "p_equiv_adj", "TOST p"),
        LOW: ("low secondary", "p_adj", "Holm p"),
        "S3": ("S3 primary", "p_adj", "p")}
REFERENCE = "reference"
DELTA = "Δ vs none ± CI"
VERDICT = "verdict, p"


@dataclass
class TerminalSummary:
    """The table, its title, the footnote lines under it and the lines printed after it."""

    table: pd.DataFrame
    title: str
    notes: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _blank_repeats(table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """``columns`` shown on the first row of each run of equal values only. (Not
    ``render_frame``'s groups: a group column may wrap, and a remedy's name has no space
    to wrap at, so a narrow terminal would break it mid-word.)"""
    out = table.copy()
    key = out[columns].astype(str).agg("\x1f".join, axis=1)
    repeat = key.eq(key.shift())
    out.loc[repeat, columns] = ""
    return out


def _read(report_dir: Path, name: str) -> pd.DataFrame | None:
    path = report_dir / f"{name}.csv"
    if not path.is_file():
        return None
    try:
        return pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (OSError, ValueError, pd.errors.EmptyDataError) as err:
        raise QKGeomError(f"{path}: unreadable ({err})") from err


def _counts(runs: pd.DataFrame) -> pd.DataFrame:
    """Per size and remedy (in the runs' order) and lr (ascending): runs, collapsed and
    diverged."""
    runs = runs.assign(diverged=runs["state"] == "diverged",
                       collapsed=runs["collapsed"].astype(bool))
    out = runs.groupby(["size", "arm", "lr"], sort=False).agg(
        runs=("run_id", "size"), collapsed=("collapsed", "sum"), diverged=("diverged", "sum"))
    order = {k: i for i, k in enumerate(dict.fromkeys(zip(runs["size"], runs["arm"],
                                                          strict=True)))}
    key = [order[(size, arm)] for size, arm, _ in out.index]
    return out.assign(_key=key).sort_values(["_key", "lr"], kind="stable").drop(columns="_key")


def _lr_text(lr: float, stable: float) -> str:
    return f"{lr:g}" + ("*" if np.isclose(lr, stable) else "")


def _delta(r: dict) -> str:
    """``mean ± half-width`` of the row's 95 % t-interval (symmetric), or n/a."""
    mean, lo, hi = (float(r[k]) for k in ("mean", "ci_low", "ci_high"))
    if not np.isfinite(mean):
        return "n/a"
    half = (hi - lo) / 2
    return f"{mean:+.3f}" + (f" ± {half:.3f}" if np.isfinite(half) else "")


def _counts_of(c: pd.DataFrame | None) -> dict[str, str]:
    """``collapsed`` and ``diverged`` (k/runs) of counts rows, summed."""
    if c is None or c.empty:
        return {"collapsed": "?", "diverged": "?"}
    n = int(c["runs"].sum())
    return {col: f"{int(c[col].sum())}/{n}" for col in ("collapsed", "diverged")}


def _claim_rows(claims: pd.DataFrame, counts: pd.DataFrame, stable: float,
                sized: bool) -> list[dict[str, object]]:
    """``none``'s counts per rate (the reference), then per remedy one row per Δ val loss
    claim row (S1, S2, low) in the claims' order and its S3 row."""
    out: list[dict[str, object]] = []
    for (size, arm, lr), c in counts.iterrows():
        if arm == NONE:
            out.append({**({"size": size} if sized else {}), "remedy": arm,
                        "lr": _lr_text(lr, stable), "row": REFERENCE,
                        **_counts_of(c.to_frame().T), DELTA: "", VERDICT: ""})
    rows = claims[(claims["quantity"] == LOSS) | (claims["claim_id"] == "S3")]
    for r in rows.to_dict("records"):
        label, p_col, p_name = ROWS[str(r["claim_id"])]
        size, arm = str(r["size"]), str(r["arm"])
        mine = counts.xs((size, arm), drop_level=False) if (size, arm) in counts.index else None
        lr = "sweep"
        if r["claim_id"] != "S3":
            lr = _lr_text(float(r["lr"]), stable)
            if mine is not None:
                mine = mine[np.isclose(mine.index.get_level_values("lr"), float(r["lr"]))]
        p = float(r[p_col])
        out.append({**({"size": size} if sized else {}), "remedy": arm, "lr": lr,
                    "row": label, **_counts_of(mine), DELTA: _delta(r),
                    VERDICT: f"{r['verdict']}, {p_name} {fmt_p(p)}"})
    return out


def _reference_rows(counts: pd.DataFrame, stable: float, sized: bool
                    ) -> list[dict[str, object]]:
    """A sweep with no remedy to compare (calibrate, transfer): ``none``'s counts per size
    and rate, no claim."""
    return [{**({"size": size} if sized else {}), "remedy": arm, "lr": _lr_text(lr, stable),
             "row": "no claim (no remedy to compare)", **_counts_of(c.to_frame().T)}
            for (size, arm, lr), c in counts.iterrows()]


def _alert_line(alerts: pd.DataFrame | None) -> str:
    if alerts is None or alerts.empty:
        return ""
    s = alert_summary(alerts)
    recall = f"{s['recall']:.0%}" if np.isfinite(s["recall"]) else "n/a"
    return (f"alerts (qkgeom.alerts.DEFAULT_RULES replayed on every run): false alarms on "
            f"{s['false_alarms']} of {s['negatives']} negatives (loss never departed); "
            f"{warned_sentence(s)}; recall {recall}")


def terminal_summary(report_dir: str | Path) -> TerminalSummary:
    """The terminal summary of a written stability report folder (its ``claims.csv``,
    ``stability_runs.csv``, ``stability_alerts.csv`` and, where written,
    ``stability_calibration.csv`` and ``stability_transfer.csv``)."""
    report_dir = Path(report_dir)
    runs = _read(report_dir, "stability_runs")
    claims = _read(report_dir, "claims")
    if runs is None or claims is None:
        raise QKGeomError(f"{report_dir}: not a stability report (no stability_runs.csv or "
                          "claims.csv)")
    runs["size"] = runs["size"].astype(str)
    counts = _counts(runs)
    stable = stable_lr(runs["lr"])
    sized = runs["size"].nunique() > 1
    notes: list[str] = []
    lines: list[str] = []
    if len(claims):
        claims["size"] = claims["size"].astype(str)
        table = pd.DataFrame(_claim_rows(claims, counts, stable, sized))
        why = descriptive_reason(claims)
        if why:  # no verdict: the p alone
            table[VERDICT] = table[VERDICT].str.split(", ", n=1).str[-1]
            table = table.rename(columns={VERDICT: "p"})
            lines.append(why)
        secondary = claims[(claims["role"] == "secondary") & (claims["family"] > 0)]
        notes += [
            "* the stable rate; rows: S1 at a rate above it (the remedy lowers the final val "
            "loss), S2 at it, low below it (two-sided, no prediction), S3 over the sweep (the "
            "remedy lowers the LR sensitivity, Wortsman et al.)",
            "Δ vs none: remedy − none of the same seed, mean ± half its 95 % t-interval, of "
            "the final val loss (S3: of the LR sensitivity), nats; collapsed, diverged: the "
            "remedy's runs at that rate (S3: over the sweep)",
            "one p per row: S1, S3 the one-sided sign-flip p, each row its own claim at "
            f"α = 0.05 (not adjusted); S2 the TOST p (equivalence within ±{DELTA_LOSS:g} "
            "nats); low the two-sided sign-flip p, Holm-adjusted over the "
            f"{len(secondary)} secondary rows (with Δ entropy and Δ max logit at every rate: "
            "report.md)",
            "row: primary rows decide the claims; secondary rows are descriptive"]
        title = ("stability: each remedy against none, per learning rate and over the sweep "
                 "(see report.md)")
    else:
        table = pd.DataFrame(_reference_rows(counts, stable, sized))
        title = "stability: runs per size and learning rate (see report.md)"
        notes.append(f"* the stable rate; collapsed: some layer's mean attention entropy below "
                     f"{COLLAPSE_NATS:g} nats at the last probe, or diverged")
    lines.append(_alert_line(_read(report_dir, "stability_alerts")))
    calibration = _read(report_dir, "stability_calibration")
    if calibration is not None and len(calibration) and not len(claims):
        chosen = calibration.loc[calibration["default"].astype(bool)]
        by = set(chosen.get("chosen_by", pd.Series(dtype=str)).astype(str))
        lines.append("candidates that meet the default rule on these runs (no false alarm on "
                     "a negative, every positive warned before departure): "
                     + (", ".join(chosen["candidate"]) if "rule" in by else "none")
                     + ("; by the fallback (every positive warned, the most before departure): "
                        + ", ".join(chosen["candidate"]) if "fallback" in by else ""))
    transfer = _read(report_dir, "stability_transfer")
    if transfer is not None and len(transfer):
        lines += [line.replace("**", "") for line in requirements(transfer)]
    table = _blank_repeats(table, [c for c in ("size", "remedy") if c in table])
    return TerminalSummary(table, title, notes, [x for x in lines if x])
