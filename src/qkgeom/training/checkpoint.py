"""Self-describing checkpoints, written atomically, newest-valid-wins on load.

A checkpoint holds everything a resumed run needs to continue bit for bit (weights,
optimiser, data-order and dropout RNG states, step, config) in ``RUN/checkpoints``. A torn
newest one falls back to the previous with a warning; one of another format version is an
error (resuming past it would silently retrain from an older state). Loading runs no code:
``torch.load(weights_only=True)`` only, and :func:`save_checkpoint` refuses state that would
need more. A file proves nothing about where it came from, so before a resume uses one it
must belong to the run (:func:`check_checkpoint`); a link in ``checkpoints/`` is never read
and rotation never deletes through one (docs/faults.md).
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qkgeom.errors import QKGeomError
from qkgeom.io import make_dir, write_bytes
from qkgeom.runs import (
    checkpoint_dir,
    checkpoint_path,
    list_checkpoints,
    load_config,
)

if TYPE_CHECKING:
    from qkgeom.config import TrainConfig

FORMAT_VERSION = 1
# Exact types (numpy.float64 is a float subclass, yet weights_only refuses it).
_PLAIN = (bool, int, float, str, bytes, type(None), torch.Size, torch.dtype)
_MAPPINGS = (dict, OrderedDict)


class UnsafeCheckpointError(QKGeomError):
    """A checkpoint file that ``torch.load(weights_only=True)`` refuses: it needs unpickling."""


class CheckpointError(QKGeomError):
    """A checkpoint that is not this run's, or not well formed: a resume refuses it before
    writing anything (the run's status is left as it was)."""


def read_checkpoint(path: Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU: a file that needs unpickling is
    an :class:`UnsafeCheckpointError` (its payload never runs); other failures (a torn or
    foreign file) propagate for the caller to judge."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "weights only load failed" not in str(err).lower():
            raise
        raise UnsafeCheckpointError(f"{path}: holds objects that need unpickling; qkgeom "
                                    "loads weights only (tensors, numbers, strings, lists, "
                                    "dicts) and did not load it: delete the file if you did "
                                    "not write it") from None


def _check_plain(value: Any, where: str) -> None:
    """QKGeomError unless ``value`` is made of what ``weights_only`` loading rebuilds."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return
    if type(value) in _MAPPINGS:
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, f"{where}[{key!r}]")
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    raise QKGeomError(f"checkpoint state {where} holds a {type(value).__module__}."
                      f"{type(value).__qualname__}; checkpoints hold only tensors, numbers, "
                      "strings, lists and dicts (they load with weights_only=True): convert "
                      "it in the callback's state_dict")


def is_checkpoint_step(step: int, every: int, schedule: str = "every") -> bool:
    """Whether the schedule saves a checkpoint after ``step`` updates (the trainer also
    saves the last): ``every``, each multiple of ``every``; ``log`` (Pythia's shape), step 0
    and the powers of two below ``every`` too, where the geometry moves fastest."""
    if schedule == "log" and step < every:
        return step == 0 or step & (step - 1) == 0
    return step > 0 and step % every == 0


def checkpoint_steps(steps: int, every: int, schedule: str = "every") -> list[int]:
    """Every step a run of ``steps`` updates saves a checkpoint at, in order."""
    return [s for s in range(steps + 1) if s == steps or is_checkpoint_step(s, every, schedule)]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write ``state`` for ``step`` atomically, then drop all but the newest ``keep``
    checkpoints (0: keep all; other files in the folder are left alone)."""
    _check_plain(state, "state")
    buf = io.BytesIO()
    torch.save({"format_version": FORMAT_VERSION, "step": step, **state}, buf)
    path = checkpoint_path(run_dir, step)
    make_dir(path.parent)  # never a linked checkpoints/ (rotation would delete through it)
    write_bytes(path, buf.getvalue())
    if keep > 0:
        for _, old in list_checkpoints(run_dir)[:-keep]:  # plain files only, never links
            old.unlink(missing_ok=True)
    return path


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_checkpoint(state: dict[str, Any], path: Path, cfg: TrainConfig) -> None:
    """:class:`CheckpointError` unless ``state`` belongs to the run of ``cfg`` (its config
    hash, which leaves out what a resume may change) and is well formed enough to resume
    from (step, RNG states, loss accumulator, weight mappings)."""
    from qkgeom.config import from_dict

    def refuse(why: str) -> None:
        raise CheckpointError(f"{path}: not a checkpoint of this run ({why}); the resume "
                              "stopped before writing anything: delete the file if you did "
                              "not write it, or train into a new --out")

    step = state.get("step")
    if not _is_count(step):
        refuse(f"its step is {step!r}")
    if step > cfg.steps:
        refuse(f"it holds step {step}, beyond the run's {cfg.steps} steps")
    saved = state.get("config")
    if not isinstance(saved, dict):
        refuse("it records no config")
    try:
        theirs = from_dict(saved)
    except QKGeomError as err:
        refuse(f"its config is not valid: {' '.join(str(err).split())[:120]}")
    if theirs.config_hash() != cfg.config_hash():
        changed = [k for k in sorted(set(saved) | set(cfg.to_dict()))
                   if saved.get(k) != cfg.to_dict().get(k)
                   and k not in ("device", "threads", "compile", "precision")]
        refuse(f"written by a run with another config ({', '.join(changed[:4]) or 'hash'} "
               "differ)")
    for key in ("model", "optimizer", "scaler"):
        if not isinstance(state.get(key), dict):
            refuse(f"no {key} state")
    if not all(isinstance(v, torch.Tensor) for v in state["model"].values()):
        refuse("its model weights are not all tensors")
    size = torch.Generator().get_state().numel()
    for key in ("data_rng", "torch_rng"):
        rng = state.get(key)
        if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.dim() == 1
                and rng.numel() == size):
            refuse(f"{key} is not a random-generator state")
        try:
            torch.Generator().set_state(rng)
        except (RuntimeError, ValueError, TypeError):
            refuse(f"{key} is not a random-generator state")
    acc = state.get("loss_acc", {})
    sums = [acc.get(k, 0.0) for k in ("loss_sum", "z_sum")] if isinstance(acc, dict) else [None]
    if not (isinstance(acc, dict) and all(k in ("loss_sum", "loss_n", "z_sum") for k in acc)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) for v in sums)
            and _is_count(acc.get("loss_n", 0))):
        refuse("its loss accumulator is not {loss_sum: number, loss_n: count, z_sum: number "
               "(with a z-loss)}")
    if not isinstance(state.get("callbacks", []), list):
        refuse("its callback states are not a list")


