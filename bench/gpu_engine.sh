#!/usr/bin/env bash
# The GPU benchmarks, one target per question (bench/README.md has the table; docs/performance.md
# the figures). On the lent GPU machine (../shared/gpu/README.md), after call 1 (carry .gpu/a:
# `cp -r .gpu/a /tmp/gpu-a`), call 2 with carry .gpu/b:
#   source .gpu/b/install.sh && bash bench/gpu_engine.sh vs-mlx-lm
# later calls while warm: bash bench/gpu_engine.sh TARGET. Every step has its own time limit, so a
# slow one still leaves the others' results under $OUT (bench/results/gpu).
#
#   vs-mlx-lm          statecore single vs mlx_lm.server on realish at 8 and 32, two model shapes
#   engine-vs-bare     the engine alone vs the bare model at batch 32; 128x128 at 32 through the node
#   where-time-goes    the engine alone by kind of device work, then the node under py-spy
#   gil-cost           the engine alone and the node over HTTP on realish at 32 and 8, each step's
#                      device time by kind; a process boundary's per-step round trip
#   core-modes         which engine core by default: a single node with --engine-core thread vs
#                      process, realish at 8 and 32, three alternating repeats (tokens/s, TTFT, ITL)
#   long-prompt-stall  long prompts into 16 decoding streams: does the first one stall them?
#   cuda-graphs        MLX's CUDA graphs off vs on, the engine alone, both shapes
#   attention-kernel   the slot lane's attention kernel checked and timed against MLX's masked one
#   mixed-load         long prompts while 16 streams decode: cluster vs one colocated node
#                      (GPUS=0,1 on a 2-GPU machine; default 0,0: every node on GPU 0)
#   long-prompt-ttft   a 2,000-token prompt's TTFT, cluster vs single, and where it goes (phases)
#   multi-turn         conversations on a shared system prompt: mlx_lm.server, single, 1P2D
#   prefix-rule        first turns and a document shorter than a chunk: a block at every message's end
#                      (--message-blocks all) vs only in prompts longer than a chunk (long), cache / none;
#                      then vs-mlx-lm on the 1B shape
#   prefix-reuse       chats on a shared system prompt and a resent document: cache / none /
#                      mlx_lm.server; what message-end blocks and smaller chunks cost a cold prompt
#   prefix-stacking    32 first turns at once on a shared system prompt: stacked prefill calls
#                      (--prefill-stacking on) vs a call per prompt (off), cache / none, 3 rounds;
#                      the load check's row classes from the node logs
#   conversation-route  where a conversation's next turn should prefill its new part
#   handoff-cost       a handoff's cost at concurrency 1: streamed vs pulled vs one node, and the
#                      stall it causes a decode node with 16 streams
#   handoff-pull       the HTTP pull per request against a raw loopback socket
#   handoff-stages     a same-host handoff's stages one by one (device-to-host copy, CRC, build)
#   essentials         one call's worth (~8 min): the allocator's memory under realish at 8 (does it
#                      stay bounded?), vs-mlx-lm on the 1B shape, handoff-cost at concurrency 1
#   memory-growth      the engine alone on realish at 8 with the allocator's memory traced: the
#                      default, whole 2,048-token chunks, a bounded buffer cache, compile off
#   one-stream-speculation  one stream with speculative decoding: prompt lookup against decoding
#                      without it (edit, chat, mislead; the traced step off, then on), and a draft
#                      model against mlx_lm.server's with the same draft and target
set -u
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
[ -f /tmp/gpu-env.sh ] && source /tmp/gpu-env.sh
PY=${PY:-python3}
export HF_HUB_OFFLINE=1
quiet() { tr '\r' '\n' | grep -v -E 'req/s|it/s|^\s*$'; }
M=/tmp/llama1b          # Llama-3.2-1B's shape, bf16, random weights
M2=/tmp/llama06-v512    # the second shape: hidden 1024, 28 layers, vocab 512
machine() { { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; nproc; \
  $PY --version; } > "$OUT/machine.txt" 2>&1; }
model_1b() { [ -f $M/config.json ] || timeout 120 $PY bench/make_llama1b.py $M 2>&1 | tail -1; }
model_second() { [ -f $M2/config.json ] || timeout 120 $PY bench/make_llama1b.py $M2 --hidden-size 1024 \
  --layers 28 --vocab 512 --seed 3 2>&1 | tail -1; }
