"""A real two-node Slurm (tests/slurm_cluster.py): jobs submitted with the sweep tool and cleanba.slurm_template as
docs/distributed.md says, checked by what a user sees: `scontrol show job`, the job's log and the run folder."""

import os
import re
import signal
import sys

import pytest
from conftest import PPO_SCRIPT, read_scalars, script_env
from slurm_cluster import NODES, Cluster, process_environment, tcp_peers, why_not_here

# every test here runs jobs of a few updates each on a real cluster: the slow tier
pytestmark = pytest.mark.slow

# CartPole with a tiny network, a line and a TensorBoard point every update, no periodic checkpoint: a resumed
# attempt can only start from the checkpoint its predecessor wrote when it was stopped
TINY_CARTPOLE = (
    f"{PPO_SCRIPT} --num-steps 32 --hiddens 16 --num-actor-threads 1 --actor-device-ids 0 --learner-device-ids 1 "
    "--local-num-envs 4 --log-frequency 1 --checkpoint-frequency 0"
)
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = why_not_here()
    if reason is not None:
        if os.environ.get("CLEANBA_REQUIRE_SLURM"):  # .ci/run: the cluster's packages were installed for these tests
            pytest.fail(f"CLEANBA_REQUIRE_SLURM is set, but a Slurm cluster cannot start here: {reason}")
        pytest.skip(reason)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def command(total_updates: int, tasks: int) -> str:
    """The training command of a job of `tasks` processes: `total_updates` updates of 128 steps per process."""
    distributed = " --distributed" if tasks > 1 else ""
    return f"{sys.executable} {TINY_CARTPOLE} --total-timesteps {128 * tasks * total_updates}{distributed}"


def test_a_two_node_job_is_one_run_that_a_requeue_stops_and_resumes_on_both_nodes(cluster, workdir):
    """The sweep tool's job of 2 nodes x 1 task: one jax.distributed process per node, the coordinator on the first
    node's address; `scontrol requeue` stops both after the same update, with the stop checkpoint, and both resume
    from it on the next attempt; the job ends COMPLETED 0:0 with equal final params, every TensorBoard step once."""
    total_updates = 20
    job = cluster.submit_sweep(workdir, command(total_updates, tasks=2), tasks=2, nodes=2, env=script_env())
    job.wait_for_line(r"^update=3/")
    pids = [job.task_pid(rank) for rank in range(2)]
    environments = [process_environment(pid) for pid in pids]
    assert [environment["SLURMD_NODENAME"] for environment in environments] == list(NODES), job.details()
    coordinator = (NODES["node1"], int(environments[0]["JAX_COORDINATOR_PORT"]))
    assert coordinator in tcp_peers(pids[1]), f"{tcp_peers(pids[1])}\n{job.details()}"
    cluster.run("scontrol", "requeue", job.id)
    restarted = job.wait_for_line(rf"^\S+ job {job.id} \(restart 1\)")
    job.wait_for_line(r"^resumed from checkpoint: .*\n(.*\n)*resumed from checkpoint: ", after=restarted.end())
    state = job.wait_for_state(FINAL_STATES)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "1"), job.details()
    stopped_attempt, resumed_attempt = job.log()[: restarted.start()], job.log()[restarted.end() :]
    # each process wrote its part of the stop checkpoint after the same update, and resumed from it
    stops = re.findall(r"^stopped by signal 15 after update (\d+): Slurm job", stopped_attempt, re.MULTILINE)
    resumes = re.findall(r"^resumed from checkpoint: update=(\d+) ", resumed_attempt, re.MULTILINE)
    assert len(stops) == 2 and stops == resumes and len(set(stops)) == 1, job.details()
    # Slurm ended the batch script with srun: a requeued attempt has no `srun exited` line (docs/distributed.md)
    assert "srun exited" not in stopped_attempt and "srun exited with code 0" in resumed_attempt, job.details()
    digests = dict(re.findall(r"^process (\d): final params sha256=([0-9a-f]{64})", resumed_attempt, re.MULTILINE))
    assert sorted(digests) == ["0", "1"] and digests["0"] == digests["1"], job.details()
    assert [step for step, _ in read_scalars(job.run_dir)["charts/SPS"]] == [
        256 * update for update in range(1, total_updates + 1)
    ]


