"""Device layout: host devices on CPU, the layout of a run's devices (`device_layout`: jax.distributed started by
cleanrl_utils/processes.py and watched by cleanrl_utils/liveness.py, the learner mesh built by
cleanrl_utils/data_path.py, the device-id checks), envpool threads, and moving replicated trees between the mesh,
the actor devices and the host.

The actor devices are local to each process; the learner devices are `--learner-device-ids` of *every* process,
in one 1-D mesh (axis "batch"), so the data-parallel learner spans all hosts.
"""

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cleanrl_utils.agreement import agree_on_flags
from cleanrl_utils.data_path import learner_mesh
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import flag
from cleanrl_utils.liveness import start_watching
from cleanrl_utils.processes import start_distributed


def ensure_host_devices(actor_device_ids: list[int], learner_device_ids: list[int], actor_threads: int):
    """CPU laptops: make enough host devices for the requested ids before JAX starts a backend, and, where the learner
    spans several of them, enough threads for their collectives (`collective_threads`).

    The flag only affects JAX's CPU platform, so it is harmless on GPU/TPU hosts. A count the user
    already set in XLA_FLAGS wins (appending never overwrites it); too few then fails the id check.
    """
    needed = max(actor_device_ids + learner_device_ids) + 1
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if needed > 1 and "--xla_force_host_platform_device_count" not in xla_flags:
        os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={needed}".strip()
    if len(learner_device_ids) > 1 and not (os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")):
        os.environ["PJRT_NPROC"] = str(collective_threads(needed, actor_threads, len(os.sched_getaffinity(0))))


def collective_threads(host_devices: int, actor_threads: int, cores: int) -> int:
    """The threads of XLA's CPU client (`PJRT_NPROC`; by default its pool has max(cores, devices) threads, and so has
    its intra-op pool) for a learner on several host devices. The pool runs every device's programs, and a device's
    part of a collective holds its thread until every device has joined. A device with 32 programs queued (XLA's
    in-flight limit; a PPO update with --num-minibatches 32 queues 34) makes the next launch wait on a pool thread:
    with those and the collective's first parts holding every thread, its last part finds none, and XLA aborts the
    process after 40 s ("Termination timeout for all reduce", then a C++ stack trace). Room for a running program on
    each device, and for a waiting launch from each device and each actor thread, twice over, keeps a thread free."""
    return max(cores, 2 * (host_devices + actor_threads))


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
    learner_devices: list  # this process's learner devices, in mesh order
    global_learner_devices: list  # the learner devices of every process, in mesh order (process-major)
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
    actor_threads = len(actor_device_ids) * getattr(args, "num_actor_threads", 0)
    ensure_host_devices(actor_device_ids, args.learner_device_ids, actor_threads)
    import jax

    if args.distributed:
        start_distributed(args)  # cleanrl_utils/processes.py
        start_watching(args.heartbeat_timeout)  # which peers are still there
        agree_on_flags(args)
    local_devices = jax.local_devices()
    for name, ids in [("actor_device_ids", actor_device_ids), ("learner_device_ids", args.learner_device_ids)]:
        if ids and max(ids) >= len(local_devices):
            raise UsageError(
                f"{flag(name)} {ids} out of range: this process has {len(local_devices)} "
                f"{local_devices[0].platform} device(s), ids 0..{len(local_devices) - 1}"
            )
    mesh, learner_devices = learner_mesh(args.learner_device_ids)  # cleanrl_utils/data_path.py: the mesh's order
    return DeviceLayout(
        actor_devices=[local_devices[i] for i in actor_device_ids],
        learner_devices=learner_devices,
        global_learner_devices=list(mesh.devices.flat),
        mesh=mesh,
        world_size=jax.process_count(),
        local_rank=jax.process_index(),
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


def stack_seeds(init: Callable[[int], object], seeds: Sequence[int], mesh):
    """The learner states `init(seed)` of several seeds (global arrays on `mesh`) as one, each leaf with a leading
    seed axis and laid out as the seeds' leaves were along the others (an Anakin script's --num-seeds: its update is a
    `vmap` over that axis). The first seed's state is made first: if the seeds' states and their stack cannot fit the
    devices' free memory, one line names --num-seeds (cleanrl_utils/memory.py) before the others are made. The first
    tree gives the structure (a TrainState's optimizer is a function of each seed's own). Every leaf is strongly typed,
    as an update returns it and a checkpoint restores it: a weakly typed one (a step count from a Python 0) would make
    the resumed run's update another program, compiled anew."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from cleanrl_utils.memory import check_copies_fit

    first = init(seeds[0])
    check_copies_fit(
        first, 2 * len(seeds), f"the learner states of {len(seeds)} seeds and their stack", "lower --num-seeds"
    )
    trees = [first, *(init(seed) for seed in seeds[1:])]
    leaves, treedef = jax.tree.flatten(first)
    shardings = [NamedSharding(mesh, PartitionSpec(None, *leaf.sharding.spec)) for leaf in leaves]
    strong = lambda x: jax.lax.convert_element_type(x, x.dtype)
    stack = jax.jit(lambda *seeds: [strong(jnp.stack(leaf)) for leaf in zip(*seeds)], out_shardings=shardings)
    return jax.tree.unflatten(treedef, stack(*(jax.tree.leaves(tree) for tree in trees)))


def seed_slice(tree, index: int):
    """Seed `index`'s part of a tree of global arrays with a leading seed axis (`stack_seeds`): what the run of that
    seed alone holds, laid out as it would be."""
    import jax

    return jax.tree.map(lambda x: x[index], tree)
