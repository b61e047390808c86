"""`python -m lmpretrain.launch ...` is `accelerate launch ...` (same arguments, same launchers) whose
run, when it stops on a user error, ends on that error's message and exit code 2.

`accelerate launch` follows a failed process with its own traceback: a CalledProcessError for one
process, torch elastic's ChildFailedError summary for several (`--quiet` only covers the former). So
the recipe hands its message over through torch elastic's error file (TORCHELASTIC_ERROR_FILE, which
torch elastic sets for each rank, and this launcher for a single process) instead of printing it, and
this launcher prints the first failed rank's message last. So does accelerate's refusal of a coordinator
port another process holds (`main_process_port` on machine 0 of several; one machine takes a free port
instead, with a warning). torch elastic's own `failed (exitcode: 2) ...` log line for that rank is held
back, and shown only when the failure turns out not to be a user error. Any other failure keeps
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

import psutil

from lmpretrain.errors import UserError

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def report_user_error(err: UserError) -> int:
    """Hand a user error's message to the launcher (torch elastic's error file) or print it; returns
    the exit code. Called once, by the recipe's entry point (run/runtime.py's exit_after)."""
    message = f"error: {err}"
    path = os.environ.get(ERROR_FILE_ENV)
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    # torch elastic shows the error file only when the job fails; one it restarts shows none
    if path and restarts_left <= 0:
        try:
            with open(path, "w", encoding="utf-8") as f:
                # A plain-string message: torch elastic's summary shows it as is (no Python traceback).
                json.dump({"message": message, "timestamp": int(time.time())}, f)
            return err.exit_code
        except OSError:
            pass  # say it here instead
    print(message, file=sys.stderr, flush=True)
    return err.exit_code


def _read_message(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            message = json.load(f).get("message")
    except (OSError, ValueError, AttributeError):
        return None
    return message if isinstance(message, str) and message.startswith("error: ") else None


class _HeldFailureLines(logging.Filter):
    """Holds torch elastic's `failed (exitcode: 2) local_rank: ...` log line: above a rank's user error it would
    be the last thing on screen but one; `release()` shows it when the failure is something else."""

    LOGGER = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []
        logging.getLogger(self.LOGGER).addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        user_error = isinstance(record.args, tuple) and record.args[:1] == (UserError.exit_code,)
        if str(record.msg).startswith("failed (exitcode") and user_error:
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
            print(
                f"[lmpretrain] the launcher stopped on {err.sigval.name} after passing it to its ranks (they "
                "save after their step; the last complete checkpoint is intact either way)",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + err.sigval)
        except ChildFailedError as err:
            _, failure = err.get_first_failure()
            message = failure.message if failure.exitcode == code else None
            if not isinstance(message, str) or not message.startswith("error: "):
                failure_lines.release()
                raise
        except BaseException:
            failure_lines.release()
            raise
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
