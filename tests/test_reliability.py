"""Every promise under faults and bad input: no hang, no lost or silently wrong run (see docs/reliability.md).

Faults are injected as a user's run meets them (tests/fault_injection.py, signals, a held lock, corrupted files);
the cheap checks call the script's main() in this process, the others run it as a subprocess.
"""

import dataclasses
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest
from conftest import (
    ANAKIN_SCRIPT,
    IMPALA_SCRIPT,
    MUJOCO_SCRIPT,
    MUZERO_SCRIPT,
    ONPOLICY_SCRIPT,
    PPO_SCRIPT,
    PQN_SCRIPT,
    R2D2_SCRIPT,
    SAC_SCRIPT,
    finish_processes,
    load_script,
    read_scalars,
    run_script,
    script_command,
    script_env,
    start_processes,
    wait_for_line,
)

from cleanrl_utils.cli import run_cli
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import settable_flags

# 1 actor thread x 4 envs x 32 steps = 128 steps per update
CARTPOLE = (
    "--env-id CartPole-v1 --local-num-envs 4 --num-steps 32 --hiddens 16 --num-actor-threads 1 --log-frequency 1"
).split()
DISTRIBUTED = [*CARTPOLE, "--actor-device-ids", "0", "--learner-device-ids", "1"]
SCRIPTS = {
    "ppo": PPO_SCRIPT,
    "impala": IMPALA_SCRIPT,
    "mujoco": MUJOCO_SCRIPT,
    "sac": SAC_SCRIPT,
    "r2d2": R2D2_SCRIPT,
    "muzero": MUZERO_SCRIPT,
    "anakin": ANAKIN_SCRIPT,
    "onpolicy": ONPOLICY_SCRIPT,
    "pqn": PQN_SCRIPT,
}


