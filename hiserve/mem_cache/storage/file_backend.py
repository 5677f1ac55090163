"""`file` storage backend: one file per page and KV kind under `<dir>/<namespace>/`.

File name `<page hash>.<kind>` (the page key after its namespace '/'). Each file is a small
fixed header followed by the page's bytes exactly as the host pool holds them:

    magic "HSKVPAGE" | format version u16 | key length u16 | payload bytes u64 | crc32 u32
    | object key (utf-8: "<namespace>/<hash>.<kind>") | payload

A write goes to a temporary name (".<name>.<pid>.<thread>.tmp") in the same directory and
is renamed over the final name (`os.replace`, atomic within one filesystem), so a crash
leaves either the whole page or no page. A read checks the file size, magic, version, key
and CRC-32 of the payload; anything else (a truncated, corrupted, or foreign file, e.g. one
copied under another page's name) is a miss: the failure is counted ("truncated" or
"checksum"), the file removed, and no byte of it is used as KV. Reads and writes go
straight between the file and the host pool page (`HostKVCache.page_object`): no
temporary copy of the page.

A size cap (`storage_size_cap_gb`, 0 = none) evicts least-recently-used pages (all kinds
at once) before a write would exceed it; recency is kept in memory, seeded from the files'
mtimes at start, and touched by reads and by writes that find the page already present.
The cap counts this process's view: two servers sharing one directory each enforce it on
what they know, so give them a cap with room for both.

Reads of one batch run on `file_io_threads` daemon threads (`io_threads.py`; default: the
usable CPUs, at most 8; logged at start): reading a file into memory and its CRC-32 release
the GIL, so a storage hit is not held to one core's copy rate. On the H200 host, for an
8K-token Llama-3-8B prefix in page-cache files, one thread read 1.7 GB/s and the storage hit
took 2.54x its recompute (`benchmark/results/h200_storage_hit_threads1.json`); eight read
11.1 GB/s and it took 0.70x (`h200_storage_hit.json`). Writes stay on the storage worker's
one thread: they are off every request's path, and one writer keeps the size cap exact.

SGLang's file backend (`mem_cache/hicache_storage.py`, `HiCacheFile`) stores one file per
page key the same way; the header, checksum, cap and parallel reads are hiserve's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from hiserve.mem_cache.storage.base import HiCacheStorage
from hiserve.mem_cache.storage.io_threads import ReadThreads, io_threads_from, usable_cpus

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool_host import HostKVCache

logger = logging.getLogger(__name__)

MAGIC = b"HSKVPAGE"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sHHQI")  # magic, version, key length, payload bytes, crc32
ENV_STORAGE_DIR = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_DIR_NAME = "hiserve_hicache"
STALE_TEMP_SECONDS = 3600.0  # a temp file this old has no live writer (it renames within ms)
REOPEN_SECONDS = 5.0  # after a failed start, retry creating the directory at most this often
_HASH_RE = re.compile(r"[0-9A-Za-z_-]+")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def os_error_reason(exc: OSError) -> str:
    """Failure reason of an OSError: "no_space", "read_only" or "io_error"."""
    if exc.errno in _NO_SPACE:
        return "no_space"
    if exc.errno in _READ_ONLY:
        return "read_only"
    return "io_error"


def resolve_storage_dir(extra_config: dict) -> str:
    """The storage root: `file_storage_path`, else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR,
    else `<tempfile.gettempdir()>/hiserve_hicache` (SGLang's key and variable names)."""
    path = extra_config.get("file_storage_path") or os.environ.get(ENV_STORAGE_DIR)
    return os.path.abspath(os.path.expanduser(path or os.path.join(tempfile.gettempdir(), DEFAULT_DIR_NAME)))


def page_view_bytes(view: torch.Tensor) -> memoryview:
    """A writable byte memoryview of a contiguous CPU tensor's memory (no copy; bf16 has no
    numpy dtype, so the tensor is reinterpreted as uint8 first)."""
    return memoryview(view.view(torch.uint8).reshape(-1).numpy()).cast("B")


def _write_all(f, data: memoryview | bytes) -> None:
    mv = memoryview(data)
    while mv:
        n = f.write(mv)
        mv = mv[n:]


def _read_into(f, mv: memoryview) -> int:
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            break
        got += n
    return got


class FileStorage(HiCacheStorage):
    """Pages as files in a directory (SGLang `--hicache-storage-backend file`).

    Args:
        host_pool: a page-first host pool (`page_object` gives each page of each kind).
        namespace: `keys.storage_namespace(...)`; also the subdirectory name.
        extra_config: `file_storage_path` (str), `storage_size_cap_gb` (float GB of 10**9
            bytes, 0 = no cap), `file_fsync` (bool, default False), `file_io_threads` (int,
            read threads, default min(usable CPUs, 8)); other keys are ignored.
    Raises:
        ValueError: a `layer_first` host pool, an unsafe namespace, a negative / non-number
            size cap, or a `file_io_threads` that is not an integer >= 1. I/O problems never
            raise: a directory that cannot be created is counted and every call then misses.
    """

    name = "file"

    def __init__(self, host_pool: "HostKVCache", namespace: str, extra_config: dict) -> None:
        super().__init__(host_pool, namespace)
        if not _HASH_RE.fullmatch(namespace):
            raise ValueError(f"file storage: namespace {namespace!r} is not a safe directory name")
        cap_gb = extra_config.get("storage_size_cap_gb", 0) or 0
        if isinstance(cap_gb, bool) or not isinstance(cap_gb, (int, float)) or cap_gb < 0:
            raise ValueError(f"storage_size_cap_gb must be a number >= 0 (GB), got {cap_gb!r}")
        self.root = resolve_storage_dir(extra_config)
        self.directory = os.path.join(self.root, namespace)
        self.size_cap_bytes = int(cap_gb * 1e9)
        # No fsync by default: storage is a cache, so a page lost to a power cut costs only a
        # recompute, and a file the rename published before its data reached the disk fails
        # the size / CRC check on read (a miss). fsync per page would cost milliseconds each.
        self.fsync = bool(extra_config.get("file_fsync", False))
        self.io_threads = io_threads_from(extra_config)
        self._readers = (ReadThreads(self.io_threads, "hicache-file-read", self._read_error)
                         if self.io_threads > 1 else None)
        logger.info("file storage: %s, %d read thread(s) (file_io_threads; %d usable CPUs)",
                    self.directory, self.io_threads, usable_cpus())
        self._lru: OrderedDict[str, int] = OrderedDict()  # page hash -> bytes on disk (all kinds)
        self.bytes_used = 0
        self._lock = threading.Lock()  # guards _lru / bytes_used against state() readers
        self._tmp_suffix = f".{os.getpid()}.{threading.get_ident()}.tmp"
        self._ready = self._open_directory()
        self._opened_at = time.monotonic()

    def _usable(self) -> bool:
        """The directory is open; after a failed start, retried every REOPEN_SECONDS (a
        mount that appears later starts working without a restart)."""
        if not self._ready and time.monotonic() - self._opened_at >= REOPEN_SECONDS:
            self._opened_at = time.monotonic()
            self._ready = self._open_directory()
        return self._ready

    # ------------------------------------------------------------------ layout

    def _hash(self, key: str) -> str:
        h = key.rsplit("/", 1)[-1]
        if not _HASH_RE.fullmatch(h):
            raise ValueError(f"file storage: page key {key!r} does not end in a file-safe hash")
        return h

    def _path(self, h: str, kind: str) -> str:
        return os.path.join(self.directory, f"{h}.{kind}")

    def _object_key(self, h: str, kind: str) -> bytes:
        return f"{self.namespace}/{h}.{kind}".encode()

    def _file_size(self, h: str, kind: str) -> int:
        return HEADER.size + len(self._object_key(h, kind)) + self.page_bytes

    def _page_size_on_disk(self, h: str) -> int:
        return sum(self._file_size(h, kind) for kind in self.kinds)

    def _open_directory(self) -> bool:
        """Create the namespace directory and seed size and recency from the files in it."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            pages: dict[str, list[float]] = {}  # hash -> [bytes, newest mtime]
            now = time.time()
            with os.scandir(self.directory) as it:
                for entry in it:
                    if entry.name.startswith("."):
                        self._drop_stale_temp(entry, now)
                        continue
                    h, _, kind = entry.name.rpartition(".")
                    if kind not in self.kinds or not entry.is_file(follow_symlinks=False):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    rec = pages.setdefault(h, [0, 0.0])
                    rec[0] += st.st_size
                    rec[1] = max(rec[1], st.st_mtime)
        except OSError as exc:
            self._fail(os_error_reason(exc), f"cannot open {self.directory}: {exc}")
            return False
        with self._lock:
            for h, (nbytes, _) in sorted(pages.items(), key=lambda kv: kv[1][1]):
                self._lru[h] = int(nbytes)
                self.bytes_used += int(nbytes)
        return True

    @staticmethod
    def _drop_stale_temp(entry: os.DirEntry, now: float) -> None:
        if entry.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS:
                    os.unlink(entry.path)

    # ------------------------------------------------------------------ recency / cap

    def _touch(self, h: str, nbytes: int | None = None) -> None:
        with self._lock:
            if h in self._lru:
                self._lru.move_to_end(h)
            elif nbytes is not None:
                self._lru[h] = nbytes
                self.bytes_used += nbytes

    def _forget(self, h: str, nbytes: int | None = None) -> None:
        """Remove a page (or, with nbytes, only that many of its bytes) from the accounting."""
        with self._lock:
            if h not in self._lru:
                return
            if nbytes is None or nbytes >= self._lru[h]:
                self.bytes_used -= self._lru.pop(h)
            else:
                self._lru[h] -= nbytes
                self.bytes_used -= nbytes

    def _remove_page_files(self, h: str) -> None:
        for kind in self.kinds:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(h, kind))
        self._forget(h)

    def _make_room(self, nbytes: int) -> bool:
        """Evict least-recently-used pages until `nbytes` more fit under the cap."""
        if not self.size_cap_bytes:
            return True
        if nbytes > self.size_cap_bytes:
            self._fail("size_cap", f"a page of {nbytes} bytes exceeds storage_size_cap_gb")
            return False
        while True:
            with self._lock:
                if self.bytes_used + nbytes <= self.size_cap_bytes or not self._lru:
                    return self.bytes_used + nbytes <= self.size_cap_bytes
                victim = next(iter(self._lru))
            try:
                self._remove_page_files(victim)
            except OSError as exc:
                self._fail(os_error_reason(exc), f"evicting {victim}: {exc}")
                return False

    # ------------------------------------------------------------------ checks

    def _bad_file(self, h: str, kind: str, reason: str, detail: str) -> None:
        """A file that must never be read as KV: count it and delete it (a miss)."""
        path = self._path(h, kind)
        self._fail(reason, f"{path}: {detail}")
        with contextlib.suppress(OSError):
            size = os.stat(path).st_size
            os.unlink(path)
            self._forget(h, size)

    def _kind_present(self, h: str, kind: str) -> bool:
        """The file exists with the right size (os.stat only). Raises OSError other than ENOENT."""
        try:
            size = os.stat(self._path(h, kind)).st_size
        except FileNotFoundError:
            return False
        want = self._file_size(h, kind)
        if size != want:
            self._bad_file(h, kind, "truncated" if size < want else "checksum",
                           f"{size} bytes, expected {want}")
            return False
        return True

    def _page_present(self, h: str) -> bool:
        return all(self._kind_present(h, kind) for kind in self.kinds)

    # ------------------------------------------------------------------ contract

    def batch_exists(self, keys: list[str]) -> int:
        """Leading keys whose every kind file exists with the right size (os.stat per file;
        contents are verified on read). I/O errors count and end the run of hits."""
        if not self._usable():
            return 0
        n = 0
        try:
            for key in keys:
                if not self._page_present(self._hash(key)):
                    break
                n += 1
        except OSError as exc:
            self._fail(os_error_reason(exc), f"stat in {self.directory}: {exc}")
        return n

    def batch_get_into(self, keys: list[str], host_pages: list[int]) -> int:
        """Read page files into host pages, in order, stopping at the first page that is
        missing, unreadable or fails verification. Returns leading pages now valid."""
        if len(keys) != len(host_pages):
            raise ValueError(f"batch_get_into: {len(keys)} keys but {len(host_pages)} host pages")
        if not self._usable():
            return 0
        t0, done = time.perf_counter(), 0
        hashes = [self._hash(key) for key in keys]
        for h, ok in zip(hashes, self._read_pages(hashes, host_pages)):
            if not ok:
                break
            self._touch(h, self._page_size_on_disk(h))  # also adopts pages another process wrote
            done += 1
        self._count(pages_read=done, bytes_read=done * self.page_bytes * len(self.kinds),
                    read_seconds=time.perf_counter() - t0)
        return done

    def _read_pages(self, hashes: list[str], host_pages: list[int]) -> list[bool]:
        """Whether each page (every kind) was read and verified. On the read threads every
        file of the batch is read, also after a miss (the caller keeps the leading pages;
        the contract lets later pages hold anything; at most one batch of reads is spent on
        a miss); on one thread, stops at the first miss."""
        readers = self._readers
        if readers is not None and len(hashes) * len(self.kinds) > 1:
            jobs = [lambda h=h, k=kind, p=page: self._read_kind(h, k, p)
                    for h, page in zip(hashes, host_pages) for kind in self.kinds]
            done = readers.run(jobs)
            if done is not None:
                nk = len(self.kinds)
                return [all(done[i * nk:(i + 1) * nk]) for i in range(len(hashes))]
        oks: list[bool] = []
        for h, page in zip(hashes, host_pages):
            oks.append(all(self._read_kind(h, kind, page) for kind in self.kinds))
            if not oks[-1]:
                break
        return oks

    def _read_error(self, exc: BaseException) -> None:
        self._fail("io_error", f"read thread: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Let the read threads end (idempotent; later reads run on the calling thread)."""
        if self._readers is not None:
            self._readers.close()

    def _read_kind(self, h: str, kind: str, page: int) -> bool:
        """Read one file into the page's memory and verify it; False on any miss."""
        key = self._object_key(h, kind)
        mv = page_view_bytes(self.host_pool.page_object(kind, page))
        try:
            with open(self._path(h, kind), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                want = HEADER.size + len(key) + len(mv)
                if size != want:
                    reason, detail = ("truncated" if size < want else "checksum"), f"{size} bytes, expected {want}"
                else:
                    head = f.read(want - len(mv))
                    reason, detail = self._check_header(head, key, len(mv))
                    if reason is None:
                        got = _read_into(f, mv)
                        if got != len(mv):
                            reason, detail = "truncated", f"payload {got} of {len(mv)} bytes"
                        elif zlib.crc32(mv) != HEADER.unpack_from(head)[4]:
                            reason, detail = "checksum", "payload CRC-32 mismatch"
        except FileNotFoundError:
            return False  # evicted or never written: a plain miss
        except OSError as exc:
            self._fail(os_error_reason(exc), f"reading {self._path(h, kind)}: {exc}")
            return False
        if reason is not None:
            self._bad_file(h, kind, reason, detail)
            return False
        return True

    @staticmethod
    def _check_header(head: bytes, key: bytes, payload: int) -> tuple[str | None, str]:
        if len(head) != HEADER.size + len(key):
            return "truncated", "short header"
        magic, version, klen, nbytes, _ = HEADER.unpack_from(head)
        if magic != MAGIC or version != FORMAT_VERSION:
            return "checksum", f"not a hiserve page file (magic {magic!r}, version {version})"
        if klen != len(key) or head[HEADER.size:] != key or nbytes != payload:
            return "checksum", f"file holds {head[HEADER.size:HEADER.size + klen]!r}, not {key!r}"
        return None, ""

    def batch_set_from(self, keys: list[str], host_pages: list[int]) -> int:
        """Write host pages as files (every kind); pages already present are skipped (and
        count as stored). Stops at the first failure. Returns pages stored."""
        if len(keys) != len(host_pages):
            raise ValueError(f"batch_set_from: {len(keys)} keys but {len(host_pages)} host pages")
        if not self._usable():
            return 0
        t0, stored, written, skipped = time.perf_counter(), 0, 0, 0
        try:
            for key, page in zip(keys, host_pages):
                h = self._hash(key)
                if self._page_present(h):
                    self._touch(h, self._page_size_on_disk(h))
                    skipped += 1
                elif self._write_page(h, page):
                    written += 1
                else:
                    break
                stored += 1
        except OSError as exc:
            self._fail(os_error_reason(exc), f"stat in {self.directory}: {exc}")
        self._count(pages_written=written, pages_skipped=skipped,
                    bytes_written=written * self.page_bytes * len(self.kinds),
                    write_seconds=time.perf_counter() - t0)
        return stored

    def _write_page(self, h: str, page: int) -> bool:
        nbytes = self._page_size_on_disk(h)
        self._forget(h)  # a page with only some kinds on disk is rewritten whole
        if not self._make_room(nbytes):
            return False
        for kind in self.kinds:
            try:
                self._write_kind(h, kind, page)
            except OSError as exc:
                self._fail(os_error_reason(exc), f"writing {self._path(h, kind)}: {exc}")
                return False
        self._touch(h, nbytes)
        return True

    def _write_kind(self, h: str, kind: str, page: int) -> None:
        """Temp file + rename, from the page's memory. Raises OSError (temp file removed)."""
        mv = page_view_bytes(self.host_pool.page_object(kind, page))
        key = self._object_key(h, kind)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, len(key), len(mv), zlib.crc32(mv)) + key
        tmp = os.path.join(self.directory, f".{h}.{kind}{self._tmp_suffix}")
        try:
            try:
                f = open(tmp, "wb", buffering=0)
            except FileNotFoundError:  # the directory was removed under us: recreate it once
                os.makedirs(self.directory, exist_ok=True)
                f = open(tmp, "wb", buffering=0)
            with f:
                _write_all(f, header)
                _write_all(f, mv)
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, self._path(h, kind))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def clear(self) -> None:
        """Delete every file in this namespace's directory (other namespaces untouched)."""
        try:
            with os.scandir(self.directory) as it:
                for entry in it:
                    if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(entry.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fail(os_error_reason(exc), f"clearing {self.directory}: {exc}")
        with self._lock:
            self._lru.clear()
            self.bytes_used = 0

    def state(self) -> dict:
        """Backend, namespace, directory, bytes used (this process's view), pages and cap."""
        with self._lock:
            pages, used = len(self._lru), self.bytes_used
        return {**super().state(), "directory": self.directory, "bytes_used": used, "pages": pages,
                "size_cap_bytes": self.size_cap_bytes, "fsync": self.fsync, "io_threads": self.io_threads}
