"""Stop-aware queues and the actor threads: no thread waits forever on a queue whose other end has stopped.

A run has one `stop_event`. Whoever stops the run (a signal, a failed actor, the learner leaving its loop)
sets it; every wait on a queue wakes up every `timeout` seconds, sees it and raises `RunStopped`.
"""

import queue
import threading


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
