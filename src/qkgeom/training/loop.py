"""The training loop: AdamW + warm-up/cosine, eval, probes, atomic checkpoints, resume.

Step ``s`` means ``s`` optimiser updates are done. At every step that is a multiple of
``probe_every`` (and at 0 and the last step) the probe set is measured; at multiples of
``eval_every`` the val loss; at multiples of ``checkpoint_every`` a checkpoint is written
*after* that step's records, so a resumed run keeps every record up to its checkpoint and
recomputes nothing differently: on CPU the same seed gives the same metrics bit for bit,
interrupted or not.

Speed (docs/speed.md): ``precision`` autocasts the forward pass (bf16 by default on CUDA,
opt-in on CPU; weights and AdamW state stay fp32, probes always run in fp32/fp64 on the
eager model); ``compile`` wraps the model in ``torch.compile`` for the training step only
(the wrapper shares the module's parameters, so probes, eval, key control and checkpoints
see the same weights without going through the compiled graph); AdamW is fused on CPU and
CUDA. On CUDA the hot loop never waits for the device: step losses stay on the GPU and are
read back once per ``log_every`` steps (or when a record is due), and the next batch is
gathered from the memmap and copied from pinned memory while the current step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from qkgeom import __version__
from qkgeom.config import TrainConfig, from_dict, with_vocab
from qkgeom.data import PreparedData, ensure_sample_data, load_prepared, probe_set, sample_batch
from qkgeom.data.batches import BatchStream
from qkgeom.errors import DivergedError, QKGeomError
from qkgeom.geometry import NonFiniteError
from qkgeom.geometry.probe import probe
from qkgeom.io import (
    RUN_FORMAT_VERSION,
    check_run_format,
    read_json,
    vocab_digest,
    write_json,
    write_parquet,
)
from qkgeom.model import GPT
from qkgeom.seeding import make_generators
from qkgeom.training.callbacks import Callback, TrainContext
from qkgeom.training.checkpoint import load_latest_checkpoint, save_checkpoint
from qkgeom.training.schedule import lr_at

LOG_COLUMNS = ["step", "loss", "val_loss", "lr", "tokens_per_s"]
_EVAL_SEED = 1234  # eval windows are the same for every run and every eval


@dataclass
class RunResult:
    """What :func:`train` returns: the run folder, its final state and its tables."""

    out_dir: Path
    status: str  # "done" | "diverged"
    step: int
    metrics: pd.DataFrame
    log: pd.DataFrame


def load_data(cfg: TrainConfig) -> PreparedData:
    """The prepared data of ``cfg.data`` ("" = the embedded Wikipedia sample, cached)."""
    data_dir = ensure_sample_data() if cfg.data == "" else Path(cfg.data)
    return load_prepared(data_dir)


def make_optimizer(model: GPT, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (``p.dim() >= 2``, robust to parametrisations)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise QKGeomError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise QKGeomError("device 'mps' requested but MPS is not available; use --device cpu")
    return torch.device(name)


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass: matmuls in bf16/fp16, parameters (and so the
    optimiser's master weights and state) stay fp32; the loss is computed in fp32."""
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


class _Status:
    """Writes ``status.json``: state, step, and the wall time spent on the run so far
    (summed over resumed attempts, up to the last status write of each)."""

    def __init__(self, out: Path, steps: int, resume: bool) -> None:
        self.path, self.steps = out / "status.json", steps
        prev: dict[str, Any] = {}
        if resume and self.path.exists():
            with contextlib.suppress(QKGeomError):
                prev = read_json(self.path)
        prev = prev if isinstance(prev, dict) else {}  # garbage status: it is rewritten below
        started, wall = prev.get("started"), prev.get("wall_s")
        number = (int, float)
        self.started = started if isinstance(started, number) else time.time()
        self.wall_before = float(wall) if isinstance(wall, number) else 0.0
        self.t0 = time.perf_counter()

    def __call__(self, state: str, step: int, **extra: Any) -> None:
        write_json(self.path, {
            "state": state, "step": step, "steps": self.steps, "started": self.started,
            "updated": time.time(),
            "wall_s": self.wall_before + time.perf_counter() - self.t0, **extra})


