"""Public device <-> host KV transfer functions, dispatched by device and IO backend.

Every function checks shapes, dtypes, devices and index placement (ValueError naming the
offending value) and then runs one implementation:

| device pool on | io_backend | implementation                                        |
|----------------|------------|-------------------------------------------------------|
| CPU            | any        | `reference.py` (there is no accelerator to program)   |
| CUDA           | `direct`   | `reference.py` (torch copies; the copy engine moves the data) |
| CUDA           | `kernel`   | CUDA kernels: not built yet -> NotImplementedError     |

Nothing silently falls back from `kernel` to something else on CUDA: a later change adds
the kernels (per-token transfer, staged `page_first` write-back) behind these same
functions, with `can_use_*()` probes for callers that want to choose.

Index placement: host indices are always CPU tensors. The staged write-back computes
host addresses on the CPU when it enqueues the copies, and a `.cpu()` of a device tensor
would block the scheduler thread until every transfer queued before it has drained.
Device indices live on the device pool's device.

Importing this module compiles nothing.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hiserve.jit_kernel import reference
from hiserve.jit_kernel.reference import LAYOUTS, WRITE_BACK_STAGING_PAGE_CHUNK  # noqa: F401 (re-export)

IO_BACKENDS = ("kernel", "direct")


def _route(device: torch.device, io_backend: str, what: str) -> None:
    """Raise unless the reference implementation is the right one for (device, io_backend)."""
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {io_backend!r}; expected one of {IO_BACKENDS}")
    if device.type == "cpu" or io_backend == "direct":
        return
    raise NotImplementedError(
        f"{what} with io_backend={io_backend!r} on {device} needs the CUDA transfer kernels, which "
        f"are not built yet; use --hicache-io-backend direct (torch copies) for now"
    )


def _check_host_indices(host_indices: torch.Tensor) -> None:
    if isinstance(host_indices, torch.Tensor) and host_indices.device.type != "cpu":
        raise ValueError(
            f"host_indices must stay on the CPU, got a tensor on {host_indices.device}: host slots come "
            "from the host allocator on the CPU, and moving them back with .cpu() would block the "
            "scheduler until earlier transfers finish"
        )


def write_back_all_layer(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
    staging_k: torch.Tensor | None = None,
    staging_v: torch.Tensor | None = None,
) -> None:
    """MHA write-back (device -> host) of every layer of the given slots.

    Args:
        k_layers, v_layers: the device pool's L tensors `[device_slots, H, Dh]`.
        host_kv: host buffer `[2, *per-kind shape of layout]` (see `reference.py`).
        layout: host layout.
        device_indices: int32/int64 `[n]` on the device pool's device.
        host_indices: int32/int64 `[n]` on the CPU, page-aligned runs of whole pages.
        page_size: tokens per page.
        io_backend: `kernel` or `direct`.
        staging_k, staging_v: the host pool's staging buffers (CUDA + page_first only);
            used by the staged kernel path, ignored by the reference.
    Raises:
        ValueError: bad shapes, dtypes, devices, index placement or io_backend.
        NotImplementedError: a (device, io_backend) pair with no implementation yet.
    """
    _check_host_indices(host_indices)
    _route(k_layers[0].device, io_backend, "write_back_all_layer")
    reference.write_back_all_layer_ref(
        k_layers, v_layers, host_kv, layout,
        device_indices=device_indices, host_indices=host_indices, page_size=page_size,
    )


def write_back_all_layer_mla(
    kv_layers: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
    staging: torch.Tensor | None = None,
) -> None:
    """MLA write-back (device -> host) of every layer; kv_layers are `[device_slots, 1, Dm]`.

    Arguments, errors: as in `write_back_all_layer`, with one host buffer and one staging buffer.
    """
    _check_host_indices(host_indices)
    _route(kv_layers[0].device, io_backend, "write_back_all_layer_mla")
    reference.write_back_all_layer_mla_ref(
        kv_layers, host_kv, layout,
        device_indices=device_indices, host_indices=host_indices, page_size=page_size,
    )


def load_back_one_layer(
    host_kv: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
) -> None:
    """MHA load-back (host -> device) of layer `layer_id` into `k_layer`, `v_layer` `[device_slots, H, Dh]`.

    Arguments, errors: as in `write_back_all_layer`; ValueError too if layer_id is out of range.
    """
    _check_host_indices(host_indices)
    _route(k_layer.device, io_backend, "load_back_one_layer")
    reference.load_back_one_layer_ref(
        host_kv, k_layer, v_layer, layout, layer_id,
        host_indices=host_indices, device_indices=device_indices, page_size=page_size,
    )


def load_back_one_layer_mla(
    host_kv: torch.Tensor,
    kv_layer: torch.Tensor,
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
) -> None:
    """MLA load-back (host -> device) of layer `layer_id` into `kv_layer` `[device_slots, 1, Dm]`."""
    _check_host_indices(host_indices)
    _route(kv_layer.device, io_backend, "load_back_one_layer_mla")
    reference.load_back_one_layer_mla_ref(
        host_kv, kv_layer, layout, layer_id,
        host_indices=host_indices, device_indices=device_indices, page_size=page_size,
    )
