"""The run lock: a live run refuses a second one in its output dir; a filesystem without POSIX locks
(ENOLCK/ENOSYS/EOPNOTSUPP, as on some Lustre and NFS set-ups) is warned about once and the run proceeds.

No filesystem without locks exists on this machine, so those tests make ``fcntl.lockf`` raise the
errno such a filesystem returns (monkeypatch restores it); the held case uses a real second process.
"""

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from accelerate import PartialState

from lmpretrain.errors import OutputDirInUseError
from lmpretrain.run.runlock import LOCK_FILE, run_lock


def failing_lockf(code):
    def lockf(fd, cmd, *args):
        raise OSError(code, os.strerror(code))

    return lockf


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_a_filesystem_without_locks_warns_once_and_the_run_proceeds(tmp_path, monkeypatch, caplog, code):
    monkeypatch.setattr(fcntl, "lockf", failing_lockf(code))
    entered = False
    with caplog.at_level(logging.WARNING, logger="lmpretrain.run.runlock"):
        with run_lock(tmp_path, PartialState()):
            entered = True
            record = json.loads((tmp_path / LOCK_FILE).read_text())
    assert entered and record["pid"] == os.getpid()  # the pid file is still written
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert errno.errorcode[code] in warnings[0]
    assert "a second run started in this output dir would not be refused" in warnings[0]


@pytest.mark.parametrize("code", [errno.EAGAIN, errno.EACCES])
def test_eagain_and_eacces_mean_another_run_holds_the_lock(tmp_path, monkeypatch, code):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "node7"}))
    monkeypatch.setattr(fcntl, "lockf", failing_lockf(code))
    with pytest.raises(OutputDirInUseError, match=r"in use by another live run \(pid 4242 on node7"):
        with run_lock(tmp_path, PartialState()):
            pytest.fail("the lock was taken although another run holds it")


HOLDER = textwrap.dedent("""
    import fcntl, json, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode(), 0)
    print("locked", flush=True)
    sys.stdin.read()  # hold it until the test closes stdin
""")


def test_a_real_lock_held_by_another_process_refuses_the_run(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirInUseError, match=rf"\(pid {holder.pid}\b"):
            with run_lock(tmp_path, PartialState()):
                pytest.fail("the lock was taken although another process holds it")
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with run_lock(tmp_path, PartialState()):  # released with its holder: taken now, without a warning
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
