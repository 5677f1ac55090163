#!/usr/bin/env bash
# Same-run CPU comparison of hiserve (`make serve` defaults), vLLM-CPU and llama.cpp's server:
# installs the peers (once, under $BENCH_HOME, default ~/.cache/hiserve-bench, outside the repo),
# then starts each engine alone, one at a time, and measures it with the same client.
#   benchmark/cpu/run_comparison.sh                 # full: 2 repeats -> benchmark/results/cpu_same_run.json
#   benchmark/cpu/run_comparison.sh --quick --repeats 1   # smoke test -> cpu_same_run_quick.json
#   benchmark/cpu/run_comparison.sh --markdown --note "quiet machine"
# Every argument goes to benchmark/cpu/compare.py (see its --help). Run it on an otherwise idle
# machine: the figures are only as good as the machine is quiet.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${HISERVE_PYTHON:-.venv/bin/python}
[[ -x $PY ]] || make setup
benchmark/cpu/install_peers.sh all
PYTHONPATH=$PWD exec "$PY" benchmark/cpu/compare.py "$@"
