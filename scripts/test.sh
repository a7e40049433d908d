#!/usr/bin/env bash
# Set up, then run every check CI runs: ruff, mypy --strict over src and tests, the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff"
.venv/bin/ruff check src tests scripts bench
echo "== mypy --strict"
.venv/bin/mypy src tests
echo "== pytest"
# pytest exits 5 when it collected no test: that is a failure here too (set -e).
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
