"""Triton attention kernels over the paged device pool (read through `req_to_token`).

- `decode_attention_fwd`: one new token per request, split-KV, CUDA-graph friendly
  (grid fixed by batch size, heads and `num_kv_splits`; scratch from `alloc_decode_scratch`).
- `extend_attention_fwd`: prefill / chunked prefill after a cached prefix, causal.

Both take MHA, GQA and MQA (MLA's absorbed form: Hkv = 1, Dk = r + rope, Dv = r).
Importing this package needs triton; `TRITON_INTERPRET=1` in the environment before
the import runs the kernels on CPU tensors through Triton's interpreter.
"""

from hiserve.layers.attention.triton_ops.decode_attention import alloc_decode_scratch, decode_attention_fwd
from hiserve.layers.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["alloc_decode_scratch", "decode_attention_fwd", "extend_attention_fwd"]
