"""The host pool's kinds and per-page objects (what a storage tier reads and writes).

Real CPU pools: a write-back fills host pages, `page_object` must show each page of each kind
as one contiguous `[P, L, *item]` run (page_first; `[L, P, *item]` for page_first_direct) equal
to the device tokens, `page_byte_range` must locate it inside the pool's one allocation, and a
page written through the view must load back to the device unchanged (the zero-copy get path).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import HostKVCache, MHATokenToKVPoolHost, MLATokenToKVPoolHost

LAYERS, HEADS, HEAD_DIM = 3, 2, 4
KV_LORA_RANK, ROPE_DIM = 6, 2
PAGE = 4


def make(kind: str, layout: str, device_pages: int = 6, host_pages: int = 5, device: str = "cpu"):
    size = device_pages * PAGE
    if kind == "MHA":
        dev = MHATokenToKVPool(size, PAGE, torch.float32, HEADS, HEAD_DIM, LAYERS, device)
        host = MHATokenToKVPoolHost(dev, host_pages / device_pages, 0, PAGE, layout)
    else:
        dev = MLATokenToKVPool(size, PAGE, torch.float32, KV_LORA_RANK, ROPE_DIM, LAYERS, device)
        host = MLATokenToKVPoolHost(dev, host_pages / device_pages, 0, PAGE, layout)
    gen = torch.Generator().manual_seed(3)
    for buf in dev.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen).to(device))
    for buf in host.kv_buffers:
        buf.fill_(-1.0)
    return dev, host


def slots(pages):
    return (torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_page_object_is_the_device_page_contiguous(kind, layout, device):
    """On CUDA: a registered (pinned) pool written by the `kernel` io backend."""
    dev, host = make(kind, layout, device=device)
    dev_pages, host_pages = [1, 2, 3], [4, 0, 2]
    stream = torch.cuda.Stream() if device == "cuda" else None  # batched copies refuse the legacy stream
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        host.backup_from_device_all_layer(dev, slots(host_pages), slots(dev_pages).to(device), "kernel")
    if stream is not None:
        stream.synchronize()
    names = ["k", "v"] if kind == "MHA" else ["kv"]
    assert [k.name for k in host.kinds] == names
    base = host.buffer.data_ptr()
    region = 0  # each kind's buffer follows the previous one in `buffer`
    for index, ((name, layers), meta) in enumerate(zip(dev.kv_kinds(), host.kinds)):
        assert name == meta.name and host.kind_index(name) == index
        item = tuple(layers[0].shape[1:])
        assert meta.item_shape == item and meta.token_bytes == LAYERS * item[0] * item[1] * 4
        assert meta.page_bytes == PAGE * meta.token_bytes
        for dp, hp in zip(dev_pages, host_pages):
            obj = host.page_object(name, hp)
            token_major = torch.stack([layer[dp * PAGE:(dp + 1) * PAGE].cpu() for layer in layers], dim=1)
            want = token_major if layout == "page_first" else token_major.transpose(0, 1)
            assert obj.is_contiguous() and torch.equal(obj, want), (name, hp)
            assert obj.numel() * obj.element_size() == meta.page_bytes
            assert host.page_byte_range(index, hp) == (region + hp * meta.page_bytes, meta.page_bytes)
            assert obj.data_ptr() == base + region + hp * meta.page_bytes
        untouched = host.page_object(index, 1)
        assert bool((untouched == -1.0).all()), name
        region += host.size * meta.token_bytes
    assert region == host.size_bytes == host.buffer.numel()
    if device == "cuda":
        assert host.pin_memory and all(host.page_object(k.name, 0).is_pinned() for k in host.kinds)
        host.close()


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_page_object_written_in_place_loads_back(kind):
    """A storage read lands in `page_object` views; a load-back then brings exactly that to the device."""
    dev, host = make(kind, "page_first")
    gen = torch.Generator().manual_seed(7)
    stored = {}
    for meta in host.kinds:
        for hp in (3, 1):
            stored[meta.name, hp] = torch.randn((PAGE, LAYERS, *meta.item_shape), generator=gen)
            host.page_object(meta.name, hp).copy_(stored[meta.name, hp])
    dev_pages = [5, 2]
    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, slots([3, 1]), slots(dev_pages), layer, "direct")
    for name, layers in dev.kv_kinds():
        for dp, hp in zip(dev_pages, (3, 1)):
            got = torch.stack([layer[dp * PAGE:(dp + 1) * PAGE] for layer in layers], dim=1)
            assert torch.equal(got, stored[name, hp]), (name, hp)


def test_page_object_errors():
    _, lf = make("MHA", "layer_first")
    with pytest.raises(ValueError, match="layer_first"):
        lf.page_object("k", 0)
    _, host = make("MLA", "page_first")
    with pytest.raises(ValueError, match="unknown KV kind 'k'"):
        host.page_object("k", 0)
    with pytest.raises(ValueError, match="unknown KV kind 1"):
        host.page_byte_range(1, 0)
    with pytest.raises(ValueError, match="host page 5 outside the 5 host pages"):
        host.page_object("kv", 5)
    with pytest.raises(ValueError, match="host page -1"):
        host.page_object(0, -1)


def test_kinds_follow_the_device_pool():
    mha_dev, _ = make("MHA", "page_first")
    mla_dev, mla_host = make("MLA", "page_first")
    with pytest.raises(TypeError, match=r"stores kinds \('kv',\).*has \('k', 'v'\)"):
        MLATokenToKVPoolHost(mha_dev, 1.0, 0, PAGE, "page_first")
    with pytest.raises(ValueError, match="device pool kinds"):
        mla_host.backup_from_device_all_layer(mha_dev, slots([0]), slots([1]), "direct")
    # The base class takes any device pool's kinds.
    generic = HostKVCache(mha_dev, 1.0, 0, PAGE, "page_first")
    assert [k.name for k in generic.kinds] == ["k", "v"] and len(generic.kv_buffers) == 2
