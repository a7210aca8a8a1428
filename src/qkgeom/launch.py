"""The composition root of a training run: a config -> the callbacks it asks for -> the trainer.

The trainer knows only callbacks; the features a config can switch on (key-spectrum
control, the entropy closed loop) are built here, at the edge, and nowhere else. The CLI, the sweep workers and the
Python API (``qkgeom.train``) all train through :func:`train`, so a run means the same
thing however it was started.
"""

from __future__ import annotations

from pathlib import Path

from qkgeom.config import TrainConfig
from qkgeom.training import Callback, RunResult
from qkgeom.training import train as _train_with

__all__ = ["callbacks_for", "train"]


def callbacks_for(cfg: TrainConfig, out_dir: str | Path | None = None) -> list[Callback]:
    """The callbacks that implement what ``cfg`` enables (``cfg.active_features()``).

    ``out_dir`` is the run folder: the key-control callback writes its ``key_pr.parquet``
    there (``key_control.record``) and resolves a relative ``key_control.reference``
    against its parent.
    """
    out: list[Callback] = []
    if cfg.key_control.active:  # a control, or only the per-step key-PR record
        from qkgeom.control import KeyControlCallback

        out.append(KeyControlCallback(cfg.key_control, run_dir=out_dir))
    if cfg.entropy_control.active:
        from qkgeom.control.closed_loop import EntropyControlCallback, EntropyController

        ec = cfg.entropy_control
        out.append(EntropyControlCallback(EntropyController(ec.target, gain=ec.gain,
                                                            max_step=ec.max_step)))
    return out


def train(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          callbacks: list[Callback] | None = None, progress: bool = False,
          run_id: str | None = None, progress_every: int | None = None) -> RunResult:
    """Train one run into ``out_dir`` (the run-folder layout of docs/definitions.md).

    ``callbacks`` (your own) run after those the config asks for. ``resume`` continues the
    run in ``out_dir`` from its newest checkpoint (bit-exact on CPU). ``progress``: a bar
    on a terminal, plain lines every ``progress_every`` steps (default ``probe_every``)
    in a log. Raises
    :class:`~qkgeom.errors.QKGeomError` for bad input before any work, and
    :class:`~qkgeom.errors.DivergedError` (after recording ``status: diverged``) when the
    loss or the geometry stops being finite.
    """
    return _train_with(cfg, out_dir, resume=resume,
                       callbacks=[*callbacks_for(cfg, out_dir), *(callbacks or [])],
                       progress=progress, run_id=run_id, progress_every=progress_every)