def _provenance(cfg: TrainConfig, data: PreparedData, run_id: str) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "config": cfg.to_dict(),
        "config_hash": cfg.config_hash(),
        "data_dir": str(data.dir),
        "data_source": data.meta.get("source"),
        "vocab_size": data.vocab.vocab_size,
        "vocab_sha256": vocab_digest(data.vocab.chars),
        "format_version": RUN_FORMAT_VERSION,
        "versions": {"qkgeom": __version__, "torch": torch.__version__,
                     "python": platform.python_version()},
    }


def _prepare_run_dir(out: Path, cfg: TrainConfig, resume: bool, prov: dict[str, Any]) -> None:
    """Refuse to clobber a different run; check a resumed run has the same config."""
    cfg_path = out / "config.json"
    if cfg_path.exists():
        if not resume:
            raise QKGeomError(f"{out} already holds a run; pass --resume to continue it "
                              "or choose another --out")
        saved = read_json(cfg_path)
        check_run_format(saved, cfg_path)
        if saved.get("vocab_sha256", prov["vocab_sha256"]) != prov["vocab_sha256"]:
            meta = Path(prov["data_dir"]) / "meta.json"
            raise QKGeomError(f"{meta}: its vocabulary is not the one this run was trained "
                              f"with ({cfg_path} records {saved.get('data_dir')}); resume with "
                              "--data pointing at that data, or train into a new --out")
        if saved.get("config_hash") != prov["config_hash"]:
            raise QKGeomError(f"{cfg_path}: the run was started with a different config "
                              f"(hash {saved.get('config_hash')} vs {prov['config_hash']}); "
                              "resume with the same settings or use another --out")
    elif out.exists() and any(out.iterdir()) and not resume:
        raise QKGeomError(f"{out} exists and is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_json(cfg_path, prov)


def _read_table(path: Path, upto: int) -> list[pd.DataFrame]:
    if not path.exists():
        return []
    try:
        frame = pd.read_parquet(path)
    except Exception as err:
        raise QKGeomError(f"{path}: unreadable Parquet ({type(err).__name__}); delete the run "
                          "folder and train again") from None
    if "step" not in frame.columns:
        raise QKGeomError(f"{path}: not a qkgeom table (no 'step' column); delete the run "
                          "folder and train again")
    return [frame[frame["step"] <= upto]]


def train(
    cfg: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    callbacks: list[Callback] | None = None,
    progress: bool = False,
    run_id: str | None = None,
) -> RunResult:
    """Train one run into ``out_dir`` (SPEC §7 layout) and return its tables.

    Raises :class:`QKGeomError` for bad input before any work, and
    :class:`DivergedError` (after recording ``status: diverged``) on a non-finite loss.
    """
    cfg.validate()
    out = Path(out_dir)
    run_id = run_id or out.name
    callbacks = list(callbacks or [])
    device = resolve_device(cfg.device)
    cfg = dataclasses.replace(cfg, precision=cfg.effective_precision)  # auto -> concrete
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    data = load_data(cfg)
    data.require_block(cfg.model.block_size)
    cfg = with_vocab(cfg, data.vocab.vocab_size)
    cfg.validate()
    probe_tokens = probe_set(data.val, cfg.probe_sequences, cfg.model.block_size)
    prov = _provenance(cfg, data, run_id)
    _prepare_run_dir(out, cfg, resume, prov)

    gens = make_generators(cfg.seed)
    torch.manual_seed(gens.dropout_seed)
    model = GPT(cfg.model, generator=gens.init).to(device)
    if cfg.key_control != "none":
        from qkgeom.control import KeyControlCallback  # imports training: not at module level

        key_cb = KeyControlCallback.from_config(cfg)
        if cfg.key_control_how == "parametrize":  # renames state_dict keys: bind before loading
            key_cb.bind(model, cfg.steps, fresh=True)
        callbacks = [key_cb, *callbacks]
    optimizer = make_optimizer(model, cfg, device)
    # The compiled wrapper shares every parameter with ``model``; only the training step
    # calls it. Probes, eval, callbacks and checkpoints use ``model`` itself.
    step_model = torch.compile(model) if cfg.compile else model
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    ctx = TrainContext(config=cfg, model=model, optimizer=optimizer)

    status = _Status(out, cfg.steps, resume)
    step = 0
    metrics: list[pd.DataFrame] = []
    log_rows: list[dict[str, float]] = []
    state = load_latest_checkpoint(out) if resume else None
    if state is not None:
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        except (KeyError, RuntimeError, ValueError) as err:
            raise QKGeomError(f"{out / 'checkpoints'}: step {state.get('step')} checkpoint does "
                              f"not fit this run's model ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:160]}); train into a new --out"
                              ) from None
        gens.data.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        for cb, cb_state in zip(callbacks, state.get("callbacks", []), strict=False):
            cb.load_state_dict(cb_state)
        step = int(state["step"])
        metrics = _read_table(out / "metrics.parquet", step)
        log_frames = _read_table(out / "train_log.parquet", step)
        log_rows = log_frames[0].to_dict("records") if log_frames else []
    ctx.step = step
    for cb in callbacks:
        cb.on_train_start(ctx)

    def flush() -> None:
        if metrics:
            write_parquet(out / "metrics.parquet", pd.concat(metrics, ignore_index=True))
        write_parquet(out / "train_log.parquet", pd.DataFrame(log_rows, columns=LOG_COLUMNS))

    def record_probe(s: int) -> None:
        try:
            frame = probe(model, probe_tokens, batch_size=cfg.probe_batch, run_id=run_id, step=s)
        except NonFiniteError as err:
            # Update s left inf/NaN weights or activations while its own loss was finite (a
            # huge lr): every earlier loss was finite, so the run diverged at step s.
            diverge(s, f"{err} at the probe of step {s}")
        frame = frame[["run_id", "step", "layer", "head", "metric", "value"]]
        for cb in callbacks:
            extra = cb.on_probe(ctx, frame)
            if extra:
                rows = [{"run_id": run_id, "step": s, "layer": -1, "head": -1,
                         "metric": k, "value": float(v)} for k, v in extra.items()]
                frame = pd.concat([frame, pd.DataFrame(rows)], ignore_index=True)
        metrics.append(frame)

    tokens_per_step = cfg.batch_size * cfg.model.block_size
    acc = {"loss_sum": 0.0, "loss_n": 0, "tokens": 0, "t": time.perf_counter()}
    if state is not None:
        acc.update(state.get("loss_acc", {}))
        acc["t"] = time.perf_counter()
    # Step losses not yet read back, as device scalars, and the step they belong to. On CPU
    # a read-back costs nothing, so every loss is checked before its update (a non-finite
    # loss stops the run before it touches the weights); on an accelerator they are read
    # once per log interval, and a non-finite one still names its exact step.
    pending: list[tuple[int, torch.Tensor]] = []
    read_each_step = device.type == "cpu"
    batches = BatchStream(data.train, cfg.batch_size, cfg.model.block_size, gens.data,
                          device=device, prefetch=device.type == "cuda")

    def read_losses() -> None:
        """Move pending step losses into the log accumulator; raise on a non-finite one."""
        if not pending:
            return
        steps = [s for s, _ in pending]  # the update each loss belongs to (1-based)
        values = torch.stack([v for _, v in pending]).tolist()  # one host sync
        pending.clear()
        for bad, value in zip(steps, values, strict=True):
            if not math.isfinite(value):
                diverge(bad, f"non-finite loss ({value}) at step {bad}")
            acc["loss_sum"] += value
            acc["loss_n"] += 1

    def diverge(bad: int, message: str) -> None:
        """Record ``diverged`` at update ``bad`` (records so far kept) and stop the run."""
        flush()
        status("diverged", step, diverged_step=bad, message=message)
        raise DivergedError(f"run diverged: {message}; recorded in {out / 'status.json'}")

    def at_boundary(s: int, is_last: bool) -> None:
        """Records, logs and checkpoints due at step ``s`` (before update s + 1)."""
        if is_last or any(s % every == 0 for every in (
                cfg.log_every, cfg.probe_every, cfg.eval_every, cfg.checkpoint_every)):
            read_losses()
        if s % cfg.probe_every == 0 or is_last:
            record_probe(s)
        val_loss = math.nan
        if s % cfg.eval_every == 0 or is_last:
            val_loss = evaluate(model, data.val, cfg, device)
        if s == 0 and not math.isnan(val_loss):
            log_rows.append({"step": 0, "loss": math.nan, "val_loss": val_loss,
                             "lr": 0.0, "tokens_per_s": math.nan})
        elif s > 0 and (s % cfg.log_every == 0 or not math.isnan(val_loss) or is_last):
            now = time.perf_counter()
            log_rows.append({
                "step": s, "loss": acc["loss_sum"] / max(acc["loss_n"], 1), "val_loss": val_loss,
                "lr": lr_at(s - 1, lr=cfg.lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps,
                            min_lr_ratio=cfg.min_lr_ratio),
                "tokens_per_s": acc["tokens"] / max(now - acc["t"], 1e-9),
            })
            acc.update(loss_sum=0.0, loss_n=0, tokens=0, t=now)
            if bar is not None:
                bar.update(log_rows[-1])
        if (s > 0 and s % cfg.checkpoint_every == 0) or is_last:
            flush()
            save_checkpoint(out, s, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(), "data_rng": batches.generator_state(),
                "torch_rng": torch.get_rng_state(), "config": cfg.to_dict(),
                "callbacks": [cb.state_dict() for cb in callbacks],
                "loss_acc": {"loss_sum": acc["loss_sum"], "loss_n": acc["loss_n"]},
            }, keep=cfg.keep_checkpoints)
            status("done" if is_last else "running", s)
        elif s % cfg.probe_every == 0:
            flush()
            status("running", s)

    bar = _Bar(cfg.steps, step) if progress else None
    status("running", step)
    model.train()
    resumed_at = step if state is not None else -1
    try:
        while True:
            is_last = step == cfg.steps
            if step != resumed_at:  # a resumed step's records were written before the stop
                at_boundary(step, is_last)
            if is_last:
                break


            lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps,
                       min_lr_ratio=cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = batches.next()  # (B, T), (B, T)
            with _autocast(device, cfg.precision):
                _, loss = step_model(x, y)
            pending.append((step + 1, loss.detach()))
            if read_each_step:
                read_losses()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            batches.prefetch()  # next batch's host gather + copy overlap this step's kernels
            if cfg.grad_clip > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(optimizer)
            scaler.update()
            step += 1
            ctx.step = step
            for cb in callbacks:
                cb.on_step_end(ctx)
            acc["tokens"] += tokens_per_step
            if bar is not None:
                bar.advance()
    finally:
        if bar is not None:
            bar.close()
    status("done", step)
    for cb in callbacks:
        cb.on_train_end(ctx)
    return RunResult(out_dir=out, status="done", step=step,
                     metrics=pd.concat(metrics, ignore_index=True),
                     log=pd.DataFrame(log_rows, columns=LOG_COLUMNS))


