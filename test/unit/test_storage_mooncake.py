"""The `mooncake` storage backend against a real `mooncake_master` on loopback (TCP).

Real page-first host pools (MHA: K and V objects per page; MLA: one): pages written with
`batch_set_from` come back byte-equal through `batch_get_into` into other host pages;
`batch_exists` counts leading pages only; two clients (two replicas' host pools) share one
master; a killed master makes every call a counted miss within a bounded time, without an
exception, and a restarted one serves again through the same client objects; a master that
is not there at start is connected to later.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from mooncake_fixture import MooncakeMaster, free_port, mooncake_unavailable

from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hiserve.mem_cache.storage import create_storage
from hiserve.mem_cache.storage.keys import page_keys, storage_namespace
from hiserve.mem_cache.storage.mooncake_backend import MooncakeStore, MooncakeStoreConfig, parse_size

SKIP = mooncake_unavailable()
needs_mooncake = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4
HOST_PAGES = 10
LEASE_TTL_MS = 1000  # short read leases, so clear() can remove what a test has just read
DEAD_CALL_S = 15.0  # bound on one call while the master is dead (observed ~4.5 s at worst)


def host_pool(kind: str, seed: int):
    """A page-first float32 host pool of HOST_PAGES random pages."""
    if kind == "MHA":
        dev = MHATokenToKVPool(2 * PAGE, PAGE, torch.float32, HEADS, HEAD_DIM, LAYERS, "cpu")
        host = MHATokenToKVPoolHost(dev, HOST_PAGES / 2, 0, PAGE, "page_first")
    else:
        dev = MLATokenToKVPool(2 * PAGE, PAGE, torch.float32, 6, 2, LAYERS, "cpu")
        host = MLATokenToKVPoolHost(dev, HOST_PAGES / 2, 0, PAGE, "page_first")
    gen = torch.Generator().manual_seed(seed)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8, generator=gen))
    return host


def namespace(host) -> str:
    return storage_namespace("test-model", "float32", PAGE, host.layout,
                             [(k.name, k.item_shape) for k in host.kinds], LAYERS, extra=str(time.time_ns()))


def page_bytes(host, kind: str, page: int) -> torch.Tensor:
    """The raw bytes of one page object (random bytes include NaN floats, which never compare equal)."""
    return host.page_object(kind, page).view(torch.uint8)


def pages_of(host, pages: list[int]) -> list[dict[str, torch.Tensor]]:
    return [{k.name: page_bytes(host, k.name, p).clone() for k in host.kinds} for p in pages]


def assert_pages_equal(host, pages: list[int], want: list[dict[str, torch.Tensor]]) -> None:
    for p, expected in zip(pages, want):
        for name, tensor in expected.items():
            assert torch.equal(page_bytes(host, name, p), tensor), (p, name)


def tokens(n_pages: int, seed: int) -> list[int]:
    return torch.randint(0, 50000, (n_pages * PAGE,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def master():
    if SKIP:
        pytest.skip(SKIP)
    m = MooncakeMaster(lease_ttl_ms=LEASE_TTL_MS).start()
    yield m
    m.stop()


@pytest.fixture
def stores(master):
    """Factory of stores on `master`, all closed at the end of the test."""
    made = []

    def make(host, ns, **overrides):
        made.append(MooncakeStore(host, ns, master.extra_config(**overrides)))
        return made[-1]

    yield make
    with ThreadPoolExecutor(max(1, len(made))) as pool:  # a close takes ~2 s: close them together
        list(pool.map(MooncakeStore.close, made))


@needs_mooncake
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_set_then_get_is_byte_equal(stores, kind):
    host = host_pool(kind, seed=1)
    ns = namespace(host)
    store = stores(host, ns)
    assert store.state()["connected"] and store.kinds == (["k", "v"] if kind == "MHA" else ["kv"])
    keys = page_keys(tokens(4, seed=2), PAGE, ns)
    src = [0, 1, 2, 3]
    want = pages_of(host, src)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_from(keys, src) == 4
    assert store.batch_exists(keys) == 4
    host.buffer.fill_(0)
    dst = [9, 4, 7, 5]
    assert store.batch_get_into(keys, dst) == 4
    assert_pages_equal(host, dst, want)
    # A second write of the same pages is skipped (nothing transferred).
    assert store.batch_set_from(keys, dst) == 4
    st = store.stats()
    page_bytes = sum(k.page_bytes for k in host.kinds)
    assert (st.pages_written, st.pages_skipped, st.pages_read) == (4, 4, 4)
    assert st.bytes_written == st.bytes_read == 4 * page_bytes
    assert not st.failures


@needs_mooncake
def test_set_reports_leading_pages_when_a_middle_put_fails(stores):
    """A put that fails for page 2 of 5 (e.g. the store is full): pages 3-4 may be written,
    but only pages 0-1 count as stored, since the caller marks exactly the leading pages."""
    host = host_pool("MHA", seed=5)
    ns = namespace(host)
    store = stores(host, ns)
    keys = page_keys(tokens(5, seed=6), PAGE, ns)
    real, n = store._store, len(store.kinds)

    class FailPage2:
        def __getattr__(self, name):
            return getattr(real, name)

        def batch_put_from(self, names, ptrs, sizes):
            codes = real.batch_put_from(names, ptrs, sizes)
            return [-200 if names[i].startswith(keys[2]) else c for i, c in enumerate(codes)]

    store._store = FailPage2()
    try:
        assert store.batch_set_from(keys, [0, 1, 2, 3, 4]) == 2
    finally:
        store._store = real
    assert store.stats().failures["no_space"] >= 1


@needs_mooncake
def test_exists_counts_leading_pages_and_get_stops_at_a_gap(stores):
    host = host_pool("MHA", seed=3)
    ns = namespace(host)
    store = stores(host, ns)
    keys = page_keys(tokens(5, seed=4), PAGE, ns)
    assert store.batch_set_from([keys[0], keys[1], keys[3], keys[4]], [0, 1, 3, 4]) == 4
    assert store.batch_exists(keys) == 2
    assert store.batch_exists(keys[3:]) == 2
    want = pages_of(host, [0, 1])
    host.buffer.fill_(0)
    assert store.batch_get_into(keys, [5, 6, 7, 8, 9]) == 2
    assert_pages_equal(host, [5, 6], want)
    assert not store.stats().failures  # a missing page is a miss, not a failure


@needs_mooncake
def test_two_replicas_share_one_master(stores):
    """Pages one replica writes are read by another (its own host pool, its own client)."""
    host_a, host_b = host_pool("MHA", seed=5), host_pool("MHA", seed=6)
    ns = namespace(host_a)
    a, b = stores(host_a, ns), stores(host_b, ns)
    keys = page_keys(tokens(3, seed=7), PAGE, ns)
    want = pages_of(host_a, [2, 3, 4])
    assert a.batch_set_from(keys, [2, 3, 4]) == 3
    assert b.batch_exists(keys) == 3
    assert b.batch_get_into(keys, [0, 1, 2]) == 3
    assert_pages_equal(host_b, [0, 1, 2], want)
    # B skips what A already stored.
    assert b.batch_set_from(keys, [0, 1, 2]) == 3 and b.stats().pages_skipped == 3


@needs_mooncake
def test_clear_removes_only_its_namespace(stores):
    host = host_pool("MLA", seed=8)
    ns_a, ns_b = namespace(host), namespace(host)
    a, b = stores(host, ns_a), stores(host, ns_b)
    keys_a, keys_b = page_keys(tokens(2, 9), PAGE, ns_a), page_keys(tokens(2, 9), PAGE, ns_b)
    assert a.batch_set_from(keys_a, [0, 1]) == 2 and b.batch_set_from(keys_b, [0, 1]) == 2
    time.sleep(LEASE_TTL_MS / 1000 + 0.3)  # the exists inside set granted read leases
    a.clear()
    assert a.batch_exists(keys_a) == 0
    assert b.batch_exists(keys_b) == 2


@needs_mooncake
def test_master_killed_then_restarted(stores):
    """A dead master: every call returns 0 pages within a bounded time, counted, no exception;
    restarted (empty) on the same ports: the same clients store and share pages again."""
    if SKIP:
        pytest.skip(SKIP)
    m = MooncakeMaster(lease_ttl_ms=LEASE_TTL_MS).start()
    try:
        host_a, host_b = host_pool("MHA", seed=10), host_pool("MHA", seed=11)
        ns = namespace(host_a)
        a = MooncakeStore(host_a, ns, m.extra_config())
        b = MooncakeStore(host_b, ns, m.extra_config())
        keys = page_keys(tokens(3, seed=12), PAGE, ns)
        assert a.batch_set_from(keys, [0, 1, 2]) == 3
        m.kill()
        for call in (lambda: a.batch_exists(keys), lambda: a.batch_get_into(keys, [3, 4, 5]),
                     lambda: a.batch_set_from(keys, [0, 1, 2]), lambda: b.batch_get_into(keys, [0, 1, 2]),
                     lambda: b.batch_exists(keys), a.clear):
            t0 = time.monotonic()
            assert not call()
            assert time.monotonic() - t0 < DEAD_CALL_S
        assert a.stats().failures["unavailable"] >= 4 and b.stats().failures["unavailable"] >= 2
        assert not a.state()["connected"] and "master" in a.state()["last_error"]

        m.restart()
        deadline = time.monotonic() + 30
        while a.batch_set_from(keys, [0, 1, 2]) != 3:  # the client reconnects by itself
            assert time.monotonic() < deadline, a.state()
            time.sleep(0.2)
        assert a.state()["connected"]
        want = pages_of(host_a, [0, 1, 2])
        deadline = time.monotonic() + 30
        while b.batch_get_into(keys, [7, 8, 9]) != 3:
            assert time.monotonic() < deadline, b.state()
            time.sleep(0.2)
        assert_pages_equal(host_b, [7, 8, 9], want)
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(MooncakeStore.close, [a, b]))
    finally:
        m.stop()


@needs_mooncake
def test_master_absent_at_start_is_connected_later():
    """The constructor does not block on a missing master; calls miss (counted) until one
    appears at the configured address, then the next call after the retry interval connects."""
    if SKIP:
        pytest.skip(SKIP)
    m = MooncakeMaster(rpc_port=free_port())
    host = host_pool("MLA", seed=13)
    ns = namespace(host)
    t0 = time.monotonic()
    store = MooncakeStore(host, ns, m.extra_config(connect_retry_interval=0.2))
    assert time.monotonic() - t0 < 5.0
    try:
        keys = page_keys(tokens(2, seed=14), PAGE, ns)
        assert store.batch_set_from(keys, [0, 1]) == 0 and store.batch_exists(keys) == 0
        state = store.state()
        assert not state["connected"] and state["failures"]["unavailable"] >= 2
        assert state["master_server_address"] == m.address
        m.start()
        time.sleep(0.3)
        assert store.batch_set_from(keys, [0, 1]) == 2
        assert store.state()["connected"] and store.batch_exists(keys) == 2
    finally:
        store.close()
        m.stop()
    assert store.batch_exists(keys) == 0  # closed: a miss, no call into the closed client
    store.close()  # idempotent


def test_config_sources(monkeypatch, tmp_path):
    """SGLang's order: extra config naming the master, else the config file, else MOONCAKE_*."""
    for var in ("MOONCAKE_MASTER", "MOONCAKE_TE_META_DATA_SERVER", "MOONCAKE_PROTOCOL",
                "MOONCAKE_GLOBAL_SEGMENT_SIZE", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs a master"):
        MooncakeStoreConfig.resolve({})
    cfg = MooncakeStoreConfig.resolve({"master_server_address": "10.0.0.1:50051", "global_segment_size": "1gb"})
    assert (cfg.master_server_address, cfg.protocol, cfg.metadata_server) == ("10.0.0.1:50051", "tcp", "P2PHANDSHAKE")
    assert cfg.global_segment_size == 1024**3 and cfg.local_hostname == "127.0.0.1"
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.2:1")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "512mb")
    cfg = MooncakeStoreConfig.resolve({})
    assert cfg.master_server_address == "10.0.0.2:1" and cfg.global_segment_size == 512 * 1024**2
    path = tmp_path / "mc.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.3:2", "metadata_server": "http://h:8080/metadata"}))
    monkeypatch.setenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", str(path))
    cfg = MooncakeStoreConfig.resolve({})
    assert (cfg.master_server_address, cfg.metadata_server) == ("10.0.0.3:2", "http://h:8080/metadata")
    with pytest.raises(ValueError, match="global_segment_size"):
        MooncakeStoreConfig.resolve({"master_server_address": "h:1", "global_segment_size": "lots"})
    assert parse_size(4096) == 4096 and parse_size("1.5k") == 1536 and parse_size("4GiB") == 4 * 1024**3


@needs_mooncake
def test_factory_builds_it(master, monkeypatch):
    """`create_storage("mooncake", ...)` (the --hicache-storage-backend name) builds this backend;
    without any master configured it refuses at start with a message naming the keys."""
    host = host_pool("MLA", seed=15)
    ns = namespace(host)
    store = create_storage("mooncake", host, ns, master.extra_config())
    try:
        assert isinstance(store, MooncakeStore) and store.state()["connected"]
        keys = page_keys(tokens(1, seed=16), PAGE, ns)
        assert store.batch_set_from(keys, [0]) == 1 and store.batch_exists(keys) == 1
    finally:
        store.close()
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match="master_server_address"):
        create_storage("mooncake", host, ns, {})
