"""The processes of a `--distributed` run: jax.distributed started with a bounded wait and with every GPU of each
process visible, each host's address checked, the one way a started process ends (`exit_process`), and the Slurm
job a process belongs to. Which peers are still there: cleanrl_utils/liveness.py; what they agree on:
cleanrl_utils/agreement.py.

Under Slurm JAX reads the coordinator, process count and process id from Slurm's variables, and would also restrict
each process to one GPU (the one whose index is SLURM_LOCALID: JAX's default of one process per GPU); here each
process keeps every GPU its device-id flags name (GPUs 0 .. the largest id of the task's own GPUs), as upstream
Cleanba did.

Before any collective, the processes compare, through the coordination service, the address each one's host name
resolves to: Gloo (JAX's CPU collectives) listens there, and a host whose name resolves to a loopback address
(Debian's default /etc/hosts line `127.0.1.1 HOST`) cannot be reached by the others (Gloo: "Connection refused").
"""

import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

from cleanrl_utils.errors import UsageError

_process = {"distributed": False}
_ending = threading.Lock()  # held by the thread that ends the process: its line is the only one


def distributed_started() -> bool:
    """Whether this process joined a jax.distributed run (`start_distributed`)."""
    return _process["distributed"]


def mark_distributed(started: bool):
    _process["distributed"] = started


def exit_process(code: int, line: str | None = None, then: Callable[[], None] | None = None) -> NoReturn:
    """End the process now, without the interpreter's shutdown (a jax.distributed run's exit barrier would wait for
    peers): prints `error: {line}` first, then calls `then` (cleanrl_utils.liveness.outlive_peers: the peers print
    theirs). Called by cleanrl_utils.cli.run_cli, and by watchdog threads (`start_distributed`'s timeout, the
    liveness watchdog); the first caller ends the process, a later one waits for that."""
    if not _ending.acquire(blocking=False):
        threading.Event().wait()  # another thread is ending the process, with its own line
    if line is not None:
        print(f"error: {line}", file=sys.stderr, flush=True)
    if then is not None:
        then()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def slurm_job_id() -> str | None:
    """The Slurm job this process runs in, as `scontrol requeue` takes it: an array task is `{array job}_{task}`;
    None outside Slurm."""
    job, array_job, task = (
        os.environ.get(name) for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
    )
    return f"{array_job}_{task}" if job is not None and array_job and task else job


def local_device_ids(args) -> list[int] | None:
    """The local devices jax.distributed makes visible to this process: every id up to the largest that the
    device-id flags name (None: JAX_LOCAL_DEVICE_IDS, the user's own choice, is left to JAX)."""
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return None
    return list(range(max(getattr(args, "actor_device_ids", []) + args.learner_device_ids) + 1))


def start_distributed(args):
    """jax.distributed.initialize, bounded: a peer that has not arrived after --heartbeat-timeout seconds ends the
    wait with one line (JAX's own timeout aborts the process with a C++ stack dump, so ours fires first). Then the
    processes check that each host's own address is one the others can reach. Then the caller starts the liveness
    watchdog (cleanrl_utils/liveness.py) and compares the flags (cleanrl_utils/agreement.py)."""
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


def shutdown():
    """Leave jax.distributed: a barrier, every process ends its run."""
    if distributed_started():
        import jax

        jax.distributed.shutdown()
        mark_distributed(False)
