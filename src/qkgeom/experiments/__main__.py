"""``python -m qkgeom.experiments worker RUN_DIR --config JSON --threads N``: the local
backend starts each run of a sweep in a fresh process this way
(:func:`qkgeom.experiments.worker.main`). Users run sweeps with ``qkgeom sweep run``."""

from __future__ import annotations

import sys

from qkgeom.experiments.worker import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] != ["worker"]:
        print("python -m qkgeom.experiments is the sweep's internal worker entry; "
              "use `qkgeom sweep run GRID.yaml` or `qkgeom reproduce e1`", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv[1:]))
