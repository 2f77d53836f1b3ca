#!/usr/bin/env bash
# Run the whole test suite in the project's virtual environment (created on first use),
# on two test processes (pytest-xdist), each file's tests in one of them: a file's
# module-wide fixtures run once, the files handed out in collection order (tests/conftest.py
# puts the long ones first; xdist's default reorders them by their count of tests, which
# left a long file of two tests to run alone at the end). SOMATIZE_TEST_PROCESSES=1 runs
# it in this process alone; arguments go to pytest (`bash scripts/test.sh tests/test_store.py -x`).
source "$(dirname "$0")/venv.sh"
cd "$root"
# bytecode for somatize and the tests, once: every scenario and worker the tests start is a
# fresh interpreter, which otherwise compiles them again where PYTHONDONTWRITEBYTECODE=1
python -m compileall -q -j 0 somatize tests scripts >/dev/null 2>&1 || true
n=${SOMATIZE_TEST_PROCESSES:-2}
if [ "$n" = 1 ]; then
  exec python -m pytest "$@"
fi
exec python -m pytest -n "$n" --dist loadfile --no-loadscope-reorder "$@"