# Each of the three engine nodes sharing GPU 0 in the handoff targets: 3 x 8 GiB of KV and 3 x 2.5
# GB of weights leave an 80 GB H100 room for activations (16 GiB each ran it out of memory).
NODE_KV=8589934592
SPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)
# The engine alone on realish (bench/engine/engine_realish.py ARGS...): tok/s, gap p99, ms per step by kind.
engine_alone() {
  timeout 100 $PY bench/engine/engine_realish.py --seconds 12 --no-bare --out "$OUT/er_last.json" "$@" > /dev/null 2>&1
  $PY -c "import json,sys; r=json.load(open('$OUT/er_last.json')); r=[v for k,v in r.items() if k.startswith('engine_c')][0]; \
p=r['device_profile']; print(round(r['tok_s']), 'tok/s gap p99', round(r['gap_p99_ms'],1), 'ms/step', \
{k: round(1000*v[1]/max(p['step'][0],1),2) for k,v in p.items() if k!='decode_rows'}, 'rows', \
round(p['decode_rows'][0]/max(p['step'][0],1),1))" 2>&1 | tail -1
}
# side_by_side on realish at 8 and 32 for one shape: vs_mlx_lm MODEL REQUESTS_PER_SLOT MAX_REQUESTS LIMIT_S NAME
# Both servers stay up for the whole run: on an 80 GB H100 the node's default KV share (32 GiB) beside
# mlx_lm.server's growing cache ran both out of memory (2026-12-07), so the node takes half the device.
vs_mlx_lm() {
  timeout "$4" $PY bench/serving/side_by_side.py --model "$1" --blas bundled --reps 1 --servers mlx_lm,single \
    --statecore-arg=--device-shared-by=2 \
    --mix realish --concurrency 8,32 --no-parity --requests-per-slot "$2" --max-requests "$3" \
    --startup-timeout 120 --out "$OUT/$5" 2>&1 | quiet | tail -6
}
# handoff_overhead.py with the three engine nodes on GPU 0, each a third of it:
# handoff_cost LIMIT_S OUT_NAME LINES ARGS...
handoff_cost() {
  local limit=$1 name=$2 lines=$3
  shift 3
  timeout "$limit" $PY bench/handoff/handoff_overhead.py --model $M --gpus 0 0 0 \
    --node-arg=--kv-memory-bytes=$NODE_KV --node-arg=--device-shared-by=3 --out "$OUT/$name" \
    --logs "$OUT/logs-${name%.json}" "$@" 2>&1 | quiet | tail -"$lines"
}
# The engine alone on realish at 8, the allocator's memory traced: memory_trace LIMIT_S PERIOD_S LINES [ARG]
memory_trace() {
  timeout "$1" $PY bench/engine/engine_realish.py --model $M --concurrency 8 --seconds 14 --no-bare \
    --memory-trace "$2" ${4:+"$4"} 2>&1 | grep -E "^memory|^\{|Error|error" | cut -c1-400 | tail -"$3"
}
case "${1:-vs-mlx-lm}" in
  vs-mlx-lm)
    machine; model_1b; model_second
    vs_mlx_lm $M 6 192 200 sbs
    vs_mlx_lm $M2 4 96 130 sbs2
    ;;
  engine-vs-bare)
    machine; model_1b
    timeout 150 $PY bench/engine/engine_ladder.py --model $M --batch 32 --rungs bare,engine --max-tokens 128 \
      --out "$OUT/ladder.json" 2>&1 | tail -4
    timeout 150 $PY bench/serving/side_by_side.py --model $M --blas bundled --reps 1 --servers single \
      --mix 128x128 --concurrency 32 --no-parity --requests-per-slot 6 --max-requests 192 \
      --startup-timeout 120 --out "$OUT/sbs_128" 2>&1 | quiet | tail -4
    ;;
  where-time-goes)
    # The engine alone at 8 and 32 with its device time by kind; each kind of device work evaluated
    # alone and timed; the HTTP side alone (fake engine); then the node under py-spy.
    machine; model_1b
    timeout 120 $PY bench/engine/engine_realish.py --model $M --concurrency 8,32 --seconds 12 \
      --out "$OUT/er.json" 2>&1 | tail -4
    timeout 200 $PY bench/engine/engine_breakdown.py --model $M --concurrency 32 --seconds 12 \
      --out "$OUT/breakdown.json" 2>&1 | tail -3
    $PY bench/serving/frontend_only.py --port 18777 > "$OUT/frontend_only.log" 2>&1 &
    FO=$!
    sleep 4
    timeout 60 $PY bench/clients/serve_bench.py --url http://127.0.0.1:18777 --tokenizer $M --mix 128x128 \
      --concurrency 32 --num-requests 640 --out "$OUT/frontend_only" 2>&1 | quiet | tail -2
    kill $FO
    timeout 150 $PY bench/serving/profile_single.py --model $M --blas bundled --mix realish --concurrency 32 \
      --duration 15 --py-spy "$SPY" --out "$OUT/profile_http" 2>&1 | quiet | tail -60
    ;;
  gil-cost)
    # What the GIL costs the node: the engine alone (engine_realish.py, at the node's GIL switch
    # interval) and a single node through HTTP (serve_bench.py), realish at 32 and 8, each with its device time a step by kind (the
    # node's from /internal/stats); then what a process boundary for the engine core would cost
    # per step (core_channel.py). With py-spy staged (`stage.sh py-spy`) also the node's threads
    # sampled by py-spy --gil at 32.
    machine; model_1b
    timeout 60 $PY bench/engine/core_channel.py --batch 8,32 --rounds 20000 --out "$OUT/channel.json" 2>&1 | tail -8
    U=http://127.0.0.1:18800
    for C in 32 8; do
      timeout 120 $PY bench/engine/engine_realish.py --model $M --concurrency $C --seconds 12 --no-bare \
        --switch-interval 0.0005 --out "$OUT/er$C.json" > /dev/null 2>&1
      $PY -c "import json; r=json.load(open('$OUT/er$C.json'))['engine_c$C']; p=r['device_profile']; n=p['step'][0]; \
print('engine alone $C:', round(r['tok_s']), 'tok/s', {k: round(1000*v[1]/n, 2) for k, v in p.items() if k != 'decode_rows'}, \
'rows', round(p['decode_rows'][0]/n, 1))"
    done
    $PY -m adapters.cli run --role single --model $M --port 18800 --log-level WARNING > "$OUT/node.log" 2>&1 &
    NODE=$!
    $PY -c "import httpx, time
