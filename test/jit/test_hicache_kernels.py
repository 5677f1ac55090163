"""CUDA KV-transfer kernels against the torch reference (`torch.equal`, byte for byte).

Covers the staged write-back (relayout + copy engine; batched and per-page copies each
forced), the per-layer load-back kernel from every host layout, the all-layer SM
write-back kernel, and the `kernel` io backend through the real pools. Page counts sit
around the 64-page staging chunk; MHA items of 128..1024 bf16 elements plus an odd
144-byte one (72 elements: 16-byte aligned, not 128-byte aligned), MLA 576; host pages
reversed, shuffled and contiguous; host pages next to the written ones hold sentinels that
must survive; int32 and int64 indices.

Skipped without CUDA or apache-tvm-ffi. The first test compiles the kernels (tens of seconds).
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
pytest.importorskip("tvm_ffi")

from hiserve.jit_kernel import hicache, reference, utils  # noqa: E402
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost  # noqa: E402

PAGE_COUNTS = [1, 63, 64, 65, 67, 128, 129]
MHA_ELEMENTS = [128, 256, 512, 1024, 72]  # H*Dh bf16 elements per token and layer; 72 -> 144 bytes
MLA_ELEMENTS = 576  # kv_lora_rank 512 + rope 64
LAYERS = 3
PAGE_SIZE = 16
CAPACITY = 64  # staging pages, as the host pool allocates
SENTINEL = {"K": -7.0, "V": -11.0, "KV": -13.0}
DTYPE = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    if not utils.can_use_jit_kernels():
        pytest.skip(f"JIT kernels unavailable: {utils.jit_unavailable_reason()}")
    utils.load_kvcacheio_module()


def item_shape(elements: int, mla: bool = False) -> tuple[int, int]:
    if mla:
        return (1, elements)
    return (elements // 128, 128) if elements % 128 == 0 else (1, elements)


def device_layers(slots: int, item, seed: int, num_layers: int = LAYERS):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn((slots, *item), generator=gen, device="cuda").to(DTYPE) for _ in range(num_layers)]


def pinned_host(layout, host_slots, item, name, page_size=PAGE_SIZE, num_layers=LAYERS):
    shape = reference.host_kind_shape(layout, host_slots, num_layers, page_size, item)
    return torch.full(shape, SENTINEL[name], dtype=DTYPE).pin_memory()


def slots_of(pages, page_size, dtype, device="cpu"):
    offsets = torch.arange(page_size, dtype=torch.int64)
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + offsets).reshape(-1).to(dtype).to(device)


def host_pages_for(num_pages: int, order: str) -> list[int]:
    pages = list(range(1, num_pages + 1))  # page 0 and page n+1 stay untouched
    if order == "reversed":
        return pages[::-1]
    if order == "shuffled":
        perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(num_pages))
        return [pages[i] for i in perm]
    return pages


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def run_on_side_stream(fn):
    """cudaMemcpyBatchAsync refuses the legacy default stream: run on a side stream, then wait."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn()
    stream.synchronize()
    return out


def test_batched_copy_is_usable_here():
    info = utils.batch_copy_info()
    assert info["compiled_runtime"] >= utils.BATCHED_COPY_MIN_CUDA_VERSION, info
    assert info["usable"] == 1, info
    assert utils.can_use_batched_copy()


# ----------------------------------------------------------------------------- staged write-back


