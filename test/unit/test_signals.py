"""`exit_on_sigterm`: the first SIGTERM leaves through SystemExit (status 143, `finally` runs);
a second one arriving while the interpreter exits (a scheduler gets one from the test harness
and one from the launcher) is ignored instead of raising inside an atexit callback, which
printed a traceback into the server log."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import atexit, os, signal, time
from hiserve.engine.signals import exit_on_sigterm

def second_term():
    os.kill(os.getpid(), signal.SIGTERM)  # as the launcher's, during interpreter exit
    time.sleep(0.2)

atexit.register(second_term)
exit_on_sigterm()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
finally:
    print("finally ran", flush=True)
"""


def test_first_sigterm_exits_143_and_a_second_one_is_ignored():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert "finally ran" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
