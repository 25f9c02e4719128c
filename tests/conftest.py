"""Shared helpers: run a cleanba script the way a user does (a subprocess), and read what it wrote."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

# in-process tests (the learner on a mesh) need several host devices: set before JAX starts a backend
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

REPO = Path(__file__).resolve().parent.parent
PPO_SCRIPT = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
# JAX deprecations are errors in every run the tests start (the product must use today's JAX API)
SUBPROCESS_WARNINGS = "error::DeprecationWarning"
# tiny Atari settings: a few updates of a 4-channel IMPALA CNN on Breakout-v5
TINY_BREAKOUT = ["--env-id", "Breakout-v5", "--local-num-envs", "4", "--num-steps", "8", "--channels", "4",
                 "--hiddens", "16", "--num-minibatches", "2", "--update-epochs", "1", "--log-frequency", "1"]


def load_script(path: Path = PPO_SCRIPT):
    """Import a cleanba script as a module (for its pure functions)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Run:
    def __init__(self, completed: subprocess.CompletedProcess, seconds: float, cwd: Path, run_name: str):
        self.returncode, self.stdout, self.stderr = completed.returncode, completed.stdout, completed.stderr
        self.seconds, self.run_dir = seconds, cwd / "runs" / run_name

    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        """Every scalar in the run's TensorBoard event files: tag -> [(step, value), ...]."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        accumulator = EventAccumulator(str(self.run_dir), size_guidance={"scalars": 0})
        accumulator.Reload()
        return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def run_script(args: list[str], cwd: Path, run_name: str = "test", script: Path = PPO_SCRIPT, timeout: float = 300,
               env: dict | None = None, python_args: list[str] | None = None) -> Run:
    full_env = {**os.environ, "PYTHONWARNINGS": SUBPROCESS_WARNINGS, "WANDB_MODE": "offline", **(env or {})}
    full_env.pop("XLA_FLAGS", None) if env is None or "XLA_FLAGS" not in env else None
    command = [sys.executable, *(python_args or []), str(script), "--run-name", run_name, *args]
    start = time.time()
    completed = subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    return Run(completed, time.time() - start, cwd, run_name)


@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path
