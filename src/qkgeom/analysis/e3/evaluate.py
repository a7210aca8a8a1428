"""E3 from a collated sweep: :func:`e3_tables` (pairs, paired differences, window means,
the manipulation check, per seed) then :func:`e3_verdicts` (effects, the gate, claims);
:func:`e3_analysis` is both. Two stages, so simulations can pool many sweeps' tables.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from qkgeom.analysis.collate import Collated
from qkgeom.analysis.e3.arms import pair_groups, run_arms
from qkgeom.analysis.e3.claims import evaluate_e3_claims, mediation_table
from qkgeom.analysis.e3.manipulation import (
    manipulation_gate,
    manipulation_summary,
    manipulation_units,
)
from qkgeom.analysis.e3.paired import (
    e3_series,
    effects,
    paired_differences,
    unit_series,
    window_means,
)


def e3_tables(data: Collated) -> dict[str, pd.DataFrame]:
    """``arms`` (every analysed run's arm), ``members`` (the runs of the valid pair groups),
    ``excluded_pairs`` (runs left out of the pairs, with the reason), ``series``,
    ``paired``, ``windows`` (each seed's window means), ``manipulation_units`` (the check
    per run, window and unit) and ``manipulation`` (per run and window)."""
    arms = run_arms(data)
    members, excluded = pair_groups(arms)
    series = e3_series(data.metrics, members)
    steps = members.groupby("group")["steps"].max().to_dict() if len(members) else {}
    paired = paired_differences(series, members)
    units = manipulation_units(unit_series(data.metrics, members), members, steps)
    return {"arms": arms, "members": members, "excluded_pairs": excluded, "series": series,
            "paired": paired, "windows": window_means(paired, steps),
            "manipulation_units": units, "manipulation": manipulation_summary(units)}


def e3_verdicts(windows: pd.DataFrame, units: pd.DataFrame) -> dict[str, Any]:
    """``effects``, ``mediation``, ``gate`` ((arm, window) → why it is not evaluated),
    ``gate_p1`` (the same under protocol 1's gate, shown beside) and ``claims`` from the
    seeds' window means and the per-unit manipulation check."""
    eff = effects(windows)
    gate, gate_p1 = manipulation_gate(units), manipulation_gate(units, protocol=1)
    return {"effects": eff, "mediation": mediation_table(eff), "gate": gate,
            "gate_p1": gate_p1, "claims": evaluate_e3_claims(eff, windows, gate, gate_p1)}


def e3_analysis(data: Collated) -> dict[str, Any]:
    """Everything the E3 report shows: the tables of :func:`e3_tables` and of
    :func:`e3_verdicts`."""
    tables = e3_tables(data)
    return {**tables, **e3_verdicts(tables["windows"], tables["manipulation_units"])}
