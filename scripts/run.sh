#!/usr/bin/env bash
# The main job (README's first command), on scikit-learn's digits — nothing downloaded:
#   1. the example model (examples/digits.py, a plain LightningModule) trained split:
#      its body placed on a local worker process by SomatizeStrategy(place={"body":
#      "worker"}), its head here;
#   2. the head retrained over the now frozen body, whose outputs SomatizeCache keeps in
#      a store (the second epoch on does not run the body at all).
# Each run prints where each module ran (by the pid that ran it) and the held-out accuracy. Extra arguments are
# Hydra overrides for both runs (e.g. `bash scripts/run.sh trainer.max_epochs=3`).
# Creates the virtual environment on first use. SOMATIZE_OUT names where the runs write
# (default outputs/main_job, emptied first).
source "$(dirname "$0")/venv.sh"
# the coordinator computes on the cores its worker computes on: its idle math threads
# must sleep, not spin (read once when torch is imported; docs/performance.md)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# large tensors it receives from the worker land in huge pages, as the worker's do (read
# once, at torch's first allocation; docs/performance.md)
export THP_MEM_ALLOC_ENABLE=${THP_MEM_ALLOC_ENABLE:-1}
cd "$root"
out=${SOMATIZE_OUT:-$root/outputs/main_job}
rm -rf "$out"
echo "== 1/2: split training: body on a worker, head here =="
python train.py +somatize=split hydra.run.dir="$out/split" "$@"
echo
echo "== 2/2: the head retrained over the frozen, cached body =="
python train.py +somatize=cached hydra.run.dir="$out/cached" \
  model.body_from="$out/split/checkpoints/last.ckpt" somatize.store="$out/store" "$@"
echo
# the store's size: what it holds and takes on disk, then its per-item part (packs)
echo "store:"
python -m somatize store du "$out/store"
