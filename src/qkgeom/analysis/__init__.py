"""Analysis layer: collate a result folder, test the claims over independent units, report.

Reads only Parquet/JSON (no torch, no models) and returns DataFrames, figures and files::

    from qkgeom.analysis import collate, trajectories, claims_table, write_report
    sweep = collate("sweeps/e1")            # .metrics (long table), .runs, .excluded, ...
    pr_q = trajectories(sweep, "pr_q_token")  # seed mean ± 95 % t-interval per layer and step
    print(claims_table("sweeps/e1"))        # claims: units, tests, intervals, verdicts
    write_report("sweeps/e1")               # sweeps/e1/report/report.md + .html + figures
    summary_line("sweeps/e1/report")        # "E1/E2: 12 of 22 claim rows supported, ..."

Modules: docs/report.md. Names load on first use: ``qkgeom.analysis.tables`` (pandas
only, what ``qkgeom show`` prints) must not need the ``report`` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom._lazy import lazy_getattr

# Eager: ``collate`` is also the name of its submodule, and importing the submodule would
# bind the module on this package in place of a lazily loaded function (pandas only).
from qkgeom.analysis.collate import Collated, collate, runs_table, trajectories

_EXPORTS = {
    "CLAIMS": "qkgeom.analysis.e1.claims", "evaluate_claims": "qkgeom.analysis.e1.claims",
    "e3_analysis": "qkgeom.analysis.e3.evaluate",
    "claims_table": "qkgeom.analysis.report", "write_report": "qkgeom.analysis.report",
    "summary_line": "qkgeom.analysis.report", "excluded_count": "qkgeom.analysis.report",
    "layer_table": "qkgeom.analysis.tables",
}

__all__ = ["collate", "Collated", "trajectories", "write_report", "claims_table", "summary_line",
           "runs_table", "excluded_count", "evaluate_claims", "CLAIMS", "e3_analysis", "layer_table"]

if TYPE_CHECKING:
    from qkgeom.analysis.e1.claims import CLAIMS, evaluate_claims
    from qkgeom.analysis.e3.evaluate import e3_analysis
    from qkgeom.analysis.report import (
        claims_table,
        excluded_count,
        summary_line,
        write_report,
    )
    from qkgeom.analysis.tables import layer_table

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
