"""``python -m qkgeom.experiments``: run a grid, the E1 grid, or show a sweep's status.

    python -m qkgeom.experiments run GRID.yaml --out SWEEP [--workers N] [--backend ray ...]
    python -m qkgeom.experiments e1 --preset smoke|demo|paper --out SWEEP [--data DIR]
    python -m qkgeom.experiments status SWEEP

Exit codes: 0 every run is done or diverged (or trained by another process right now),
1 some run failed, 2 bad input (one line on stderr), 130 interrupted. The internal
``worker`` subcommand is how the local backend starts one run in a fresh process.
"""

from __future__ import annotations

import argparse
import sys

from qkgeom.errors import QKGeomError


def _sweep_options(parser: argparse.ArgumentParser, workers_help: str) -> None:
    parser.add_argument("--out", required=True, help="sweep folder (created; rerun to resume)")
    parser.add_argument("--workers", type=int, default=None, help=workers_help)
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    parser.add_argument("--address", default=None,
                        help="ray cluster: 'auto' or host:port (default: start a local one)")
    parser.add_argument("--threads-per-run", type=int, default=None,
                        help="torch threads per run (default: CPUs // workers)")
    parser.add_argument("--retry-failed", action="store_true", help="train failed runs again")
    parser.add_argument("--quiet", action="store_true", help="no progress view")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qkgeom.experiments",
                                     description="Sweeps of qkgeom training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train every run of a grid file")
    run.add_argument("grid", help="grid YAML file")
    _sweep_options(run, "runs at once (default 1)")
    e1 = sub.add_parser("e1", help="the paper's E1 grid (depth x Q/K init x seed)")
    e1.add_argument("--preset", choices=["smoke", "demo", "paper"], default="demo")
    e1.add_argument("--data", default="", help="prepared data folder (default: the sample)")
    _sweep_options(e1, "runs at once (default: smoke/demo one 1-thread run per CPU, "
                       "paper 1)")
    status = sub.add_parser("status", help="one line per run of a sweep folder")
    status.add_argument("out", help="sweep folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        from qkgeom.experiments.worker import main as worker_main

        return worker_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except QKGeomError as err:
        print(f"qkgeom: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("qkgeom: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from qkgeom.experiments import load_grid, reproduce_e1, run_sweep, sweep_status

    if args.command == "status":
        import pandas as pd

        with pd.option_context("display.max_rows", None, "display.width", 200):
            print(sweep_status(args.out).drop(columns=["config_hash"]).to_string(index=False))
        return 0
    options = dict(backend=args.backend, address=args.address,
                   threads_per_run=args.threads_per_run, progress=not args.quiet,
                   retry_failed=args.retry_failed)
    if args.command == "run":
        summary = run_sweep(load_grid(args.grid), args.out, workers=args.workers or 1,
                            **options)
    else:
        summary = reproduce_e1(args.preset, args.out, args.data, workers=args.workers,
                               **options)
    print(summary)
    return 1 if summary.counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
