"""E4: how Q/K geometry changes across a family of checkpoints.

Offline: one run of our GPT per seed, trained with the ``log`` checkpoint schedule, each
run's checkpoints analysed as a family, the report over seeds (the seed is the unit). With a
hub family (``model``, ``revisions``) nothing is trained. The folder layout
(:mod:`qkgeom.runs.family`) and sizes (five demo seeds: the least that can reach p < 0.05):
docs/checkpoints.md#reproducing-e4-offline-qkgeom-reproduce-e4.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.errors import QKGeomError
from qkgeom.experiments.experiment import Experiment, Preset
from qkgeom.experiments.grid import Grid
from qkgeom.runs.sweep import run_dir

E4_TRAIN = "train"  # OUT/train: the sweep folder of the offline E4's runs (one per seed)
E4_ANALYSIS = "analysis"  # OUT/analysis: the family (--model) or a folder per seed


@dataclass(frozen=True)
class E4Preset(Preset):
    """One size of E4: the training runs (``train_preset`` None: a hub family is required),
    the seeds and the analysis."""

    tokens: int = 0  # text tokens analysed per checkpoint (the same tokens for all)
    blocks: int = 8  # contiguous token blocks, for the noise and the bootstrap
    text: str = "sample"  # the embedded sample: its held-out (val) split first


E4_PRESETS: dict[str, E4Preset] = {
    "smoke": E4Preset("smoke", {"steps": 40, "checkpoint_every": 16,
                                "checkpoint_schedule": "log", "keep_checkpoints": 0},
                      (0, 1), tokens=2048),
    "demo": E4Preset("small", {
        "model": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64,
                  "qk_init": "normal"},
        "steps": 1024, "batch_size": 32, "probe_every": 64, "eval_every": 128,
        "checkpoint_every": 64, "checkpoint_schedule": "log", "keep_checkpoints": 0,
    }, (0, 1, 2, 3, 4), tokens=32768),
    "paper": E4Preset(None, {}, tokens=200_000),
}


@contextmanager
def _one_thread_on_cpu(device: str | None) -> Iterator[None]:
    """torch on one thread while the runs' checkpoints are analysed on a CPU: the runs
    trained single-threaded, and a thread per core stalls on a shared machine
    (docs/checkpoints.md)."""
    import torch

    from qkgeom.training import resolve_device

    before = torch.get_num_threads()
    if str(resolve_device(device or "auto")) == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class E4(Experiment):
    name = "e4"
    presets = E4_PRESETS

    def training(self, preset: str) -> None:
        """A one-line error unless the preset trains runs (else it needs a hub family)."""
        if self.preset(preset).train_preset is None:
            raise QKGeomError(f"the {preset} E4 preset analyses a pretrained family: pass "
                              "model=<hub id or folder> and revisions (CLI: --model, "
                              "--revisions)")

    def grid(self, preset: str, data: str = "", overrides: dict[str, Any] | None = None
             ) -> Grid:
        self.training(preset)
        return super().grid(preset, data, overrides)

    def train(self, grid: Grid, out_dir: str | Path, *, progress: bool = True
              ) -> dict[int, Path]:
        """Train the runs of ``grid`` into ``out_dir/train`` (one single-threaded run per
        CPU on a CPU), resumable; returns ``{seed: run folder}``."""
        out = Path(out_dir) / E4_TRAIN
        summary = super().run(grid, out, progress=progress)  # E4 grids are never ``paper``
        if not summary.complete or summary.counts["diverged"]:
            bad = {k: v for k, v in summary.states.items() if v != "done"}
            raise QKGeomError(f"the E4 runs in {out} did not all finish ({bad}); run the same "
                              "command again to resume (`qkgeom sweep status` shows why)")
        return {int(s.axes["seed"]): run_dir(out, s.run_id) for s in grid.expand()}

    def run(self, preset: str, out: str | Path | None = None, *, data: str = "",  # type: ignore[override]
            model: str | None = None, revisions: list[str] | None = None,
            text: str | None = None, tokens: int | None = None, device: str | None = None,
            overrides: dict[str, Any] | None = None, progress: bool = True) -> Path:
        """E4 end to end; returns the folder whose report was written.

        Without ``model``: train the preset's runs, analyse each into ``OUT/analysis/seed-<s>``,
        mark ``OUT`` an E4 set (``e4.json``) and report over seeds into ``OUT/report``; returns
        ``OUT`` (default ``sweeps/e4-<preset>``). With ``model`` and ``revisions``: analyse that
        family into ``OUT/analysis`` and report it. Reruns train nothing twice and reuse every
        analysed checkpoint; ``device`` is where runs train and families are measured."""
        from qkgeom.checkpoints.family import analyze_checkpoints
        from qkgeom.training import resolve_device

        spec = self.preset(preset)
        if device:
            resolve_device(device)
        assert isinstance(spec, E4Preset)
        analysis = {"text": text or spec.text, "max_tokens": tokens or spec.tokens,
                    "blocks": spec.blocks, "device": device or "auto", "progress": progress}
        if model is not None:
            if data or overrides:
                raise QKGeomError("--data and --set configure the training run; with --model "
                                  "there is none (the family is analysed as it is)")
            out = Path(out or Path("sweeps") / f"e4-{model.rstrip('/').replace('/', '_')}")
            folder = analyze_checkpoints([model], out / E4_ANALYSIS, revisions=revisions,
                                         **analysis)
            self.report(folder)
            return folder
        if revisions is not None:
            raise QKGeomError("--revisions names checkpoints of --model; pass --model too")
        self.training(preset)
        out = Path(out or self.default_out(preset))
        self._refuse_other_preset(out, preset)
        over = {**({"device": device} if device else {}), **(overrides or {})} or None
        grid = self.grid(preset, data, over)
        runs = self.train(grid, out, progress=progress)
        units = {}
        with _one_thread_on_cpu(device):
            for seed, run in runs.items():
                folder = analyze_checkpoints([str(run)], out / E4_ANALYSIS / f"seed-{seed}",
                                             **analysis)
                self.report(folder)
                units[f"seed-{seed}"] = f"{E4_ANALYSIS}/seed-{seed}"
        warmup = grid.expand()[0].config.warmup_steps
        self._mark_set(out, preset, sorted(runs), units, warmup)
        self.report(out)
        return out

    @staticmethod
    def _refuse_other_preset(out: Path, preset: str) -> None:
        from qkgeom.io import read_json
        from qkgeom.runs.family import SET_MARKER

        marker = out / SET_MARKER
        if marker.is_file() and read_json(marker).get("preset") != preset:
            raise QKGeomError(f"{out} holds an E4 set of another preset; use another --out")

    def _mark_set(self, out: Path, preset: str, seeds: list[int], units: dict[str, str],
                  warmup_steps: int) -> None:
        """``OUT/e4.json``: an E4 set of these seeds and their warm-up (shown, not tested)."""
        from qkgeom.io import write_json
        from qkgeom.runs.family import SET_KIND, SET_MARKER

        write_json(out / SET_MARKER, {"kind": SET_KIND, "name": f"e4-{preset}",
                                      "preset": preset, "seeds": seeds,
                                      "warmup_steps": warmup_steps, "units": units})
