"""Shared helpers: run a cleanba script the way a user does (a subprocess), and read what it wrote."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# in-process tests (the learner on a mesh) need several host devices: set before JAX starts a backend
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

REPO = Path(__file__).resolve().parent.parent
PPO_SCRIPT = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
IMPALA_SCRIPT = REPO / "cleanba" / "cleanba_impala_envpool_impala_atari_wrapper.py"
MUJOCO_SCRIPT = REPO / "cleanba" / "cleanba_ppo_continuous_action_envpool_mujoco.py"
SAC_SCRIPT = REPO / "cleanba" / "cleanba_sac_continuous_action_envpool_mujoco.py"
MUZERO_SCRIPT = REPO / "cleanba" / "cleanba_muzero_envpool_impala_atari_wrapper.py"
R2D2_SCRIPT = REPO / "cleanba" / "cleanba_r2d2_envpool_impala_atari_wrapper.py"
# JAX deprecations are errors in every run the tests start (the product must use today's JAX API). The one
# exception is third-party: tensorflow-probability (imported by rlax through distrax) reads a deprecated
# jax.core attribute at import time; the filter names that module only.
SUBPROCESS_WARNINGS = ("error::DeprecationWarning,"
                       "ignore::DeprecationWarning:tensorflow_probability.python.internal.backend.jax.ops")
# tiny Atari settings: a few updates of a 4-channel IMPALA CNN on Breakout-v5
TINY_BREAKOUT = ["--env-id", "Breakout-v5", "--local-num-envs", "4", "--num-steps", "8", "--channels", "4",
                 "--hiddens", "16", "--num-minibatches", "2", "--log-frequency", "1"]
TINY_BREAKOUT_PPO = [*TINY_BREAKOUT, "--update-epochs", "1"]
# tiny MuJoCo settings: a few updates of 8-unit MLPs on HalfCheetah-v4
TINY_HALFCHEETAH = ["--env-id", "HalfCheetah-v4", "--local-num-envs", "2", "--num-steps", "16", "--hiddens", "8",
                    "--num-minibatches", "2", "--update-epochs", "2", "--log-frequency", "1"]


def load_script(path: Path = PPO_SCRIPT):
    """Import a cleanba script as a module (for its pure functions)."""
    from cleanrl_utils.evals.evaluate import load_script as load

    return load(path)


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run's TensorBoard event files: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


class Run:
    def __init__(self, completed: subprocess.CompletedProcess, seconds: float, cwd: Path, run_name: str):
        self.returncode, self.stdout, self.stderr = completed.returncode, completed.stdout, completed.stderr
        self.seconds, self.run_dir = seconds, cwd / "runs" / run_name

    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        return read_scalars(self.run_dir)


FAULT_INJECTION = REPO / "tests" / "fault_injection.py"


def script_command(args: list[str], run_name: str | None, script: Path = PPO_SCRIPT,
                   fault: list[str] | None = None) -> list[str]:
    """The command a user runs; with `fault` (e.g. ["learner", "3"]) through tests/fault_injection.py."""
    injection = [str(FAULT_INJECTION), str(script), *fault] if fault else [str(script)]
    return [sys.executable, *injection, *(["--run-name", run_name] if run_name else []), *args]


def script_env(env: dict | None = None) -> dict:
    """The environment a user's run gets: JAX deprecations as errors, W&B offline, the script's own
    XLA_FLAGS (the tests' 4 host devices are not passed on, unless `env` sets XLA_FLAGS)."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**full_env, "PYTHONWARNINGS": SUBPROCESS_WARNINGS, "WANDB_MODE": "offline", **(env or {})}


def run_script(args: list[str], cwd: Path, run_name: str | None = "test", script: Path = PPO_SCRIPT, timeout: float = 300,
               env: dict | None = None) -> Run:
    start = time.time()
    completed = subprocess.run(script_command(args, run_name, script), cwd=cwd, env=script_env(env),
                               capture_output=True, text=True, timeout=timeout)
    return Run(completed, time.time() - start, cwd, run_name or "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_processes(args: list[str], cwd: Path | list[Path], num_processes: int, run_name: str = "test",
                    script: Path = PPO_SCRIPT, fault: list[str] | None = None,
                    process_args: list[list[str]] | None = None, process_ids: list[int] | None = None
                    ) -> list[subprocess.Popen]:
    """A jax.distributed run of `num_processes` processes on 127.0.0.1, as on a cluster without SLURM; `cwd` is one
    folder for all, or one per process (hosts whose working directories differ); `process_args`: flags added to
    each process's command; `process_ids`: start only these processes (the others never arrive)."""
    coordinator = f"127.0.0.1:{free_port()}"
    cwds = cwd if isinstance(cwd, list) else [cwd] * num_processes
    process_args = process_args or [[] for _ in range(num_processes)]
    return [
        subprocess.Popen(script_command([*args, *process_args[i], "--distributed", "--coordinator-address", coordinator,
                                         "--num-processes", str(num_processes), "--process-id", str(i)],
                                        run_name, script, fault),
                         cwd=cwds[i], env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (range(num_processes) if process_ids is None else process_ids)
    ]


def start_script(flags: list[str], cwd: Path, run_name: str, script: Path,
                 command: list[str] | None = None) -> subprocess.Popen:
    """The script as a user runs it, in the background; `command` (default: the user's command) replaces it."""
    return subprocess.Popen(command or script_command(flags, run_name, script), cwd=cwd, env=script_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_script(process: subprocess.Popen, cwd: Path, run_name: str, timeout: float = 400) -> Run:
    out, err = process.communicate(timeout=timeout)
    return Run(subprocess.CompletedProcess(process.args, process.returncode, out, err), 0.0, cwd, run_name)


def finish_processes(processes: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process of a jax.distributed run; none is left running."""
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            process.kill()
    return [(process.returncode, out, err) for process, (out, err) in zip(processes, outputs)]


def same_seed_and_resumed_runs(tmp_path_factory, name: str, start, flags: list[str], long: list[str]) -> dict:
    """The runs a replay script's determinism and resume tests read, started a few at a time: "first" and "second"
    (`flags` twice), "stopped" (`long`, SIGTERM after update 4: (exit code, stdout, stderr)), then "resumed" and
    "resumed_again" (its checkpoint resumed in its folder and in a copy in another folder). `start(flags, cwd,
    run_name)` starts one run."""
    workdir = tmp_path_factory.mktemp(name)
    first, second, stopped = start(flags, workdir, "first"), start(flags, workdir, "second"), start(long, workdir,
                                                                                                    "stopped")
    try:
        lines = wait_for_line(stopped, "update=4/")
        stopped.send_signal(signal.SIGTERM)
        out, err = stopped.communicate(timeout=120)
        result = {"first": finish_script(first, workdir, "first"), "second": finish_script(second, workdir, "second")}
    finally:
        for process in [first, second, stopped]:
            process.kill()
    result["stopped"] = (stopped.returncode, "".join(lines) + out, err)
    copy = tmp_path_factory.mktemp(f"{name}_copy")  # the same run (--run-name is a flag of the run) in another folder
    shutil.copytree(workdir / "runs" / "stopped", copy / "runs" / "stopped")
    resumed, resumed_again = start(long, workdir, "stopped"), start(long, copy, "stopped")
    result["resumed"] = finish_script(resumed, workdir, "stopped")
    result["resumed_again"] = finish_script(resumed_again, copy, "stopped")
    return result


def wait_for_line(process: subprocess.Popen, prefix: str) -> list[str]:
    """Read `process`'s stdout up to a line starting with `prefix`; fail the test if the process ends first (so a
    test that signals a run "after update 3" cannot pass when the run died before it)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    process.wait(timeout=30)
    pytest.fail(f"the process ended (exit code {process.returncode}) before printing {prefix!r}:\n"
                f"{''.join(lines)[-2000:]}\n{process.stderr.read()[-3000:]}")


@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path


# PPO on CartPole-v1 as in the README: CleanRL's classic-control network (two 64-unit tanh layers), clip 0.2
CARTPOLE_PPO = ["--env-id", "CartPole-v1", "--num-steps", "128", "--hiddens", "64", "64", "--clip-coef", "0.2",
                "--learning-rate", "1e-3"]
CARTPOLE_LEARNING = [*CARTPOLE_PPO, "--num-actor-threads", "1", "--actor-device-ids", "0", "--learner-device-ids", "1",
                     "--total-timesteps", "250000", "--log-frequency", "50"]


@pytest.fixture(scope="session")
def cartpole_learning_run(tmp_path_factory) -> Run:
    """One 250k-step PPO CartPole run with 8 envs in one process, shared by the tests that need it."""
    return run_script([*CARTPOLE_LEARNING, "--local-num-envs", "8"], tmp_path_factory.mktemp("cartpole"), "one",
                      timeout=400)
