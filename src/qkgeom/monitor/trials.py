"""Trials: Hugging Face models qkgeom did not build, trained in a plain PyTorch loop under a
:class:`GeometryMonitor`, stable and unstable by learning rate.

Why: the alert rules were chosen on the project's own GPT; whether they transfer needs runs
of models built elsewhere (``GPT2LMHeadModel``, ``LlamaForCausalLM`` with grouped-query
attention and rotary) trained the way a practitioner would, recorded so that the stability
analysis can tell whether attention collapsed, when the validation loss departed from the
stable run and which rules fired when. Recipe, grid and folder format:
docs/monitor.md#trials-hugging-face-models-under-the-monitor.

::

    python -m qkgeom.monitor.trials --preset demo --out sweeps/alerts-hf
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError
from qkgeom.io import make_dir, read_json, refuse_link, refuse_links, write_json
from qkgeom.runs import RunLock, finished_state, foreign_entries, one_line, read_status

__all__ = ["EVAL_SEED", "FAMILIES", "PRESETS", "TRIALS_FILE", "Grid", "Settings", "Trial",
           "build_model", "main", "run_grid", "train_trial"]

FAMILIES = ("gpt2", "llama")
TRIALS_FILE = "trials.json"
RUNS_DIR = "runs"  # run folders in <out>/runs/<run_id>/, where collation looks for them
GRID_LOCK = ".trials.lock"  # one grid process per folder (inside it)
#: The validation windows: the same for every run of every seed (the trainer's rule).
EVAL_SEED = 1234
_OWN = {TRIALS_FILE, RUNS_DIR, GRID_LOCK, "report"}


@dataclass(frozen=True)
class Settings:
    """Model shape and training recipe of every run of a grid: the project trainer's
    recipe (AdamW, decay on weights of dim >= 2, clipping, warm-up then cosine to
    ``min_lr_ratio``), fp32, dropout 0. ``n_kv_head``: Llama's key heads (GPT-2 has one per
    query head)."""

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_kv_head: int = 2
    intermediate_size: int = 512
    block_size: int = 64
    steps: int = 200
    warmup_steps: int = 20
    batch_size: int = 16
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    probe_every: int = 5
    probe_sequences: int = 16
    eval_every: int = 10
    eval_batches: int = 4


@dataclass(frozen=True)
class Trial:
    """One run of a grid: a model family, a peak learning rate, a seed (init and data)."""

    family: str
    lr: float
    seed: int

    @property
    def run_id(self) -> str:
        return f"{self.family}-lr{self.lr:g}-s{self.seed}"


@dataclass(frozen=True)
class Grid:
    """Families x learning rates x seeds, all with one :class:`Settings`."""

    preset: str
    settings: Settings
    families: tuple[str, ...]
    lrs: tuple[float, ...]
    seeds: tuple[int, ...]

    def trials(self) -> list[Trial]:
        return [Trial(f, lr, s) for f in self.families for lr in self.lrs for s in self.seeds]

    def record(self) -> dict[str, Any]:
        """``trials.json``: the grid and its run folders."""
        return {"grid": {"preset": self.preset, "families": list(self.families),
                         "lrs": list(self.lrs), "seeds": list(self.seeds),
                         "settings": dataclasses.asdict(self.settings)},
                "runs": [{"run_id": t.run_id, "family": t.family, "lr": t.lr, "seed": t.seed,
                          "dir": f"{RUNS_DIR}/{t.run_id}"} for t in self.trials()]}


_SMOKE = Settings(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, intermediate_size=64,
                  block_size=32, steps=30, warmup_steps=3, batch_size=8, probe_sequences=4,
                  eval_every=5, eval_batches=2)
PRESETS: dict[str, Grid] = {
    # the lead's evaluation (issue 35): 2 families x 3 rates x 3 seeds = 18 runs
    "demo": Grid("demo", Settings(), FAMILIES, (3e-3, 3e-2, 1e-1), (200, 201, 202)),
    # tiny models, few steps: for tests
    "smoke": Grid("smoke", _SMOKE, FAMILIES, (1e-2,), (0,)),
}


# ---------------------------------------------------------------------- one run


def build_model(family: str, settings: Settings, vocab_size: int, seed: int) -> Any:
    """A fresh ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` from a ``transformers`` config,
    initialised by transformers' own init under ``torch.manual_seed(seed)``; SDPA
    attention (the monitor computes the entropy from the captured q and k)."""
    import torch
    import transformers

    s = settings
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, n_inner=s.intermediate_size,
            n_positions=s.block_size, vocab_size=vocab_size, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            num_hidden_layers=s.n_layer, hidden_size=s.n_embd, num_attention_heads=s.n_head,
            num_key_value_heads=s.n_kv_head, intermediate_size=s.intermediate_size,
            max_position_embeddings=s.block_size, vocab_size=vocab_size, attention_dropout=0.0,
            attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(cfg)
    raise QKGeomError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")


def _optimizer(model: Any, settings: Settings, lr: float) -> Any:
    """AdamW with weight decay on the parameters of dim >= 2 only (the trainer's groups)."""
    import torch

    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(settings.beta1, settings.beta2))


def _loss(model: Any, x: Any, y: Any) -> Any:
    """Mean next-token cross-entropy (nats per character) over every position of ``x``."""
    import torch.nn.functional as F

    logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _val_loss(model: Any, batches: list[tuple[Any, Any]]) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        value = sum(float(_loss(model, x, y)) for x, y in batches) / len(batches)
    model.train()
    return value


def _train_config(trial: Trial, s: Settings, vocab_size: int, threads: int) -> dict[str, Any]:
    """The run's TrainConfig keys (config.json's ``config``: what collation reads)."""
    return {"seed": trial.seed, "lr": trial.lr, "steps": s.steps,
            "warmup_steps": s.warmup_steps, "batch_size": s.batch_size,
            "min_lr_ratio": s.min_lr_ratio, "weight_decay": s.weight_decay, "beta1": s.beta1,
            "beta2": s.beta2, "grad_clip": s.grad_clip, "probe_every": s.probe_every,
            "probe_sequences": s.probe_sequences, "eval_every": s.eval_every,
            "eval_batches": s.eval_batches, "log_every": 1, "checkpoint_every": s.steps,
            "precision": "fp32", "device": "cpu", "threads": threads,
            "model": {"n_layer": s.n_layer, "n_head": s.n_head, "n_embd": s.n_embd,
                      "block_size": s.block_size, "vocab_size": vocab_size, "dropout": 0.0,
                      "bias": trial.family == "gpt2"}}


def _loop(model: Any, opt: Any, mon: Any, trial: Trial, s: Settings, data: Any,
          val: list[tuple[Any, Any]], order: Any) -> tuple[str, int, dict[str, Any]]:
    """The plain training loop under the monitor; returns how it ended: ``(state, step,
    status extras)``."""
    import torch

    from qkgeom.data import sample_batch
    from qkgeom.geometry import NonFiniteError
    from qkgeom.training.schedule import lr_at

    model.train()
    mon.start(0)
    mon.log_loss(0, None, 0.0, val_loss=_val_loss(model, val))
    for step in range(1, s.steps + 1):
        lr = lr_at(step - 1, lr=trial.lr, warmup_steps=s.warmup_steps, steps=s.steps,
                   min_lr_ratio=s.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = sample_batch(data.train, s.batch_size, s.block_size, order)  # (B, T) each
        loss = _loss(model, x, y)
        value = float(loss.detach())
        if not math.isfinite(value):  # the weights of update step - 1 give no loss
            return "diverged", step - 1, {"diverged_step": step, "message":
                                          f"non-finite loss ({value}) at step {step}"}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        vl = _val_loss(model, val) if step % s.eval_every == 0 or step == s.steps else None
        if vl is not None and not math.isfinite(vl):
            mon.log_loss(step, value, lr)
            return "diverged", step, {"diverged_step": step, "message":
                                      f"non-finite val loss ({vl}) at step {step}"}
        try:
            mon.step(step, loss=value, lr=lr, val_loss=vl)
        except NonFiniteError as err:  # update step left inf/NaN weights, the loss was finite
            return "diverged", step, {"diverged_step": step,
                                      "message": f"{err} at the probe of step {step}"}
    return "done", s.steps, {}


def train_trial(trial: Trial, settings: Settings, out: str | Path, *, data_dir: Any = None,
                preset: str = "", threads: int = 1, model: Any = None) -> dict[str, Any]:
    """Train one run into the monitor run folder ``out`` (new or empty) and return its
    summary (:func:`_summary`). A non-finite training or validation loss, or weights the
    probe finds non-finite, stop the run as ``diverged`` (``diverged_step``, ``message``
    in status.json); any other error is recorded as ``failed`` (``error``) and raised.
    ``threads``: torch's CPU threads for the run (restored after). ``model``: the model
    to train in place, as :func:`build_model` makes it for ``trial`` (default: built
    here), for a caller that wants the trained weights."""
    import torch

    from qkgeom.alerts import GeometryWarning
    from qkgeom.data import ensure_sample_data, load_prepared, probe_set, sample_batch
    from qkgeom.monitor.monitor import GeometryMonitor

    s, out = settings, Path(out)
    data = load_prepared(data_dir if data_dir is not None else ensure_sample_data())
    vocab = data.vocab.vocab_size
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if model is None:
            with torch.random.fork_rng():  # the caller's global RNG is left as it was
                model = build_model(trial.family, s, vocab, trial.seed)
        opt = _optimizer(model, s, trial.lr)
        held_out = torch.Generator().manual_seed(EVAL_SEED)
        val = [sample_batch(data.val, s.batch_size, s.block_size, held_out)
               for _ in range(s.eval_batches)]
        record = {"trial": {"family": trial.family, "lr": trial.lr, "seed": trial.seed,
                            "steps": s.steps, "warmup_steps": s.warmup_steps, "preset": preset,
                            "settings": dataclasses.asdict(s), "data": "sample",
                            "init": "transformers' own init under torch.manual_seed(seed)",
                            "data_order": "sample_batch, torch.Generator().manual_seed(seed)",
                            "eval_seed": EVAL_SEED, "attn_implementation": "sdpa"},
                  "hf_config": json.loads(model.config.to_json_string())}
        mon = GeometryMonitor(model, probe_set(data.val, s.probe_sequences, s.block_size),
                              every=s.probe_every, metrics="all", out=out, run_id=out.name,
                              total_steps=s.steps, tensorboard=None, wandb=False,
                              histograms=False, config=_train_config(trial, s, vocab, threads),
                              record=record)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GeometryWarning)  # recorded in alerts.json
            try:
                state, step, info = _loop(model, opt, mon, trial, s, data, val,
                                          torch.Generator().manual_seed(trial.seed))
            except KeyboardInterrupt:
                mon.close("interrupted")
                raise
            except BaseException as err:
                mon.close("failed", error=one_line(err))
                raise
            mon.close(state, step, **info)
        return _summary(trial, mon, state, info, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)


def _summary(trial: Trial, mon: Any, state: str, info: dict[str, Any], wall_s: float
             ) -> dict[str, Any]:
    """What the progress line shows: state, last val loss, lowest layer entropy at the
    last probe, the alerts (count, first step and rule), wall time."""
    import pandas as pd

    log = mon.folder.log if mon.folder is not None else pd.DataFrame()
    vals = log["val_loss"].dropna() if len(log) else pd.Series(dtype=float)
    frame = mon.last.frame if mon.last is not None else pd.DataFrame(
        columns=["layer", "head", "metric", "value"])
    ent = frame[(frame["metric"] == "attn_entropy") & (frame["head"] == -1)
                & (frame["layer"] >= 0)]["value"]
    first = min(mon.fired, key=lambda a: (a.step, a.layer)) if mon.fired else None
    return {"run_id": trial.run_id, "state": state, "diverged_step": info.get("diverged_step"),
            "message": info.get("message", ""),
            "val_loss": float(vals.iloc[-1]) if len(vals) else math.nan,
            "min_entropy": float(ent.min()) if len(ent) else math.nan,
            "alerts": len(mon.fired), "first_alert_step": first.step if first else None,
            "first_alert": first.metric if first else "", "wall_s": wall_s}


def _run_one(trial: Trial, settings: Settings, out: str, data_dir: str, preset: str
             ) -> dict[str, Any]:
    """A worker's job: one run; an error is its summary (``failed``), never the grid's."""
    try:
        return train_trial(trial, settings, out, data_dir=data_dir, preset=preset)
    except Exception as err:  # recorded in the run's status.json by train_trial
        return {"run_id": trial.run_id, "state": "failed", "message": one_line(err)}


def _line(done: int, total: int, summary: dict[str, Any]) -> str:
    """One progress line per finished run."""
    from qkgeom.ui import clock, printable

    head = f"[{done:>{len(str(total))}}/{total}] {summary['run_id']:<22} {summary['state']:<8}"
    if summary["state"] == "failed":
        return printable(f"{head} {summary.get('message', '')}")
    if summary["state"] == "skipped":
        return f"{head} (finished before)"
    parts = [f"val loss {summary['val_loss']:.3f}", f"entropy min {summary['min_entropy']:.2f}"]
    if summary["state"] == "diverged":
        parts = [f"at step {summary['diverged_step']}"]
    alerts = summary["alerts"]
    parts.append(f"alerts {alerts}" + (f" (first: {summary['first_alert']} at step "
                                       f"{summary['first_alert_step']})" if alerts else ""))
    return f"{head} " + ", ".join(parts) + f", {clock(summary['wall_s'])}"


# ---------------------------------------------------------------------- the grid


def _check_out(out: Path) -> None:
    """An ``--out`` the grid may write: a new or empty folder, or one holding a grid."""
    if out.exists() and not out.is_dir():
        raise QKGeomError(f"{out} exists and is not a folder; choose another --out")
    refuse_link(out)
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in _OWN)
        if other:
            raise QKGeomError(f"{out} holds files that are not a trials grid's "
                              f"({', '.join(other[:4])}); choose an empty or new --out")
        for name in (TRIALS_FILE, RUNS_DIR):
            refuse_link(out / name)


def _merged_record(out: Path, grid: Grid) -> dict[str, Any]:
    """trials.json: this grid's, or the union of its runs with those already recorded
    there (their settings must be the same: one line otherwise)."""
    new = grid.record()
    path = out / TRIALS_FILE
    if not path.exists():
        return new
    old = read_json(path)
    if not (isinstance(old, dict) and isinstance(old.get("grid"), dict)
            and isinstance(old.get("runs"), list)):
        raise QKGeomError(f"{path}: not a trials record (a grid and a list of runs); "
                          "choose another --out")
    if old["grid"].get("settings") != new["grid"]["settings"]:
        raise QKGeomError(f"{path}: the runs there were trained with other settings (preset "
                          f"{old['grid'].get('preset')!r}); use another --out")
    runs = {r.get("run_id"): r for r in old["runs"] if isinstance(r, dict)}
    runs.update({r["run_id"]: r for r in new["runs"]})
    axes = {k: sorted(set(old["grid"].get(k) or []) | set(new["grid"][k]))
            for k in ("families", "lrs", "seeds")}
    return {"grid": {**new["grid"], **axes}, "runs": list(runs.values())}


def _clear(folder: Path) -> None:
    """Remove an unfinished run folder so that it restarts clean (only what qkgeom wrote
    there; anything else is refused in one line)."""
    from qkgeom.monitor.monitor import MONITOR_LOCK

    refuse_link(folder)
    if not folder.exists():
        return
    refuse_links(folder)
    foreign = [n for n in foreign_entries(folder) if n != MONITOR_LOCK]
    if foreign:
        raise QKGeomError(f"{folder} holds files the monitor did not write "
                          f"({', '.join(foreign[:4])}); remove them or the folder, then rerun")
    shutil.rmtree(folder)


def run_grid(grid: Grid, out: str | Path, *, workers: int = 2, data_dir: Any = None,
             echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Train every run of ``grid`` into ``out/runs/<run_id>/`` (``out/trials.json`` lists
    them), ``workers`` processes at a time (1 thread each; 1: in this process). A run
    finished before (``done`` or ``diverged``) is skipped; any other (interrupted,
    failed) restarts clean. One line per finished run through ``echo``; returns the
    summaries."""
    from qkgeom.data import ensure_sample_data

    out = Path(out)
    if workers < 1:
        raise QKGeomError(f"--workers must be >= 1, got {workers}")
    _check_out(out)
    make_dir(out)
    lock = RunLock(out, out / GRID_LOCK).require("run the grid")
    try:
        write_json(out / TRIALS_FILE, _merged_record(out, grid))
        data = str(ensure_sample_data() if data_dir is None else data_dir)
        runs = make_dir(out / RUNS_DIR)
        trials, done, todo = grid.trials(), [], []
        for trial in trials:
            folder = runs / trial.run_id
            refuse_link(folder)
            state = finished_state(read_status(folder)) if folder.is_dir() else None
            if state in ("done", "diverged"):
                done.append({"run_id": trial.run_id, "state": "skipped"})
                echo(_line(len(done), len(trials), done[-1]))
            else:
                _clear(folder)
                todo.append(trial)
        for summary in _train_all(todo, grid, runs, data, workers):
            done.append(summary)
            echo(_line(len(done), len(trials), summary))
        return done
    finally:
        lock.release()


def _train_all(todo: list[Trial], grid: Grid, runs: Path, data: str, workers: int) -> Any:
    """Each run's summary as it finishes: here (one worker) or in spawned processes."""
    jobs = [(t, grid.settings, str(runs / t.run_id), data, grid.preset) for t in todo]
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            yield _run_one(*job)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch
    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context) as pool:
        futures = [pool.submit(_run_one, *job) for job in jobs]
        try:
            for future in as_completed(futures):
                yield future.result()
        except BrokenProcessPool:
            raise QKGeomError("a worker process died (out of memory?); rerun the same "
                              "command: finished runs are skipped") from None


# ---------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (not usage + message)
        print(f"qkgeom: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _grid(args: argparse.Namespace) -> Grid:
    """The preset, with the axes the options replace."""
    if args.preset not in PRESETS:
        raise QKGeomError(f"unknown preset {args.preset!r}; choose one of "
                          f"{', '.join(PRESETS)}")
    grid = PRESETS[args.preset]
    families = tuple(args.families) if args.families else grid.families
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise QKGeomError(f"unknown model family {unknown[0]!r}; choose among "
                          f"{', '.join(FAMILIES)}")
    lrs = tuple(args.lrs) if args.lrs else grid.lrs
    if not all(math.isfinite(lr) and lr > 0 for lr in lrs):
        raise QKGeomError(f"--lrs must be positive finite numbers, got {list(lrs)}")
    seeds = tuple(args.seeds) if args.seeds is not None else grid.seeds
    if not seeds or min(seeds) < 0:
        raise QKGeomError(f"--seeds must be whole numbers >= 0, got {list(seeds)}")
    return dataclasses.replace(grid, families=tuple(dict.fromkeys(families)),
                               lrs=tuple(dict.fromkeys(lrs)), seeds=tuple(dict.fromkeys(seeds)))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m qkgeom.monitor.trials``: 0 when every run is done or diverged, 1 when
    one failed, 2 for bad input (one line)."""
    from qkgeom.ui import printable

    parser = _Parser(prog="python -m qkgeom.monitor.trials",
                     description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo", help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--out", type=Path, default=Path("sweeps/alerts-hf"))
    parser.add_argument("--workers", type=int, default=2, help="processes (1 thread each)")
    parser.add_argument("--families", nargs="+", help="replace the preset's families")
    parser.add_argument("--lrs", nargs="+", type=float, help="replace the preset's rates")
    parser.add_argument("--seeds", nargs="+", type=int, help="replace the preset's seeds")
    args = parser.parse_args(argv)
    try:
        summaries = run_grid(_grid(args), args.out, workers=args.workers)
    except QKGeomError as err:
        print(f"qkgeom: error: {printable(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("qkgeom: interrupted; rerun the same command to continue (finished runs are "
              "skipped)", file=sys.stderr)
        return 130
    failed = sum(s["state"] == "failed" for s in summaries)
    if failed:
        print(f"qkgeom: {failed} run(s) failed (status.json says why); rerun to retry them",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
