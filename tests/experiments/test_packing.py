"""Several runs per GPU: the packing probe's arithmetic and rule, the ramp, the placement
of local runs on GPUs, Ray's fractional GPUs, and the probe itself on a CPU (no GPU here;
benchmarks/gpu_check.sh runs it on one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sweep_helpers import tiny_grid, write_grid

import qkgeom.experiments.packing as packing
from qkgeom.errors import QKGeomError
from qkgeom.experiments.backends import LocalBackend, RayBackend
from qkgeom.experiments.packing import (
    PackingResult,
    choose_runs_per_gpu,
    measure_packing,
    parse_runs_per_gpu,
    probe_packing,
    window_throughput,
)
from qkgeom.experiments.runner import resolve_data, sweep_workers

GIB = 2.0**30


def test_runs_per_gpu_values() -> None:
    assert parse_runs_per_gpu("auto") == "auto" and parse_runs_per_gpu(" AUTO ") == "auto"
    assert parse_runs_per_gpu("4") == 4 and parse_runs_per_gpu(2) == 2
    for bad in ("0", "-1", "x", "2.5", "", True, 0):
        with pytest.raises(QKGeomError, match="--runs-per-gpu must be auto or a whole number"):
            parse_runs_per_gpu(bad)


def test_window_throughput_counts_only_the_common_window() -> None:
    """A: 10 steps/s from t=0 to 10; B: 5 steps/s from t=2 to 12. Window [2, 10]: A trains
    80 steps in it, B 40; 120 steps x 100 tokens / 8 s."""
    a = [(0.0, 10), (5.0, 60), (10.0, 110)]
    b = [(2.0, 10), (12.0, 60)]
    assert window_throughput([a, b], 100) == pytest.approx(1500.0)
    assert window_throughput([a], 100) == pytest.approx(1000.0)  # one process: its rate
    # never overlapping: all steps over the whole span (100 + 50 steps over 30 s)
    late = [(20.0, 10), (30.0, 60)]
    assert window_throughput([a, late], 100) == pytest.approx(150 * 100 / 30)
    with pytest.raises(QKGeomError, match="no timed steps"):
        window_throughput([[(1.0, 5)]], 100)


def _r(k: int, tps: float, mem: float = 10 * GIB, ok: bool = True) -> PackingResult:
    return PackingResult(k, 1, tps, mem, 141 * GIB, ok=ok)


def test_the_rule_picks_the_smallest_count_near_the_best_that_fits() -> None:
    saturating = [_r(1, 100), _r(2, 190), _r(4, 300), _r(8, 310)]
    assert choose_runs_per_gpu(saturating, 141 * GIB) == 4  # 300 is within 5 % of 310
    assert choose_runs_per_gpu(saturating, 40 * GIB) == 2  # 4 x 10 GiB > 90 % of 40 GiB
    assert choose_runs_per_gpu([_r(1, 100), _r(2, 101), _r(4, 99)], 141 * GIB) == 1  # no gain
    assert choose_runs_per_gpu([_r(1, 100), _r(2, 400, ok=False)], None) == 1  # failed: out
    assert choose_runs_per_gpu([], None) == 1


def test_the_ramp_stops_when_doubling_gains_little_or_would_not_fit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def ramp(rates: dict[int, float], memory_total: float | None = None, mem: float = GIB,
             fail: int | None = None) -> tuple[int, list[int]]:
        asked: list[int] = []

        def fake(config: Any, k: int, **_: Any) -> PackingResult:
            asked.append(k)
            return PackingResult(k, 1, rates[k], mem, 80 * GIB, ok=k != fail)

        monkeypatch.setattr(packing, "measure_packing", fake)
        choice, _ = probe_packing({}, memory_total=memory_total)
        return choice, asked

    assert ramp({1: 100, 2: 180, 4: 320, 8: 330}) == (4, [1, 2, 4, 8])
    assert ramp({1: 100, 2: 105, 4: 500}) == (1, [1, 2])  # +5 %: stop, 4 never measured
    assert ramp({1: 100, 2: 190, 4: 360}, memory_total=30 * GIB, mem=7 * GIB) == (2, [1, 2])
    assert ramp({1: 100, 2: 190, 4: 360}, fail=2) == (1, [1, 2])
    # the device's memory comes from the first measurement when not given: 8 x 10 > 72
    assert ramp({1: 100, 2: 190, 4: 360, 8: 700}, mem=10 * GIB) == (4, [1, 2, 4])


class _FakePool:
    def __init__(self) -> None:
        self.started: list[tuple[str, tuple, dict[str, str]]] = []
        self.ended: list[Path] = []

    def start(self, run_dir: Path, request: dict, key: tuple, env: dict[str, str]) -> None:
        self.started.append((run_dir.name, key, env))

    def wait(self, timeout: float) -> list:
        out = [(d, {"run_id": d.name, "state": "done"}, "") for d in self.ended]
        self.ended = []
        return out


def test_local_cuda_runs_go_to_the_least_loaded_gpu(tmp_path: Path) -> None:
    backend = LocalBackend(gpus=["3", "5"])
    pool = _FakePool()
    backend._pool = pool  # the processes are the pool's concern, not this test's
    assert backend.capacity(True, 2) == 4 and backend.capacity(False, 2) is None
    for i in range(4):
        backend.submit(tmp_path / f"r{i}", {"device": "cuda"}, 2, False)
    gpus = [env.get("CUDA_VISIBLE_DEVICES") for _, _, env in pool.started]
    assert gpus == ["3", "5", "3", "5"]
    assert {key for _, key, _ in pool.started} == {(2, "3"), (2, "5")}  # one worker per GPU
    assert all(env["OMP_NUM_THREADS"] == "2" for _, _, env in pool.started)
    pool.ended = [tmp_path / "r1"]  # a run on GPU 5 ends: the next goes there
    assert [r["run_id"] for r in backend.wait(0)] == ["r1"]
    backend.submit(tmp_path / "r4", {"device": "cuda"}, 2, False)
    assert pool.started[-1][2]["CUDA_VISIBLE_DEVICES"] == "5"
    backend.submit(tmp_path / "c", {"device": "cpu"}, 1, False)  # CPU and cuda:N: not pinned
    backend.submit(tmp_path / "n", {"device": "cuda:1"}, 1, False)
    assert all("CUDA_VISIBLE_DEVICES" not in env for _, _, env in pool.started[-2:])


def test_workers_default_to_the_gpu_slots_and_never_exceed_them(sample_data: Path) -> None:
    specs = resolve_data(tiny_grid(sample_data, seeds=[0, 1, 2, 3, 4]).expand())

    class Runner:
        def __init__(self, cap: int | None) -> None:
            self.cap = cap

        def capacity(self, on_cuda: bool, runs_per_gpu: int) -> int | None:
            return self.cap

    assert sweep_workers(None, specs, Runner(8), on_cuda=True, runs_per_gpu=4, local=True) == 8
    assert sweep_workers(16, specs, Runner(8), on_cuda=True, runs_per_gpu=4, local=True) == 8
    assert sweep_workers(3, specs, Runner(8), on_cuda=True, runs_per_gpu=4, local=True) == 3
    assert sweep_workers(16, specs, Runner(8), on_cuda=True, runs_per_gpu=4, local=False) == 16
    cpu = sweep_workers(None, specs, Runner(None), on_cuda=False, runs_per_gpu=1, local=True)
    assert 1 <= cpu <= 5  # one per CPU, at most one per run


def test_ray_gives_a_cuda_run_its_share_of_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    class FakeTask:
        def __init__(self) -> None:
            self.options_seen: list[dict] = []

        def options(self, **kw: Any) -> FakeTask:
            self.options_seen.append(kw)
            return self

        def remote(self, *args: Any) -> object:
            return object()

    class FakeRay:
        task = FakeTask()

        def remote(self, **kw: Any):
            return lambda fn: self.task

        def cluster_resources(self) -> dict[str, float]:
            return {"GPU": 2.0, "CPU": 16.0}

    fake = FakeRay()
    monkeypatch.setattr("qkgeom.experiments.backends.connect_ray", lambda address: (fake, False))
    backend = RayBackend("auto", runs_per_gpu=4)
    backend.submit(tmp_path / "a", {"device": "cuda"}, 2, False)
    backend.submit(tmp_path / "b", {"device": "cpu"}, 1, False)
    assert fake.task.options_seen == [{"num_cpus": 2, "num_gpus": 0.25}, {"num_cpus": 1}]
    assert backend.capacity(True, 4) == 8 and backend.capacity(False, 4) == 16


def test_the_cli_refuses_a_bad_runs_per_gpu_in_one_line(sample_data: Path,
                                                        tmp_path: Path) -> None:
    grid = write_grid(tmp_path / "g.yaml", tiny_grid(sample_data))
    res = subprocess.run([sys.executable, "-m", "qkgeom.cli", "sweep", "run", str(grid),
                          "--out", str(tmp_path / "s"), "--runs-per-gpu", "half", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "--runs-per-gpu" in res.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_the_probe_measures_runs_side_by_side_on_a_cpu(sample_data: Path) -> None:
    """The real probe (fresh processes, the barrier, the common window) with 2 runs of a
    smoke config: positive summed tokens/s, peak memory, no device memory on a CPU; a
    process that fails makes the result failed, with its reason."""
    cfg = resolve_data(tiny_grid(sample_data).expand())[0].config.to_dict()
    two = measure_packing(cfg, 2, warmup=3, steps=10)
    assert two.ok, two.error
    assert two.tokens_per_s > 0 and two.memory > 2**20 and two.device_memory is None
    assert two.runs == 2 and two.per_run == pytest.approx(two.tokens_per_s / 2)
    bad = measure_packing(dict(cfg, device="cuda:99"), 1, warmup=3, steps=10)
    assert not bad.ok and "cuda" in bad.error.lower()


def test_gpu_check_fits_its_budget_and_names_existing_scripts() -> None:
    """benchmarks/gpu_check.sh runs unattended on a lent GPU: its timeouts must sum to
    under 8 minutes and every script it calls must exist."""
    import re

    root = Path(__file__).resolve().parents[2]
    script = (root / "benchmarks" / "gpu_check.sh").read_text()
    assert sum(int(t) for t in re.findall(r"\btimeout (\d+)", script)) <= 470
    called = re.findall(r"benchmarks/(\w+\.py)", script)
    assert {"gpu_check.py", "grid_packing.py", "control_overhead.py"} <= set(called)
    assert all((root / "benchmarks" / name).is_file() for name in called)
