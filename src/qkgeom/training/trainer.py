"""The training loop: AdamW + warm-up/cosine, eval, probes, atomic checkpoints, resume.

Step ``s`` means ``s`` updates are done. At each step its probe, eval and log records come
first and its checkpoint after them, so a resumed run keeps every record up to its
checkpoint and recomputes nothing differently: on CPU the same seed gives the same metrics
bit for bit, interrupted or not. The trainer knows no feature: key control, entropy control
and your own behaviour are :class:`~qkgeom.training.callbacks.Callback` objects
(:mod:`qkgeom.launch` builds those a config asks for).

Trust (the run's lock, refusals before any write, ``failed`` and ``interrupted``):
docs/faults.md. Speed (autocast, ``compile``, no host sync on CUDA): docs/speed.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from qkgeom.config import TrainConfig, detect_device, with_vocab
from qkgeom.data import load_data, probe_set, sample_batch
from qkgeom.data.batches import BatchStream
from qkgeom.errors import DivergedError, Interrupted, QKGeomError, signals_interrupt
from qkgeom.geometry import LAYER, NonFiniteError, measure, records_to_frame
from qkgeom.model import GPT, z_loss
from qkgeom.runs import (
    STATUS,
    RunLock,
    RunWriter,
    check_run_dir,
    claim_run_dir,
    list_checkpoints,
    one_line,
    remove_stale_temp_files,
    run_record,
)
from qkgeom.seeding import make_generators
from qkgeom.training.callbacks import Callback, TrainContext
from qkgeom.training.checkpoint import (
    CheckpointError,
    is_checkpoint_step,
    load_latest_checkpoint,
    save_checkpoint,
)
from qkgeom.training.resources import (
    check_training_fits,
    gib,
    is_out_of_memory,
    training_memory,
    warn_if_long_on_cpu,
)
from qkgeom.training.schedule import lr_at

if TYPE_CHECKING:
    from qkgeom.ui import StepProgress

__all__ = ["RunResult", "Trainer", "evaluate", "make_optimizer", "resolve_device", "train"]

_EVAL_SEED = 1234  # eval windows are the same for every run and every eval


@dataclass
class RunResult:
    """What :func:`train` returns: the run folder, its final state and its tables."""

    out_dir: Path
    status: str  # "done" | "diverged"
    step: int
    metrics: pd.DataFrame
    log: pd.DataFrame


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, fused on CPU and CUDA; weight decay on matrices only (``p.dim() >= 2``, robust
    to parametrisations). The betas are cast to float: torch refuses a mixed pair."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(float(cfg.beta1), float(cfg.beta2)),
                             fused=fused)


def resolve_device(name: str) -> torch.device:
    """The torch device ``name`` means here (``auto``: :func:`qkgeom.config.detect_device`);
    a one-line QKGeomError for one this machine does not have."""
    if name == "auto":
        name = detect_device()
    for kind, available in (("cuda", torch.cuda.is_available),
                            ("mps", torch.backends.mps.is_available)):
        if name.startswith(kind) and not available():
            raise QKGeomError(f"device {name!r} requested but {kind.upper()} is not available; "
                              "use --device auto or cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:  # "cuda:x" and the like
        raise QKGeomError(f"unknown device {name!r} ({err})") from None
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise QKGeomError(f"device {name!r} requested but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s); use --device cuda")
    return device


def device_facts(device: torch.device, cfg: TrainConfig) -> dict[str, str]:
    """What a run computes on, for its record: the device and precision asked for, what they
    resolved to, and the hardware's name."""
    import platform

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine() or device.type
    return {"device": str(device), "precision": cfg.effective_precision,
            "device_requested": cfg.device, "precision_requested": cfg.precision,
            "hardware": name}


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; parameters (so the optimiser's state) stay
    fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate(model: GPT, data: np.ndarray, cfg: TrainConfig, device: torch.device) -> float:
    """Mean loss over ``eval_batches`` fixed windows of the val split."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(_EVAL_SEED)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = sample_batch(data, cfg.batch_size, cfg.model.block_size, gen, device=device)
        with _autocast(device, cfg.effective_precision):
            _, loss = model(x, y)
        losses.append(loss)  # read back after the loop: one device sync, not one per batch
    model.train(was_training)
    return float(np.mean([float(v) for v in losses]))


class Trainer:
    """One run into one folder: ``Trainer(cfg, out).run()``.

    Everything is checked in the constructor, before any work: the features against the
    callbacks, the device, the data, the memory and probe-time estimates, the lock and the
    run folder (fresh: empty; resume: a qkgeom run folder of this config, vocabulary and
    corpus). The lock is held until :meth:`run` ends (or :meth:`close`)."""

    def __init__(self, cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False,
                 callbacks: list[Callback] | None = None, progress: bool = False,
                 run_id: str | None = None, progress_every: int | None = None) -> None:
        self.callbacks = list(callbacks or [])
        served = {cb.feature for cb in self.callbacks}
        unserved = [f for f in cfg.active_features() if f not in served]
        if unserved:
            raise QKGeomError(f"the config enables {', '.join(unserved)} but no callback serves "
                              "it; train with qkgeom.train(cfg, out), which builds the "
                              "callbacks a config asks for")
        self.out, self.resume, self.progress = Path(out_dir), resume, progress
        self.progress_every = progress_every
        # the folder's own name, also for --out . or --out ..
        self.run_id = run_id or Path(os.path.realpath(self.out)).name
        self.device = resolve_device(cfg.device)
        # auto -> concrete: the record says where the run computed and in which precision
        execution = device_facts(self.device, cfg)
        cfg = dataclasses.replace(cfg, device=execution["device"],
                                  precision=execution["precision"])
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.data = load_data(cfg.data)
        self.data.require_block(cfg.model.block_size)
        self.cfg = cfg = with_vocab(cfg, self.data.vocab.vocab_size)
        self.probe_tokens = probe_set(self.data.val, cfg.probe_sequences, cfg.model.block_size)
        check_training_fits(cfg, self.device)
        check_eval_fits(cfg, len(self.data.val))
        if not resume:  # a resumed run was told when it started
            warn_if_long_on_cpu(cfg, self.device)
        record = run_record(cfg, self.run_id, execution=execution, data_dir=str(self.data.dir),
                            data_source=self.data.meta.get("source"),
                            vocab_size=self.data.vocab.vocab_size,
                            vocab_sha256=self.data.vocab.digest(),
                            corpus_sha256=self.data.corpus_sha256)
        # reentrant: a sweep worker calls the trainer inside its own hold of the run's lock
        self.lock = RunLock(self.out).require("train or resume", reentrant=True)
        try:
            # Everything a resume reads is checked before anything is written.
            check_run_dir(self.out, record, resume)
            self._state = load_latest_checkpoint(self.out, cfg) if resume else None
            self.writer = RunWriter(self.out, self.run_id, steps=cfg.steps, resume=resume,
                                    threads=torch.get_num_threads())
            upto = self._state["step"] if self._state is not None else -1
            self._previous = self.writer.read_previous(upto) if resume else None
            claim_run_dir(self.out, record, resume)
            if resume:
                remove_stale_temp_files(self.out)
        except BaseException:
            self.lock.release()
            raise
        if resume:
            self._warn_on_resume(self.writer.previous)

    def _warn_on_resume(self, previous: dict) -> None:
        """One line each when a resume runs with another torch thread count than before (CPU
        results are bit-exact only with the same count), or finds no checkpoint although an
        earlier attempt got somewhere (the run starts over from step 0)."""
        before, now = previous.get("threads"), torch.get_num_threads()
        if isinstance(before, int) and before != now:
            warnings.warn(f"{self.out}: resuming with {now} torch threads, the run so far used "
                          f"{before}; the results may differ from an uninterrupted run in the "
                          f"last bits (pass --threads {before} for a bit-exact resume)",
                          stacklevel=3)
        reached = previous.get("step", 0)
        if self._state is None and reached > 0:
            warnings.warn(f"{self.out}: no checkpoint yet (the earlier attempt stopped at step "
                          f"{reached}, before its first checkpoint); the run starts over from "
                          "step 0", stacklevel=3)

    def close(self) -> None:
        """Release the run's lock (done by :meth:`run`; for a Trainer never run)."""
        self.lock.release()

    # ------------------------------------------------------------------ the run

    def run(self) -> RunResult:
        """Train to ``cfg.steps`` (from the newest checkpoint when resuming), releasing the
        lock however it ends. An error is recorded ``failed`` with its reason before it is
        raised; out of memory becomes a one-line QKGeomError."""
        self.step, self._tables_taken = 0, not self.resume
        try:
            with signals_interrupt():
                return self._run()
        except (DivergedError, CheckpointError):
            raise  # diverged is recorded as such; a foreign checkpoint changed nothing
        except KeyboardInterrupt as err:  # SIGINT / SIGTERM: recorded, resumable
            stopped = self._interrupted(err)
            if isinstance(err, Interrupted):  # a signal: raised again with the line to print
                raise stopped from None
            raise  # a KeyboardInterrupt of the caller's own (a callback's): as it came
        except BaseException as err:
            if is_out_of_memory(err):
                message = self._oom_message(err)
                self._fail(message)
                raise QKGeomError(message) from None
            self._fail(one_line(err))
            raise
        finally:
            self.lock.release()

    def _oom_message(self, err: BaseException) -> str:
        cfg = self.cfg
        need = sum(training_memory(cfg).values())
        return (f"out of memory at step {self.step} ({type(err).__name__}); the run needs about "
                f"{gib(need)} by qkgeom's estimate (batch_size {cfg.batch_size} × block_size "
                f"{cfg.model.block_size}); lower batch_size or block_size, then --resume; "
                f"recorded in {self.out / STATUS}")

    def _interrupted(self, err: KeyboardInterrupt) -> Interrupted:
        """Record ``interrupted`` (the step reached, the signal, the newest checkpoint or
        None) as far as the disk allows, and the one line that says how to resume."""
        import signal

        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        name = signal.Signals(signum).name
        found = list_checkpoints(self.out)
        ckpt = found[-1][0] if found else None
        with contextlib.suppress(Exception):
            self.writer.status("interrupted", self.step, signal=name, checkpoint=ckpt)
        where = f"recorded in {self.out / STATUS}"
        if ckpt is None:
            how = ("no checkpoint exists yet, so --resume starts the run over from step 0 "
                   f"({where})")
        else:
            how = (f"resume it from its step-{ckpt} checkpoint: the same command with --resume "
                   f"(--out {self.out}; {where})")
        return Interrupted(signum, f"interrupted ({name}) at step {self.step}; {how}")

    def _fail(self, message: str) -> None:
        """Record ``failed`` (the reason in status.json; the tables compacted once this
        attempt has taken them up), as far as the disk allows: the error being raised says
        what went wrong either way."""
        if self._tables_taken:
            with contextlib.suppress(Exception):
                self.writer.compact()
        with contextlib.suppress(Exception):
            self.writer.status("failed", self.step, error=message)

    def _run(self) -> RunResult:
        self._build()
        self._restore()
        for cb in self.callbacks:
            cb.on_train_start(self.ctx)
        self.bar: StepProgress | None = None
        if self.progress:
            from qkgeom.ui import step_progress

            self.bar = step_progress("train", self.cfg.steps, self.step,
                                     self.progress_every or self.cfg.probe_every)
        self.writer.status("running", self.step)
        self.model.train()
        try:
            while True:
                last = self.step == self.cfg.steps
                if self.step != self.resumed_at:  # a resumed step's records exist already
                    self._boundary(self.step, last)
                if last:
                    break
                self._train_step()
                if self.bar is not None:
                    self.bar.advance()
                self.writer.heartbeat(self.step)  # status.json between probes (every 30 s)
        finally:
            if self.bar is not None:
                self.bar.close()
        self.writer.status("done", self.step)  # compacted: at the last step, or on restore
        for cb in self.callbacks:
            cb.on_train_end(self.ctx)
        return RunResult(self.out, "done", self.step, self.writer.metrics, self.writer.log)

    def _build(self) -> None:
        """Model (seeded init), callbacks' model hook, optimiser, compiled step, batches."""
        cfg = self.cfg
        self.gens = make_generators(cfg.seed)
        torch.manual_seed(self.gens.dropout_seed)
        self.model = GPT(cfg.model, generator=self.gens.init).to(self.device)
        self.ctx = TrainContext(config=cfg, model=self.model, resumed=self.resume)
        for cb in self.callbacks:  # before the optimiser and any checkpoint load
            cb.on_model_built(self.ctx)
        self.optimizer = self.ctx.optimizer = make_optimizer(self.model, cfg, self.device)
        # Shares every parameter with ``model``; only the training step calls it.
        self.step_model = torch.compile(self.model) if cfg.compile else self.model
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self.batches = BatchStream(self.data.train, cfg.batch_size, cfg.model.block_size,
                                   self.gens.data, device=self.device,
                                   prefetch=self.device.type == "cuda")
        self.step, self.resumed_at = 0, -1
        # The previous probe's logit windows (logit_delta), checkpointed for a resume.
        self.probe_windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Step losses not yet read back, with their update: on CPU each is checked before its
        # update touches the weights; on an accelerator once per log interval. With a z-loss,
        # its terms too (logged beside the loss, never in it).
        self.pending: list[tuple[int, torch.Tensor]] = []
        self.pending_z: list[torch.Tensor] = []
        self.acc: dict[str, float] = {"loss_sum": 0.0, "loss_n": 0, "z_sum": 0.0, "tokens": 0,
                                      "t": time.perf_counter()}

    def _restore(self) -> None:
        """Continue from the checkpoint read when the trainer was built; a resume without
        one drops the records an earlier attempt left (the run starts over)."""
        state, self._state = self._state, None
        if state is None:
            if self.resume:
                self.writer.restore(upto=-1, tables=(None, None))
                self._tables_taken = True
            return
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, RuntimeError, ValueError, TypeError) as err:
            raise CheckpointError(f"{self.out / 'checkpoints'}: step {state.get('step')} "
                                  "checkpoint does not fit this run's model "
                                  f"({type(err).__name__}: {' '.join(str(err).split())[:160]}); "
                                  "train into a new --out") from None
        self.gens.data.set_state(state["data_rng"])
        self.probe_windows = _windows(state.get("probe_windows"))
        torch.set_rng_state(state["torch_rng"])
        for cb, cb_state in zip(self.callbacks, state.get("callbacks", []), strict=False):
            cb.load_state_dict(cb_state)
        self.step = self.resumed_at = self.ctx.step = int(state["step"])
        self.writer.restore(upto=self.step, tables=self._previous)
        self._previous = None
        self._tables_taken = True
        self.acc.update(state.get("loss_acc", {}), t=time.perf_counter())

    # ------------------------------------------------------------------ one update

    def _train_step(self) -> None:
        cfg = self.cfg
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.batches.next()  # (B, T), (B, T)
        with _autocast(self.device, cfg.precision):
            logits, loss = self.step_model(x, y)
        self.pending.append((self.step + 1, loss.detach()))
        objective = loss  # the recorded loss stays the cross-entropy
        if cfg.z_loss:
            z = cfg.z_loss * z_loss(logits)
            self.pending_z.append(z.detach())
            objective = loss + z
        if self.device.type == "cpu":
            self._read_losses()
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(objective).backward()
        self.batches.prefetch()  # next batch's host gather + copy overlap this step's kernels
        if cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.step = self.ctx.step = self.step + 1
        try:
            for cb in self.callbacks:
                cb.on_step_end(self.ctx)
        except NonFiniteError as err:  # a control met inf/NaN weights: update s diverged
            self._diverge(self.step, f"{err} after update {self.step}")
        self.acc["tokens"] += cfg.batch_size * cfg.model.block_size

    def _read_losses(self) -> None:
        """Move pending step losses into the log accumulator; stop on a non-finite one."""
        if not self.pending:
            return
        steps = [s for s, _ in self.pending]  # the update each loss belongs to (1-based)
        values = torch.stack([v for _, v in self.pending]).tolist()  # one host sync
        self.pending.clear()
        if self.pending_z:
            for z in torch.stack(self.pending_z).tolist():
                self.acc["z_sum"] += z
            self.pending_z.clear()
        for bad, value in zip(steps, values, strict=True):
            if not math.isfinite(value):
                self._diverge(bad, f"non-finite loss ({value}) at step {bad}")
            self.acc["loss_sum"] += value
            self.acc["loss_n"] += 1

    def _diverge(self, bad: int, message: str) -> None:
        """Record ``diverged`` at update ``bad`` (records so far kept) and stop the run."""
        self.writer.compact()
        self.writer.status("diverged", self.step, diverged_step=bad, message=message)
        raise DivergedError(f"run diverged: {message}; recorded in {self.out / STATUS}")

    # ------------------------------------------------------------------ records

    def _boundary(self, s: int, last: bool) -> None:
        """Records, logs and checkpoints due at step ``s`` (before update s + 1)."""
        cfg = self.cfg
        ckpt = last or is_checkpoint_step(s, cfg.checkpoint_every, cfg.checkpoint_schedule)
        if ckpt or any(s % every == 0 for every in (cfg.log_every, cfg.probe_every,
                                                     cfg.eval_every)):
            self._read_losses()
        if s % cfg.probe_every == 0 or last:
            self._probe(s)
        val_loss = math.nan
        if s % cfg.eval_every == 0 or last:
            val_loss = evaluate(self.model, self.data.val, cfg, self.device)
        if s == 0 and not math.isnan(val_loss):
            self._add_log({"step": 0, "loss": math.nan, "val_loss": val_loss, "lr": 0.0})
        elif s > 0 and (s % cfg.log_every == 0 or not math.isnan(val_loss) or last):
            self._log(s, val_loss)
        if ckpt:
            # Compacted before the status says done: a finished run's tables hold every row.
            (self.writer.compact if last else self.writer.flush)()
            self._checkpoint(s)
            self.writer.status("done" if last else "running", s)
        elif s % cfg.probe_every == 0:
            self.writer.flush()
            self.writer.status("running", s)

    def _probe(self, s: int) -> None:
        """Measure the probe set; callbacks may add flat records (layer −1, head −1)."""
        try:
            found = measure(self.model, self.probe_tokens, batch_size=self.cfg.probe_batch,
                            previous=self.probe_windows)
            frame, self.probe_windows = found.frame, found.logit_windows
        except NonFiniteError as err:
            # Update s left inf/NaN weights while its loss was finite: it diverged at step s.
            self._diverge(s, f"{err} at the probe of step {s}")
        for cb in self.callbacks:
            extra = cb.on_probe(self.ctx, frame)
            if extra:
                rows = records_to_frame({LAYER: [(LAYER, k, float(v)) for k, v in extra.items()]})
                frame = pd.concat([frame, rows], ignore_index=True)
        self.writer.add_metrics(frame, s)

    def _log(self, s: int, val_loss: float) -> None:
        acc, now = self.acc, time.perf_counter()
        row = {"step": s, "loss": acc["loss_sum"] / max(acc["loss_n"], 1), "val_loss": val_loss,
               "lr": self._lr(s - 1), "tokens_per_s": acc["tokens"] / max(now - acc["t"], 1e-9)}
        if self.cfg.z_loss:  # the z term (coefficient included) beside the plain loss
            row["z_loss"] = acc["z_sum"] / max(acc["loss_n"], 1)
        self._add_log(row)
        acc.update(loss_sum=0.0, loss_n=0, z_sum=0.0, tokens=0, t=now)
        if self.bar is not None:
            self.bar.update(s, loss=row["loss"], val_loss=val_loss,
                            tokens_per_s=row["tokens_per_s"])

    def _add_log(self, row: dict[str, float]) -> None:
        self.writer.add_log(row)
        for cb in self.callbacks:
            cb.on_log(self.ctx, row)

    def _lr(self, step: int) -> float:
        """The learning rate of update ``step + 1``."""
        cfg = self.cfg
        return lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps,
                     min_lr_ratio=cfg.min_lr_ratio)

    def _checkpoint(self, s: int) -> None:
        save_checkpoint(self.out, s, {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(), "data_rng": self.batches.generator_state(),
            "torch_rng": torch.get_rng_state(), "config": self.cfg.to_dict(),
            "callbacks": [cb.state_dict() for cb in self.callbacks],
            "loss_acc": {"loss_sum": self.acc["loss_sum"], "loss_n": self.acc["loss_n"],
                         **({"z_sum": self.acc["z_sum"]} if self.cfg.z_loss else {})},
            "probe_windows": {layer: list(qk) for layer, qk in self.probe_windows.items()},
        }, keep=self.cfg.keep_checkpoints)


