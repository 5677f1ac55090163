#!/usr/bin/env bash
# One H200 call's worth of checks and benchmarks, writing logs and JSON under $OUT.
#   bash benchmark/gpu/h200_session.sh tests        # CUDA-marked tests + transfer/decode benchmarks (~8 min)
#   bash benchmark/gpu/h200_session.sh e2e          # GPU serving end to end: 500/500 identity (~5 min)
#   bash benchmark/gpu/h200_session.sh hits         # cold / device-hit / host-hit latency (~6 min)
#   bash benchmark/gpu/h200_session.sh final-a      # after the last GPU-path edit: CUDA tests, Llama serving
#                                                   #   identity, decode during eviction / write-back (~8 min)
#   bash benchmark/gpu/h200_session.sh final-b      # MLA serving identity, write-back bandwidth, hit latency
#                                                   #   page 64 incl. the page-aligned limit (~7 min)
#                                                   #   (s7-final-a / s7-final-b: the same, as session 7 ran them)
#   bash benchmark/gpu/h200_session.sh issue10      # CUDA-marked tests, hit latency (page 16, 64), decode during
#                                                   #   eviction write-back (~9 min)
#   bash benchmark/gpu/h200_session.sh hit-path     # client vs server time of a device hit, py-spy of every
#                                                   #   process, then hit latency at page 64 (~6 min)
#   bash benchmark/gpu/h200_session.sh hits-ab      # the CUDA-graph tests, then hit latency with extend graphs
#                                                   #   (page 16, 64) and without them (page 64) (~9 min)
#   bash benchmark/gpu/h200_session.sh overlap      # issue 12: client TPOT vs model step, overlap on / off,
#                                                   #   concurrency 1/16/64/160, bench_decode in the same call (~6-8 min)
#   bash benchmark/gpu/h200_session.sh overlap-e2e  # GPU serving identity with overlap on (~5 min; "e2e"
#                                                   #   is the same run, "overlap-e2e-off" the one with it off)
#   bash benchmark/gpu/h200_session.sh profile-step # host time per decode step by phase, overlap on / off,
#                                                   #   at concurrency 1 and 16, with torch.profiler traces (~4 min)
#   bash benchmark/gpu/h200_session.sh tp2          # issue 14 on nvidia-h200-x2: decode step TP=2 vs TP=1
#                                                   #   (bench_tp_decode), then the GPU serving scenarios with
#                                                   #   every server at --tp-size 2 (500-request stress with the
#                                                   #   host tier, identity with/without it) against a TP=1
#                                                   #   server on the same backend (calibrated tolerance) (~15 min)
#   bash benchmark/gpu/h200_session.sh storage-hit  # issue 11 9(c): 8K-token prefix L3 -> host -> device, TTFT of a
#                                                   #   storage hit vs recompute, bytes/s per hop vs a copy (~2 min)
#   bash benchmark/gpu/h200_session.sh owed         # what session 5 left for the next GPU session: decode during
#                                                   #   eviction with paired idle steps, hit latency (page 64),
#                                                   #   overlap at concurrency 160 with a step profile (~8 min)
#   bash benchmark/gpu/h200_session.sh s7-probe     # hit latency page 64 with overlap on / off; issue 12 at
#                                                   #   concurrency 1 and 16 with one prefill per wave (~8 min)
#   bash benchmark/gpu/h200_session.sh tp2-cpu      # the CPU-checkable parts of tp2 (gloo, tiny models, ~3 min)
#   bash benchmark/gpu/h200_session.sh s15-probe    # HTTP parser check, client vs server time of a device hit
#                                                   #   with py-spy of every process (~2-4 min)
#   bash benchmark/gpu/h200_session.sh s8-hits      # hit latency page 64 raw vs httpx client, page 16, and the
#                                                   #   in-process device-hit profile (~8 min)
# Expects the machine's python3 (torch + CUDA), FA3 importable (PYTHONPATH), and the
# project's missing wheels installed (README of benchmark/gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/h200_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HISERVE_RESULTS_DIR="$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
case "${1:-tests}" in
  tests)
    python3 -m pytest -m cuda test/jit test/unit -q -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/cuda_tests.txt"
    python3 benchmark/gpu/bench_decode_during_eviction.py --out-dir "$OUT" 2>&1 | tail -5 | tee "$OUT/eviction.txt"
    python3 benchmark/gpu/bench_decode_during_write_back.py --batch-sizes 16 --repeats 3 --out-dir "$OUT" 2>&1 \
      | tail -12 | tee "$OUT/write_back_decode.txt"
    python3 benchmark/hicache/bench_hicache_write_back.py --out-dir "$OUT" 2>&1 | tail -30 | tee "$OUT/write_back.txt"
    ;;
  e2e)
    python3 -m pytest -m cuda test/gpu -q -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_e2e.txt"
    ;;
  overlap)
    python3 benchmark/gpu/bench_overlap.py --out-dir "$OUT" 2>&1 | tail -40 | tee "$OUT/overlap.txt"
    ;;
  overlap-e2e)
    python3 -m pytest -m cuda test/gpu -q -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_e2e_overlap_on.txt"
    ;;
  overlap-e2e-off)
    HISERVE_GPU_SERVER_EXTRA="--cuda-graph-max-bs 16 --disable-overlap-schedule" \
      python3 -m pytest -m cuda test/gpu -q -x -p no:cacheprovider 2>&1 | tail -40 | tee "$OUT/gpu_e2e_overlap_off.txt"
    ;;
  profile-step)
    for c in 1 16; do
      python3 benchmark/gpu/profile_scheduler_step.py --concurrency "$c" --name "h200_scheduler_step_c$c" \
        --trace "$OUT/traces" --out-dir "$OUT" 2>&1 | tail -16 | tee "$OUT/scheduler_step_c$c.txt"
    done
    ;;
  tp2)
    nvidia-smi topo -m | tee "$OUT/topo.txt"  # NVLink between the two GPUs; multicast stays off (KINDS.md)
    python3 benchmark/gpu/bench_tp_decode.py --out-dir "$OUT" 2>&1 | tail -20 | tee "$OUT/tp_decode.txt"
    python3 benchmark/gpu/bench_tp_decode.py --shape deepseek-mla --out-dir "$OUT" 2>&1 | tail -20 \
      | tee "$OUT/tp_decode_mla.txt"
    # Servers A and B at TP=2; server C (the reference) at TP=1 on the same backend, CUDA graphs on.
    HISERVE_RESULTS_DIR="$OUT/tp2" HISERVE_GPU_SERVER_EXTRA="--cuda-graph-max-bs 16 --tp-size 2" \
      HISERVE_GPU_REFERENCE_BACKEND=fa3 HISERVE_GPU_REFERENCE_EXTRA="--cuda-graph-max-bs 16 --tp-size 1" \
      python3 -m pytest -m cuda test/gpu -k llama3 -q -x -p no:cacheprovider -s 2>&1 | tail -60 \
      | tee "$OUT/gpu_e2e_tp2_llama.txt"
    HISERVE_RESULTS_DIR="$OUT/tp2" HISERVE_GPU_SERVER_EXTRA="--cuda-graph-max-bs 16 --tp-size 2" \
      HISERVE_GPU_MLA_BACKEND=triton HISERVE_GPU_REFERENCE_BACKEND=triton \
      HISERVE_GPU_REFERENCE_EXTRA="--cuda-graph-max-bs 16 --tp-size 1" \
      python3 -m pytest -m cuda test/gpu -k deepseek -q -x -p no:cacheprovider -s 2>&1 | tail -60 \
      | tee "$OUT/gpu_e2e_tp2_mla.txt"
    ;;
  tp2-cpu)
    python3 benchmark/gpu/bench_tp_decode.py --tiny --device cpu --out-dir "$OUT" 2>&1 | tail -12 \
      | tee "$OUT/tp_decode_cpu.txt"
    HISERVE_RESULTS_DIR="$OUT/tp2" HISERVE_CPU_SERVER_EXTRA="--tp-size 2" HISERVE_CPU_REFERENCE_EXTRA="--tp-size 1" \
      python3 -m pytest test/gpu -k "cpu-tiny-llama" -q -x -p no:cacheprovider -s 2>&1 | tail -40 \
      | tee "$OUT/gpu_e2e_tp2_cpu.txt"
    python3 -m pytest test/e2e/test_tp.py test/unit/test_tp_collectives.py test/unit/test_tp_sharding.py -q \
      -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/tp_tests_cpu.txt"
    ;;
  storage-hit)
    python3 benchmark/gpu/bench_storage_hit.py --out-dir "$OUT" 2>&1 | tail -12 | tee "$OUT/storage_hit.txt"
    ;;
  owed)
    python3 benchmark/gpu/bench_decode_during_eviction.py --out-dir "$OUT" 2>&1 | tail -3 | tee "$OUT/eviction.txt"
    python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --in-process --out-dir "$OUT" 2>&1 \
      | tail -30 | tee "$OUT/hit_latency.txt"
    python3 benchmark/gpu/profile_scheduler_step.py --concurrency 160 --name h200_scheduler_step_c160 \
      --out-dir "$OUT" 2>&1 | tail -14 | tee "$OUT/scheduler_step_c160.txt"
    ;;
  hits-ab)
    # Issue 10 item 10 with extend graphs: their CUDA tests, then hit latency with extend graphs
    # (page 16 and 64, + in process) and, in the same call, without them (page 64).
    timeout 200 python3 -m pytest -m cuda test/jit/test_cuda_graph_runner.py test/jit/test_fa3_backend.py -q -x \
      -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/cuda_graph_tests.txt"
    timeout 330 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 16 64 --in-process --out-dir "$OUT" \
      2>&1 | tail -60 | tee "$OUT/hit_latency.txt"
    timeout 200 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --out-dir "$OUT" \
      --name hit_latency_cuda_llama3-8b_eager_extend --server-args --cuda-graph-max-extend-tokens 0 2>&1 \
      | tail -12 | tee "$OUT/hit_latency_eager_extend.txt"
    ;;
  hit-path)
    # Where a device hit's time goes (client vs server, py-spy of every process), then hit latency at page 64.
    timeout 120 python3 -m pytest -m cuda test/jit/test_cuda_graph_runner.py -q -x -p no:cacheprovider 2>&1 \
      | tail -5 | tee "$OUT/cuda_graph_tests.txt"
    timeout 240 python3 benchmark/hicache/profile_hit_path.py --lengths 2048 6144 --rate 500 --top 70 \
      --out-dir "$OUT" 2>&1 | tail -200 | tee "$OUT/hit_path.txt"
    timeout 200 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --out-dir "$OUT" 2>&1 | tail -12 \
      | tee "$OUT/hit_latency.txt"
    ;;
  issue10)
    # Issue 10's GPU evidence in one call: the CUDA-marked tests, hit latency (page 16 and 64,
    # 5 repeats), decode during eviction write-back (paired idle steps).
    timeout 280 python3 -m pytest -m cuda test/jit test/unit -q -x -p no:cacheprovider 2>&1 | tail -30 \
      | tee "$OUT/cuda_tests.txt"
    timeout 240 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 16 64 --repeats 5 --out-dir "$OUT" \
      2>&1 | tail -14 | tee "$OUT/hit_latency.txt"
    timeout 60 python3 benchmark/gpu/bench_decode_during_eviction.py --out-dir "$OUT" 2>&1 | tail -6 \
      | tee "$OUT/eviction.txt"
    ;;
  s7-probe)
    # Session 7: device/host hit latency at page 64 with the overlap scheduler (default) and without it
    # (a lone request's hand-off to the worker thread), then issue 12's concurrency 1 and 16 with every
    # prompt of the wave in one prefill batch (--chunked-prefill-size 16384), bench_decode in the same call.
    timeout 110 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --repeats 5 --out-dir "$OUT" \
      --name h200_hit_latency_s7 2>&1 | tail -8
    timeout 110 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --repeats 5 --out-dir "$OUT" \
      --name h200_hit_latency_s7_no_overlap --server-args --disable-overlap-schedule 2>&1 | tail -8
    timeout 260 python3 benchmark/gpu/bench_overlap.py --concurrency 1 16 --num-prompts 16 --modes overlap \
      --server-extra "--chunked-prefill-size 16384" --name h200_overlap_one_wave_s7 --out-dir "$OUT" 2>&1 | tail -16
    ;;
  final-a|s7-final-a)
    # After the last edit of GPU-path code, part 1 (s7-final-a: session 7's name for it):
    # CUDA-marked tests, Llama-3-8B serving identity (500/500 with and without the host tier, overlap
    # on), decode during eviction / write-back.
    timeout 110 python3 -m pytest -m cuda test/jit test/unit -q -x -p no:cacheprovider 2>&1 | tail -4 \
      | tee "$OUT/cuda_tests.txt"
    timeout 280 python3 -m pytest -m cuda test/gpu -k llama3 -q -x -p no:cacheprovider 2>&1 | tail -12 \
      | tee "$OUT/gpu_e2e_llama3.txt"
    timeout 50 python3 benchmark/gpu/bench_decode_during_eviction.py --out-dir "$OUT" 2>&1 | tail -2 \
      | tee "$OUT/eviction.txt"
    timeout 60 python3 benchmark/gpu/bench_decode_during_write_back.py --batch-sizes 16 --repeats 3 \
      --out-dir "$OUT" 2>&1 | tail -12 | tee "$OUT/write_back_decode.txt"
    ;;
  final-b|s7-final-b)
    # Part 2: MLA serving identity (triton), write-back bandwidth, hit latency at page 64 (2K, 6K, the
    # longest page-aligned prefix, the context limit). The MLA servers' first start compiles Triton
    # kernels on a fresh machine: 237 s of setup once, past the old 200 s limit.
    timeout 430 python3 -m pytest -m cuda test/gpu -k deepseek --durations=8 -q -x -p no:cacheprovider 2>&1 | tail -12 \
      | tee "$OUT/gpu_e2e_mla.txt"
    timeout 60 python3 benchmark/hicache/bench_hicache_write_back.py --out-dir "$OUT" 2>&1 | tail -30 \
      | tee "$OUT/write_back.txt"
    timeout 170 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --repeats 5 --out-dir "$OUT" \
      --name h200_hit_latency_s8_final 2>&1 | tail -9
    ;;
  s15-probe)
    # Session 15: which HTTP parser the server gets here (the project requires httptools; without it
    # uvicorn falls back to h11), client vs server time of a device hit (py-spy when carried).
    python3 -c "import uvicorn, httptools; print('uvicorn', uvicorn.__version__, 'httptools', httptools.__version__)" \
      2>&1 | tee "$OUT/http_parser.txt"
    timeout 200 python3 benchmark/hicache/profile_hit_path.py --lengths 2048 6144 8064 --rate 500 --top 70 \
      --out-dir "$OUT" --name h200_hit_path_s15 2>&1 | tail -120 | tee "$OUT/hit_path.txt"
    ;;
  s8-hits)
    # Session 8: hit latency at page 64 with the raw client (default) and httpx (sessions up to 7), page 16
    # raw, then the in-process profile of a device hit (cProfile + torch.profiler trace).
    timeout 150 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --lengths 2048 6144 8064 --repeats 5 \
      --client httpx --out-dir "$OUT" --name h200_hit_latency_s8_httpx 2>&1 | tail -6
    timeout 150 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 16 --repeats 5 --out-dir "$OUT" \
      --name h200_hit_latency_s8_page16 2>&1 | tail -8
    timeout 200 python3 benchmark/hicache/bench_hit_latency.py --page-sizes 64 --lengths 2048 6144 --repeats 3 \
      --in-process --out-dir "$OUT" --name h200_hit_latency_s8_in_process 2>&1 | tail -8
    ;;
  hits)
    python3 benchmark/hicache/bench_hit_latency.py --page-sizes 16 64 --in-process --out-dir "$OUT" 2>&1 \
      | tail -60 | tee "$OUT/hit_latency.txt"
    ;;
esac
