"""Checkpoints: the learner's whole state at update boundaries (orbax), the flags it was made with, digests.

Where: `--checkpoint-dir`, by default `runs/{run_name}/checkpoints` of the working directory. Every process of a
`--distributed` run writes its part of each checkpoint into that one folder, and orbax commits a checkpoint only
when all parts are there, so the folder must be the same for all processes (a shared file system). That is
checked when the run starts (process 0 writes a probe file, every process looks for it): processes that see
different folders stop at once with one line, instead of waiting forever for each other's parts.
"""

import hashlib
import os
import re
import secrets
import time

import numpy as np

from cleanrl_utils.errors import RunError, UsageError
from cleanrl_utils.flags import flag
from cleanrl_utils.process_stderr import drop_abandoned_io_reports, stderr_held


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: unreadable, corrupted, or made with other flags."""


def tree_digest(tree) -> str:
    """sha256 of the leaves of a tree as whole arrays, the same however they are laid out over devices and processes
    (and whatever sharding spec describes the layout): equal digests, equal states, on any layout. Each leaf is hashed
    slice by slice along its first axis of more than one element (a replay's env or item axis, the axis a sharded
    leaf is usually split along), where each slice lives; a process that lacks slices (a sharded leaf) gathers their
    32-byte hashes from the others, not the data. A leaf split along a later axis (an Anakin run's envs with
    --num-seeds: the seed axis first, the envs split over the devices) is gathered whole first. With several
    processes every process must call it at the same point (it is a collective), as `Checkpoints` and the scripts'
    final lines do."""
    import jax

    leaves = jax.tree.leaves(_keys_to_data(tree))  # a typed PRNG key: its data
    return hashlib.sha256(b"".join(_leaf_digest(leaf) for leaf in leaves)).hexdigest()


def _leaf_digest(x) -> bytes:
    shape = np.shape(x)
    axis = next((axis for axis, size in enumerate(shape) if size > 1), None)
    if axis is None:  # one element, or none
        data = x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x
        return hashlib.sha256(np.asarray(data).tobytes()).digest()
    if _split_along_another_axis(x, axis):  # each slice's bytes in one place: the whole leaf, in every process
        from jax.experimental import multihost_utils

        x = np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)
    slice_digests, held = np.zeros((shape[axis], 32), np.uint8), np.zeros(shape[axis], bool)
    shards = x.addressable_shards if hasattr(x, "addressable_shards") else [None]
    for shard in shards:
        data = np.asarray(x if shard is None else shard.data)
        start = 0 if shard is None else shard.index[axis].start or 0
        for i, piece in enumerate(np.moveaxis(data, axis, 0)):
            slice_digests[start + i] = np.frombuffer(
                hashlib.sha256(np.ascontiguousarray(piece).tobytes()).digest(), np.uint8
            )
        held[start : start + data.shape[axis]] = True
    sharded_over_processes = hasattr(x, "addressable_shards") and not (x.is_fully_addressable or x.is_fully_replicated)
    if sharded_over_processes:  # the same answer in every process: all of them gather
        from jax.experimental import multihost_utils

        all_digests, all_held = multihost_utils.process_allgather((slice_digests, held))
        slice_digests, held = all_digests[all_held.argmax(0), np.arange(shape[axis])], all_held.any(0)
    assert held.all(), "every slice is held by some device"
    return hashlib.sha256(slice_digests.tobytes()).digest()


def _split_along_another_axis(x, axis: int) -> bool:
    """Whether some device holds part of a slice of `x` along `axis`: read off the sharding, which every process
    knows whole, so that every process takes the same path through `_leaf_digest`'s collective."""
    if not hasattr(x, "sharding"):
        return False
    shape = np.shape(x)
    return any(
        (index.start or 0, shape[other] if index.stop is None else index.stop) != (0, shape[other])
        for indices in x.sharding.devices_indices_map(shape).values()
        for other, index in enumerate(indices)
        if other != axis
    )


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind an error (orbax and tensorstore wrap them), if any."""
    while error is not None:
        if isinstance(error, OSError):
            return error
        error = error.__cause__ or error.__context__
    return None


def _is_key(x) -> bool:
    import jax

    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keys_to_data(tree):
    """orbax stores arrays, not typed PRNG keys: keys go as their data, on the host where this process holds all of it
    (a learner key, the same in every process), else as the global array it is (an Anakin run's per-env keys,
    sharded over the learner devices of every process)."""
    import jax

    def data(x):
        if not _is_key(x):
            return x
        key_data = jax.random.key_data(x)
        return np.asarray(key_data) if getattr(key_data, "is_fully_addressable", True) else key_data

    return jax.tree.map(data, tree)


def _empty_to_placeholders(tree):
    """orbax refuses arrays of zero size (MJX's state has several, e.g. `act` of a model without actuator state): each
    goes as a scalar of its dtype, and comes back from the template the run restores into (it holds no data)."""
    import jax

    return jax.tree.map(lambda x: np.zeros((), x.dtype) if np.size(x) == 0 else x, tree)


def _key_template(key):
    """What a typed key restores as: its data with the key's sharding where that is a mesh's, else on the host."""
    import jax
    from jax.sharding import NamedSharding

    data = jax.random.key_data(key)
    return data if isinstance(getattr(data, "sharding", None), NamedSharding) else np.asarray(data)


def check_shared_folder(path: str):
    """Every process must see the folder process 0 writes to; else a UsageError in every process."""
    import jax
    from jax.experimental import multihost_utils

    token = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(31))))
    probe = os.path.join(path, f".shared-folder-probe-{token}")
    if jax.process_index() == 0:
        try:
            os.makedirs(path, exist_ok=True)
            open(probe, "w").close()
        except OSError as error:
            raise UsageError(f"--checkpoint-dir: cannot write {path} ({error.strerror})") from None
    multihost_utils.sync_global_devices("checkpoint folder probe written")
    sees = multihost_utils.process_allgather(np.int32(os.path.exists(probe)))
    multihost_utils.sync_global_devices("checkpoint folder probe read")
    if jax.process_index() == 0:
        os.remove(probe)
    if not sees.all():
        blind = [int(i) for i in np.flatnonzero(sees == 0)]
        raise UsageError(
            f"--checkpoint-dir: process(es) {blind} do not see the checkpoint folder of process 0 (here: "
            f"{path}); all processes of a run need one shared folder: start them in the same (shared) "
            "working directory or give --checkpoint-dir a path on a shared file system"
        )


def _learner_devices(leaves) -> int:
    """The devices of the mesh the state is laid out on (1 for a state of host arrays)."""
    from jax.sharding import NamedSharding

    return max(
        (leaf.sharding.mesh.size for leaf in leaves if isinstance(getattr(leaf, "sharding", None), NamedSharding)),
        default=1,
    )


def check_shapes(meta: dict, leaves: list, path: str):
    """A checkpoint restores into any device layout of the same shapes (orbax re-shards). A state whose shapes depend
    on the number of learner devices (R2D2's replay keeps one priority tree per device) resumes only on as many."""
    if meta["shapes"] == [list(np.shape(leaf)) for leaf in leaves]:
        return
    stored, here = meta["learner_devices"], _learner_devices(leaves)
    if stored != here:
        raise CheckpointError(
            f"--learner-device-ids: checkpoint {path} was made on {stored} learner devices (over all processes), this "
            f"run has {here}, and this script's state is shaped by their number (a replay of one part per device "
            f"that cannot be re-sharded): resume on {stored} learner devices (--learner-device-ids x processes)"
        )
    raise CheckpointError(
        f"--resume: checkpoint {path} holds a state of other shapes than this run's (made by another "
        "version of the script?); use another --run-name"
    )


def check_flags_of(meta: dict, path: str, *, update: int, batch_size: int, flags: dict):
    """Checkpoint `update` made with this run's steps per update (`batch_size`) and the `flags` that shape its
    computation, or a CheckpointError naming the flag."""
    if meta["global_step"] != update * batch_size:
        raise CheckpointError(
            f"--resume: checkpoint {path} was made with {meta['global_step'] // max(update, 1)} steps per "
            f"update, this run has {batch_size} (--local-num-envs x --num-steps x the env copies per "
            "process, Sebulba's actor threads or Anakin's learner devices, x processes); use the checkpoint's "
            "values or another --run-name"
        )
    for name, value in flags.items():
        if meta["args"].get(name) != value:
            raise CheckpointError(
                f"--resume: checkpoint {path} was made with {flag(name)} {meta['args'].get(name)}, this run "
                f"has {value}; use the checkpoint's value or another --run-name"
            )


class Checkpoints:
    def __init__(self, directory: str, *, keep: int, world_size: int):
        """The checkpoints in `directory` (as the user knows it: the messages name it), the newest `keep` kept."""
        import orbax.checkpoint as ocp

        self.directory = directory
        path = os.path.abspath(self.directory)
        if world_size > 1:
            check_shared_folder(path)
        self.manager = ocp.CheckpointManager(
            path, options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False)
        )

    def save(self, update: int, state, *, global_step: int, flags: dict, summary: str):
        """The state (any tree of arrays and PRNG keys) after `update` (unless it is saved already) with its digest
        and the run's `flags`. orbax writes to a temporary folder and renames it when complete: a crash mid-write
        leaves no checkpoint that looks valid. `summary` (digests) is printed. Disk full, permission denied: a
        RunError naming the folder."""
        import jax
        import orbax.checkpoint as ocp

        if update == self.manager.latest_step():
            return
        start = time.time()
        state = _empty_to_placeholders(_keys_to_data(state))
        leaves = jax.tree.leaves(state)
        # the digest of the whole state (any layout) and what its shapes were made for: checked at restore
        meta = {
            "args": flags,
            "update": update,
            "global_step": global_step,
            "state_sha256": tree_digest(state),
            "shapes": [list(np.shape(leaf)) for leaf in leaves],
            "learner_devices": _learner_devices(leaves),
        }
        try:
            with stderr_held():
                try:
                    self.manager.save(
                        update,
                        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                    )
                finally:
                    self.manager.wait_until_finished()  # a failed write's other threads end here too
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore wrap the OS error in their own types
            cause = os_error_in(error)
            code = re.search(r"os_error_code='(\d+)'", str(error))  # tensorstore's errors carry errno as text
            cause = (
                cause.strerror
                if cause is not None and cause.strerror
                else os.strerror(int(code.group(1)))
                if code
                else str(error).splitlines()[0][:200]
            )
            drop_abandoned_io_reports()
            last = self.manager.latest_step()
            raise RunError(
                f"cannot write checkpoint {update} into {self.directory}: {cause}; "
                + (
                    f"the last complete checkpoint ({last}) is intact"
                    if last is not None
                    else "no checkpoint of this run is complete yet"
                )
            ) from None
        print(
            f"checkpoint saved: update={update} global_step={global_step} {summary} in {time.time() - start:.2f}s",
            flush=True,
        )

    def restore(self, state, *, batch_size: int, flags: dict, resume: bool, summary) -> tuple:
        """The newest complete checkpoint in the shapes of `state`, checked against this run's steps per update
        (`batch_size`) and the `flags` that shape its computation: (state, update), and a console line with
        `summary(state)`. No checkpoint: `state` as it is and update 0 (an error with `resume`, --resume)."""
        import jax
        import orbax.checkpoint as ocp

        update = self.manager.latest_step()
        if update is None:
            if resume:
                raise UsageError(f"--resume: {self.directory} has no complete checkpoint")
            return state, 0
        path = os.path.join(self.manager.directory, str(update))
        try:
            with stderr_held():  # absl's log of a damaged metadata file, orbax's threads' tracebacks
                meta = self.manager.restore(update, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            check_flags_of(meta, path, update=update, batch_size=batch_size, flags=flags)
            # keys as their data: on the mesh where they live on it (a replicated key restores into this run's
            # layout, also from a checkpoint that other processes wrote), else on the host (a key on no mesh is not
            # committed to a device: jit places it)
            template = _empty_to_placeholders(jax.tree.map(lambda x: _key_template(x) if _is_key(x) else x, state))
            check_shapes(meta, jax.tree.leaves(template), path)
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
            with stderr_held():
                restored = self.manager.restore(
                    update, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
                )
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is one line, whatever orbax raised
            drop_abandoned_io_reports()
            raise CheckpointError(
                f"--resume: checkpoint {path} cannot be read ({type(error).__name__}: "
                f"{str(error).splitlines()[0][:200] if str(error) else ''}); delete it to resume "
                "from an older one"
            ) from None
        if tree_digest(restored["state"]) != meta["state_sha256"]:
            raise CheckpointError(
                f"--resume: checkpoint {path} is corrupted (its state does not match the digest "
                "saved with it); delete it to resume from an older one"
            )

        def restored_leaf(template, x):
            if _is_key(template):
                return jax.random.wrap_key_data(x)
            return template if np.size(template) == 0 else x  # an empty array: the template's (no data)

        restored = jax.tree.map(restored_leaf, state, restored["state"], is_leaf=_is_key)
        print(
            f"resumed from checkpoint: update={update} global_step={meta['global_step']} {summary(restored)}",
            flush=True,
        )
        return restored, update

    def close(self):
        self.manager.close()
