#!/usr/bin/env bash
# The main job: the example model trained split across a local worker, then its head
# retrained over the cached frozen encoder. Creates the virtual environment on first use.
source "$(dirname "$0")/venv.sh"
cd "$root"
exec python scripts/main_job.py "$@"
