#!/usr/bin/env bash
# The GPU session's benchmark calls (see ../shared/gpu/README.md and docs/performance.md), on the
# 2-GPU machine. After call 1 (carry .gpu/a: cp -r .gpu/a /tmp/gpu-a):
#   call 2, carry .gpu/b:  source .gpu/b/install.sh && bash bench/gpu_run.sh serving
#   call 3 (warm):         bash bench/gpu_run.sh cluster
# `serving` builds the Llama-3.2-1B-shaped random model, measures the bare model and runs the side
# by side (mlx_lm.server vs statecore single vs the 3-node cluster) on GPU 0; `cluster` runs the
# mixed load (prefill on GPU 0, decode on GPU 1, against one colocated node) and the per-request
# handoff bench. Every step has its own time limit, so a slow one still leaves the others' results.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
[ -f /tmp/gpu-env.sh ] && source /tmp/gpu-env.sh
PY=${PY:-python3}
export HF_HUB_OFFLINE=1
M=${MODEL:-/tmp/llama1b}
quiet() { tr '\r' '\n' | grep -v -E 'req/s|it/s|^\s*$'; }
case "${1:-serving}" in
  serving)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; $PY --version; } \
      > "$OUT/machine.txt" 2>&1
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    export CUDA_VISIBLE_DEVICES=0
    timeout 90 $PY bench/bare_decode.py --model $M --batch 1,8,32 --out "$OUT/bare.json" 2>&1 | tail -4
    timeout "${SBS_LIMIT:-400}" $PY bench/side_by_side.py --model $M --blas bundled --reps 2 \
      --servers mlx_lm,single,cluster --mix 128x128 --mix 2000x16 --concurrency 1,8,32 \
      --long-concurrency 1 --long-requests 4 --startup-timeout 150 --out "$OUT/sbs" 2>&1 | quiet | tail -8
    timeout 60 $PY bench/bare_decode.py --model $M --batch 1,8,32 --out "$OUT/bare_after.json" 2>&1 | tail -4
    ;;
  cluster)
    timeout "${MIXED_LIMIT:-300}" $PY bench/mixed_load.py --model $M --blas bundled --gpus 0,1 \
      --startup-timeout 150 --out "$OUT/mixed" 2>&1 | quiet | tail -22
    CUDA_VISIBLE_DEVICES=0 timeout "${HANDOFF_LIMIT:-200}" $PY bench/handoff_http.py --model $M \
      --per-length 3 --out "$OUT/handoff.json" 2>&1 | quiet | tail -16
    ;;
esac
ls -R "$OUT" | head -40
