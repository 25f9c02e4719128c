"""Flags: the typed errors, the marker for flags a resumed run may change, checks, the CLI entry.

Library code raises `UsageError` (bad input) or `RunError` (a run that cannot go on: a full disk, divergence);
only `run_cli` turns them into what a user sees: one `error:` line, exit code 2 (like argparse) or 1.
"""

import dataclasses
import math
import errno
import os
import re
import sys
import typing
from typing import Annotated, TypeVar

import tyro

T = TypeVar("T")


class UsageError(ValueError):
    """Bad input, named by its flag: `run_cli` prints it as one `error:` line and exits with code 2."""


class RunError(RuntimeError):
    """A run that cannot go on (disk full, permission denied, divergence): one `error:` line, exit code 1."""


def os_error_line(error: OSError, doing: str = "cannot write") -> str:
    """An OSError as one line with the path and the cause, e.g. "cannot write runs/x/f: No space left on device"."""
    path = error.filename or "?"
    cause = error.strerror or errno.errorcode.get(error.errno, str(error))
    return f"{doing} {path}: {cause}"


class _RunSetting:
    def __repr__(self):
        return "RunSetting"


RUN_SETTING = _RunSetting()
RunSetting = Annotated[T, RUN_SETTING]
"""Marks a flag that says where and how a run runs (devices, logging, checkpoint and evaluation settings), not
what it computes: a resumed run may change it. Every other flag must match the checkpoint's value."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def settable_flags(args) -> dict:
    """The flags a user sets (the init fields of the dataclass); runtime values (init=False) are not flags."""
    return {field.name: getattr(args, field.name) for field in dataclasses.fields(args) if field.init}


def computation_flags(args) -> dict:
    """The flags that shape the computation: every settable flag not marked `RunSetting`."""
    hints = typing.get_type_hints(type(args), include_extras=True)
    return {name: value for name, value in settable_flags(args).items()
            if RUN_SETTING not in getattr(hints[name], "__metadata__", ())}


def check_flags(args, *, positive_ints=(), non_negative_ints=(), positive=(), non_negative=(), unit_interval=(),
                positive_int_lists=(), device_id_lists=(), ranges=None):
    """Range checks by kind, each failing with the flag's name and what is allowed. Floats must be finite.
    `ranges`: {name: (low, high)}, both included (an upper bound where the OS or JAX has one)."""
    for name, (low, high) in (ranges or {}).items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise UsageError(f"{flag(name)} must be in [{low}, {high}], got {value}")
    for name in positive_ints:
        if getattr(args, name) <= 0:
            raise UsageError(f"{flag(name)} must be a positive integer, got {getattr(args, name)}")
    for name in non_negative_ints:
        if getattr(args, name) < 0:
            raise UsageError(f"{flag(name)} must be 0 (off / automatic) or a positive integer, got {getattr(args, name)}")
    for name in positive:
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise UsageError(f"{flag(name)} must be positive and finite, got {getattr(args, name)}")
    for name in non_negative:
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            raise UsageError(f"{flag(name)} must be non-negative and finite, got {getattr(args, name)}")
    for name in unit_interval:
        if not 0 <= getattr(args, name) <= 1:  # NaN fails too
            raise UsageError(f"{flag(name)} must be in [0, 1], got {getattr(args, name)}")
    for name in positive_int_lists:
        if not getattr(args, name) or min(getattr(args, name)) <= 0:
            raise UsageError(f"{flag(name)} must be one or more positive integers, got {getattr(args, name)}")
    for name in device_id_lists:
        ids = getattr(args, name)
        if not ids or min(ids) < 0 or max(ids) > MAX_DEVICE_ID or len(set(ids)) != len(ids):
            raise UsageError(f"{flag(name)} must be one or more distinct device ids in [0, {MAX_DEVICE_ID}], got {ids}")


MAX_DEVICE_ID = 63  # a host has at most a few dozen accelerators; on CPU, id N makes N + 1 host devices
MAX_SEED = 2**32 - 1  # NumPy's seed range
MAX_COUNT = 2**53  # counts of env steps (--total-timesteps, --buffer-size): exact as float64, within int64 everywhere
INT32_MAX = 2**31 - 1  # JAX without x64: counts and indices in compiled code (optimizer steps, replays) are int32
MAX_SECONDS = 86_400  # timeouts: at most a day
NAME = re.compile(r"[A-Za-z0-9._-]+")


def check_name(value: str | None, name: str):
    """Run and experiment names are one path component: letters, digits and `._-`, not `.` or `..`."""
    if value is not None and (not NAME.fullmatch(value) or value in (".", "..")):
        raise UsageError(f"{flag(name)} must be one folder name of letters, digits and ._- (not . or ..), got {value!r}")


def check_choice(name: str, value, choices):
    if value not in choices:
        raise UsageError(f"{flag(name)} must be one of {', '.join(map(str, choices))}, got {value!r}")


LEARNER_LOOPS = ("auto", "scan", "python")  # see cleanrl_utils.devices.learner_loop


def run_cli(main, args_class, argv: list[str] | None = None):
    """Parse the flags with tyro and run `main(args)`; a `UsageError` becomes one `error:` line and exit code 2.

    A `RunError` or an `OSError` (disk full, permission denied, read-only) is one line with exit code 1.
    After jax.distributed has started, the exit skips the interpreter's shutdown: its exit barrier would wait
    for peers that may still be training (they stop with their own error, or when their heartbeat times out).
    """
    args = tyro.cli(args_class, args=argv)
    try:
        return main(args)
    except (UsageError, RunError, OSError) as error:
        code = 2 if isinstance(error, UsageError) else 1
        print(f"error: {os_error_line(error) if isinstance(error, OSError) else error}", file=sys.stderr, flush=True)
        from cleanrl_utils import devices

        if devices.distributed_started():
            sys.stdout.flush()
            os._exit(code)
        sys.exit(code)


def check_run_flags(args):
    """The flags every script shares (logging, checkpoints, devices, processes): checked before JAX starts."""
    check_flags(args, positive_ints=["log_frequency", "checkpoint_keep", "eval_episodes"],
                non_negative_ints=["checkpoint_frequency"], device_id_lists=["actor_device_ids", "learner_device_ids"],
                ranges={"seed": (0, MAX_SEED), "total_timesteps": (1, MAX_COUNT),
                        "envpool_threads": (0, os.cpu_count()), "queue_timeout": (0.001, 3600),
                        "heartbeat_timeout": (1, MAX_SECONDS), "num_processes": (1, 65_536), "process_id": (0, 65_535),
                        # the replay scripts' capacity: larger sizes are refused by devices.check_replay_fits
                        **({"buffer_size": (1, MAX_COUNT)} if hasattr(args, "buffer_size") else {})})
    check_name(args.run_name, "run_name")
    check_name(args.exp_name, "exp_name")
    if not args.distributed:
        for name in ["coordinator_address", "num_processes", "process_id"]:
            if getattr(args, name) is not None:
                raise UsageError(f"{flag(name)} needs --distributed (a run of several processes)")
    if hasattr(args, "learner_loop"):
        check_choice("learner_loop", args.learner_loop, LEARNER_LOOPS)
    if args.resume and args.run_name is None:
        raise UsageError("--resume needs --run-name: the name of the run to continue")
    if args.distributed and (args.coordinator_address is None) != (args.num_processes is None):
        raise UsageError("--coordinator-address and --num-processes go together (or neither, to auto-detect SLURM)")
    if args.process_id is not None and args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        raise UsageError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")


def check_int32_counts(args, counts: dict[str, tuple[str, int]]):
    """Counts that compiled code keeps in int32 and that grow by a number in every update, e.g. {"optimizer steps":
    ("--update-epochs x --num-minibatches", 16)} (the step count an optax learning-rate schedule reads): after
    `args.num_updates` updates each must still fit int32, else it overflows (a Python int too large for a compiled
    schedule is an OverflowError) or wraps. A UsageError names --total-timesteps and the largest value allowed with
    the run's batch size, or the flags of a count too large for a single update. Call it once `args.num_updates` and
    `args.batch_size` are known."""
    for what, (flags, per_update) in counts.items():
        if per_update > INT32_MAX:
            raise UsageError(f"{flags} ({what} per update) must be at most {INT32_MAX}: they are counted in int32, "
                             f"got {per_update}")
    what, (flags, per_update) = min(counts.items(), key=lambda count: INT32_MAX // max(count[1][1], 1))
    largest_updates = INT32_MAX // max(per_update, 1)
    if args.num_updates > largest_updates:
        raise UsageError(f"--total-timesteps ({args.total_timesteps}) must be at most "
                         f"{(largest_updates + 1) * args.batch_size - 1} with {args.batch_size} env steps per update: "
                         f"{what} ({flags} = {per_update} per update) are counted in int32, at most {INT32_MAX} in a "
                         "run")