def start(flags, cwd, run_name="run", fault=None):
    return subprocess.Popen(
        script_command(flags, run_name, fault=fault),
        cwd=cwd,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(flags, cwd, run_name="run", fault=None, timeout=180):
    process = start(flags, cwd, run_name, fault)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------- flags: every numeric flag has a checked range


def bad_values(value):
    """Values outside any sane range of a flag of this type: one of them must be refused."""
    if isinstance(value, list):
        return [[-1], [10**9]]
    if isinstance(value, float):
        return [float("nan"), float("inf"), -1.0]
    return [-1, 2**62]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_numeric_flag_has_a_checked_range_in_its_help_line(name):
    script = load_script(SCRIPTS[name])
    # the script's own flags and those of the shared dataclasses it extends (cleanrl_utils/flags.py)
    source = "".join(inspect.getsource(cls) for cls in script.Args.__mro__ if dataclasses.is_dataclass(cls))
    hints = typing.get_type_hints(script.Args)
    for flag_name, value in settable_flags(script.Args()).items():
        hint = str(hints[flag_name])
        choices = typing.get_origin(hints[flag_name]) is typing.Literal  # e.g. --compute-dtype's "float32"
        if not any(kind in hint for kind in ("int", "float")) or isinstance(value, bool) or choices:
            continue
        help_line = " ".join(re.search(rf'\n    {flag_name}: [^\n]*\n    """(.*?)"""', source, re.S).group(1).split())
        assert re.search(r"positive|non-negative|in \[|in \(", help_line), f"{flag_name}: help names no range"
        refused = []
        for bad in bad_values(value if value is not None else 1):
            args = script.Args(**{flag_name: bad})
            try:
                script.validate_args(getattr(script, "with_loss_defaults", lambda args: args)(args))
            except UsageError as error:
                refused.append(str(error).startswith(f"--{flag_name.replace('_', '-')}"))
        assert any(refused), f"--{flag_name}: no out-of-range value refused"


# ---------------------------------------------------------------- run folder: names, lock, atomic rewrite


def test_a_live_runs_folder_is_locked(tmp_path, monkeypatch, capsys):
    """A second run with the same --run-name stops at once with one line; the first (here a process holding the
    lock as a live run does) is untouched."""
    (tmp_path / "runs" / "twin").mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open('runs/twin/.lock', 'a+'); "
            "fcntl.flock(f, fcntl.LOCK_EX); f.write('process 1 on host\\n'); f.flush(); "
            "print('locked', flush=True); time.sleep(60)",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        ppo = load_script()
        monkeypatch.chdir(tmp_path)
        with pytest.raises(SystemExit) as exit_info:
            run_cli(ppo.main, ppo.Args, [*CARTPOLE, "--run-name", "twin"])
        assert exit_info.value.code == 2
        errors = error_lines(capsys.readouterr().err)
        assert errors == [
            "error: --run-name: runs/twin is in use by a live run (process 1 on host); wait for it to "
            "end or choose another --run-name"
        ], errors
    finally:
        holder.kill()
        holder.communicate()
    assert sorted(p.name for p in (tmp_path / "runs" / "twin").iterdir()) == [".lock"]


@pytest.mark.slow
def test_a_kill_inside_the_tensorboard_rewrite_loses_and_duplicates_no_step(tmp_path):
    """Run, SIGKILL, resume killed inside the rewrite of the event files (the rewritten file is in place, the old
    one not yet removed), resume to the end: every update's scalars once (the rewrite rolls forward from its
    journal)."""
    flags = [*CARTPOLE, "--total-timesteps", str(12 * 128), "--checkpoint-frequency", "3"]
    process = start(flags, tmp_path)
    try:
        wait_for_line(process, "update=5/")  # checkpoint 3; the event file holds updates 1..5
    finally:
        process.kill()
        process.communicate()
    returncode, out, _ = run(flags, tmp_path, fault=["kill-in-rewrite", "0"])
    assert returncode == -signal.SIGKILL and "killed while removing events.out.tfevents" in out, out
    assert len(list((tmp_path / "runs" / "run").glob("events.out.tfevents.*"))) == 2  # the window: 1..3 and 1..5
    returncode, out, err = run(flags, tmp_path)
    assert returncode == 0, err
    assert "resumed from checkpoint: update=3 " in out
    scalars = read_scalars(tmp_path / "runs" / "run")
    assert [step for step, _ in scalars["charts/SPS"]] == [128 * i for i in range(1, 13)]
    assert [v for _, v in scalars["stats/learner_policy_version"]] == list(range(12))


# ---------------------------------------------------------------- checkpoints: integrity, OS errors


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory) -> Path:
    """A finished 3-update run whose checkpoint 3 the corruption tests copy and damage."""
    folder = tmp_path_factory.mktemp("checkpointed")
    returncode, _, err = run([*CARTPOLE, "--total-timesteps", "384"], folder)
    assert returncode == 0, err
    return folder / "runs" / "run" / "checkpoints"


def largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def flip_bytes(path: Path):
    data = bytearray(path.read_bytes())
    for offset in range(len(data) // 2, len(data) // 2 + 64):
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped bytes", "zero-byte file", "zero-byte metadata"])
def test_a_corrupted_checkpoint_is_one_line_naming_it(checkpointed, tmp_path, damage, monkeypatch, capfd):
    shutil.copytree(checkpointed, tmp_path / "runs" / "run" / "checkpoints")
    newest = tmp_path / "runs" / "run" / "checkpoints" / "3"
    if damage == "flipped bytes":
        flip_bytes(largest_file(newest / "state"))
    elif damage == "zero-byte file":
        largest_file(newest / "state").write_bytes(b"")
    else:
        (newest / "meta" / "metadata").write_bytes(b"")
    ppo = load_script()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(ppo.main, ppo.Args, [*CARTPOLE, "--total-timesteps", "384", "--run-name", "run", "--resume"])
    assert exit_info.value.code == 2
    errors = error_lines(capfd.readouterr().err)  # after a failed read, the line goes to the real stderr (fd 2's)
    assert len(errors) == 1 and errors[0].startswith(f"error: --resume: checkpoint {newest} "), errors
    assert errors[0].endswith("delete it to resume from an older one"), errors


# each script's tiny settings for a fresh state to damage: its replay, its envs (Anakin: sharded over two devices) and
# its multipliers (the on-policy script's V-MPO) are in it
DAMAGE_FLAGS = {
    "ppo": [*DISTRIBUTED],
    "impala": [*DISTRIBUTED],
    "mujoco": "--env-id Hopper-v4 --local-num-envs 2 --num-steps 16 --hiddens 8 --num-actor-threads 1".split(),
    "sac": "--env-id Pendulum-v1 --local-num-envs 4 --num-steps 8 --hiddens 16 --minibatch-size 16 --buffer-size 512 "
    "--num-actor-threads 1".split(),
    "r2d2": "--env-id CartPole-v1 --local-num-envs 4 --num-steps 8 --sequence-length 8 --burn-in 2 --lstm-size 8 "
    "--hiddens 16 --minibatch-size 4 --buffer-size 256 --replay-ratio 0.0625 --num-actor-threads 1".split(),
    "muzero": "--env-id CartPole-v1 --local-num-envs 4 --num-steps 8 --hiddens 16 --embedding-size 8 --support-size 5 "
    "--minibatch-size 8 --buffer-size 512 --num-actor-threads 1".split(),
    "anakin": "--local-num-envs 8 --num-steps 16 --hiddens 16 --learner-device-ids 0 1".split(),
    "onpolicy": "--env-id Hopper-v4 --local-num-envs 2 --num-steps 16 --hiddens 8 --num-actor-threads 1 "
    "--policy-loss vmpo".split(),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DAMAGE_FLAGS))
