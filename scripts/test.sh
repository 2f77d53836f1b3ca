#!/usr/bin/env bash
# Run the whole test suite in the project's virtual environment (created on first use).
source "$(dirname "$0")/venv.sh"
cd "$root"
exec python -m pytest "$@"
