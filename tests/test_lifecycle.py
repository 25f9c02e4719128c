"""A run never hangs: failures anywhere end it quickly, non-zero, with the original traceback."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
from conftest import (
    FAULT_INJECTION,
    IMPALA_SCRIPT,
    PPO_SCRIPT,
    SUBPROCESS_WARNINGS,
    TINY_BREAKOUT_PPO,
    run_script,
    wait_for_line,
)

from cleanrl_utils.actors import ActorThreads
from cleanrl_utils.run import SebulbaRun


def first_fault_time(stdout: str) -> float:
    """When tests/fault_injection.py raised its first fault (it prints `fault injected at T`)."""
    return min(float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("fault injected at "))


CARTPOLE = ["--env-id", "CartPole-v1", "--local-num-envs", "4", "--num-steps", "16", "--hiddens", "8"]


@pytest.mark.slow
@pytest.mark.parametrize("script", [PPO_SCRIPT, IMPALA_SCRIPT], ids=["ppo", "impala"])
def test_actor_failure_ends_the_run_within_20_seconds(workdir, script):
    # 2 actor threads; their envs fail after 40 steps (in the third rollout): the learner is waiting on the queue
    run = subprocess.run(
        [
            sys.executable,
            str(FAULT_INJECTION),
            str(script),
            "env",
            "40",
            *CARTPOLE,
            "--num-actor-threads",
            "2",
            "--total-timesteps",
            "100000000",
            "--run-name",
            "t",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": SUBPROCESS_WARNINGS},
    )
    ended = time.time()
    assert run.returncode != 0, run.stderr[-3000:]
    seconds = ended - first_fault_time(run.stdout)
    # timed from the fault, not from the start: a loaded machine's slower imports and compiles are not a hang
    assert seconds < 20, f"ended {seconds:.1f}s after the fault"
    # the original traceback, down to the failing line, not just a summary
    assert "injected env failure after 40 steps" in run.stderr
    assert 'raise InjectedFault(f"injected env failure' in run.stderr
    assert "an actor thread failed" in run.stderr


@pytest.mark.slow
def test_learner_failure_ends_the_run_and_its_actors(workdir):
    run = subprocess.run(
        [
            sys.executable,
            str(FAULT_INJECTION),
            str(PPO_SCRIPT),
            "learner",
            "3",
            *TINY_BREAKOUT_PPO,
            "--num-actor-threads",
            "2",
            "--learner-device-ids",
            "1",
            "--total-timesteps",
            "100000000",
            "--run-name",
            "t",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": SUBPROCESS_WARNINGS},
    )
    ended = time.time()
    assert run.returncode != 0, run.stderr[-3000:]
    seconds = ended - first_fault_time(run.stdout)
    assert seconds < 20, f"ended {seconds:.1f}s after the fault"
    assert "injected learner failure at update 3" in run.stderr


@pytest.mark.slow
def test_ctrl_c_exits_promptly(workdir):
    process = subprocess.Popen(
        [
            sys.executable,
            str(PPO_SCRIPT),
            *CARTPOLE,
            "--num-actor-threads",
            "2",
            "--total-timesteps",
            "100000000",
            "--log-frequency",
            "1",
            "--run-name",
            "t",
        ],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": SUBPROCESS_WARNINGS},
    )
    try:
        lines = wait_for_line(process, "update=3/")  # training is under way
        interrupted = time.time()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        seconds = time.time() - interrupted
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    # what the user sees: the update it stopped after, its checkpoint, how to resume; no traceback; 128 + SIGINT
    assert process.returncode == 130, err[-3000:]
    assert seconds < 15, f"took {seconds:.1f}s after Ctrl-C"
    out = "".join(lines) + out
    stopped = re.search(
        r"^stopped by signal 2 after update (\d+): run the same command \(--run-name t\) to resume$", out, re.M
    )
    assert stopped, out[-2000:]
    update = stopped.group(1)
    assert re.search(rf"^checkpoint saved: update={update} ", out, re.M), out[-2000:]
    assert (workdir / "runs" / "t" / "checkpoints" / update).is_dir()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def stuck_threads_warning(capsys) -> str:
    """The warning a Sebulba run prints when an actor thread does not stop, as the code prints it: SebulbaRun's
    supervision around one thread, named actor-0, made to hang (it waits on an event of its own, not the run's)."""
    release = threading.Event()
    actors = ActorThreads(threading.Event(), join_timeout=0.01)
    actors.start(release.wait, name="actor-0")
    capsys.readouterr()
    try:
        with SebulbaRun.supervise(types.SimpleNamespace(actors=actors, logger=types.SimpleNamespace(close=lambda: 0))):
            pass
    finally:
        release.set()
    return capsys.readouterr().err


def test_run_exits_by_itself_with_every_thread_stopped(workdir, capsys):
    # with 3 actor threads and concurrency, the last params the learner sends are never consumed
    run = run_script([*CARTPOLE, "--num-actor-threads", "3", "--total-timesteps", "960"], workdir, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "update=5/5" in run.stdout
    # the warning's text up to the names of the threads that did not stop (the code's own, so the test cannot drift)
    warning = stuck_threads_warning(capsys)
    assert warning.startswith("warning: ") and "actor-0" in warning, warning
    assert warning[: warning.index("actor-0")] not in run.stderr, run.stderr[-3000:]
