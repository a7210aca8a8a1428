"""The public API is what the issue promises, whatever was imported before."""

from __future__ import annotations

import subprocess
import sys


def test_top_level_names_are_the_functions_even_after_submodule_imports() -> None:
    code = (
        "import qkgeom.training, qkgeom.geometry.measure, qkgeom.launch, qkgeom.analysis\n"
        "import inspect\n"
        "from qkgeom import GPT, GPTConfig, TrainConfig, train, measure\n"
        "assert inspect.isfunction(train) and inspect.isfunction(measure), (train, measure)\n"
        "import qkgeom.launch; assert train is qkgeom.launch.train\n"
        "assert inspect.isclass(GPT) and inspect.isclass(GPTConfig)\n"
        "import qkgeom; assert qkgeom.train is train\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_analysis_import_does_not_load_torch() -> None:
    code = ("import sys, qkgeom, qkgeom.analysis, qkgeom.analysis.e4.report, qkgeom.runs, "
            "qkgeom.runs.sweep, qkgeom.runs.family, qkgeom.monitor.watch, qkgeom.config\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
