#!/usr/bin/env bash
# Create .venv (if missing) and install statecore with its dev tools into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import statecore, adapters, mlx_lm, pytest, mypy, ruff" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.statecore-installed ]; then
    echo "setup: installing statecore and its dependencies (first run: about a minute)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch .venv/.statecore-installed
fi
# MLX's Linux CPU wheel bundles the reference BLAS; with the system OpenBLAS installed,
# `statecore run --blas auto` (the default) preloads it: ~3-10x faster prefill. Install it only
# when that is quiet and safe (Linux, root, apt-get); never fail setup over it.
if [ "$(uname -s)" = Linux ] \
   && ! .venv/bin/python -c "from adapters.blas import find_openblas; raise SystemExit(find_openblas() is None)"; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing libopenblas0 (OpenBLAS for faster CPU matmuls)"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -qq libopenblas0 >/dev/null 2>&1 \
          || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0 >/dev/null 2>&1; }; } \
          || echo "setup: could not install libopenblas0; statecore will use MLX's bundled BLAS (slower)"
    else
        echo "setup: no system OpenBLAS; statecore uses MLX's bundled BLAS (apt-get install libopenblas0 for ~3-10x faster CPU prefill)"
    fi
fi
# The live view's browser test (tests/e2e/test_live_view.py) drives the system Chromium through
# Playwright's Python package (never a browser download of Playwright's own). Install it when
# that is quiet and safe; without it the test is skipped, except under CI, where it fails.
if [ "$(uname -s)" = Linux ] && ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing chromium (for the live view's browser test)"
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -qq chromium >/dev/null 2>&1 \
          || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }; } \
          || echo "setup: could not install chromium; tests/e2e/test_live_view.py cannot run"
    else
        echo "setup: no chromium; tests/e2e/test_live_view.py is skipped (apt-get install chromium runs it)"
    fi
fi
