"""Wall time of ``qkgeom report`` on an E1 sweep, against references measured in this run.

The claim it checks (issue 14): the report of a demo-sized E1 sweep takes at most ~15 s,
because figures are drawn once at screen resolution (PNG 150 dpi, one layout pass for the
PNG and the SVG) and report.html links its large figures instead of embedding them.

Variants, each a fresh Python process writing a fresh report folder (so imports count, as
for the command), run interleaved (rep 1 of every variant, then rep 2, ...) so that machine
noise hits them alike:

- ``new``: ``write_report`` as shipped;
- ``new@300dpi``: the same report with the figures saved at 300 dpi (the old resolution,
  still one layout pass): how much of the gain is the resolution;
- ``old`` (with ``--old-ref REV``): the code of git revision ``REV`` of this checkout
  (``git archive``; e.g. the commit before the change), on the same folder.

The folder: ``--sweep DIR`` (copied to a temporary folder first, so nothing is written
into it), or by default a synthetic sweep of the demo grid's size: depths 4, 6, 8 × inits
normal, orthogonal, tied × 2 seeds, 4 heads, 11 probes, both levels, every metric the
report draws (values are smooth curves with seed noise; their numbers do not matter here).

Printed: per variant the median and range of the wall time, the median CPU time (user +
system of the child: what a busy machine inflates least) and the report's size; last the
ratios ``new / new@300dpi`` and (with ``--old-ref``) ``new / old`` of both medians.

    python benchmarks/report_time.py [--sweep DIR] [--reps 3] [--old-ref fb40080]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DEPTHS, INITS, SEEDS, HEADS = (4, 6, 8), ("normal", "orthogonal", "tied"), (0, 1), 4
STEPS = list(range(0, 401, 40))  # 11 probes of a 400-step run
METRICS = [f"{m}_{lv}" for lv in ("weight", "token") for m in ("pr_q", "pr_k", "contrast",
                                                                 "pr_qk")]
METRICS += ["attn_entropy", "attn_entropy_norm", "attn_max", "logit_std"]

_RUN = """
import sys
from qkgeom.analysis import write_report
{patch}
write_report(sys.argv[1], sys.argv[2])
"""
_AT_300_DPI = """
import functools
import qkgeom.analysis.e1.figures as figures
figures.save_figure = functools.partial(figures.save_figure, dpi=300)
"""


def _values(rng: np.random.Generator, depth: int) -> pd.DataFrame:
    """One run's metrics: PR_Q and PR_K fall then drift apart, entropy follows pr_qk."""
    t = np.array(STEPS, dtype=float) / STEPS[-1]
    rows = []
    for layer in range(depth):
        q = 6 + 20 * np.exp(-6 * t) + 3 * t + rng.normal(0, 0.3, len(t))
        k = 6 + 22 * np.exp(-6 * t) - 1 * t + rng.normal(0, 0.3, len(t))
        for head in [*range(HEADS), -1]:
            jitter = 0.0 if head < 0 else rng.normal(0, 0.5)
            base = {"pr_q": q + jitter, "pr_k": k + jitter, "contrast": q - k,
                    "pr_qk": k / 2 + jitter}
            for metric in METRICS:
                stem = metric.rsplit("_", 1)[0] if metric.endswith(("_weight", "_token")) \
                    else metric
                vals = base.get(stem, 1.0 + base["pr_qk"] / 10)
                rows += [(s, layer, head, metric, float(v)) for s, v in zip(STEPS, vals,
                                                                             strict=True)]
    return pd.DataFrame(rows, columns=["step", "layer", "head", "metric", "value"])


