#!/usr/bin/env bash
# What isolating a run costs (docs/security.md): the step benches with SOMATIZE_ISOLATE=auto
# against off, alternated in this tree, ROUNDS each (default 5), then the medians:
#   bash scripts/bench_isolation.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
export OMP_WAIT_POLICY=PASSIVE
log=$(mktemp)
for i in $(seq "$rounds"); do
  for t in auto off; do
    uptime | sed "s/^/# $t /" >> $log
    SOMATIZE_ISOLATE=$t timeout 300 .venv/bin/python scripts/bench_dropin.py --rounds 1 --epochs 2 \
       2>/dev/null | sed -n 's/.*SomatizeStrategy(place=encoder): *\([0-9.]*\) ms.*/dropin_placed_ms \1/p' \
       | sed "s/^/$t /" >> $log
    SOMATIZE_ISOLATE=$t timeout 300 .venv/bin/python scripts/bench_split.py --repeats 3 --steps 10 \
       2>/dev/null | sed -n -e 's/^ *somatize split *\([0-9.]*\) ms.*/split_ms \1/p' \
       -e 's/^ *split \/ one piece *\([0-9.]*\).*/split_over_one_piece \1/p' \
       | sed "s/^/$t /" >> $log
  done
done
python3 - "$log" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")]
for name in dict.fromkeys(r[1] for r in rows):
    med = {t: statistics.median(float(r[2]) for r in rows if r[:2] == [t, name]) for t in ("auto", "off")}
    n = {t: sum(1 for r in rows if r[:2] == [t, name]) for t in ("auto", "off")}
    print(f"{name:22s} auto {med['auto']:8.3f} (n={n['auto']})  off {med['off']:8.3f} (n={n['off']})  auto/off {med['auto'] / med['off']:.3f}")
PY
rm -f "$log"
