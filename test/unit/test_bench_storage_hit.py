"""benchmark/gpu/bench_storage_hit.py's CPU harness (`--tiny --device cpu`): the four TTFT cases
run and are checked (the storage hit reads the whole prefix from storage, the host hit loads it
back, the device hit moves nothing), the hops are timed, and the record is written. Its figures
mean nothing on the CPU; the run shows the benchmark works before it spends GPU time."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmark" / "gpu" / "bench_storage_hit.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(_PATH.parent))
    spec = importlib.util.spec_from_file_location("bench_storage_hit", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_cpu_run_writes_a_checked_record(bench, tmp_path):
    assert bench.main(["--tiny", "--device", "cpu", "--reps", "1", "--io-threads", "2",
                       "--storage-dir", str(tmp_path / "l3"), "--out-dir", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "cpu_storage_hit_tiny.json").read_text())
    assert set(rec["ttft_median_ms"]) == {"recompute", "storage_hit", "device_hit", "host_hit"}
    assert rec["hops"]["pages"] == 512 // 16 and rec["hops"]["read_threads"] == 2
    assert all(v > 0 for v in rec["hops"]["median_ms"].values())


def test_io_threads_must_be_positive(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--io-threads", "0"])
