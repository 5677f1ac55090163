"""Tensor-parallel process groups and the collectives the engine, layers and KV hierarchy use.

`parallel_state.py` holds the one TP group of this process (rank, size, a device group for
the forward's collectives and a gloo CPU group for control messages); every collective here
is a no-op at TP size 1, so callers never branch on it. The module sits below `layers` and
`mem_cache` (it imports only torch).
"""

from hiserve.distributed.parallel_state import (
    TPGroup,
    broadcast_pyobj,
    destroy_tp_group,
    get_tp_group,
    init_tp_group,
    tp_all_gather_last_dim,
    tp_all_reduce,
    tp_broadcast_,
    tp_gather_objects,
    tp_min_ints,
)

__all__ = ["TPGroup", "broadcast_pyobj", "destroy_tp_group", "get_tp_group", "init_tp_group",
           "tp_all_gather_last_dim", "tp_all_reduce", "tp_broadcast_", "tp_gather_objects", "tp_min_ints"]
