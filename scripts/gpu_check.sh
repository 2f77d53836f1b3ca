#!/usr/bin/env bash
# On a machine with a GPU (under 5 minutes): the device-dependent checks nothing else runs.
#   1. the drop-in autoencoder with the local half on cuda:0 and the encoder on a worker on
#      cuda:0, under 32-true, bf16-mixed and 16-mixed (a real CUDA GradScaler): equal to plain?
#   2. the split bench (scripts/bench_split.py), its ratios printed.
# Everything else passes on CPU alone (bash scripts/test.sh).
source "$(dirname "$0")/venv.sh"
cd "$root"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no GPU here')"
out=$(mktemp -d)
echo "== drop-in on cuda:0 =="
PYTHONPATH="$root" timeout 240 python tests/dropin_runs.py gpu "$out/gpu.pt"
echo "== split bench =="
timeout 120 python scripts/bench_split.py --repeats 3
