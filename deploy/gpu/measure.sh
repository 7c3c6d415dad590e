#!/usr/bin/env bash
# The GPU measurements of docs/engine.md ("Next on a GPU"), in stages that each fit one 10-minute
# command on the GPU kit's machine (../shared/gpu/README.md). From the project root, after
# `source .gpu/env.sh;`, with $OUT the folder whose files come back:
#   bash deploy/gpu/measure.sh tests              tests/engine on CUDA (graphs and kernels real)
#   bash deploy/gpu/measure.sh steps [VAR=VALUE]  in-process step times, graphs against eager
#   bash deploy/gpu/measure.sh bench LABEL [VAR=VALUE ...]
#       toolkv bench --spawn: single, concurrent and agent scenarios at 1, 16 and 32 clients, with
#       settings changed by TOOLKV_* variables (e.g. `bench no-overlap TOOLKV_DECODE_OVERLAP=false`)
#   bash deploy/gpu/measure.sh restart            the first request after a restart, its group read from
#                                                 disk, against the miss that wrote it
#   bash deploy/gpu/measure.sh peer               llama.cpp's CUDA server on the same weights, side
#                                                 by side (build it first: `bash .gpu/llamacpp.sh build`)
# The model (MODEL_DIR, default /tmp/q3: the kit's random-weight Qwen3-8B shape) is built when
# missing; /tmp lasts as long as the machine stays warm.
set -euo pipefail
stage=${1:?"stage: tests, steps, bench, restart or peer"}
shift
out=${OUT:?"OUT: where results go"}
model=${MODEL_DIR:-/tmp/q3}
export TOOLKV_RAM_BUDGET_BYTES=${TOOLKV_RAM_BUDGET_BYTES:-16GiB}
need_model() { [ -d "$model" ] || python3 .gpu/mkmodel.py qwen3-8b "$model"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" || true
git log -1 --format='%H %s' > "$out/commit.txt" 2>/dev/null || true

case "$stage" in
  tests)
    timeout 400 python3 -m pytest tests/engine -q -p no:cacheprovider 2>&1 | tail -40 > "$out/tests-engine.txt"
    tail -5 "$out/tests-engine.txt" ;;
  steps)
    need_model
    env "$@" timeout 400 python3 deploy/gpu/step_times.py "$model" --out "$out/step_times.json" 2>&1 \
      | grep -v -e Loading -e Converting | tee "$out/step_times.txt" ;;
  bench)
    label=${1:?"bench LABEL [VAR=VALUE ...]"}
    shift
    need_model
    env "$@" timeout 450 toolkv bench --spawn --model "$model" --scenario single concurrent agent \
      --clients 1,16,32 --no-floor --out "$out/bench-$label" 2>&1 | grep -v "━" | tail -75 | tee "$out/bench-$label.txt"
    grep -i "captured\|warm-up\|ready in\|compiled tool\|Traceback\|Error" "$out/bench-$label/server.log" \
      | cut -c1-250 | head -30 > "$out/server-events-$label.txt" || true ;;
  restart)
    need_model
    timeout 450 toolkv bench --spawn --model "$model" --scenario restart --no-floor --out "$out/bench-restart" 2>&1 \
      | grep -v "━" | tail -40 | tee "$out/bench-restart.txt" ;;
  peer)
    need_model
    bash .gpu/llamacpp.sh wait
    [ -f "$model.gguf" ] || bash .gpu/llamacpp.sh gguf "$model"
    bash .gpu/llamacpp.sh serve "$model.gguf" 8811
    timeout 450 toolkv bench --spawn --model "$model" --peer-url http://127.0.0.1:8811 --tools-in-system \
      --out "$out/bench-peer" 2>&1 | grep -v "━" | tail -75 | tee "$out/bench-peer.txt" ;;
  *)
    echo "unknown stage $stage" >&2
    exit 2 ;;
esac
