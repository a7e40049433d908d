#!/usr/bin/env bash
# Set up, then run every check CI runs: ruff, mypy --strict over src, tests and support, the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check src tests scripts bench support
echo "== mypy --strict"
.venv/bin/mypy src tests support
echo "== pytest"
# --durations: the slowest tests in CI's log. pytest exits 5 when it collected no test: that is a failure here too (set -e).
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
