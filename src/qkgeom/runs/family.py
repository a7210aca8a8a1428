"""The folder of a checkpoint-family analysis (experiment E4), written by
:func:`qkgeom.checkpoints.analyze_checkpoints` and read by the E4 report::

    DIR/
      analysis.json          model, text, tokens, settings (and their hash), state
      metrics.parquet        run_id, checkpoint, step, layer, head, metric, value,
                             duplicate_of, in_trends
      checkpoints.parquet    per checkpoint: step and its source, Q/K hash, duplicate_of,
                             in_trends, tokens, tokens/s
      checkpoints/<name>.*   the per-checkpoint cache (parquet + a .json completion marker)
"""

from __future__ import annotations

from pathlib import Path

MARKER = "analysis.json"
FORMAT_VERSION = 1
CHECKPOINT_TABLE = "checkpoints.parquet"
CACHE = "checkpoints"


def is_analysis_folder(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()
