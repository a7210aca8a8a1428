"""The folder of a checkpoint-family analysis (experiment E4), written by
:func:`qkgeom.checkpoints.analyze_checkpoints` and read by the E4 report::

    DIR/
      analysis.json          model, text, tokens, settings (and their hash), state; and
                             text_ran_out when the text held fewer tokens than asked for
      metrics.parquet        run_id, checkpoint, step, layer, head, metric, value,
                             duplicate_of, in_trends
      checkpoints.parquet    per checkpoint: step and its source, Q/K hash, duplicate_of,
                             in_trends, tokens, tokens/s
      checkpoints/<name>.*   the per-checkpoint cache (parquet + a .json completion marker)
"""

from __future__ import annotations

from pathlib import Path

from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json

MARKER = "analysis.json"
FORMAT_VERSION = 1
CHECKPOINT_TABLE = "checkpoints.parquet"
CACHE = "checkpoints"


def is_analysis_folder(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def record_text_shortfall(path: str | Path) -> str | None:
    """When the text ran out before the ``max_tokens`` an analysis asked for: record it in
    ``analysis.json`` (``text_ran_out``: tokens asked for and analysed) and return a
    one-line warning; None when every checkpoint got the tokens it asked for."""
    import pandas as pd

    folder = Path(path)
    meta = read_json(folder / MARKER)
    table = folder / CHECKPOINT_TABLE
    if not isinstance(meta, dict) or not table.is_file():
        return None
    asked = int(meta.get("settings", {}).get("max_tokens", 0))
    try:
        got = int(pd.read_parquet(table, columns=["tokens"])["tokens"].min())
    except Exception as err:
        raise QKGeomError(f"{table}: unreadable ({type(err).__name__})") from None
    if got >= asked:
        return None
    write_json(folder / MARKER, {**meta, "text_ran_out": {"max_tokens": asked, "tokens": got}})
    text = meta.get("settings", {}).get("text")
    return (f"the text {text!r} ran out after {got:,} tokens, fewer than the {asked:,} asked "
            f"for (--tokens); every checkpoint was analysed on those {got:,} tokens (recorded "
            f"in {folder / MARKER})")
