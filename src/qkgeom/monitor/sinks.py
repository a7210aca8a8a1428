"""Where probe results go besides the run folder: TensorBoard and Weights & Biases.

Tag names (both loggers): ``qkgeom/<metric>/layer<l>`` for the layer-level scalars (metric
names), ``qkgeom/key_sv_weight/layer<l>`` (singular values of W_K) and
``qkgeom/key_eig_token/layer<l>`` (eigenvalues of the key covariance on the probe set) for
the per-layer histograms of the key spectrum, ``qkgeom/alerts`` for alert texts.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from qkgeom.geometry import Measurement
from qkgeom.monitor.alerts import Alert

__all__ = ["TensorBoardSink", "WandbSink", "active_wandb_run", "scalars", "wandb_module"]


def scalars(probe: Measurement) -> dict[str, float]:
    """Layer-level (head −1) values as ``{"qkgeom/<metric>/layer<l>": value}``; rows of
    layer −1 (controller records) as ``{"qkgeom/<metric>": value}``."""
    rows = probe.frame[probe.frame["head"] == -1]
    out = {}
    for layer, metric, value in zip(rows["layer"], rows["metric"], rows["value"], strict=True):
        tag = f"qkgeom/{metric}" if layer < 0 else f"qkgeom/{metric}/layer{layer}"
        out[tag] = float(value)
    return out


def _spectra(probe: Measurement) -> dict[str, Any]:
    out = {}
    for name, spectra in (("key_sv_weight", probe.key_sv_weight),
                          ("key_eig_token", probe.key_eig_token)):
        for layer, values in spectra.items():
            out[f"qkgeom/{name}/layer{layer}"] = values.numpy()
    return out


class TensorBoardSink:
    """Scalars and key-spectrum histograms into a ``SummaryWriter`` (ours or the user's).

    ``target``: a writer (anything with ``add_scalar``; left open, it is the user's) or a
    log folder (a ``torch.utils.tensorboard.SummaryWriter`` is made there and closed by
    :meth:`close`)."""

    def __init__(self, target: Any) -> None:
        if hasattr(target, "add_scalar"):
            self.writer, self._owned = target, False
        else:
            from torch.utils.tensorboard import SummaryWriter

            self.writer, self._owned = SummaryWriter(log_dir=str(Path(target))), True

    def log(self, probe: Measurement, alerts: list[Alert]) -> None:
        for tag, value in scalars(probe).items():
            self.writer.add_scalar(tag, value, probe.step)
        for tag, values in _spectra(probe).items():
            if len(values):
                self.writer.add_histogram(tag, values, probe.step)
        for alert in alerts:
            self.writer.add_text("qkgeom/alerts", alert.message, probe.step)
        self.writer.flush()

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
            define("qkgeom/step")
            define("qkgeom/*", step_metric="qkgeom/step")

    def log(self, probe: Measurement, alerts: list[Alert]) -> None:
        data: dict[str, Any] = {"qkgeom/step": probe.step, **scalars(probe)}
        if self.histogram is not None:
            data.update({tag: self.histogram(values) for tag, values in _spectra(probe).items()
                         if len(values)})
        if alerts:
            data["qkgeom/alerts"] = len(alerts)
        self.run.log(data)

    def close(self) -> None:
        """The run belongs to the user (or their trainer): nothing to close."""
