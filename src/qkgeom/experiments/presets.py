"""The paper's grids: E1 (depths x Q/K inits x seeds) and E3 (seeds x key-control arms).

E1: sizes of one structure, depth x ``qk_init`` x replicate, every run with its own seed
(``distinct_seeds``: runs that shared a seed would share their data order and, within a
depth, every initial weight but W_Q/W_K, so they would not be independent units); every
run sees the same probe set (probes come from the start of the val split):

``smoke``  depths {1, 2} x 3 inits x 1 = 6 runs of the ``smoke`` training preset (40
           steps): a wiring check, not a result.
``demo``   depths {4, 6, 8} x 3 inits x 2 = 18 runs on the embedded Wikipedia sample with
           the ``demo`` model (4 heads, width 128, context 64) trained for 400 steps of
           16 x 64 tokens (11 probes, every 40 steps).
``lab``    the demo's grid x 3 replicates = 27 runs of 2 000 steps (5x the demo's, probes
           every 100): the regime after the early transient, about an hour on 2 CPU cores.
``paper``  depths {4, 6, 8} x 3 inits x 4 = 36 runs of the ``paper`` training preset on the
           prepared corpus ``data`` (WikiText-103, char level).

E3: seeds x named **arms** (:attr:`qkgeom.config.KeyControlConfig.arm`): ``none`` (no
control, records its per-step key PR and spread), ``sham-<level>-<scale>``,
``hold-<level>-<scale>`` and ``shrink-<dose>-<level>-<scale>``. Every controlled arm
references the ``none`` run of its seed (a cap relative to its PR_K; the data rule's key
spread matched to its), so the sweep runner trains that run first. The runs of one seed
start from the same init and see the same batches, so they are paired by seed. Sizes (the
seed counts come from the power calculation of docs/protocols.md#e3):

``smoke``  2 seeds x 4 arms (none, sham, hold, shrink-0.5; token level, data rule).
``demo``   20 seeds x those 4 arms = 80 runs of the E1 demo's 4-layer model (normal init)
           on the embedded sample, 400 steps, probed every 25 steps.
``lab``    8 seeds x the same 4 arms = 32 runs of 2 000 steps (probes every 100): about
           an hour on 2 CPU cores; fewer seeds than the power calculation asks for, said in
           its report.
``paper``  20 seeds x 8 arms (none; sham, hold and shrink at doses 0.75, 0.5, 0.25 at the
           token level with the data rule; hold and shrink-0.5 at the weight level with the
           Frobenius rule) = 160 runs of the ``paper`` preset (6 layers) on WikiText-103.

Nothing here is tuned to make a claim hold: sizes come from throughput and the power
calculation, fixed before any result (docs/protocols.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.config import QK_INITS, KeyControlConfig, TrainConfig, deep_merge
from qkgeom.errors import QKGeomError
from qkgeom.experiments.grid import Grid, nest_keys
from qkgeom.experiments.runner import SweepSummary, available_cpus, on_this_machine, run_sweep
from qkgeom.runs.sweep import run_dir

PAPER_DEPTHS = [4, 6, 8]

# preset -> (training preset, overrides for every run, depths, replicates)
E1_PRESETS: dict[str, tuple[str, dict[str, Any], list[int], list[int]]] = {
    "smoke": ("smoke", {}, [1, 2], [0]),
    "demo": ("demo", {
        "model": {"n_head": 4, "n_embd": 128, "block_size": 64},
        "steps": 400, "batch_size": 16, "warmup_steps": 30, "probe_every": 40,
        "eval_every": 100, "eval_batches": 4, "checkpoint_every": 100,
    }, PAPER_DEPTHS, [0, 1]),
    "lab": ("demo", {
        "model": {"n_head": 4, "n_embd": 128, "block_size": 64},
        "steps": 2000, "batch_size": 16, "warmup_steps": 30, "probe_every": 100,
        "eval_every": 250, "eval_batches": 4, "checkpoint_every": 500,
    }, PAPER_DEPTHS, [0, 1, 2]),
    "paper": ("paper", {}, PAPER_DEPTHS, [0, 1, 2, 3]),
}


_DEMO_BASE: dict[str, Any] = E1_PRESETS["demo"][1]
_LAB_BASE: dict[str, Any] = E1_PRESETS["lab"][1]

#: The arms every E3 size has: the primary rows of docs/protocols.md#e3 read them.
E3_CORE_ARMS = ["none", "sham-token-data", "hold-token-data", "shrink-0.5-token-data"]
# preset -> (training preset, overrides for every run, seeds, arm names)
E3_PRESETS: dict[str, tuple[str, dict[str, Any], list[int], list[str]]] = {
    "smoke": ("smoke", {}, [0, 1], E3_CORE_ARMS),
    "demo": ("demo", deep_merge(_DEMO_BASE, {"model": {"n_layer": 4, "qk_init": "normal"},
                                             "probe_every": 25, "eval_every": 100}),
             list(range(20)), E3_CORE_ARMS),
    "lab": ("demo", deep_merge(_LAB_BASE, {"model": {"n_layer": 4, "qk_init": "normal"}}),
            list(range(8)), E3_CORE_ARMS),
    "paper": ("paper", {"model": {"n_layer": 6, "qk_init": "normal"}}, list(range(20)),
              [*E3_CORE_ARMS, "shrink-0.75-token-data", "shrink-0.25-token-data",
               "hold-weight-frobenius", "shrink-0.5-weight-frobenius"]),
}


def e3_arm(name: str) -> dict[str, Any]:
    """The E3 arm called ``name`` as a grid arm (docs/definitions.md#e3-arms).

    ``none``: no control, ``key_control.record`` on (its per-step PR_K and key spread are
    the reference); every other arm sets the mode, dose, level and scale rule its name
    gives (:meth:`qkgeom.config.KeyControlConfig.arm_settings`) and references ``none``
    when it reads it (a cap, or the data rule's matched spread; a Frobenius hold does not).
    """
    settings = KeyControlConfig.arm_settings(name)
    if name == "none":
        return {"name": name, "set": {"key_control.mode": "none", "key_control.record": True}}
    arm = {"name": name, "set": {f"key_control.{k}": v for k, v in settings.items()}}
    if settings["mode"] in KeyControlConfig.CAPPED or settings["scale"] == "data":
        arm["reference"] = "none"  # a cap relative to it, or its key spread matched
    return arm


def _base(name: str, base: dict[str, Any], data: str,
          overrides: dict[str, Any] | None) -> dict[str, Any]:
    merged = deep_merge(nest_keys(base, f"{name} base"),
                        nest_keys(overrides or {}, f"{name} overrides"))
    if data:
        merged["data"] = str(data)
    return merged


def _need_data(experiment: str, preset: str, data: str) -> None:
    if preset == "paper" and not data:
        raise QKGeomError(f"the paper {experiment} grid trains on WikiText-103: pass data=<folder "
                          "prepared with `qkgeom data prepare --source wikitext-103`>")


def e1_grid(preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
    """The E1 grid at size ``preset`` (smoke | demo | paper) on the prepared corpus ``data``.

    ``data=""`` is the embedded Wikipedia sample (the paper preset needs a real corpus).
    ``overrides`` (nested or dotted keys) are applied to every run, e.g.
    ``{"device": "cuda"}``; they are part of the grid, so the sweep folder records them.
    """
    if preset not in E1_PRESETS:
        raise QKGeomError(f"unknown E1 preset {preset!r}; choose one of {', '.join(E1_PRESETS)}")
    train_preset, base, depths, seeds = E1_PRESETS[preset]
    _need_data("E1", preset, data)
    return Grid.from_dict({
        "name": f"e1-{preset}",
        "preset": train_preset,
        "base": _base("e1", base, data, overrides),
        "axes": {"model.n_layer": list(depths), "model.qk_init": list(QK_INITS),
                 "seed": list(seeds)},
        "distinct_seeds": True,
    })


def e3_grid(preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
    """The E3 grid at size ``preset``: seeds x the preset's arms (:data:`E3_PRESETS`).

    The seed is the outer axis and ``none`` the first arm, so a sweep finishes whole seeds
    first and a partial sweep already has complete pairs to compare. ``overrides`` as in
    :func:`e1_grid` (e.g. ``{"key_control": {"scope": "head"}}``); a key an arm sets is
    the arm's.
    """
    if preset not in E3_PRESETS:
        raise QKGeomError(f"unknown E3 preset {preset!r}; choose one of {', '.join(E3_PRESETS)}")
    train_preset, base, seeds, arms = E3_PRESETS[preset]
    _need_data("E3", preset, data)
    return Grid.from_dict({
        "name": f"e3-{preset}",
        "preset": train_preset,
        "base": _base("e3", base, data, overrides),
        "axes": {"seed": list(seeds)},
        "arms": [e3_arm(name) for name in arms],
    })


GRIDS: dict[str, Callable[..., Grid]] = {"e1": e1_grid, "e3": e3_grid}


def reproduce(
    experiment: str,
    preset: str,
    out_dir: str | Path,
    data: str = "",
    *,
    workers: int | None = None,
    backend: str = "local",
    address: str | None = None,
    threads_per_run: int | None = None,
    progress: bool = True,
    retry_failed: bool = False,
    overrides: dict[str, Any] | None = None,
    retries: int = 0,
    runs_per_gpu: int | str = 1,
) -> SweepSummary:
    """Expand the grid of ``experiment`` (``e1`` | ``e3``) at size ``preset`` and run it into
    ``out_dir`` (resumable; see :func:`~qkgeom.experiments.runner.run_sweep`).

    ``workers=None`` picks the layout measured fastest for each size: for ``smoke`` and
    ``demo`` (small CPU models that do not scale across threads) one single-threaded run
    per CPU, at most one per run (benchmarks/sweep_scaling.py: 2 workers x 1 thread was
    3.5x faster than 1 worker x 2 threads on 2 shared cores); for ``paper`` on CUDA
    ``runs_per_gpu`` runs per GPU (a number or ``"auto"``), on a CPU one run at a time.
    ``overrides`` (nested or dotted config keys) apply to every run. ``retries``: Ray task
    retries (see :func:`~qkgeom.experiments.runner.run_sweep`).
    """
    if experiment not in GRIDS:
        raise QKGeomError(f"unknown experiment {experiment!r}; choose one of "
                          f"{', '.join(GRIDS)}")
    grid = GRIDS[experiment](preset, data, overrides)
    if workers is None and preset != "paper":
        workers = max(1, min(available_cpus(), len(grid.expand())))
        if threads_per_run is None:
            threads_per_run = 1
    elif workers is None and not on_this_machine(grid.expand()[0]).config.device.startswith(
            "cuda"):
        workers = 1  # the paper preset on a CPU: one run with every thread
    return run_sweep(grid, out_dir, workers=workers, backend=backend, address=address,
                     threads_per_run=threads_per_run, progress=progress,
                     retry_failed=retry_failed, retries=retries, runs_per_gpu=runs_per_gpu)


def reproduce_e1(preset: str, out_dir: str | Path, data: str = "", **options: Any) -> SweepSummary:
    """E1 + E2: :func:`reproduce` of the E1 grid (depth x Q/K init x seed)."""
    return reproduce("e1", preset, out_dir, data, **options)


def reproduce_e3(preset: str, out_dir: str | Path, data: str = "", **options: Any) -> SweepSummary:
    """E3: :func:`reproduce` of the E3 grid (seed x arm, paired by seed)."""
    return reproduce("e3", preset, out_dir, data, **options)


# ------------------------------------------------------------------------------------- E4
#
# E4 offline: runs of our GPT, one per seed, trained with the ``log`` checkpoint schedule
# (step 0, the powers of two below ``checkpoint_every``, then its multiples: the shape of
# Pythia's suite), whose checkpoints are then analysed as a family each on held-out text,
# and reported with the seed as the unit. The folder ``OUT`` (layout:
# :mod:`qkgeom.runs.family`) holds ``e4.json``, ``train/`` (the sweep of the runs),
# ``analysis/seed-<s>/`` (each seed's family) and ``report/``.
#
# ``smoke``  the ``smoke`` training preset, 40 steps, checkpoints 0, 1, 2, 4, 8, 16, 32, 40;
#            seeds 0 and 1; 2 048 tokens in 8 blocks. Seconds: what the tests run.
# ``demo``   the demo model (4 layers x 128, 4 heads, context 64, normal init), batch 32,
#            1 024 steps, checkpoint_every 64: 23 checkpoints (0, 1, 2, ..., 32, 64, 128,
#            ..., 1 024), 15 of them after the 100-step LR warm-up; 32 768 tokens of the
#            sample's held-out text in 8 blocks, windows of the context. Seeds 0-4: five,
#            because with n independent units the sign-flip p is at least 2^-n, so fewer
#            than five seeds can never reach p < 0.05 (three would only describe). One
#            thread per run, one run per CPU (two OpenMP threads stall on a shared 2-core
#            machine). The run itself is the one-seed demo's, sized from throughput alone
#            before any E4 verdict was seen: measured on the 2-core dev machine (one thread,
#            CPU time) 0.21 s per step (probes and evals included) and 1.8 s per checkpoint
#            analysed, i.e. about 215 s training + 41 s analysis per seed; five seeds, two
#            trained at a time and analysed in turn, about 15 min on an idle machine.
# ``paper``  no training run: the paper's E4 is on pretrained suites; pass a hub family
#            (``model`` + ``revisions``, e.g. EleutherAI/pythia-160m at step0, step512, ...);
#            200 000 tokens in 8 blocks. One family is one unit: its layers describe it.
#
# With a hub family (``model``) any preset only sets the analysis (text, tokens, blocks).

E4_TRAIN = "train"  # OUT/train: the sweep folder of the offline E4's runs (one per seed)
E4_ANALYSIS = "analysis"  # OUT/analysis: the family (--model) or a folder per seed


@dataclass(frozen=True)
class E4Preset:
    """One size of E4: the training runs (None: a hub family is required), the seeds, and
    the analysis."""

    train_preset: str | None
    overrides: dict[str, Any]
    tokens: int  # text tokens analysed per checkpoint (the same tokens for all)
    seeds: tuple[int, ...] = ()
    blocks: int = 8  # contiguous token blocks, for the noise and the bootstrap
    text: str = "sample"  # the embedded sample: its held-out (val) split first


E4_PRESETS: dict[str, E4Preset] = {
    "smoke": E4Preset("smoke", {"steps": 40, "checkpoint_every": 16,
                                "checkpoint_schedule": "log", "keep_checkpoints": 0}, 2048,
                      (0, 1)),
    "demo": E4Preset("demo", {
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64,
                  "qk_init": "normal"},
        "steps": 1024, "batch_size": 32, "probe_every": 64, "eval_every": 128,
        "checkpoint_every": 64, "checkpoint_schedule": "log", "keep_checkpoints": 0,
    }, 32768, (0, 1, 2, 3, 4)),
    "paper": E4Preset(None, {}, 200_000),
}


def e4_preset(preset: str) -> E4Preset:
    """The E4 preset ``preset`` (smoke | demo | paper); QKGeomError for another name."""
    if preset not in E4_PRESETS:
        raise QKGeomError(f"unknown E4 preset {preset!r}; choose one of {', '.join(E4_PRESETS)}")
    return E4_PRESETS[preset]


def _need_runs(preset: str, spec: E4Preset) -> None:
    if spec.train_preset is None:
        raise QKGeomError(f"the {preset} E4 preset analyses a pretrained family: pass model=<hub "
                          "id or folder> and revisions (CLI: --model, --revisions)")


def e4_grid(preset: str, data: str = "", overrides: dict[str, Any] | None = None) -> Grid:
    """The offline E4's runs at size ``preset``: one per seed of the preset, with the
    ``log`` checkpoint schedule (``overrides``: nested or dotted keys on top, e.g.
    ``{"device": "cuda"}``)."""
    spec = e4_preset(preset)
    _need_runs(preset, spec)
    return Grid.from_dict({"name": f"e4-{preset}", "preset": spec.train_preset,
                           "base": _base("e4", spec.overrides, data, overrides),
                           "axes": {"seed": list(spec.seeds)}})


def e4_config(preset: str, data: str = "", overrides: dict[str, Any] | None = None
              ) -> TrainConfig:
    """The training config of the offline E4's first seed at size ``preset``."""
    return e4_grid(preset, data, overrides).expand()[0].config


def train_e4(preset: str, out_dir: str | Path, data: str = "", *,
             overrides: dict[str, Any] | None = None, progress: bool = True
             ) -> dict[int, Path]:
    """Train the offline E4's runs into ``out_dir/train`` (a sweep folder: one run per
    seed, one single-threaded run per CPU) and return ``{seed: run folder}``.

    Resumable: finished runs are left as they are, an interrupted one continues from its
    newest checkpoint (bit-exact on CPU), missing ones start."""
    grid = e4_grid(preset, data, overrides)
    specs = grid.expand()
    out = Path(out_dir) / E4_TRAIN
    on_cpu = not on_this_machine(specs[0]).config.device.startswith("cuda")
    summary = run_sweep(grid, out, workers=max(1, min(available_cpus(), len(specs)))
                        if on_cpu else None, threads_per_run=1 if on_cpu else None,
                        progress=progress)
    if not summary.complete or summary.counts["diverged"]:
        bad = {k: v for k, v in summary.states.items() if v != "done"}
        raise QKGeomError(f"the E4 runs in {out} did not all finish ({bad}); run the same "
                          "command again to resume (`qkgeom sweep status` shows why)")
    return {int(s.axes["seed"]): run_dir(out, s.run_id) for s in specs}


@contextmanager
def _one_thread_on_cpu(device: str | None) -> Iterator[None]:
    """torch on one thread while the runs' checkpoints are analysed here on a CPU: the runs
    trained in single-threaded workers, and this process would otherwise take a thread per
    core, which stalls on a shared machine (docs/checkpoints.md has the times)."""
    import torch

    from qkgeom.training import resolve_device

    before = torch.get_num_threads()
    if str(resolve_device(device or "auto")) == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reproduce_e4(preset: str, out: str | Path | None = None, *, data: str = "",
                 model: str | None = None, revisions: list[str] | None = None,
                 text: str | None = None, tokens: int | None = None, device: str | None = None,
                 overrides: dict[str, Any] | None = None, progress: bool = True) -> Path:
    """E4 end to end; returns the folder whose report was written.

    Without ``model``: train the preset's runs, one per seed, with the ``log`` checkpoint
    schedule (:func:`train_e4`), analyse each run's checkpoints as a family into
    ``OUT/analysis/seed-<s>`` (its own report beside), mark ``OUT`` as an E4 set
    (``e4.json``) and write the report over seeds into ``OUT/report``; returns ``OUT``.
    With ``model`` (a hub id or local HF folders) and ``revisions``: analyse that family
    into ``OUT/analysis`` and report it (one model: its layers describe it); returns that
    folder. ``OUT`` defaults to ``sweeps/e4-<preset>`` (``sweeps/e4-<model>`` for a family).
    Resumable: rerunning trains nothing twice and reuses every analysed checkpoint.
    ``device`` (default ``auto``: CUDA, then MPS, then CPU) is where the runs train and
    the families are measured."""
    from qkgeom.analysis import write_report
    from qkgeom.checkpoints.family import analyze_checkpoints
    from qkgeom.io import read_json, write_json
    from qkgeom.runs.family import SET_KIND, SET_MARKER
    from qkgeom.training import resolve_device

    spec = e4_preset(preset)
    if device:
        resolve_device(device)
    analysis = {"text": text or spec.text, "max_tokens": tokens or spec.tokens,
                "blocks": spec.blocks, "device": device or "auto", "progress": progress}
    if model is not None:
        if data or overrides:
            raise QKGeomError("--data and --set configure the training run; with --model there "
                              "is none (the family is analysed as it is)")
        out = Path(out or Path("sweeps") / f"e4-{model.rstrip('/').replace('/', '_')}")
        folder = analyze_checkpoints([model], out / E4_ANALYSIS, revisions=revisions,
                                     **analysis)
        write_report(folder)
        return folder
    if revisions is not None:
        raise QKGeomError("--revisions names checkpoints of --model; pass --model too")
    _need_runs(preset, spec)
    out = Path(out or Path("sweeps") / f"e4-{preset}")
    marker = out / SET_MARKER
    if marker.is_file() and read_json(marker).get("preset") != preset:
        raise QKGeomError(f"{out} holds an E4 set of another preset; use another --out")
    over = {**({"device": device} if device else {}), **(overrides or {})}
    runs = train_e4(preset, out, data, overrides=over or None, progress=progress)
    units = {}
    with _one_thread_on_cpu(device):
        for seed, run in runs.items():
            folder = analyze_checkpoints([str(run)], out / E4_ANALYSIS / f"seed-{seed}",
                                         **analysis)
            write_report(folder)
            units[f"seed-{seed}"] = f"{E4_ANALYSIS}/seed-{seed}"
    cfg = e4_config(preset, data, over or None)
    write_json(marker, {"kind": SET_KIND, "name": f"e4-{preset}", "preset": preset,
                        "seeds": sorted(runs), "warmup_steps": cfg.warmup_steps,
                        "units": units})
    write_report(out)
    return out
