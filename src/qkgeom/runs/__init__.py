"""Result folders on disk: one home for their file names, formats and records.

- the **run folder** (:mod:`.folder`, :mod:`.table`, :mod:`.writer`, :mod:`.lock`): what
  the trainer, a sweep worker and the monitor write and what ``show``, ``watch``, ``analyze``, collation
  and ``report`` read (layout: docs/definitions.md#run-folder);
- runs at a glance (:mod:`.overview`): the run folders under a folder, two runs compared;
- the **sweep folder** (:mod:`.sweep`): ``sweep.json`` and ``runs/<run_id>/``;
- the **checkpoint-family analysis folder** of E4 (:mod:`.family`).

Nothing here imports torch but :func:`.folder.run_record`, when called: readers stay light.
"""

from qkgeom.runs.folder import (
    ALERTS,
    CHECKPOINTS,
    CONFIG,
    FINAL_STATES,
    FORMAT_VERSION,
    KEY_PR,
    LOG_COLUMNS,
    METRIC_COLUMNS,
    METRICS,
    STATES,
    STATUS,
    TENSORBOARD,
    TRAIN_LOG,
    check_run_dir,
    checkpoint_dir,
    checkpoint_path,
    claim_run_dir,
    finished_state,
    foreign_entries,
    has_metrics,
    is_run_folder,
    list_checkpoints,
    load_config,
    read_alerts,
    read_log,
    read_metrics,
    read_record,
    read_status,
    read_table,
    refuse_links,
    remove_stale_temp_files,
    run_record,
    status_of,
    wide_metrics,
)
from qkgeom.runs.lock import FolderLock, RunLock, holder, lock_is_held, lock_path
from qkgeom.runs.overview import Comparison, compare_runs, find_runs, last_losses, list_runs
from qkgeom.runs.writer import RunWriter, one_line, record_failed

__all__ = [
    "ALERTS", "CHECKPOINTS", "CONFIG", "FINAL_STATES", "FORMAT_VERSION", "KEY_PR", "LOG_COLUMNS",
    "METRICS", "METRIC_COLUMNS", "STATES", "STATUS", "TENSORBOARD", "TRAIN_LOG", "Comparison",
    "FolderLock", "RunLock", "RunWriter", "check_run_dir", "compare_runs", "find_runs",
    "last_losses", "list_runs", "wide_metrics", "checkpoint_dir", "checkpoint_path",
    "claim_run_dir", "finished_state", "foreign_entries", "has_metrics", "holder", "is_run_folder",
    "list_checkpoints", "load_config", "lock_is_held", "lock_path", "one_line",
    "read_alerts", "read_log", "read_metrics", "read_record", "read_status", "read_table",
    "record_failed", "refuse_links", "remove_stale_temp_files", "run_record", "status_of",
]
