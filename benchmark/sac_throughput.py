"""SAC throughput: env steps/s (SPS) and gradient steps/s of the SAC script, one config after another in one session.

For each env (Pendulum-v1, HalfCheetah-v4) and each --replay-ratio (1, 0.25), with and without --no-concurrency,
the script runs as a user runs it (a subprocess, the script's defaults but a short run: --learning-starts 512 and
--total-timesteps for --updates updates), and this reads its TensorBoard events: the steady-state SPS and gradient
steps/s over the updates after learning started plus --warmup-updates (compilation happens there), from the
events' wall times. Prints a markdown table (for the docs). Holds /tmp/cleanba-bench.lock, like the other
benchmarks, so that no other benchmark of this repository runs at the same time.

usage (from the repository root): uv run python benchmark/sac_throughput.py [--updates 24]
"""

import dataclasses
import fcntl
import os
import subprocess
import sys
import tempfile
import warnings
from functools import partial
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tool_helpers import check_each

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.envs import check_env_id
from cleanrl_utils.errors import RunError

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "cleanba" / "cleanba_sac_continuous_action_envpool_mujoco.py"
# envpool's MuJoCo Box spaces are float64; gymnasium warns when it casts them (the env check makes one), as the
# scripts say where they filter the same warning
warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32")
BATCH = 256  # env steps per update of the script's defaults: 2 actor threads x 4 envs x 32 steps


@dataclasses.dataclass
class BenchArgs:
    env_ids: list[str] = dataclasses.field(default_factory=lambda: ["Pendulum-v1", "HalfCheetah-v4"])
    replay_ratios: list[float] = dataclasses.field(default_factory=lambda: [1.0, 0.25])
    updates: int = 24
    """updates per run (256 env steps each with the defaults)"""
    warmup_updates: int = 4
    """updates after learning starts left out of the steady state (the learner compiles in the first)"""
    learning_starts: int = 512


def first_steady_update(args: BenchArgs) -> int:
    """The index of the first update of the steady state: after learning starts, plus --warmup-updates."""
    return -(-args.learning_starts // BATCH) + args.warmup_updates


def check_flags(args: BenchArgs):
    """One line naming the flag, before any run: each run is a subprocess that would fail only after its start-up."""
    if not args.replay_ratios or not all(0 < ratio < float("inf") for ratio in args.replay_ratios):
        fail(f"--replay-ratios must be one or more positive, finite numbers (got {args.replay_ratios})")
    if args.learning_starts < 0:
        fail(f"--learning-starts must be non-negative (got {args.learning_starts})")
    if args.warmup_updates < 1:  # the learner compiles in the first update after learning starts
        fail(f"--warmup-updates must be positive (got {args.warmup_updates})")
    if args.updates <= first_steady_update(args):
        fail(
            f"--updates ({args.updates}) must exceed the updates before learning starts plus --warmup-updates "
            f"({first_steady_update(args)}): the steady state is measured after them"
        )
    if not args.env_ids:
        fail("--env-ids needs one or more env ids")
    check_each("--env-ids", args.env_ids, partial(check_env_id, discrete=False))  # last: it makes an env of each


def measure(args: BenchArgs, env_id: str, replay_ratio: float, concurrency: bool) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            sys.executable,
            str(SCRIPT),
            "--env-id",
            env_id,
            "--replay-ratio",
            str(replay_ratio),
            "--learning-starts",
            str(args.learning_starts),
            "--total-timesteps",
            str(args.updates * BATCH),
            "--actor-device-ids",
            "0",
            "--learner-device-ids",
            "1",
            "--checkpoint-frequency",
            "0",
            "--log-frequency",
            "1000",
            "--run-name",
            "bench",
            *([] if concurrency else ["--no-concurrency"]),
        ]
        code = subprocess.run(command, cwd=workdir, stdout=subprocess.DEVNULL).returncode
        if code != 0:  # its own error line is above (its stderr is this one's)
            raise RunError(f"the SAC script failed ({code}) on {env_id}, --replay-ratio {replay_ratio}")
        events = EventAccumulator(str(Path(workdir) / "runs" / "bench"), size_guidance={"scalars": 0})
        events.Reload()
        sps = events.Scalars("charts/SPS")
        first = first_steady_update(args)
        start, end = sps[first - 1], sps[-1]
        seconds = end.wall_time - start.wall_time
        gradient_steps = sum(e.value for e in events.Scalars("stats/gradient_steps")[first:])
        return {
            "env_id": env_id,
            "replay_ratio": replay_ratio,
            "concurrency": concurrency,
            "sps": (end.step - start.step) / seconds,
            "gradient_steps_per_second": gradient_steps / seconds,
            "updates": len(sps) - first,
        }


def main(args: BenchArgs):
    check_flags(args)
    with open("/tmp/cleanba-bench.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [
            measure(args, env_id, ratio, concurrency)
            for env_id in args.env_ids
            for ratio in args.replay_ratios
            for concurrency in [True, False]
        ]
    print(f"steady state over {rows[0]['updates']} updates of 256 env steps, {os.cpu_count()} cores, JAX on CPU, a0-l1")
    print("| env | --replay-ratio | concurrency | SPS (env steps/s) | gradient steps/s |")
    print("|-|-|-|-|-|")
    for row in rows:
        print(
            f"| {row['env_id']} | {row['replay_ratio']} | {'on' if row['concurrency'] else 'off (--no-concurrency)'} "
            f"| {row['sps']:.0f} | {row['gradient_steps_per_second']:.0f} |"
        )


if __name__ == "__main__":
    sys.exit(run_cli(main, BenchArgs))
