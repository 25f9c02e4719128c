"""jax.distributed runs on this machine: two processes on 127.0.0.1, each with 2 host CPU devices (a0-l1-d2)."""

import re
import signal
import time

import pytest
from conftest import (
    CARTPOLE_LEARNING,
    best_window,
    finish_processes,
    read_scalars,
    run_script,
    start_processes,
    wait_for_line,
)

# every test here starts two processes (jax.distributed on 127.0.0.1): the slow tier
pytestmark = pytest.mark.slow

CARTPOLE = (
    "--env-id CartPole-v1 --num-steps 32 --hiddens 16 --num-actor-threads 1 --actor-device-ids 0 "
    "--learner-device-ids 1 --log-frequency 1"
).split()
DIGEST = re.compile(r"process (\d): final params sha256=([0-9a-f]{64})")


def test_two_processes_train_one_learner(workdir):
    flags = [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "1280"]
    results = finish_processes(start_processes(flags, workdir, 2, run_name="two"))
    for returncode, out, err in results:
        assert returncode == 0, err
        assert "global_step=1280" in out and "process_SPS=" in out  # every process logs its own SPS
    digests = [DIGEST.search(out).groups() for _, out, _ in results]
    assert [rank for rank, _ in digests] == ["0", "1"]
    assert digests[0][1] == digests[1][1], "learner replicas diverged"
    # only process 0 writes TensorBoard; its steps count both processes
    assert len(list((workdir / "runs" / "two").glob("events.out.tfevents.*"))) == 1
    two_steps = [step for step, _ in read_scalars(workdir / "runs" / "two")["charts/SPS"]]
    single = run_script(flags, workdir, "one")
    assert single.returncode == 0, single.stderr
    one_steps = [step for step, _ in single.scalars()["charts/SPS"]]
    assert len(two_steps) == len(one_steps) // 2 and two_steps == [2 * s for s in one_steps[: len(two_steps)]]


def test_a_dead_process_ends_the_other_within_60_seconds(workdir):
    """A killed worker: the survivor's next all-reduce fails and it ends with one line naming the dead process. A
    killed process 0 takes JAX's coordination service with it, and JAX aborts the survivor itself (it takes no
    handler for that: cleanrl_utils/liveness.py); either way the survivor exits non-zero at once."""
    for victim in [1, 0]:  # a worker, then the coordinator
        processes = start_processes(
            [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "100000000"], workdir, 2, run_name=f"kill{victim}"
        )
        survivor = processes[1 - victim]
        try:
            wait_for_line(processes[0], "update=3/")  # both are training together
            processes[victim].kill()
            killed = time.time()
            _, err = survivor.communicate(timeout=120)
            assert survivor.returncode != 0
            assert time.time() - killed < 60, f"survivor took {time.time() - killed:.0f}s to exit"
        finally:
            for process in processes:
                process.kill()
                process.communicate()
        if victim == 1:
            assert [line for line in err.splitlines() if line.startswith("error:")] == [
                "error: --distributed: process 1 of this run's 2 ended first (killed, or stopped by its own error: "
                "see its output); process 0 stops too. The run resumes from its last checkpoint when every process "
                "is started again"
            ], err[-3000:]
            assert "Traceback" not in err


@pytest.mark.extra_learning
def test_two_processes_learn_cartpole_with_the_global_batch_of_one(workdir):
    """The README's CartPole PPO command (8 envs in one process: tests/test_learning.py) as two processes of 4 envs,
    the same global batch, for 100k env steps: from random play (about 20 per episode at the first update) to a best
    10k-step window of at least 200. Measured, seeds 1 and 2: 270 and 439 (the one-process run passes 400 between
    44k and 121k of its 250k steps, benchmark/results/readme_commands.jsonl). On this one-core machine a step of two
    processes costs four to five of one (34-43 s for these 100k steps, 21 s for the one process's 250k)."""
    flags = [*CARTPOLE_LEARNING, "--local-num-envs", "4", "--total-timesteps", "100000"]  # the last value counts
    results = finish_processes(start_processes(flags, workdir, 2, run_name="two"), timeout=600)
    assert all(returncode == 0 for returncode, _, _ in results), results[0][2] + results[1][2]
    returns = read_scalars(workdir / "runs" / "two")["charts/avg_episodic_return"]
    assert returns[0][1] < 50, returns[:5]
    assert best_window(returns, 10_000) >= 200, returns[::5]


