#!/usr/bin/env bash
# The engine's GPU runs (one H200; see ../shared/gpu/README.md): after call 1 (carry .gpu/a:
# `cp -r .gpu/a /tmp/gpu-a`), call 2 with carry .gpu/b:
#   source .gpu/b/install.sh && bash bench/gpu_engine.sh serving
# later calls while warm: bash bench/gpu_engine.sh second | mixed
# `serving`: the Llama-3.2-1B-shaped model: bare decode vs the engine alone (no HTTP), then
# mlx_lm.server vs statecore single on realish and 128x128 at concurrency 8 and 32.
# `second`: the same side by side on a shape not benchmarked before (hidden 1024, 28 layers,
# 512-token vocabulary). `mixed`: long prompts arriving while 16 streams decode, prefill and decode
# nodes on the same GPU (the stand-in for two GPUs), against one colocated node. `attention`: the
# slot lane's attention kernel checked and timed against MLX's masked attention.
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
[ -f /tmp/gpu-env.sh ] && source /tmp/gpu-env.sh
PY=${PY:-python3}
export HF_HUB_OFFLINE=1
quiet() { tr '\r' '\n' | grep -v -E 'req/s|it/s|^\s*$'; }
M=/tmp/llama1b
M2=/tmp/llama06-v512
# MLX settings for the statecore servers only (`graphs` below writes the best it measured there).
SC_ENV=()
if [ -f /tmp/best-graphs.env ]; then for v in $(cat /tmp/best-graphs.env); do SC_ENV+=(--statecore-env "$v"); done; fi
# Both shapes, mlx_lm.server vs single on realish at 8 and 32:
# headline_cells REQUESTS_PER_SLOT MAX_REQUESTS_1B LIMIT_1B_S LIMIT_SECOND_S
headline_cells() {
  echo "statecore env: ${SC_ENV[*]:-none}"
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; } > "$OUT/machine.txt" 2>&1
  [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
  timeout "$3" $PY bench/side_by_side.py --model $M --blas bundled --reps 1 --servers mlx_lm,single \
    --mix realish --concurrency 8,32 --no-parity --requests-per-slot "$1" --max-requests "$2" \
    --startup-timeout 120 "${SC_ENV[@]}" --out "$OUT/sbs" 2>&1 | quiet | tail -6
  [ -f $M2/config.json ] || timeout 120 $PY bench/make_llama1b.py $M2 --hidden-size 1024 --layers 28 \
    --vocab 512 --seed 3 2>&1 | tail -1
  timeout "$4" $PY bench/side_by_side.py --model $M2 --blas bundled --reps 1 --servers mlx_lm,single \
    --mix realish --concurrency 8,32 --no-parity --requests-per-slot 4 --max-requests 96 \
    --startup-timeout 120 "${SC_ENV[@]}" --out "$OUT/sbs2" 2>&1 | quiet | tail -6
}
# The engine alone on realish (bench/engine_realish.py ARGS...): tok/s, gap p99, ms per step by kind.
engine_alone() {
  timeout 100 $PY bench/engine_realish.py --seconds 12 --no-bare --out "$OUT/er_last.json" "$@" > /dev/null 2>&1
  $PY -c "import json,sys; r=json.load(open('$OUT/er_last.json')); r=[v for k,v in r.items() if k.startswith('engine_c')][0]; \
p=r['device_profile']; print(round(r['tok_s']), 'tok/s gap p99', round(r['gap_p99_ms'],1), 'ms/step', \
{k: round(1000*v[1]/max(p['step'][0],1),2) for k,v in p.items() if k!='decode_rows'}, 'rows', \
round(p['decode_rows'][0]/max(p['step'][0],1),1))" 2>&1 | tail -1
}
case "${1:-serving}" in
  graphs)
    # MLX's CUDA graphs with its per-graph byte limit lifted: MLX ends a graph once the arrays its
    # kernels read pass MLX_MAX_MB_PER_BUFFER (400 MB on an H100/H200), and every slot-pool buffer
    # (32 rows x the whole capacity) is larger than that, so with graphs on each layer's KV write
    # and attention ended a graph of its own. The engine alone at 32 on both shapes per setting;
    # the best (if 5 % over graphs off on average) goes to /tmp/best-graphs.env for `final`; then 8
    # rows, and the first long prompt's stall with the slow steps it caused.
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; } > "$OUT/machine.txt" 2>&1
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    [ -f $M2/config.json ] || timeout 120 $PY bench/make_llama1b.py $M2 --hidden-size 1024 --layers 28 \
      --vocab 512 --seed 3 2>&1 | tail -1
    rm -f /tmp/best-graphs.env
    LIFT="MLX_MAX_MB_PER_BUFFER=1000000"
    SETTINGS=("MLX_USE_CUDA_GRAPHS=0" "MLX_USE_CUDA_GRAPHS=1 $LIFT" "MLX_USE_CUDA_GRAPHS=1 $LIFT MLX_MAX_OPS_PER_BUFFER=100")
    best=0; best_score=0
    for i in "${!SETTINGS[@]}"; do
      score=0
      for model in $M $M2; do
        line=$(export ${SETTINGS[$i]}; engine_alone --model $model --concurrency 32 --warmup-seconds 5)
        echo "${SETTINGS[$i]} | $model c32: $line"
        tok=${line%% *}; case "$tok" in ''|*[!0-9]*) tok=0 ;; esac
        if [ "$i" = 0 ]; then eval "off_$(basename $model | tr -c 'a-z0-9\n' _)=$tok"; fi
        off=$(eval echo \${off_$(basename $model | tr -c 'a-z0-9\n' _):-0})
        [ "$off" -gt 0 ] && score=$(( score + tok * 1000 / off ))
      done
      [ "$i" = 0 ] && continue
      echo "  score (per mille of graphs off, summed over both shapes): $score"
      if [ "$score" -gt 2100 ] && [ "$score" -gt "$best_score" ]; then best=$i; best_score=$score; fi
    done
    echo "best: ${SETTINGS[$best]}"
    [ "$best" != 0 ] && echo "${SETTINGS[$best]}" > /tmp/best-graphs.env
    for model in $M $M2; do
      for i in 0 $best; do
        [ "$i" = 0 ] && [ "$best" = 0 ] && [ -n "${once:-}" ] && continue
        once=1
        echo "${SETTINGS[$i]} | $model c8: $(export ${SETTINGS[$i]}; engine_alone --model $model --concurrency 8 --warmup-seconds 5)"
      done
      once=
    done
    env ${SETTINGS[$best]} timeout 150 $PY bench/cold_prefill.py --model $M 2>&1 | tail -5
    ;;
  compiled)
    # The slot lane's traced step (--compile-decode) against the untraced one, both shapes, realish
    # at 32: the engine alone, then the node under HTTP load; then a long prompt's cold shapes.
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; } > "$OUT/machine.txt" 2>&1
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    [ -f $M2/config.json ] || timeout 120 $PY bench/make_llama1b.py $M2 --hidden-size 1024 --layers 28 \
      --vocab 512 --seed 3 2>&1 | tail -1
    SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    for model in $M $M2; do
      for mode in on off; do
        echo "$model compile $mode, engine alone c32: $(engine_alone --model $model --concurrency 32 \
          --engine-arg compile_decode=$mode)"
        echo "$model compile $mode, node c32:"
        timeout 110 $PY bench/profile_single.py --model $model --blas bundled --mix realish --concurrency 32 \
          --duration 10 --rate 20 --py-spy "$SPY" --statecore-arg=--compile-decode=$mode \
          --out "$OUT/node_compile_$mode" 2>&1 | quiet | grep -E "output|decode rows|step |launch|decode_build"
      done
    done
    timeout 150 $PY bench/cold_prefill.py --model $M 2>&1 | tail -12
    ;;
  serving)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; $PY --version; } \
      > "$OUT/machine.txt" 2>&1
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout 150 $PY bench/engine_ladder.py --model $M --batch 32 --rungs bare,engine --max-tokens 128 \
      --out "$OUT/ladder.json" 2>&1 | tail -3
    timeout "${SBS_LIMIT:-330}" $PY bench/side_by_side.py --model $M --blas bundled --reps 1 \
      --servers mlx_lm,single --mix realish --mix 128x128 --concurrency 8,32 --no-parity \
      --requests-per-slot 4 --max-requests 96 \
      --startup-timeout 120 --out "$OUT/sbs" 2>&1 | quiet | tail -30
    ;;
  second)
    [ -f $M2/config.json ] || timeout 120 $PY bench/make_llama1b.py $M2 --hidden-size 1024 --layers 28 \
      --vocab 512 --seed 3 2>&1 | tail -1
    timeout "${SBS_LIMIT:-330}" $PY bench/side_by_side.py --model $M2 --blas bundled --reps 1 \
      --servers mlx_lm,single --mix realish --concurrency 8,32 --no-parity \
      --requests-per-slot 4 --max-requests 96 \
      --startup-timeout 120 --out "$OUT/sbs2" 2>&1 | quiet | tail -20
    ;;
  profile)
    # Where the time goes on realish: the engine alone (no HTTP) at two chunk sizes, the engine's
    # device thread under py-spy, then a single node under HTTP load under py-spy.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    timeout 120 $PY bench/engine_realish.py --model $M --concurrency 8,32 --seconds 12 \
      --out "$OUT/er_default.json" 2>&1 | tail -4
    timeout 90 $PY bench/engine_realish.py --model $M --concurrency 32 --seconds 12 \
      --engine-arg prefill_chunk_size=512 --out "$OUT/er_chunk512.json" 2>&1 | tail -2
    timeout 90 "$SPY" record --rate 100 --format raw -o "$OUT/er_spy.txt" -- \
      $PY bench/engine_realish.py --model $M --concurrency 32 --seconds 12 2>&1 | tail -3
    timeout 150 $PY bench/profile_single.py --model $M --blas bundled --mix realish --concurrency 32 \
      --duration 15 --py-spy "$SPY" --out "$OUT/profile_http" 2>&1 | quiet | tail -60
    ;;
  diagnose)
    # The node vs the engine alone on one host: the engine alone on realish at 32, then again with
    # a thread holding the GIL half the time; the HTTP side alone (fake engine); then the node
    # under realish at 32 under py-spy --native with its device time by kind, and once more with
    # a shorter GIL switch interval.
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; nproc; } > "$OUT/machine.txt" 2>&1
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    timeout 100 $PY bench/engine_realish.py --model $M --concurrency 32 --seconds 12 \
      --out "$OUT/er.json" 2>&1 | tail -2
    timeout 100 $PY bench/engine_realish.py --model $M --concurrency 32 --seconds 12 --gil-neighbour 0.3/0.3 \
      --out "$OUT/er_neighbour.json" 2>&1 | tail -2
    $PY bench/frontend_only.py --port 18777 > "$OUT/frontend_only.log" 2>&1 &
    FO=$!
    sleep 4
    T0=$(awk '{print $14+$15}' /proc/$FO/stat)
    timeout 60 $PY bench/serve_bench.py --url http://127.0.0.1:18777 --tokenizer $M --mix 128x128 \
      --concurrency 32 --num-requests 640 --out "$OUT/frontend_only" 2>&1 | quiet | tail -2
    T1=$(awk '{print $14+$15}' /proc/$FO/stat)
    echo "frontend_only server cpu s: $(( (T1 - T0) / 100 ))"
    kill $FO
    timeout 150 $PY bench/profile_single.py --model $M --blas bundled --mix realish --concurrency 32 \
      --duration 15 --native --rate 40 --py-spy "$SPY" --out "$OUT/profile_native" 2>&1 | quiet | tail -70
    STATECORE_SWITCH_INTERVAL=0.0001 timeout 120 $PY bench/profile_single.py --model $M --blas bundled \
      --mix realish --concurrency 32 --duration 10 --py-spy "$SPY" --out "$OUT/profile_switch" 2>&1 \
      | quiet | grep -E "output|device thread|decode rows|step |launch|readback|decode_build"
    ;;
  knobs)
    # The engine alone on realish at 32 under MLX's CUDA knobs (graphs on/off, their cache, ops
    # per graph), each after a long warm-up; then the node under two of them.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
    er() { engine_alone --model $M --concurrency 32 "$@"; }
    echo "warm 2 s:"; er --warmup-seconds 2
    echo "warm 20 s:"; er --warmup-seconds 20
    echo "graphs off:"; MLX_USE_CUDA_GRAPHS=0 er --warmup-seconds 20
    echo "graph cache 1000:"; MLX_CUDA_GRAPH_CACHE_SIZE=1000 er --warmup-seconds 20
    echo "ops per graph 100, cache 1000:"; MLX_MAX_OPS_PER_BUFFER=100 MLX_CUDA_GRAPH_CACHE_SIZE=1000 er --warmup-seconds 20
    for knob in "" MLX_USE_CUDA_GRAPHS=0 MLX_CUDA_GRAPH_CACHE_SIZE=1000; do
      echo "node ${knob:-default}:"
      env $knob timeout 100 $PY bench/profile_single.py --model $M --blas bundled --mix realish --concurrency 32 \
        --duration 10 --py-spy "$SPY" --out "$OUT/node_${knob:-default}" 2>&1 | quiet \
        | grep -E "output|decode rows|step |launch|readback|decode_build|prefill"
    done
    ;;
  breakdown)
    # Each kind of device work evaluated alone and timed (decode call, prefills, copies into
    # slots), and the slot step at ragged lengths against KVCache, kernels only.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout 200 $PY bench/engine_breakdown.py --model $M --concurrency 32 --seconds 12 \
      --out "$OUT/breakdown.json" 2>&1 | tail -3
    timeout 120 $PY bench/engine_breakdown.py --model $M --concurrency 32 --seconds 12 --no-ragged \
      --engine-arg shape_bucket=0 --out "$OUT/breakdown_nobucket.json" 2>&1 | tail -2
    ;;
  final)
    # One call, the GPU cells: the 1B shape (6 requests per client, so ramp-up and tail
    # weigh less) and the second shape on realish, then the mixed load.
    headline_cells 6 192 200 130
    [ -f /tmp/best-graphs.env ] && export $(cat /tmp/best-graphs.env)
    timeout "${MIXED_LIMIT:-150}" $PY bench/mixed_load.py --model $M --blas bundled --gpus 0,0 --reps 1 \
      --startup-timeout 120 --out "$OUT/mixed" 2>&1 | quiet | tail -24
    ;;
  headline)
    # The headline cells in the least device time: 4 requests per client, 96 at most.
    headline_cells 4 96 170 140
    ;;
  attention)
    # The slot lane's attention kernel: self-checks, one call against MLX's masked attention, and
    # the whole slot step masked vs kernel (exit 1 when a check disagrees).
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout 200 $PY bench/decode_attention.py --model $M --out "$OUT/attention.json" 2>&1 | tail -40
    ;;
  kernels)
    # The slot step's parts at realish-like lengths (mask, scatter) and prefill calls cold and warm.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout 150 $PY -c "import sys, json; sys.path[:0] = ['bench', 'src']; from pathlib import Path; \
