"""The processes of a `--distributed` run: jax.distributed started with a bounded wait and with every GPU of each
process visible, the flags every process must share, and, when a collective fails, which process ended first.

Under Slurm JAX reads the coordinator, process count and process id from Slurm's variables, and would also restrict
each process to one GPU (the one whose index is SLURM_LOCALID: JAX's default of one process per GPU); here each
process keeps every GPU its device-id flags name (GPUs 0 .. the largest id of the task's own GPUs), as upstream
Cleanba did.

When a process dies, its peers learn it in their next collective (Gloo: "Connection reset by peer"), and each ends
with one line naming the process(es) that ended first: every process listens on a socket whose address all the
others know (the kernel accepts connections while the process lives, with no thread; it refuses them once the
process is gone), so a survivor asks each peer's socket. When the process that ended is process 0, JAX's
coordination service (which runs in it) is gone too, and JAX aborts the others itself ("Terminating process because
the JAX distributed service detected fatal errors"): JAX takes no handler for that (its client's
missed_heartbeat_callback cannot be called from Python: std::bad_cast, jax 0.10 and 0.12).
"""

import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

import numpy as np

from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import computation_flags, flag

_HOST_BYTES = 255  # a host name's longest length (POSIX HOST_NAME_MAX)
_peers = {"listener": None, "addresses": []}  # this process's liveness socket; every process's (host, port)
_process = {"distributed": False}


def distributed_started() -> bool:
    """Whether this process joined a jax.distributed run (`start_distributed`)."""
    return _process["distributed"]


def mark_distributed(started: bool):
    _process["distributed"] = started


def exit_process(code: int, line: str | None = None) -> NoReturn:
    """End the process now, without the interpreter's shutdown (a jax.distributed run's exit barrier would wait for
    peers): prints `error: {line}` first. Called by cleanrl_utils.cli.run_cli, and by a watchdog thread
    (`start_distributed`'s timeout)."""
    if line is not None:
        print(f"error: {line}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def local_device_ids(args) -> list[int] | None:
    """The local devices jax.distributed makes visible to this process: every id up to the largest that the
    device-id flags name (None: JAX_LOCAL_DEVICE_IDS, the user's own choice, is left to JAX)."""
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    return list(range(max(getattr(args, "actor_device_ids", []) + args.learner_device_ids) + 1))


def start_distributed(args):
    """jax.distributed.initialize, bounded: a peer that has not arrived after --heartbeat-timeout seconds ends the
    wait with one line (JAX's own timeout aborts the process with a C++ stack dump, so ours fires first). Then each
    process learns where every other one listens (`gone_processes`)."""
    import jax

    if args.coordinator_address is not None:
        host = args.coordinator_address.rpartition(":")[0].strip("[]")
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError) as error:
            raise UsageError(
                f"--coordinator-address {args.coordinator_address}: cannot resolve {host!r} "
                f"({getattr(error, 'strerror', None) or error}); use host:port of process 0"
            ) from None
    started = time.time()

    def give_up():  # the main thread is blocked inside JAX: only ending the process ends the wait
        exit_process(
            1,
            f"--distributed: not every process arrived within --heartbeat-timeout {args.heartbeat_timeout}s "
            f"(waited {time.time() - started:.0f}s for {args.num_processes or 'all'} processes at "
            f"{args.coordinator_address or 'the Slurm coordinator'}); start them all, or raise "
            "--heartbeat-timeout",
        )

    timer = threading.Timer(args.heartbeat_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        # a dead peer is detected after heartbeat_timeout_seconds (JAX's default is 100 s)
        jax.distributed.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            local_device_ids=local_device_ids(args),
            initialization_timeout=args.heartbeat_timeout + 60,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        )
    except ValueError as error:  # e.g. no Slurm and no --coordinator-address: JAX cannot tell the cluster
        raise UsageError(f"--distributed: {str(error).splitlines()[0][:300]}") from None
    finally:
        timer.cancel()
    mark_distributed(True)
    _listen_for_peers()


def _listen_for_peers():
    """A listening socket (the kernel accepts connections for it as long as this process lives) and every process's
    host and port, gathered from all processes."""
    from jax.experimental import multihost_utils

    listener = socket.socket()
    listener.bind(("", 0))
    listener.listen(512)  # each probe of a peer is one connection, never accepted: room for every probe of a run
    host = socket.gethostname().encode()[:_HOST_BYTES]
    row = np.zeros(2 + _HOST_BYTES, np.uint8)
    row[:2] = np.frombuffer(listener.getsockname()[1].to_bytes(2, "big"), np.uint8)
    row[2 : 2 + len(host)] = np.frombuffer(host, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row))
    _peers["listener"] = listener
    _peers["addresses"] = [
        (bytes(r[2:]).rstrip(b"\0").decode(errors="replace"), int.from_bytes(bytes(r[:2]), "big")) for r in rows
    ]


def gone_processes(timeout: float = 3.0) -> list[int]:
    """The processes of this run whose liveness socket refuses a connection (the process has ended) or does not
    answer within `timeout` seconds (its host is gone); empty outside a distributed run."""
    import jax

    if not _peers["addresses"]:
        return []
    me = jax.process_index()

    def gone(rank: int) -> bool:
        host, port = _peers["addresses"][rank]
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError:
            return True
        return False

    others = [rank for rank in range(len(_peers["addresses"])) if rank != me]
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


def agreed_values(args) -> dict:
    """What every process of a run must share: the flags that shape the computation, the checkpoint schedule,
    and how many devices each process gives the actors and the learner (the batch is split by them)."""
    return {
        **computation_flags(args),
        **{
            name: getattr(args, name)
            for name in ["checkpoint_frequency", "checkpoint_keep", "resume", "heartbeat_timeout"]
        },
        "actor_device_ids (count)": len(getattr(args, "actor_device_ids", [])),
        "learner_device_ids (count)": len(args.learner_device_ids),
    }


def agree_on_flags(args):
    """Every process compares its values with everyone's before any heavy work: a mismatch is the same UsageError
    in every process, naming the flag and both values (instead of a hang or an abort deep in a collective)."""
    from jax.experimental import multihost_utils

    encoded = json.dumps(agreed_values(args), default=str).encode()
    try:
        length = int(multihost_utils.process_allgather(np.int32(len(encoded))).max())
        everyone = multihost_utils.process_allgather(np.frombuffer(encoded.ljust(length), np.uint8))
    except Exception as error:  # noqa: BLE001 - e.g. processes with different numbers of devices
        raise UsageError(
            f"--distributed: the processes could not compare their flags ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]}); start every process with the same flags and as many "
            "devices (the largest of --actor-device-ids and --learner-device-ids)"
        ) from None
    tables = [json.loads(bytes(row).decode()) for row in np.asarray(everyone)]
    for name, value in tables[0].items():
        for rank, table in enumerate(tables[1:], start=1):
            if table.get(name) != value:
                raise UsageError(
                    f"the processes disagree on {flag(name)}: process 0 has {value}, process {rank} has "
                    f"{table.get(name)}; every process of a run needs the same value"
                )


def agreed_time() -> int:
    """Process 0's clock (unix seconds), the same in every process: e.g. for the default run name."""
    if not distributed_started():
        return int(time.time())
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(time.time())))


def shutdown():
    """Leave jax.distributed (a barrier: every process ends its run), and close the liveness socket."""
    if distributed_started():
        import jax

        jax.distributed.shutdown()
        mark_distributed(False)
    if _peers["listener"] is not None:
        _peers["listener"].close()
        _peers.update(listener=None, addresses=[])
