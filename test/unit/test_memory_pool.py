"""Device KV pools (MHA, MLA) on CPU tensors."""

import pytest
import torch

from hiserve.mem_cache.allocator import TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool


class RecordingCounter:
    """A layer transfer counter that remembers which layers were waited on."""

    def __init__(self) -> None:
        self.waited: list[int] = []

    def wait_until(self, layer_id: int) -> None:
        self.waited.append(layer_id)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mha_shapes_and_sizes(page_size):
    size, H, D, L = 32, 2, 8, 3
    pool = MHATokenToKVPool(size, page_size, torch.bfloat16, head_num=H, head_dim=D, layer_num=L,
                            device="cpu")
    assert len(pool.k_buffer) == len(pool.v_buffer) == L
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape == (size + page_size, H, D)
        assert buf.dtype == torch.bfloat16
    assert pool.item_bytes == H * D * 2
    assert pool.get_kv_size_bytes() == 2 * L * (size + page_size) * H * D * 2
    assert MHATokenToKVPool.cell_size_bytes(H, D, L, torch.bfloat16) == 2 * H * D * L * 2
    assert pool.k_data_ptrs.dtype == torch.uint64 and pool.k_data_ptrs.shape == (L,)
    assert pool.data_ptrs.shape == (2 * L,)
    ptrs, lens_bytes, item_bytes = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]
    assert ptrs[0] == int(pool.k_data_ptrs[0])
    assert lens_bytes == [(size + page_size) * H * D * 2] * (2 * L)
    assert item_bytes == [H * D * 2] * (2 * L)


def test_mha_set_and_get_casts_to_pool_dtype():
    H, D = 2, 4
    pool = MHATokenToKVPool(16, 1, torch.float16, H, D, layer_num=2, device="cpu")
    allocator = TokenToKVPoolAllocator(16, 1, "cpu", pool)
    loc = allocator.alloc(3)
    k = torch.randn(3, H, D, dtype=torch.float32)
    v = torch.randn(3, H, D, dtype=torch.float32)
    pool.set_kv_buffer(1, loc, k, v)
    k_buf, v_buf = pool.get_kv_buffer(1)
    assert torch.equal(k_buf[loc], k.half())
    assert torch.equal(pool.get_value_buffer(1)[loc], v.half())
    assert torch.equal(pool.get_key_buffer(1)[loc], k.half())
    assert k_buf[0].abs().sum() == 0  # padding slot untouched
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layer untouched
    with pytest.raises(ValueError):
        pool.set_kv_buffer(0, loc, k, None)


def test_layer_transfer_counter_is_waited_on():
    pool = MHATokenToKVPool(8, 1, torch.float32, 1, 4, layer_num=3, device="cpu")
    counter = RecordingCounter()
    pool.register_layer_transfer_counter(counter)
    pool.get_key_buffer(0)
    pool.get_value_buffer(1)
    pool.get_kv_buffer(2)
    assert counter.waited == [0, 1, 2]

    mla = MLATokenToKVPool(8, 1, torch.float32, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=2, device="cpu")
    mla.register_layer_transfer_counter(counter)
    mla.get_key_buffer(1)
    mla.get_value_buffer(0)
    mla.get_kv_buffer(1)
    assert counter.waited == [0, 1, 2, 1, 0, 1]


@pytest.mark.parametrize("page_size", [1, 4])
def test_mla_shapes_and_set_get(page_size):
    size, rank, rope, L = 16, 8, 4, 2
    pool = MLATokenToKVPool(size, page_size, torch.bfloat16, rank, rope, L, "cpu")
    assert len(pool.kv_buffer) == L
    assert pool.kv_buffer[0].shape == (size + page_size, 1, rank + rope)
    assert pool.item_bytes == (rank + rope) * 2
    assert pool.get_kv_size_bytes() == L * (size + page_size) * (rank + rope) * 2
    assert MLATokenToKVPool.cell_size_bytes(rank, rope, L, torch.bfloat16) == (rank + rope) * L * 2
    assert pool.data_ptrs.shape == (L,) and pool.data_ptrs.dtype == torch.uint64
    ptrs, _, item_bytes = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer]
    assert item_bytes == [pool.item_bytes] * L

    loc = torch.tensor([page_size, page_size + 2])
    nope = torch.randn(2, 1, rank)
    rope_part = torch.randn(2, 1, rope)
    pool.set_mla_kv_buffer(1, loc, nope, rope_part)
    key = pool.get_key_buffer(1)
    value = pool.get_value_buffer(1)
    assert value.shape == (size + page_size, 1, rank)
    assert value.data_ptr() == key.data_ptr()  # a view, not a copy
    assert torch.equal(key[loc], torch.cat([nope, rope_part], -1).bfloat16())
    assert torch.equal(value[loc], nope.bfloat16())

    whole = torch.randn(2, 1, rank + rope)
    pool.set_kv_buffer(0, loc, whole)
    k0, v0 = pool.get_kv_buffer(0)
    assert torch.equal(k0[loc], whole.bfloat16())
    assert torch.equal(v0[loc], whole[..., :rank].bfloat16())
