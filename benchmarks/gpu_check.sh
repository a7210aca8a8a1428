#!/usr/bin/env bash
# GPU check (issues 6 and 16), run as is from the repository root on a CUDA machine; under
# 8 minutes on an H100/H200 (the timeouts below sum to 470 s). Installs nothing: uses .venv
# if present, else the python on PATH with qkgeom importable (`pip install -e .` with a
# CUDA torch). Prints tokens/s and MFU of the paper preset with bf16 + torch.compile, the
# key-control overhead, the grid's throughput at 1, 2, 4, 8 runs per GPU (what
# `--runs-per-gpu auto` measures), then runs `pytest -m gpu`.
#   QKGEOM_PEAK_TFLOPS=...  override the bf16 peak (default: looked up by device name)
#   GPU_CHECK_STEPS=200     training steps of the timed run
#   GPU_PACKING_COUNTS=1,2,4,8  runs per GPU measured
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export QKGEOM_CACHE="${QKGEOM_CACHE:-$PWD/.cache/qkgeom}"
$PY -c "import qkgeom, torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
echo "== paper preset, bf16 + compile =="
timeout 160 $PY benchmarks/gpu_check.py --steps "${GPU_CHECK_STEPS:-200}"; rc1=$?
echo "== key-spectrum control overhead on the GPU (E3's hold/shrink runs) =="
timeout 40 $PY benchmarks/control_overhead.py --device cuda --precision bf16 --sizes paper \
    --paper-steps 10 --reps 2 || true
echo "== grid throughput: paper-preset runs packed per GPU =="
timeout 170 $PY benchmarks/grid_packing.py --device cuda \
    --counts "${GPU_PACKING_COUNTS:-1,2,4,8}" --warmup 10 --steps 40; rc3=$?
echo "== pytest -m gpu =="
timeout 100 $PY -m pytest -q -m gpu tests; rc2=$?
echo "gpu_check: benchmark exit $rc1, packing exit $rc3, gpu tests exit $rc2"
exit $(( rc1 != 0 || rc2 != 0 || rc3 != 0 ))
