"""The run's folder runs/{run_name}: its agreed name, the lock that keeps a second live run out, atomic writes.

A run folder is used by one live run at a time: process 0 holds an exclusive `flock` on runs/{run_name}/.lock
(and on --checkpoint-dir/.lock) while it runs; the kernel drops the lock when the process ends, however it ends,
so a crashed run never leaves a stale lock behind. A second run with the same name stops at once with one line.
"""

import fcntl
import os
import sys

from cleanrl_utils.devices import agreed_time
from cleanrl_utils.flags import UsageError, check_name, flag


class RunFolder:
    def __init__(self, args, *, is_main_process: bool, default_name: str):
        """Sets `args.run_name` (default: `default_name` with process 0's time, the same in every process), then
        locks the run's folders (process 0; the others write only into the checkpoint folder process 0 locked)."""
        if args.run_name is None:  # Football's ids hold a "/" (gfootball/...): one folder, so "-" for it
            args.run_name = f"{default_name.replace('/', '-')}__{agreed_time()}"
        check_name(args.run_name, "run_name")  # the default holds --env-id and --exp-name
        self.locks = []
        if is_main_process:
            self._lock(f"runs/{args.run_name}", "run_name")
            if args.checkpoint_dir:
                self._lock(args.checkpoint_dir, "checkpoint_dir")

    def _lock(self, folder: str, name: str):
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, ".lock"), "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise UsageError(f"{flag(name)}: {folder} is in use by a live run ({holder}); wait for it to end or "
                             f"choose another {flag(name)}") from None
        except OSError as error:  # a file system without locks (some cluster mounts): run, but say so
            print(f"warning: {folder} cannot be locked ({error.strerror}): make sure no other run uses "
                  f"{flag(name)} {folder}", file=sys.stderr, flush=True)
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
