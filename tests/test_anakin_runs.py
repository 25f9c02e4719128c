"""The Anakin PPO scripts run as processes, for an env of each family: every update logged at lag 0, SIGTERM then
resume bit for bit (the envs included); for an env of each script: two processes with identical params (and the
layout change on resume); bad input across two processes, a diverged update."""

import re
import shutil
import signal

import numpy as np
import pytest
from anakin_families import DIGESTS, FAMILIES, ONE_PER_SCRIPT, TINY, final_digests, script_of
from conftest import (
    ANAKIN_SCRIPT,
    finish_processes,
    finish_script,
    read_scalars,
    run_script,
    start_processes,
    start_script,
    wait_for_line,
)

SEED_DIGESTS = re.compile(r"seed (\d+): params sha256=([0-9a-f]{64}) envs sha256=([0-9a-f]{64})")


def every_digest(line: str) -> dict[str | None, tuple]:
    """A digests line's (params, envs) of each seed (--num-seeds), or of the run's one seed (None)."""
    seeds = SEED_DIGESTS.findall(line)
    return {seed: tuple(digests) for seed, *digests in seeds} if seeds else {None: DIGESTS.search(line).groups()}


@pytest.fixture(scope="module", params=FAMILIES)
def seeded_runs(tmp_path_factory, request) -> dict:
    """A run, and a second run of the same seed stopped by SIGTERM after update 4, then resumed by the same command (no
    --resume: a --run-name with checkpoints resumes)."""
    workdir = tmp_path_factory.mktemp("anakin")
    flags = [
        *TINY,
        "--env-id",
        request.param,
        "--total-timesteps",
        "12800",
        "--checkpoint-frequency",
        "0",
    ]  # 100 updates (CartpoleBalance: each env ends its first 1,000-step episode)
    script = script_of(request.param)[1]
    first = run_script(flags, workdir, "first", script=script)
    stopped = start_script(flags, workdir, "stopped", script)
    try:
        lines = wait_for_line(stopped, "update=4/")
        stopped.send_signal(signal.SIGTERM)
        out, err = stopped.communicate(timeout=60)
    finally:
        stopped.kill()
    resumed = finish_script(start_script(flags, workdir, "stopped", script), workdir, "stopped")
    return {
        "first": first,
        "stopped": (stopped.returncode, "".join(lines) + out, err),
        "resumed": resumed,
    }


@pytest.mark.slow
def test_a_run_logs_every_update_with_the_actor_at_the_learners_version(seeded_runs):
    first = seeded_runs["first"]
    assert first.returncode == 0, first.stderr[-2000:]
    scalars = first.scalars()
    for tag in ["charts/SPS", "charts/avg_episodic_return", "charts/learning_rate", "losses/approx_kl"]:
        assert len(scalars[tag]) > 0, tag
    assert [v for _, v in scalars["stats/actor_policy_version"]] == list(range(100))  # lag 0: the learner's policy
    assert [step for step, _ in scalars["charts/SPS"]] == [128 * u for u in range(1, 101)]


