#!/usr/bin/env bash
# Set up, then run every check CI runs: ruff, mypy --strict over src, tests and support, the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
# The live view's browser test (tests/e2e/test_live_view.py) drives the system Chromium through
# Playwright's Python package (never a browser download of Playwright's own). Install it when
# that is quiet and safe; without it the test is skipped, except under CI, where it fails.
if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "test: installing chromium (for the live view's browser test)"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -qq chromium >/dev/null 2>&1 \
          || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
          || echo "test: could not install chromium; tests/e2e/test_live_view.py cannot run"
    else
        echo "test: no chromium; tests/e2e/test_live_view.py is skipped (apt-get install chromium runs it)"
    fi
fi
echo "== ruff"
.venv/bin/ruff check src tests scripts bench support
echo "== mypy --strict"
.venv/bin/mypy src tests support
echo "== pytest"
# --durations: the slowest tests in CI's log. pytest exits 5 when it collected no test: that is a failure here too (set -e).
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@"
