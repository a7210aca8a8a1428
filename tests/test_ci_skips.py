"""Under CI a skipped test fails the run (tests/conftest.py), except a test marked gpu: the
hooks run in a separate pytest on three tiny test files, with and without ``CI`` set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT_CONFTEST = Path(__file__).with_name("conftest.py")

CONFTEST = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("qkgeom_test_hooks", {str(ROOT_CONFTEST)!r})
_hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hooks)
pytest_runtest_makereport = _hooks.pytest_runtest_makereport
pytest_make_collect_report = _hooks.pytest_make_collect_report


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
'''
FILES = {
    "test_extra.py": 'import pytest\npytest.importorskip("qkgeom_no_such_extra")\n\n'
                     "def test_never_collected():\n    pass\n",
    "test_skip.py": "import pytest\n\ndef test_skips():\n    pytest.skip('no reason')\n\n"
                    "def test_passes():\n    pass\n",
    "test_gpu.py": "import pytest\n\n@pytest.mark.gpu\ndef test_needs_cuda():\n"
                   "    pytest.skip('needs a CUDA device')\n",
}


def _pytest(folder: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "QKGEOM_REQUIRE_EXTRAS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           str(folder)], capture_output=True, text=True, cwd=folder,
                          env={**clean, **env}, timeout=120)


def test_a_skip_fails_under_ci_unless_the_test_needs_a_gpu(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    local = _pytest(tmp_path)
    assert local.returncode == 0, local.stdout
    assert "1 passed, 3 skipped" in local.stdout
    for env in ({"CI": "true"}, {"QKGEOM_REQUIRE_EXTRAS": "1"}):
        ci = _pytest(tmp_path, **env)  # a missing extra stops the run at collection
        assert ci.returncode == 2, ci.stdout
        assert "test_extra.py was skipped (could not import 'qkgeom_no_such_extra'" in ci.stdout
    (tmp_path / "test_extra.py").unlink()
    ci = _pytest(tmp_path, CI="true")
    assert ci.returncode == 1, ci.stdout
    assert "1 failed, 1 passed, 1 skipped" in ci.stdout, ci.stdout
    assert "test_skips was skipped (no reason)" in ci.stdout
    assert "SKIPPED [1] test_gpu.py" in ci.stdout  # its reason printed; not a failure
