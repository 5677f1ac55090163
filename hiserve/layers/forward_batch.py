"""What one forward pass needs to know about its batch.

`ForwardBatch` lives under `layers/` (not `engine/`) so that models and attention
backends can read it without importing the scheduler: imports point downward.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from hiserve.mem_cache.allocator import ReqToTokenPool
    from hiserve.mem_cache.memory_pool import KVCache


class ForwardMode(IntEnum):
    """EXTEND runs new prompt tokens (prefill, or a prefill chunk after a cached
    prefix); DECODE runs exactly one new token per request."""

    EXTEND = 1
    DECODE = 2

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Tensors and host-side lengths of one forward pass.

    T is the number of new tokens in the pass, B the number of requests.
    Tokens of request i occupy a contiguous run of the T axis, in request order.

    Attributes:
        forward_mode: EXTEND or DECODE.
        batch_size: B.
        input_ids: [T] int64, new token ids.
        positions: [T] int64, absolute position of each new token.
        out_cache_loc: [T] int64, KV slot of each new token in the device pool.
        req_pool_indices: [B] int64, row of each request in `req_to_token`.
        seq_lens: [B] int64, tokens with KV after this pass (prefix + new).
        seq_lens_cpu: the same, as a Python list.
        extend_seq_lens_cpu: new tokens per request (all 1 for DECODE).
        extend_prefix_lens_cpu: tokens whose KV already exists per request
            (`seq_lens - extend_seq_lens`).
        req_to_token_pool: maps (request row, position) to KV slot.
        token_to_kv_pool: the device KV pool (MHA or MLA).
        attn_backend: the attention backend that runs this pass; it keeps its
            per-batch metadata on itself (`init_forward_metadata`).
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "KVCache"
    attn_backend: Any
    # Prompt logprobs: T-axis rows whose logits the logits processor also returns (in
    # `input_logits`, [len(rows), V] float32); None for passes where no request asks.
    input_logprob_rows: Optional[torch.Tensor] = None
    input_logits: Optional[torch.Tensor] = None
    # EXTEND under a CUDA graph: [B] int64 T-axis row of each request's last new token, a
    # static buffer (the logits processor otherwise builds it from extend_seq_lens_cpu, a
    # host-to-device copy a graph cannot hold).
    last_token_index: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
