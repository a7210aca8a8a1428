"""Self-describing checkpoints, written atomically, newest-valid-wins on load.

A checkpoint holds everything a resumed run needs to continue bit-for-bit: weights,
optimiser state, the data-order generator state, torch's global RNG (dropout), the step
and the config. Files are ``ckpt_{step:08d}.pt`` in ``RUN/checkpoints`` (names:
:mod:`qkgeom.runs`); a torn or
unreadable newest checkpoint falls back to the previous one with a one-line warning. A
checkpoint of another format version is an error (never silently skipped: resuming past it
would retrain from an older state, or from scratch, without saying so). Temp files left by
a write that was killed are removed when a run resumes.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch

from qkgeom.errors import QKGeomError
from qkgeom.io import write_bytes
from qkgeom.runs import (
    checkpoint_dir,
    checkpoint_path,
    list_checkpoints,
    load_config,
    remove_stale_temp_files,
)

FORMAT_VERSION = 1


def is_checkpoint_step(step: int, every: int, schedule: str = "every") -> bool:
    """Whether the schedule saves a checkpoint after ``step`` updates (the trainer also
    saves the last step). ``every``: each positive multiple of ``every``. ``log`` (the shape
    of Pythia's suite, for checkpoint families): step 0, the powers of two below ``every``
    (1, 2, 4, ...), then each multiple of ``every``, so the early steps, where the geometry
    moves fastest, are sampled densely."""
    if schedule == "log" and step < every:
        return step == 0 or step & (step - 1) == 0
    return step > 0 and step % every == 0


def checkpoint_steps(steps: int, every: int, schedule: str = "every") -> list[int]:
    """Every step a run of ``steps`` updates saves a checkpoint at, in order."""
    return [s for s in range(steps + 1) if s == steps or is_checkpoint_step(s, every, schedule)]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` for ``step`` atomically, then drop all but the newest ``keep``
    (``keep = 0``: keep all)."""
    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, **state}, buf)
    path = checkpoint_path(run_dir, step)
    write_bytes(path, buf.getvalue())
    if keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def load_latest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The newest readable checkpoint, or None when there is none.

    A torn or unreadable file (or one whose content is not the step its name says) is
    skipped with a one-line warning and the previous one is used; when every checkpoint
    is unreadable, a QKGeomError says so rather than silently starting over. A checkpoint
    written in another format version raises QKGeomError naming the file.
    """
    remove_stale_temp_files(run_dir)
    found = list_checkpoints(run_dir)
    for step, path in reversed(found):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # torn / corrupt file: fall back to an older one
            warnings.warn(f"{path}: unreadable checkpoint ({type(err).__name__}); "
                          "falling back to the previous one", stacklevel=2)
            continue
        if not isinstance(state, dict) or "format_version" not in state:
            warnings.warn(f"{path}: not a qkgeom checkpoint; falling back to the previous one",
                          stacklevel=2)
            continue
        version = state["format_version"]
        if version != FORMAT_VERSION:
            newer = isinstance(version, int) and version > FORMAT_VERSION
            raise QKGeomError(
                f"{path}: checkpoint format {version!r}, this qkgeom reads format "
                f"{FORMAT_VERSION}; " + ("upgrade qkgeom to resume this run" if newer else
                                         "resume it with the qkgeom version that wrote it, or "
                                         "train again into a new --out"))
        if state.get("step") != step:
            warnings.warn(f"{path}: holds step {state.get('step')!r}, not {step} (renamed?); "
                          "falling back to the previous one", stacklevel=2)
            continue
        return state
    if found:
        raise QKGeomError(f"{checkpoint_dir(run_dir)}: no readable checkpoint (all {len(found)} "
                          "are torn or corrupt); delete the folder's checkpoints to train the "
                          "run again from step 0")
    return None


def load_model(run_dir: str | Path, step: int | None = None) -> tuple[Any, int]:
    """(GPT in eval mode, step) from a run folder's checkpoint at ``step`` (default: newest)."""
    from qkgeom.model import GPT

    run = Path(run_dir)
    found = dict(list_checkpoints(run))
    if not found:
        raise QKGeomError(f"{run}: the run folder has no checkpoints (checkpoints/ckpt_*.pt)")
    step = max(found) if step is None else step
    if step not in found:
        raise QKGeomError(f"{run}: no checkpoint at step {step}; it has steps "
                          + ", ".join(map(str, sorted(found))))
    cfg = load_config(run)
    if cfg.key_control.active and cfg.key_control.how == "parametrize":
        raise QKGeomError(f"{run}: trained with a parametrised key control; its checkpoints "
                          "store the unconstrained weights, not what the model used")
    try:
        state = torch.load(found[step], map_location="cpu", weights_only=False)
    except Exception as err:
        raise QKGeomError(f"{found[step]}: unreadable checkpoint ({type(err).__name__})") from None
    model = GPT(cfg.model)
    model.load_state_dict(state["model"])
    return model.eval(), step