def staged_case(kind, elements, num_pages, order, copy_mode, dev_dtype, host_dtype, *, page_size=PAGE_SIZE,
                capacity=CAPACITY, merge_runs=True, sort_pages=True, pipeline=True):
    mla = kind == "MLA"
    item = item_shape(elements, mla)
    names = ["KV"] if mla else ["K", "V"]
    dev_pages = list(range(2, num_pages + 2))[::-1] if order == "reversed" else list(range(2, num_pages + 2))
    layers = [device_layers((num_pages + 3) * page_size, item, seed=num_pages * 7 + i) for i in range(len(names))]
    host_slots = (num_pages + 2) * page_size
    expected = [pinned_host("page_first", host_slots, item, n, page_size) for n in names]
    actual = [pinned_host("page_first", host_slots, item, n, page_size) for n in names]
    dev_idx = slots_of(dev_pages, page_size, dev_dtype, "cuda")
    host_idx = slots_of(host_pages_for(num_pages, order), page_size, host_dtype)
    kw = dict(device_indices=dev_idx, host_indices=host_idx, page_size=page_size)
    stagings = [torch.empty((capacity, page_size, LAYERS, *item), dtype=DTYPE, device="cuda") for _ in names]

    # The reference, one kind at a time: the oracle per kind.
    for kind_layers, want in zip(layers, expected):
        reference.write_back_all_layer_ref([(kind_layers, want)], "page_first", **kw)
    opts = dict(copy_mode=copy_mode, merge_runs=merge_runs, sort_pages=sort_pages, pipeline=pipeline)
    stats = run_on_side_stream(lambda: hicache.transfer_hicache_all_layer_staged_lf_pf(
        layers, actual, stagings, **opts, **kw))
    for name, got, want in zip(names, actual, expected):
        assert same_bytes(got, want), name
        # Untouched host pages (0 and n+1) keep their sentinel.
        assert bool((got[:page_size] == SENTINEL[name]).all()), name
        assert bool((got[(num_pages + 1) * page_size:] == SENTINEL[name]).all()), name
    per_chunk = capacity // 2 if pipeline and capacity >= 2 and num_pages > capacity else capacity
    assert stats.pages_per_chunk == per_chunk
    chunks = math.ceil(num_pages / per_chunk)
    assert stats.chunks == chunks
    if copy_mode == "batch":
        assert stats.batched_chunks == chunks
    elif copy_mode == "per_page":
        assert stats.batched_chunks == 0
    return stats


@pytest.mark.parametrize("copy_mode", ["batch", "per_page"])
@pytest.mark.parametrize("elements", MHA_ELEMENTS)
@pytest.mark.parametrize("num_pages", PAGE_COUNTS)
def test_staged_mha(num_pages, elements, copy_mode):
    order = "reversed" if num_pages % 2 else "shuffled"
    dev_dtype = torch.int32 if num_pages in (64, 65, 128) else torch.int64
    host_dtype = torch.int64 if dev_dtype == torch.int32 else torch.int32
    staged_case("MHA", elements, num_pages, order, copy_mode, dev_dtype, host_dtype)


@pytest.mark.parametrize("copy_mode", ["batch", "per_page", "auto"])
@pytest.mark.parametrize("num_pages", PAGE_COUNTS)
def test_staged_mla(num_pages, copy_mode):
    order = "shuffled" if num_pages % 2 else "reversed"
    dtype = torch.int64 if num_pages in (64, 65, 128) else torch.int32
    staged_case("MLA", MLA_ELEMENTS, num_pages, order, copy_mode, dtype, dtype)


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("sort_pages", [True, False])
@pytest.mark.parametrize("num_pages", PAGE_COUNTS)
def test_staged_unsorted_and_unpipelined(num_pages, sort_pages, pipeline):
    for copy_mode in ("batch", "per_page"):
        staged_case("MHA", 512, num_pages, "shuffled", copy_mode, torch.int32, torch.int64, sort_pages=sort_pages,
                    pipeline=pipeline)


