"""The ways a run ends early, as typed errors: library code raises them, and only the CLI entry
(`cleanrl_utils.cli.run_cli`) turns them into what a user sees: one `error:` line and an exit code."""

import errno


class UsageError(ValueError):
    """Bad input, named by its flag: one `error:` line, exit code 2 (like argparse)."""


class RunError(RuntimeError):
    """A run that cannot go on (disk full, permission denied, divergence): one `error:` line, exit code 1."""


def os_error_line(error: OSError, doing: str = "cannot write") -> str:
    """An OSError as one line with the path and the cause, e.g. "cannot write runs/x/f: No space left on device"."""
    path = error.filename or "?"
    cause = error.strerror or errno.errorcode.get(error.errno, str(error))
    return f"{doing} {path}: {cause}"


def error_line(error: BaseException) -> str | None:
    """The one line a typed error is shown as (None: not a typed error, its traceback is shown)."""
    if isinstance(error, OSError):
        return os_error_line(error)
    if isinstance(error, (UsageError, RunError)):
        return str(error)
    return None


def exit_code(error: BaseException) -> int:
    return 2 if isinstance(error, UsageError) else 1
