#!/usr/bin/env bash
# The GPU session's second call (see ../shared/gpu/README.md and docs/performance.md):
#   source .gpu/b/install.sh && bash bench/gpu_run.sh
# Builds the Llama-3.2-1B-shaped random model on the GPU, measures bare-model decode, runs the
# side-by-side (mlx_lm.server vs statecore single vs cluster) and a py-spy profile of the single
# node at concurrency 32. Every step has its own time limit, so that a slow one still leaves the
# others' results in $OUT.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
[ -f /tmp/gpu-env.sh ] && source /tmp/gpu-env.sh
PY=${PY:-python3}
export HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; python3 --version; } > "$OUT/machine.txt" 2>&1
M=${MODEL:-/tmp/llama1b}
[ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -2
timeout 90 $PY bench/bare_decode.py --model $M --batch 1,8,32 --out "$OUT/bare.json" 2>&1 | tail -5
timeout "${SBS_LIMIT:-270}" $PY bench/side_by_side.py --model $M --blas bundled --reps 1 \
  --servers mlx_lm,single,cluster,single_shared \
  --mix 128x128 --mix 2000x16 --concurrency 1,8,32 --long-concurrency 1 --long-requests 4 \
  --startup-timeout 150 --out "$OUT/sbs" 2>&1 | tr '\r' '\n' | grep -v -E 'req/s|it/s|^\s*$' | tail -30
timeout "${PROF_LIMIT:-75}" $PY bench/profile_single.py --model $M --blas bundled --concurrency 32 \
  --duration 15 --py-spy "${PYSPY:-/tmp/site/bin/py-spy}" --out "$OUT/profile" 2>&1 | tr '\r' '\n' \
  | grep -v -E 'req/s|it/s|^\s*$' | head -60
ls -la "$OUT" "$OUT"/*