def test_every_damaged_checkpoint_of_every_script_is_one_line(name, tmp_path):
    """`tests/damaged_checkpoints.py` in one process: each script's fresh state saved, then damaged in each of 22 ways
    (bytes flipped at 6 offsets over its data file, the file emptied or cut, twice each; the manifest flipped,
    emptied, cut; each metadata file cut) and restored as --resume restores it. Every damaged read is refused with the
    one line, or reads a state whose digest matches (a file it does not read); stderr holds those lines and nothing
    else: none of the tracebacks and "Exception ignored" reports that orbax's and tensorstore's abandoned reads
    print from their own threads and at exit."""
    devices = ["--actor-device-ids", "0", "--learner-device-ids", "1"] if name != "anakin" else []
    flags = [*devices, *DAMAGE_FLAGS[name], "--run-name", "damaged"]  # the last value of a flag counts
    harness = Path(__file__).parent / "damaged_checkpoints.py"
    result = subprocess.run(
        [sys.executable, str(harness), str(tmp_path), str(SCRIPTS[name]), *flags],
        cwd=tmp_path,
        env=script_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cases = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(cases) == 22, result.stdout[-2000:]
    refused = [case for case in cases if case["result"] == "refused"]
    # the data file emptied or cut, the manifest emptied, the state's metadata cut: always refused
    assert all(case["result"] == "refused" for case in cases if case["damage"] in ("zero", "cut")), cases
    lines = result.stderr.splitlines()
    assert len(lines) == len(refused), result.stderr[-3000:]
    for line in lines:
        assert line.startswith("error: --resume: checkpoint ") and line.endswith(
            "delete it to resume from an older one"
        ), line


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_last_checkpoint_resumes(tmp_path):
    flags = [*CARTPOLE, "--total-timesteps", str(9 * 128), "--checkpoint-frequency", "3"]
    process = start(flags, tmp_path, fault=["disk-full", "1"])  # checkpoint 3 is written, then the disk is full
    wait_for_line(process, "disk full now")
    full = time.time()
    out, err = process.communicate(timeout=120)
    print(f"full disk: exit {time.time() - full:.1f}s after the disk filled")
    assert process.returncode == 1, err
    errors = error_lines(err)
    assert len(errors) == 1 and "File too large" in errors[0] and "runs/run" in errors[0], err
    assert "Traceback" not in err
    returncode, out, err = run(flags, tmp_path)
    assert returncode == 0, err
    assert "resumed from checkpoint: update=3 " in out


@pytest.mark.slow
def test_a_full_disk_at_the_first_checkpoint_is_one_line_saying_none_is_complete(tmp_path):
    """The disk fills as the first checkpoint begins: the write fails in every one of orbax's writer threads, and the
    run still prints one line. (A tmpfs of 16 KiB in a user namespace gave ENOSPC itself, but not every CI sandbox
    allows user namespaces: RLIMIT_FSIZE fails the same writes in the kernel anywhere.)"""
    flags = [*CARTPOLE, "--total-timesteps", "384", "--checkpoint-frequency", "1"]
    returncode, out, err = run(flags, tmp_path, fault=["disk-full", "0"])
    assert "disk full now" in out, err[-3000:]
    assert returncode == 1, err[-3000:]
    assert err.strip() == (
        "error: cannot write checkpoint 1 into runs/run/checkpoints: File too large; no "
        "checkpoint of this run is complete yet"
    ), err[-3000:]


def test_a_read_only_working_directory_is_one_line(tmp_path):
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)], capture_output=True
        ).returncode
        == 0
    )  # root: a read-only file system
    if not mounted:
        read_only.chmod(0o555)  # others: a folder they may not write
    try:
        returncode, out, err = run([*CARTPOLE, "--total-timesteps", "384"], read_only, timeout=120)
    finally:
        if mounted:
            subprocess.run(["umount", str(read_only)], check=True)
        read_only.chmod(0o755)
    assert returncode == 1, err
    cause = "Read-only file system" if mounted else "Permission denied"
    assert error_lines(err) == [f"error: cannot write runs: {cause}"], err  # the folder it could not make
    assert "Traceback" not in err


