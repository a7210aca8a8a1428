"""Bytes written per probe by a run folder's writer, early in a run and late (issue 15).

The claim it checks: with append-only tables (``qkgeom.runs.table``: each flush writes one
part of the new rows, parts merged ``FAN_IN`` at a time), the I/O of a probe does not grow
with the number of probes before it, whereas rewriting ``metrics.parquet`` whole at every
probe (what qkgeom did before) grows linearly, so a long monitored run did quadratic I/O.

Both writers run in the same process on the same rows (``--rows`` long-format rows per
probe, about a 6-layer model's probe; one train-log row per probe): ``RunWriter`` as the
trainer and monitor use it (``add_metrics``, ``add_log``, ``flush`` per probe), and the
reference, which writes the whole table with ``qkgeom.io.write_parquet`` at every probe.
Bytes are counted at the atomic-write layer (every file written, merges included).

Printed: mean bytes per probe over the first and the last ``--window`` probes, their ratio
(late / early) for each writer, and the total bytes. Last line: both ratios.

    python benchmarks/run_folder_io.py [--probes 600] [--rows 400] [--window 50]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

import qkgeom.io
from qkgeom.runs import METRIC_COLUMNS, RunWriter


class ByteCounter:
    """Wraps ``qkgeom.io.atomic_write``: adds the size of every file written to ``total``."""

    def __init__(self) -> None:
        self.total = 0
        self._real = qkgeom.io.atomic_write

    def __enter__(self) -> ByteCounter:
        def counted(path, write):
            def inner(tmp: Path) -> None:
                write(tmp)
                self.total += tmp.stat().st_size

            self._real(path, inner)

        qkgeom.io.atomic_write = counted
        return self

    def __exit__(self, *_: object) -> None:
        qkgeom.io.atomic_write = self._real


def probe_rows(rows: int, rng: np.random.Generator) -> pd.DataFrame:
    return pd.DataFrame({"layer": np.arange(rows) % 6, "head": np.arange(rows) % 7 - 1,
                         "metric": np.array(["pr_q_token", "pr_k_token", "attn_entropy"])[
                             np.arange(rows) % 3], "value": rng.random(rows)})


def run(kind: str, probes: int, rows: int, folder: Path) -> tuple[list[int], float]:
    """Bytes written at each probe, and seconds in all."""
    rng = np.random.default_rng(0)
    writer = RunWriter(folder, "bench")
    per_probe = []
    t0 = time.perf_counter()
    with ByteCounter() as counter:
        for step in range(probes):
            before = counter.total
            frame = probe_rows(rows, rng)
            writer.add_metrics(frame, step)
            writer.add_log({"step": step, "loss": 1.0})
            if kind == "append-only":
                writer.flush()
            else:  # the reference: both tables rewritten whole at every probe
                qkgeom.io.write_parquet(folder / "metrics.parquet",
                                        writer.metrics[METRIC_COLUMNS])
                qkgeom.io.write_parquet(folder / "train_log.parquet", writer.log)
            per_probe.append(counter.total - before)
    return per_probe, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probes", type=int, default=600)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--window", type=int, default=50)
    args = parser.parse_args()
    ratios = {}
    for kind in ("append-only", "rewrite whole"):
        with tempfile.TemporaryDirectory() as tmp:
            per_probe, seconds = run(kind, args.probes, args.rows, Path(tmp))
        early = float(np.mean(per_probe[:args.window]))
        late = float(np.mean(per_probe[-args.window:]))
        ratios[kind] = late / early
        print(f"{kind:>14}: {early / 1024:8.1f} KiB/probe over the first {args.window} probes, "
              f"{late / 1024:8.1f} KiB/probe over the last {args.window}; late/early "
              f"{late / early:6.2f}; total {sum(per_probe) / 2**20:8.1f} MiB in {seconds:.1f} s")
    print(f"bytes per probe, late/early ({args.probes} probes of {args.rows} rows): "
          f"append-only {ratios['append-only']:.2f}, rewrite whole "
          f"{ratios['rewrite whole']:.2f}")


if __name__ == "__main__":
    main()
