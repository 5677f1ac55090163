"""Storage tier (L3) write / read bandwidth per page size, as a ratio to a memcpy of the
same bytes measured in the same run (issue 11, 9(b)).

For each model shape and page size: a real page-first host pool (bf16) of N random pages,
N chosen so the pages total about --target-mb; then, per repetition, with fresh keys:
  * write       `batch_set_from` of all N pages (every kind)
  * read        `batch_get_into` of the same N pages into other host pages, straight after
                the write: for `file` these reads are served from the OS page cache
                (nothing is dropped), so they measure the backend's own overhead
  * read_cold   `file` only: after os.sync() and posix_fadvise(POSIX_FADV_DONTNEED) on every
                page file, so the read goes to the disk (or whatever the hypervisor caches
                beneath it); NaN where fadvise is unavailable or for other backends
  * memcpy      one `Tensor.copy_` of the same bytes (each kind's N pages, contiguous in the
                pool) into a preallocated, touched buffer: the memory-bandwidth bound
MB/s are 10**6 bytes per second of payload (headers excluded); each figure is the median
of --reps runs after one warm-up; ratio = path MB/s / memcpy MB/s. torch runs single-
threaded (as the one storage worker thread does), so the memcpy is one core's.

Shapes: SmolLM2-135M (30 layers, 3 KV heads x 64, bf16; K and V) and Llama-3-8B (32
layers, 8 KV heads x 128, bf16; K and V); page sizes 16, 64, 256.

Usage:
  python benchmark/hicache/bench_storage.py [--backend file|mooncake] [--extra-config JSON]
      [--dir DIR] [--target-mb 256] [--reps 3] [--out benchmark/results/cpu_storage_<backend>.json]
The backend is built through `create_storage`, so `--backend mooncake --extra-config
'{"master_server_address": ..., "metadata_server": ...}'` runs the same measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hiserve.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost  # noqa: E402
from hiserve.mem_cache.storage import create_storage, parse_extra_config  # noqa: E402
from hiserve.mem_cache.storage.keys import page_keys, storage_namespace  # noqa: E402

MODELS = {  # name: (layers, KV heads, head dim)
    "smollm2_135m": (30, 3, 64),
    "llama3_8b": (32, 8, 128),
}
PAGE_SIZES = [16, 64, 256]
DTYPE = torch.bfloat16
NAN = float("nan")


def machine_info(directory: str) -> dict:
    """lscpu model, cores, memory, kernel, load average, and the filesystem under `directory`."""
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    fs = subprocess.run(["df", "-T", directory], capture_output=True, text=True).stdout.splitlines()
    return {"cpu_model": fields.get("Model name"), "cpus_usable": len(os.sched_getaffinity(0)),
            "hypervisor": fields.get("Hypervisor vendor"), "host": platform.node(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "kernel": os.uname().release, "python": sys.version.split()[0], "torch": torch.__version__,
            "load_average_start": list(os.getloadavg()),
            "filesystem": fs[-1].split()[:2] if len(fs) > 1 else None}


def make_host_pool(layers: int, heads: int, head_dim: int, page: int, pages: int) -> MHATokenToKVPoolHost:
    """A page_first bf16 host pool of 2*`pages` pages (first half written, second half read
    into), random bytes; the device pool behind it is one page (only its shape is used)."""
    dev = MHATokenToKVPool(page, page, DTYPE, heads, head_dim, layers, "cpu")
    host = MHATokenToKVPoolHost(dev, 2 * pages, 0, page, "page_first")
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    return host


def mbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6 if seconds > 0 else NAN


def page_files(backend, keys: list[str]) -> list[str]:
    """The file backend's files of `keys` (empty for other backends)."""
    directory = getattr(backend, "directory", None)
    if directory is None:
        return []
    return [os.path.join(directory, f"{k.rsplit('/', 1)[-1]}.{kind}") for k in keys for kind in backend.kinds]


def drop_page_cache(paths: list[str]) -> bool:
    """Flush dirty pages, then ask the kernel to drop these files' cached pages."""
    if not paths or not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def memcpy_seconds(host, pages: int) -> float:
    """One copy_ per kind of the first `pages` pages (contiguous in page_first) into a
    preallocated buffer that was written once (so no page faults are timed)."""
    srcs = [buf[: pages * host.page_size] for buf in host.kv_buffers]
    dsts = [torch.empty_like(s) for s in srcs]
    for d, s in zip(dsts, srcs):
        d.copy_(s)
    t0 = time.perf_counter()
    for d, s in zip(dsts, srcs):
        d.copy_(s)
    return time.perf_counter() - t0


