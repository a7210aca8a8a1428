"""Self-describing checkpoints, written atomically, newest-valid-wins on load.

A checkpoint holds everything a resumed run needs to continue bit-for-bit: weights,
optimiser state, the data-order generator state, torch's global RNG (dropout), the step
and the config. Files are ``ckpt_{step:08d}.pt`` in ``RUN/checkpoints``; a torn or
unreadable newest checkpoint falls back to the previous one with a warning.
"""

from __future__ import annotations

import io
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from qkgeom.io import write_bytes

FORMAT_VERSION = 1
_NAME = re.compile(r"ckpt_(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint, oldest first."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.search(p.name))]
    return sorted(found)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` for ``step`` atomically, then drop all but the newest ``keep``."""
    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, **state}, buf)
    path = checkpoint_dir(run_dir) / f"ckpt_{step:08d}.pt"
    write_bytes(path, buf.getvalue())
    for _, old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The newest readable checkpoint, or None when there is none."""
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # torn / corrupt file: fall back to an older one
            warnings.warn(f"{path}: unreadable checkpoint ({type(err).__name__}); "
                          "falling back to the previous one", stacklevel=2)
            continue
        if state.get("format_version") != FORMAT_VERSION or state.get("step") != step:
            warnings.warn(f"{path}: checkpoint of another format version; skipped", stacklevel=2)
            continue
        return state
    return None
