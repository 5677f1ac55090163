"""The storage read threads (`mem_cache/storage/io_threads.py`): results in order, a job
that raises is a counted False, `run` returns only after every job, and after `close()` the
caller runs its jobs itself."""

from __future__ import annotations

import threading
import time

import pytest

from hiserve.mem_cache.storage.io_threads import ReadThreads, io_threads_from, usable_cpus


def test_results_in_order_and_errors_are_false():
    errors = []
    pool = ReadThreads(3, "t", errors.append)

    def job(i):
        if i == 5:
            raise ValueError("bad page")
        time.sleep(0.001 * (i % 3))
        return i % 2 == 0

    assert pool.run([lambda i=i: job(i) for i in range(8)]) == [i % 2 == 0 and i != 5 for i in range(8)]
    assert len(errors) == 1 and isinstance(errors[0], ValueError)
    assert pool.run([]) == []
    pool.close()


def test_run_waits_for_every_job_and_close_hands_jobs_back():
    pool = ReadThreads(2, "t", lambda e: None)
    finished = []

    def slow():
        time.sleep(0.05)
        finished.append(threading.current_thread().name)
        return True

    assert pool.run([slow, slow, slow]) == [True] * 3 and len(finished) == 3
    assert all(name.startswith("t-") for name in finished)
    pool.close()
    pool.close()  # idempotent
    assert pool.run([slow]) is None  # the caller runs it itself


def test_io_threads_default_and_bounds():
    assert io_threads_from({}) == min(usable_cpus(), 8)
    assert io_threads_from({"file_io_threads": 3}) == 3
    for bad in (0, -2, 2.0, False, "2"):
        with pytest.raises(ValueError, match="file_io_threads"):
            io_threads_from({"file_io_threads": bad})
