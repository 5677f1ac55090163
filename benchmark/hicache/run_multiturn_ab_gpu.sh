#!/usr/bin/env bash
# HiCache multi-turn A/B on a GPU with a Llama-3-8B-shaped dummy model (--load-format dummy):
# run_multiturn_ab.sh (the same bench_multiturn.py workload against a server WITHOUT and then
# WITH --enable-hierarchical-cache, same small device pool, same request rate) on a dummy
# model folder written first, then the target check: mean TTFT with / without <= 0.4.
#
#   benchmark/hicache/run_multiturn_ab_gpu.sh [PREFIX]          # H200: about 3-4 minutes
#   DEVICE=cpu SHAPE=tiny-llama CLIENTS=3 ROUNDS=3 REQUEST_LEN=48 OUTPUT_LEN=4 MAX_TOTAL_TOKENS=256 \
#       benchmark/hicache/run_multiturn_ab_gpu.sh cpu_multiturn_ab_tiny   # harness check on the CPU
#
# Writes benchmark/results/PREFIX_{without,with}_hicache.json and PREFIX_ab.json (PREFIX
# defaults to h200_hicache_multiturn); the target is added to PREFIX_ab.json.
# Knobs (defaults): SHAPE [llama3-8b] DEVICE [cuda] ATTENTION_BACKEND [fa3 on cuda,
# torch_native on cpu] CUDA_GRAPH_MAX_BS [16] MAX_TOTAL_TOKENS [8192] PAGE_SIZE [16]
# HICACHE_RATIO [12] CLIENTS [16] ROUNDS [6] REQUEST_LEN [512] OUTPUT_LEN [32] MAX_PARALLEL [8]
# REQUEST_RATE [4] PYTHON [python3] MODEL_DIR [a new temporary folder], plus run_multiturn_ab.sh's.
# Sizing: 16 conversations end near 6 x (512 + 32) = 3.3K tokens each, 52K in all: six times
# the device pool (8K: about two contexts), within the host pool (12 x 8K = 98K tokens, 12.9 GB
# pinned), so later rounds' prefixes come from the host with the hierarchical cache and are
# mostly recomputed without it. 96 requests at 4/s per run; each server start includes the
# CUDA-graph capture.
set -euo pipefail
cd "$(dirname "$0")/../.."

prefix=${1:-h200_hicache_multiturn}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
model_dir=${MODEL_DIR:-$(mktemp -d /tmp/hiserve_dummy.XXXXXX)}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
    "import sys; from hiserve.testing.dummy_model import write_dummy_model; write_dummy_model(sys.argv[1], sys.argv[2])" \
    "$model_dir" "${SHAPE:-llama3-8b}"

extra="--model-path $model_dir --load-format dummy --device $device"
if [ "$device" = cuda ]; then
    extra="$extra --attention-backend ${ATTENTION_BACKEND:-fa3} --cuda-graph-max-bs ${CUDA_GRAPH_MAX_BS:-16}"
else
    extra="$extra --attention-backend ${ATTENTION_BACKEND:-torch_native}"
fi
export PYTHON=$py DTYPE=${DTYPE:-bfloat16} MAX_TOTAL_TOKENS=${MAX_TOTAL_TOKENS:-8192} PAGE_SIZE=${PAGE_SIZE:-16} \
    HICACHE_RATIO=${HICACHE_RATIO:-12} CLIENTS=${CLIENTS:-16} ROUNDS=${ROUNDS:-6} REQUEST_LEN=${REQUEST_LEN:-512} \
    OUTPUT_LEN=${OUTPUT_LEN:-32} MAX_PARALLEL=${MAX_PARALLEL:-8} REQUEST_RATE=${REQUEST_RATE:-4} \
    SERVER_EXTRA="$extra ${SERVER_EXTRA:-}"
benchmark/hicache/run_multiturn_ab.sh "$prefix"

"$py" - "benchmark/results/${prefix}_ab.json" <<'PY'
import json, sys
path = sys.argv[1]
ab = json.load(open(path))
ratio = ab.get("ttft_ratio_b_over_a")
ab["target"] = {"mean_ttft_ratio_with_over_without_max": 0.4,
                "met": ratio is not None and ratio <= 0.4}
json.dump(ab, open(path, "w"), indent=1)
print(f"target mean TTFT with/without <= 0.4: {ratio} ({'met' if ab['target']['met'] else 'NOT met'})")
PY
