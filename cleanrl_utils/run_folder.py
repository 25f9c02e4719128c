"""Files of a run: the lock that keeps a second live run out of its folders, and writes that are whole or absent.

A run folder is used by one live run at a time: process 0 holds an exclusive `flock` on runs/{run_name}/.lock
(and on --checkpoint-dir/.lock) while it runs; the kernel drops the lock when the process ends, however it ends,
so a crashed run never leaves a stale lock behind. A second run with the same name stops at once with one line.
"""

import fcntl
import os
import sys

from cleanrl_utils.agreement import agreed_time
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import check_name, flag


def default_run_name(env_id: str, exp_name: str, seed: int) -> str:
    """{env_id}__{exp_name}__{seed}__{process 0's unix time} (the same in every process), one folder name: Football's
    ids hold a "/" (gfootball/...), written "-"."""
    name = f"{env_id}__{exp_name}__{seed}".replace("/", "-") + f"__{agreed_time()}"
    check_name(name, "run_name")  # it holds --env-id and --exp-name
    return name


class RunFolder:
    def __init__(self, run_name: str, checkpoint_dir: str | None, *, is_main_process: bool):
        """Locks runs/{run_name} and `checkpoint_dir` if given (process 0; the others write only into the checkpoint
        folder process 0 locked)."""
        self.locks = []
        if is_main_process:
            self._lock(f"runs/{run_name}", "run_name")
            if checkpoint_dir:
                self._lock(checkpoint_dir, "checkpoint_dir")

    def _lock(self, folder: str, name: str):
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, ".lock"), "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise UsageError(
                f"{flag(name)}: {folder} is in use by a live run ({holder}); wait for it to end or "
                f"choose another {flag(name)}"
            ) from None
        except OSError as error:  # a file system without locks (some cluster mounts): run, but say so
            print(
                f"warning: {folder} cannot be locked ({error.strerror}): make sure no other run uses "
                f"{flag(name)} {folder}",
                file=sys.stderr,
                flush=True,
            )
            lock.close()
            return
        lock.truncate(0)
        lock.write(f"process {os.getpid()} on {os.uname().nodename}\n")
        lock.flush()
        self.locks.append(lock)

    def release(self):
        for lock in self.locks:
            lock.close()  # closing drops the flock
        self.locks = []


def atomic_write(path: str, data: bytes):
    """Write `path` as a whole or not at all: a temporary name in the same folder, fsync, rename over `path`."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
