"""The processes of a `--distributed` run: jax.distributed started with a bounded wait and with every GPU of each
process visible, the flags every process must share, and, when a collective fails, which process ended first.

Under Slurm JAX reads the coordinator, process count and process id from Slurm's variables, and would also restrict
each process to one GPU (the one whose index is SLURM_LOCALID: JAX's default of one process per GPU); here each
process keeps every GPU its device-id flags name (GPUs 0 .. the largest id of the task's own GPUs), as upstream
Cleanba did.

When a process dies, its peers learn it in their next collective (Gloo: "Connection reset by peer"), and each ends
with one line naming the process(es) that ended first: every process listens on a socket whose address all the
others know (a thread accepts and closes each connection; the kernel refuses them once the process is gone), so a
survivor asks each peer's socket. A host that goes silent (down, or off the network: its connections neither close
nor answer) is found by a watchdog thread that asks every peer's socket each second: one silent for half of
--heartbeat-timeout ends each surviving process with one line naming it. JAX's own heartbeat check would abort the
process later, from C++, with a stack trace: JAX takes no handler for that (its client's missed_heartbeat_callback
cannot be called from Python: std::bad_cast, jax 0.10 and 0.12), so JAX's heartbeat timeout is set to twice ours.
When the process that ended is process 0, JAX's coordination service (which runs in it) is gone too, and JAX aborts
the others itself ("Terminating process because the JAX distributed service detected fatal errors").

Before any collective, the processes compare, through the coordination service, the address each one's host name
resolves to: Gloo (JAX's CPU collectives) listens there, and a host whose name resolves to a loopback address
(Debian's default /etc/hosts line `127.0.1.1 HOST`) cannot be reached by the others (Gloo: "Connection refused").
"""

import contextlib
import ipaddress
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
_PROBE_SECONDS = 1.0  # how often the watchdog asks each peer's liveness socket
# this process's liveness socket and rank; every process's (host, port); the watchdog's stop
_peers = {"listener": None, "rank": 0, "addresses": [], "stop_watching": threading.Event()}
_process = {"distributed": False}
_ending = threading.Lock()  # held by the thread that ends the process: its line is the only one


def distributed_started() -> bool:
    """Whether this process joined a jax.distributed run (`start_distributed`)."""
    return _process["distributed"]


def mark_distributed(started: bool):
    _process["distributed"] = started