def load_latest_checkpoint(run_dir: Path, cfg: TrainConfig | None = None
                           ) -> dict[str, Any] | None:
    """The newest readable checkpoint (None when there is none), reading only. A torn one,
    or one not holding the step its name says, is skipped with a warning; all torn, another
    format version, one that needs unpickling or (with ``cfg``) one not of this run is a
    QKGeomError naming the file."""
    found = list_checkpoints(run_dir)
    for step, path in reversed(found):
        try:
            state = read_checkpoint(path)
        except UnsafeCheckpointError:
            raise
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
        if cfg is not None:
            check_checkpoint(state, path, cfg)
        return state
    if found:
        raise QKGeomError(f"{checkpoint_dir(run_dir)}: no readable checkpoint (all {len(found)} "
                          "are torn or corrupt); delete the folder's checkpoints to train the "
                          "run again from step 0")
    return None


def run_checkpoints(run: Path) -> dict[int, Path]:
    """``{step: file}`` of a run folder's checkpoints; one line when it has none."""
    found = dict(list_checkpoints(run))
    if not found:
        raise QKGeomError(f"{run}: the run folder has no checkpoints (checkpoints/ckpt_*.pt)")
    return found


def load_model(run_dir: str | Path, step: int | None = None) -> tuple[Any, int]:
    """(GPT in eval mode, step) from a run folder's checkpoint at ``step`` (default: newest)."""
    from qkgeom.model import GPT

    run = Path(run_dir)
    found = run_checkpoints(run)
    step = max(found) if step is None else step
    if step not in found:
        raise QKGeomError(f"{run}: no checkpoint at step {step}; it has steps "
                          + ", ".join(map(str, sorted(found))))
    cfg = load_config(run)
    if cfg.key_control.active and cfg.key_control.how == "parametrize":
        raise QKGeomError(f"{run}: trained with a parametrised key control; its checkpoints "
                          "store the unconstrained weights, not what the model used")
    try:
        state = read_checkpoint(found[step])
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise QKGeomError(f"{found[step]}: unreadable checkpoint ({type(err).__name__})") from None
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise QKGeomError(f"{found[step]}: not a qkgeom checkpoint (no model weights)")
    model = GPT(cfg.model)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, ValueError) as err:
        raise QKGeomError(f"{found[step]}: does not fit the run's model ({type(err).__name__}: "
                          f"{' '.join(str(err).split())[:160]})") from None
    return model.eval(), step
