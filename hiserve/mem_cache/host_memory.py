"""Host memory for the host KV pool: sizing (slots from --hicache-size / --hicache-ratio,
what the machine can spare, the staging buffers' device bytes) and the exact-size pinned
buffer registered with CUDA.

Sizes: names ending in `_bytes` are bytes; slots and pages are counts. `--hicache-size`
is in GB (10**9 bytes) per rank, like SGLang's.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch

from hiserve.jit_kernel.reference import WRITE_BACK_STAGING_PAGE_CHUNK

logger = logging.getLogger(__name__)

GB = 10**9
GiB = 1 << 30
# One cudaHostRegister call covers at most this much (very large single registrations
# fail on some drivers); chunk ends are rounded to whole pages so no copy spans two.
HOST_REGISTER_CHUNK_BYTES = 64 * GiB


# ----------------------------------------------------------------------------- sizing


def host_pool_slots(
    size_per_token_bytes: int,
    page_size: int,
    device_pool_size: int,
    host_to_device_ratio: float,
    host_size_gb: int,
) -> int:
    """Host slots S: `host_size_gb` GB worth of tokens when > 0, else ratio x device slots,
    rounded down to whole pages.

    Raises:
        ValueError: the result is less than one page.
    """
    if host_size_gb > 0:
        slots = int(host_size_gb * GB) // size_per_token_bytes
        asked = f"--hicache-size {host_size_gb} GB ({host_size_gb * GB} bytes)"
    else:
        slots = int(device_pool_size * host_to_device_ratio)
        asked = f"--hicache-ratio {host_to_device_ratio} x {device_pool_size} device slots"
    slots = slots // page_size * page_size
    if slots <= 0:
        raise ValueError(
            f"{asked} gives less than one host page ({page_size} tokens x {size_per_token_bytes} bytes "
            "per token); raise --hicache-size or --hicache-ratio"
        )
    return slots


def read_host_memory_bytes() -> tuple[int, int]:
    """(available, total) host memory in bytes: /proc/meminfo MemAvailable / MemTotal,
    further limited by a cgroup v2 memory limit when there is one."""
    available = total = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemAvailable":
                    available = int(rest.split()[0]) * 1024
                elif key == "MemTotal":
                    total = int(rest.split()[0]) * 1024
    except OSError:
        pass
    if available is None or total is None:
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        available = os.sysconf("SC_AVPHYS_PAGES") * page
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            total = min(total, int(limit))
            available = min(available, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return available, total


def host_memory_reserve_bytes(total_bytes: int) -> int:
    """Host memory left alone for the OS and the rest of the process: 10% of the total,
    at least 2 GiB, at most 10 GiB."""
    return max(2 * GiB, min(total_bytes // 10, 10 * GiB))


def write_back_staging_bytes(
    layout: str, device: torch.device, page_num: int | None, page_size: int, layer_num: int,
    item_bytes: int, num_buffers: int,
) -> int:
    """Device bytes of the write-back staging buffers (0 unless `page_first` on CUDA).

    `item_bytes` is one token of one layer of one kind (K or V or the MLA row);
    `num_buffers` is the number of kinds of that size (2 for MHA, 1 for MLA); `page_num` None means the 64-page upper bound
    (for budgeting before the host pool exists).
    """
    if layout != "page_first" or torch.device(device).type != "cuda":
        return 0
    capacity = WRITE_BACK_STAGING_PAGE_CHUNK if page_num is None else min(page_num, WRITE_BACK_STAGING_PAGE_CHUNK)
    return num_buffers * capacity * page_size * layer_num * item_bytes


# ----------------------------------------------------------------------------- pinned buffer


class RegisteredHostMemory:
    """An exact-size anonymous mmap registered with CUDA (cudaHostRegister) chunk by chunk.

    torch's `pin_memory=True` goes through a caching allocator that rounds every request up
    to a power of two (a 20 GiB pool would take 32 GiB); an mmap is exactly the size asked.
    """

    def __init__(self, nbytes: int, granularity_bytes: int) -> None:
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        chunk = max(HOST_REGISTER_CHUNK_BYTES // granularity_bytes, 1) * granularity_bytes
        self._registered: list[int] = []
        base = self.tensor.data_ptr()
        cudart = torch.cuda.cudart()
        for offset in range(0, nbytes, chunk):
            length = min(chunk, nbytes - offset)
            err = int(cudart.cudaHostRegister(base + offset, length, 0))
            if err != 0:
                self.release()
                raise RuntimeError(
                    f"cudaHostRegister of {length} bytes at offset {offset} of a {nbytes}-byte host KV "
                    f"pool failed with cudaError {err}; lower --hicache-size / --hicache-ratio"
                )
            self._registered.append(base + offset)

    def release(self) -> None:
        """Unregister every chunk (idempotent). The memory itself goes with the last tensor view."""
        if not self._registered:
            return
        cudart = torch.cuda.cudart()
        for ptr in self._registered:
            err = int(cudart.cudaHostUnregister(ptr))
            if err != 0:
                logger.warning("cudaHostUnregister(0x%x) failed with cudaError %d", ptr, err)
        self._registered = []
