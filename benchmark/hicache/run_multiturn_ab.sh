#!/usr/bin/env bash
# HiCache A/B on the multi-turn workload: the same bench_multiturn.py run against a hiserve
# server WITHOUT and then WITH --enable-hierarchical-cache (same small device pool), then a
# comparison (mean TTFT, ratio, host-hit tokens, identical outputs).
#
#   benchmark/hicache/run_multiturn_ab.sh [PREFIX]
#
# Writes benchmark/results/PREFIX_{without,with}_hicache.json and PREFIX_ab.json
# (PREFIX defaults to hicache_multiturn). Environment knobs (defaults in brackets):
#   PYTHON [.venv/bin/python]  DTYPE [bfloat16]  MAX_TOTAL_TOKENS [4096]  PAGE_SIZE [1]
#   HICACHE_RATIO [6]  WRITE_POLICY [write_through]  CLIENTS [12]  ROUNDS [6]
#   REQUEST_LEN [200]  OUTPUT_LEN [32]  MAX_PARALLEL [4]  REQUEST_RATE [inf]  SEED [1]
#   SERVER_EXTRA (extra flags for both servers)  LOG_DIR (server logs) [a new /tmp/hicache_ab.* dir]
# The working set (all conversations' full contexts, about CLIENTS*ROUNDS*(REQUEST_LEN+OUTPUT_LEN)
# tokens) should be several times MAX_TOTAL_TOKENS, and fit the host pool
# (HICACHE_RATIO*MAX_TOTAL_TOKENS), for the host tier to matter.
set -euo pipefail
cd "$(dirname "$0")/../.."

prefix=${1:-hicache_multiturn}
py=${PYTHON:-.venv/bin/python}
dtype=${DTYPE:-bfloat16}
pool=${MAX_TOTAL_TOKENS:-4096}
page=${PAGE_SIZE:-1}
ratio=${HICACHE_RATIO:-6}
policy=${WRITE_POLICY:-write_through}
out=benchmark/results
logs=${LOG_DIR:-$(mktemp -d /tmp/hicache_ab.XXXXXX)}
mkdir -p "$out" "$logs"

bench=(--num-clients "${CLIENTS:-12}" --num-rounds "${ROUNDS:-6}" --request-length "${REQUEST_LEN:-200}"
       --output-length "${OUTPUT_LEN:-32}" --max-parallel "${MAX_PARALLEL:-4}"
       --request-rate "${REQUEST_RATE:-inf}" --seed "${SEED:-1}" --flush-cache --disable-tqdm)
server_common=(--dtype "$dtype" --max-total-tokens "$pool" --page-size "$page" --host 127.0.0.1 --enable-metrics --enable-cache-report
               ${SERVER_EXTRA:-})

server_pid=""
stop_server() {
    if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
        # the server runs in its own process group (setsid): stop it and its scheduler
        kill -TERM -- "-$server_pid" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$server_pid" 2>/dev/null || true
        wait "$server_pid" 2>/dev/null || true
    fi
    server_pid=""
}
trap stop_server EXIT INT TERM

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run_one LABEL [server flags...]
run_one() {
    local label=$1; shift
    local port log
    port=$(free_port)
    log="$logs/${prefix}_${label}.server.log"
    echo "=== $label: server on port $port (log $log) ==="
    setsid "$py" -m hiserve.launch_server "${server_common[@]}" --port "$port" "$@" >"$log" 2>&1 &
    server_pid=$!
    for _ in $(seq 600); do
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "server exited during start-up:"; tail -30 "$log"; exit 1
        fi
        if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
        sleep 1
    done
    curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server not healthy"; exit 1; }
    "$py" benchmark/hicache/bench_multiturn.py --base-url "http://127.0.0.1:$port" "${bench[@]}" \
        --label "$label" --output-file "$out/${prefix}_${label}.json"
    stop_server
}

run_one without_hicache
run_one with_hicache --enable-hierarchical-cache --hicache-ratio "$ratio" --hicache-write-policy "$policy"

"$py" benchmark/hicache/bench_multiturn.py --compare \
    "$out/${prefix}_without_hicache.json" "$out/${prefix}_with_hicache.json" \
    --output-file "$out/${prefix}_ab.json"
