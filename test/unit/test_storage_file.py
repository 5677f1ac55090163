"""`file` storage backend on real CPU host pools: pages round-trip byte for byte (MHA K and V,
MLA one object; page_first and page_first_direct; float32 and bfloat16), a truncated,
corrupted or foreign file is a counted miss and is removed, the size cap evicts LRU, and
I/O failures return fewer pages without raising. Plus the factory and the extra-config parser.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost
from hiserve.mem_cache.storage import STORAGE_BACKENDS, create_storage, parse_extra_config
from hiserve.mem_cache.storage.file_backend import HEADER, FileStorage
from hiserve.mem_cache.storage.keys import page_keys, storage_namespace

LAYERS, HEADS, HEAD_DIM = 3, 2, 4
KV_LORA_RANK, ROPE_DIM = 6, 2
PAGE = 4
HOST_PAGES = 8


def make_host(kind: str = "MHA", layout: str = "page_first", dtype=torch.float32, seed: int = 0):
    """A host pool of HOST_PAGES pages whose every byte is random."""
    size = HOST_PAGES * PAGE
    if kind == "MHA":
        dev = MHATokenToKVPool(size, PAGE, dtype, HEADS, HEAD_DIM, LAYERS, "cpu")
        host = MHATokenToKVPoolHost(dev, 1.0, 0, PAGE, layout)
    else:
        dev = MLATokenToKVPool(size, PAGE, dtype, KV_LORA_RANK, ROPE_DIM, LAYERS, "cpu")
        host = MLATokenToKVPoolHost(dev, 1.0, 0, PAGE, layout)
    gen = torch.Generator().manual_seed(seed)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, generator=gen, dtype=torch.uint8))
    return host


def namespace_of(host, model: str = "m") -> str:
    kinds = [(k.name, k.item_shape) for k in host.kinds]
    return storage_namespace(model, str(host.dtype), PAGE, host.layout, kinds, host.layer_num)


def keys_for(ns: str, pages: int, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50000, (pages * PAGE + 1,), generator=gen).tolist()
    return page_keys(tokens, PAGE, ns)


def page_bytes(host, page: int) -> list[bytes]:
    return [host.page_object(k.name, page).view(torch.uint8).numpy().tobytes() for k in host.kinds]


def store(tmp_path, host, ns=None, **extra) -> FileStorage:
    return FileStorage(host, ns or namespace_of(host), {"file_storage_path": str(tmp_path), **extra})


def kind_files(backend: FileStorage, key: str) -> list[str]:
    h = key.rsplit("/", 1)[-1]
    return [os.path.join(backend.directory, f"{h}.{kind}") for kind in backend.kinds]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_round_trip_bytes_equal(tmp_path, kind, layout, dtype):
    host = make_host(kind, layout, dtype)
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 4)
    src = [2, 5, 0, 7]
    want = [page_bytes(host, p) for p in src]
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_from(keys, src) == 4
    assert len(os.listdir(backend.directory)) == 4 * len(host.kinds) == 4 * (2 if kind == "MHA" else 1)
    host.buffer.zero_()  # the host copy is gone: only the files can give it back
    assert backend.batch_exists(keys) == 4
    dst = [6, 1, 3, 4]
    assert backend.batch_get_into(keys, dst) == 4
    assert [page_bytes(host, p) for p in dst] == want
    assert all(b == bytes(len(b)) for p in (0, 2, 5, 7) for b in page_bytes(host, p))  # nothing else written
    s = backend.stats()
    per_page = host.kinds[0].page_bytes * len(host.kinds)
    assert (s.pages_written, s.pages_read, s.bytes_written, s.bytes_read) == (4, 4, 4 * per_page, 4 * per_page)
    assert not s.failures
    st = backend.state()
    assert st["backend"] == "file" and st["directory"] == backend.directory and st["pages"] == 4
    assert st["bytes_used"] == sum(os.path.getsize(os.path.join(backend.directory, f))
                                   for f in os.listdir(backend.directory))


def test_restart_reads_pages_of_a_previous_instance(tmp_path):
    host = make_host()
    keys = keys_for(namespace_of(host), 3)
    store(tmp_path, host).batch_set_from(keys, [0, 1, 2])
    want = [page_bytes(host, p) for p in (0, 1, 2)]
    host2 = make_host(seed=9)
    again = store(tmp_path, host2)
    assert again.state()["pages"] == 3 and again.bytes_used > 0
    assert again.batch_get_into(keys, [5, 6, 7]) == 3
    assert [page_bytes(host2, p) for p in (5, 6, 7)] == want


def test_batch_exists_counts_leading_pages_and_a_missing_kind_is_a_gap(tmp_path):
    host = make_host("MHA")
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 5)
    assert backend.batch_set_from(keys[:2] + keys[3:], [0, 1, 3, 4]) == 4
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[3:]) == 2
    os.unlink(kind_files(backend, keys[4])[1])  # page 4 has K but no V
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.batch_get_into(keys, [0, 1, 2, 3, 4]) == 2  # stops at the gap
    assert backend.batch_exists([]) == 0


def test_existing_pages_are_skipped(tmp_path):
    host = make_host()
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 4)
    assert backend.batch_set_from(keys[:2], [0, 1]) == 2
    mtimes = [os.stat(p).st_mtime_ns for k in keys[:2] for p in kind_files(backend, k)]
    assert backend.batch_set_from(keys, [0, 1, 2, 3]) == 4
    s = backend.stats()
    assert (s.pages_written, s.pages_skipped) == (4, 2)
    assert [os.stat(p).st_mtime_ns for k in keys[:2] for p in kind_files(backend, k)] == mtimes


def corrupt_truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)


def corrupt_flip(path):
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("threads", [1, 4], ids=["one-thread", "read-threads"])
@pytest.mark.parametrize("damage,reason", [(corrupt_truncate, "truncated"), (corrupt_flip, "checksum")])
def test_damaged_file_is_a_counted_miss_and_removed(tmp_path, damage, reason, threads):
    host = make_host()
    backend = store(tmp_path, host, file_io_threads=threads)
    keys = keys_for(backend.namespace, 3)
    backend.batch_set_from(keys, [0, 1, 2])
    bad = kind_files(backend, keys[1])[1]
    damage(bad)
    used = backend.bytes_used
    good0 = page_bytes(host, 0)
    host.buffer.zero_()
    assert backend.batch_get_into(keys, [3, 4, 5]) == 1
    assert page_bytes(host, 3) == good0
    assert backend.stats().failures[reason] == 1
    assert not os.path.exists(bad) and backend.bytes_used < used
    assert backend.batch_exists(keys) == 1  # now a plain miss, not counted again
    assert backend.stats().failures[reason] == 1


def test_truncated_file_seen_by_exists(tmp_path):
    host = make_host()
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 2)
    backend.batch_set_from(keys, [0, 1])
    bad = kind_files(backend, keys[0])[0]
    corrupt_truncate(bad)
    assert backend.batch_exists(keys) == 0
    assert backend.stats().failures["truncated"] == 1 and not os.path.exists(bad)


# On one thread a read stops at a page's first bad file; on the read threads every file of
# the batch is read, so both of the page's foreign files are counted (and deleted).
@pytest.mark.parametrize("threads,bad_files", [(1, 1), (4, 2)], ids=["one-thread", "read-threads"])
def test_file_copied_under_another_key_is_a_miss(tmp_path, threads, bad_files):
    host = make_host()
    backend = store(tmp_path, host, file_io_threads=threads)
    keys = keys_for(backend.namespace, 2)
    backend.batch_set_from(keys[:1], [0])
    src, dst = kind_files(backend, keys[0])[0], kind_files(backend, keys[1])[0]
    os.rename(src, dst)  # same size and a valid CRC, but it names another page
    os.link(kind_files(backend, keys[0])[1], kind_files(backend, keys[1])[1])
    host.buffer.zero_()
    assert backend.batch_get_into(keys[1:], [4]) == 0
    assert backend.stats().failures["checksum"] == bad_files and not os.path.exists(dst)
    assert page_bytes(host, 4)[0] == bytes(len(page_bytes(host, 4)[0]))  # never usable KV anyway


@pytest.mark.parametrize("threads,bad_files", [(1, 1), (4, 2)], ids=["one-thread", "read-threads"])
def test_foreign_file_and_partial_temp_file_are_ignored(tmp_path, threads, bad_files):
    host = make_host()
    backend = store(tmp_path, host, file_io_threads=threads)
    keys = keys_for(backend.namespace, 2)
    backend.batch_set_from(keys[:1], [0])
    h1 = keys[1].rsplit("/", 1)[-1]
    with open(os.path.join(backend.directory, f".{h1}.k.123.456.tmp"), "wb") as f:
        f.write(b"HSKVPAGE" + b"\0" * 10)  # a writer that died mid-page
    with open(os.path.join(backend.directory, "notes.txt"), "w") as f:
        f.write("not a page")
    again = store(tmp_path, host, file_io_threads=threads)
    assert again.batch_exists(keys) == 1 and again.state()["pages"] == 1
    assert again.batch_get_into(keys, [5, 6]) == 1
    assert not again.stats().failures
    # A file of the right name and size that is not ours at all.
    size = os.path.getsize(kind_files(backend, keys[0])[0])
    for path in kind_files(backend, keys[1]):
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    assert again.batch_get_into(keys[1:], [6]) == 0 and again.stats().failures["checksum"] == bad_files


def test_size_cap_evicts_least_recently_used(tmp_path):
    host = make_host()
    ns = namespace_of(host)
    keys = keys_for(ns, 4)
    probe = store(tmp_path / "probe", host, ns)
    probe.batch_set_from(keys[:1], [0])
    page_on_disk = probe.bytes_used
    cap_gb = 3.5 * page_on_disk / 1e9  # room for three pages
    backend = store(tmp_path, host, ns, storage_size_cap_gb=cap_gb)
    assert backend.batch_set_from(keys[:3], [0, 1, 2]) == 3
    assert backend.batch_get_into(keys[:1], [4]) == 1  # page 0 is now the most recently used
    assert backend.batch_set_from(keys[3:], [3]) == 1  # evicts page 1, the least recently used
    assert backend.bytes_used == 3 * page_on_disk <= backend.size_cap_bytes
    assert [backend.batch_exists([k]) for k in keys] == [1, 0, 1, 1]
    assert backend.state()["size_cap_bytes"] == int(cap_gb * 1e9)
    # A restart seeds recency from mtimes: the oldest file goes first.
    again = store(tmp_path, host, ns, storage_size_cap_gb=cap_gb)
    assert again.bytes_used == 3 * page_on_disk
    tiny = store(tmp_path / "tiny", host, ns, storage_size_cap_gb=page_on_disk / 2e9)
    assert tiny.batch_set_from(keys[:1], [0]) == 0 and tiny.stats().failures["size_cap"] == 1


@pytest.mark.parametrize("err,reason", [(errno.EROFS, "read_only"), (errno.ENOSPC, "no_space"),
                                        (errno.EACCES, "read_only"), (errno.EIO, "io_error")])
def test_write_failure_returns_fewer_pages(tmp_path, monkeypatch, err, reason):
    host = make_host()
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 4)
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(dst)
        if len(calls) > 2:  # page 0 (k and v) lands, then the disk refuses
            raise OSError(err, os.strerror(err))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    assert backend.batch_set_from(keys, [0, 1, 2, 3]) == 1
    assert backend.batch_set_from(keys, [0, 1, 2, 3]) == 1  # counted again, logged once
    monkeypatch.undo()
    assert backend.stats().failures[reason] == 2
    assert [n for n in os.listdir(backend.directory) if n.startswith(".")] == []  # temp files removed
    assert backend.batch_exists(keys) == 1


def test_directory_that_is_a_file_never_raises(tmp_path):
    host = make_host()
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    backend = FileStorage(host, namespace_of(host), {"file_storage_path": str(blocker)})
    keys = keys_for(backend.namespace, 2)
    assert backend.batch_set_from(keys, [0, 1]) == 0
    assert backend.batch_exists(keys) == 0 and backend.batch_get_into(keys, [0, 1]) == 0
    assert backend.stats().failures["io_error"] == 1
    backend.clear()
    blocker.unlink()  # the path becomes usable: the backend retries opening it, rate-limited
    assert backend.batch_set_from(keys, [0, 1]) == 0
    backend._opened_at -= 60
    assert backend.batch_set_from(keys, [0, 1]) == 2 and backend.batch_exists(keys) == 2


def test_directory_removed_while_running_is_recreated(tmp_path):
    import shutil

    host = make_host()
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 3)
    assert backend.batch_set_from(keys[:1], [0]) == 1
    shutil.rmtree(backend.directory)
    assert backend.batch_exists(keys) == 0 and backend.batch_get_into(keys[:1], [4]) == 0
    assert backend.batch_set_from(keys, [0, 1, 2]) == 3 and backend.batch_exists(keys) == 3
    assert not backend.stats().failures


def test_read_failure_returns_fewer_pages(tmp_path, monkeypatch):
    import builtins

    host = make_host()
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 3)
    backend.batch_set_from(keys, [0, 1, 2])
    bad = kind_files(backend, keys[1])[0]
    real_open = builtins.open

    def failing_open(path, *a, **kw):
        if path == bad:
            raise OSError(errno.EIO, "I/O error")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", failing_open)
    assert backend.batch_get_into(keys, [3, 4, 5]) == 1
    monkeypatch.undo()
    assert backend.stats().failures["io_error"] == 1 and os.path.exists(bad)  # not ours to delete


def test_namespaces_are_isolated(tmp_path):
    host = make_host()
    ns_a, ns_b = namespace_of(host, "model-a"), namespace_of(host, "model-b")
    a, b = store(tmp_path, host, ns_a), store(tmp_path, host, ns_b)
    tokens = list(range(3 * PAGE))
    keys_a, keys_b = page_keys(tokens, PAGE, ns_a), page_keys(tokens, PAGE, ns_b)
    assert a.batch_set_from(keys_a, [0, 1, 2]) == 3
    assert b.batch_exists(keys_b) == 0 and b.batch_exists(keys_a) == 0  # same tokens, other model
    assert b.batch_get_into(keys_a, [3, 4, 5]) == 0
    b.batch_set_from(keys_b[:1], [0])
    b.clear()
    assert os.listdir(b.directory) == [] and a.batch_exists(keys_a) == 3 and b.state()["bytes_used"] == 0


def test_page_keys_end_to_end_shared_prefix(tmp_path):
    """Two requests sharing two pages of tokens: the second finds exactly those two."""
    host = make_host()
    backend = store(tmp_path, host)
    first = list(range(100, 100 + 4 * PAGE))
    second = first[:2 * PAGE] + [7] * (2 * PAGE)
    k1, k2 = page_keys(first, PAGE, backend.namespace), page_keys(second, PAGE, backend.namespace)
    backend.batch_set_from(k1, [0, 1, 2, 3])
    assert backend.batch_exists(k2) == 2
    assert backend.batch_get_into(k2, [4, 5, 6, 7]) == 2
    assert page_bytes(host, 4) == page_bytes(host, 0) and page_bytes(host, 5) == page_bytes(host, 1)


def test_header_holds_the_object_key(tmp_path):
    host = make_host("MLA")
    backend = store(tmp_path, host)
    keys = keys_for(backend.namespace, 1)
    backend.batch_set_from(keys, [3])
    data = open(kind_files(backend, keys[0])[0], "rb").read()
    magic, version, klen, nbytes, _ = HEADER.unpack_from(data)
    assert magic == b"HSKVPAGE" and version == 1 and nbytes == host.kinds[0].page_bytes
    assert data[HEADER.size:HEADER.size + klen] == f"{keys[0]}.kv".encode()
    assert data[HEADER.size + klen:] == page_bytes(host, 3)[0]


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="layer_first"):
        store(tmp_path, make_host(layout="layer_first"), "ns")
    host = make_host()
    with pytest.raises(ValueError, match="storage_size_cap_gb"):
        store(tmp_path, host, storage_size_cap_gb=-1)
    with pytest.raises(ValueError, match="storage_size_cap_gb"):
        store(tmp_path, host, storage_size_cap_gb="10")
    with pytest.raises(ValueError, match="safe directory"):
        store(tmp_path, host, "../escape")
    backend = store(tmp_path, host)
    with pytest.raises(ValueError, match="file-safe hash"):
        backend.batch_exists([f"{backend.namespace}/.."])
    with pytest.raises(ValueError, match="2 keys but 1 host pages"):
        backend.batch_get_into(keys_for(backend.namespace, 2), [0])


def test_default_directory_from_environment(tmp_path, monkeypatch):
    host = make_host()
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path / "env"))
    backend = FileStorage(host, namespace_of(host), {})
    assert backend.directory == os.path.join(str(tmp_path / "env"), namespace_of(host))
    explicit = FileStorage(host, namespace_of(host), {"file_storage_path": str(tmp_path / "cfg")})
    assert explicit.root == str(tmp_path / "cfg")


def test_create_storage(tmp_path):
    host = make_host()
    assert STORAGE_BACKENDS == ("file", "mooncake")
    backend = create_storage("file", host, namespace_of(host), {"file_storage_path": str(tmp_path)})
    assert isinstance(backend, FileStorage)
    with pytest.raises(ValueError, match="'nfs'.*file, mooncake"):
        create_storage("nfs", host, namespace_of(host), {})


def test_parse_extra_config(tmp_path):
    assert parse_extra_config(None) == {} and parse_extra_config("  ") == {}
    assert parse_extra_config('{"file_storage_path": "/x", "storage_size_cap_gb": 2}') == {
        "file_storage_path": "/x", "storage_size_cap_gb": 2}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"protocol": "tcp"}))
    assert parse_extra_config(f"@{path}") == {"protocol": "tcp"}
    with pytest.raises(ValueError, match="extra-config: invalid JSON in inline JSON"):
        parse_extra_config("{file_storage_path: /x}")
    with pytest.raises(ValueError, match="must be a JSON object, got list"):
        parse_extra_config("[1, 2]")
    with pytest.raises(ValueError, match="cannot read file"):
        parse_extra_config(f"@{tmp_path / 'missing.json'}")
    path.write_text("not json")
    with pytest.raises(ValueError, match="invalid JSON in file"):
        parse_extra_config(f"@{path}")


def test_read_threads_deliver_every_page_exactly(tmp_path):
    """Many pages read on 4 threads land in the right host pages, byte for byte."""
    host = make_host(dtype=torch.bfloat16)
    backend = store(tmp_path, host, file_io_threads=4)
    assert backend.state()["io_threads"] == 4
    n = HOST_PAGES // 2
    keys = keys_for(backend.namespace, n)
    assert backend.batch_set_from(keys, list(range(n))) == n
    want = [page_bytes(host, i) for i in range(n)]
    dst = list(range(HOST_PAGES - 1, HOST_PAGES - 1 - n, -1))  # other pages, reversed order
    assert backend.batch_get_into(keys, dst) == n
    assert [page_bytes(host, d) for d in dst] == want
    backend.close()
    host.buffer.zero_()
    assert backend.batch_get_into(keys, dst) == n  # after close: on the calling thread, still exact
    assert [page_bytes(host, d) for d in dst] == want


def test_a_read_that_raises_is_a_counted_miss_and_every_read_has_ended(tmp_path, monkeypatch):
    """An unexpected exception on a read thread: the batch returns the leading pages, counts
    an io_error, and no read of that batch is still running when it returns."""
    host = make_host()
    backend = store(tmp_path, host, file_io_threads=3)
    keys = keys_for(backend.namespace, 4)
    assert backend.batch_set_from(keys, [0, 1, 2, 3]) == 4
    real, running = backend._read_kind, []

    def flaky(h, kind, page):
        running.append(1)
        try:
            if page == 6 and kind == backend.kinds[-1]:
                raise RuntimeError("boom")
            return real(h, kind, page)
        finally:
            running.pop()

    monkeypatch.setattr(backend, "_read_kind", flaky)
    assert backend.batch_get_into(keys, [4, 5, 6, 7]) == 2
    assert not running and backend.stats().failures["io_error"] == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "4"])
def test_file_io_threads_must_be_a_positive_integer(tmp_path, bad):
    with pytest.raises(ValueError, match="file_io_threads"):
        store(tmp_path, make_host(), file_io_threads=bad)
