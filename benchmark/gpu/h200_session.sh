#!/usr/bin/env bash
# One H200 call's worth of checks and benchmarks, writing logs and JSON under $OUT.
#   bash benchmark/gpu/h200_session.sh tests        # CUDA-marked tests + transfer/decode benchmarks (~8 min)
#   bash benchmark/gpu/h200_session.sh e2e          # GPU serving end to end: 500/500 identity (~5 min)
#   bash benchmark/gpu/h200_session.sh hits         # cold / device-hit / host-hit latency (~6 min)
#   bash benchmark/gpu/h200_session.sh overlap      # issue 12: client TPOT vs model step, overlap on / off,
#                                                   #   concurrency 1/16/64/160, bench_decode in the same call (~6-8 min)
#   bash benchmark/gpu/h200_session.sh overlap-e2e  # GPU serving identity with overlap on (~5 min; "e2e"
#                                                   #   is the same run, "overlap-e2e-off" the one with it off)
#   bash benchmark/gpu/h200_session.sh profile-step # host time per decode step by phase, overlap on / off,
#                                                   #   at concurrency 1 and 16, with torch.profiler traces (~4 min)
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
  hits)
    python3 benchmark/hicache/bench_hit_latency.py --page-sizes 16 64 --in-process --out-dir "$OUT" 2>&1 \
      | tail -60 | tee "$OUT/hit_latency.txt"
    ;;
esac
