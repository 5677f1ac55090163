#!/usr/bin/env bash
# The serving-core issue's three CPU scenarios against one OpenAI-compatible server.
#   benchmark/cpu_scenarios.sh BASE_URL LABEL [TOKENIZER]
# Writes benchmark/results/<LABEL>_{A,B,C}.json; benchmark/compare_cpu.py puts two labels side by side.
#   A: 8 single-stream chat requests, ~200 prompt tokens, 64 output tokens
#   B: concurrency 1, 4, 16 with 32 requests each, ~300-token prompts, 128 output tokens, ignore_eos
#   C: 32 requests sharing a 1000-token system prompt + 50-token questions, concurrency 8
set -euo pipefail
cd "$(dirname "$0")/.."
url=$1; label=$2; tok=${3:-}
py=${PYTHON:-.venv/bin/python}
common=(--base-url "$url" --backend openai-chat --seed 1 --temperature 0)
[ -n "$tok" ] && common+=(--tokenizer "$tok")
out=benchmark/results
$py benchmark/bench_serving.py "${common[@]}" --label "${label}_A" --output-file "$out/${label}_A.json" \
    --scenario random --num-prompts 8 --random-input-len 200 --random-output-len 64 --concurrency 1 --warmup 2
$py benchmark/bench_serving.py "${common[@]}" --label "${label}_B" --output-file "$out/${label}_B.json" \
    --scenario random --num-prompts 32 --random-input-len 300 --random-output-len 128 --ignore-eos \
    --concurrency 1 4 16
$py benchmark/bench_serving.py "${common[@]}" --label "${label}_C" --output-file "$out/${label}_C.json" \
    --scenario shared-prefix --num-prompts 32 --shared-prefix-len 1000 --question-len 50 \
    --random-output-len 32 --ignore-eos --concurrency 8