for _ in range(150):
    try:
        if httpx.get('$U/health').status_code == 200: break
    except httpx.HTTPError: pass
    time.sleep(1)"
    SB="$PY bench/clients/serve_bench.py --url $U --tokenizer $M --mix realish"
    $SB --concurrency 32 --num-requests 64 --out /tmp/gil-warm > /dev/null 2>&1
    for C in 32 8; do
      $PY -c "import httpx; open('/tmp/s0.json', 'w').write(httpx.get('$U/internal/stats').text)"
      $SB --concurrency $C --num-requests $((C * 24)) --out "$OUT/node$C" 2>&1 | quiet | tail -2
      $PY -c "import httpx, json; a=json.load(open('/tmp/s0.json'))['device_time']; b=httpx.get('$U/internal/stats').json()['device_time']; \
g={k: (b[k]['calls']-a.get(k, {'calls': 0})['calls'], b[k]['seconds']-a.get(k, {'seconds': 0})['seconds']) for k in b}; n=g['step'][0]; \
print('node $C:', {k: round(1000*v[1]/n, 2) for k, v in g.items() if k != 'decode_rows'}, 'rows', round(g['decode_rows'][0]/n, 1))"
    done
    kill $NODE
    if [ -x "$SPY" ]; then
      timeout 150 $PY bench/serving/profile_single.py --model $M --blas bundled --mix realish --concurrency 32 \
        --duration 15 --gil --py-spy "$SPY" --out "$OUT/spy_gil_32" 2>&1 | quiet | tail -45
    fi
    ;;
  core-modes)
    # The default of --engine-core: the same prompts to a thread-core and a process-core single
    # node on the 1B shape, alternating which goes first (issue 32: the process wins where its
    # tokens/s ratio is above 1 and its TTFT is not worse).
    machine; model_1b
    timeout 560 $PY bench/engine/core_modes.py --model $M --blas bundled --concurrency 8,32 --repeats 3 \
      --out "$OUT/core_modes" 2>&1 | tail -4
    ;;
  long-prompt-stall)
    # Without the load's warm-up request, without it and without the prefix cache, the defaults.
    machine; model_1b
    for args in "--warm-request off" "--warm-request off --prefix-cache-bytes 0" ""; do
      echo "cold_prefill ${args:-defaults}:"
      timeout 100 $PY bench/engine/cold_prefill.py --model $M $args 2>&1 | grep -E '^\{|loaded' | cut -c1-420
    done
    ;;
  cuda-graphs)
    # The engine alone at 32 and 8 rows on both shapes, MLX_USE_CUDA_GRAPHS=0 (the engine's
    # default) then 1, each after a 5 s warm-up.
    machine; model_1b; model_second
    for model in $M $M2; do
      for g in 0 1; do
        for c in 32 8; do
          echo "$(basename $model) graphs $g c$c: $(MLX_USE_CUDA_GRAPHS=$g engine_alone --model $model \
            --concurrency $c --warmup-seconds 5)"
        done
      done
    done
    ;;
  attention-kernel)
    # Self-checks, one call against MLX's masked attention, the whole slot step masked vs kernel
    # (exit 1 when a check disagrees).
    machine; model_1b
    timeout 200 $PY bench/engine/decode_attention.py --model $M --out "$OUT/attention.json" 2>&1 | tail -40
    ;;
  mixed-load)
    machine; model_1b
    timeout "${MIXED_LIMIT:-300}" $PY bench/serving/mixed_load.py --model $M --blas bundled --gpus "${GPUS:-0,0}" \
      --reps 1 --startup-timeout 120 --out "$OUT/mixed" 2>&1 | quiet | tail -24
    ;;
  long-prompt-ttft)
    # 2,000-token prompts at concurrency 1 and 4, then each node's phases (--log-transitions) for
    # the last request at 1; each node with an 8 GiB KV budget (three nodes share the GPU).
    machine; model_1b
    timeout 150 $PY bench/serving/side_by_side.py --model $M --blas bundled --reps 1 --servers single,cluster \
      --statecore-arg=--kv-memory-bytes=8589934592 --statecore-arg=--log-level=INFO --statecore-arg=--log-transitions \
      --mix 2000x16 --concurrency 1,4 --requests-per-slot 4 --min-requests 8 --max-requests 16 \
      --startup-timeout 120 --out "$OUT/sbs_long" 2>&1 | quiet | tail -6
    for who in single cluster; do
      echo "$who:"; $PY bench/phase_times.py "$OUT/sbs_long/$who.log" --last 1 2>&1 | tail -16
    done
    ;;
  multi-turn)
    # 8 and 32 conversations of 6 turns on a shared 1,536-token system prompt, 64-token answers.
    machine; model_1b
    timeout "${MULTITURN_LIMIT:-540}" $PY bench/serving/multi_turn.py --model $M --blas bundled \
      --servers ${MT_SERVERS:-mlx_lm,single,cluster_1p2d,single_nocache} --conversations ${MT_COUNTS:-8,32} \
      --turns 6 --system-tokens 1536 --answer-tokens 64 --statecore-arg=--kv-memory-bytes=8589934592 \
      --startup-timeout 180 --out "$OUT/multi_turn" 2>&1 | quiet | tail -30
    ;;
  prefix-reuse)
    # Chats on a shared 1,000-token system prompt (32 first turns at once, two rounds) and a 3,700-token
    # document asked a second question: statecore with / without its prefix cache and mlx_lm.server;
    # then an 8,000-token cold prompt with a message end every 500 tokens (a block ends after each)
    # against the same prompt without, and at 256- and 512-token chunks (what smaller blocks cost).
    machine; model_1b
    timeout "${PREFIX_LIMIT:-420}" $PY bench/serving/shared_prefix.py --model $M --blas bundled \
      --servers mlx_lm,single,single_nocache,single_chunk256 --conversations 32 --rounds 2 --documents 3 \
      --startup-timeout 120 --out "$OUT/shared_prefix" 2>&1 | quiet | tail -18
    # One process, an engine per chunk size for both rounds (a start costs more than a cold prefill):
    # a line per prefill as it ends, then the medians over the default chunk (2,048 on CUDA) without
    # message ends.
    echo "== 8,000 tokens cold, an end-of-turn token every 0 (none) / 500 tokens; chunks 2048 (the default), 256, 512"
    timeout "${COLD_LIMIT:-90}" $PY bench/engine/long_cold.py --model $M --base-src src --tokens 8000 \
      --rounds 2 --warm-first --blas bundled --message-every 0,500 --chunks 256,512 \
      --work "$OUT/long_cold" 2>&1 | tail -13
    ;;
  prefix-stacking)
    # Issue 31's first turns on the GPU: 32 at once on a 1,000-token system message, three rounds.
    # *_stack stack their calls of one shape where the load check finds rows computed alike;
    # *_nostack make a call per prompt. Target: single_stack / single_nocache_stack TTFT p50 <= 0.5.
    # The node logs say at which row counts rows compute alike (none: nothing stacks). Four nodes at a
    # quarter of an H100 each ran it out of memory while loading (2026-12-07): a fifth each.
    machine; model_1b
    timeout "${STACK_LIMIT:-480}" $PY bench/serving/shared_prefix.py --model $M --blas bundled \
      --servers single_stack,single_nocache_stack,single_nostack,single_nocache_nostack --conversations 32 --rounds 3 \
      --scenarios system --answer-tokens 8 --startup-timeout 180 --device-shared-by 5 \
      --out "$OUT/prefix_stacking" 2>&1 | quiet | tail -24
    grep -h "stacked prefill calls" "$OUT"/prefix_stacking/*.log | cut -c1-400 | head -4
    ;;
  prefix-rule)
    # Where a block ends after an end-of-turn token: in every prompt (--message-blocks all, the default)
    # or only in prompts longer than a chunk (long, the rule before: a shorter chat prompt is one call
    # and may share a padded call with others, and nothing of it is reused). 32 first turns at once on
    # a 1,000-token system prompt (two rounds) and a 1,500-token document asked a second question (both
    # shorter than a 2,048-token chunk), each rule with and without the prefix cache: the *_nocache
    # pair is what cold chat prompts pay for losing their padded calls. Then realish against
    # mlx_lm.server (raw completions, no end-of-turn token inside: no change expected).
    machine; model_1b
    timeout "${RULE_LIMIT:-420}" $PY bench/serving/shared_prefix.py --model $M --blas bundled \
      --servers single,single_nocache,single_long,single_long_nocache --conversations 32 --rounds 2 \
      --documents 3 --document-tokens 1500 --startup-timeout 120 --device-shared-by 4 --out "$OUT/prefix_rule" 2>&1 | quiet | tail -28
    vs_mlx_lm $M 6 192 200 sbs_rule
    ;;
  conversation-route)
    # An 8,192-token start held by the decode node and a new part of 512 / 4,096 tokens.
    machine; model_1b
    timeout "${ROUTE_LIMIT:-240}" $PY bench/serving/conversation_route.py --model $M --blas bundled \
      --prefix-tokens 8192 --suffixes 512,4096 --repeats 3 --statecore-arg=--kv-memory-bytes=8589934592 \
      --statecore-arg=--prefill-chunk-size=2048 --out "$OUT/route" 2>&1 | quiet | tail -16
    ;;
  handoff-cost)
    # All three engine nodes on GPU 0: 2,000 and 8,000 tokens at concurrency 1, then 8,000-token
    # streamed handoffs into a decode node with 16 streams decoding. TRACE=1: the first part with
    # every process's step times (bench/step_trace) and every node's transitions, in
    # $OUT/steps.tgz (one file: a call brings back a limited number of files), and where each
    # request's time went by node (phase_times): where a streamed first token waits.
    machine; model_1b
    if [ "${TRACE:-0}" = 1 ]; then
      rm -rf /tmp/steps
      (export STEP_TRACE=/tmp/steps PYTHONPATH=$PWD/bench/step_trace:${PYTHONPATH:-}
       handoff_cost "${STREAM_LIMIT:-280}" stream.json 12 --lengths 2000 8000 --rounds 3 --max-tokens 12 \
         --transitions)
      $PY bench/phase_times.py "$OUT"/logs-stream/*.log --last 2 2>&1 | tail -40
      tar czf "$OUT/steps.tgz" -C /tmp steps
    else
      handoff_cost "${STREAM_LIMIT:-280}" stream.json 12 --lengths 2000 8000 --rounds 3 --max-tokens 12
    fi
    # The decode node with 16 GiB of KV: its 32 slots hold 8,192 positions (at 8 GiB, 4,096: the
    # 8,000-token prompt would decode in the batch lane, which evaluates on its own each step).
    # TRACE=1 traces it too, into $OUT/steps_stall.tgz (the slot path's stall was never traced).
    stall=(handoff_cost "${STALL_LIMIT:-250}" stream_stall.json 8 --lengths 8000 --rounds 2 --max-tokens 12
           --background-streams 16 --decode-arg=--kv-memory-bytes=17179869184)
    if [ "${TRACE:-0}" = 1 ]; then
      rm -rf /tmp/steps_stall
      (export STEP_TRACE=/tmp/steps_stall PYTHONPATH=$PWD/bench/step_trace:${PYTHONPATH:-}; "${stall[@]}")
      tar czf "$OUT/steps_stall.tgz" -C /tmp steps_stall
    else
      "${stall[@]}"
    fi
    ;;
  handoff-stages)
    machine
    timeout "${STAGES_LIMIT:-150}" $PY bench/handoff/kv_copy_stages.py --tokens 2000 8000 --reps 3 2>&1 | tail -34
    ;;
  handoff-pull)
    # 128 / 2,000 / 8,000 tokens with 16 streams decoding on the decode node throughout.
    machine; model_1b
    timeout "${HANDOFF_LIMIT:-300}" $PY bench/handoff/handoff_http.py --model $M --lengths 128 2000 8000 \
      --per-length 3 --background-streams 16 --node-arg=--kv-memory-bytes=$NODE_KV \
      --node-arg=--device-shared-by=3 --out "$OUT/handoff.json" 2>&1 | quiet | tail -24
    ;;
  essentials)
    machine; model_1b
    echo "== memory: the engine alone on realish at 8, default settings"
    memory_trace 60 4 6
    echo "== vs-mlx-lm, the 1B shape"
    vs_mlx_lm $M 6 192 190 sbs
    echo "== handoff-cost at concurrency 1 (2,000 and 8,000 tokens)"
    handoff_cost 200 stream.json 12 --lengths 2000 8000 --rounds 2 --max-tokens 16
    ;;
  memory-growth)
    machine; model_1b
    for variant in "" "--engine-arg=prefill_chunk_size=2048" "--cache-limit-bytes=4294967296" \
        "--engine-arg=compile_decode=off"; do
      echo "== ${variant:-default}"
      memory_trace "${VARIANT_LIMIT:-60}" 2 14 "$variant"
    done
    ;;
  one-stream-speculation)
    # bench/engine/speculative.py on a chain model (the answer mostly follows a fixed chain of
    # tokens: prompt lookup drafts it when the prompt holds it), bf16, hidden 2048 x 16 layers,
    # head dim 64 (32 query heads: MLX's CUDA attention kernels take 64 or 128, not the tiny
    # checkpoints' 16); its JSON says whether the load check left speculation on
    # (load_checks.off_reason).
    machine
    for compile in off on; do
      echo "== prompt lookup, --compile-decode $compile"
      timeout "${SPEC_LIMIT:-110}" $PY bench/engine/speculative.py --hidden-size 2048 --layers 16 \
        --head-dim 64 --dtype bfloat16 --rounds 3 --tokens 200 --draft-tokens 3,5 --compile-decode $compile \
        --out "$OUT/speculative_compile_$compile.json" 2>&1 | tail -14
    done
    echo "== a draft model (hidden 256, 1 layer) for the same target: statecore single vs mlx_lm.server"
    for spec in "/tmp/chain-target-d64 2048 16" "/tmp/chain-draft-d64 256 1"; do
      set -- $spec
      [ -f "$1/config.json" ] || timeout 120 $PY -c "import sys; sys.path.insert(0, '.'); from pathlib import Path; \
from support.chain_model import build_chain_checkpoint as b; b(Path('$1'), hidden_size=$2, num_layers=$3, \
dtype='bfloat16', head_dim=64)"
    done
    timeout "${DRAFT_LIMIT:-140}" $PY bench/serving/side_by_side.py --model /tmp/chain-target-d64 --blas bundled \
      --servers mlx_lm,single --mix 64x128 --concurrency 1 --min-requests 4 --max-requests 4 --reps 3 \
      --no-parity --startup-timeout 120 --mlx-lm-arg=--draft-model=/tmp/chain-draft-d64 \
      --mlx-lm-arg=--num-draft-tokens=3 --statecore-arg=--draft-model=/tmp/chain-draft-d64 \
      --statecore-arg=--num-draft-tokens=3 --statecore-arg=--compile-decode=off \
      --out "$OUT/spec_draft" 2>&1 | quiet | tail -8
    ;;
  *)
    sed -n '/^#   [a-z-]*  /p' "$0"
    exit 2
    ;;
esac
