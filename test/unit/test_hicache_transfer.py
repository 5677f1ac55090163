"""Host KV pool and the reference transfers: exact round trips device -> host -> device.

Runs on the CPU with real pools. Page counts sit around the 64-page staging chunk
(one page, just below, exact, one over, a few over, two chunks, two chunks + 1).
Where CUDA is present the same round trips also run with a CUDA device pool
(pinned host pool, `direct` io backend, staging buffers).
"""

from __future__ import annotations

import pytest
import torch

from hiserve.jit_kernel import hicache, reference
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import (
    GB,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    host_memory_reserve_bytes,
    host_pool_slots,
    write_back_staging_bytes,
)

PAGE_COUNTS = [1, 63, 64, 65, 67, 128, 129]
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
PAGE_SIZES = [1, 4, 16]
LAYERS, HEADS, HEAD_DIM = 3, 2, 4
KV_LORA_RANK, ROPE_DIM = 6, 2
SENTINEL = {"K": -7.0, "V": -11.0, "KV": -13.0}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_pools(kind, layout, page_size, device_pages, host_pages, dtype=torch.float32, device="cpu"):
    """A filled device pool and a sentinel-filled host pool of exactly `host_pages` pages."""
    size = device_pages * page_size
    if kind == "MHA":
        dev = MHATokenToKVPool(size, page_size, dtype, HEADS, HEAD_DIM, LAYERS, device)
        host_cls = MHATokenToKVPoolHost
    else:
        dev = MLATokenToKVPool(size, page_size, dtype, KV_LORA_RANK, ROPE_DIM, LAYERS, device)
        host_cls = MLATokenToKVPoolHost
    gen = torch.Generator().manual_seed(page_size * 1000 + device_pages)
    for buf in dev.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    host = host_cls(dev, host_pages / device_pages, 0, page_size, layout)
    assert host.page_num == host_pages
    fill_sentinel(host)
    return dev, host


NAMES = {"k": "K", "v": "V", "kv": "KV"}


def fill_sentinel(host):
    for kind, buf in zip(host.kinds, host.kv_buffers):
        buf.fill_(SENTINEL[NAMES[kind.name]])


def host_bytes(host):
    return torch.cat([b.reshape(-1).view(torch.uint8) for b in host.kv_buffers])


def pages_to_slots(pages, page_size, dtype=torch.int64, device="cpu"):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    return slots.to(dtype=dtype, device=device)


def host_pages_view(host, kind_buf):
    """One kind's host buffer as `[L, host_pages, P, *item]`, by reshaping only (independent of the reference)."""
    p, n = host.page_size, host.page_num
    if host.layout == "layer_first":
        return kind_buf.view(LAYERS, n, p, *kind_buf.shape[2:])
    if host.layout == "page_first":
        v = kind_buf.view(n, p, LAYERS, *kind_buf.shape[2:])
        return v.permute(2, 0, 1, *range(3, v.dim()))
    return kind_buf.transpose(0, 1)


def kinds(dev, host):
    if isinstance(host, MHATokenToKVPoolHost):
        return [("K", dev.k_buffer, host.kv_buffers[0]), ("V", dev.v_buffer, host.kv_buffers[1])]
    return [("KV", dev.kv_buffer, host.kv_buffers[0])]


def pairs(dev, host):
    """The (device layers, host buffer) kinds the transfer functions take."""
    return [(layers, buf) for _, layers, buf in kinds(dev, host)]


def check_host(dev, host, dev_pages, host_pages):
    """Host pages hold the device pages exactly; every other host page still holds the sentinel."""
    p = host.page_size
    untouched = [hp for hp in range(host.page_num) if hp not in set(host_pages)]
    for name, layers, buf in kinds(dev, host):
        src = torch.stack([layer.cpu() for layer in layers])  # [L, device slots, *item]
        src = src.view(LAYERS, -1, p, *src.shape[2:])
        got = host_pages_view(host, buf)
        assert torch.equal(got[:, host_pages], src[:, dev_pages]), name
        assert bool((got[:, untouched] == SENTINEL[name]).all()), name