@pytest.mark.parametrize("copy_mode", ["batch", "per_page"])
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_staged_merges_consecutive_host_pages(kind, copy_mode):
    kinds = 1 if kind == "MLA" else 2
    elements = MLA_ELEMENTS if kind == "MLA" else 256
    # 129 pages in 32-page chunks (pipelined halves of the 64-page staging buffer): 5 chunks.
    for order in ("contiguous", "reversed", "shuffled"):  # one contiguous run of host pages, in any order
        stats = staged_case(kind, elements, 129, order, copy_mode, torch.int64, torch.int64)
        assert stats.chunks == 5 and stats.copies == kinds * 5, order
    stats = staged_case(kind, elements, 129, "contiguous", copy_mode, torch.int32, torch.int64, merge_runs=False)
    assert stats.copies == kinds * 129
    stats = staged_case(kind, elements, 65, "reversed", copy_mode, torch.int64, torch.int64, sort_pages=False)
    assert stats.copies == kinds * 65  # staged in the given (reversed) order, nothing merges
    stats = staged_case(kind, elements, 65, "contiguous", copy_mode, torch.int64, torch.int64, pipeline=False)
    assert stats.chunks == 2 and stats.copies == kinds * 2


@pytest.mark.parametrize("page_size", [1, 4, 64])
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_staged_page_sizes_and_small_staging(kind, page_size):
    elements = MLA_ELEMENTS if kind == "MLA" else 1024
    for copy_mode in ("batch", "per_page"):
        staged_case(kind, elements, 11, "shuffled", copy_mode, torch.int64, torch.int32, page_size=page_size,
                    capacity=3)


def test_staged_on_default_stream_falls_back_or_refuses():
    item = item_shape(512)
    layers = device_layers(4 * PAGE_SIZE, item, seed=3)
    host = pinned_host("page_first", 4 * PAGE_SIZE, item, "KV")
    want = host.clone()
    dev_idx = slots_of([1, 2], PAGE_SIZE, torch.int64, "cuda")
    host_idx = slots_of([2, 0], PAGE_SIZE, torch.int64)
    kw = dict(device_indices=dev_idx, host_indices=host_idx, page_size=PAGE_SIZE)
    reference.write_back_all_layer_ref([(layers, want)], "page_first", **kw)
    assert torch.cuda.current_stream().cuda_stream == 0
    stats = hicache.transfer_hicache_all_layer_staged_lf_pf([layers], [host], None, **kw)
    torch.cuda.synchronize()
    assert stats.batched_chunks == 0 and same_bytes(host, want)
    with pytest.raises(RuntimeError, match="cudaMemcpyBatchAsync"):
        hicache.transfer_hicache_all_layer_staged_lf_pf([layers], [host], None, copy_mode="batch", **kw)


def test_staged_rejects_bad_arguments():
    item = item_shape(256)
    layers = device_layers(4 * PAGE_SIZE, item, seed=5)
    host = pinned_host("page_first", 4 * PAGE_SIZE, item, "K")
    dev_idx = slots_of([1], PAGE_SIZE, torch.int64, "cuda")
    host_idx = slots_of([2], PAGE_SIZE, torch.int64)
    call = hicache.transfer_hicache_all_layer_staged_lf_pf
    with pytest.raises(ValueError, match="host_indices must stay on the CPU"):
        call([layers, layers], [host, host], None, device_indices=dev_idx, host_indices=host_idx.cuda(),
             page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="pinned"):
        call([layers, layers], [host.clone(), host], None, device_indices=dev_idx, host_indices=host_idx,
             page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="inside the 64 host slots; page 0 is"):
        call([layers, layers], [host, host], None, device_indices=dev_idx,
             host_indices=slots_of([4], PAGE_SIZE, torch.int64), page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="page-aligned"):
        call([layers, layers], [host, host], None, device_indices=dev_idx, host_indices=host_idx + 1,
             page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="copy_mode"):
        call([layers, layers], [host, host], None, device_indices=dev_idx, host_indices=host_idx,
             page_size=PAGE_SIZE, copy_mode="fast")
    odd = device_layers(4 * PAGE_SIZE, (1, 4), seed=6)  # 8-byte items
    odd_host = torch.zeros((4 * PAGE_SIZE, LAYERS, 1, 4), dtype=DTYPE).pin_memory()
    with pytest.raises(ValueError, match="multiple of 16"):
        call([odd, odd], [odd_host, odd_host], None, device_indices=dev_idx, host_indices=host_idx,
             page_size=PAGE_SIZE)