def exit_process(code: int, line: str | None = None, outlive: bool = False) -> NoReturn:
    """End the process now, without the interpreter's shutdown (a jax.distributed run's exit barrier would wait for
    peers): prints `error: {line}` first, then (`outlive`) lets the peers print theirs (`outlive_peers`). Called by
    cleanrl_utils.cli.run_cli, and by watchdog threads (`start_distributed`'s timeout, `_watch_for_silent_peers`);
    the first caller ends the process, a later one waits for that."""
    if not _ending.acquire(blocking=False):
        threading.Event().wait()  # another thread is ending the process, with its own line
    if line is not None:
        print(f"error: {line}", file=sys.stderr, flush=True)
    if outlive:
        outlive_peers()
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
    wait with one line (JAX's own timeout aborts the process with a C++ stack dump, so ours fires first). Then the
    processes check that each host's own address is one the others can reach, each process learns where every
    other one listens (`gone_processes`), and a watchdog watches them (`_watch_for_silent_peers`)."""
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
        # JAX aborts a process whose peer sent no heartbeat for heartbeat_timeout_seconds (its default is 100 s):
        # our watchdog names a silent peer within --heartbeat-timeout, so JAX's check comes later
        jax.distributed.initialize(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            local_device_ids=local_device_ids(args),
            initialization_timeout=args.heartbeat_timeout + 60,
            heartbeat_timeout_seconds=2 * args.heartbeat_timeout,
        )
    except ValueError as error:  # e.g. no Slurm and no --coordinator-address: JAX cannot tell the cluster
        raise UsageError(f"--distributed: {str(error).splitlines()[0][:300]}") from None
    finally:
        timer.cancel()
    # every process finds an unreachable address and raises the same UsageError: all of them then leave through
    # jax.distributed's shutdown barrier at exit, each with its line
    check_own_addresses(args.heartbeat_timeout)
    mark_distributed(True)
    _listen_for_peers()
    if len(_peers["addresses"]) > 1:
        _peers["stop_watching"].clear()
        watchdog = threading.Thread(
            target=_watch_for_silent_peers, args=(args.heartbeat_timeout,), name="silent-peers", daemon=True
        )
        watchdog.start()


def own_address(host: str) -> str | None:
    """The address `host` resolves to first, as Gloo picks the address it listens on (None: it does not resolve)."""
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError):
        return None


def check_own_addresses(timeout: int):
    """Every process publishes its host name and the address that name resolves to in the coordination service's
    key-value store (no collective: Gloo would fail first, with a traceback), and reads everyone's. With several
    hosts, a host whose own name resolves to a loopback address, or to nothing, is a UsageError naming it."""
    from jax._src import distributed

    client = distributed.global_state.client
    host = socket.gethostname()
    client.key_value_set(f"cleanba/address/{distributed.global_state.process_id}", f"{host} {own_address(host)}")
    hosts = dict(
        client.blocking_key_value_get(f"cleanba/address/{rank}", timeout * 1000).split(" ")
        for rank in range(distributed.global_state.num_processes)
    )
    if len(hosts) < 2:  # one host: its processes reach each other on any of its addresses
        return
    for name, address in sorted(hosts.items()):
        if address == "None" or ipaddress.ip_address(address.split("%")[0]).is_loopback:
            resolved = "does not resolve" if address == "None" else f"resolves to {address}, a loopback address"
            raise UsageError(
                f"--distributed: host {name}'s own name {resolved}: the other hosts cannot reach its processes "
                f"there. Map {name} to its network address on {name} (its /etc/hosts, where Debian's default line "
                f"is '127.0.1.1 {name}', or DNS)"
            )


def _listen_for_peers():
    """A listening socket (connections to it succeed as long as this process lives) and every process's host and
    port, gathered from all processes."""
    import jax
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
    _peers["rank"] = jax.process_index()
    _peers["addresses"] = [
        (bytes(r[2:]).rstrip(b"\0").decode(errors="replace"), int.from_bytes(bytes(r[:2]), "big")) for r in rows
    ]
    threading.Thread(target=_accept_probes, args=(listener,), name="liveness", daemon=True).start()


def _accept_probes(listener: socket.socket):
    """Accept and close every probe (the watchdog's probes come each second: a backlog would fill up)."""
    while True:
        try:
            listener.accept()[0].close()
        except OSError:  # the listener was closed (`shutdown`)
            return


def probe(host: str, port: int, timeout: float) -> str:
    """'alive'; 'ended' (the host refuses: the process is gone); 'silent' (no answer: its host is down or off the
    network)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "ended"
    except OSError:
        return "silent"
    return "alive"


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
                exit_process(1, silent_peers_line(silent, silent_for), outlive=True)
            stop.wait(max(0.0, _PROBE_SECONDS - (time.time() - started)))


def silent_peers_line(lost: list[int], silent_for: float) -> str:
    """The one line of a process whose peers' hosts went silent: who, where, and how the run goes on."""
    import jax

    who = ", ".join(f"process {rank} (host {_peers['addresses'][rank][0]})" for rank in lost)
    job = os.environ.get("SLURM_JOB_ID")
    if job is not None and os.environ.get("SLURM_ARRAY_JOB_ID"):
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID')}"
    requeue = f"; under Slurm the job resumes when requeued (by Slurm on a node failure, or scontrol requeue {job})"
    return (
        f"--distributed: {who} of this run's {jax.process_count()} went silent: no answer for {silent_for:.0f}s "
        f"(its host is down or off the network); process {jax.process_index()} stops too. The run resumes from its "
        f"last checkpoint when every process is started again{requeue if job else ''}"
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
    _peers["stop_watching"].set()
    if distributed_started():
        import jax

        jax.distributed.shutdown()
        mark_distributed(False)
    if _peers["listener"] is not None:
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept (close alone would not)
            _peers["listener"].shutdown(socket.SHUT_RDWR)
        _peers["listener"].close()
        _peers.update(listener=None, rank=0, addresses=[])
