#!/usr/bin/env bash
# The GPU measurements of docs/engine.md ("Next on a GPU"): ONE command of at most 9 minutes on the
# GPU kit's H100 (../shared/gpu/README.md). From the project root, with .gpu/ carried and $OUT the
# folder whose files come back:
#   source .gpu/env.sh; bash deploy/gpu/measure.sh
# Each stage has its own timeout (SIGINT first, so pytest and Python print what they have) and writes
# under $OUT as it goes, so a crash or a timeout leaves the earlier stages' files; timeline.txt says
# when each ended and how. The stages, in order (the model built in the background meanwhile):
#   1. tests   CUDA tests of the new paths on tiny models (pytest -v)          -> tests.txt
#   2. probe   where a decode step's time goes (deploy/gpu/probe.py: batch 1/16/32, graphs vs eager,
#              a torch.profiler split of GEMM / attention / small kernels, kernels per step; streams
#              with tool_choice none / auto / required)                           -> probe.json, probe.txt
#   3. steps   every step shape, graph against eager (deploy/gpu/step_times.py) -> step_times.json/.txt
#   4. bench   toolkv bench --spawn, single and concurrent at 1/16/32 clients with tools
#              (tool_choice auto, the bench's default)                          -> bench-auto/, bench-auto.txt
#   5. bench   the same requests with tool_choice none (single, concurrent at 16), with what is left
#              (the "auto within 10% of none" target)                             -> bench-none/, bench-none.txt
# One stage alone (each builds the model when missing; /tmp lasts while the machine stays warm):
#   bash deploy/gpu/measure.sh tests|probe|steps
#   bash deploy/gpu/measure.sh bench LABEL [VAR=VALUE ...] [-- BENCH ARGS]   e.g. `bench no-overlap
#       TOOLKV_DECODE_OVERLAP=false`; default args: single concurrent at 1,16,32 clients, tools auto
#   bash deploy/gpu/measure.sh restart   the first request after a restart (its group from disk)
#   bash deploy/gpu/measure.sh peer      llama.cpp's CUDA server on the same weights, side by side
#                                        (after `bash .gpu/llamacpp.sh build` and its ~5 minutes)
# MODEL_DIR (default /tmp/q3: the kit's random-weight Qwen3-8B shape); MEASURE_BUDGET_S (default 480:
# the whole run's seconds, leaving the 9 minutes' rest for `source .gpu/env.sh` and a last SIGKILL);
# TIMEOUT_S: one stage's limit when run alone.
set -uo pipefail
out=${OUT:?"OUT: where results go"}
mkdir -p "$out"
model=${MODEL_DIR:-/tmp/q3}
budget=${MEASURE_BUDGET_S:-480}
t0=$(date +%s)
elapsed() { echo $(( $(date +%s) - t0 )); }
left() { echo $(( budget - $(elapsed) )); }
stamp() { echo "[$(elapsed)s] $*" | tee -a "$out/timeline.txt"; }
# run SECONDS [VAR=VALUE ...] CMD...: at most SECONDS, SIGINT then SIGKILL 15 s later; its status
# (124: timed out)
run() { local limit=$1; shift; timeout -k 15 -s INT "$limit" env "$@"; }
need_model() {  # ~25 s for the 8B shape; bounded, so a hung build cannot hold up the stages after it
  [ -d "$model" ] || timeout -k 10 150 python3 .gpu/mkmodel.py qwen3-8b "$model" > "$out/mkmodel.txt" 2>&1
}

setup() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.csv" 2>&1
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    > "$out/versions.txt" 2>&1
  git log -1 --format='%H %s' > "$out/commit.txt" 2>/dev/null
  git status --short > "$out/git-status.txt" 2>/dev/null
  stamp "env ready ($(cat "$out/versions.txt" 2>/dev/null | tail -1))"
}

stage_tests() {  # 1. correctness of the new paths on CUDA, tiny models; -v: a timeout still shows what ran
  run "${1:-170}" python3 -m pytest -v -p no:cacheprovider --tb=short --durations=15 \
    tests/engine/test_attention_kernels.py tests/engine/test_model_layers.py tests/engine/test_models.py \
    tests/engine/test_model_identity.py tests/engine/test_forced_tokens.py tests/engine/test_decode_overlap.py \
    tests/engine/test_step_graphs.py tests/engine/test_cuda_warm_start.py > "$out/tests.txt" 2>&1
  stamp "tests rc=$? $(grep -E '(passed|failed|error)' "$out/tests.txt" | tail -1)"
}

