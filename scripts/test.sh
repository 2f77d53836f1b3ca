#!/usr/bin/env bash
# Run the whole test suite in the project's virtual environment (created on first use),
# on two test processes (pytest-xdist), each file's tests in one of them: a file's
# module-wide fixtures run once. SOMATIZE_TEST_PROCESSES=1 runs it in this process alone;
# arguments go to pytest (`bash scripts/test.sh tests/test_store.py -x`).
source "$(dirname "$0")/venv.sh"
cd "$root"
n=${SOMATIZE_TEST_PROCESSES:-2}
if [ "$n" = 1 ]; then
  exec python -m pytest "$@"
fi
exec python -m pytest -n "$n" --dist loadfile "$@"
