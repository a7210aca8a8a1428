"""``GeometryMonitor``: the Q/K geometry of a model while someone else trains it.

Each probe is :func:`qkgeom.geometry.measure` on a fixed probe set, so training computes
exactly what it would unmonitored and the numbers are the trainer's. Cadence, sinks, the run
folder (rank 0 only, under its lock :data:`MONITOR_LOCK`) and what the integrations call:
docs/monitor.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from torch import nn

from qkgeom.alerts import Alert, AlertRule, Alerts, as_rules
from qkgeom.arch import QK_SITES, adapter_for
from qkgeom.config import TrainConfig
from qkgeom.control.closed_loop import EntropyController
from qkgeom.errors import QKGeomError
from qkgeom.geometry import LAYER, Measurement, measure, records_to_frame, resolve_metrics
from qkgeom.geometry.measure import PRECISIONS
from qkgeom.io import write_json
from qkgeom.monitor.probe_input import DEFAULT_PROBE_SEQUENCES, probe_batch
from qkgeom.monitor.sinks import TensorBoardSink, WandbSink, active_wandb_run
from qkgeom.runs import (
    ALERTS,
    CONFIG,
    METRIC_COLUMNS,
    RunLock,
    RunWriter,
    foreign_entries,
    read_alerts,
    read_record,
    run_record,
)

__all__ = ["DEFAULT_EVERY", "DEFAULT_METRICS", "GeometryMonitor", "train_config_mapping"]

DEFAULT_EVERY = 200
#: The monitor's lock file, inside its run folder: out= is often inside a folder another
#: tool owns (a Trainer's output_dir), where the monitor writes nothing beside it.
MONITOR_LOCK = ".qkgeom-monitor.lock"
DEFAULT_METRICS = ("pr_q_token", "pr_k_token", "contrast_token", "pr_qk_weight", "attn_entropy",
                   "entropy_min", "sink_mass", "logit_max", "q_norm_max", "k_norm_max",
                   "logit_bound")


class GeometryMonitor:
    """Probe Q/K geometry of ``model`` during training and log it where you already look.

    ``model``: anything :func:`qkgeom.arch.adapter_for` supports. ``probe``: token ids
    (n_seq, T), a batch with ``input_ids`` (and an ``attention_mask``), or text with
    ``tokenizer=`` (:mod:`qkgeom.monitor.probe_input`; ``seq_len``, ``n_seq`` and, for
    encoders, ``special_tokens`` shape its windows). ``every``: a cadence in optimiser steps
    or a list of steps. ``metrics``: names, ``"contrast"`` or ``"all"`` (those the alerts or
    the controller read are added). ``batch_size``, ``qk_site``, ``precision``: as
    :func:`~qkgeom.geometry.measure`. ``out`` (``resume``, ``run_id``): a run folder.
    ``total_steps``: the run's length if known. ``tensorboard``: a writer, a folder,
    ``"auto"`` (the trainer's own, found by an integration) or off; ``wandb``: ``"auto"``
    (the active run) or off; ``histograms``: the key spectra too. ``alerts``: rules, or
    mappings of their fields from a config file, checked here (default
    :data:`~qkgeom.alerts.DEFAULT_RULES`), ``on_alert`` a hook. ``control``: an
    :class:`EntropyController` closing the loop (then training changes, on purpose)."""

    def __init__(self, model: nn.Module, probe: Any, *, every: int | Iterable[int] = DEFAULT_EVERY,
                 metrics: str | Iterable[str] = DEFAULT_METRICS, tokenizer: Any = None,
                 seq_len: int | None = None, n_seq: int = DEFAULT_PROBE_SEQUENCES,
                 special_tokens: bool = True, batch_size: int = 8, qk_site: str = "post-rotary",
                 precision: str = "float64", out: str | Path | None = None, run_id: str | None = None,
                 resume: bool = False, total_steps: int | None = None,
                 config: Mapping[str, Any] | None = None,
                 record: Mapping[str, Any] | None = None,
                 tensorboard: Any = "auto", wandb: str | bool | None = "auto",
                 histograms: bool = True,
                 alerts: Iterable[AlertRule | Mapping[str, Any]] | None = None,
                 on_alert: Callable[[Alert], None] | None = None,
                 control: EntropyController | None = None) -> None:
        if qk_site not in QK_SITES:
            raise QKGeomError(f"unknown qk_site {qk_site!r}; choose one of {', '.join(QK_SITES)}")
        if batch_size < 1:
            raise QKGeomError(f"batch_size must be >= 1, got {batch_size}")
        if precision not in PRECISIONS:
            raise QKGeomError(f"unknown precision {precision!r}; choose one of "
                              f"{', '.join(PRECISIONS)}")
        self.model, self.precision = model, precision
        self.adapter = adapter_for(model)
        self.special_tokens = bool(special_tokens) and not self.adapter.causal
        self.ids, self.attention_mask = probe_batch(
            probe, tokenizer=tokenizer, seq_len=seq_len, n_seq=n_seq,
            max_positions=self.adapter.max_positions, special_tokens=self.special_tokens)
        self.every = _cadence(every)
        self.alerts = Alerts(as_rules(alerts), on_alert)
        self.control = control
        self.requested = resolve_metrics(metrics)
        needed = set(self.alerts.metrics) | ({"attn_entropy"} if control is not None else set())
        self.metrics = self.requested + tuple(sorted(needed - set(self.requested)))
        self.batch_size, self.qk_site, self.histograms = batch_size, qk_site, histograms
        self.total_steps = total_steps
        self.config, self.record = dict(config or {}), _extra_record(record)
        if self.config:  # refused now, in one line, before the user's training starts
            length = {} if total_steps else {"steps": TrainConfig().steps}  # known at start()
            train_config_mapping(self._facts(), {**length, **self.config})
        self.run_id = run_id or (Path(out).name if out is not None else "monitor")
        self._out, self._resume = (Path(out) if out is not None else None), resume
        self.folder: RunWriter | None = None  # opened by start(), on rank 0
        self._lock: RunLock | None = None
        writes = _rank() == 0
        if self._out is not None and writes:
            _check_folder(self._out, resume)  # fail now, before the user's training starts
        self._tb_auto = isinstance(tensorboard, str) and tensorboard == "auto"
        off = tensorboard is None or tensorboard is False
        self.tensorboard = (None if off or self._tb_auto or not writes
                            else TensorBoardSink(tensorboard))
        self._wandb_on = writes and wandb is not None and wandb is not False
        self._wandb: WandbSink | None = None
        self.probes: list[Measurement] = []
        self._alerts: list[dict[str, Any]] = []
        self.probe_seconds = 0.0
        self._last_step: int | None = None
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ cadence

    def due(self, step: int) -> bool:
        """Whether ``step`` is a probe step (and not probed yet)."""
        if self.probes and self.probes[-1].step == step:
            return False
        if isinstance(self.every, int):
            return step % self.every == 0
        return step in self.every

    def start(self, step: int = 0, *, total_steps: int | None = None,
              tensorboard: Any = None) -> Measurement | None:
        """Begin a run at ``step``: open the folder, write the config, attach the
        controller, probe. The integrations call it at train start; in a plain loop
        ``start(0)`` probes the initialisation (else :meth:`step` starts the run and probes
        only when due)."""
        if self._started:
            return None
        self._begin(step, total_steps, tensorboard)
        return self.probe(step)

    def _begin(self, step: int, total_steps: int | None, tensorboard: Any) -> None:
        self._started = True
        self.total_steps = total_steps or self.total_steps
        if _rank() != 0:  # distributed, not rank 0: probe, write nothing
            self.tensorboard, self._wandb_on, self._tb_auto = None, False, False
        elif self._out is not None:
            # inside its own folder: nothing is written beside out= (a Trainer's folder)
            self._lock = RunLock(self._out, self._out / MONITOR_LOCK).require(
                "start the monitor")
            try:
                _check_folder(self._out, self._resume)
                self._out.mkdir(parents=True, exist_ok=True)
                writer = RunWriter(self._out, self.run_id, resume=self._resume)
                if self._resume:
                    writer.restore()  # the run an earlier attempt wrote
                    self._take_up_alerts(writer, step)
                self.folder = writer
            except BaseException:
                self._lock.release()
                raise
        if self._tb_auto and tensorboard is not None and self.tensorboard is None:
            self.tensorboard = TensorBoardSink(tensorboard)
        if self.control is not None:
            self.control.attach(self.model)
        self._write_config()
        self._last_step = step

    def _take_up_alerts(self, writer: RunWriter, step: int) -> None:
        """A resumed run keeps the alerts its earlier attempts recorded before ``step`` (the
        step training resumes from; later ones fire again if training gets there again)
        and its rules continue where they were: the probes recorded before ``step``
        replayed through them (:meth:`Alerts.replay`: baselines, active conditions, rates),
        so it fires what an uninterrupted run would. One limit: ``logit_delta`` needs the
        previous probe's logits, which no file keeps, so it is unmeasured (NaN) at the
        first probe after the resume."""
        recorded = writer.metrics
        earlier = recorded[recorded["step"] < step]
        if len(earlier):
            self.alerts.replay(earlier)
        self._alerts = [a for a in read_alerts(writer.out)
                        if not (isinstance(a.get("step"), int) and a["step"] >= step)]

    def step(self, step: int, *, loss: float | None = None, lr: float | None = None,
             val_loss: float | None = None) -> Measurement | None:
        """After an optimiser update: ``step`` = updates done so far. Applies the
        controller (if any), records ``loss`` and ``val_loss`` (with ``lr``), probes when
        due. Returns the probe or None."""
        step = int(step)
        if not self._started:
            self._begin(step, None, None)
        elif step == self._last_step:  # gradient accumulation: one update, several calls
            return None
        self._last_step = step
        if self.control is not None:
            self.control.after_step(step)
        if loss is not None or val_loss is not None:
            self.log_loss(step, loss, lr, val_loss=val_loss)
        if self.due(step):
            return self.probe(step)
        if self.folder is not None:
            self.folder.heartbeat(step)  # status.json between probes (every 30 s)
        return None

    def log_loss(self, step: int, loss: Any = None, lr: float | None = None, *,
                 val_loss: Any = None) -> None:
        """Record a training and/or validation loss (floats or scalar tensors; None: not
        measured, NaN in the log) in the run folder's log."""
        if self.folder is not None:
            self.folder.add_log({"step": step, "loss": _number(loss),
                                 "val_loss": _number(val_loss), "lr": _number(lr)})

    # ------------------------------------------------------------------ probing

    def probe(self, step: int) -> Measurement:
        """Measure now, log everywhere, check the alerts, update the controller."""
        spectra = self.histograms and (self.tensorboard is not None or self._wandb_sink()
                                       is not None)
        previous = self.probes[-1] if self.probes else None
        probe = measure(self.model, self.ids, attention_mask=self.attention_mask,
                        metrics=self.metrics, batch_size=self.batch_size,
                        qk_site=self.qk_site, precision=self.precision, spectra=spectra,
                        previous=previous)
        if previous is not None:
            previous.logit_windows = {}  # only the newest probe's are needed (memory)
        probe.step = int(step)
        self.probe_seconds += probe.seconds
        fired = self.alerts.check(step, probe.frame)
        if self.control is not None:
            self.control.update(probe.layer_values("attn_entropy"))
            extra = records_to_frame({LAYER: [(LAYER, k, float(v))
                                              for k, v in self.control.records().items()]})
            probe.frame = pd.concat([probe.frame, extra], ignore_index=True)
        self.probes.append(probe)
        if self.folder is not None:
            self.folder.add_metrics(probe.frame, step, replace=True)
            self.folder.flush()
            if fired:
                self._alerts += [dataclasses.asdict(a) | {"message": a.message} for a in fired]
                write_json(self.folder.out / ALERTS, self._alerts)
            self.folder.status("running", step, probe_s=self.probe_seconds)
        for sink in (self.tensorboard, self._wandb_sink()):
            if sink is not None:
                sink.log(probe, fired)
        return probe

    def _wandb_sink(self) -> WandbSink | None:
        active = active_wandb_run() if self._wandb_on else None
        if active is None:
            return None
        module, run = active
        if self._wandb is None or self._wandb.run is not run:
            self._wandb = WandbSink(run, getattr(module, "Histogram", None))
        return self._wandb

    # ------------------------------------------------------------------ results

    @property
    def last(self) -> Measurement | None:
        """The newest probe (its ``repr`` is one line; ``.frame`` holds the numbers)."""
        return self.probes[-1] if self.probes else None

    def __repr__(self) -> str:
        every = self.every if isinstance(self.every, int) else f"{len(self.every)} steps"
        n = len(self.probes)
        probes = (f"{n} probe{'' if n == 1 else 's'}, last at step {self.probes[-1].step}"
                  if self.probes else "no probe yet")
        where = f", out={self._out}" if self._out is not None else ""
        return (f"GeometryMonitor({self.adapter.arch}, {self.adapter.n_layer} layers, "
                f"every={every}, {probes}{where})")

    @property
    def fired(self) -> list[Alert]:
        """Every alert fired so far."""
        return self.alerts.fired

    @property
    def history(self) -> pd.DataFrame:
        """All probes: ``run_id, step, layer, head, metric, value``."""
        if not self.probes:
            return pd.DataFrame(columns=METRIC_COLUMNS)
        frames = [p.frame.assign(run_id=self.run_id, step=p.step)[METRIC_COLUMNS]
                  for p in self.probes]
        return pd.concat(frames, ignore_index=True)

    def overhead(self) -> dict[str, float]:
        """``probes``, ``probe_s`` (total), ``per_probe_s`` (mean)."""
        n = len(self.probes)
        return {"probes": n, "probe_s": self.probe_seconds,
                "per_probe_s": self.probe_seconds / n if n else math.nan}

    # ------------------------------------------------------------------ closing

    def close(self, state: str = "done", step: int | None = None, **status: Any) -> None:
        """Finish: probe the last step if not yet (state ``done``), write the final status
        (with ``status``'s keys, e.g. ``diverged_step`` and ``message`` of a divergence),
        close writers it opened. Idempotent."""
        if self._closed:
            return
        self._closed = True
        step = self._last_step if step is None else int(step)
        if state == "done" and step is not None and (not self.probes or
                                                     self.probes[-1].step != step):
            self.probe(step)
        try:
            if self.folder is not None and step is not None:
                if self.total_steps is None:
                    self.total_steps = step
                    self._write_config()
                self.folder.compact()
                self.folder.status(state, step, probe_s=self.probe_seconds, **status)
            if self.tensorboard is not None:
                self.tensorboard.close()
        finally:
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> GeometryMonitor:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close("done" if exc_type is None else "failed")

    def _facts(self) -> dict[str, Any]:
        """What the monitor knows of the run, for :func:`train_config_mapping`."""
        site = self.adapter.sites[0]
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        return {"n_layer": self.adapter.n_layer, "n_head": site.n_head,
                "n_embd": site.d_model, "block_size": int(self.ids.shape[1]),
                "vocab_size": vocab, "steps": self.total_steps,
                "probe_every": self.every if isinstance(self.every, int) else None,
                "probe_sequences": int(self.ids.shape[0])}

    def _write_config(self) -> None:
        if self.folder is None:
            return
        site = self.adapter.sites[0]
        facts = self._facts()
        monitor = {"every": self.every if isinstance(self.every, int) else sorted(self.every),
                   "metrics": list(self.metrics), "qk_site": self.qk_site,
                   "probe_shape": list(self.ids.shape),
                   "probe_tokens": int(self.ids.numel() if self.attention_mask is None
                                       else self.attention_mask.sum()),
                   "alerts": [r.__dict__ for r in self.alerts.rules],
                   "control": None if self.control is None else
                   {"target": self.control.targets, "gain": self.control.gain,
                    "max_step": self.control.max_step}}
        model = {"arch": self.adapter.arch, "class": type(self.model).__name__,
                 "n_layer": self.adapter.n_layer, "n_head": site.n_head,
                 "n_kv_head": site.n_kv_head, "head_dim": site.head_dim,
                 "d_model": site.d_model, "causal": self.adapter.causal,
                 "n_params": sum(p.numel() for p in self.model.parameters()),
                 "precision": self.precision}
        cfg = train_config_mapping(facts, self.config)
        write_json(self.folder.out / CONFIG, run_record(
            cfg, self.run_id, **self.record, source="qkgeom.monitor", monitor=monitor,
            model=model))
        self.folder.steps = int(self.config.get("steps") or facts.get("steps") or 0)

    # ------------------------------------------------------------------ integrations

    def hf_callback(self) -> Any:
        """A ``transformers.TrainerCallback`` driving this monitor."""
        from qkgeom.monitor.integrations import hf_callback

        return hf_callback(self)

    def lightning_callback(self, package: str = "auto") -> Any:
        """A Lightning ``Callback`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
        from qkgeom.monitor.integrations import lightning_callback

        return lightning_callback(self, package)


def _cadence(every: int | Iterable[int]) -> int | frozenset[int]:
    if isinstance(every, int):
        if every < 1:
            raise QKGeomError(f"every must be >= 1, got {every}")
        return every
    steps = frozenset(int(s) for s in every)
    if not steps or min(steps) < 0:
        raise QKGeomError("every must be a positive int or a non-empty list of steps >= 0")
    return steps


#: config.json keys the monitor writes itself: ``record=`` may not name them.
_OWN_RECORD_KEYS = frozenset({"run_id", "config", "config_hash", "source", "monitor", "model",
                              "format_version", "versions"})


def _extra_record(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """``record`` checked: a mapping of new keys whose values JSON can write (one line
    otherwise, at construction rather than when the run starts)."""
    if record is None:
        return {}
    if not isinstance(record, Mapping):
        raise QKGeomError(f"record must be a mapping of config.json sections, got "
                          f"{type(record).__name__}")
    taken = sorted(_OWN_RECORD_KEYS & set(record))
    if taken:
        raise QKGeomError(f"record may not set {', '.join(map(repr, taken))}: the monitor "
                          "writes those keys of config.json itself (training settings go in "
                          "config=)")
    try:
        json.dumps(dict(record), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise QKGeomError(f"record must hold JSON values (numbers, text, lists, mappings): "
                          f"{err}") from None
    return dict(record)


def _number(value: Any) -> float:
    """A log entry as a float (a scalar tensor read back; None: NaN, not measured)."""
    if value is None:
        return math.nan
    return float(value.detach()) if hasattr(value, "detach") else float(value)


def _rank() -> int:
    """This process's rank under ``torch.distributed`` (0 when it is not initialised; the
    ``RANK`` a launcher such as torchrun sets, before the process group exists)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def _check_folder(out: Path, resume: bool) -> None:
    """Refuse a run folder the monitor may not write: a run already (unless ``resume``), a
    folder holding files qkgeom did not write, or a ``config.json`` of another tool."""
    if out.exists() and not out.is_dir():
        raise QKGeomError(f"{out} exists and is not a folder; choose another out=")
    if not out.is_dir() or all(p.name == MONITOR_LOCK for p in out.iterdir()):
        return
    if (out / CONFIG).exists() and not resume:
        raise QKGeomError(f"{out} already holds a run; pass resume=True to append to it or "
                          "choose another out=")
    if (out / CONFIG).exists():
        read_record(out)  # a one-line error for a config.json that is not a run record
    foreign = [name for name in foreign_entries(out, check_status=not (out / CONFIG).exists())
               if name != MONITOR_LOCK]
    if foreign or not resume:
        what = ", ".join(foreign[:4]) or "files of an unfinished run"
        raise QKGeomError(f"{out} holds files the monitor did not write ({what}); choose an "
                          "empty or new out= (or resume=True for a run it wrote)")


def train_config_mapping(facts: dict[str, Any], overrides: Mapping[str, Any] | None = None
                         ) -> Any:
    """The :class:`~qkgeom.config.TrainConfig` that ``facts`` (``n_layer``, ``n_head``,
    ``n_embd``, ``block_size``, ``vocab_size``, ``steps``, ``probe_every``,
    ``probe_sequences``, ``seed``; None = unknown) describe, or None when they make no valid
    one, so that ``qkgeom show`` and collation read a monitored run like a trained one.
    ``overrides``: TrainConfig keys the caller knows, over the facts; a config they make
    invalid is a one-line QKGeomError (they are the user's, not guesses)."""
    from qkgeom.config import deep_merge, from_dict

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
    if overrides:
        try:
            return from_dict(deep_merge(cfg, dict(overrides)))
        except QKGeomError as err:
            raise QKGeomError(f"config: {err}") from None
    try:
        return from_dict(cfg)
    except QKGeomError:
        return None
