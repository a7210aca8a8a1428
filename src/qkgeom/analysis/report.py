"""One entry point for every result folder: its claims table and its report.

:func:`write_report` and :func:`claims_table` tell the folder's kind and hand it to its
experiment's report:

- a checkpoint-family analysis folder (``analysis.json``, ``qkgeom analyze``):
  E4, :mod:`qkgeom.analysis.e4.report`;
- a sweep whose runs pair key-control modes by seed: E3, :mod:`qkgeom.analysis.e3.report`;
- any other sweep, or one run folder (trained by qkgeom, or written by its
  :class:`~qkgeom.monitor.GeometryMonitor`, which may record only some metrics):
  E1/E2, :mod:`qkgeom.analysis.e1.report`.

The report goes to ``<folder>/report/`` (layout: docs/report.md): ``report.md`` opening with
the claims table, a self-contained ``report.html``, the figures as PNG (300 dpi) and SVG,
and the numbers as CSV; every file is written atomically. Nothing here imports torch;
matplotlib is imported only to draw.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from qkgeom.analysis.collate import collate
from qkgeom.analysis.e1.report import e1_claims, write_e1_report
from qkgeom.analysis.e3.analysis import e3_analysis
from qkgeom.analysis.e3.arms import is_e3
from qkgeom.analysis.e3.report import write_e3_report
from qkgeom.analysis.e4.bootstrap import N_BOOT
from qkgeom.analysis.e4.report import e4_claims_table, write_e4_report
from qkgeom.errors import QKGeomError
from qkgeom.runs import is_run_folder
from qkgeom.runs.family import MARKER, is_analysis_folder
from qkgeom.runs.sweep import RUNS_DIR, SWEEP_FILE


def claims_table(folder: str | Path, include_incomplete: bool = False,
                 n_boot: int = N_BOOT) -> pd.DataFrame:
    """The claims table of any result folder: one row per claim × level × origin with the
    independent units (k of n with the predicted sign), the estimate with its t-interval,
    the sign-flip p (the verdict's), the sign-test p, what is shown beside, the verdict and,
    when it is *not evaluated*, the reason.

    For a sweep or a run folder (E1/E2, see :func:`qkgeom.analysis.e1.claims.evaluate_claims`;
    E3, :func:`qkgeom.analysis.e3.claims.evaluate_e3_claims`), ``claims.attrs["excluded"]``
    lists the runs left out. An analysis folder gets the E4 claims (``n_boot`` token-block
    bootstrap resamples)."""
    if is_analysis_folder(folder):
        return e4_claims_table(folder, n_boot=n_boot)
    table = collate(_result_folder(folder), include_incomplete=include_incomplete)
    claims = e3_analysis(table)["claims"] if is_e3(table) else e1_claims(table)["claims"]
    claims.attrs["excluded"] = table.attrs["excluded"]
    return claims


def write_report(folder: str | Path, out: str | Path | None = None, *, figures: bool = True,
                 include_incomplete: bool = False, n_boot: int = N_BOOT) -> Path:
    """Analyse a result folder and write its report; returns the path of ``report.md``.

    ``out`` defaults to ``<folder>/report``. Diverged, failed and unfinished runs are left
    out of every number and listed with their reason (``include_incomplete`` keeps runs
    still running). ``figures=False`` skips the figures (faster; tables only). Claims and
    figures a folder lacks the metrics for are skipped with a note in the report. ``n_boot``:
    resamples of E4's token-block bootstrap (an analysis folder only).
    """
    folder = Path(folder)
    if is_analysis_folder(folder):  # a checkpoint family (qkgeom analyze): E4
        return write_e4_report(folder, out, figures=figures, n_boot=n_boot)
    table = collate(_result_folder(folder), include_incomplete=include_incomplete)
    out = folder / "report" if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write = write_e3_report if is_e3(table) else write_e1_report
    return write(table, folder, out, figures)


def _result_folder(folder: str | Path) -> Path:
    """``folder``, if it is a sweep or a run folder; else a one-line error saying what is."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QKGeomError(f"{folder}: no such folder")
    if not ((folder / SWEEP_FILE).is_file() or (folder / RUNS_DIR).is_dir()
            or is_run_folder(folder)):
        raise QKGeomError(f"{folder}: not a sweep, run or checkpoint-analysis folder (no "
                          f"{SWEEP_FILE}, {RUNS_DIR}/, run config.json or {MARKER}); run "
                          "`qkgeom sweep run`, `qkgeom reproduce`, `qkgeom train` or "
                          "`qkgeom analyze` first")
    return folder
