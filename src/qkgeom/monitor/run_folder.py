"""The monitor's run folder (SPEC §7), readable by ``qkgeom show``, ``watch`` and ``report``.

``config.json``: ``run_id``; ``config``, a :class:`~qkgeom.config.TrainConfig`-shaped
mapping of what the monitor knows about the run (the model's depth, heads and width, the
probe length as ``block_size``, steps, probe cadence -- validated, so ``qkgeom show`` and
the collation read it like a training run's; keys it cannot know keep their defaults);
``monitor`` (cadence, metrics, alert rules, controller) and ``model`` (architecture,
class, GQA heads) with the facts that do not map onto a TrainConfig; ``source:
"qkgeom.monitor"``. ``metrics.parquet``: ``run_id, step, layer, head, metric, value``,
rewritten atomically after every probe. ``status.json``: ``state`` (running / done /
failed), ``step``, ``steps``, wall time and the time spent probing. ``train_log.parquet``
(``step, loss, val_loss, lr, tokens_per_s``) when losses were reported, ``alerts.json``
when an alert fired.
"""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path
from typing import Any

import pandas as pd

from qkgeom import __version__
from qkgeom.errors import QKGeomError
from qkgeom.io import read_json, write_json, write_parquet
from qkgeom.monitor.alerts import Alert

__all__ = ["RunFolder", "train_config_mapping"]

METRIC_COLUMNS = ["run_id", "step", "layer", "head", "metric", "value"]
LOG_COLUMNS = ["step", "loss", "val_loss", "lr", "tokens_per_s"]


def train_config_mapping(facts: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``facts`` a :class:`TrainConfig` accepts, validated; {} if invalid.

    ``facts``: ``n_layer, n_head, n_embd, block_size, vocab_size, steps, probe_every,
    probe_sequences, seed`` (None = unknown)."""
    from qkgeom.config import from_dict

    model = {k: facts[k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
             if facts.get(k)}
    cfg: dict[str, Any] = {"model": model}
    steps = max(1, int(facts.get("steps") or 1))
    cfg.update(steps=steps, warmup_steps=0, batch_size=int(facts.get("batch_size") or 1))
    if facts.get("probe_every"):
        cfg["probe_every"] = min(int(facts["probe_every"]), steps)
    for key in ("probe_sequences", "seed"):
        if facts.get(key) is not None:
            cfg[key] = int(facts[key])
    try:
        return from_dict(cfg).to_dict()
    except QKGeomError:
        return {}


class RunFolder:
    """Writes one monitored run into ``out`` (see the module docstring)."""

    def __init__(self, out: str | Path, run_id: str | None = None, *, resume: bool = False) -> None:
        self.out = Path(out)
        self.run_id = run_id or self.out.name
        self._metrics: list[pd.DataFrame] = []
        self._log: list[dict[str, float]] = []
        self._alerts: list[dict[str, Any]] = []
        self.started = time.time()
        self._t0 = time.perf_counter()
        self.steps = 0
        if (self.out / "config.json").exists() or (self.out / "metrics.parquet").exists():
            if not resume:
                raise QKGeomError(f"{self.out} already holds a run; pass resume=True to append "
                                  "to it or choose another out=")
            if (self.out / "metrics.parquet").exists():
                self._metrics.append(pd.read_parquet(self.out / "metrics.parquet"))
            if (self.out / "train_log.parquet").exists():
                self._log = pd.read_parquet(self.out / "train_log.parquet").to_dict("records")
        self.out.mkdir(parents=True, exist_ok=True)

    def write_config(self, facts: dict[str, Any], monitor: dict[str, Any],
                     model: dict[str, Any]) -> None:
        import torch

        self.steps = int(facts.get("steps") or 0)
        write_json(self.out / "config.json", {
            "run_id": self.run_id, "source": "qkgeom.monitor",
            "config": train_config_mapping(facts), "monitor": monitor, "model": model,
            "versions": {"qkgeom": __version__, "torch": torch.__version__,
                         "python": platform.python_version()}})

    def add_probe(self, step: int, frame: pd.DataFrame, alerts: list[Alert],
                  probe_seconds: float) -> None:
        """Append one probe's rows (replacing any earlier rows of the same step) and write."""
        frame = frame.assign(run_id=self.run_id, step=int(step))[METRIC_COLUMNS]
        self._metrics = [m[m["step"] != step] for m in self._metrics] + [frame]
        write_parquet(self.out / "metrics.parquet", pd.concat(self._metrics, ignore_index=True))
        if alerts:
            self._alerts += [dataclasses.asdict(a) | {"message": a.message} for a in alerts]
            write_json(self.out / "alerts.json", self._alerts)
        self.status("running", step, probe_seconds)

    def add_loss(self, step: int, loss: float, lr: float | None = None) -> None:
        self._log.append({"step": int(step), "loss": float(loss), "val_loss": float("nan"),
                          "lr": float("nan") if lr is None else float(lr),
                          "tokens_per_s": float("nan")})

    def status(self, state: str, step: int, probe_seconds: float) -> None:
        if self._log:
            write_parquet(self.out / "train_log.parquet", pd.DataFrame(self._log,
                                                                      columns=LOG_COLUMNS))
        write_json(self.out / "status.json", {
            "state": state, "step": int(step), "steps": max(self.steps, int(step)),
            "started": self.started, "updated": time.time(),
            "wall_s": time.perf_counter() - self._t0, "probe_s": probe_seconds})


def read_status(run: Path) -> dict[str, Any]:
    """``status.json`` of a run folder, or {} when it has none yet."""
    path = Path(run) / "status.json"
    return read_json(path) if path.exists() else {}