def _windows(saved: object) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The probe windows a checkpoint recorded (none when it holds no well-formed ones)."""
    if not isinstance(saved, dict):
        return {}
    return {int(layer): (qk[0], qk[1]) for layer, qk in saved.items()
            if isinstance(layer, int) and isinstance(qk, list) and len(qk) == 2
            and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qk)}


def check_eval_fits(cfg: TrainConfig, val_tokens: int) -> None:
    """Refuse more eval windows (``eval_batches × batch_size``) than the val split has
    positions: they measure nothing new, and a huge count would hang the step-0 eval."""
    windows = cfg.eval_batches * cfg.batch_size
    positions = max(val_tokens - cfg.model.block_size, 1)
    if windows > positions:
        raise QKGeomError(f"eval_batches {cfg.eval_batches:,} × batch_size {cfg.batch_size:,} "
                          f"= {windows:,} eval windows, but the val split has only "
                          f"{positions:,} window positions; lower eval_batches (at most "
                          f"{max(positions // cfg.batch_size, 1):,})")


def train(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          callbacks: list[Callback] | None = None, progress: bool = False,
          run_id: str | None = None, progress_every: int | None = None) -> RunResult:
    """Train one run into ``out_dir`` with exactly the ``callbacks`` given (:class:`Trainer`);
    :func:`qkgeom.train` adds those the config asks for."""
    return Trainer(cfg, out_dir, resume=resume, callbacks=callbacks, progress=progress,
                   run_id=run_id, progress_every=progress_every).run()
