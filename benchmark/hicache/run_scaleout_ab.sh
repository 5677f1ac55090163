#!/usr/bin/env bash
# Scale-out A/B on the multi-turn workload: sglang-router (cache_aware) in front of two hiserve
# replicas (hierarchical cache, small device + host pools), WITHOUT and then WITH a Mooncake
# Store the replicas share (`--hicache-storage-backend mooncake`, one mooncake_master); the same
# bench_multiturn.py --api-format native run through the router; mean TTFT ratio with/without.
#
#   benchmark/hicache/run_scaleout_ab.sh [PREFIX]
#
# Writes benchmark/results/PREFIX_{without,with}_store.json and PREFIX_ab.json (PREFIX defaults
# to scaleout_multiturn; the _ab file adds the commands, lscpu's CPU model, per-replica request
# counts and storage figures, the working set against one replica's pools, and NOTE).
# Environment knobs (defaults in brackets):
#   PYTHON [.venv/bin/python]  DTYPE [bfloat16]  MAX_TOTAL_TOKENS [1024]  HICACHE_RATIO [2]
#   PAGE_SIZE [16]  CLIENTS [12]  ROUNDS [5]  REQUEST_LEN [144]  OUTPUT_LEN [16]  MAX_PARALLEL [4]
#   SEED [1]  SEGMENT [512mb] (memory each replica lends the store)  PREFETCH_THRESHOLD [64]
#   REPLICA_THREADS [1] (each replica's OMP_NUM_THREADS; more threads than cores makes OpenMP
#   spin-wait against the other replica and the storage worker)
#   NOTE (free text stored in the _ab JSON)  LOG_DIR [a new /tmp/scaleout_ab.* dir]
# The working set (CLIENTS*ROUNDS*(REQUEST_LEN+OUTPUT_LEN) tokens) should be >= 3x one
# replica's device + host pools (MAX_TOTAL_TOKENS*(1+HICACHE_RATIO)) and fit 2*SEGMENT.
set -euo pipefail
cd "$(dirname "$0")/../.."

prefix=${1:-scaleout_multiturn}
py=${PYTHON:-.venv/bin/python}
pool=${MAX_TOTAL_TOKENS:-1024}
ratio=${HICACHE_RATIO:-2}
threads=${REPLICA_THREADS:-1}  # compute threads per replica: two replicas share the machine's cores
out=benchmark/results
logs=${LOG_DIR:-$(mktemp -d /tmp/scaleout_ab.XXXXXX)}
mkdir -p "$out" "$logs"
master_bin=$(dirname "$py")/mooncake_master

bench=(--num-clients "${CLIENTS:-12}" --num-rounds "${ROUNDS:-5}" --request-length "${REQUEST_LEN:-144}"
       --output-length "${OUTPUT_LEN:-16}" --max-parallel "${MAX_PARALLEL:-4}" --seed "${SEED:-1}"
       --api-format native --flush-cache --disable-tqdm)
replica_common=(--dtype "${DTYPE:-bfloat16}" --max-total-tokens "$pool" --page-size "${PAGE_SIZE:-16}"
                --enable-hierarchical-cache --hicache-ratio "$ratio" --host 127.0.0.1
                --enable-metrics --enable-cache-report)

pids=()  # every process started here runs in its own process group (setsid)
stop_all() {
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    pids=()
}
trap stop_all EXIT INT TERM

free_port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_url() {  # wait_url URL PID LOG: until URL answers 200
    for _ in $(seq 600); do
        kill -0 "$2" 2>/dev/null || { echo "exited during start-up ($3):"; tail -30 "$3"; exit 1; }
        curl -sf "$1" >/dev/null 2>&1 && return 0
        sleep 1
    done
    echo "not ready: $1"; exit 1
}
start() {  # start LOG CMD...: run CMD in its own process group
    local log=$1; shift
    echo "+ $*" | tee -a "$logs/commands.txt"
    setsid "$@" >"$log" 2>&1 &
    pids+=($!)
}

# run_one LABEL [replica flags...]
run_one() {
    local label=$1; shift
    local urls=() port rport
    for i in 1 2; do
        port=$(free_port)
        start "$logs/${prefix}_${label}_replica$i.log" env OMP_NUM_THREADS="$threads" "$py" -m hiserve.launch_server "${replica_common[@]}" --port "$port" "$@"
        urls+=("http://127.0.0.1:$port")
    done
    for i in 0 1; do wait_url "${urls[$i]}/health" "${pids[-2 + i]}" "$logs/${prefix}_${label}_replica$((i + 1)).log"; done
    rport=$(free_port)
    start "$logs/${prefix}_${label}_router.log" "$py" -m sglang_router.launch_router --host 127.0.0.1 \
        --port "$rport" --worker-urls "${urls[@]}" --policy cache_aware --prometheus-host 127.0.0.1 \
        --prometheus-port "$(free_port)" --log-level warn
    wait_url "http://127.0.0.1:$rport/health" "${pids[-1]}" "$logs/${prefix}_${label}_router.log"
    echo "=== $label: router :$rport -> ${urls[*]} (logs in $logs) ==="
    "$py" benchmark/hicache/bench_multiturn.py --base-url "http://127.0.0.1:$rport" "${bench[@]}" \
        --label "$label" --output-file "$out/${prefix}_${label}.json"
    "$py" benchmark/hicache/scaleout_replicas.py --output-file "$out/${prefix}_${label}.json" "${urls[@]}"
    stop_all
}

run_one without_store

mport=$(free_port)
hport=$(free_port)
start "$logs/${prefix}_master.log" "$master_bin" --rpc_port="$mport" --rpc_address=127.0.0.1 \
    --enable_http_metadata_server=true --http_metadata_server_host=127.0.0.1 \
    --http_metadata_server_port="$hport" --metrics_port="$(free_port)" --enable_metric_reporting=false
wait_url "http://127.0.0.1:$hport/health" "${pids[-1]}" "$logs/${prefix}_master.log"
extra="{\"master_server_address\": \"127.0.0.1:$mport\", \"metadata_server\": \"http://127.0.0.1:$hport/metadata\","
extra+=" \"protocol\": \"tcp\", \"global_segment_size\": \"${SEGMENT:-512mb}\", \"prefetch_threshold\": ${PREFETCH_THRESHOLD:-64}}"
run_one with_store --hicache-storage-backend mooncake --hicache-storage-backend-extra-config "$extra"

"$py" benchmark/hicache/bench_multiturn.py --compare \
    "$out/${prefix}_without_store.json" "$out/${prefix}_with_store.json" --output-file "$out/${prefix}_ab.json"
"$py" benchmark/hicache/scaleout_replicas.py --summarize "$out/${prefix}_ab.json" \
    --commands "$logs/commands.txt" --pool-tokens "$((pool + pool * ratio))" --note "${NOTE:-}"
