"""Internal process entries of the sweep (users run ``qkgeom sweep run``): ``worker``, the
local backend's persistent worker (:func:`qkgeom.experiments.worker.main`), and ``probe``,
one process of the packing probe (:func:`qkgeom.experiments.packing.probe_main`)."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        from qkgeom.experiments.worker import main

        sys.exit(main(argv[1:]))
    if argv[:1] == ["probe"]:
        from qkgeom.experiments.packing import probe_main

        sys.exit(probe_main(argv[1:]))
    print("python -m qkgeom.experiments is the sweep's internal worker entry; "
          "use `qkgeom sweep run GRID.yaml` or `qkgeom reproduce e1`", file=sys.stderr)
    sys.exit(2)
