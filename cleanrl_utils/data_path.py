"""The data path: which samples each learner device sees, from the actor threads of every process to the learner.

The learner's mesh is the learner devices of every process, process by process (process 0's first), each process's
in the order of their local ids, along one axis, "batch" (`learner_mesh`). One update's data takes two steps:

1. Actor side (`split_for_learners`): actor thread t splits its rollout along the env axis (axis 1) into one equal
   slice per learner device of its process: slice l, envs [l E/L, (l+1) E/L) of its E = --local-num-envs, goes to
   the process's l-th learner device (one host-to-device copy per slice).
2. Learner side (`assemble_global_rollout`): on each learner device the slices of the process's T threads are
   concatenated in thread order, and the mesh views the devices' arrays as one global array, env axis sharded.

So env e of thread t of process p sits at global env index
    ((p L + l) T + t) E/L + e - l E/L,   with l = e // (E/L),
and learner device p L + l holds the global envs [(p L + l) T E/L, (p L + l + 1) T E/L). An update that is a function
of the whole global rollout (advantages per env, statistics and gradients summed over the mesh, one minibatch per
epoch) is therefore the same for the same global rollout on any number of learner devices and processes; several
minibatches per epoch differ between layouts, because each learner device shuffles its own samples.

An Anakin run has no actor threads: its envs are one array, env axis sharded over the same mesh, so the learner
device at mesh position i steps the global envs [i E, (i + 1) E) of its E = --local-num-envs (`anakin_layout_lines`).
"""


def learner_mesh(learner_device_ids: list[int]):
    """(the mesh over the learner devices of every process, axis "batch"; this process's learner devices in mesh
    order). Device ids are local to each process, the same ids in every process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = [
        device
        for process in range(jax.process_count())
        for i, device in enumerate(sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id))
        if i in learner_device_ids
    ]
    local = [device for device in devices if device.process_index == jax.process_index()]
    return Mesh(np.array(devices), ("batch",)), local


def device_name(device) -> str:
    return f"{device.platform}:{device.id}"


def mesh_line(mesh) -> str:
    """The first line of a run's layout: the learner devices of every process in mesh order."""
    return f"learner mesh (axis batch, in order): {', '.join(map(device_name, mesh.devices.flat))}"


def layout_lines(*, mesh, learner_devices: list, thread_devices: list, local_num_envs: int) -> list[str]:
    """What a Sebulba run prints when it starts, in this process: the learner mesh in its order, then each actor
    thread's device and where its envs go: slice l of its --local-num-envs to local learner device l, at the global
    env indices of the formula above (so a user sees which samples each learner device trains on)."""
    import jax

    process, num_learners, num_threads = jax.process_index(), len(learner_devices), len(thread_devices)
    per_learner = local_num_envs // num_learners
    lines = [mesh_line(mesh)]
    for thread, device in enumerate(thread_devices):
        slices = []
        for learner, learner_device in enumerate(learner_devices):
            start = ((process * num_learners + learner) * num_threads + thread) * per_learner
            local = f"{learner * per_learner}-{(learner + 1) * per_learner - 1}"
            slices.append(f"envs {local} -> {device_name(learner_device)} (global {start}-{start + per_learner - 1})")
        lines.append(f"process {process} actor thread {thread} on {device_name(device)}: {', '.join(slices)}")
    return lines


def anakin_layout_lines(*, mesh, local_num_envs: int) -> list[str]:
    """What an Anakin run prints when it starts, in this process: the learner mesh in its order, then each of this
    process's learner devices and the envs it steps, at their global indices (env i is reset with key i of the
    run's split, so the global index names the env on any layout)."""
    import jax

    lines = [mesh_line(mesh)]
    for position, device in enumerate(mesh.devices.flat):
        if device.process_index == jax.process_index():
            first = position * local_num_envs
            envs = f"envs 0-{local_num_envs - 1} (global {first}-{first + local_num_envs - 1})"
            lines.append(f"process {device.process_index} learner device {device_name(device)}: {envs}")
    return lines


def split_for_learners(rollout, learner_devices: list) -> list:
    """An actor thread's time-major rollout, one env slice per learner device of its process, each on its device
    (device_put copies the host arrays, so the thread may overwrite them afterwards)."""
    import jax

    envs = jax.tree.leaves(rollout)[0].shape[1] // len(learner_devices)

    def part(index: int):
        return jax.tree.map(lambda x: x[:, index * envs : (index + 1) * envs], rollout)

    return [jax.device_put(part(index), device) for index, device in enumerate(learner_devices)]


def assemble_global_rollout(per_thread_storages: list, mesh, global_envs: int):
    """The learner's view of one update's rollouts: `per_thread_storages[thread][l]`, each thread's slice for local
    learner device l, concatenated on device l in thread order, then one global array per leaf over the learner devices
    of every process (env axis 1 sharded)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    per_device = [
        jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *storages) for storages in zip(*per_thread_storages)
    ]

    def to_global(*shards):
        shape = (shards[0].shape[0], global_envs, *shards[0].shape[2:])
        sharding = NamedSharding(mesh, PartitionSpec(None, "batch"))
        return jax.make_array_from_single_device_arrays(shape, sharding, list(shards))

    return jax.tree.map(to_global, *per_device)
