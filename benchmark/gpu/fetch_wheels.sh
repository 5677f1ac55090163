#!/usr/bin/env bash
# The Python 3.12 wheels an H200 call needs beyond its image (which has torch, triton, httpx,
# transformers, ... but not the serving stack), at the versions this checkout's .venv runs: every
# runtime dependency pyproject.toml declares except those a CUDA image brings with torch (numpy,
# transformers, safetensors, tqdm, httpx), so the GPU figures are taken with the declared stack. httptools matters:
# without it uvicorn falls back to the pure-Python h11 parser, which cost 0.4-1.1 ms more per
# /generate of 4,000 input_ids (benchmark/results/cpu_http_parser_ab.json).
#
#   bash benchmark/gpu/fetch_wheels.sh          # -> .whl/ (~13 MB), .fa3a/ + .fa3b/ (FA3, split)
#
# FA3 (tokenspeed-fa3, 62.8 MB) plus the working tree exceeds one call's 64 MiB, so it travels
# in two halves named after the wheel: call 1 carries .fa3a and runs `cp .fa3a/* /tmp/`; call 2,
# while the machine is still warm, carries .fa3b and .whl and runs
#   f=$(cd .fa3b && ls) && w=/tmp/${f%.part_ab} && cat $w.part_aa .fa3b/$f > $w &&
#   python3 -m pip install -q --no-index --no-deps --target /tmp/fa3 $w &&
#   python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=$PWD:/tmp/site:/tmp/fa3 PATH=/tmp/site/bin:$PATH
# Add the three folders to .git/info/exclude (this script does) so they travel only when carried.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PKGS="fastapi starlette uvicorn httptools pydantic pydantic_core annotated-types typing-inspection
annotated-doc opentelemetry-api typing_extensions anyio sniffio pyzmq orjson gguf xgrammar apache-tvm-ffi
prometheus-client ninja sentencepiece pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
--platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLAT -d "$1" "$2"; }
mkdir -p .git/info .whl
for f in /.whl/ /.fa3a/ /.fa3b/; do grep -qxF "$f" .git/info/exclude 2>/dev/null || echo "$f" >> .git/info/exclude; done
for p in $PKGS; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")
  get .whl "$p==$v"
done
get .whl py-spy  # profile_hit_path.py samples every server process with it when present
tmp=$(mktemp -d)
get "$tmp" tokenspeed-fa3
whl=$(cd "$tmp" && ls tokenspeed_fa3-*.whl)
rm -rf .fa3a .fa3b && mkdir -p .fa3a .fa3b
split -b 36000000 "$tmp/$whl" "$tmp/$whl.part_"
mv "$tmp/$whl.part_aa" .fa3a/ && mv "$tmp/$whl.part_ab" .fa3b/
rm -rf "$tmp"
du -sh .whl .fa3a .fa3b