def round_trip(kind, layout, page_size, num_pages, order, index_dtype, device="cpu", io_backend="kernel",
               dtype=torch.float32):
    # Device pages 1..n hold the data, n+1..2n receive the load-back; host pages 0 and n+1
    # (and beyond) must stay untouched.
    dev, host = make_pools(kind, layout, page_size, 2 * num_pages, num_pages + 2, dtype=dtype, device=device)
    dev_pages = list(range(1, num_pages + 1))
    host_pages = list(range(1, num_pages + 1))
    if order == "reversed":
        host_pages.reverse()
    else:
        host_pages = [host_pages[i] for i in torch.randperm(num_pages, generator=torch.Generator().manual_seed(num_pages))]
    dev_idx = pages_to_slots(dev_pages, page_size, index_dtype, device)
    host_idx = pages_to_slots(host_pages, page_size, index_dtype)

    host.backup_from_device_all_layer(dev, host_idx, dev_idx, io_backend)
    check_host(dev, host, dev_pages, host_pages)

    snapshot = [[t.clone() for t in layers] for _, layers, _ in kinds(dev, host)]
    load_pages = list(range(num_pages + 1, 2 * num_pages + 1))
    load_idx = pages_to_slots(load_pages, page_size, index_dtype, device)
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, host_idx, load_idx, layer, io_backend)
    p = page_size
    for (name, layers, _), before in zip(kinds(dev, host), snapshot):
        for layer in range(LAYERS):
            src = before[layer][p : (num_pages + 1) * p]
            dst = layers[layer][(num_pages + 1) * p : (2 * num_pages + 1) * p]
            assert torch.equal(dst, src), (name, layer)
            assert torch.equal(layers[layer][: (num_pages + 1) * p], before[layer][: (num_pages + 1) * p])
    return dev, host, dev_idx, host_idx


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("num_pages", PAGE_COUNTS)
def test_round_trip(kind, layout, page_size, num_pages):
    order = "reversed" if num_pages % 2 else "shuffled"
    index_dtype = torch.int32 if num_pages in (1, 64, 65, 128) else torch.int64
    round_trip(kind, layout, page_size, num_pages, order, index_dtype)


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_half_dtypes_and_orders(order, index_dtype, dtype):
    for kind in ("MHA", "MLA"):
        for layout in LAYOUTS:
            round_trip(kind, layout, 4, 5, order, index_dtype, dtype=dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_pages", [1, 65, 129])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_round_trip_cuda_direct(kind, layout, num_pages):
    dev, host, _, _ = round_trip(kind, layout, 16, num_pages, "shuffled", torch.int64, device="cuda",
                                 io_backend="direct", dtype=torch.bfloat16)
    assert host.pin_memory and all(b.is_pinned() for b in host.kv_buffers)
    if layout == "page_first":
        assert host.staging_page_capacity == min(host.page_num, 64)
        assert host.staging_buffer_bytes == sum(b.numel() * b.element_size() for b in host.staging_buffers)
        assert host.staging_buffer_bytes > 0
    else:
        assert host.staging_buffer_bytes == 0 and host.staging_buffers == []
    host.close()
    # The kernel IO backend (JIT CUDA kernels, or the reference when they cannot build) round-trips too.
    _, host, _, _ = round_trip(kind, layout, 16, num_pages, "shuffled", torch.int64, device="cuda",
                               io_backend="kernel", dtype=torch.bfloat16)
    host.close()


# ----------------------------------------------------------------------------- staged reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("num_pages", PAGE_COUNTS)
def test_staged_equals_plain_page_first(kind, page_size, num_pages, device):
    dev, plain = make_pools(kind, "page_first", page_size, num_pages + 2, num_pages + 2, device=device)
    _, staged = make_pools(kind, "page_first", page_size, num_pages + 2, num_pages + 2, device=device)
    dev_pages = list(range(2, num_pages + 2))
    host_pages = list(range(num_pages, 0, -1))
    index_dtype = torch.int32 if num_pages == 64 else torch.int64
    dev_idx = pages_to_slots(dev_pages, page_size, index_dtype, device)
    host_idx = pages_to_slots(host_pages, page_size, index_dtype)
    kw = dict(device_indices=dev_idx, host_indices=host_idx, page_size=page_size)

    reference.write_back_all_layer_ref(pairs(dev, plain), "page_first", **kw)
    # Default staging (min(n, 64) pages), then a small explicit one to force many chunks.
    reference.transfer_all_layer_staged_lf_pf_ref(pairs(dev, staged), **kw)
    assert torch.equal(host_bytes(staged), host_bytes(plain))
    fill_sentinel(staged)
    stagings = [torch.empty((3, page_size, LAYERS, *buf.shape[2:]), device=device) for buf in staged.kv_buffers]
    reference.transfer_all_layer_staged_lf_pf_ref(pairs(dev, staged), **kw, stagings=stagings)
    assert torch.equal(host_bytes(staged), host_bytes(plain))
    check_host(dev, plain, dev_pages, host_pages)


def test_staged_rejects_non_page_runs_and_device_host_indices():
    dev, host = make_pools("MLA", "page_first", 4, 4, 4)
    good = pages_to_slots([1, 2], 4)
    bad = torch.tensor([4, 5, 6, 8, 9, 10, 11, 12])  # first page not consecutive
    with pytest.raises(ValueError, match="device_indices must be page-aligned"):
        reference.transfer_all_layer_staged_lf_pf_ref(pairs(dev, host), device_indices=bad, host_indices=good,
                                                      page_size=4)
    with pytest.raises(ValueError, match="staging buffer"):
        reference.transfer_all_layer_staged_lf_pf_ref(pairs(dev, host), device_indices=good, host_indices=good,
                                                      page_size=4, stagings=[torch.empty(2, 4, LAYERS, 1, 3)])


# ----------------------------------------------------------------------------- any kinds


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transfers_loop_over_any_kinds(layout):
    """The public functions take any sequence of (device layers, host buffer) kinds, each with its
    own item shape: here three, as a model with a third stored tensor family would have."""
    page, host_slots, gen = 4, 16, torch.Generator().manual_seed(5)
    items = [(2, 4), (1, 8), (3, 2)]
    layers = [[torch.randn((5 * page, *item), generator=gen) for _ in range(LAYERS)] for item in items]
    hosts = [torch.full(reference.host_kind_shape(layout, host_slots, LAYERS, page, item), -1.0) for item in items]
    kinds = list(zip(layers, hosts))
    dev_idx, host_idx = pages_to_slots([1, 3], page), pages_to_slots([2, 0], page)
    hicache.write_back_all_layer(kinds, layout, device_indices=dev_idx, host_indices=host_idx, page_size=page,
                                 io_backend="kernel")
    back = [[torch.zeros_like(t) for t in kind_layers] for kind_layers in layers]
    for layer in range(LAYERS):
        hicache.load_back_one_layer(list(zip(back, hosts)), layout, layer, host_indices=host_idx,
                                    device_indices=dev_idx, page_size=page, io_backend="direct")
    for kind_layers, kind_back in zip(layers, back):
        for src, dst in zip(kind_layers, kind_back):
            assert torch.equal(dst[dev_idx], src[dev_idx])
            untouched = torch.ones(len(dst), dtype=torch.bool)
            untouched[dev_idx] = False
            assert bool((dst[untouched] == 0).all())
    with pytest.raises(ValueError, match="layer_id=3 out of range"):
        hicache.load_back_one_layer(kinds, layout, LAYERS, host_indices=host_idx, device_indices=dev_idx,
                                    page_size=page, io_backend="direct")


# ----------------------------------------------------------------------------- argument checks


def test_transfer_argument_errors():
    dev, host = make_pools("MHA", "page_first_direct", 4, 4, 4)
    dev_idx = pages_to_slots([1, 2], 4)
    host_idx = pages_to_slots([0, 3], 4)

    def backup(h=host_idx, d=dev_idx, io="kernel"):
        host.backup_from_device_all_layer(dev, h, d, io)

    with pytest.raises(ValueError, match="same length"):
        backup(d=dev_idx[:4])
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        backup(h=host_idx[:3], d=dev_idx[:3])
    with pytest.raises(ValueError, match="page-aligned runs"):
        backup(h=host_idx + 1)
    with pytest.raises(ValueError, match="int32 or int64"):
        backup(h=host_idx.to(torch.int16))
    with pytest.raises(ValueError, match="unknown io_backend"):
        backup(io="dma")
    with pytest.raises(ValueError, match="layer_id=3 out of range"):
        host.load_to_device_per_layer(dev, host_idx, dev_idx, LAYERS, "kernel")
    with pytest.raises(ValueError, match="host dtype"):
        hicache.write_back_all_layer([(dev.k_buffer, host.kv_buffers[0]), (dev.v_buffer, host.kv_buffers[1].double())],
                                     "page_first_direct", device_indices=dev_idx, host_indices=host_idx,
                                     page_size=4, io_backend="direct")
    with pytest.raises(ValueError, match="does not match layout"):
        hicache.write_back_all_layer(pairs(dev, host), "page_first", device_indices=dev_idx,
                                     host_indices=host_idx, page_size=4, io_backend="direct")
    with pytest.raises(ValueError, match="unknown host layout"):
        reference.write_back_all_layer_ref(pairs(dev, host), "page_head", device_indices=dev_idx,
                                           host_indices=host_idx, page_size=4)


# ----------------------------------------------------------------------------- allocator


def test_host_allocator_pages_sorted_and_lazy_merge():
    _, host = make_pools("MHA", "page_first", 4, 8, 6)
    assert host.available_size() == 24
    a = host.alloc(8)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    assert a.tolist() == list(range(0, 8))
    b = host.alloc(12)
    assert b.tolist() == list(range(8, 20))
    assert host.alloc(8) is None  # one page left; nothing taken
    assert host.available_size() == 4
    host.free(b[4:8])  # page 3
    host.free(a)  # pages 0, 1
    assert host.available_size() == 16
    c = host.alloc(16)  # merge: sorted free pages 0, 1, 3, 5
    assert c.tolist() == list(range(0, 8)) + list(range(12, 16)) + list(range(20, 24))
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        host.alloc(6)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        host.free(c[:3])
    host.clear()
    assert host.available_size() == 24
    assert host.alloc(0).numel() == 0


# ----------------------------------------------------------------------------- sizing


def test_sizing_ratio_rounds_down_to_pages():
    dev = MHATokenToKVPool(100, 16, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu")
    host = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first")
    assert host.size == 192 and host.page_num == 12  # int(200) rounded down to 16
    per_token = 2 * HEADS * HEAD_DIM * LAYERS * 2
    assert host.get_size_per_token_bytes() == per_token
    assert host.size_bytes == 192 * per_token == sum(b.numel() * b.element_size() for b in host.kv_buffers)
    assert host.size_bytes == host.buffer.numel()
    assert [b.shape for b in host.kv_buffers] == [(192, LAYERS, HEADS, HEAD_DIM)] * 2
    # K then V, back to back in the one allocation.
    k, v = host.kv_buffers
    assert k.data_ptr() == host.buffer.data_ptr() and v.data_ptr() == k.data_ptr() + k.numel() * k.element_size()
    assert [(kd.name, kd.item_shape, kd.token_bytes) for kd in host.kinds] == [
        ("k", (HEADS, HEAD_DIM), per_token // 2), ("v", (HEADS, HEAD_DIM), per_token // 2)]
    assert not host.pin_memory and host.staging_buffer_bytes == 0 and host.staging_page_capacity == 0

    mla_dev = MLATokenToKVPool(64, 4, torch.float32, KV_LORA_RANK, ROPE_DIM, LAYERS, "cpu")
    mla = MLATokenToKVPoolHost(mla_dev, 1.5, 0, 4, "page_first_direct")
    assert mla.size == 96 and mla.get_size_per_token_bytes() == (KV_LORA_RANK + ROPE_DIM) * LAYERS * 4
    assert [b.shape for b in mla.kv_buffers] == [(24, LAYERS, 4, 1, KV_LORA_RANK + ROPE_DIM)]
    assert [k.name for k in mla.kinds] == ["kv"] and mla.kinds[0].page_bytes == 4 * mla.get_size_per_token_bytes()
    lf = MLATokenToKVPoolHost(mla_dev, 1.5, 0, 4, "layer_first")
    assert [b.shape for b in lf.kv_buffers] == [(LAYERS, 96, 1, KV_LORA_RANK + ROPE_DIM)]
    mha_pfd = MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first_direct")
    assert [b.shape for b in mha_pfd.kv_buffers] == [(12, LAYERS, 16, HEADS, HEAD_DIM)] * 2


def test_sizing_hicache_size_overrides_ratio():
    per_token = 2 * 8 * 128 * 32 * 2  # Llama-8B-like, bf16: 128 KiB per token
    assert host_pool_slots(per_token, 64, 1000, 2.0, 10) == (10 * GB // per_token) // 64 * 64
    assert host_pool_slots(per_token, 1, 1000, 2.0, 0) == 2000
    assert host_pool_slots(per_token, 64, 1000, 2.5, 0) == 2496
    with pytest.raises(ValueError, match="less than one host page"):
        host_pool_slots(per_token, 64, 10, 2.0, 0)


def test_sizing_refuses_more_than_host_memory():
    dev = MHATokenToKVPool(64, 16, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu")
    with pytest.raises(ValueError, match=r"--hicache-size 10000.*\d+ bytes.*GB.*lower --hicache-size or --hicache-ratio"):
        MHATokenToKVPoolHost(dev, 2.0, 10000, 16, "page_first")
    with pytest.raises(ValueError, match="--hicache-ratio"):
        MHATokenToKVPoolHost(dev, 1e12, 0, 16, "page_first")


def test_reserve_and_staging_bytes():
    gib = 1 << 30
    assert host_memory_reserve_bytes(8 * gib) == 2 * gib
    assert host_memory_reserve_bytes(64 * gib) == 64 * gib // 10
    assert host_memory_reserve_bytes(1024 * gib) == 10 * gib
    cuda = torch.device("cuda")
    # Llama-8B-like at page_size 64: 2 x 64 pages x 64 tokens x 32 layers x 2 KiB = 512 MiB.
    assert write_back_staging_bytes("page_first", cuda, None, 64, 32, 2048, 2) == 512 * (1 << 20)
    assert write_back_staging_bytes("page_first", cuda, 10, 64, 32, 2048, 2) == 10 * 64 * 32 * 2048 * 2
    assert write_back_staging_bytes("page_first_direct", cuda, None, 64, 32, 2048, 2) == 0
    assert write_back_staging_bytes("page_first", torch.device("cpu"), None, 64, 32, 2048, 2) == 0


def test_pool_argument_errors():
    dev = MHATokenToKVPool(64, 16, torch.float32, HEADS, HEAD_DIM, LAYERS, "cpu")
    with pytest.raises(ValueError, match="unknown host layout"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_head")
    with pytest.raises(ValueError, match="page_size"):
        MHATokenToKVPoolHost(dev, 2.0, 0, 8, "page_first")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            MHATokenToKVPoolHost(dev, 2.0, 0, 16, "page_first", pin_memory=True)
