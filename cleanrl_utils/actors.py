"""The actor threads: where each runs (`ActorThread`), their supervision (`ActorThreads`), and stop-aware queues.

A run has one `stop_event`. Whoever stops the run (a signal, a failed actor, the learner leaving its loop) sets it;
every wait on a queue wakes up every `timeout` seconds, sees it and raises `RunStopped`, so no thread waits forever
on a queue whose other end has stopped.
"""

import queue
import threading
from dataclasses import dataclass

import numpy as np


class RunStopped(Exception):
    """Raised inside a thread waiting on a queue when another thread has stopped the run."""


class ActorFailed(RuntimeError):
    """An actor thread raised: its error is the cause (the traceback shows where it failed)."""


def queue_get(q: queue.Queue, stop_event: threading.Event, timeout: float):
    while True:
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            if stop_event.is_set():
                raise RunStopped from None


def queue_put(q: queue.Queue, item, stop_event: threading.Event, timeout: float):
    while True:
        try:
            return q.put(item, timeout=timeout)
        except queue.Full:
            if stop_event.is_set():
                raise RunStopped from None


@dataclass(frozen=True)
class ActorThread:
    """One actor thread: where it runs, where its rollouts go, and its share of the run's seeds and keys."""

    index: int  # in this process
    global_index: int  # over all processes: its envs' seeds and its key
    device: object  # the actor device it runs inference on (jax.Device)
    learner_devices: list  # this process's learner devices: each gets a slice of the rollout's envs (data_path.py)
    start_update: int  # 0, or the update of the checkpoint the run resumed from
    envpool_threads: int  # threads stepping its envs
    stop_event: threading.Event
    queue_timeout: float

    def env_seed(self, seed: int, num_envs: int) -> int:
        """envpool seeds env i of a pool with env_seed + i: every actor thread of every process gets its own range,
        from a base hashed from --seed (runs with seeds 1 and 2 do not share envs) and from the update the run starts
        at (a resumed run starts new episodes, not the first ones again)."""
        base = int(np.random.SeedSequence([seed, self.start_update]).generate_state(1)[0]) % 2**30
        return base + self.global_index * num_envs

    def key(self, key):
        """This thread's PRNG key on its device: no two threads (or processes, or resumed runs) share one."""
        import jax

        return jax.device_put(
            jax.random.fold_in(jax.random.fold_in(key, self.start_update), self.global_index), self.device
        )

    def get(self, q: queue.Queue):
        return queue_get(q, self.stop_event, self.queue_timeout)

    def put(self, q: queue.Queue, item):
        return queue_put(q, item, self.stop_event, self.queue_timeout)

    def check_stopped(self):
        """Between env steps: another thread failed, or Ctrl-C; do not finish a long rollout."""
        if self.stop_event.is_set():
            raise RunStopped


class ActorThreads:
    """Starts actor threads; the first failure is recorded and stops the whole run (`stop_event`)."""

    def __init__(self, stop_event: threading.Event, join_timeout: float = 10.0):
        self.stop_event, self.join_timeout = stop_event, join_timeout
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def start(self, target, name: str, **kwargs):
        def run():
            try:
                target(**kwargs)
            except RunStopped:
                pass
            except BaseException as error:  # noqa: BLE001 - re-raised by the learner thread in check()
                self.errors.append(error)
                self.stop_event.set()

        # daemon: a thread stuck inside envpool or XLA must not keep a finished (or failed) process alive
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def check(self):
        """Raise the first actor failure in the calling (learner) thread."""
        if self.errors:
            raise ActorFailed(f"an actor thread failed: {self.errors[0]!r}") from self.errors[0]

    def stop(self) -> list[str]:
        """Stop every actor thread and wait for it; the names of those still running after the timeout."""
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=self.join_timeout)
        return [thread.name for thread in self.threads if thread.is_alive()]