def test_sigterm_to_every_process_checkpoints_one_update_and_resumes(workdir):
    """Slurm preemption signals every task: all processes stop after the same update, then resume together."""
    flags = [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "3840", "--checkpoint-frequency", "0"]
    processes = start_processes(flags, workdir, 2, run_name="pre")
    try:
        wait_for_line(processes[0], "update=4/")
        for process in processes:
            process.send_signal(signal.SIGTERM)
        results = finish_processes(processes, timeout=60)
    finally:
        for process in processes:
            process.kill()
    saved = [re.findall(r"checkpoint saved: update=(\d+)", out) for _, out, _ in results]
    assert [returncode for returncode, _, _ in results] == [143, 143], results[1][2]
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved  # one checkpoint, after the same update
    resumed = finish_processes(start_processes(flags, workdir, 2, run_name="pre"))
    assert all(returncode == 0 for returncode, _, _ in resumed), resumed[0][2] + resumed[1][2]
    assert all(f"resumed from checkpoint: update={saved[0][0]} " in out for _, out, _ in resumed)
    digests = [DIGEST.search(out).group(2) for _, out, _ in resumed]
    assert digests[0] == digests[1]
    steps = [step for step, _ in read_scalars(workdir / "runs" / "pre")["charts/SPS"]]
    assert steps == [256 * i for i in range(1, 16)]


def test_processes_in_different_folders_stop_at_once_with_one_line(tmp_path):
    """Hosts that do not share a working directory would each write runs/RUN/checkpoints of their own and wait
    forever for each other's part of a checkpoint: the start-up check stops both before training."""
    folders = [tmp_path / "host0", tmp_path / "host1"]
    for folder in folders:
        folder.mkdir()
    start = time.time()
    results = finish_processes(
        start_processes(
            [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "1280"], folders, 2, run_name="apart"
        ),
        timeout=120,
    )
    seconds = time.time() - start
    for rank, (returncode, out, err) in enumerate(results):
        assert returncode == 2, (rank, out, err)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith("error: --checkpoint-dir: process(es) [1] do not see"), err
        assert "Traceback" not in err and "update=" not in out
    assert seconds < 60, f"took {seconds:.0f}s"
    # the documented fix: one --checkpoint-dir that both see (here the same absolute path), and the run trains
    shared = tmp_path / "shared_checkpoints"
    results = finish_processes(
        start_processes(
            [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "1280", "--checkpoint-dir", str(shared)],
            folders,
            2,
            run_name="apart",
        ),
        timeout=300,
    )
    assert [returncode for returncode, _, _ in results] == [0, 0], results[0][2] + results[1][2]
    assert sorted(p.name for p in shared.iterdir() if p.name != ".lock") == ["5"]  # the final checkpoint, by both
    assert not (folders[1] / "runs").exists()  # process 1 writes nothing of its own


def test_sigterm_during_a_checkpoint_write_finishes_it_then_stops(workdir):
    """Slurm signals every task while they write a checkpoint: the write completes, then both stop and resume."""
    flags = [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "3840", "--checkpoint-frequency", "2"]
    processes = start_processes(flags, workdir, 2, run_name="pre", fault=["slow-checkpoint", "4"])
    try:
        wait_for_line(processes[0], "checkpoint write started: update=2")
        for process in processes:
            process.send_signal(signal.SIGTERM)
        sent = time.time()
        results = finish_processes(processes, timeout=60)
        seconds = time.time() - sent
    finally:
        for process in processes:
            process.kill()
    assert [returncode for returncode, _, _ in results] == [143, 143], results[0][2] + results[1][2]
    assert seconds < 30, f"{seconds:.0f}s from SIGTERM to exit"
    for _, out, _ in results:
        assert "checkpoint saved: update=2 " in out  # the write in progress completed
        assert "stopped by signal 15 after update" in out
    stopped_at = {re.search(r"stopped by signal 15 after update (\d+)", out).group(1) for _, out, _ in results}
    assert stopped_at == {"2"}  # both, right after the update whose checkpoint was being written
    resumed = finish_processes(start_processes(flags, workdir, 2, run_name="pre"))
    assert all(returncode == 0 for returncode, _, _ in resumed), resumed[0][2] + resumed[1][2]
    assert all("resumed from checkpoint: update=2 " in out for _, out, _ in resumed)
    assert DIGEST.search(resumed[0][1]).group(2) == DIGEST.search(resumed[1][1]).group(2)
