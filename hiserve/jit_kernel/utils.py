"""Build, cache and probe the JIT CUDA modules under `jit_kernel/csrc/`.

Modules are compiled with apache-tvm-ffi (`tvm_ffi.cpp.load_inline`, nvcc + ninja) the
first time they are needed, one module per compile-time configuration
(`KvcacheioConfig`: the threads per block and 16-byte vectors in flight per thread of the
kernels). tvm-ffi caches the shared library on disk (`TVM_FFI_CACHE_DIR`, default
`~/.cache/tvm-ffi`), keyed by the inline source, which embeds a hash of every file under
`csrc/`, so an edited header gives a new build. Importing this module compiles nothing.

The `can_use_*()` probes answer whether a path can run here; each logs ONE warning with
the reason the first time it says no, so callers can fall back to `reference.py` quietly
after that:

* `can_use_jit_kernels()`: CUDA present, tvm-ffi importable, nvcc and ninja found.
* `can_use_batched_copy(device)`: the above, and the CUDA runtime and driver are >= 12.8
  (`cudaMemcpyBatchAsync`), read from the compiled module.

The scheduler process that calls these is single-threaded, so the module-level caches
below take no locks.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import os
import shutil
import sys
import weakref
from pathlib import Path
from typing import Sequence

import torch

from hiserve.jit_kernel import reference

logger = logging.getLogger(__name__)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
BATCHED_COPY_MIN_CUDA_VERSION = 12080  # cudaMemcpyBatchAsync: CUDA 12.8 runtime and driver
VECTOR_BYTES = 16

_warned: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log `message` as a warning the first time `key` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message, *args)


# ----------------------------------------------------------------------------- probes


def _find_cuda_home() -> str | None:
    """A CUDA toolkit root holding both bin/nvcc and the runtime library to link."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).parent.parent))
    candidates.append("/usr/local/cuda")
    for home in filter(None, candidates):
        root = Path(home)
        if (root / "bin" / "nvcc").exists() and any((root / "lib64").glob("libcudart.so*")):
            return str(root)
    return None


def _ensure_ninja_on_path() -> bool:
    """tvm-ffi runs `ninja` from PATH; add the ninja that pip installed beside this
    interpreter (or the `ninja` package's) when PATH lacks one."""
    if shutil.which("ninja"):
        return True
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # type: ignore[import-not-found]

        candidates.append(Path(ninja.BIN_DIR))
    except Exception:
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return True
    return False


