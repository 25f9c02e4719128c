"""A real two-node Slurm cluster for the tests: munged and slurmctld from Debian's packages on this machine, and one
slurmd per node, each node in its own network and UTS namespace (its own host name, address and hosts file) joined
to this machine by a veth pair on a private bridge with no route out; started in a temporary folder with
tests/slurm/slurm.conf, stopped by their PIDs, the namespaces and the bridge removed. Jobs are submitted the way
docs/distributed.md says (the sweep tool and cleanba.slurm_template); every wait is bounded and ends the test with
the job's state and log when its time is up."""

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
DAEMONS = ["munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "srun"]
NAMESPACE_TOOLS = ["ip", "nsenter", "unshare", "mount"]
PACKAGES = "slurmctld slurmd slurm-client munge iproute2"
# the private bridge: this machine's side (slurmctld listens there) and the nodes' addresses, no route out; named
# after this process, so that two test sessions on one machine keep apart
SESSION = os.getpid()
BRIDGE = f"cbr{SESSION}"
NETWORK = f"10.157.{SESSION % 250 + 1}"
CONTROLLER_ADDRESS = f"{NETWORK}.1"
NODES = {"node1": f"{NETWORK}.11", "node2": f"{NETWORK}.12"}


def why_not_here() -> str | None:
    """Why this machine cannot run the cluster (None: it can)."""
    missing = [name for name in DAEMONS + NAMESPACE_TOOLS if shutil.which(name) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install {PACKAGES}; bash .ci/run does as root)"
    if os.geteuid() != 0:
        return "not root (slurmd starts the jobs' processes as their users, and the nodes' namespaces need root)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(condition, timeout: float, what: str, details=lambda: ""):
    """Poll `condition()` until it returns something true (returned), or fail the test after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{details()}")


def namespace(node: str, session: int = SESSION) -> str:
    return f"cleanba{session}-{node}"


def ip(*command: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *command], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        pytest.fail(f"ip {' '.join(command)}: exit code {result.returncode}\n{result.stderr}")
    return result.stdout


def remove_network(session: int = SESSION):
    """A session's namespaces and bridge (the veth pairs go with the namespaces)."""
    for node in NODES:
        ip("netns", "delete", namespace(node, session), check=False)
    ip("link", "delete", f"cbr{session}", check=False)


def remove_stale_networks():
    """The namespaces and bridges that earlier sessions, now gone, left behind (a crash, a kill -9)."""
    names = ip("netns", "list", check=False) + ip("-o", "link", "show", "type", "bridge", check=False)
    found = re.findall(r"\bcleanba(\d+)-node\d\b|\bcbr(\d+)\b", names)  # (namespace's, bridge's) session
    for session in {int(number) for pair in found for number in pair if number}:
        if not Path(f"/proc/{session}").exists():
            remove_network(session)


def create_network():
    """A bridge on this machine ({CONTROLLER_ADDRESS}) and, per node, a network namespace whose eth0 is one end of
    a veth pair plugged into the bridge: the nodes reach each other and slurmctld, and nothing else."""
    remove_stale_networks()
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{CONTROLLER_ADDRESS}/24", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    for node, address in NODES.items():
        ip("netns", "add", namespace(node))
        ip("link", "add", f"{BRIDGE}-{node[-1]}", "type", "veth", "peer", "name", "eth0", "netns", namespace(node))
        ip("link", "set", f"{BRIDGE}-{node[-1]}", "master", BRIDGE, "up")
        ip("-n", namespace(node), "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace(node), "link", "set", "eth0", "up")
        ip("-n", namespace(node), "link", "set", "lo", "up")


class Cluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.hosts_files = {node: folder / f"hosts-{node}" for node in NODES}
        self.pid_files = [folder / "munge" / "munged.pid", folder / "slurmctld.pid"] + [
            folder / f"slurmd-{node}.pid" for node in NODES
        ]

    # ------------------------------------------------------------ start and stop

    def start(self):
        for sub in ["munge", "state", "spool", "log"] + [f"spool/{node}" for node in NODES]:
            (self.folder / sub).mkdir(mode=0o700)
        key = self.folder / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        munge = self.folder / "munge"
        self.run(
            "munged",
            "--force",
            f"--socket={munge / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
            daemon=True,
        )
        create_network()
        memory_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20
        self.cpus = len(os.sched_getaffinity(0))
        host = socket.gethostname().split(".")[0]
        self.conf.write_text(
            (TESTS / "slurm" / "slurm.conf")
            .read_text()
            .format(
                folder=self.folder,
                host=host,
                controller_address=CONTROLLER_ADDRESS,
                slurmctld_port=free_port(),
                slurmd_port=free_port(),
                node_lines="\n".join(
                    f"NodeName={node} NodeAddr={address} CPUs={self.cpus} RealMemory={memory_mb * 9 // 20} "
                    "State=UNKNOWN"
                    for node, address in NODES.items()
                ),
                node_names=",".join(NODES),
            )
        )
        for node in NODES:
            self.write_hosts_file(node)
        self.run("slurmctld", "-f", str(self.conf), daemon=True)
        for node in NODES:
            self.run(*self.on_node(node, "slurmd", "-f", str(self.conf), "-N", node), daemon=True)
        wait_until(
            lambda: (
                set(self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.splitlines())
                == {f"{node} idle" for node in NODES}
            ),
            60,
            "the nodes to be idle",
            self.daemon_logs,
        )

    def write_hosts_file(self, node: str, own_address: str | None = None):
        """The node's /etc/hosts: every node and the controller by their bridge addresses; `own_address` instead of
        its own (e.g. Debian's default line, 127.0.1.1). Written in place: the node's bind mount sees the change."""
        addresses = {**NODES, socket.gethostname().split(".")[0]: CONTROLLER_ADDRESS}
        if own_address is not None:
            addresses[node] = own_address
        lines = ["127.0.0.1 localhost"] + [f"{address} {name}" for name, address in addresses.items()]
        self.hosts_files[node].write_text("\n".join(lines) + "\n")

    def on_node(self, node: str, *command: str) -> list[str]:
        """`command` inside the node: its network namespace (nsenter), and its own UTS and mount namespaces
        (unshare: `ip netns exec` would remount /sys without the cgroup mounts slurmd needs) with its host name and
        its hosts file over /etc/hosts."""
        setup = f'hostname {node} && mount --bind {self.hosts_files[node]} /etc/hosts && exec "$@"'
        enter = ["nsenter", f"--net=/run/netns/{namespace(node)}", "unshare", "--mount", "--uts"]
        return [*enter, "sh", "-c", setup, "sh", *command]

    def set_link(self, node: str, up: bool):
        """The node's eth0 up or down (down: the node drops off the network, its processes go on)."""
        ip("-n", namespace(node), "link", "set", "eth0", "up" if up else "down")

    def stop(self):
        """Cancel every job, end whatever the jobs left (processes that carry this cluster's SLURM_CONF), then the
        daemons, by their PIDs; then the nodes' network."""
        for node in NODES:  # a node a test took off the network: its processes end like the others
            ip("-n", namespace(node), "link", "set", "eth0", "up", check=False)
        self.run("scancel", "--user", "root", check=False)
        deadline = time.time() + 45  # KillWait (30 s) and a margin
        while self.job_processes() and time.time() < deadline:
            time.sleep(0.5)
        for pid in self.job_processes():
            os.kill(pid, signal.SIGKILL)
        for pid_file in reversed(self.pid_files):
            if pid_file.exists():
                pid = int(pid_file.read_text())
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                deadline = time.time() + 15
                while Path(f"/proc/{pid}").exists() and time.time() < deadline:
                    time.sleep(0.2)
                if Path(f"/proc/{pid}").exists():
                    os.kill(pid, signal.SIGKILL)
        remove_network()

    def job_processes(self) -> list[int]:
        """PIDs of the processes that the cluster's jobs started (their environment names this cluster's config)."""
        mark = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                try:
                    if mark in (proc / "environ").read_bytes().split(b"\0"):
                        pids.append(int(proc.name))
                except OSError:
                    continue
        return pids

    def daemon_logs(self) -> str:
        return "\n".join(
            f"--- {path.name}:\n{path.read_text()[-3000:]}" for path in sorted((self.folder / "log").glob("*.log"))
        )

    # ------------------------------------------------------------ what a user types

    def run(self, *command: str, check: bool = True, daemon: bool = False) -> subprocess.CompletedProcess:
        """A Slurm command on this cluster; a daemon (which gets its config with -f) without SLURM_CONF, so that only
        the jobs' processes carry it (`job_processes`)."""
        env = {k: v for k, v in self.env.items() if k != "SLURM_CONF"} if daemon else self.env
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            pytest.fail(f"{' '.join(command)}: exit code {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    def submit_sweep(self, workdir: Path, command: str, *, tasks: int, env: dict, nodes: int = 1) -> "Job":
        """One run of `command` (--env-id CartPole-v1 --seed 1 appended) as docs/distributed.md submits it: the sweep
        tool renders cleanba.slurm_template into a one-task job array (`tasks` tasks on `nodes` nodes) and sbatch
        submits it from `workdir`."""
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "cleanrl_utils.benchmark",
                "--env-ids",
                "CartPole-v1",
                "--num-seeds",
                "1",
                "--command",
                command,
                "--slurm-template-path",
                str(REPO / "cleanba.slurm_template"),
                "--slurm-nodes",
                str(nodes),
                "--slurm-ntasks",
                str(tasks),
                "--slurm-cpus-per-task",
                "1",
                "--slurm-gpus-per-task",
                "0",
                "--slurm-log-dir",
                str(workdir / "slurm"),
            ],
            cwd=workdir,
            env={**env, "SLURM_CONF": str(self.conf), "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        submitted = re.search(r"Submitted batch job (\d+)", result.stdout)
        assert result.returncode == 0 and submitted, result.stdout[-2000:] + result.stderr[-2000:]
        return Job(self, submitted.group(1), workdir)

    def preempt(self) -> str:
        """A job in the high partition that needs every CPU of every node: it preempts the running job, then ends at
        once."""
        nodes, tasks = str(len(NODES)), str(len(NODES) * self.cpus)
        return self.run(
            "sbatch", "--parsable", "-p", "high", "-N", nodes, "-n", tasks, "-o", "/dev/null", "--wrap", "sleep 1"
        ).stdout.strip()

    def set_grace_time(self, seconds: int):
        self.run("scontrol", "update", "PartitionName=low", f"GraceTime={seconds}")


class Job:
    """An array task of a job submitted by the sweep tool (array index 0): its state, its log, its run."""

    def __init__(self, cluster: Cluster, array_job_id: str, workdir: Path):
        self.cluster, self.array_job_id, self.workdir = cluster, array_job_id, workdir
        self.id = f"{array_job_id}_0"
        self.out = workdir / "slurm" / f"cleanba_{array_job_id}_0.out"
        self.err = workdir / "slurm" / f"cleanba_{array_job_id}_0.err"
        self.run_dir = workdir / "runs" / f"CartPole-v1__cleanba__1__{array_job_id}"

    def state(self) -> dict[str, str]:
        """scontrol show job, as key -> value (JobState, Restarts, ExitCode, PreemptTime, ...)."""
        shown = self.cluster.run("scontrol", "show", "job", "-o", self.id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", shown))

    def log(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def errors(self) -> str:
        return self.err.read_text() if self.err.exists() else ""

    def details(self) -> str:
        log, errors = self.log()[-4000:], self.errors()[-4000:]
        return f"--- scontrol show job: {self.state()}\n--- out:\n{log}\n--- err:\n{errors}"

    def wait_for_line(self, pattern: str, timeout: float = 180, after: int = 0, errors: bool = False) -> re.Match:
        """The first match of `pattern` in the job's output (`errors`: its error output) after character `after`."""
        read = self.errors if errors else self.log
        return wait_until(
            lambda: re.compile(pattern, re.MULTILINE).search(read(), after), timeout, repr(pattern), self.details
        )

    def wait_for_state(self, states: set[str], timeout: float = 240) -> dict[str, str]:
        return wait_until(
            lambda: (state := self.state()).get("JobState") in states and state, timeout, str(states), self.details
        )

    def task_pid(self, rank: int) -> int:
        """The PID of the training process of task `rank` (not srun's, not slurmstepd's)."""

        def find():
            for pid in self.cluster.job_processes():
                try:
                    environ = process_environment(pid)
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                ours = environ.get("SLURM_ARRAY_JOB_ID") == self.array_job_id
                script = Path(argv[1].decode(errors="replace")).name if len(argv) > 1 else ""
                if ours and environ.get("SLURM_PROCID") == str(rank) and script.startswith("cleanba_"):
                    return pid
            return None

        return wait_until(find, 30, f"the process of task {rank}", self.details)


def process_environment(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(item.partition("=")[::2] for item in items if item)


def tcp_peers(pid: int) -> set[tuple[str, int]]:
    """The remote (address, port) of every established TCP connection in the process's network namespace (IPv4, and
    IPv4-mapped IPv6)."""
    peers = set()
    for table in ["tcp", "tcp6"]:
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            remote, state = line.split()[2:4]
            if state != "01":  # ESTABLISHED
                continue
            address, port = remote.split(":")
            raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
            peers.add((socket.inet_ntop(socket.AF_INET, raw[-4:]), int(port, 16)))
    return peers
