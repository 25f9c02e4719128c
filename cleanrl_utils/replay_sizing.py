"""Replay memory: whether `--buffer-size` fits the learner devices (bytes of the replay shard against XLA's limit on
GPU/TPU, the host's memory on CPU) and flashbax's int32 indices, before any replay is allocated."""

import math
import os

import numpy as np

from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import INT32_MAX, check_envs_split, nearest_that_work, suggestion
from cleanrl_utils.memory import own_cgroup_memory

GIB = 2**30


def tree_bytes(tree) -> int:
    """The bytes of a tree of arrays or of `jax.ShapeDtypeStruct`s, in Python ints (no overflow at any size)."""
    import jax

    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def host_memory_bytes() -> int:
    """This host's physical memory, or the memory limit of this process's cgroups (a container, a Slurm job) where
    lower."""
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min([physical] + [limit for limit, _ in own_cgroup_memory()])


def device_memory_bytes(device) -> int | None:
    """The most memory XLA may allocate on `device` (its allocator's `bytes_limit`: GPU, TPU), None where the device
    does not say (CPU: its arrays are in the host's memory)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


def check_replay_fits(buffer_size: int, init, item, learner_devices: list, new_rows: int):
    """--buffer-size against this process's learner devices, before any replay is allocated (else a huge size is a
    RESOURCE_EXHAUSTED traceback, or an int32 overflow in compiled code): a UsageError, one line.

    `init(item)` makes one learner device's replay shard (a flashbax buffer's `init`); only its shapes are computed
    (jax.eval_shape), in Python ints, so no size overflows before the check. The shard must fit in the memory of
    each learner device: XLA's `bytes_limit` on GPU and TPU; on CPU the host's physical memory (or the cgroup's
    limit), shared by the process's CPU learner devices. Physical memory, not what is free now (MemAvailable): it is
    the same kind of bound as the GPU's limit, the most the device can ever hold, and it gives the same answer for the
    same flags on the same machine (a resume is not refused because other programs hold memory at that moment); a
    replay above it can never be allocated. Each axis of the shard, plus the `new_rows` an update writes into it,
    must fit flashbax's int32 indices."""
    import jax

    shard = jax.eval_shape(init, item)
    need = tree_bytes(shard)
    limits = [
        (device_memory_bytes(device), device, "XLA's memory limit on it")
        for device in learner_devices
        if device.platform != "cpu"
    ]
    cpus = [device for device in learner_devices if device.platform == "cpu"]
    if cpus:
        host = host_memory_bytes()
        shared = (
            f", {host / GIB:,.1f} GiB, shared by this process's {len(cpus)} CPU learner devices"
            if len(cpus) > 1
            else ""
        )
        limits.append((host // len(cpus), cpus[0], f"the host's memory{shared}"))
    known = [limit for limit in limits if limit[0] is not None]
    if known and need > min(limit[0] for limit in known):
        limit, device, what = min(known, key=lambda limit: limit[0])
        raise UsageError(
            f"--buffer-size ({buffer_size}) needs {need / GIB:,.1f} GiB of replay on each learner device; "
            f"device {device} has {limit / GIB:,.1f} GiB ({what}): lower --buffer-size (about "
            f"{buffer_size * limit // need} fit){'' if cpus else ' or use more learner devices'}"
        )
    largest = max((max(leaf.shape, default=0) for leaf in jax.tree.leaves(shard)), default=0)
    if largest + new_rows > INT32_MAX:
        raise UsageError(
            f"--buffer-size ({buffer_size}) makes replay arrays of {largest} rows on each learner "
            f"device (+ {new_rows} written per update); their indices are int32, at most {INT32_MAX}: "
            f"lower --buffer-size (about {max(0, buffer_size * (INT32_MAX - new_rows) // largest)} fit)"
        )


def whole_gradient_steps(replay_ratio: float, batch_size: int) -> bool:
    """Whether --replay-ratio x env steps per update is a positive whole number of gradient steps."""
    gradient_steps = replay_ratio * batch_size
    return round(gradient_steps) >= 1 and abs(gradient_steps - round(gradient_steps)) <= 1e-6


def check_replay_envs_split(args):
    """`check_envs_split` for a replay script: the env counts its error suggests give a whole number of gradient
    steps per update too (with one process, so with any number of processes)."""
    threads = len(args.actor_device_ids) * args.num_actor_threads
    check_envs_split(args, lambda envs: whole_gradient_steps(args.replay_ratio, threads * envs * args.num_steps))


def gradient_steps_per_update(replay_ratio: float, batch_size: int) -> int:
    """--replay-ratio x env steps per update, a positive whole number (a UsageError otherwise): the gradient steps of
    an update, the same on any layout with the same global batch, so a seed reproduces a run."""
    if not whole_gradient_steps(replay_ratio, batch_size):
        raise UsageError(
            f"--replay-ratio ({replay_ratio}) x env steps per update ({batch_size}) must be a positive whole number "
            "of gradient steps"
        )
    return round(replay_ratio * batch_size)


def check_minibatch_split(minibatch_size: int, num_learner_devices: int):
    """Each learner device samples an equal share of every minibatch from its replay shard."""
    if minibatch_size % num_learner_devices != 0:
        raise UsageError(
            f"--minibatch-size ({minibatch_size}) must be divisible by the number of learner devices of all "
            f"processes ({num_learner_devices}): each samples its share"
            + suggestion(nearest_that_work(minibatch_size, num_learner_devices))
        )
