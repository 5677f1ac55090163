"""The tensor-parallel group of this process and its collectives.

One scheduler process per rank (SGLang's layout). Two groups join the ranks:
- the *device group*: NCCL on CUDA, gloo on the CPU; the forward's all-reduces and
  all-gathers and the sampled-token broadcast run on it (on the forward's thread);
- the *CPU group*: always gloo; rank 0's broadcast of the requests it received and the
  KV hierarchy's agreements (all-reduce MIN) run on it, on the scheduler thread. Keeping
  them apart (as SGLang keeps a gloo group beside NCCL) lets the overlap scheduler run a
  forward on its worker thread while the scheduler thread talks on the CPU group: each
  group sees its operations in the same order on every rank.

Every collective takes the group's timeout (`--dist-timeout`): a rank that hangs makes the
others raise instead of waiting forever; a rank that dies closes its gloo sockets, so the
others' next collective fails at once (and the launcher's child watch stops the server).
At TP size 1 nothing is initialised and every function here returns its input.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: 0 .. size-1; rank 0 talks to the API process.
        size: number of ranks (`--tp-size`).
        device_group: group of the forward's collectives (None at size 1).
        cpu_group: gloo group of control messages (None at size 1).
    """

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, full: int, what: str = "") -> tuple[int, int]:
        """(start, size) of this rank's equal share of `full` items (`what` names them in
        the error).

        Raises:
            ValueError: `full` is not divisible by the TP size.
        """
        if full % self.size:
            raise ValueError(f"{full} {what or 'items'} cannot be split evenly over --tp-size {self.size}")
        part = full // self.size
        return self.rank * part, part


_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    """The TP group of this process (size 1 unless `init_tp_group` ran)."""
    return _GROUP


def init_tp_group(size: int, rank: int, init_addr: str, device: torch.device,
                  timeout_s: float) -> TPGroup:
    """Join the `size` ranks at `init_addr` ("host:port", rank 0 listens there).

    Args:
        device: this rank's device; CUDA selects NCCL for the device group (after
            `torch.cuda.set_device(device)`), anything else gloo.
        timeout_s: seconds any collective (and the rendezvous) may wait.
    Raises:
        RuntimeError / DistError: the rendezvous failed or timed out.
    """
    global _GROUP
    if size == 1:
        _GROUP = TPGroup()
        return _GROUP
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{init_addr}", world_size=size, rank=rank,
                            timeout=timeout)
    cpu_group = dist.new_group(list(range(size)), backend="gloo", timeout=timeout)
    _GROUP = TPGroup(rank=rank, size=size, device_group=dist.group.WORLD, cpu_group=cpu_group)
    # One collective per group now: NCCL creates its communicator at the first one, which
    # must not be inside a CUDA-graph capture (the decode graphs capture the all-reduces).
    dist.all_reduce(torch.zeros(1, device=device), group=_GROUP.device_group)
    dist.barrier(group=cpu_group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("TP rank %d/%d (pid %d) joined at %s (device group %s, CPU group gloo, timeout %.0f s)",
                rank, size, os.getpid(), init_addr, backend, timeout_s)
    return _GROUP


def destroy_tp_group() -> None:
    """Leave the group (tests that build several groups in one process)."""
    global _GROUP
    if _GROUP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _GROUP = TPGroup()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks in place (device group); returns `x`. Any shape and dtype."""
    g = _GROUP
    if g.size > 1:
        dist.all_reduce(x, group=g.device_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., size * n], rank r's part at columns r*n .. (r+1)*n."""
    g = _GROUP
    if g.size == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:  # one NCCL all-gather into a [size, ...] buffer, then ranks side by side
        out = torch.empty((g.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=g.device_group)
        return out.movedim(0, -2).reshape(*x.shape[:-1], g.size * x.shape[-1])
    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x, group=g.device_group)
    return torch.cat(parts, dim=-1)


def tp_broadcast_(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s (device group); returns `x`."""
    g = _GROUP
    if g.size > 1:
        dist.broadcast(x, src=src, group=g.device_group)
    return x


def broadcast_pyobj(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s picklable `obj` on every rank (CPU group): a length, then the bytes.

    Other ranks' `obj` is ignored. Raises on a collective error or timeout (a dead rank).
    """
    g = _GROUP
    if g.size == 1:
        return obj
    if g.rank == src:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        dist.broadcast(size, src=src, group=g.cpu_group)
        if data.numel():
            dist.broadcast(data, src=src, group=g.cpu_group)
        return obj
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=src, group=g.cpu_group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if data.numel():
        dist.broadcast(data, src=src, group=g.cpu_group)
    return pickle.loads(data.numpy().tobytes())


def tp_min_ints(values: list[int]) -> list[int]:
    """Element-wise minimum of an int list over the ranks (CPU group); every rank must
    pass a list of the same length."""
    g = _GROUP
    if g.size == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=g.cpu_group)
    return t.tolist()


def tp_gather_objects(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, on every rank (CPU group); [obj] at size 1."""
    g = _GROUP
    if g.size == 1:
        return [obj]
    out: list[Any] = [None] * g.size
    dist.all_gather_object(out, obj, group=g.cpu_group)
    return out