@pytest.mark.slow
def test_sigterm_then_resume_ends_bit_for_bit_as_the_uninterrupted_run(seeded_runs):
    returncode, out, err = seeded_runs["stopped"]
    assert returncode == 143, err[-2000:]
    stopped_update = int(re.findall(r"checkpoint saved: update=(\d+)", out)[-1])
    assert 4 <= stopped_update < 100, out[-2000:]  # stopped mid-run, after the update the signal reached
    saved = DIGESTS.search(out.split("checkpoint saved: ")[-1]).groups()
    uninterrupted = final_digests(seeded_runs["first"].stdout)
    resumed = seeded_runs["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from checkpoint: update={stopped_update} " in resumed.stdout
    assert DIGESTS.search(resumed.stdout.split("resumed from checkpoint: ")[1]).groups() == saved
    # the envs resume where they were: the whole run, params and envs, is the uninterrupted one (so a seed's run is
    # reproducible too: the stopped run is a second run of the same seed)
    assert final_digests(resumed.stdout) == uninterrupted


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ONE_PER_SCRIPT)
def test_two_processes_hold_identical_params_and_step_the_envs_of_one(workdir, env_id):
    """Two hosts whose working directories differ (each its own runs/ folder), with one --checkpoint-dir both see;
    for MiniGrid, two seeds (--num-seeds 2: each process holds every seed and its half of each seed's envs), one model
    saved and evaluated per seed, and their checkpoint resumed in one process on two learner devices, each seed bit
    for bit (the layout change docs/reliability.md promises: the learner key, replicated over two processes when saved,
    restores onto the one process's devices; the checkpoints' code is the same for every family, the two processes
    are each family's)."""
    flags = [
        *TINY,
        "--env-id",
        env_id,
        "--total-timesteps",
        "2560",
        "--num-minibatches",
        "1",
        "--checkpoint-frequency",
        "5",
        *(["--num-seeds", "2"] if env_id == FAMILIES[0] else []),
    ]
    hosts, shared, script = [workdir / "host0", workdir / "host1"], workdir / "shared_checkpoints", script_of(env_id)[1]
    for host in hosts:
        host.mkdir()
    save_model = ["--save-model", "--eval-episodes", "1"] if env_id == FAMILIES[0] else []
    results = finish_processes(
        start_processes([*flags, *save_model, "--checkpoint-dir", str(shared)], hosts, 2, run_name="two", script=script)
    )
    for returncode, _, err in results:
        assert returncode == 0, err[-3000:]
    # 10 updates of 16 envs x 16 steps, checkpoints 5 and 10, written by both processes into the shared folder
    assert sorted(p.name for p in shared.iterdir() if p.name != ".lock") == ["10", "5"]
    digests = [every_digest(out.split("final ")[-1]) for _, out, _ in results]
    assert digests[0] == digests[1], "the processes' states differ"
    # each process first prints the layout: the mesh (process 0's device first), its learner device and its 8 envs'
    # global indices
    for process, (_, out, _) in enumerate(results):
        assert re.search(r"^learner mesh \(axis batch, in order\): cpu:\d+, cpu:\d+$", out, re.MULTILINE), out[:2000]
        first = 8 * process
        envs = rf"envs 0-7 \(global {first}-{first + 7}\)"
        assert re.search(rf"^process {process} learner device cpu:\d+: {envs}$", out, re.MULTILINE), out[:2000]
    if env_id != FAMILIES[0]:
        return
    assert sorted(digests[0]) == ["1", "2"] and digests[0]["1"] != digests[0]["2"]
    for seed in (1, 2):  # process 0 saves and evaluates a model per seed
        seed_dir = hosts[0] / "runs" / "two" / f"seed{seed}"
        assert (seed_dir / "cleanba_ppo_anakin.cleanrl_model").is_file()
        assert len(read_scalars(seed_dir)["eval/episodic_return"]) == 1
    saved = every_digest(re.search(r"checkpoint saved: update=5 .*", results[0][1]).group(0))
    # checkpoint 5, resumed by one process on two devices: each seed restored bit for bit, and the same 16 envs of
    # each seed stepped on to the same env states, bit for bit
    one_process = workdir / "one_checkpoints"
    shutil.copytree(shared, one_process)
    shutil.rmtree(one_process / "10")
    flags = [*flags, "--learner-device-ids", "0", "1", "--checkpoint-dir", str(one_process)]
    one = run_script(flags, workdir, "two", script=script)  # the run's own name, in the working directory
    assert one.returncode == 0, one.stderr[-3000:]
    assert every_digest(re.search(r"resumed from checkpoint: update=5 .*", one.stdout).group(0)) == saved
    final = every_digest(one.stdout.split("final ")[-1])
    assert {seed: envs for seed, (_, envs) in final.items()} == {seed: envs for seed, (_, envs) in digests[0].items()}
    assert "process 0 learner device cpu:1: envs 0-7 (global 8-15)" in one.stdout  # the same envs, on one process


@pytest.mark.slow
def test_two_processes_with_a_bad_env_id_each_end_with_its_one_line(workdir):
    """--env-id is checked once jax.distributed has started (importing xminigrid starts JAX's backend), in every
    process: each prints the one line and exits 2, process 0 (JAX's coordination service) last, so that no peer is
    aborted by JAX mid-way (twice: the exits race)."""
    for attempt in range(2):
        results = finish_processes(
            start_processes(
                [*TINY, "--env-id", "MiniGrid-Empty-5x5-v0"], workdir, 2, run_name=f"bad{attempt}", script=ANAKIN_SCRIPT
            ),
            timeout=120,
        )
        for rank, (returncode, _, err) in enumerate(results):
            errors = [line for line in err.splitlines() if line.startswith("error:")]
            assert returncode == 2 and len(errors) == 1, (attempt, rank, err[-3000:])
            assert errors[0].startswith("error: --env-id must be one of MiniGrid-"), errors
            assert "Traceback" not in err and "Terminating process" not in err, err[-3000:]


