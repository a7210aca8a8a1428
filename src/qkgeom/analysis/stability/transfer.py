"""Alerts that transfer (docs/stability.md#the-alert-table-and-its-requirements): the rules
calibrated on one sweep, replayed on runs of other sizes and on Hugging Face models, at the
full and at a 4× sparser cadence; one table rule × model, and the protocol's requirements
checked on it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from qkgeom.alerts import DEFAULT_RULES, AlertRule
from qkgeom.analysis.stability.alerts import (
    MEGATRON_RULES,
    PROTOCOL1_RULES,
    SPARSE_EVERY,
    alert_summary,
    candidate_rules,
    evaluate,
)
from qkgeom.analysis.stability.outcomes import StabilityRuns

DEFAULTS = "calibrated defaults"
REQUIRED_SHARE = 0.9  # of the positives (collapsed and departed), warned before departure
REQUIRED_SIZES = 2  # at this many held-out models at least
TRANSFER_COLUMNS = ["rule", "model", "source", "in_sample", "cadence", "negatives",
                    "false_alarms", "low_entropy_healthy", "low_entropy_healthy_alerted",
                    "positives", "positives_warned", "warned_before_departure",
                    "lead_median", "lead_min", "lead_max"]
RuleSets = Sequence[tuple[str, tuple[AlertRule, ...]]]
CADENCES = (("every probe", 1), (f"every {SPARSE_EVERY}th probe", SPARSE_EVERY))


@dataclass
class Source:
    """Runs the rules are replayed on: a sweep or a folder of trial runs; ``in_sample``
    for the calibration sweep itself."""

    stab: StabilityRuns
    in_sample: bool = False


def rule_sets(thresholds: dict[str, float], defaults: Sequence[str], warmup: int
              ) -> list[tuple[str, tuple[AlertRule, ...]]]:
    """The rules of the table, by name, for runs of LR warm-up ``warmup`` (C3w and C4w
    read from it): the calibrated defaults together (the candidates ``defaults`` names),
    each candidate alone (C1 is the entropy-only rule), protocol 1's defaults, the
    Megatron-style rule, and the library's ``DEFAULT_RULES`` when they are neither of the
    first two."""
    cands = candidate_rules(thresholds, warmup)
    chosen = tuple(cands[c] for c in defaults if c in cands)
    sets: list[tuple[str, tuple[AlertRule, ...]]] = []
    if chosen:
        sets.append((f"{DEFAULTS} ({', '.join(c for c in defaults if c in cands)})", chosen))
    sets += [(f"{cid}{' (entropy-only)' if cid == 'C1' else ''}: {rule.name}", (rule,))
             for cid, rule in cands.items()]
    sets += [("protocol-1 defaults (74 / 8.8 / 0.59)", PROTOCOL1_RULES),
             ("Megatron-style (logit_max > 100)", MEGATRON_RULES)]
    if DEFAULT_RULES not in (chosen, PROTOCOL1_RULES):
        sets.append(("qkgeom.alerts.DEFAULT_RULES", DEFAULT_RULES))
    return sets


def transfer_table(sources: Sequence[Source],
                   sets: RuleSets | Callable[[int], RuleSets]) -> pd.DataFrame:
    """:data:`TRANSFER_COLUMNS`: per rule set, model (each size of each source) and
    cadence, the counts of :func:`~qkgeom.analysis.stability.alerts.alert_summary`.
    ``sets``: the rule sets, or a function of a source's LR warm-up giving them (the rules
    after the warm-up are built per source, :func:`rule_sets`)."""
    rows = []
    for src in sources:
        mine = sets(src.stab.warmup) if callable(sets) else sets
        for name, rules in mine:
            for cadence, every in CADENCES:
                ev = evaluate(src.stab, rules, every)
                for size in src.stab.sizes:
                    s = alert_summary(ev[ev["size"] == size])
                    rows.append({"rule": name, "model": size, "source": src.stab.name,
                                 "in_sample": src.in_sample, "cadence": cadence,
                                 **{k: s[k] for k in TRANSFER_COLUMNS[5:]}})
    table = pd.DataFrame(rows, columns=TRANSFER_COLUMNS)
    order = {name: i for i, name in enumerate(dict.fromkeys(table["rule"]))}
    return table.sort_values("rule", key=lambda c: c.map(order), kind="stable").reset_index(
        drop=True)


def requirements(table: pd.DataFrame) -> list[str]:
    """The protocol's two requirements on the calibrated defaults at the full cadence, each
    a sentence saying whether it holds and, where not, where."""
    rows = table[table["rule"].str.startswith(DEFAULTS) & (table["cadence"] == CADENCES[0][0])]
    if rows.empty:
        return ["No candidate qualified as a default on the calibration sweep: the "
                "requirements cannot be checked."]
    held = rows[~rows["in_sample"].astype(bool)]
    alarms = rows[rows["false_alarms"] > 0]
    first = ("**0 false alarms on negatives at every size and model: met**"
             if alarms.empty else
             "**0 false alarms on negatives at every size and model: not met**; false "
             "alarms at " + ", ".join(f"{r.model} ({r.source}: {r.false_alarms}/"
                                      f"{r.negatives})" for r in alarms.itertuples()))
    share = held["warned_before_departure"] / held["positives"].where(held["positives"] > 0)
    good = held[share >= REQUIRED_SHARE]
    short = held[(share < REQUIRED_SHARE) & share.notna()]
    second = (f"**≥ {REQUIRED_SHARE:.0%} of positives (collapsed, loss departed) warned "
              f"before departure at {REQUIRED_SIZES} or more held-out models: "
              f"{'met' if len(good) >= REQUIRED_SIZES else 'not met'}** (met at "
              + (", ".join(f"{r.model} ({r.source})" for r in good.itertuples()) or "none")
              + ("; short at " + ", ".join(
                  f"{r.model} ({r.source}: {r.warned_before_departure}/{r.positives})"
                  for r in short.itertuples()) if len(short) else "")
              + (f"; {int(share.isna().sum())} held-out model(s) had no positive"
                 if share.isna().any() else "") + ")")
    return [first, second]


def lead_text(r: pd.Series) -> str:
    """``median (min–max)`` of a table row's lead times, or ``—``."""
    if not np.isfinite(r["lead_median"]):
        return "—"
    return f"{r['lead_median']:.0f} ({r['lead_min']:.0f} to {r['lead_max']:.0f})"