def test_requeue_and_preemption_with_or_without_grace_time_resume_the_run_by_themselves(cluster, workdir):
    """One job's life on a cluster: a `scontrol requeue`, then a preemption without a grace time (Slurm requeues the
    job itself), then one with GraceTime=60 (Slurm would record FAILED 143 and never requeue it: the template
    requeues it). Each time the run writes its stop checkpoint after the update in progress, the next attempt
    resumes from it, and the job ends COMPLETED 0:0 at the full step count, with every TensorBoard step logged
    once and the log of every attempt kept."""
    total_updates = 600  # room for the last interruption to arrive before the run ends, on an idle machine too
    job = cluster.submit_sweep(workdir, command(total_updates, tasks=1), tasks=1, env=script_env())
    interruptions = [
        ("scontrol requeue", 0, lambda: cluster.run("scontrol", "requeue", job.id)),
        ("preemption without a grace time", 0, cluster.preempt),
        ("preemption with GraceTime=60", 60, cluster.preempt),
    ]
    position, resumed_at = 0, 0
    for attempt, (what, grace_time, interrupt) in enumerate(interruptions):
        cluster.set_grace_time(grace_time)
        position = job.wait_for_line(rf"^\S+ job {job.id} \(restart {attempt}\)", after=position).end()
        # a few updates into this attempt, then the interruption
        job.wait_for_line(rf"^update={resumed_at + 10}/", after=position)
        interrupt()
        stopped = job.wait_for_line(r"^stopped by signal 15 after update (\d+): Slurm job", after=position)
        stop_update = int(stopped.group(1))
        logged = [int(update) for update in re.findall(r"^update=(\d+)/", job.log()[position : stopped.start()], re.M)]
        # nothing that was logged is lost: the stop checkpoint holds the last update done
        assert logged[-1] == stop_update and re.search(
            rf"^checkpoint saved: update={stop_update} ", job.log()[position : stopped.start()], re.M
        ), f"{what}: {job.details()}"
        position = stopped.end()
        resumed = job.wait_for_line(r"^resumed from checkpoint: update=(\d+) ", after=position)
        assert int(resumed.group(1)) == stop_update, f"{what}: {job.details()}"
        resumed_at = stop_update
        between_attempts = job.log()[position : resumed.start()]
        if grace_time:  # the job ended within its grace time: requeued by the template, not by Slurm
            assert "srun exited with code 143" in between_attempts, job.details()
            assert "preempted, requeued" in between_attempts, job.details()
        else:  # requeued by Slurm, which ends the batch script with srun: the template says nothing more
            assert "srun exited" not in between_attempts, f"{what}: {job.details()}"
    state = job.wait_for_state(FINAL_STATES)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("COMPLETED", "0:0", "3"), job.details()
    log = job.log()
    assert [int(restart) for restart in re.findall(rf"job {job.id} \(restart (\d+)\)", log)] == [0, 1, 2, 3]
    assert f"update={total_updates}/{total_updates} " in log and "process 0: final params" in log
    assert [step for step, _ in read_scalars(job.run_dir)["charts/SPS"]] == [
        128 * update for update in range(1, total_updates + 1)
    ]


def test_a_killed_task_ends_the_job_with_a_line_naming_it(cluster, workdir):
    """SIGKILL to process 1 of a two-task job: process 0 stops at its next collective with one line naming
    process 1 (no traceback), srun names the task, and the job ends FAILED, not requeued."""
    job = cluster.submit_sweep(workdir, command(100_000, tasks=2), tasks=2, env=script_env())
    job.wait_for_line(r"^update=3/")
    os.kill(job.task_pid(1), signal.SIGKILL)
    state = job.wait_for_state(FINAL_STATES, timeout=120)
    assert (state["JobState"], state["Restarts"]) == ("FAILED", "0"), job.details()
    errors = job.errors()
    error_lines = [line for line in errors.splitlines() if line.startswith("error:")]
    assert error_lines == [
        "error: --distributed: process 1 of this run's 2 ended first (killed, or stopped by its own error: see its "
        "output); process 0 stops too. The run resumes from its last checkpoint when every process is started again"
    ], job.details()
    assert "task 1: Killed" in errors and "Traceback" not in errors, job.details()


def test_a_node_whose_own_name_resolves_to_a_loopback_address_stops_the_job_before_training(cluster, workdir):
    """Debian's default /etc/hosts line on the second node (`127.0.1.1 node2`): Gloo there would listen on an
    address the first node cannot reach. Both processes end before training with one line naming the host, the
    address and the fix, exit code 2 (no Gloo traceback)."""
    cluster.write_hosts_file("node2", own_address="127.0.1.1")
    try:
        job = cluster.submit_sweep(workdir, command(20, tasks=2), tasks=2, nodes=2, env=script_env())
        state = job.wait_for_state(FINAL_STATES, timeout=120)
    finally:
        cluster.write_hosts_file("node2")
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), job.details()
    expected = (
        "error: --distributed: host node2's own name resolves to 127.0.1.1, a loopback address: the other hosts cannot "
        "reach its processes there. Map node2 to its network address on node2 (its /etc/hosts, where Debian's default "
        "line is '127.0.1.1 node2', or DNS)"
    )
    assert [line for line in job.errors().splitlines() if line.startswith("error:")] == [expected] * 2, job.details()
    assert "Traceback" not in job.errors() and "update=" not in job.log(), job.details()


def test_a_node_that_drops_off_the_network_ends_the_run_with_one_line(cluster, workdir):
    """The second node's link goes down mid-run (its processes go on, unreachable): process 0 ends within
    --heartbeat-timeout (30 s) with one line naming process 1 and its host, and how the run resumes; no JAX abort,
    no C++ stack trace."""
    job = cluster.submit_sweep(workdir, command(100_000, tasks=2), tasks=2, nodes=2, env=script_env())
    job.wait_for_line(r"^update=3/")
    cluster.set_link("node2", up=False)
    try:
        lost = job.wait_for_line(r"^error: .*", timeout=60, errors=True)
    finally:
        cluster.set_link("node2", up=True)
        # srun waits for the exit of process 1, whose node was away when it ended (a node failure that Slurm would
        # find after SlurmdTimeout, 300 s, and requeue the job); the test ends the job now, srun included (on
        # SIGTERM it would wait 32 s more for that exit)
        cluster.run("scancel", "--full", "--signal=KILL", job.id)
    assert re.fullmatch(
        rf"error: --distributed: process 1 \(host node2\) of this run's 2 went silent: no answer for \d+s \(its host "
        r"is down or off the network, or the process is stopped\); process 0 stops too\. The run resumes from its "
        r"last checkpoint when every process is started again; under Slurm the job resumes when requeued \(by Slurm "
        rf"on a node failure, or scontrol requeue {job.id}\)",
        lost.group(0),
    ), job.details()
    errors = job.errors()
    assert not re.search(r"Terminating process|Traceback|^F\d{4} |stack trace", errors, re.MULTILINE), job.details()
