"""Where probe results go besides the run folder: TensorBoard and Weights & Biases.

Both get the same tags, ``<family>/<name>/layer<l>`` (:func:`tag`), so each family of
metrics has its own panel, and ``.../layer<l>/head<h>`` for the :data:`HEAD_METRICS`, which
practitioners read per head; W&B puts them on their own step axis ``qkgeom/step``. The tags:
docs/monitor.md#where-the-results-go.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom.alerts import Alert
from qkgeom.errors import QKGeomError
from qkgeom.geometry import Measurement

__all__ = ["FAMILIES", "HEAD_METRICS", "STEP_AXIS", "TensorBoardSink", "WandbSink",
           "active_wandb_run", "scalars", "tag", "wandb_module"]

#: Metric-name prefix -> TensorBoard/W&B section (the rest of the name follows it).
FAMILIES = (("pr_", "pr"), ("contrast_", "contrast"), ("attn_", "attention"))
#: Other metrics of the attention section, under their own names.
_ATTENTION = ("entropy_min", "sink_mass", "q_norm_max", "k_norm_max")
#: Metrics logged per head as well as per layer: the largest logit (Megatron's
#: ``--log-max-attention-logit``, what QK-Clip acts on), the sink mass and the norm bound.
HEAD_METRICS = ("logit_max", "sink_mass", "q_norm_max", "k_norm_max", "logit_bound")
STEP_AXIS = "qkgeom/step"  # W&B's x axis for every qkgeom value
_SECTIONS = ("pr", "contrast", "attention", "control", "key_spectrum", "train", "alerts")


def tag(metric: str, layer: int = -1, head: int = -1) -> str:
    """The logger tag of ``metric`` at ``layer`` (−1: a flat record) and ``head`` (−1: the
    layer), e.g. ``tag("pr_q_token", 0) == "pr/q_token/layer0"``, ``tag("logit_max", 1, 3)
    == "attention/logit_max/layer1/head3"``."""
    family, name = "control", metric
    for prefix, section in FAMILIES:
        if metric.startswith(prefix):
            family, name = section, metric[len(prefix):]
            break
    else:
        if metric.startswith("logit_") or metric in _ATTENTION:
            family = "attention"
    if layer < 0:
        return f"{family}/{name}"
    return f"{family}/{name}/layer{layer}" + (f"/head{head}" if head >= 0 else "")


def scalars(frame: pd.DataFrame) -> dict[str, float]:
    """Layer-level (head −1) values of a probe's long ``frame``, and the head rows of the
    :data:`HEAD_METRICS`, as ``{tag: value}`` (:func:`tag`); token-block rows (``block``
    >= 0) are left out."""
    rows = frame[(frame["head"] == -1) | frame["metric"].isin(HEAD_METRICS)]
    if "block" in rows:
        rows = rows[rows["block"] < 0]
    return {tag(metric, int(layer), int(head)): float(value)
            for layer, head, metric, value in zip(rows["layer"], rows["head"], rows["metric"],
                                                  rows["value"], strict=True)}


def _spectra(probe: Measurement) -> dict[str, Any]:
    """The probe's non-empty key spectra by tag."""
    return {f"key_spectrum/{name}/layer{layer}": values.numpy()
            for name, spectra in (("sv_weight", probe.key_sv_weight),
                                  ("eig_token", probe.key_eig_token))
            for layer, values in spectra.items() if len(values)}


def _train_scalars(row: dict[str, float]) -> dict[str, float]:
    """A training-log row as ``{"train/loss": ...}`` (NaN entries left out)."""
    import math

    return {f"train/{k}": float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}


class TensorBoardSink:
    """Scalars and key-spectrum histograms into a ``SummaryWriter``: ``target`` is the
    user's writer (left open) or a log folder (a writer of ours, closed by
    :meth:`close`)."""

    def __init__(self, target: Any) -> None:
        if hasattr(target, "add_scalar"):
            self.writer, self._owned = target, False
        else:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # torch's writer needs the tensorboard package
                raise QKGeomError("TensorBoard logging needs the tensorboard package: pip "
                                  "install 'qkgeom[tensorboard]'") from None
            self.writer, self._owned = SummaryWriter(log_dir=str(Path(target))), True

    def log(self, probe: Measurement, alerts: Iterable[Alert] = ()) -> None:
        """A probe: its scalars (:func:`scalars`), key-spectrum histograms and alert texts."""
        self.log_frame(probe.step, probe.frame)
        for name, values in _spectra(probe).items():
            self.writer.add_histogram(name, values, probe.step)
        for alert in alerts:
            self.writer.add_text("alerts", alert.message, probe.step)
        self.writer.flush()

    def log_frame(self, step: int, frame: pd.DataFrame) -> None:
        """The scalars (:func:`scalars`) of a probe's long ``frame`` at ``step``."""
        for name, value in scalars(frame).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_train(self, row: dict[str, float]) -> None:
        """A row of the training log (``train/loss`` ...) at its ``step``."""
        for name, value in _train_scalars(row).items():
            self.writer.add_scalar(name, value, int(row["step"]))

    def close(self) -> None:
        if self._owned:
            self.writer.close()


def wandb_module() -> Any | None:
    """The ``wandb`` module if installed, else None (imported on first need only)."""
    if "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
        return None
    import wandb

    return wandb


def active_wandb_run() -> tuple[Any, Any] | None:
    """``(wandb module, wandb.run)`` when W&B is installed and a run is active, else None."""
    module = wandb_module()
    run = getattr(module, "run", None) if module is not None else None
    return None if run is None else (module, run)


class WandbSink:
    """Scalars (and histograms, ``wandb.Histogram``) into a W&B run, on their own step axis
    ``qkgeom/step`` so they never fight the trainer's step counter."""

    def __init__(self, run: Any, histogram: Any = None) -> None:
        self.run, self.histogram = run, histogram
        define = getattr(run, "define_metric", None)
        if define is not None:
            define(STEP_AXIS)
            for section in _SECTIONS:
                define(f"{section}/*", step_metric=STEP_AXIS)

    def log(self, probe: Measurement, alerts: Iterable[Alert] = ()) -> None:
        """A probe: its scalars (:func:`scalars`), key-spectrum histograms, the alert count."""
        data: dict[str, Any] = {STEP_AXIS: probe.step, **scalars(probe.frame)}
        if self.histogram is not None:
            data.update({name: self.histogram(values) for name, values in _spectra(probe).items()})
        alerts = list(alerts)
        if alerts:
            data["alerts/count"] = len(alerts)
        self.run.log(data)

    def log_frame(self, step: int, frame: pd.DataFrame) -> None:
        """The scalars (:func:`scalars`) of a probe's long ``frame`` at ``step``."""
        self.run.log({STEP_AXIS: step, **scalars(frame)})

    def log_train(self, row: dict[str, float]) -> None:
        """A row of the training log (``train/loss`` ...) at its ``step``."""
        self.run.log({STEP_AXIS: int(row["step"]), **_train_scalars(row)})

    def close(self) -> None:
        """The run belongs to the user (or their trainer): nothing to close."""
