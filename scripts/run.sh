#!/usr/bin/env bash
# Set up, then start `statecore run` (no arguments: a local router+prefill+decode cluster on
# the embedded demo model). Extra arguments go to `statecore run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/statecore run "$@"