# ----------------------------------------------------------------------------- SM-kernel transfers


SM_CASES = [(n, e) for n in (1, 64, 65, 129) for e in (128, 1024, 72)] + [(67, MLA_ELEMENTS), (128, MLA_ELEMENTS)]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", reference.LAYOUTS)
@pytest.mark.parametrize("num_pages,elements", SM_CASES)
def test_load_back_one_layer(num_pages, elements, layout, index_dtype):
    mla = elements == MLA_ELEMENTS
    item = item_shape(elements, mla)
    names = ["KV"] if mla else ["K", "V"]
    host_slots = (num_pages + 2) * PAGE_SIZE
    gen = torch.Generator().manual_seed(num_pages + elements)
    hosts = [torch.randn(reference.host_kind_shape(layout, host_slots, LAYERS, PAGE_SIZE, item), generator=gen)
             .to(DTYPE).pin_memory() for _ in names]
    order = "reversed" if num_pages % 2 else "shuffled"
    host_idx = slots_of(host_pages_for(num_pages, order), PAGE_SIZE, index_dtype)
    dev_idx = slots_of(list(range(num_pages + 1, 1, -1)), PAGE_SIZE, index_dtype, "cuda")
    dev_slots = (num_pages + 3) * PAGE_SIZE
    for layer_id in range(LAYERS):
        want = [torch.full((dev_slots, *item), SENTINEL[n], dtype=DTYPE, device="cuda") for n in names]
        got = [w.clone() for w in want]
        kw = dict(host_indices=host_idx, device_indices=dev_idx, page_size=PAGE_SIZE)
        # The reference takes every layer of a kind; only `layer_id` is written.
        reference.load_back_one_layer_ref([([w] * LAYERS, h) for w, h in zip(want, hosts)], layout, layer_id, **kw)
        if not mla:
            # Host indices already on the device work too.
            kw["host_indices"] = host_idx.cuda() if layer_id == 1 else host_idx
        hicache.transfer_hicache_one_layer(hosts, got, layout, layer_id, **kw)
        torch.cuda.synchronize()
        for name, g, w in zip(names, got, want):
            assert same_bytes(g, w), (name, layer_id)


@pytest.mark.parametrize("block_quota", [1, 4])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", reference.LAYOUTS)
@pytest.mark.parametrize("num_pages,elements", SM_CASES)
def test_all_layer_sm_write_back(num_pages, elements, layout, index_dtype, block_quota):
    mla = elements == MLA_ELEMENTS
    item = item_shape(elements, mla)
    names = ["KV"] if mla else ["K", "V"]
    kinds = [device_layers((num_pages + 3) * PAGE_SIZE, item, seed=num_pages + i) for i in range(len(names))]
    host_slots = (num_pages + 2) * PAGE_SIZE
    want = [pinned_host(layout, host_slots, item, n) for n in names]
    got = [pinned_host(layout, host_slots, item, n) for n in names]
    order = "shuffled" if num_pages % 2 else "reversed"
    host_idx = slots_of(host_pages_for(num_pages, order), PAGE_SIZE, index_dtype)
    dev_idx = slots_of(list(range(2, num_pages + 2)), PAGE_SIZE, index_dtype, "cuda")
    kw = dict(device_indices=dev_idx, host_indices=host_idx, page_size=PAGE_SIZE)
    for layers, w in zip(kinds, want):
        reference.write_back_all_layer_ref([(layers, w)], layout, **kw)
    hicache.transfer_hicache_all_layer(kinds, got, layout, block_quota=block_quota, **kw)
    torch.cuda.synchronize()
    for name, g, w in zip(names, got, want):
        assert same_bytes(g, w), name


