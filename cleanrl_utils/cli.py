"""The CLI entry of every script and tool (`run_cli`), the only place a process exits, and bad input as one line
(`fail`; `read_input` for a file the user named).

Library code raises typed errors (cleanrl_utils.errors); `run_cli` prints a `UsageError` as one `error:` line with
exit code 2 (like argparse), a `RunError` or an `OSError` (disk full, permission denied) as one line with exit code 1,
and a bad flag value or choice (tyro's parse errors) as one `error:` line with exit code 2 too. After jax.distributed
has started, a failed process ends at once (cleanrl_utils.processes.exit_process, the one other place a process
exits): the interpreter's exit barrier would wait for peers that
may still be training (they stop with their own error, or when their heartbeat times out); a failure in a collective
because a peer ended first is one line naming that peer (cleanrl_utils/liveness.py).
"""

import contextlib
import io
import sys
import traceback
from pathlib import Path
from typing import NoReturn

import tyro

from cleanrl_utils.errors import UsageError, error_line, exit_code
from cleanrl_utils.liveness import outlive_peers, peer_failure_line
from cleanrl_utils.processes import distributed_started, exit_process


def fail(message: str) -> NoReturn:
    raise UsageError(message)  # the CLI entry prints it as one `error:` line, exit code 2


def read_input(path, flag: str, expected: str) -> str:
    """The text of a file the user named with `flag`. A missing, unreadable or binary one is bad input (exit code 2,
    the flag named), not a failed write nor a UnicodeDecodeError's traceback."""
    try:
        return Path(path).read_text()
    except OSError as error:
        fail(f"{flag} {path}: {error.strerror or error}; expected {expected}")
    except UnicodeDecodeError:
        fail(f"{flag} {path}: not UTF-8 text; expected {expected}")


def parse_flags(args_class, argv: list[str] | None = None):
    """tyro's parse, with a parse error (a bad value, an unknown flag or choice) as one `error:` line, exit code 2;
    `--help` prints tyro's help as usual."""
    output = io.StringIO()
    try:
        with contextlib.redirect_stderr(output), contextlib.redirect_stdout(output):
            args = tyro.cli(args_class, args=argv, console_outputs=False)
    except SystemExit as parse_exit:
        if parse_exit.code == 0:  # --help: printed this time
            return tyro.cli(args_class, args=argv)
        with contextlib.redirect_stderr(output), contextlib.redirect_stdout(output), contextlib.suppress(SystemExit):
            tyro.cli(args_class, args=argv)  # the error's text, held
        print(f"error: {tyro_error_message(output.getvalue())}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.stderr.write(output.getvalue())  # e.g. warnings
    return args


def tyro_error_message(box: str) -> str:
    """The message of a tyro error box (as printed without a terminal: a title, a rule, the message, a rule, ...)."""
    lines = [line.strip() for line in box.splitlines()]
    rules = [i for i, line in enumerate(lines) if line and set(line) <= set("-─")]
    if len(rules) < 2:
        return " ".join(line for line in lines if line) or "bad flags (see --help)"
    message = " ".join(line for line in lines[rules[0] + 1 : rules[1]] if line)
    return f"{message} (see --help)"


def run_cli(main, args_class, argv: list[str] | None = None):
    """Parse the flags with tyro and return `main(args)` (an exit code); typed errors become one line (see above)."""
    return run_main(main, parse_flags(args_class, argv))


def run_main(main, *args):
    """Return `main(*args)` (an exit code), typed errors as one line (see above): the entry of a tool that parses its
    own flags (benchmark/train_in_parts.py: argparse, whose errors it raises as UsageError)."""
    try:
        return main(*args)
    except BaseException as error:
        line = error_line(error)
        if distributed_started():
            if isinstance(error, UsageError):  # every process finds it: each prints its line, process 0 ends last
                print(f"error: {line}", file=sys.stderr, flush=True)
                outlive_peers()
                exit_process(exit_code(error))
            peer_line = peer_failure_line()  # a collective that failed because a peer ended: name it
            if peer_line is not None:
                exit_process(1, peer_line)
            if line is None:
                traceback.print_exc()
            exit_process(exit_code(error), line)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.exit(exit_code(error))
