#!/usr/bin/env bash
# The GPU check: one prepared call for the machine a GPU is lent on (its python3 and
# PYTHONPATH, no venv, no registry), in under 8 minutes, its figures in one file:
#   0. what that python holds (torch 2.11 accepted for this run; blake3 stood in for if
#      missing: scripts/gpu_shim/);
#   1. the private torch/Lightning/cloudpickle names somatize relies on (tests/test_private.py);
#   2. TensorPipe on cuda:0: a device map cuda:0 -> cuda:0 in a dynamic group, an RRef of a
#      CUDA tensor (or CPU staging where refused), an exact matmul across processes, TF32 off;
#   3. the drop-in on cuda:0 under 32-true, bf16-mixed and 16-mixed (tests/dropin_precision_runs.py);
#   4. scripts/bench_split.py.
#
#   bash scripts/gpu_check.sh              # on the GPU machine: figures to $OUT/gpu_check.txt
#   bash scripts/gpu_check.sh --dry-run    # on CPU, the same steps, small (tests/test_gpu_check.py)
# GPU_CHECK_OUT names the figures' file; PYTHON the interpreter (default python3).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
py=${PYTHON:-python3}
out=${GPU_CHECK_OUT:-${OUT:-$root}/gpu_check.txt}
export PYTHONPATH="$root:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import blake3" 2>/dev/null; then
  export PYTHONPATH="$PYTHONPATH:$root/scripts/gpu_shim"
  echo "blake3 is not installed: scripts/gpu_shim/blake3.py stands in (BLAKE2b) for this run"
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} CUBLAS_WORKSPACE_CONFIG=:4096:8
cd "$root"
# 8 minutes there; the dry run's CPU may be shared (CI), so it waits longer
limit=470; [ "${1:-}" = --dry-run ] && limit=1200
exec timeout "$limit" "$py" scripts/gpu_check.py --out "$out" "$@"
