"""jax.distributed runs on this machine: two processes on 127.0.0.1, each with 2 host CPU devices (a0-l1-d2)."""

import re
import signal
import time

from conftest import CARTPOLE_LEARNING, read_scalars, run_script, start_processes

CARTPOLE = ["--env-id", "CartPole-v1", "--num-steps", "32", "--hiddens", "16", "--num-actor-threads", "1",
            "--actor-device-ids", "0", "--learner-device-ids", "1", "--log-frequency", "1"]
DIGEST = re.compile(r"process (\d): final params sha256=([0-9a-f]{64})")


def finish(processes, timeout=300):
    outputs = [process.communicate(timeout=timeout) for process in processes]
    return [(process.returncode, out, err) for process, (out, err) in zip(processes, outputs)]


def test_two_processes_train_one_learner(workdir):
    flags = [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "1280"]
    results = finish(start_processes(flags, workdir, 2, run_name="two"))
    for rank, (returncode, out, err) in enumerate(results):
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
    for victim in [1, 0]:  # a worker, then the coordinator
        processes = start_processes([*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "100000000"],
                                    workdir, 2, run_name=f"kill{victim}")
        survivor = processes[1 - victim]
        try:
            for line in processes[0].stdout:  # wait until both are training together
                if line.startswith("update=3/"):
                    break
            processes[victim].kill()
            killed = time.time()
            returncode = survivor.wait(timeout=120)
            assert returncode != 0
            assert time.time() - killed < 60, f"survivor took {time.time() - killed:.0f}s to exit"
        finally:
            for process in processes:
                process.kill()
                process.communicate()


def test_one_and_two_processes_learn_alike_with_the_same_global_batch(workdir, cartpole_learning_run):
    one = cartpole_learning_run  # 1 process x 8 envs
    assert one.returncode == 0, one.stderr
    results = finish(start_processes([*CARTPOLE_LEARNING, "--local-num-envs", "4"], workdir, 2, run_name="two"),
                     timeout=600)
    assert all(returncode == 0 for returncode, _, _ in results), results[0][2] + results[1][2]
    for run_dir in [one.run_dir, workdir / "runs" / "two"]:
        returns = [value for _, value in read_scalars(run_dir)["charts/avg_episodic_return"]]
        assert max(returns) >= 400, f"{run_dir.name}: best average return {max(returns):.0f}"


def test_sigterm_to_every_process_checkpoints_one_update_and_resumes(workdir):
    """SLURM preemption signals every task: all processes stop after the same update, then resume together."""
    flags = [*CARTPOLE, "--local-num-envs", "4", "--total-timesteps", "3840", "--checkpoint-frequency", "0"]
    processes = start_processes(flags, workdir, 2, run_name="pre")
    try:
        for line in processes[0].stdout:
            if line.startswith("update=4/"):
                break
        for process in processes:
            process.send_signal(signal.SIGTERM)
        results = finish(processes, timeout=60)
    finally:
        for process in processes:
            process.kill()
    saved = [re.findall(r"checkpoint saved: update=(\d+)", out) for _, out, _ in results]
    assert [returncode for returncode, _, _ in results] == [143, 143], results[1][2]
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved  # one checkpoint, after the same update
    resumed = finish(start_processes(flags, workdir, 2, run_name="pre"))
    assert all(returncode == 0 for returncode, _, _ in resumed), resumed[0][2] + resumed[1][2]
    assert all(f"resumed from checkpoint: update={saved[0][0]} " in out for _, out, _ in resumed)
    digests = [DIGEST.search(out).group(2) for _, out, _ in resumed]
    assert digests[0] == digests[1]
    steps = [step for step, _ in read_scalars(workdir / "runs" / "pre")["charts/SPS"]]
    assert steps == [256 * i for i in range(1, 16)]