def demo_sized_sweep(root: Path) -> Path:
    """A synthetic E1 sweep folder of the demo grid's size (see the module docstring)."""
    rng = np.random.default_rng(0)
    runs = []
    for depth in DEPTHS:
        for init in INITS:
            for seed in SEEDS:
                rid = f"n_layer={depth},qk_init={init},seed={seed}"
                out = root / "runs" / rid
                out.mkdir(parents=True)
                cfg = {"model": {"n_layer": depth, "n_head": HEADS, "n_embd": 128,
                                 "block_size": 64, "vocab_size": 96, "qk_init": init},
                       "seed": seed, "steps": STEPS[-1], "batch_size": 16, "lr": 3e-3,
                       "warmup_steps": 30, "reference_step": -1, "probe_every": 40,
                       "probe_sequences": 16, "device": "cpu", "data": ""}
                (out / "config.json").write_text(json.dumps({
                    "run_id": rid, "config": cfg, "config_hash": f"h{seed}", "data_dir": "/x",
                    "data_source": "synthetic", "vocab_size": 96, "versions": {}}))
                _values(rng, depth).assign(run_id=rid).to_parquet(out / "metrics.parquet",
                                                                  index=False)
                pd.DataFrame({"step": STEPS, "loss": np.linspace(4, 2, len(STEPS)),
                              "val_loss": np.linspace(4.1, 2.1, len(STEPS)), "lr": 3e-3,
                              "tokens_per_s": 5000.0}).to_parquet(out / "train_log.parquet",
                                                                  index=False)
                (out / "status.json").write_text(json.dumps(
                    {"state": "done", "step": STEPS[-1], "steps": STEPS[-1]}))
                runs.append({"run_id": rid, "config_hash": f"h{seed}", "steps": STEPS[-1],
                             "axes": {"model.n_layer": depth, "model.qk_init": init,
                                      "seed": seed}})
    grid = {"name": "demo-sized", "preset": "small", "base": {},
            "axes": {"model.n_layer": list(DEPTHS), "model.qk_init": list(INITS),
                     "seed": list(SEEDS)}}
    (root / "sweep.json").write_text(json.dumps({"grid": grid, "runs": runs}))
    return root


def old_source(rev: str, into: Path) -> Path:
    """The ``src`` folder of git revision ``rev`` of this checkout, extracted into ``into``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True,
                             capture_output=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def timed(src: Path, patch: str, sweep: Path, out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one report of ``sweep`` into a new ``out`` by the
    code under ``src``. The CPU time (user + system of the child) is what a busy machine
    inflates least; the wall time is what a user waits."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", _RUN.format(patch=patch), str(sweep), str(out)],
                   check=True, env=env, capture_output=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def folder_size(path: Path) -> tuple[int, int]:
    """(bytes of report.html, bytes of the whole folder)."""
    return ((path / "report.html").stat().st_size,
            sum(p.stat().st_size for p in path.iterdir() if p.is_file()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", type=Path, help="a finished E1 sweep (default: synthetic, "
                    "demo-sized)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--old-ref", help="git revision whose code is timed as 'old'")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sweep = tmp / "sweep"
        if args.sweep:
            shutil.copytree(args.sweep, sweep, ignore=shutil.ignore_patterns("report"))
        else:
            demo_sized_sweep(sweep)
        variants = {"new": (ROOT / "src", ""), "new@300dpi": (ROOT / "src", _AT_300_DPI)}
        if args.old_ref:
            variants["old"] = (old_source(args.old_ref, tmp / "old"), "")
        wall: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        for rep in range(args.reps):
            for name, (src, patch) in variants.items():
                w, c = timed(src, patch, sweep, tmp / f"report-{name}-{rep}")
                wall[name].append(w)
                cpu[name].append(c)
        print(f"sweep: {args.sweep or 'synthetic, demo-sized'}; {args.reps} reps, interleaved; "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        for name in variants:
            html, total = folder_size(tmp / f"report-{name}-0")
            w, c = wall[name], cpu[name]
            print(f"{name:>11}: wall median {statistics.median(w):5.1f} s ({min(w):.1f}–"
                  f"{max(w):.1f}), CPU median {statistics.median(c):5.1f} s; report.html "
                  f"{html / 1e3:,.0f} kB, folder {total / 1e6:.1f} MB")
        ratios = []
        for ref in ("new@300dpi", "old"):
            if ref in variants:
                ratios += [f"new / {ref}: wall {_ratio(wall, ref):.2f}, CPU {_ratio(cpu, ref):.2f}"]
        print("; ".join(ratios))


def _ratio(times: dict[str, list[float]], ref: str) -> float:
    return statistics.median(times["new"]) / statistics.median(times[ref])


if __name__ == "__main__":
    main()
