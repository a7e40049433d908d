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
