"""Probe overhead per training step: one probe's wall time against one training step's.

The claim it checks: measuring the geometry (the trainer's probes: the fixed probe set
through the eager fp32 model with q/k taps, float64 streamed covariances, Gram-trace
interaction spectra, attention entropy, sink mass, largest logits and q/k norms) costs a
small share of training at the preset's probe cadence (at most 1 % at the small preset's).
Timed here: ``qkgeom.measure`` on the preset's probe set (16 sequences x context) and a
training step of the same model (fp32, plain eager step, the benchmark sizes' batch),
interleaved per rep. Share per step = probe time / (probe_every x step time), both from the
same process. ``--against REV`` also runs the same loop on the qkgeom of a git revision
(e.g. the commit before a new metric) in a second worker process, interleaved rep by rep
with this tree's, so both shares and the probe-time ratio come from one run. The key-spectrum
control's overhead is ``control_overhead.py``. Last line: the share at each size.

    python benchmarks/probe_overhead.py [--quick] [--sizes small paper] [--reps 3]
        [--threads 1] [--precision fp32] [--against REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from _common import SIZES, sample_config, summary

import qkgeom
from qkgeom import GPT
from qkgeom import measure as measure_geometry
from qkgeom.data import load_prepared, probe_set, sample_batch

STEPS = {"small": 10, "paper": 3}


class Bench:
    """The preset's model, optimiser and probe set, warmed up; :meth:`rep` times
    ``STEPS[size]`` training steps and one probe."""

    def __init__(self, size: str, threads: int, precision: str, dev: torch.device) -> None:
        cfg = sample_config(size, 10, threads=threads, device=dev.type)
        self.cfg, self.size, self.dev = cfg, size, dev
        self.data = load_prepared(cfg.data)
        self.model = GPT(cfg.model, generator=torch.Generator().manual_seed(0)).to(dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        self.tokens = probe_set(self.data.val, cfg.probe_sequences, cfg.model.block_size)
        self.gen = torch.Generator().manual_seed(0)
        self.autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16"
                         else contextlib.nullcontext())
        self.step()
        self.probe()  # warm-up, untimed

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        cfg = self.cfg
        x, y = sample_batch(self.data.train, cfg.batch_size, cfg.model.block_size, self.gen,
                            device=self.dev)
        with self.autocast:
            _, loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def probe(self) -> None:
        measure_geometry(self.model, self.tokens, batch_size=self.cfg.probe_batch)

    def rep(self) -> tuple[float, float]:
        """(seconds per training step, seconds per probe) of one repetition."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(STEPS[self.size]):
            self.step()
        self.sync()
        step_s = (time.perf_counter() - t0) / STEPS[self.size]
        t0 = time.perf_counter()
        self.probe()
        self.sync()
        return step_s, time.perf_counter() - t0


def worker(args: argparse.Namespace) -> None:
    """``--worker``: one Bench; a line on stdin -> one rep's ``[step_s, probe_s]`` as JSON."""
    torch.set_num_threads(args.threads)
    bench = Bench(args.worker, args.threads, args.precision, torch.device(args.device))
    print(json.dumps({"ready": list(bench.tokens.shape), "batch": bench.cfg.batch_size}),
          flush=True)
    for _ in sys.stdin:
        print(json.dumps(bench.rep()), flush=True)


def revision_src(rev: str, into: Path) -> Path:
    """The ``src`` folder of git revision ``rev`` of this repository, unpacked ``into``."""
    repo = Path(__file__).resolve().parents[1]
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(repo), "archive", rev, "src"], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


class Worker:
    """A ``--worker`` process on the qkgeom found at ``src``."""

    def __init__(self, src: Path, size: str, args: argparse.Namespace) -> None:
        env = {**os.environ, "PYTHONPATH": str(src)}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", size, "--threads", str(args.threads),
             "--precision", args.precision, "--device", args.device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = json.loads(self.proc.stdout.readline())

    def rep(self) -> tuple[float, float]:
        self.proc.stdin.write("rep\n")
        self.proc.stdin.flush()
        return tuple(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def report(name: str, size: str, step_s: list[float], probe_s: list[float]) -> float:
    """Print one variant's line; returns its share per step at the preset cadence."""
    cadence = SIZES[size]["cadence"]
    share = statistics.median(probe_s) / (cadence * statistics.median(step_s))
    print(f"{name}{size}: step {summary([1e3 * s for s in step_s], '.0f')} ms, probe "
          f"{summary([1e3 * s for s in probe_s], '.0f')} ms "
          f"(= {statistics.median(probe_s) / statistics.median(step_s):.2f} steps); "
          f"probe_every {cadence}: probe / (probe_every x step) = {100 * share:.2f}%",
          flush=True)
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["small", "paper"], choices=list(SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="2 reps")
    ap.add_argument("--against", metavar="REV", help="also time the qkgeom of this git revision")
    ap.add_argument("--worker", choices=list(SIZES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.reps = 2
    torch.set_num_threads(args.threads)
    shares: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"this tree": Path(qkgeom.__file__).resolve().parents[1]}
        if args.against:
            variants[args.against] = revision_src(args.against, Path(tmp))
        for size in args.sizes:
            if not args.against:  # in this process, as before
                bench = Bench(size, args.threads, args.precision, torch.device(args.device))
                times = [bench.rep() for _ in range(args.reps)]
                print(f"{size}: probe set {tuple(bench.tokens.shape)}, train batch "
                      f"{bench.cfg.batch_size}", flush=True)
                shares[size] = report("", size, *map(list, zip(*times, strict=True)))
                continue
            workers = {name: Worker(src, size, args) for name, src in variants.items()}
            times = {name: [] for name in workers}
            try:
                for _ in range(args.reps):  # interleaved: rep 1 of each, then rep 2, ...
                    for name, w in workers.items():
                        times[name].append(w.rep())
            finally:
                for w in workers.values():
                    w.close()
            info = next(iter(workers.values())).info
            print(f"{size}: probe set {tuple(info['ready'])}, train batch {info['batch']}")
            probe = {}
            for name, rows in times.items():
                step_s, probe_s = map(list, zip(*rows, strict=True))
                share = report(f"[{name}] ", size, step_s, probe_s)
                shares[size if name == "this tree" else f"{size} at {name}"] = share
                probe[name] = statistics.median(probe_s)
            print(f"{size}: probe time this tree / {args.against} = "
                  f"{probe['this tree'] / probe[args.against]:.3f}", flush=True)
    print("probe overhead per training step at the preset cadence: "
          + "; ".join(f"{k} {100 * v:.2f}%" for k, v in shares.items()))


if __name__ == "__main__":
    main()