stage_probe() {  # 2. a decode step's time, in process
  need_model
  run "${1:-150}" TOOLKV_RAM_BUDGET_BYTES="${TOOLKV_RAM_BUDGET_BYTES:-40GiB}" \
    python3 deploy/gpu/probe.py "$model" --out "$out/probe.json" > "$out/probe.txt" 2>&1
  stamp "probe rc=$? $(grep -c FAILED "$out/probe.txt") parts failed"
}

stage_steps() {  # 3. every step shape, graph against eager
  need_model
  run "${1:-80}" TOOLKV_RAM_BUDGET_BYTES="${TOOLKV_RAM_BUDGET_BYTES:-40GiB}" \
    python3 deploy/gpu/step_times.py "$model" --repeats 10 --out "$out/step_times.json" > "$out/step_times.log" 2>&1
  local rc=$?
  grep -v -e Loading -e Converting "$out/step_times.log" > "$out/step_times.txt"
  stamp "steps rc=$rc"
}

# bench SECONDS LABEL [VAR=VALUE ...] [-- BENCH ARGS]: toolkv bench --spawn, its whole log kept
bench() {
  local limit=$1 label=$2; shift 2
  local vars=() args=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do vars+=("$1"); shift; done
  [ "${1:-}" = "--" ] && { shift; args=("$@"); }
  [ ${#args[@]} -gt 0 ] || args=(--scenario single concurrent --clients 1,16,32)
  need_model
  run "$limit" TOOLKV_RAM_BUDGET_BYTES="${TOOLKV_RAM_BUDGET_BYTES:-16GiB}" "${vars[@]}" \
    toolkv bench --spawn --model "$model" --no-floor --out "$out/bench-$label" "${args[@]}" > "$out/bench-$label.log" 2>&1
  local rc=$?
  grep -v "━" "$out/bench-$label.log" | tail -80 > "$out/bench-$label.txt"
  grep -i "captured\|warm-up\|ready in\|compiled tool\|Traceback\|Error\|eager" "$out/bench-$label/server.log" \
    2>/dev/null | cut -c1-250 | head -40 > "$out/server-events-$label.txt"
  stamp "bench $label rc=$rc"
}

all() {
  setup
  # the 8B model, built on the GPU in the background while the tiny-model tests run (~30 s)
  need_model & local mk=$!
  stage_tests 170
  wait "$mk"; stamp "model: $(tail -1 "$out/mkmodel.txt" 2>/dev/null || echo "$model was there")"
  stage_probe 150
  local l; l=$(left)
  stage_steps $(( l > 80 ? 80 : (l < 20 ? 20 : l) ))
  l=$(left)
  if [ "$l" -gt 200 ]; then
    bench $(( l - 90 )) auto -- --scenario single concurrent --clients 1,16,32 --tool-choice auto
  elif [ "$l" -gt 60 ]; then
    bench "$l" auto -- --scenario single concurrent --clients 1,16 --tool-choice auto
  else
    stamp "bench skipped: ${l}s left"
  fi
  l=$(left)
  if [ "$l" -gt 60 ]; then
    bench "$l" none -- --scenario single concurrent --clients 16 --tool-choice none
  else
    stamp "bench none skipped: ${l}s left"
  fi
  stamp "done"
}

stage=${1:-all}
[ $# -gt 0 ] && shift
case "$stage" in
  all) all ;;
  tests) setup; stage_tests "${TIMEOUT_S:-400}" ;;
  probe) setup; stage_probe "${TIMEOUT_S:-400}" ;;
  steps) setup; stage_steps "${TIMEOUT_S:-400}" ;;
  bench)
    setup
    label=${1:?"bench LABEL [VAR=VALUE ...] [-- BENCH ARGS]"}; shift
    bench "${TIMEOUT_S:-500}" "$label" "$@" ;;
  restart) setup; bench "${TIMEOUT_S:-500}" restart -- --scenario restart ;;
  peer)
    setup
    need_model
    bash .gpu/llamacpp.sh wait
    [ -f "$model.gguf" ] || bash .gpu/llamacpp.sh gguf "$model"
    bash .gpu/llamacpp.sh serve "$model.gguf" 8811
    bench "${TIMEOUT_S:-500}" peer -- --peer-url http://127.0.0.1:8811 --tools-in-system ;;
  *)
    echo "unknown stage $stage: all (the default), tests, probe, steps, bench, restart or peer" >&2
    exit 2 ;;
esac