def test_sm_kernels_reject_bad_arguments():
    item = item_shape(128)
    layers = device_layers(4 * PAGE_SIZE, item, seed=9)
    host = pinned_host("layer_first", 4 * PAGE_SIZE, item, "K")
    idx = slots_of([1], PAGE_SIZE, torch.int64)
    kw = dict(host_indices=idx, device_indices=idx.cuda(), page_size=PAGE_SIZE)
    with pytest.raises(ValueError, match="block_quota"):
        hicache.transfer_hicache_one_layer([host, host], layers[:2], "layer_first", 0, block_quota=0, **kw)
    with pytest.raises(ValueError, match="layer_id"):
        hicache.transfer_hicache_one_layer([host, host], layers[:2], "layer_first", LAYERS, **kw)
    with pytest.raises(ValueError, match="give 1 to 2 kinds"):
        hicache.transfer_hicache_one_layer([host] * 3, layers, "layer_first", 0, **kw)
    with pytest.raises(ValueError, match="unknown host layout"):
        hicache.transfer_hicache_all_layer([layers, layers], [host, host], "head_first", **kw)
    with pytest.raises(ValueError, match="device_indices must be on"):
        hicache.transfer_hicache_all_layer([layers, layers], [host, host], "layer_first", host_indices=idx,
                                           device_indices=idx, page_size=PAGE_SIZE)


# ----------------------------------------------------------------------------- through the pools


def make_pools(kind, layout, page_size, device_pages, host_pages, elements):
    size = device_pages * page_size
    if kind == "MHA":
        heads, head_dim = item_shape(elements)
        dev = MHATokenToKVPool(size, page_size, DTYPE, heads, head_dim, LAYERS, "cuda")
        host_cls = MHATokenToKVPoolHost
    else:
        dev = MLATokenToKVPool(size, page_size, DTYPE, elements - 64, 64, LAYERS, "cuda")
        host_cls = MLATokenToKVPoolHost
    gen = torch.Generator(device="cuda").manual_seed(page_size + device_pages)
    for buf in dev.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen, device="cuda").to(DTYPE))
    host = host_cls(dev, (host_pages + 0.5) / device_pages, 0, page_size, layout)
    assert host.page_num == host_pages
    return dev, host


@pytest.mark.parametrize("layout", reference.LAYOUTS)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_kernel_io_backend_round_trip_through_pools(kind, layout):
    """Registered (cudaHostRegister) host pools, the dispatcher, write-back then load-back."""
    num_pages, page_size = 67, 16
    elements = 1024 if kind == "MHA" else MLA_ELEMENTS
    dev, host = make_pools(kind, layout, page_size, 2 * num_pages + 1, num_pages + 2, elements)
    ref_dev, ref_host = make_pools(kind, layout, page_size, 2 * num_pages + 1, num_pages + 2, elements)
    for a, b in zip(ref_dev.buffers(), dev.buffers()):
        a.copy_(b)
    for buf in host.kv_buffers + ref_host.kv_buffers:
        buf.fill_(-3.0)
    host_idx = slots_of(host_pages_for(num_pages, "shuffled"), page_size, torch.int64)
    dev_idx = slots_of(list(range(1, num_pages + 1)), page_size, torch.int32, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.backup_from_device_all_layer(dev, host_idx, dev_idx, "kernel")
    stream.synchronize()
    ref_host.backup_from_device_all_layer(ref_dev, host_idx, dev_idx, "direct")
    for got, want in zip(host.kv_buffers, ref_host.kv_buffers):
        assert same_bytes(got, want)

    load_idx = slots_of(list(range(num_pages + 1, 2 * num_pages + 1)), page_size, torch.int64, "cuda")
    with torch.cuda.stream(stream):
        for layer in range(LAYERS):
            host.load_to_device_per_layer(dev, host_idx, load_idx, layer, "kernel")
    stream.synchronize()
    for layer in range(LAYERS):
        ref_host.load_to_device_per_layer(ref_dev, host_idx, load_idx, layer, "direct")
    torch.cuda.synchronize()
    for a, b in zip(dev.buffers(), ref_dev.buffers()):
        assert same_bytes(a, b)
    host.close()
    ref_host.close()
