#!/usr/bin/env bash
# SGLang's own bench_serving, unmodified (the file from the sglang==0.5.5 wheel), against hiserve:
# the native /generate backend and the OpenAI completions and chat backends, small and random-ids
# (no dataset download). Exits non-zero if a run fails or reports failed requests.
#
# sglang itself is not installed (its dependencies pull a CUDA torch): the wheel goes with
# --no-deps into $SGL_DIR, with the two extra modules bench_serving.py imports (pybase64, pillow);
# bench_serving.py imports nothing else from sglang.
#   usage: benchmark/sglang_clients/run_bench_serving.sh   (PY, PORT, SGL_DIR override)
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PY:-.venv/bin/python}
dir=${SGL_DIR:-/tmp/sglang_0.5.5_nodeps}
port=${PORT:-30123}
out=benchmark/results/sglang_bench_serving_cpu.jsonl
[ -f "$dir/sglang/bench_serving.py" ] || "$py" -m pip install -q --no-deps --target "$dir" sglang==0.5.5 pybase64 pillow

tok=$(mktemp -d)
PYTHONPATH=$PWD "$py" -c "
from hiserve.models.loader import get_tokenizer, resolve_model_path
get_tokenizer(resolve_model_path(None)).save_pretrained('$tok')"
log=$(mktemp)
PYTHONPATH=$PWD "$py" -m hiserve.launch_server --host 127.0.0.1 --port "$port" --dtype float32 --max-total-tokens 4096 >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 1
done

rm -f "$out"
for backend in sglang sglang-oai sglang-oai-chat; do
    PYTHONPATH=$dir "$py" "$dir/sglang/bench_serving.py" --backend "$backend" \
        --base-url "http://127.0.0.1:$port" --dataset-name random-ids --tokenizer "$tok" \
        --num-prompts 8 --random-input-len 64 --random-output-len 16 --random-range-ratio 1.0 \
        --request-rate inf --output-file "$out" --disable-tqdm
done
"$py" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"{r['backend']:<16} completed {r['completed']}/8  output tok/s {r['output_throughput']:.1f}")
sys.exit(0 if len(rows) == 3 and all(r["completed"] == 8 for r in rows) else 1)
PY
