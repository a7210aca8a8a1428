"""One entry point for every result folder: its claims table and its report.

:func:`write_report` and :func:`claims_table` tell the folder's kind and hand it to its
experiment: an analysis folder or a set of them (E4), a sweep whose grid declares
``experiment: e3`` or ``stability``, any other sweep or one run folder (E1/E2; a folder
that declares no experiment is E3 when its runs pair a controlled run with an uncontrolled
one). The report folder is marked by ``report.json``: it is written only into a new or
empty folder or one so marked, never over files qkgeom did not write (docs/report.md).
Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.analysis.collate import Collated, collate, is_single_run
from qkgeom.analysis.e1.report import e1_claims, write_e1_report
from qkgeom.analysis.e3.arms import is_e3
from qkgeom.analysis.e3.evaluate import e3_analysis
from qkgeom.analysis.e3.report import write_e3_report
from qkgeom.analysis.e4.bootstrap import N_BOOT
from qkgeom.analysis.e4.report import e4_claims_table, write_e4_report
from qkgeom.analysis.kit import claims_summary
from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, refuse_link, write_json
from qkgeom.runs import is_run_folder
from qkgeom.runs.family import MARKER, is_analysis_folder, is_e4_set
from qkgeom.runs.sweep import RUNS_DIR, SWEEP_FILE, sweep_experiment
from qkgeom.version import __version__

REPORT_MARKER = "report.json"
_REPORT_KIND = "qkgeom-report"


def claims_table(folder: str | Path, include_incomplete: bool = False,
                 n_boot: int = N_BOOT) -> pd.DataFrame:
    """The claims table of any result folder: one row per claim × level × origin with its
    independent units (k of n with the predicted sign), estimate, p's, verdict and, when
    *not evaluated*, the reason.

    A sweep or a run folder gets the E1/E2 or the E3 claims (the runs left out:
    ``collate(folder).excluded``), an analysis folder the E4 claims of one model (``n_boot``
    token-block bootstrap resamples), an E4 set those over its seeds."""
    if is_analysis_folder(folder) or is_e4_set(folder):
        return e4_claims_table(folder, n_boot=n_boot)
    if sweep_experiment(folder) == "stability":
        from qkgeom.analysis.stability.claims import stability_claims
        from qkgeom.analysis.stability.outcomes import read_stability

        return stability_claims(read_stability(folder))
    data = collate(_result_folder(folder), include_incomplete=include_incomplete)
    return e3_analysis(data)["claims"] if _is_e3_folder(data) else e1_claims(data)["claims"]


def write_report(folder: str | Path, out: str | Path | None = None, *, figures: bool = True,
                 include_incomplete: bool = False, n_boot: int = N_BOOT,
                 calibration: str | Path | None = None, also: Sequence[str | Path] = ()
                 ) -> Path:
    """Analyse a result folder and write its report; returns the path of ``report.md``.

    ``out`` defaults to ``<folder>/report``. Diverged, failed and unfinished runs are left
    out of every number and listed with their reason (``include_incomplete`` keeps runs
    still running). ``figures=False`` skips the figures (faster; tables only). Claims and
    figures a folder lacks the metrics for are skipped with a note in the report. ``n_boot``:
    resamples of E4's token-block bootstrap (an analysis folder only). ``calibration`` and
    ``also``: a stability sweep's cross-size alert table (docs/stability.md#reports-which-command-gives-what).
    """
    # The report extra, before anything is written: a missing package raises
    # ModuleNotFoundError naming it, which the CLI turns into one line naming the extra.
    for name in ("scipy.stats", "markdown", *(("matplotlib",) if figures else ())):
        importlib.import_module(name)
    folder = Path(folder)
    stability = sweep_experiment(folder) == "stability"
    if (calibration or also) and not stability:
        raise QKGeomError(f"{folder}: --calibration and --also are for stability sweeps "
                          "(qkgeom reproduce stability)")
    if out is None:  # inside the folder: a planted report/ link is refused, never followed
        out = folder / "report"
        refuse_link(out)
    out = Path(out)
    if is_analysis_folder(folder) or is_e4_set(folder):  # checkpoint families: E4
        claim_report_dir(out, folder)
        return write_e4_report(folder, out, figures=figures, n_boot=n_boot)
    if stability:  # diverged runs are part of its results
        from qkgeom.analysis.stability.report import write_stability_report

        claim_report_dir(out, _result_folder(folder))
        return write_stability_report(folder, out, figures, calibration=calibration,
                                      also=also)
    data = collate(_result_folder(folder), include_incomplete=include_incomplete)
    _refuse_unfinished_run(data)
    claim_report_dir(out, folder)
    write = write_e3_report if _is_e3_folder(data) else write_e1_report
    path = write(data, out, figures)
    # what was left out, for a command to say so without collating the folder again
    write_json(out / REPORT_MARKER, {**read_json(out / REPORT_MARKER),
                                      "excluded": len(data.excluded)})
    return path


def _is_e3_folder(data: Collated) -> bool:
    """E3 when the sweep's grid declares it; for a folder that declares no experiment, when
    its runs pair a controlled run with an uncontrolled one (:func:`is_e3`)."""
    declared = sweep_experiment(data.folder)
    return declared == "e3" if declared else is_e3(data)


def _refuse_unfinished_run(data: Collated) -> None:
    """One run folder that is not finished (interrupted, killed, still running) or whose
    files are unreadable: one line saying so, instead of a claims table of nothing.
    (A diverged or failed run is reported, with the reason it is left out.)"""
    folder, left_out = data.folder, data.excluded
    if not (is_single_run(folder) and len(left_out)):
        return
    reason = str(left_out["excluded"].iloc[0])
    if reason.startswith("incomplete"):
        state = reason.removeprefix("incomplete").strip(" ()")
        raise QKGeomError(f"{folder}: the run is not finished ({state}); nothing to report "
                          "yet: resume it (qkgeom train ... --resume) and report it when it "
                          "is done")
    if reason.startswith("unread"):
        raise QKGeomError(f"{folder}: nothing to report: {reason}")


def excluded_count(report_dir: str | Path) -> int:
    """How many runs a written report left out (diverged, failed, unfinished): 0 for an
    E4 report (an analysis folder has no runs to leave out) or a report written before
    the count was recorded."""
    excluded = _marker(Path(report_dir)).get("excluded", 0)
    return excluded if isinstance(excluded, int) and not isinstance(excluded, bool) else 0


def summary_line(report_dir: str | Path) -> str:
    """The one-line summary of a written report ("E1/E2: 12 of 22 claim rows supported,
    1 mixed, 9 not supported, 0 not evaluated (6 claims)"), from its ``claims.csv``: the
    line ``report.md`` opens with, for a command to print."""
    path = Path(report_dir) / "claims.csv"
    if not path.is_file():
        raise QKGeomError(f"{report_dir}: no claims.csv (not a written report folder); run "
                          "`qkgeom report` first")
    try:
        claims = pd.read_csv(path)
    except (OSError, ValueError, pd.errors.EmptyDataError) as err:
        raise QKGeomError(f"{path}: unreadable ({err})") from err
    if len(claims) and not {"claim_id", "claim", "verdict"} <= set(claims.columns):
        raise QKGeomError(f"{path}: not a qkgeom claims table (no claim_id/claim/verdict)")
    if "setting" in claims.columns:  # an E1 width ladder: its own summary
        from qkgeom.analysis.e1.ladder import ladder_summary_of

        return ladder_summary_of(path.parent) or claims_summary(claims)
    return claims_summary(claims)


def _marker(folder: Path) -> dict[str, Any]:
    """The ``report.json`` of ``folder``; {} when it has none or it is not a record."""
    try:
        record = read_json(folder / REPORT_MARKER)
    except QKGeomError:
        return {}
    return record if isinstance(record, dict) else {}


def claim_report_dir(out: Path, source: Path) -> None:
    """Make ``out`` a report folder, refusing a non-empty folder that is not one (its
    files are not qkgeom's to overwrite); marks it with ``report.json``."""
    if out.exists() and not out.is_dir():
        raise QKGeomError(f"{out} exists and is not a folder; choose another --out")
    if out.is_symlink() and not out.exists():  # dangling: nothing to write into
        refuse_link(out)
    if out.is_dir() and any(out.iterdir()) and _marker(out).get("kind") != _REPORT_KIND:
        raise QKGeomError(f"{out} is not empty and is not a qkgeom report folder (no "
                          f"{REPORT_MARKER}); choose an empty or new --out: a report never "
                          "overwrites files qkgeom did not write")
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / REPORT_MARKER, {"kind": _REPORT_KIND, "source": str(source),
                                      "written": time.time(), "qkgeom": __version__})


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
