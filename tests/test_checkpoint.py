"""Never lose a run: periodic checkpoints, SIGTERM/Ctrl-C checkpoint and exit, resume, bad checkpoints."""

import dataclasses
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import FINAL, RESUMED, SAVED, read_scalars, run_script, script_command, script_env, wait_for_line
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from test_utils import TinyArgs, checkpoints_of, restore_values, save_values

from cleanrl_utils.checkpoints import CheckpointError, tree_digest

# 12 updates of 128 steps; a checkpoint every 3 updates, the 2 newest kept
CARTPOLE = (
    "--env-id CartPole-v1 --local-num-envs 4 --num-steps 32 --hiddens 16 --num-actor-threads 2 "
    "--learner-device-ids 1 --total-timesteps 3072 --checkpoint-frequency 3 --checkpoint-keep 2 "
    "--log-frequency 1"
).split()


def interrupt(workdir, run_name, flags, after_update, sig=signal.SIGTERM):
    """Start a run, send `sig` once it has logged `after_update`; return (exit code, seconds to exit, output)."""
    process = subprocess.Popen(
        script_command(flags, run_name),
        cwd=workdir,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = wait_for_line(process, f"update={after_update}/")
        sent = time.time()
        process.send_signal(sig)
        out, err = process.communicate(timeout=60)
        return process.returncode, time.time() - sent, "".join(lines) + out, err
    finally:
        process.kill()


def checkpoint_steps(workdir, run_name):
    return sorted(int(p.name) for p in (workdir / "runs" / run_name / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_sigterm_checkpoints_and_exits_then_the_same_command_resumes(workdir):
    returncode, seconds, out, err = interrupt(workdir, "run", CARTPOLE, after_update=5)
    assert returncode == 143, err  # 128 + SIGTERM: preempted, checkpoint written
    assert seconds < 30, f"{seconds:.1f}s from SIGTERM to exit"
    saved = SAVED.findall(out)
    last_update, last_step, last_digest = saved[-1]
    assert [u for u, _, _ in saved[:-1]] == ["3"] and int(last_update) >= 5  # periodic, then at the signal
    assert f"stopped by signal 15 after update {last_update}" in out
    assert checkpoint_steps(workdir, "run") == [3, int(last_update)]  # keeps the 2 newest

    kept = workdir / "kept_checkpoints"
    shutil.copytree(workdir / "runs" / "run" / "checkpoints", kept)
    resumed = run_script(CARTPOLE, workdir, "run")  # the same command, no --resume needed
    assert resumed.returncode == 0, resumed.stderr
    assert RESUMED.search(resumed.stdout).groups() == (last_update, last_step, last_digest)  # bitwise the same state
    scalars = read_scalars(workdir / "runs" / "run")
    steps = [step for step, _ in scalars["charts/SPS"]]
    assert steps == [256 * i for i in range(1, 13)]  # every update once: no duplicated or missing x
    learner_versions = [v for _, v in scalars["stats/learner_policy_version"]]
    assert learner_versions == list(range(12))
    # the learning-rate schedule continues: during update k, 2.5e-4 x (1 - (k - 1) / 12)
    learning_rates = [v for _, v in scalars["charts/learning_rate"]]
    for update, learning_rate in enumerate(learning_rates, start=1):
        assert abs(learning_rate - 2.5e-4 * (1 - (update - 1) / 12)) < 1e-9, (update, learning_rate)
    assert checkpoint_steps(workdir, "run") == [12] or checkpoint_steps(workdir, "run")[-1] == 12

    # a resumed run is reproducible: resuming again from the same checkpoint ends with the same params, also with a
    # RunSetting changed: the learner waiting for each minibatch step (--sync-minibatches) computes the same
    shutil.rmtree(workdir / "runs" / "run" / "checkpoints")
    shutil.copytree(kept, workdir / "runs" / "run" / "checkpoints")
    again = run_script([*CARTPOLE, "--resume", "--sync-minibatches"], workdir, "run")
    assert again.returncode == 0, again.stderr
    assert FINAL.search(again.stdout).group(1) == FINAL.search(resumed.stdout).group(1)


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_exits_with_130(workdir):
    returncode, seconds, out, err = interrupt(
        workdir, "run", [*CARTPOLE, "--total-timesteps", "100000000"], after_update=2, sig=signal.SIGINT
    )
    assert returncode == 130, err
    assert seconds < 30
    assert SAVED.search(out) and checkpoint_steps(workdir, "run")


@pytest.mark.slow
def test_resume_without_a_checkpoint_is_an_error(workdir):
    run = run_script([*CARTPOLE, "--resume"], workdir, "missing", timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == "error: --resume: runs/missing/checkpoints has no complete checkpoint"


def test_resume_needs_a_run_name(workdir):
    run = run_script([*CARTPOLE, "--resume"], workdir, run_name=None, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == "error: --resume needs --run-name: the name of the run to continue"


@pytest.mark.slow
def test_truncated_and_foreign_checkpoints_are_rejected_with_one_line(workdir):
    finished = run_script([*CARTPOLE, "--total-timesteps", "768"], workdir, "run")  # 3 updates: checkpoint 3
    assert finished.returncode == 0, finished.stderr
    # a checkpoint from another network size
    foreign = run_script(
        [*CARTPOLE, "--total-timesteps", "768", "--hiddens", "32", "--resume"], workdir, "run", timeout=120
    )
    assert foreign.returncode == 2
    assert (
        foreign.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: --resume: checkpoint {workdir}/runs/run/checkpoints/3 was made with --hiddens [16], this run "
            "has [32]"
        )
    )
    # a truncated file inside the newest checkpoint
    data_files = [
        p
        for p in (workdir / "runs" / "run" / "checkpoints" / "3").rglob("*")
        if p.is_file() and p.stat().st_size > 1000
    ]
    for path in data_files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    truncated = run_script([*CARTPOLE, "--total-timesteps", "768", "--resume"], workdir, "run", timeout=120)
    assert truncated.returncode == 2, truncated.stdout + truncated.stderr
    error = truncated.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: --resume: checkpoint {workdir}/runs/run/checkpoints/3 cannot be read"), error
    assert "Traceback" not in truncated.stderr


@pytest.mark.slow
def test_an_unfinished_checkpoint_write_is_ignored(workdir):
    finished = run_script([*CARTPOLE, "--total-timesteps", "768"], workdir, "run")  # 3 updates, checkpoint 3
    assert finished.returncode == 0, finished.stderr
    # a crash while writing update 6 leaves orbax's temporary folder behind
    (workdir / "runs" / "run" / "checkpoints" / "6.orbax-checkpoint-tmp-1234").mkdir()
    resumed = run_script([*CARTPOLE, "--total-timesteps", "768"], workdir, "run")
    assert resumed.returncode == 0, resumed.stderr
    assert RESUMED.search(resumed.stdout).group(1) == "3"


# ---------------------------------------------------------------- digests and layouts (in-process, 4 host devices)


def sharded(values, num_devices: int, spec=("batch",)):
    """`values` laid out over the first `num_devices` host devices, split along the axis `spec` names."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
    return jax.device_put(values, NamedSharding(mesh, PartitionSpec(*spec)))


def test_digest_is_of_the_whole_array_on_any_layout():
    rows = np.arange(48, dtype=np.float32).reshape(4, 3, 4)
    # the env axis of a replay: first (SAC, MuZero), or second after an axis of one (R2D2's item buffer) or after
    # the seed axis (an Anakin run's envs with --num-seeds: its slices split over the devices); on one device jit may
    # hand back P() for P("batch"): the same layout, so the same digest
    seeds = np.stack([rows, -rows])
    for values, spec in [(rows, ("batch",)), (rows[None], (None, "batch")), (seeds, (None, "batch"))]:
        digests = {tree_digest({"x": sharded(values, n, spec)}) for n in (1, 2, 4)} | {
            tree_digest(sharded(values, 1, ()))
        }
        assert len(digests) == 1, spec
    flipped = rows.copy()
    flipped[3, 2, 1] = np.nextafter(flipped[3, 2, 1], np.float32(100))  # in the second device's half
    assert tree_digest(sharded(flipped, 2)) != tree_digest(sharded(rows, 2))
    assert tree_digest(sharded(flipped, 1)) == tree_digest(sharded(flipped, 4)) == tree_digest(flipped)
    flipped_seed = np.stack([rows, -flipped])  # the second seed's, in the second device's half of its envs
    assert tree_digest(sharded(flipped_seed, 2, (None, "batch"))) != tree_digest(sharded(seeds, 2, (None, "batch")))


def test_a_sharded_state_resumes_on_fewer_and_more_devices_and_a_flipped_bit_anywhere_is_refused(tmp_path):
    args = dataclasses.replace(TinyArgs(), checkpoint_dir=str(tmp_path / "checkpoints"))
    replay = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    checkpoints_of(args).save(2, {"replay": sharded(replay, 2)}, **save_values(args, 2), summary="")
    for num_devices in (1, 4):  # fewer and more learner devices than the checkpoint's 2: re-sharded by orbax
        restored, update = checkpoints_of(args).restore(
            {"replay": sharded(np.zeros_like(replay), num_devices)}, **restore_values(args), summary=tree_digest
        )
        assert update == 2 and np.array_equal(np.asarray(restored["replay"]), replay)
        assert len(restored["replay"].sharding.device_set) == num_devices

    # one bit of the second device's rows changes in storage (the files stay readable): refused with one line
    damaged = replay.copy()
    damaged.view(np.uint32)[3, 5] ^= 1
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "damaged", {"replay": sharded(damaged, 2)})
    checkpointer.wait_until_finished()
    state_folder = tmp_path / "checkpoints" / "2" / "state"
    shutil.rmtree(state_folder)
    shutil.copytree(tmp_path / "damaged", state_folder)
    with pytest.raises(CheckpointError, match=r"checkpoint .*/2 is corrupted \(its state does not match the digest"):
        checkpoints_of(args).restore({"replay": sharded(np.zeros_like(replay), 2)}, **restore_values(args), summary=str)


def test_a_state_shaped_by_the_device_count_names_the_count_it_needs(tmp_path):
    """R2D2's replay keeps one priority tree per learner device: its shapes depend on their number."""
    args = dataclasses.replace(TinyArgs(), checkpoint_dir=str(tmp_path / "checkpoints"))
    checkpoints_of(args).save(2, {"trees": sharded(np.ones(2 * 7, np.float32), 2)}, **save_values(args, 2), summary="")
    for num_devices in (1, 4):
        with pytest.raises(
            CheckpointError,
            match=rf"^--learner-device-ids: checkpoint .*/2 was made on 2 learner "
            rf"devices \(over all processes\), this run has {num_devices}, .*"
            r"resume on 2 learner devices",
        ):
            checkpoints_of(args).restore(
                {"trees": sharded(np.ones(num_devices * 5, np.float32), num_devices)},
                **restore_values(args),
                summary=str,
            )
    with pytest.raises(CheckpointError, match=r"holds a state of other shapes than this run's"):
        checkpoints_of(args).restore(
            {"trees": sharded(np.ones(2 * 5, np.float32), 2)}, **restore_values(args), summary=str
        )