@functools.lru_cache(maxsize=None)
def jit_unavailable_reason() -> str | None:
    """Why the JIT kernels cannot be built or run here, or None when they can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    try:
        _import_tvm_ffi()
    except Exception as exc:  # ImportError, or a broken install
        return f"apache-tvm-ffi is not importable ({type(exc).__name__}: {exc}); pip install apache-tvm-ffi"
    if _find_cuda_home() is None:
        return "no CUDA toolkit with nvcc and libcudart was found (set CUDA_HOME or put nvcc on PATH)"
    if not _ensure_ninja_on_path():
        return "ninja was not found on PATH (pip install ninja)"
    return None


def can_use_jit_kernels() -> bool:
    """True when the CUDA transfer kernels can be compiled and run; else warns once."""
    reason = jit_unavailable_reason()
    if reason is not None:
        warn_once("jit", "hiserve CUDA transfer kernels unavailable (%s); using the torch reference copies", reason)
        return False
    return True


def _device_index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or torch.device(device).index is None:
        return torch.cuda.current_device()
    return torch.device(device).index


def batch_copy_info(device: torch.device | int | None = None) -> dict[str, int]:
    """What the compiled module sees: compiled/runtime/driver CUDA versions, whether
    `cudaMemcpyBatchAsync` was found and is usable, and whether the device may use host
    pointers of registered memory directly. Needs the JIT kernels."""
    index = _device_index(device)
    values = [int(v) for v in load_kvcacheio_module().batch_copy_info(index)]
    keys = ("compiled_runtime", "runtime", "driver", "symbol", "usable", "can_use_host_pointer")
    return dict(zip(keys, values))


def can_use_batched_copy(device: torch.device | int | None = None) -> bool:
    """True when staged pages can leave through one `cudaMemcpyBatchAsync` per chunk
    (runtime and driver >= 12.8); else warns once (per-page cudaMemcpyAsync is used)."""
    if not can_use_jit_kernels():
        return False
    info = batch_copy_info(device)
    if not info["usable"]:
        warn_once(
            "batched_copy",
            "cudaMemcpyBatchAsync unusable (compiled for CUDA %d, runtime %d, driver %d, symbol found %d; needs >= %d): "
            "staged write-back falls back to one cudaMemcpyAsync per page",
            info["compiled_runtime"], info["runtime"], info["driver"], info["symbol"], BATCHED_COPY_MIN_CUDA_VERSION,
        )
        return False
    return True


# ----------------------------------------------------------------------------- build


def _import_tvm_ffi():
    # tvm-ffi's optional torch addon is compiled on first import when torch lacks the
    # DLPack C exchange API; the kernels do not need it (they only convert a few tensors).
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import tvm_ffi.cpp  # noqa: F401

    return tvm_ffi


@dataclasses.dataclass(frozen=True)
class KvcacheioConfig:
    """Compile-time configuration of the kvcacheio module (each value is a -D macro).

    relayout_threads, relayout_unroll: block size and 16-byte loads in flight per thread of
        the relayout kernel (device -> device, not block-limited).
    transfer_threads, transfer_unroll: the same for the SM transfer kernels, whose grid is
        capped at a block quota given per call.
    relayout_max_blocks: grid cap of the relayout kernel per buffer (K or V); 0 means 16 per
        SM. The copy engine drains the staging buffer at PCIe speed (~55 GB/s), so a small
        grid keeps ahead of it while leaving the other SMs to a forward pass running at the
        same time. Default from the environment variable HISERVE_RELAYOUT_MAX_BLOCKS.
    """

    relayout_threads: int = 256
    relayout_unroll: int = 4
    transfer_threads: int = 1024
    transfer_unroll: int = 4
    relayout_max_blocks: int = int(os.environ.get("HISERVE_RELAYOUT_MAX_BLOCKS", "0"))

    def macros(self) -> list[str]:
        return [
            f"-DHISERVE_RELAYOUT_THREADS={self.relayout_threads}",
            f"-DHISERVE_RELAYOUT_UNROLL={self.relayout_unroll}",
            f"-DHISERVE_TRANSFER_THREADS={self.transfer_threads}",
            f"-DHISERVE_TRANSFER_UNROLL={self.transfer_unroll}",
            f"-DHISERVE_RELAYOUT_MAX_BLOCKS={self.relayout_max_blocks}",
        ]


KVCACHEIO_FUNCTIONS = {
    "staged_write_back_chunk": "relayout one chunk of pages into staging, then copy the staged pages to host",
    "transfer_one_layer_h2d": "per-layer load-back from any host layout into the layer_first device pool",
    "transfer_all_layer_d2h": "all-layer SM write-back from the layer_first device pool into any host layout",
    "batch_copy_info": "compiled/runtime/driver CUDA versions and cudaMemcpyBatchAsync usability",
    "plan_host_pages": "check CPU host pages (aligned runs inside the buffer) and order them by host slot",
}


def csrc_digest() -> str:
    """Hash of every source file under csrc/ (part of the module name and cache key)."""
    digest = hashlib.sha256()
    for path in sorted(CSRC_DIR.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(CSRC_DIR)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _cuda_arch_flags() -> list[str]:
    """`-gencode` for the current device (e.g. sm_90 on H100/H200), unless TVM_FFI_CUDA_ARCH_LIST is set."""
    if "TVM_FFI_CUDA_ARCH_LIST" in os.environ or not torch.cuda.is_available():
        return []
    major, minor = torch.cuda.get_device_capability()
    os.environ["TVM_FFI_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    return []


@functools.lru_cache(maxsize=None)
def load_kvcacheio_module(config: KvcacheioConfig = KvcacheioConfig()):
    """Compile (first call) and load the kvcacheio module for `config`; cached per config.

    Raises:
        RuntimeError: the JIT toolchain is missing (see `jit_unavailable_reason`) or nvcc failed.
    """
    reason = jit_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot build the kvcacheio kernels: {reason}")
    tvm_ffi = _import_tvm_ffi()
    _cuda_arch_flags()
    os.environ.setdefault("CUDA_HOME", _find_cuda_home())
    digest = csrc_digest()
    name = (
        f"hiserve_kvcacheio_{digest}_r{config.relayout_threads}x{config.relayout_unroll}"
        f"_t{config.transfer_threads}x{config.transfer_unroll}_b{config.relayout_max_blocks}"
    )
    source = f'// csrc digest {digest}\n#include "kvcacheio/bindings.cuh"\n'
    module = tvm_ffi.cpp.load_inline(
        name=name,
        cuda_sources=source,
        functions=KVCACHEIO_FUNCTIONS,
        extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr", *config.macros()],
        extra_ldflags=["-ldl"],
        extra_include_paths=[str(CSRC_DIR)],
        backend="cuda",
    )
    logger.info("loaded JIT module %s (%s)", name, config)
    return module


# ----------------------------------------------------------------------------- call helpers


def item_bytes_of(layer: torch.Tensor) -> int:
    """Bytes of one row (one token of one layer) of a device layer `[slots, *item]`."""
    return math.prod(layer.shape[1:]) * layer.element_size()


_TABLE_CACHE_SIZE = 16
_table_cache: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()


def layer_pointer_table(kinds: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """uint64 `[num_kinds * L]` device tensor of layer base addresses, kind-major (K layers
    then V layers), cached by the addresses, shape and dtype.

    Every layer is validated the first time a set of layers is seen: each is a contiguous
    CUDA tensor `[slots, *item]`, all of one device, dtype, item shape and layer count.

    Raises:
        ValueError: naming the offending layer.
    """
    first = kinds[0][0] if kinds and len(kinds[0]) else None
    if first is None:
        raise ValueError("no device layers given")
    ptrs = tuple(p for layers in kinds for p in map(torch.Tensor.data_ptr, layers))
    key = (ptrs, tuple(first.shape), first.dtype, len(kinds))
    table = _table_cache.get(key)
    if table is not None:
        _table_cache.move_to_end(key)
        return table
    num_layers = len(kinds[0])
    for kind_id, layers in enumerate(kinds):
        if len(layers) != num_layers:
            raise ValueError(f"kind {kind_id} has {len(layers)} layers, kind 0 has {num_layers}")
        for layer_id, t in enumerate(layers):
            if (
                t.device.type != "cuda"
                or t.device != first.device
                or t.dtype != first.dtype
                or tuple(t.shape[1:]) != tuple(first.shape[1:])
                or not t.is_contiguous()
            ):
                raise ValueError(
                    f"device layer {layer_id} of kind {kind_id} is {tuple(t.shape)} {t.dtype} on {t.device} "
                    f"(contiguous={t.is_contiguous()}); expected contiguous [slots, *{tuple(first.shape[1:])}] "
                    f"{first.dtype} on a CUDA device {first.device}"
                )
    # Pinned + non_blocking: a plain .to(device) would wait for the work queued on the stream.
    table = torch.tensor(list(key[0]), dtype=torch.uint64).pin_memory().to(first.device, non_blocking=True)
    _table_cache[key] = table
    while len(_table_cache) > _TABLE_CACHE_SIZE:
        _table_cache.popitem(last=False)
    return table


_index_cache: dict[str, tuple] = {}


def host_indices_to_device(host_indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy CPU host indices to `device` for an SM kernel without blocking the host: through a
    pinned bounce buffer, `non_blocking`, on the current stream. The last result is reused
    while the same tensor (same version) is asked for again on the same stream, so a
    layer-by-layer load-back copies its indices once."""
    stream = torch.cuda.current_stream(device)
    cached = _index_cache.get("last")
    if cached is not None:
        ref, version, stream_id, on_device = cached
        if ref() is host_indices and version == host_indices._version and stream_id == stream.cuda_stream:
            return on_device
    pinned = torch.empty(host_indices.shape, dtype=host_indices.dtype, pin_memory=True)
    pinned.copy_(host_indices)
    on_device = pinned.to(device, non_blocking=True)
    try:
        _index_cache["last"] = (weakref.ref(host_indices), host_indices._version, stream.cuda_stream, on_device)
    except TypeError:
        pass
    return on_device