def load_run_config(run_dir: str | Path) -> TrainConfig:
    """The :class:`TrainConfig` a run folder was trained with."""
    prov = read_json(Path(run_dir) / "config.json")
    check_run_format(prov, Path(run_dir) / "config.json")
    try:
        return from_dict(prov["config"])
    except (KeyError, TypeError):
        raise QKGeomError(f"{Path(run_dir) / 'config.json'}: not a qkgeom run config") from None


class _Bar:
    """A rich progress bar with loss, tokens/s and ETA (only when asked for)."""

    def __init__(self, total: int, done: int) -> None:
        from qkgeom.ui import progress_bar

        self._progress = progress_bar("[bold]train", "loss {task.fields[loss]}",
                                      "{task.fields[tps]} tok/s")
        self._task = self._progress.add_task("train", total=total, completed=done,
                                             loss="-", tps="-")
        self._progress.start()

    def advance(self) -> None:
        self._progress.advance(self._task)

    def update(self, row: dict[str, float]) -> None:
        self._progress.update(self._task, loss=f"{row['loss']:.3f}",
                              tps=f"{row['tokens_per_s']:,.0f}")

    def close(self) -> None:
        self._progress.stop()


__all__ = ["RunResult", "train", "evaluate", "load_run_config", "load_data",
           "make_optimizer"]