def one_rep(backend, host, pages: int, page: int, rep: int, check: bool) -> dict:
    """Write then read `pages` pages under fresh keys; seconds of each step."""
    gen = torch.Generator().manual_seed(1000 + rep)
    tokens = torch.randint(0, 49152, (pages * page,), generator=gen).tolist()
    keys = page_keys(tokens, page, backend.namespace)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    t = {}
    t0 = time.perf_counter()
    stored = backend.batch_set_from(keys, src)
    t["write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = backend.batch_get_into(keys, dst)
    t["read"] = time.perf_counter() - t0
    if stored != pages or got != pages:
        raise RuntimeError(f"backend stored {stored} and read {got} of {pages} pages: {backend.stats().failures}")
    if check:
        for kind in host.kinds:
            for s, d in zip(src, dst):
                if not torch.equal(host.page_object(kind.name, s).view(torch.uint8),
                                   host.page_object(kind.name, d).view(torch.uint8)):
                    raise RuntimeError(f"page {s} read back differs ({kind.name})")
    t["read_cold"] = NAN
    if drop_page_cache(page_files(backend, keys)):
        t0 = time.perf_counter()
        got = backend.batch_get_into(keys, dst)
        t["read_cold"] = time.perf_counter() - t0 if got == pages else NAN
    t["memcpy"] = memcpy_seconds(host, pages)
    backend.clear()
    return t


def run_case(args, extra: dict, model: str, page: int) -> dict:
    layers, heads, head_dim = MODELS[model]
    page_bytes = page * layers * heads * head_dim * 2 * 2  # K and V, bf16
    pages = max(8, min(4096, int(args.target_mb * 1e6) // page_bytes))
    host = make_host_pool(layers, heads, head_dim, page, pages)
    ns = storage_namespace(f"bench-{model}", "bfloat16", page, "page_first",
                           [(k.name, k.item_shape) for k in host.kinds], layers, extra=f"pid{os.getpid()}")
    backend = create_storage(args.backend, host, ns, extra)
    try:
        backend.clear()
        reps = [one_rep(backend, host, pages, page, r, check=(r == 0)) for r in range(args.reps + 1)][1:]
    finally:
        backend.clear()
        backend.close()
        if getattr(backend, "directory", None):
            shutil.rmtree(backend.directory, ignore_errors=True)
    nbytes = pages * page_bytes
    row = {"model": model, "page_size": page, "pages": pages, "page_bytes": page_bytes, "bytes": nbytes}
    for step in ("write", "read", "read_cold", "memcpy"):
        secs = [r[step] for r in reps]
        row[f"{step}_s"] = secs
        row[f"{step}_mbps"] = mbps(nbytes, statistics.median(secs)) if all(s == s for s in secs) else NAN
    for step in ("write", "read", "read_cold"):
        row[f"{step}_ratio"] = row[f"{step}_mbps"] / row["memcpy_mbps"]
    row["failures"] = dict(backend.stats().failures)
    return row


def print_table(rows: list[dict], backend: str) -> None:
    print(f"\n## {backend}: MB/s (10**6 B/s of payload) and ratio to memcpy of the same bytes")
    print(f"| model | page | pages | MB | write | read (page cache) | read cold | memcpy | write/memcpy "
          f"| read/memcpy | cold/memcpy |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['page_size']} | {r['pages']} | {r['bytes'] / 1e6:.0f} | {r['write_mbps']:.0f} "
              f"| {r['read_mbps']:.0f} | {r['read_cold_mbps']:.0f} | {r['memcpy_mbps']:.0f} "
              f"| {r['write_ratio']:.3f} | {r['read_ratio']:.3f} | {r['read_cold_ratio']:.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="file", choices=["file", "mooncake"])
    parser.add_argument("--extra-config", default=None, help="JSON or @file.json (as the server flag)")
    parser.add_argument("--dir", default=None, help="file backend directory (default: a fresh temp dir)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--page-sizes", type=int, nargs="+", default=PAGE_SIZES)
    parser.add_argument("--target-mb", type=float, default=256.0, help="payload per case, MB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    parser.add_argument("--out", default=None, help="JSON path (default benchmark/results/cpu_storage_<backend>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    extra = parse_extra_config(args.extra_config)
    tmp = None
    if args.backend == "file" and "file_storage_path" not in extra:
        tmp = args.dir or tempfile.mkdtemp(prefix="hiserve_bench_storage_")
        extra["file_storage_path"] = tmp
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(extra.get("file_storage_path", tempfile.gettempdir())),
        "run_note": args.note, "backend": args.backend, "extra_config": extra, "settings": vars(args), "torch_threads": 1,
        "note": "MB = 10**6 bytes of payload; medians of --reps after one warm-up; 'read' is served "
                "from the OS page cache for the file backend; 'read_cold' after fsync + "
                "POSIX_FADV_DONTNEED per file (a VM's host cache may still serve it)",
    }
    rows, t0 = [], time.time()
    try:
        for model in args.models:
            for page in args.page_sizes:
                rows.append(run_case(args, extra, model, page))
                print(f"# {model} page {page}: done ({time.time() - t0:.0f} s)", flush=True)
    finally:
        if tmp and not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    results["rows"], results["elapsed_s"] = rows, time.time() - t0
    results["machine"]["load_average_end"] = list(os.getloadavg())
    print_table(rows, args.backend)
    out = Path(args.out or f"benchmark/results/cpu_storage_{args.backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out} ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
