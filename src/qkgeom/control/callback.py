"""The key-spectrum control as a trainer callback (experiment E3).

It attaches in ``on_model_built``, on the fresh step-0 weights and before the optimiser
and any checkpoint (a parametrisation renames ``k_proj.weight``, which a resumed run's
checkpoint then matches); a resumed run's saved state replaces what attach measured, so
targets never come from trained weights. With ``key_control.record`` it owns the run's
``key_pr.parquet``, written whole at every checkpoint and at the end.
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
    """Steps :class:`KeySpectrumControl` after every update; ``on_probe`` hands its records
    to ``metrics.parquet``. ``run_dir`` is needed for ``record`` and for a relative
    ``reference`` (resolved against the run folder's parent: a sweep's sibling run)."""

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
        """The run's recorded rows up to ``step``, whole (at step 0 there may be none yet:
        that row waits for the first batch's Σ)."""
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
        """The control's state, the trajectory file written first (a checkpoint never refers
        to rows the file lacks)."""
        if self.control is None:
            return {}
        self._write_record()
        return self.control.state_dict()
