"""One live run per output dir: a second run started in the same `run.output_dir` is refused.

The main process holds a POSIX record lock (``fcntl.lockf``) on ``<output_dir>/.lock`` for the run's
life. The kernel drops it when the process ends, however it ends (kill -9 included), so a dead run never
blocks the next one and there is nothing to clean up; forked dataloader workers do not inherit it.

Only EAGAIN/EACCES from ``lockf`` mean another process holds the lock. Some filesystems where multi-node
runs live (some Lustre and NFS set-ups) have no POSIX locks: ``lockf`` fails with ENOLCK, ENOSYS or
EOPNOTSUPP there. Then the run warns once that a second run here would not be refused and proceeds,
still writing its record (pid, host, start time) to the file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from lmpretrain.errors import OutputDirInUseError
from lmpretrain.run.distributed import broadcast_int

LOCK_FILE = ".lock"
HELD = {errno.EAGAIN, errno.EACCES}  # lockf's answers when another process holds the lock

logger = logging.getLogger(__name__)


def _try_lock(fd: int, path: Path) -> bool:
    """Take the lock; False when another process holds it. A filesystem without POSIX locks (ENOLCK,
    ENOSYS, EOPNOTSUPP) is warned about and counts as taken: refusing would stop every launch there."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in HELD:
            return False
        logger.warning(
            "cannot lock %s (%s: %s): this filesystem has no POSIX locks, so a second run started in this "
            "output dir would not be refused; the run goes on, make sure it is the only one here",
            path,
            errno.errorcode.get(err.errno, err.errno),
            err.strerror,
        )
    return True


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


@contextmanager
def run_lock(output_dir, state):
    """Hold the output dir's lock while the block runs; every rank calls it (rank 0 takes the lock).

    Raises OutputDirInUseError on every rank when another live run holds it.
    """
    path = Path(output_dir) / LOCK_FILE
    fd = None
    holder_pid = 0
    if state.is_main_process:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if not _try_lock(fd, path):
            os.close(fd)
            fd = None
            holder_pid = int(_holder(path).get("pid") or -1)  # -1: it has not written its record yet
    holder_pid = broadcast_int(holder_pid, state)  # 0: rank 0 holds the lock
    if holder_pid != 0:
        info = _holder(path) if state.is_main_process else {}
        who = f"pid {holder_pid}" if holder_pid > 0 else "pid unknown"
        where = f" on {info['host']}" if info.get("host") else ""
        since = f", started {info['started']}" if info.get("started") else ""
        raise OutputDirInUseError(
            f"run.output_dir {str(output_dir)!r} is in use by another live run ({who}{where}{since}): "
            "two runs would write the same checkpoints. Wait for it to finish or stop it, or pick another "
            "--run.output_dir."
        )
    try:
        if fd is not None:
            record = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock
