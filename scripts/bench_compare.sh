#!/usr/bin/env bash
# Compare two checkouts on the step benches, runs alternated so both see the same machine:
#   bash scripts/bench_compare.sh OLD_TREE NEW_TREE [ROUNDS]      (ROUNDS default 5)
# Each tree needs its own .venv (bash scripts/test.sh --co -q makes one). Prints each run's
# line as it comes, then the medians and the ratio new/old of each figure.
set -euo pipefail
old=$1 new=$2 rounds=${3:-5}
export OMP_WAIT_POLICY=PASSIVE
log=$(mktemp)
for i in $(seq "$rounds"); do
  for t in old new; do
    d=$old; [ "$t" = new ] && d=$new
    (cd "$d" && timeout 300 .venv/bin/python scripts/bench_dropin.py --rounds 1 --epochs 2 \
       2>/dev/null | sed -n 's/.*SomatizeStrategy(place=encoder): *\([0-9.]*\) ms.*/dropin_placed_ms \1/p' \
       | sed "s/^/$t /") | tee -a "$log"
    (cd "$d" && timeout 300 .venv/bin/python scripts/bench_split.py --repeats 3 --steps 10 \
       2>/dev/null | sed -n -e 's/^ *somatize split *\([0-9.]*\) ms.*/split_ms \1/p' \
       -e 's/^ *split \/ one piece *\([0-9.]*\).*/split_over_one_piece \1/p' \
       | sed "s/^/$t /") | tee -a "$log"
  done
done
python3 - "$log" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if line.strip()]
for name in dict.fromkeys(r[1] for r in rows):
    med = {t: statistics.median(float(r[2]) for r in rows if r[:2] == [t, name])
           for t in ("old", "new")}
    print(f"{name:22s} old {med['old']:8.3f}  new {med['new']:8.3f}  new/old "
          f"{med['new'] / med['old']:.3f}")
PY
rm -f "$log"
