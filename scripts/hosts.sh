#!/usr/bin/env bash
# Test hosts by hand: three network namespaces on this machine, each a "machine" with its
# own address in 198.18.0.0/15, to try the two-machine recipes (README, "Across machines").
# As root, with `ip` and `tc` (iproute2); the tests make their own (tests/hosts.py).
#
#   bash scripts/hosts.sh up [--rate 1gbit]    # hosts a, b, c: 198.18.0.1, .2, .3
#   bash scripts/hosts.sh exec b CMD...        # run CMD on host b
#   bash scripts/hosts.sh down                 # kill what runs there, remove them
set -euo pipefail
exec python3 "$(dirname "$0")/../tests/hosts.py" "$@"
