#!/usr/bin/env bash
# Create .venv (if missing) and install statecore into it. Idempotent.
#   bash scripts/setup.sh          what serving needs: the package and its dependencies (and the
#                                  system OpenBLAS, where installing it is quiet and safe)
#   bash scripts/setup.sh --dev    also the tools and test dependencies (ruff, mypy, pytest, the
#                                  official clients, ...): what scripts/test.sh and CI use
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRA=""
CHECK="import statecore, adapters, mlx_lm"
MARK=.venv/.statecore-installed
if [ "${1:-}" = "--dev" ]; then
    EXTRA="[dev]"
    CHECK="$CHECK, pytest, mypy, ruff"
    MARK=.venv/.statecore-dev-installed
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "$CHECK" 2>/dev/null || [ pyproject.toml -nt "$MARK" ]; then
    echo "setup: installing statecore${EXTRA} and its dependencies (first run: about a minute)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".$EXTRA"
    touch "$MARK"
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