_order_buffer: list[torch.Tensor] = []  # one reusable scratch tensor
_side_streams: dict[int, torch.cuda.Stream] = {}


def order_buffer(num_pages: int) -> torch.Tensor:
    """A CPU int64 scratch of >= num_pages entries (read only during one call)."""
    if not _order_buffer or _order_buffer[0].numel() < num_pages:
        _order_buffer[:] = [torch.empty(max(num_pages, 1024), dtype=torch.int64)]
    return _order_buffer[0]


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One extra stream per device (the staged write-back's relayout stream)."""
    stream = _side_streams.get(device.index)
    if stream is None:
        stream = _side_streams[device.index] = torch.cuda.Stream(device)
    return stream


# ----------------------------------------------------------------------------- argument checks (ValueError)


def check_indices(device_indices, host_indices, device: torch.device, host_device: torch.device | None,
                   page_size: int) -> int:
    """Both index tensors 1-D int32/int64 of equal length, a whole number of pages, on their
    devices (`host_device` None: CPU or `device`). Returns the number of tokens."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    reference.check_index_tensor(device_indices, "device_indices", device)
    if host_device is None:
        host_device = host_indices.device if host_indices.device in (device, torch.device("cpu")) else device
    reference.check_index_tensor(host_indices, "host_indices", host_device)
    n = device_indices.numel()
    if host_indices.numel() != n:
        raise ValueError(f"device_indices ({n}) and host_indices ({host_indices.numel()}) must have the same length")
    if n % page_size:
        raise ValueError(f"{n} slots is not a multiple of page_size={page_size}")
    if not host_indices.is_contiguous() or not device_indices.is_contiguous():
        raise ValueError("device_indices and host_indices must be contiguous")
    return n


def check_host_buffer(host: torch.Tensor, name: str, layout: str, layer_num: int, page_size: int,
                       item: tuple, dtype: torch.dtype) -> int:
    """A pinned, contiguous CPU buffer of one kind in `layout`; returns its host slots S."""
    if not isinstance(host, torch.Tensor) or host.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got {getattr(host, 'device', type(host))}")
    if host.dtype != dtype:
        raise ValueError(f"{name} dtype {host.dtype} != device dtype {dtype} (copies are exact)")
    slots = reference.host_kind_slots(layout, host, page_size)
    expected = reference.host_kind_shape(layout, slots, layer_num, page_size, item)
    if tuple(host.shape) != expected:
        raise ValueError(f"{name} shape {tuple(host.shape)} does not fit {layout!r} with L={layer_num}, "
                         f"P={page_size}, item={item}; expected {expected}")
    if not host.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {host.stride()}")
    check_pinned(host, name)
    return slots


_pinned_ranges: set[tuple[int, int]] = set()


def check_pinned(host: torch.Tensor, name: str) -> None:
    """Pinned or registered: asked of CUDA once per (address, bytes); host pools keep their
    registration for the life of the process, so a positive answer is remembered."""
    key = (host.data_ptr(), host.numel() * host.element_size())
    if key in _pinned_ranges:
        return
    if not host.is_pinned():
        raise ValueError(f"{name} must be pinned or cudaHostRegister-ed host memory (the device reads/writes it)")
    if len(_pinned_ranges) > 64:
        _pinned_ranges.clear()
    _pinned_ranges.add(key)


def check_item_bytes(item_bytes: int) -> None:
    if item_bytes % VECTOR_BYTES:
        raise ValueError(f"item of {item_bytes} bytes is not a multiple of {VECTOR_BYTES} (16-byte vectors)")


def check_host_bounds(host_indices: torch.Tensor, slots: int) -> None:
    """CPU host indices inside [0, slots) (cheap on the CPU; skipped for device tensors)."""
    if host_indices.device.type == "cpu" and host_indices.numel():
        low, high = int(host_indices.min()), int(host_indices.max())
        if low < 0 or high >= slots:
            raise ValueError(f"host_indices span [{low}, {high}], outside the {slots} host slots")
