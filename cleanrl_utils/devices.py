"""Device layout: host devices on CPU, `jax.distributed`, the learner mesh over every process, device-id checks.

The actor devices are local to each process; the learner devices are `--learner-device-ids` of *every* process,
in one 1-D mesh (axis "batch"), so the data-parallel learner spans all hosts.
"""

import math
import os
from dataclasses import dataclass

import numpy as np

from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import INT32_MAX, flag
from cleanrl_utils.processes import agree_on_flags, start_distributed


def ensure_host_devices(device_ids: list[int]):
    """CPU laptops: make enough host devices for the requested ids before JAX starts a backend.

    The flag only affects JAX's CPU platform, so it is harmless on GPU/TPU hosts. A count the user
    already set in XLA_FLAGS wins (appending never overwrites it); too few then fails the id check.
    """
    needed = max(device_ids) + 1
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if needed > 1 and "--xla_force_host_platform_device_count" not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={needed}".strip()


def envpool_num_threads(requested: int, actor_threads_per_process: int) -> int:
    """`--envpool-threads`, or this process's cores but one (left to the learner and inference) shared by its actor
    threads: on 2 cores, 1 thread instead of envpool's default (all cores) ran CartPole PPO 22% faster."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores - 1) // actor_threads_per_process)


@dataclass
class DeviceLayout:
    actor_devices: list  # this process's devices that run actor threads
    learner_devices: list  # this process's learner devices
    global_learner_devices: list  # the learner devices of every process, process-major: the mesh
    mesh: object  # jax.sharding.Mesh over global_learner_devices, axis "batch"
    world_size: int  # the number of processes
    local_rank: int  # this process's index

    @property
    def is_main_process(self) -> bool:
        return self.local_rank == 0


def device_layout(args) -> DeviceLayout:
    """Start jax.distributed if asked (`args.distributed`), then check the device ids against this process's
    devices. Call it after the flag checks: it starts JAX's backend."""
    actor_device_ids = getattr(args, "actor_device_ids", [])  # an Anakin script has none: it acts on its learners
    ensure_host_devices(actor_device_ids + args.learner_device_ids)
    import jax
    from jax.sharding import Mesh

    if args.distributed:
        start_distributed(args)  # cleanrl_utils/processes.py
        agree_on_flags(args)
    local_devices = jax.local_devices()
    for name, ids in [("actor_device_ids", actor_device_ids), ("learner_device_ids", args.learner_device_ids)]:
        if ids and max(ids) >= len(local_devices):
            raise UsageError(
                f"{flag(name)} {ids} out of range: this process has {len(local_devices)} "
                f"{local_devices[0].platform} device(s), ids 0..{len(local_devices) - 1}"
            )
    world_size = jax.process_count()
    global_learner_devices = [
        device
        for process in range(world_size)
        for i, device in enumerate(sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id))
        if i in args.learner_device_ids
    ]
    return DeviceLayout(
        actor_devices=[local_devices[i] for i in actor_device_ids],
        learner_devices=[local_devices[i] for i in args.learner_device_ids],
        global_learner_devices=global_learner_devices,
        mesh=Mesh(np.array(global_learner_devices), ("batch",)),
        world_size=world_size,
        local_rank=jax.process_index(),
    )


GIB = 2**30


def tree_bytes(tree) -> int:
    """The bytes of a tree of arrays or of `jax.ShapeDtypeStruct`s, in Python ints (no overflow at any size)."""
    import jax

    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def host_memory_bytes() -> int:
    """This host's physical memory, or the memory limit of this process's cgroup (a container) where lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]:  # cgroup v2, v1
        try:
            with open(path) as file:
                value = file.read().strip()
        except OSError:
            continue
        if value.isdigit():  # v2 says "max" when unlimited
            limit = min(limit, int(value))
    return limit


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


def replicate(tree, mesh):
    """Host values, identical in every process, to one replicated global array per leaf over the mesh (a typed PRNG
    key goes as its data, and is a key again on the mesh)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = NamedSharding(mesh, PartitionSpec())

    def replicated(x):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(replicated(jax.random.key_data(x)), impl=jax.random.key_impl(x))
        return jax.device_put(jax.device_get(x), sharding)

    return jax.tree.map(replicated, tree)


def local_value(tree):
    """This process's copy of a replicated (possibly multi-process) tree, as NumPy arrays."""
    import jax

    return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), tree)


def copies_for_devices(tree, devices: list) -> dict:
    """One copy of our shard of a replicated tree per device (e.g. the params, per actor device, shared by its
    threads); a copy even on a learner device, since the learner donates its buffers."""
    import jax

    local = jax.tree.map(lambda x: x.addressable_shards[0].data, tree)
    return {device: jax.device_put(local, device, may_alias=False) for device in devices}


def assemble_global_rollout(per_thread_storages: list, mesh, global_envs: int):
    """The learner's view of one update's rollouts: each actor thread's parts (one per local learner device, env axis
    1) concatenated on their device, then viewed as one global array over the learner devices of every process (env
    axis sharded, device-major)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    per_device = [  # per_thread_storages[thread][device] -> one rollout per local learner device
        jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *storages) for storages in zip(*per_thread_storages)
    ]

    def to_global(*shards):
        shape = (shards[0].shape[0], global_envs, *shards[0].shape[2:])
        sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
        return jax.make_array_from_single_device_arrays(shape, sharding, list(shards))

    return jax.tree.map(to_global, *per_device)
