"""Liveness: which peers of a `--distributed` run are still there, asked through a socket of each process.

When a process dies, its peers learn it in their next collective (Gloo: "Connection reset by peer"), and each ends
with one line naming the process(es) that ended first: every process listens on a socket whose address all the
others know (a thread of the process answers each connection with a byte; the kernel refuses them once the process
is gone), so a survivor asks each peer's socket (`peer_failure_line`). A peer that goes silent (its host down or off
the network, or the process stopped: SIGSTOP, a terminal's Ctrl-Z, a frozen host; its connections get no answer) is
found by a watchdog thread that asks every peer's socket each second: one silent for half of --heartbeat-timeout
ends each surviving process with one line naming it. JAX's own heartbeat check would abort the process later, from
C++, with a stack trace: JAX takes no handler for that (its client's missed_heartbeat_callback cannot be called from
Python: std::bad_cast, jax 0.10 and 0.12), so JAX's heartbeat timeout is set to twice ours
(cleanrl_utils/processes.py). When the process that ended is process 0, JAX's coordination service (which runs in
it) is gone too, and JAX aborts the others itself ("Terminating process because the JAX distributed service detected
fatal errors").
"""

import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from cleanrl_utils.processes import exit_process, slurm_job_id

_HOST_BYTES = 255  # a host name's longest length (POSIX HOST_NAME_MAX)
_PROBE_SECONDS = 1.0  # how often the watchdog asks each peer's liveness socket
ALIVE = b"!"  # the answer of a process that runs
# this process's liveness socket and rank; every process's (host, port); the watchdog's stop
_peers = {"listener": None, "rank": 0, "addresses": [], "stop_watching": threading.Event()}


def start_watching(heartbeat_timeout: int):
    """Once jax.distributed has started: this process's liveness socket, every process's address, and a watchdog
    thread that ends this process with one line when a peer's host goes silent (`_watch_for_silent_peers`)."""
    _listen_for_peers()
    if len(_peers["addresses"]) > 1:
        _peers["stop_watching"].clear()
        watchdog = threading.Thread(
            target=_watch_for_silent_peers, args=(heartbeat_timeout,), name="silent-peers", daemon=True
        )
        watchdog.start()


def stop_watching():
    """The watchdog stops (before jax.distributed's shutdown barrier, where peers leave one by one)."""
    _peers["stop_watching"].set()


def close():
    """Close the liveness socket: peers that ask now find this process ended."""
    if _peers["listener"] is not None:
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept (close alone would not)
            _peers["listener"].shutdown(socket.SHUT_RDWR)
        _peers["listener"].close()
        _peers.update(listener=None, rank=0, addresses=[])


def _listen_for_peers():
    """A listening socket (connections to it succeed as long as this process lives) and every process's host and
    port, gathered from all processes."""
    import jax
    from jax.experimental import multihost_utils

    listener = socket.socket()
    listener.bind(("", 0))
    listener.listen(512)  # a stopped process answers no probe: room for every probe of a run in the backlog
    host = socket.gethostname().encode()[:_HOST_BYTES]
    row = np.zeros(2 + _HOST_BYTES, np.uint8)
    row[:2] = np.frombuffer(listener.getsockname()[1].to_bytes(2, "big"), np.uint8)
    row[2 : 2 + len(host)] = np.frombuffer(host, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row))
    _peers["listener"] = listener
    _peers["rank"] = jax.process_index()
    _peers["addresses"] = [
        (bytes(r[2:]).rstrip(b"\0").decode(errors="replace"), int.from_bytes(bytes(r[:2]), "big")) for r in rows
    ]
    threading.Thread(target=_accept_probes, args=(listener,), name="liveness", daemon=True).start()


def _accept_probes(listener: socket.socket):
    """Answer every probe with one byte, from this thread: the kernel alone would accept a connection to a stopped
    process (SIGSTOP, a terminal's Ctrl-Z, a frozen host) too, and its peers would never see it as silent."""
    while True:
        try:
            connection = listener.accept()[0]
        except OSError:  # the listener was closed (`close`)
            return
        with contextlib.suppress(OSError), connection:  # a prober that gave up already
            connection.sendall(ALIVE)


