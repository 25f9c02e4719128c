"""Flags: the ones every script shares (`RunArgs`; `DeviceArgs`, the learner's devices and the run's processes; then
`SebulbaArgs` with the actor threads, or `AnakinArgs`: a script's `Args` extends one), the marker for flags a resumed
run may change (`RunSetting`), and the range checks, each failing with a `UsageError` that names the flag and what is
allowed.
"""

import dataclasses
import math
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from cleanrl_utils.errors import UsageError

T = TypeVar("T")


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
    return {
        name: value
        for name, value in settable_flags(args).items()
        if RUN_SETTING not in getattr(hints[name], "__metadata__", ())
    }


def check_flags(
    args,
    *,
    positive_ints=(),
    non_negative_ints=(),
    positive=(),
    non_negative=(),
    unit_interval=(),
    positive_int_lists=(),
    device_id_lists=(),
    ranges=None,
):
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
            raise UsageError(
                f"{flag(name)} must be 0 (off / automatic) or a positive integer, got {getattr(args, name)}"
            )
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
        raise UsageError(
            f"{flag(name)} must be one folder name of letters, digits and ._- (not . or ..), got {value!r}"
        )


def check_run_flags(args):
    """The flags every script shares (logging, checkpoints, devices, processes; a Sebulba script's actor threads):
    checked before JAX starts."""
    sebulba = isinstance(args, SebulbaArgs)
    check_flags(
        args,
        positive_ints=["log_frequency", "checkpoint_keep", "eval_episodes"]
        + (["num_actor_threads"] if sebulba else []),
        non_negative_ints=["checkpoint_frequency"],
        device_id_lists=(["actor_device_ids"] if sebulba else []) + ["learner_device_ids"],
        ranges={
            "seed": (0, MAX_SEED),
            "total_timesteps": (1, MAX_COUNT),
            **({"envpool_threads": (0, os.cpu_count()), "queue_timeout": (0.001, 3600)} if sebulba else {}),
            "heartbeat_timeout": (1, MAX_SECONDS),
            "num_processes": (1, 65_536),
            "process_id": (0, 65_535),
            # the replay scripts' capacity: larger sizes are refused by replay_sizing.check_replay_fits
            **({"buffer_size": (1, MAX_COUNT)} if hasattr(args, "buffer_size") else {}),
        },
    )
    check_name(args.run_name, "run_name")
    check_name(args.exp_name, "exp_name")
    if isinstance(args, AnakinArgs) and not 1 <= args.num_seeds <= MAX_SEED + 1 - args.seed:
        raise UsageError(
            f"--num-seeds must be a positive integer with --seed + --num-seeds - 1 at most {MAX_SEED}, got "
            f"{args.num_seeds} (--seed {args.seed})"
        )
    if not args.distributed:
        for name in ["coordinator_address", "num_processes", "process_id"]:
            if getattr(args, name) is not None:
                raise UsageError(f"{flag(name)} needs --distributed (a run of several processes)")
    if args.resume and args.run_name is None:
        raise UsageError("--resume needs --run-name: the name of the run to continue")
    if args.distributed and (args.coordinator_address is None) != (args.num_processes is None):
        raise UsageError("--coordinator-address and --num-processes go together (or neither, to auto-detect Slurm)")
    if args.process_id is not None and args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        raise UsageError(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")


def nearest_that_work(value: int, multiple: int, works: Callable[[int], bool] = lambda value: True) -> list[int]:
    """The multiples of `multiple` nearest to `value`, one below it and one above (within 1024 multiples each way),
    for which `works` holds: what an error suggests instead of `value`."""
    below = range((value - 1) // multiple * multiple, 0, -multiple)
    above = range((value // multiple + 1) * multiple, value + 1025 * multiple, multiple)
    found = [next((candidate for candidate in candidates if works(candidate)), None) for candidates in (below, above)]
    return [candidate for candidate in found if candidate is not None]


def suggestion(values: list[int]) -> str:
    """`nearest_that_work`'s values as the end of an error line (nothing when there are none)."""
    return f" (the nearest that work with the other flags: {' or '.join(map(str, values))})" if values else ""


def check_envs_split(args, works: Callable[[int], bool] = lambda envs: True):
    """Each actor thread sends each of its process's learner devices an equal share of its envs: --local-num-envs
    must be a multiple of the number of --learner-device-ids. The error names the nearest env counts that split and
    for which `works(envs)` holds: the script's other checks of the env count (whole minibatches, whole gradient
    steps), with the other flags as given."""
    learners = len(args.learner_device_ids)
    if args.local_num_envs % learners != 0:
        raise UsageError(
            f"--local-num-envs ({args.local_num_envs}) must be divisible by the number of --learner-device-ids "
            f"({learners}): each actor thread splits its envs over them"
            + suggestion(nearest_that_work(args.local_num_envs, learners, works))
        )


def check_int32_counts(args, counts: dict[str, tuple[str, int]]):
    """Counts that compiled code keeps in int32 and that grow by a number in every update, e.g. {"optimizer steps":
    ("--update-epochs x --num-minibatches", 16)} (the step count an optax learning-rate schedule reads): after
    `args.num_updates` updates each must still fit int32, else it overflows (a Python int too large for a compiled
    schedule is an OverflowError) or wraps. A UsageError names --total-timesteps and the largest value allowed with
    the run's batch size, or the flags of a count too large for a single update. Call it once `args.num_updates` and
    `args.batch_size` are known."""
    for what, (flags, per_update) in counts.items():
        if per_update > INT32_MAX:
            raise UsageError(
                f"{flags} ({what} per update) must be at most {INT32_MAX}: they are counted in int32, got {per_update}"
            )
    what, (flags, per_update) = min(counts.items(), key=lambda count: INT32_MAX // max(count[1][1], 1))
    largest_updates = INT32_MAX // max(per_update, 1)
    if args.num_updates > largest_updates:
        raise UsageError(
            f"--total-timesteps ({args.total_timesteps}) must be at most "
            f"{(largest_updates + 1) * args.batch_size - 1} with {args.batch_size} env steps per update: "
            f"{what} ({flags} = {per_update} per update) are counted in int32, at most {INT32_MAX} in a "
            "run"
        )


@dataclass
class RunArgs:
    """The run's settings, the same in every script. RunSetting[...]: where and how the run runs, not what it
    computes; a resumed run may change these flags."""

    exp_name: str | None = None
    """the name of this experiment (default: the script's file name without .py)"""
    seed: int = 1
    """seed of the experiment (in [0, 2**32 - 1])"""
    run_name: str | None = None
    """the run's folder under runs/ (default: {env_id}__{exp_name}__{seed}__{unix time})"""
    track: RunSetting[bool] = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: RunSetting[str] = "cleanba"
    """the wandb's project name"""
    wandb_entity: RunSetting[str | None] = None
    """the entity (team) of wandb's project"""
    save_model: RunSetting[bool] = False
    """whether to save the model (args + params) into runs/{run_name}/{exp_name}.cleanrl_model, then evaluate it"""
    eval_episodes: RunSetting[int] = 10
    """with --save-model: episodes of the evaluation of the saved model (TensorBoard: eval/episodic_return)
    (positive)"""
    eval_greedy: RunSetting[bool] = False
    """with --save-model: evaluate with the most likely action instead of sampling it"""
    capture_video: RunSetting[bool] = False
    """with --save-model: record the evaluation episodes of env 0 as MP4 files into videos/{run_name}/"""
    upload_model: RunSetting[bool] = False
    """with --save-model: upload the model, its card, this script and a video to the Hugging Face Hub"""
    hf_entity: RunSetting[str | None] = None
    """the Hub user or organization of the repo {hf_entity}/{env_id}-{exp_name}-seed{seed} (default: the token's
    user)"""
    log_frequency: RunSetting[int] = 10
    """print a console line every this many updates (TensorBoard gets every update) (positive)"""
    checkpoint_frequency: RunSetting[int] = 100
    """save the training state every this many updates (0: only at the end and on SIGTERM/SIGINT; non-negative)"""
    checkpoint_keep: RunSetting[int] = 3
    """how many of the newest checkpoints to keep (positive)"""
    checkpoint_dir: RunSetting[str | None] = None
    """the checkpoints' folder (default: runs/{run_name}/checkpoints); with --distributed, one folder that every
    process sees (a shared file system): checked at start"""
    resume: RunSetting[bool] = False
    """continue --run-name from its newest checkpoint (re-running a --run-name that has checkpoints resumes too)"""


@dataclass
class DeviceArgs(RunArgs):
    """The learner's devices and the run's processes (jax.distributed), and the values derived from them: the same in
    every script."""

    learner_device_ids: RunSetting[list[int]] = field(default_factory=lambda: [0])
    """the local device ids the data-parallel learner runs on (in every process) (distinct, in [0, 63])"""
    distributed: RunSetting[bool] = False
    """call jax.distributed.initialize() (Slurm is auto-detected; else use the three flags below)"""
    coordinator_address: RunSetting[str | None] = None
    """with --distributed outside Slurm: host:port of process 0"""
    num_processes: RunSetting[int | None] = None
    """with --distributed outside Slurm: the number of processes (in [1, 65536])"""
    process_id: RunSetting[int | None] = None
    """with --distributed outside Slurm: the id of this process, in [0, num_processes)"""
    heartbeat_timeout: RunSetting[int] = 30
    """with --distributed: seconds within which a process whose host went silent ends the run, and the longest
    wait for every process to start (in [1, 86400])"""

    # derived when the run starts (cleanrl_utils.run), not flags
    local_batch_size: int = field(init=False, default=0)
    """steps per update collected by this process"""
    batch_size: int = field(init=False, default=0)
    """steps per update over all processes"""
    global_num_envs: int = field(init=False, default=0)
    """envs over all processes: the learner's batch is global_num_envs x num_steps"""
    num_updates: int = field(init=False, default=0)
    """the number of learner updates"""
    world_size: int = field(init=False, default=1)
    """the number of processes"""
    local_rank: int = field(init=False, default=0)
    """this process's index"""


@dataclass
class SebulbaArgs(DeviceArgs):
    """The Sebulba flags: actor threads on actor devices, stepping envpool, one policy version behind the learner."""

    num_actor_threads: int = 2
    """the number of actor threads on each actor device (positive)"""
    envpool_threads: RunSetting[int] = 0
    """threads stepping each actor thread's envs (0: this process's cores but one, shared by its actor threads; in
    [0, this machine's cores])"""
    actor_device_ids: RunSetting[list[int]] = field(default_factory=lambda: [0])
    """the local device ids that actor threads run inference on (distinct, in [0, 63])"""
    concurrency: bool = True
    """actor acts one policy version behind while the learner learns; --no-concurrency: lag 0"""
    queue_timeout: RunSetting[float] = 1.0
    """seconds between checks for a stopped run while waiting on a queue (in [0.001, 3600])"""


@dataclass
class AnakinArgs(DeviceArgs):
    """Anakin: acting, the JAX-native envs and learning are one compiled program on each learner device; no actor
    threads, no queues (the actor is the learner's current policy, lag 0)."""

    num_seeds: int = 1
    """independent runs of these flags in one program, seeds --seed, --seed + 1, ...: each the run that its --seed
    alone gives; logged into runs/{run_name}/seed{seed} (positive)"""


def derive_batch_values(args: DeviceArgs, *, world_size: int, local_rank: int, env_copies: int, copies_flags: str):
    """The values every script derives from its flags and the device layout (a script adds its own): `env_copies`
    groups of --local-num-envs in this process (Sebulba: its actor threads; Anakin: its learner devices), named by
    `copies_flags` for the message."""
    args.world_size, args.local_rank = world_size, local_rank
    args.local_batch_size = args.local_num_envs * args.num_steps * env_copies
    args.batch_size = args.local_batch_size * world_size
    args.global_num_envs = args.local_num_envs * env_copies * world_size
    args.num_updates = args.total_timesteps // args.batch_size
    if args.num_updates < 1:
        raise UsageError(
            f"--total-timesteps ({args.total_timesteps}) is smaller than one batch ({args.batch_size} = "
            f"--local-num-envs x --num-steps x {copies_flags} x processes)"
        )
