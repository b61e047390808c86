"""One family for every failure a user has to fix (a config, a launch, data, a checkpoint, a run that
diverged). The recipe catches `UserError` once, prints its message and exits 2 with no traceback;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; the message says what to do. Exit code 2."""

    exit_code = 2


class ConfigError(UserError):
    """A config problem; the message lists every problem found, so all are fixed at once."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{len(problems)} problem(s) in {source}:\n{lines}")


class LaunchError(UserError):
    """The processes that started are not the ones that were asked for."""


class OutputDirInUseError(UserError):
    """Another live run holds the output dir (two runs would write the same checkpoints)."""


class DataError(UserError):
    """Bad data configuration or input; the message names the file/field and the fix."""


class TokenizerError(UserError):
    """A tokenizer cannot be loaded or lacks what the data pipeline needs."""


class PrecisionUnavailableError(UserError):
    """The requested precision would silently run as something else on this device."""


class CheckpointError(UserError):
    """A checkpoint cannot be written, found or loaded; the message says what to do."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was written by a run whose fingerprint differs from this one."""


class TrainingDiverged(UserError):
    """Too many consecutive steps had a non-finite loss or gradient; the message says what to change."""
