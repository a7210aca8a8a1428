"""The composition root of a run: a config -> the callbacks it asks for -> the trainer.

The features a config can switch on (key-spectrum control, the entropy closed loop,
QK-Clip) are built here and nowhere else; the CLI, the sweep workers and ``qkgeom.train``
all train through :func:`train`, so a run means the same thing however it was started.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.config import TrainConfig
from qkgeom.training import Callback, RunResult, TrainContext
from qkgeom.training import train as _train_with

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["QKClipCallback", "callbacks_for", "train"]


class QKClipCallback(Callback):
    """QK-Clip after every optimiser step: the model's own :meth:`~qkgeom.model.GPT.qk_clip_`
    (so a plain loop calls the same one line). At each probe it adds the flat metric
    ``qk_clip_share``: the share of (update, layer, head) triples clipped since the previous
    probe (0 at step 0). The count stays on the device until a probe or a checkpoint reads
    it."""

    feature = "qk_clip"

    def __init__(self) -> None:
        self.clipped: Any = 0  # heads clipped since the last probe (a device tensor, or 0)
        self.seen = 0  # (update, layer, head) triples since the last probe

    def on_step_end(self, ctx: TrainContext) -> None:
        self.clipped = self.clipped + ctx.model.qk_clip_()
        self.seen += ctx.config.model.n_layer * ctx.config.model.n_head

    def on_probe(self, ctx: TrainContext, metrics: pd.DataFrame) -> dict[str, float] | None:
        share = int(self.clipped) / self.seen if self.seen else 0.0
        self.clipped, self.seen = 0, 0
        return {"qk_clip_share": share}

    def state_dict(self) -> dict[str, Any]:
        return {"clipped": int(self.clipped), "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clipped, self.seen = int(state.get("clipped", 0)), int(state.get("seen", 0))


def callbacks_for(cfg: TrainConfig, out_dir: str | Path | None = None) -> list[Callback]:
    """The callbacks that implement what ``cfg`` enables; ``out_dir`` is the run folder, where
    the key control writes ``key_pr.parquet`` and against whose parent it resolves a relative
    ``key_control.reference``."""
    out: list[Callback] = []
    if cfg.key_control.active:  # a control, or only the per-step key-PR record
        from qkgeom.control import KeyControlCallback

        out.append(KeyControlCallback(cfg.key_control, run_dir=out_dir))
    if cfg.entropy_control.active:
        from qkgeom.control.closed_loop import EntropyControlCallback, EntropyController

        ec = cfg.entropy_control
        out.append(EntropyControlCallback(EntropyController(ec.target, gain=ec.gain,
                                                            max_step=ec.max_step)))
    if cfg.model.qk_clip:
        out.append(QKClipCallback())
    return out


def train(cfg: TrainConfig, out_dir: str | Path, *, resume: bool = False,
          callbacks: list[Callback] | None = None, progress: bool = False,
          run_id: str | None = None, progress_every: int | None = None) -> RunResult:
    """Train one run into ``out_dir`` (docs/training.md); your ``callbacks`` run after those
    the config asks for.

    ``resume``: continue from the newest checkpoint (bit-exact on CPU). ``progress``: a bar
    on a terminal, else a line every ``progress_every`` steps (default ``probe_every``).
    Raises QKGeomError for bad input before any work, DivergedError (after recording
    ``diverged``) when the loss or the geometry stops being finite."""
    return _train_with(cfg, out_dir, resume=resume,
                       callbacks=[*callbacks_for(cfg, out_dir), *(callbacks or [])],
                       progress=progress, run_id=run_id, progress_every=progress_every)
