"""The key-spectrum control as a trainer callback (experiment E3).

Event order (:mod:`qkgeom.training.callbacks`): the control attaches in ``on_model_built``
(fresh step-0 weights, before the optimiser and any checkpoint: a parametrisation renames
``k_proj.weight`` to ``k_proj.parametrizations.weight.original``, which the checkpoint of a
resumed run then matches); a resumed run's saved state (step-0 PRs, step counter, window
counters, the input moments S) replaces what was measured at attach time in
``load_state_dict``, so targets never come from trained weights.

With ``key_control.record`` the callback also owns the run's ``key_pr.parquet``: it is
written whole (atomically) whenever the trainer takes the callback's state for a
checkpoint and at the end of training, and a resumed run keeps its rows up to the resumed
step. A run with ``mode: none, record: true`` only measures: it never writes a weight.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.config import KeyControlConfig
from qkgeom.control.keyspectrum import KeySpectrumControl
from qkgeom.control.trajectory import FIELDS, frame_to_trajectory, read_key_pr, write_key_pr
from qkgeom.errors import QKGeomError
from qkgeom.runs import KEY_PR
from qkgeom.training.callbacks import Callback

if TYPE_CHECKING:
    import pandas as pd

    from qkgeom.training.callbacks import TrainContext

__all__ = ["KeyControlCallback"]


class KeyControlCallback(Callback):
    """Attaches :class:`KeySpectrumControl` to the trainer's model and steps it after every
    update. ``on_probe`` returns the records since the previous probe (``ctl_target_l0``,
    ``ctl_bound_share_l0``, ...) so they land in ``metrics.parquet`` next to the probe
    metrics. ``run_dir`` (the run folder) is needed for ``record`` and for a relative
    ``reference``, which is resolved against the run folder's parent (in a sweep: the
    sibling run of that id)."""

    feature = "key_control"

    def __init__(self, settings: KeyControlConfig, *, run_dir: str | Path | None = None,
                 layers: list[int] | None = None) -> None:
        self.settings, self.layers = settings, layers
        self.run_dir = None if run_dir is None else Path(run_dir)
        if self.run_dir is None and (settings.record or (
                settings.reference and not Path(settings.reference).is_absolute())):
            raise QKGeomError("key_control.record and a relative key_control.reference need "
                              "the run folder: build the callback with run_dir (qkgeom.train "
                              "does)")
        self.control: KeySpectrumControl | None = None
        self._restored = False

    @property
    def reference_dir(self) -> Path | None:
        """The reference run folder, or None."""
        ref = self.settings.reference
        if not ref:
            return None
        path = Path(ref)
        return path if path.is_absolute() or self.run_dir is None else self.run_dir.parent / path

    def on_model_built(self, ctx: TrainContext) -> None:
        s = self.settings
        ramp = ctx.config.warmup_steps if s.ramp_steps < 0 else s.ramp_steps
        self.control = KeySpectrumControl.attach(
            ctx.model, s.mode, level=s.level, scope=s.scope, scale=s.scale, dose=s.dose,
            ramp_steps=ramp, reference=self.reference_dir, how=s.how, layers=self.layers,
            record=s.record)
        table = self.control.reference
        if table is not None and table["pr"].shape[0] <= ctx.config.steps:
            raise QKGeomError(f"{self.reference_dir / KEY_PR}: the reference run's key PR "
                              f"ends at step {table['pr'].shape[0] - 1}, this run trains "
                              f"{ctx.config.steps} steps; train the reference to its end first")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.control is None:
            raise QKGeomError("key control state given before the model was built")
        self.control.load_state_dict(state)
        if self.settings.record:
            self.control.trajectory = self._saved_trajectory(self.control.step_count)
        self._restored = True

    def _saved_trajectory(self, step: int) -> tuple[list[int], dict[str, list[Any]]]:
        """The run's recorded rows up to ``step``; they must be whole to go on. At step 0
        there may be none yet: the step-0 row waits for the first training batch's Σ."""
        where = self.run_dir / KEY_PR
        frame = read_key_pr(self.run_dir, upto=step)
        if step == 0 and (frame is None or frame.empty):
            return [], {f: [] for f in FIELDS}
        if frame is None:
            raise QKGeomError(f"{where}: missing, so the run's key PR trajectory cannot be "
                              "continued whole; train the run again into a new folder")
        steps, values = frame_to_trajectory(frame, self.control.names, str(where))
        if steps != list(range(step + 1)):
            raise QKGeomError(f"{where}: the trajectory does not reach the resumed step "
                              f"{step} without gaps; train the run again into a new folder")
        return steps, values

    def on_train_start(self, ctx: TrainContext) -> None:
        if ctx.step > 0 and not self._restored:
            raise QKGeomError(f"resuming at step {ctx.step} with key control "
                              f"{self.settings.mode!r}, but the checkpoint holds no key-control "
                              "state (was the run started without it?)")

    def on_step_end(self, ctx: TrainContext) -> None:
        self.control.step(ctx.step)

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        out = self.control.last()
        self.control.reset_window()
        return out or None

    def on_train_end(self, ctx: TrainContext) -> None:
        self._write_record()

    def _write_record(self) -> None:
        if self.settings.record and self.control is not None:
            write_key_pr(self.run_dir, *self.control.trajectory, self.control.names)

    def state_dict(self) -> dict[str, Any]:
        """The control's state; with ``record`` the trajectory file is written first, so a
        checkpoint never refers to rows the file lacks."""
        if self.control is None:
            return {}
        self._write_record()
        return self.control.state_dict()