# ---------------------------------------------------------------- divergence


@pytest.mark.slow
def test_divergence_stops_with_one_line_after_checkpointing_the_last_finite_state(tmp_path):
    returncode, out, err = run(
        [*CARTPOLE, "--total-timesteps", "640", "--learning-rate", "1e30", "--max-grad-norm", "1e30", "--save-model"],
        tmp_path,
    )
    assert returncode == 1, err
    errors = error_lines(err)
    assert len(errors) == 1 and errors[0].startswith("error: update 1 diverged"), err
    assert "loss=nan" in errors[0] and "the last finite state is checkpoint 0" in errors[0]
    assert "checkpoint saved: update=0 " in out and "Traceback" not in err
    assert not list((tmp_path / "runs" / "run").glob("*.cleanrl_model"))  # never a non-finite model


# ---------------------------------------------------------------- memory


@pytest.mark.slow
def test_an_update_larger_than_the_host_stops_with_one_line_before_it_runs(tmp_path):
    """SAC's learner update on 2**20-sample minibatches of a 65,536-unit layer: about 3 TiB of buffers, more than any
    test host has. Its first call stops the run (cleanrl_utils/memory.py): the actor thread stopped, no traceback, no
    checkpoint, no digests (what would be the kernel's OOM killer, no message at all, without the check)."""
    flags = (
        "--env-id Pendulum-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 --hiddens 65536 "
        "--minibatch-size 1048576 --buffer-size 1048576 --learning-starts 0 --replay-ratio 0.03125 "
        "--checkpoint-frequency 1"
    ).split()
    run = run_script(flags, tmp_path, script=SAC_SCRIPT, timeout=180)
    assert run.returncode == 2, run.stderr
    assert error_lines(run.stderr) == [
        "error: the learner's update needs 3,072.1 GiB of memory, more than the "
        + re.search(r"more than the ([\d,.]+) GiB", run.stderr).group(1)
        + " GiB this host can give it (90% of its available memory): lower --minibatch-size"
    ], run.stderr
    assert "Traceback" not in run.stderr and "final params" not in run.stdout
    assert list((run.run_dir / "checkpoints").iterdir()) == []  # not even update 1's: no update ran