@pytest.mark.slow
def test_a_diverged_update_stops_with_one_line_and_the_last_finite_checkpoint(workdir):
    run = run_script([*TINY, "--total-timesteps", "2560", "--learning-rate", "1e38"], workdir, script=ANAKIN_SCRIPT)
    assert run.returncode == 1, run.stderr[-2000:]
    error = run.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"error: update (\d+) diverged .* the last finite state is checkpoint \d+; .*", error), error


@pytest.mark.slow
def test_four_seeds_on_two_devices_stop_and_resume_each_bit_for_bit(workdir):
    """--num-seeds 4 on two learner devices (every device holds every seed, its half of each seed's envs): every
    seed's TensorBoard folder (runs/{run}/seed{seed}) logs each update once, the run's folder the mean of the seeds'
    returns and their min and max; SIGTERM after update 4, then the same command: each seed's final digests are the
    uninterrupted 4-seed run's; --save-model saves and evaluates one model per seed."""
    flags = [*TINY, "--env-id", "MiniGrid-Empty-5x5", "--total-timesteps", "3200", "--num-seeds", "4", "--seed", "3"]
    flags = [*flags, "--local-num-envs", "4", "--learner-device-ids", "0", "1"]  # 2 x 4 envs x 16 steps an update
    first = run_script([*flags, "--save-model", "--eval-episodes", "1"], workdir, "first", script=ANAKIN_SCRIPT)
    assert first.returncode == 0, first.stderr[-2000:]
    uninterrupted = every_digest(first.stdout.split("final ")[-1])
    assert sorted(uninterrupted) == ["3", "4", "5", "6"] and len(set(uninterrupted.values())) == 4
    assert re.search(r"avg_episodic_return=[\d.]+ \(seeds: min [\d.]+ max [\d.]+\)", first.stdout), first.stdout
    scalars = first.scalars()
    for tag in ["charts/avg_episodic_return_min", "charts/avg_episodic_return_max", "losses/approx_kl"]:
        assert [step for step, _ in scalars[tag]][-1] == 3200, tag
    seed_returns = []
    for seed in range(3, 7):
        seed_scalars = read_scalars(first.run_dir / f"seed{seed}")
        assert [step for step, _ in seed_scalars["losses/approx_kl"]] == [128 * u for u in range(1, 26)]
        assert len(seed_scalars["eval/episodic_return"]) == 1
        assert (first.run_dir / f"seed{seed}" / "cleanba_ppo_anakin.cleanrl_model").is_file()
        seed_returns.append(dict(seed_scalars["charts/avg_episodic_return"]))
    # the run's return is the mean of the seeds' (each seed weighs the same, however many of its envs have finished
    # an episode), at every update where each seed has one
    both = [
        (step, value) for step, value in scalars["charts/avg_episodic_return"] if all(step in r for r in seed_returns)
    ]
    assert len(both) > 10
    for step, value in both:
        assert value == pytest.approx(np.mean([r[step] for r in seed_returns]), rel=1e-6), step
    stopped = start_script(flags, workdir, "stopped", ANAKIN_SCRIPT)
    try:
        wait_for_line(stopped, "update=4/")
        stopped.send_signal(signal.SIGTERM)
        stopped.communicate(timeout=60)
    finally:
        stopped.kill()
    assert stopped.returncode == 143
    resumed = finish_script(start_script(flags, workdir, "stopped", ANAKIN_SCRIPT), workdir, "stopped")
    assert resumed.returncode == 0 and "resumed from checkpoint: update=" in resumed.stdout, resumed.stderr[-2000:]
    assert every_digest(resumed.stdout.split("final ")[-1]) == uninterrupted
    for seed in range(3, 7):  # every update logged once, across the stop
        steps = [step for step, _ in read_scalars(resumed.run_dir / f"seed{seed}")["losses/approx_kl"]]
        assert steps == [128 * u for u in range(1, 26)], steps