from engine_breakdown import ragged_step; print(json.dumps(ragged_step(Path('$M'), 32, 50)))" 2>&1 | tail -3
    ;;
  decide)
    # MLX's CUDA graphs again, now that traced steps repeat their shapes: the engine alone at 32 and
    # 8 with graphs off and on; the headline cells (6 requests per client) then run with the
    # faster setting at 32 (mlx_lm.server keeps its own default, graphs on, either way).
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    for g in 0 1; do
      for c in 32 8; do
        line=$(MLX_USE_CUDA_GRAPHS=$g engine_alone --model $M --concurrency $c --warmup-seconds 5)
        echo "graphs $g c$c: $line"
        case "$c:${line%% *}" in 32:*[!0-9]*|32:) ;; 32:*) eval "tok_$g=${line%% *}" ;; esac
      done
    done
    if [ "${tok_1:-0}" -gt $(( ${tok_0:-0} * 105 / 100 )) ]; then export MLX_USE_CUDA_GRAPHS=1; fi
    echo "headline with MLX_USE_CUDA_GRAPHS=${MLX_USE_CUDA_GRAPHS:-statecore default 0}"
    headline_cells 6 192 200 130
    ;;
  round2)
    # The rest of the issue's GPU cells (the mixed load is in `final`): cluster vs single TTFT at
    # 2,000-token prompts (prefill and decode nodes on this one GPU), the bare model vs the engine
    # at batch 32; under the MLX settings `graphs` chose, if any.
    [ -f /tmp/best-graphs.env ] && export $(cat /tmp/best-graphs.env) && echo "env: $(cat /tmp/best-graphs.env)"
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout 240 $PY bench/side_by_side.py --model $M --blas bundled --reps 2 --servers single,cluster \
      --mix 2000x16 --concurrency 1,4 --requests-per-slot 4 --min-requests 6 --max-requests 16 \
      --startup-timeout 120 --out "$OUT/sbs_long" 2>&1 | quiet | tail -12
    timeout 150 $PY bench/engine_ladder.py --model $M --batch 32 --rungs bare,engine --max-tokens 128 \
      --out "$OUT/ladder.json" 2>&1 | tail -4
    ;;
  cold)
    # The first long prompt into 16 decoding streams: without the load's warm-up request, without
    # it and without the prefix cache, and with the defaults (warm-up on); then the mixed load.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    for args in "--warm-request off" "--warm-request off --prefix-cache-bytes 0" ""; do
      echo "cold_prefill ${args:-defaults}:"
      timeout 100 $PY bench/cold_prefill.py --model $M $args 2>&1 | grep -E '^\{|loaded' | cut -c1-420
    done
    timeout "${MIXED_LIMIT:-170}" $PY bench/mixed_load.py --model $M --blas bundled --gpus 0,0 --reps 1 \
      --startup-timeout 120 --out "$OUT/mixed" 2>&1 | quiet | tail -24
    ;;
  last)
    # The headline cells (6 requests per client), the mixed load, then cluster vs single TTFT at
    # 2,000-token prompts (one repetition): the most of the cells in one call.
    headline_cells 6 192 200 130
    timeout "${MIXED_LIMIT:-170}" $PY bench/mixed_load.py --model $M --blas bundled --gpus 0,0 --reps 1 \
      --startup-timeout 120 --out "$OUT/mixed" 2>&1 | quiet | tail -24
    timeout 150 $PY bench/side_by_side.py --model $M --blas bundled --reps 1 --servers single,cluster \
      --statecore-arg=--kv-memory-bytes=25769803776 \
      --mix 2000x16 --concurrency 1,4 --requests-per-slot 4 --min-requests 6 --max-requests 16 \
      --startup-timeout 120 --out "$OUT/sbs_long" 2>&1 | quiet | tail -12
    ;;
  fusion)
    # Fused projections (--fuse-projections) on vs off, the engine alone at 8 and 32 rows on both
    # shapes, alternating; then where a 2,000-token request's first token goes, single vs cluster
    # (the nodes' transition logs, bench/phase_times.py).
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    [ -f $M2/config.json ] || timeout 120 $PY bench/make_llama1b.py $M2 --hidden-size 1024 --layers 28 \
      --vocab 512 --seed 3 2>&1 | tail -1
    for model in $M $M2; do
      for c in 8 32; do
        for f in on off; do
          echo "$(basename $model) c$c fuse $f: $(engine_alone --model $model --concurrency $c --warmup-seconds 4 \
            --engine-arg fuse_projections=$f)"
        done
      done
    done
    timeout 150 $PY bench/side_by_side.py --model $M --blas bundled --reps 1 --servers single,cluster \
      --statecore-arg=--kv-memory-bytes=25769803776 --statecore-arg=--log-level=INFO \
      --mix 2000x16 --concurrency 1 --requests-per-slot 8 --min-requests 8 --max-requests 8 \
      --startup-timeout 120 --out "$OUT/sbs_ttft" 2>&1 | quiet | tail -4
    for who in single cluster; do
      echo "$who:"; $PY bench/phase_times.py "$OUT/sbs_ttft/$who.log" --last 1 2>&1 | tail -16
    done
    ;;
  fusion2)
    # The headline cells with the defaults (projections fused), the 1B shape's cells again with
    # --fuse-projections off (statecore only), then where a 2,000-token request's first token
    # goes, single vs cluster, each node with an 8 GiB KV budget (three nodes share the GPU).
    nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu,clocks.sm,clocks.max.sm --format=csv
    headline_cells 6 192 200 130
    timeout 100 $PY bench/side_by_side.py --model $M --blas bundled --reps 1 --servers single \
      --mix realish --concurrency 8,32 --no-parity --requests-per-slot 6 --max-requests 192 \
      --statecore-arg=--fuse-projections=off --startup-timeout 120 --out "$OUT/sbs_nofuse" 2>&1 | quiet | tail -3
    timeout 110 $PY bench/side_by_side.py --model $M --blas bundled --reps 1 --servers single,cluster \
      --statecore-arg=--kv-memory-bytes=8589934592 --statecore-arg=--log-level=INFO \
      --mix 2000x16 --concurrency 1 --requests-per-slot 8 --min-requests 8 --max-requests 8 \
      --startup-timeout 120 --out "$OUT/sbs_ttft" 2>&1 | quiet | tail -3
    for who in single cluster; do
      echo "$who:"; $PY bench/phase_times.py "$OUT/sbs_ttft/$who.log" --last 1 2>&1 | tail -16
    done
    ;;
  ttft)
    # Why a 2,000-token request's first token comes later through the cluster: the cluster alone on
    # the GPU, the single node alone, then the cluster with the prefill memory cap off; each with
    # its phases (bench/phase_times.py).
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    for run in "cluster" "single" "cluster --statecore-arg=--prefill-memory-cap=off"; do
      set -- $run
      timeout 100 $PY bench/side_by_side.py --model $M --blas bundled --reps 1 --servers $1 \
        --statecore-arg=--kv-memory-bytes=8589934592 --statecore-arg=--log-level=INFO "${@:2}" \
        --mix 2000x16 --concurrency 1 --requests-per-slot 10 --min-requests 10 --max-requests 10 \
        --no-parity --startup-timeout 120 --out "$OUT/ttft_$1" 2>&1 | quiet | grep -E "^2000x16"
      $PY bench/phase_times.py "$OUT/ttft_$1/$1.log" --last 0 2>&1 | grep -E "prefill|router|single" | head -12
    done
    ;;
  multiturn)
    # Issue 14's multi-turn workload: mlx_lm.server (prompt cache on), statecore single with and
    # without its prefix cache, and a 1P2D cluster (three nodes on this one GPU), 8, 16 and 32
    # conversations of 6 turns on a shared 1,536-token system prompt, 64-token answers.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout "${MULTITURN_LIMIT:-540}" $PY bench/multi_turn.py --model $M --blas bundled \
      --servers ${MT_SERVERS:-mlx_lm,single,cluster_1p2d,single_nocache} --conversations ${MT_COUNTS:-8,16,32} --turns 6 \
      --system-tokens 1536 --answer-tokens 64 --statecore-arg=--kv-memory-bytes=8589934592 \
      --startup-timeout 180 --out "$OUT/multi_turn" 2>&1 | quiet | tail -30
    ;;
  handoff)
    # Issue 18 item 2 on one GPU: per-request encode / transfer / install against raw loopback at
    # 128 / 2,000 / 8,000 tokens, with 16 streams decoding on the decode node throughout (the stall).
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout "${HANDOFF_LIMIT:-300}" $PY bench/handoff_http.py --model $M --lengths 128 2000 8000 \
      --per-length 3 --background-streams 16 --node-arg=--kv-memory-bytes=17179869184 \
      --out "$OUT/handoff.json" 2>&1 | quiet | tail -24
    ;;
  stream)
    # Issue 30 on one GPU (all three engine nodes on GPU 0): a handoff's cost at concurrency 1,
    # streamed (shared memory) vs pulled vs one node, at 2,000 and 8,000 tokens; then the stall
    # of 8,000-token streamed handoffs into a decode node with 16 streams decoding.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout "${STREAM_LIMIT:-280}" $PY bench/handoff_overhead.py --model $M --gpus 0 0 0 --lengths 2000 8000 \
      --rounds 3 --max-tokens 12 --node-arg=--kv-memory-bytes=17179869184 --out "$OUT/stream.json" \
      2>&1 | quiet | tail -12
    timeout "${STALL_LIMIT:-250}" $PY bench/handoff_overhead.py --model $M --gpus 0 0 0 --lengths 8000 \
      --rounds 2 --max-tokens 12 --background-streams 16 --node-arg=--kv-memory-bytes=17179869184 \
      --out "$OUT/stream_stall.json" 2>&1 | quiet | tail -8
    ;;
  route)
    # Issue 14 item 2: a conversation's next turn with an 8,192-token start held by the decode node
    # and a new part of 512 / 4,096 tokens: prefilled on the decode node, on a prefill node
    # computing the whole prompt, or on one pulling the start from the decode node.
    [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1
    timeout "${ROUTE_LIMIT:-240}" $PY bench/conversation_route.py --model $M --blas bundled \
      --prefix-tokens 8192 --suffixes 512,4096 --repeats 3 \
      --statecore-arg=--kv-memory-bytes=8589934592 --out "$OUT/route" 2>&1 | quiet | tail -16
    ;;
  mixed)
    timeout "${MIXED_LIMIT:-400}" $PY bench/mixed_load.py --model $M --blas bundled --gpus 0,0 --reps 1 \
      --startup-timeout 120 --out "$OUT/mixed" 2>&1 | quiet | tail -24
    ;;
esac
