#!/usr/bin/env bash
# Installs the third-party load clients that bench/clients/load_clients.py drives (AIPerf, and GuideLLM with
# --guidellm) into their own venv, bench/clients/.clients-venv: they are heavy (GuideLLM needs torch) and must
# never enter the project's dev dependencies. Usage: bash bench/clients/setup_clients.sh [--guidellm]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${CLIENTS_VENV:-$here/.clients-venv}"
py="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
"$venv/bin/python" -c 'import aiperf' 2>/dev/null || "${pip[@]}" 'aiperf==0.13.*'
if [ "${1:-}" = "--guidellm" ]; then
  # torch first, pinned: a plain `torch` requirement would pull a multi-GB CUDA build; 2.13.0 has a
  # CPU wheel in pip's local find-links here.
  "$venv/bin/python" -c 'import torch' 2>/dev/null || "${pip[@]}" 'torch==2.13.0'
  "$venv/bin/python" -c 'import guidellm' 2>/dev/null || "${pip[@]}" 'guidellm==0.8.*'
fi
"$venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(aiperf|guidellm|torch) ' || true
