#!/usr/bin/env bash
# GPU check (issue 6), run as is from the repository root on a CUDA machine; <= 8 minutes
# on an H100/H200. Installs nothing: uses .venv if present, else the python on PATH with
# qkgeom importable (`pip install -e .` with a CUDA torch). Prints tokens/s and MFU of the
# paper preset with bf16 + torch.compile, the probe and key-control overheads, then runs
# `pytest -m gpu`.
#   QKGEOM_PEAK_TFLOPS=...  override the bf16 peak (default: looked up by device name)
#   GPU_CHECK_STEPS=300     training steps of the timed run
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export QKGEOM_CACHE="${QKGEOM_CACHE:-$PWD/.cache/qkgeom}"
$PY -c "import qkgeom, torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
echo "== paper preset, bf16 + compile =="
timeout 270 $PY benchmarks/gpu_check.py --steps "${GPU_CHECK_STEPS:-300}"; rc1=$?
echo "== key-spectrum control overhead on the GPU (E3's hold/shrink runs) =="
timeout 60 $PY benchmarks/control_overhead.py --device cuda --precision bf16 --sizes paper \
    --paper-steps 10 --reps 2 || true
echo "== pytest -m gpu =="
timeout 150 $PY -m pytest -q -m gpu tests; rc2=$?
echo "gpu_check: benchmark exit $rc1, gpu tests exit $rc2"
exit $(( rc1 != 0 || rc2 != 0 ))
