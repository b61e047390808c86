"""SIGTERM/SIGINT -> finish the current optimizer step, save a checkpoint, exit 0; and ranks that stop
when their launcher dies.

The first signal only sets a flag; the recipe combines ``received`` over ranks once per optimizer step
(in train_step's one device read; ``should_stop`` is the same answer as a collective of its own), which
agrees across ranks, so every rank saves the same step. A second signal exits at once: the atomic
checkpoint protocol guarantees the last complete checkpoint stays loadable whatever we interrupt.

A launcher (`accelerate launch`, torchrun) forwards SIGTERM to its ranks and SIGKILLs them after a grace
period: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, 30 unless set (`launcher_grace_s`).
"""

import os
import signal
import threading
import time

import psutil

from lmpretrain.run.distributed import any_rank

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Parent command lines that mean "a launcher that owns this process" (not a shell or a scheduler).
_LAUNCHERS = ("accelerate", "torchrun", "torch.distributed.run", "torch.distributed.launch")
_DEFAULT_GRACE_S = 30  # torch elastic's default (torch/distributed/launcher/api.py)


def _say(line: str) -> None:
    # os.write, not print: a signal handler may interrupt a print already holding stderr's buffer.
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class PreemptionHandler:
    """Installs SIGTERM/SIGINT handlers (main thread only); ``restore()`` or ``with`` puts the old back.

    ``duplicate_window_s``: a repeat within this many seconds of the first signal counts as the same
    request, because launchers forward a Ctrl-C that the workers also received directly (torchrun /
    accelerate launch send SIGINT on to their children). A later repeat exits at once.
    """

    def __init__(self, *, verbose: bool = True, duplicate_window_s: float = 1.0):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "PreemptionHandler must be created in the main thread (Python delivers signals only there)"
            )
        self.verbose = verbose
        self.duplicate_window_s = duplicate_window_s
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    @property
    def received(self) -> bool:
        """Whether this process got a stop signal (``should_stop`` is the cross-rank answer)."""
        return self.signal_name is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal_name is None:
            self.signal_name, self._first_at = name, time.monotonic()
            if self.verbose:
                _say(f"received {name}: will save after this step and exit (send it again to exit at once)")
        elif time.monotonic() - self._first_at >= self.duplicate_window_s:
            _say(f"received {name} again: exiting now without saving; the last complete checkpoint is intact")
            os._exit(128 + signum)

    def should_stop(self, accelerator) -> bool:
        """True on every rank when any rank was signalled; call it once per optimizer step on all ranks."""
        return any_rank(self.received, accelerator)

    def restore(self) -> None:
        """Put back the handlers that were installed before this one."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> "PreemptionHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def launcher_grace_s() -> int:
    """Seconds between the launcher's SIGTERM to the ranks and its SIGKILL (torch elastic's shutdown timeout)."""
    return int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", _DEFAULT_GRACE_S))


def _launcher_pid() -> int | None:
    """The parent's pid when the parent is `accelerate launch` or torchrun, else None."""
    try:
        cmdline = " ".join(psutil.Process(os.getppid()).cmdline())
    except (psutil.Error, OSError):
        return None
    return os.getppid() if any(name in cmdline for name in _LAUNCHERS) else None


def watch_launcher(interval_s: float = 0.5) -> bool:
    """Stop this rank if the launcher that started it dies; returns whether there is a launcher to watch.

    torchrun starts ranks in their own sessions, so a launcher killed with SIGKILL (and accelerate's
    one-process launcher killed by any signal, which it does not forward) leaves its ranks training as
    orphans, writing checkpoints next to a relaunched run. When the parent goes, the rank signals itself
    SIGTERM: it finishes its step, saves and exits like a preempted run (every rank sees the launcher go).
    If it is still alive after the launcher's own grace period (a rank that died leaves the others
    unable to save), it exits at once; the last complete checkpoint is intact. A run started without a
    launcher (python, nohup) is not watched.
    """
    launcher = _launcher_pid()
    if launcher is None:
        return False

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(interval_s)
        grace = launcher_grace_s()
        _say(
            f"[lmpretrain] the launcher (pid {launcher}) is gone: stopping as on SIGTERM (save, then exit; "
            f"exit without saving in {grace} s)"
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        _say("[lmpretrain] the save after the launcher died did not finish: exiting without it")
        os._exit(1)

    threading.Thread(target=watch, name="lmpretrain-launcher-watch", daemon=True).start()
    return True
