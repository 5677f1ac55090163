"""The storage worker's part of MLA under TP: a backup op of a rank that does not write
(`BackupOp.write=False`: MLA pages are written by rank 0 only) touches no storage and reports
every page stored, so the ranks' agreed (minimum) stored count is rank 0's. Real `file`
backend in a temp dir."""

from __future__ import annotations

from hiserve.mem_cache.storage_controller import BackupOp

from storage_helpers import backend, make_storage_kv


def test_backup_op_without_write_touches_no_storage(tmp_path):
    kv = make_storage_kv(tmp_path)
    storage = kv.prefix_cache.storage
    op = BackupOp(["a" * 64, "b" * 64], [1, 2], write=False)
    storage.submit(op)
    assert storage.wait_idle(5)
    assert storage.poll() == [op]
    assert (op.stored_pages, op.skipped_pages, op.error) == (2, 2, None)
    assert backend(kv).stats().pages_written == 0
    kv.check_integrity()
    kv.h.close()