@pytest.fixture
def memory_cgroup_of(tmp_path):
    """`memory_cgroup_of(limit)`: a child of this process's own memory cgroup (v1 or v2, as root) limited to `limit`
    bytes, and the command prefix that starts a process in it; removed at the end."""
    from cleanrl_utils.memory import own_cgroup_folders

    with open("/proc/self/cgroup") as cgroup, open("/proc/self/mountinfo") as mountinfo:
        folders = own_cgroup_folders(cgroup.read(), mountinfo.read())
    made = []

    def make(limit: int) -> list[str]:
        for folder, version in folders:
            limit_file = {"v1": "memory.limit_in_bytes", "v2": "memory.max"}[version]
            if not os.path.exists(os.path.join(folder, limit_file)):
                continue
            child = os.path.join(folder, f"cleanba-test-{os.getpid()}-{tmp_path.name}")
            try:
                os.mkdir(child)
                made.append(child)
                Path(child, limit_file).write_text(str(limit))
            except OSError as error:
                pytest.skip(f"cannot make a memory cgroup here (needs root): {error}")
            return ["sh", "-c", f'echo $$ > {child}/cgroup.procs && exec "$@"', "sh"]
        pytest.skip("no memory cgroup to make a child in")

    yield make
    for child in made:
        for _ in range(50):  # the process may still be leaving it
            try:
                os.rmdir(child)
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.slow
def test_an_update_larger_than_the_processs_cgroup_stops_with_one_line_before_it_runs(tmp_path, memory_cgroup_of):
    """A container's, a systemd scope's or a Slurm job's memory limit (here a child cgroup of 1.5 GiB; the host has
    more): SAC's update on 65,536-sample minibatches of 2,048-unit layers needs 6 GiB. The check reads the process's
    own cgroup (and its ancestors): one line, exit 2, before the update runs (without it: the OOM killer, rc -9)."""
    flags = (
        "--env-id Pendulum-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 --hiddens 2048 "
        "--minibatch-size 65536 --buffer-size 65536 --learning-starts 0 --replay-ratio 0.03125 "
        "--checkpoint-frequency 1 --total-timesteps 320 --run-name test"
    ).split()
    prefix = memory_cgroup_of(3 * 2**29)
    completed = subprocess.run(
        [*prefix, *script_command(flags, None, SAC_SCRIPT)],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 2, (completed.returncode, completed.stderr[-3000:])
    assert error_lines(completed.stderr) == [
        "error: the learner's update needs 6.0 GiB of memory, more than the "
        + re.search(r"more than the ([\d.]+) GiB", completed.stderr).group(1)
        + " GiB this host can give it (90% of its available memory): lower --minibatch-size"
    ], completed.stderr
    assert float(re.search(r"more than the ([\d.]+) GiB", completed.stderr).group(1)) < 1.5  # the cgroup's room


@pytest.mark.slow
def test_a_learner_on_three_host_devices_with_many_programs_queued_trains_to_the_end(tmp_path):
    """The design's layout a0-l1,2,3 on a CPU, with 68 learner programs queued per update (32 minibatches x 2 epochs
    of the IMPALA CNN, 2 samples each): more than XLA's 32 in flight per device. With XLA's default CPU thread pool
    (max(cores, devices): 4 here) the third device's part of an all-reduce found no thread, and XLA aborted the run
    after 40 s with a C++ stack trace (as with PJRT_NPROC=4); cleanrl_utils.devices.collective_threads sizes it."""
    flags = (
        "--env-id Breakout-v5 --actor-device-ids 0 --learner-device-ids 1 2 3 --local-num-envs 6 --num-steps 16 "
        "--num-minibatches 32 --update-epochs 2 --total-timesteps 384 --checkpoint-frequency 0 --log-frequency 1"
    ).split()
    run = run_script(flags, tmp_path, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "update=2/2 global_step=384" in run.stdout and "final params" in run.stdout
    assert "rendezvous" not in run.stderr and "Check failure" not in run.stderr, run.stderr[-3000:]


# ---------------------------------------------------------------- two processes


@pytest.mark.slow
def test_processes_that_disagree_on_a_flag_stop_within_60_seconds(tmp_path):
    started = time.time()
    results = finish_processes(
        start_processes(
            [*DISTRIBUTED, "--total-timesteps", "1280"],
            tmp_path,
            2,
            process_args=[["--hiddens", "16"], ["--hiddens", "32"]],
        ),
        timeout=120,
    )
    seconds = time.time() - started
    print(f"flag mismatch: both processes exited {seconds:.1f}s after they started")
    for returncode, out, err in results:
        assert returncode == 2, err
        assert error_lines(err) == [
            "error: the processes disagree on --hiddens: process 0 has [16], process 1 has "
            "[32]; every process of a run needs the same value"
        ], err
        assert "update=" not in out
    assert seconds < 60


@pytest.mark.slow
def test_a_peer_that_never_arrives_ends_the_wait_after_the_heartbeat_timeout(tmp_path):
    """Only process 1 of one run, only process 0 of another: each waits --heartbeat-timeout seconds, then one line."""
    flags = [*DISTRIBUTED, "--total-timesteps", "1280", "--heartbeat-timeout", "5"]
    started = time.time()
    alone = [
        *start_processes(flags, tmp_path, 2, run_name="a", process_ids=[1]),
        *start_processes(flags, tmp_path, 2, run_name="b", process_ids=[0]),
    ]
    results = finish_processes(alone, timeout=120)
    seconds = time.time() - started
    print(f"missing peer: both exited {seconds:.1f}s after they started (--heartbeat-timeout 5)")
    for returncode, _, err in results:
        assert returncode == 1, err
        errors = error_lines(err)
        assert len(errors) == 1 and errors[0].startswith(
            "error: --distributed: not every process arrived within --heartbeat-timeout 5s"
        ), err
        assert "Check failure" not in err
    assert seconds < 60


@pytest.mark.slow
def test_a_stopped_peer_ends_the_survivor_with_one_line_before_jaxs_abort(tmp_path):
    """SIGSTOP to process 1 (a terminal's Ctrl-Z, or a frozen host): its liveness socket still accepts connections
    (the kernel's backlog), but no thread of it answers, so process 0's watchdog finds it silent after half of
    --heartbeat-timeout and ends with one line, before JAX's heartbeat check (2 x 6 s) aborts it from C++."""
    flags = [*DISTRIBUTED, "--total-timesteps", str(400 * 256), "--heartbeat-timeout", "6"]
    processes = start_processes(flags, tmp_path, 2, run_name="stopped")
    try:
        wait_for_line(processes[0], "update=3/")
        processes[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        returncode = processes[0].wait(timeout=60)
        seconds = time.time() - stopped
        _, err = processes[0].communicate()
    finally:
        for process in processes:
            process.kill()
            process.communicate()
    assert returncode == 1, err[-3000:]
    assert error_lines(err) == [
        re.search(r"error: --distributed: process 1 \(host [^)]*\) of this run's 2 went silent: .*", err).group(0)
    ], err[-3000:]
    assert "or the process is stopped" in err
    assert not re.search(r"Terminating process|Check failure|^F\d{4} |stack trace", err, re.MULTILINE), err[-3000:]
    assert seconds < 12, f"ended {seconds:.1f}s after the stop (JAX aborts at 12 s)"


@pytest.mark.slow
def test_sigterm_to_process_1_stops_both_and_saves_no_model(tmp_path):
    flags = [*DISTRIBUTED, "--total-timesteps", str(40 * 256), "--checkpoint-frequency", "0", "--save-model"]
    processes = start_processes(flags, tmp_path, 2, run_name="pre")
    try:
        wait_for_line(processes[0], "update=3/")
        processes[1].send_signal(signal.SIGTERM)
        results = finish_processes(processes, timeout=60)
    finally:
        for process in processes:
            process.kill()
    assert [returncode for returncode, _, _ in results] == [143, 143], results[0][2] + results[1][2]
    stopped = [re.search(r"stopped by signal 15 after update (\d+)", out).group(1) for _, out, _ in results]
    assert stopped[0] == stopped[1]
    assert not list((tmp_path / "runs" / "pre").glob("*.cleanrl_model"))  # an interrupted model is never final
    assert "model saved" not in results[0][1]


# ---------------------------------------------------------------- the shared modules alone


def write_events(path: Path, steps: list[int]):
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.record_writer import RecordWriter

    with open(path, "wb") as file:
        records = RecordWriter(file)
        for step in steps:
            value = summary_pb2.Summary.Value(tag="x", simple_value=float(path.name[-1] == "b"))
            records.write(event_pb2.Event(step=step, summary=summary_pb2.Summary(value=[value])).SerializeToString())


@pytest.mark.parametrize("crash", ["none", "before the journal", "after the journal", "after the rename"])
def test_the_event_rewrite_rolls_forward_from_any_crash(tmp_path, crash, monkeypatch):
    from cleanrl_utils import summary_writer

    class Crash(Exception):
        pass

    def crash_at(name, when):
        real = getattr(summary_writer, name) if name != "remove" else os.remove
        calls = []

        def crashing(*args, **kwargs):
            calls.append(args)
            if when(calls):
                raise Crash
            return real(*args, **kwargs)

        monkeypatch.setattr(*((summary_writer.os, "remove") if name == "remove" else (summary_writer, name)), crashing)

    write_events(tmp_path / "events.out.tfevents.1.a", [1, 2, 3, 4])
    write_events(tmp_path / "events.out.tfevents.2.b", [3, 4, 5, 6])  # steps 3, 4 again: the newer file wins
    if crash == "before the journal":
        crash_at("atomic_write", lambda calls: True)
    elif crash == "after the journal":
        crash_at("finish_rewrite", lambda calls: len(calls) == 2)  # the first call (at the start) has nothing to do
    elif crash == "after the rename":
        crash_at("remove", lambda calls: str(calls[-1][0]).endswith(".b"))  # .a removed, .b not yet
    if crash == "none":
        summary_writer.rewrite_events(str(tmp_path), keep_up_to_step=5)
    else:
        with pytest.raises(Crash):
            summary_writer.rewrite_events(str(tmp_path), keep_up_to_step=5)
    monkeypatch.undo()
    summary_writer.finish_rewrite(str(tmp_path))  # what the next start does first
    remaining = sorted(p.name for p in tmp_path.iterdir())
    if crash == "before the journal":  # nothing happened: the old files as they were, the temporary file gone
        assert remaining == ["events.out.tfevents.1.a", "events.out.tfevents.2.b"], remaining
        return
    assert remaining == ["events.out.tfevents.1.a.rewrite1"], remaining
    assert read_scalars(tmp_path)["x"] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0)]


def test_run_folder_lock_name_and_atomic_write(tmp_path, monkeypatch):
    from cleanrl_utils.run_folder import RunFolder, atomic_write, default_run_name

    monkeypatch.chdir(tmp_path)
    assert re.fullmatch(r"CartPole-v1__ppo__1__\d+", default_run_name("CartPole-v1", "ppo", 1))
    assert default_run_name("gfootball/academy_empty_goal_close-v1", "ppo", 1).startswith(
        "gfootball-academy_empty_goal_close-v1__ppo__1__"
    )
    with pytest.raises(UsageError, match="--run-name must be one folder name"):
        default_run_name("CartPole-v1", "a b", 1)
    first = RunFolder("first", None, is_main_process=True)
    mine = RunFolder("mine", "shared", is_main_process=True)
    with pytest.raises(UsageError, match=r"^--checkpoint-dir: shared is in use by a live run \(process \d+ on "):
        RunFolder("other", "shared", is_main_process=True)
    with pytest.raises(UsageError, match=r"^--run-name: runs/first is in use by a live run"):
        RunFolder("first", None, is_main_process=True)
    mine.release()
    RunFolder("other", "shared", is_main_process=True).release()  # free again
    first.release()
    atomic_write("model", b"whole")
    assert (tmp_path / "model").read_bytes() == b"whole" and sorted(os.listdir(tmp_path)) == ["model", "runs", "shared"]


def test_all_finite_and_the_divergence_line():
    import jax.numpy as jnp

    from cleanrl_utils.divergence import Diverged, all_finite, copy_state

    state = {"w": jnp.ones(3), "count": jnp.int32(2)}
    assert all_finite({"losses/loss": 1.0}, state)
    assert not all_finite({"losses/loss": float("nan")}, state)
    assert not all_finite({"losses/loss": 1.0}, {"w": jnp.array([1.0, jnp.inf]), "count": jnp.int32(2)})
    copied = copy_state(state)
    assert copied["w"] is not state["w"] and jnp.array_equal(copied["w"], state["w"])
    assert str(Diverged(7, {"losses/loss": float("nan"), "losses/entropy": 0.5})) == (
        "update 7 diverged (a loss term or the learner's state is NaN or infinite): loss=nan, entropy=0.5; the last "
        "finite state is checkpoint 6; try lower learning rates (or a gradient clip, where the script has one)"
    )