def probe(host: str, port: int, timeout: float) -> str:
    """'alive' (the process itself answered); 'ended' (the host refuses: the process is gone); 'silent' (no answer
    within `timeout`: its host is down or off the network, or the process is stopped or frozen)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            answered = connection.recv(1) == ALIVE
    except ConnectionRefusedError:
        return "ended"
    except OSError:
        return "silent"
    return "alive" if answered else "ended"  # closed without a byte: the process is closing its socket


def _watch_for_silent_peers(heartbeat_timeout: int):
    """Each second, every peer's liveness socket: one whose host has not answered for half of --heartbeat-timeout
    ends this process with one line naming it, before JAX's heartbeat check (which aborts from C++). A peer that
    ended (refused) is left to the collective that fails (`peer_failure_line`)."""
    stop = _peers["stop_watching"]
    others = [rank for rank in range(len(_peers["addresses"])) if rank != _peers["rank"]]
    timeout = min(2.0, heartbeat_timeout / 4)
    last_answer = dict.fromkeys(others, time.time())
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(others)))) as pool:
        while not stop.is_set():
            started = time.time()
            states = list(pool.map(lambda rank: probe(*_peers["addresses"][rank], timeout), others))
            for rank, state in zip(others, states):
                if state != "silent":
                    last_answer[rank] = started
            silent = sorted(rank for rank in others if started - last_answer[rank] >= heartbeat_timeout / 2)
            if silent and not stop.is_set():
                silent_for = time.time() - last_answer[silent[0]]
                exit_process(1, silent_peers_line(silent, silent_for), then=outlive_peers)
            stop.wait(max(0.0, _PROBE_SECONDS - (time.time() - started)))


def silent_peers_line(lost: list[int], silent_for: float) -> str:
    """The one line of a process whose peers' hosts went silent: who, where, and how the run goes on."""
    import jax

    who = ", ".join(f"process {rank} (host {_peers['addresses'][rank][0]})" for rank in lost)
    job = slurm_job_id()
    requeue = f"; under Slurm the job resumes when requeued (by Slurm on a node failure, or scontrol requeue {job})"
    return (
        f"--distributed: {who} of this run's {jax.process_count()} went silent: no answer for {silent_for:.0f}s "
        f"(its host is down or off the network, or the process is stopped); process {jax.process_index()} stops "
        f"too. The run resumes from its last checkpoint when every process is started again{requeue if job else ''}"
    )


def gone_processes(timeout: float = 3.0) -> list[int]:
    """The processes of this run whose liveness socket refuses a connection (the process has ended) or does not
    answer within `timeout` seconds (its host is gone); empty outside a distributed run."""
    if not _peers["addresses"]:
        return []

    def gone(rank: int) -> bool:
        return probe(*_peers["addresses"][rank], timeout) != "alive"

    others = [rank for rank in range(len(_peers["addresses"])) if rank != _peers["rank"]]
    with ThreadPoolExecutor(max_workers=min(32, max(1, len(others)))) as pool:
        return [rank for rank, is_gone in zip(others, pool.map(gone, others)) if is_gone]


def outlive_peers(timeout: float = 10.0):
    """Process 0 (it runs JAX's coordination service) waits up to `timeout` seconds for the others to end: bad input
    that every process finds for itself must end each with its own line, and a peer still printing its line would
    otherwise be aborted by JAX when process 0's service goes away."""
    import jax

    if not _peers["addresses"] or jax.process_index() != 0:
        return
    others = len(_peers["addresses"]) - 1
    deadline = time.time() + timeout
    while len(gone_processes(timeout=1.0)) < others and time.time() < deadline:
        time.sleep(0.25)


def peer_failure_line(wait: float = 3.0) -> str | None:
    """The one line a survivor ends with when a peer ended first, or None when every peer is still there after `wait`
    seconds (a peer that is dying may close its collective's connection before its liveness socket)."""
    deadline = time.time() + wait
    while not (gone := gone_processes()) and time.time() < deadline:
        time.sleep(0.2)
    if not gone:
        return None
    import jax

    who = f"process {gone[0]}" if len(gone) == 1 else f"processes {', '.join(map(str, gone))}"
    return (
        f"--distributed: {who} of this run's {jax.process_count()} ended first (killed, or stopped by its own "
        f"error: see its output); process {jax.process_index()} stops too. The run resumes from its last "
        "checkpoint when every process is started again"
    )
