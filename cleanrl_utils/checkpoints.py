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

from cleanrl_utils.flags import RunError, UsageError, computation_flags, flag, settable_flags


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: unreadable, corrupted, or made with other flags."""


def tree_digest(tree) -> str:
    """sha256 of the leaves of a (replicated) tree as this process holds them: equal digests, equal states."""
    import jax

    leaves = jax.tree.leaves(jax.tree.map(
        lambda x: np.asarray(x.addressable_shards[0].data if hasattr(x, "addressable_shards") else x), tree))
    return hashlib.sha256(b"".join(leaf.tobytes() for leaf in leaves)).hexdigest()


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
    """orbax stores arrays, not typed PRNG keys: keys (the same host value in every process) go as their data."""
    import jax

    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x)) if _is_key(x) else x, tree)


def check_shared_folder(path: str):
    """Every process must see the folder process 0 writes to; else a UsageError in every process."""
    from jax.experimental import multihost_utils
    import jax

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
        raise UsageError(f"--checkpoint-dir: process(es) {blind} do not see the checkpoint folder of process 0 (here: "
                         f"{path}); all processes of a run need one shared folder: start them in the same (shared) "
                         "working directory or give --checkpoint-dir a path on a shared file system")


class Checkpoints:
    def __init__(self, args, world_size: int):
        import orbax.checkpoint as ocp

        self.directory = args.checkpoint_dir or f"runs/{args.run_name}/checkpoints"  # as the user knows it
        path = os.path.abspath(self.directory)
        if world_size > 1:
            check_shared_folder(path)
        self.manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(
            max_to_keep=args.checkpoint_keep, enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, update: int, state, args, summary: str):
        """The state (any tree of arrays and PRNG keys) after `update` (unless it is saved already) with its digest.
        orbax writes to a temporary folder and renames it when complete: a crash mid-write leaves no checkpoint that
        looks valid. `summary` (digests) is printed. Disk full, permission denied: a RunError naming the folder."""
        import orbax.checkpoint as ocp

        if update == self.manager.latest_step():
            return
        start, global_step = time.time(), update * args.batch_size
        state = _keys_to_data(state)
        meta = {"args": settable_flags(args), "update": update, "global_step": global_step,
                "digest": tree_digest(state)}
        try:
            self.manager.save(update, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                              meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 - orbax and tensorstore wrap the OS error in their own types
            cause = os_error_in(error)
            code = re.search(r"os_error_code='(\d+)'", str(error))  # tensorstore's errors carry errno as text
            cause = (cause.strerror if cause is not None and cause.strerror else os.strerror(int(code.group(1)))
                     if code else str(error).splitlines()[0][:200])
            raise RunError(f"cannot write checkpoint {update} into {self.directory}: {cause}; the last complete "
                           f"checkpoint ({self.manager.latest_step()}) is intact") from None
        print(f"checkpoint saved: update={update} global_step={global_step} {summary} in {time.time() - start:.2f}s",
              flush=True)

    def restore(self, state, args, summary) -> tuple:
        """The newest complete checkpoint in the shapes of `state`, checked against this run's flags: (state,
        update), and a console line with `summary(state)`. No checkpoint: `state` as it is and update 0 (an error
        with --resume)."""
        import jax
        import orbax.checkpoint as ocp

        update = self.manager.latest_step()
        if update is None:
            if args.resume:
                raise UsageError(f"--resume: {self.directory} has no complete checkpoint")
            return state, 0
        path = os.path.join(self.manager.directory, str(update))
        try:
            meta = self.manager.restore(update, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if meta["global_step"] != update * args.batch_size:
                raise CheckpointError(
                    f"--resume: checkpoint {path} was made with {meta['global_step'] // max(update, 1)} steps per update, this "
                    f"run has {args.batch_size} (--local-num-envs x --num-steps x --num-actor-threads x actor devices x "
                    "processes); use the checkpoint's values or another --run-name")
            for name, value in computation_flags(args).items():
                if meta["args"].get(name) != value:
                    raise CheckpointError(
                        f"--resume: checkpoint {path} was made with {flag(name)} {meta['args'].get(name)}, this run has "
                        f"{value}; use the checkpoint's value or another --run-name")
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _keys_to_data(state))
            restored = self.manager.restore(update, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - any unreadable checkpoint is one line, whatever orbax raised
            raise CheckpointError(f"--resume: checkpoint {path} cannot be read ({type(error).__name__}: "
                                  f"{str(error).splitlines()[0][:200] if str(error) else ''}); delete it to resume "
                                  "from an older one") from None
        if "digest" in meta and tree_digest(restored["state"]) != meta["digest"]:
            raise CheckpointError(f"--resume: checkpoint {path} is corrupted (its state does not match the digest "
                                  "saved with it); delete it to resume from an older one")
        restored = jax.tree.map(lambda template, x: jax.random.wrap_key_data(x) if _is_key(template) else x,
                                state, restored["state"], is_leaf=_is_key)
        print(f"resumed from checkpoint: update={update} global_step={meta['global_step']} {summary(restored)}",
              flush=True)
        return restored, update

    def close(self):
        self.manager.close()
