"""`python -m lmpretrain.launch ...` is `accelerate launch ...` (same arguments, same launchers) whose
run, when it stops on a user error, ends on that error's message and exit code 2.

`accelerate launch` follows a failed process with its own traceback: a CalledProcessError for one
process, torch elastic's ChildFailedError summary for several (`--quiet` only covers the former). So
the recipe hands its message over through torch elastic's error file (TORCHELASTIC_ERROR_FILE, which
torch elastic sets for each rank, and this launcher for a single process) instead of printing it, and
this launcher prints the earliest user error's message last (user_error_message). So does accelerate's
refusal of a coordinator port another process holds (`main_process_port` on machine 0 of several; one
machine takes a free port instead, with a warning). torch elastic's own `failed (exitcode: N) ...` log line
is held back, as are its `Sending process N closing signal SIGTERM` lines for the ranks still running when
one failed, and they are shown only when the failure turns out not to be a user error. Any other failure keeps
accelerate's traceback. Under plain `accelerate launch` with several processes the message shows in torch
elastic's summary, as that rank's "traceback".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import psutil

from lmpretrain.errors import UserError

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def report_user_error(err: UserError) -> int:
    """Hand a user error's message to the launcher (torch elastic's error file) or print it; returns
    the exit code. Called once, by the recipe's entry point (run/runtime.py's exit_after)."""
    message = f"error: {err}"
    path = os.environ.get(ERROR_FILE_ENV)
    # torch elastic shows the error file only when the job fails; one it restarts shows none
    if path and _restarts_left() <= 0:
        try:
            with open(path, "w", encoding="utf-8") as f:
                # A plain-string message: torch elastic's summary shows it as is (no Python traceback).
                json.dump({"message": message, "timestamp": int(time.time())}, f)
            return err.exit_code
        except OSError:
            pass  # say it here instead
    print(message, file=sys.stderr, flush=True)
    return err.exit_code


# What a collective says when another rank of the process group went away (gloo; NCCL's own words)
LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def _restarts_left() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )


def lost_a_peer(err: BaseException) -> bool:
    """Whether `err` is a collective of several ranks that failed because another rank went away: what the
    others meet when one rank stops on a user error while they wait for it in a collective."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > 1 and isinstance(err, RuntimeError) and any(words in str(err) for words in LOST_PEER)


def report_lost_peer(err: BaseException) -> int | None:
    """For a rank whose collective failed because another rank went away (lost_a_peer): its traceback goes into
    torch elastic's error file, in torch elastic's own format, instead of onto the screen, and the exit code is
    1. The launcher then shows that traceback in torch elastic's summary, unless another rank stopped on a user
    error, whose one message is then alone on screen. None (raise as usual): another error, no error file
    (not under torch elastic), or restarts to come."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or _restarts_left() > 0 or not lost_a_peer(err):
        return None
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(err)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        return None
    return 1


def _read_message(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            message = json.load(f).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    return message if isinstance(message, str) and message.startswith("error: ") else None


def user_error_message(failures: dict) -> str | None:
    """The message of the earliest rank that stopped on a user error (exit code 2 and an `error: ` message in
    its error file), or None. A rank stopped on one while the others waited in a collective: they fail a moment
    later with the lost connection (exit code 1), and torch elastic may record one of them first (its failures'
    timestamps are whole seconds), so the user error is looked for among all failures, not only the first."""
    for failure in sorted(failures.values(), key=lambda f: f.timestamp):
        message = failure.message
        if (
            failure.exitcode == UserError.exit_code
            and isinstance(message, str)
            and message.startswith("error: ")
        ):
            return message
    return None


class _HeldFailureLines(logging.Filter):
    """Holds torch elastic's `failed (exitcode: N) local_rank: ...` log line, and its `Sending process N
    closing signal SIGTERM` lines (the ranks still running when one failed, stopped before that line): above a
    rank's user error they would be the last things on screen but one; `release()` shows them when the
    failure is something else (or the launcher was signalled). The `failed` line names the earliest failure,
    which may be a rank that lost its peer in a collective (exit code 1) rather than the user error."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []
        logging.getLogger(self.LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(("failed (exitcode", "Sending process")):
            self.held.append(record)
            return False
        return True

    def release(self) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeFilter(self)
        for record in self.held:
            logger.handle(record)
        self.held = []


def _pass_on(signum, frame) -> None:
    """SIGTERM to the launcher: to its child processes (the ranks) as well, and the launcher waits on."""
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)


def main(argv: list[str] | None = None) -> None:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = launch_command_parser().parse_args(argv)
    code = UserError.exit_code
    failure_lines = _HeldFailureLines()
    # Torch elastic's agent installs its own handler when it starts the ranks (it passes SIGTERM on too).
    signal.signal(signal.SIGTERM, _pass_on)
    with tempfile.TemporaryDirectory(prefix="lmpretrain-launch-") as tmp:
        # A single process is started by accelerate's simple launcher, which sets no error file;
        # torch elastic replaces this one with its own per rank.
        error_file = os.path.join(tmp, "error.json")
        os.environ[ERROR_FILE_ENV] = error_file
        try:
            launch_command(args)
            failure_lines.release()
            return
        except ConnectionError as err:  # the first machine's coordinator port is taken (several machines)
            message = f"error: {err}"
        except (subprocess.CalledProcessError, SystemExit):  # one process (SystemExit: with --quiet)
            message = _read_message(error_file)
            if message is None:
                failure_lines.release()
                raise
        except SignalException as err:  # torch elastic's agent, signalled: its ranks had their grace to save
            failure_lines.release()
            print(
                f"[lmpretrain] the launcher stopped on {err.sigval.name} after passing it to its ranks (they "
                "save after their step; the last complete checkpoint is intact either way)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + err.sigval)
        except ChildFailedError as err:
            message = user_error_message(err.failures)
            if message is None:
                failure_lines.release()
                raise
        except BaseException:
            failure_lines.release()
            raise
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
