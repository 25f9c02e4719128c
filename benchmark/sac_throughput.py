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
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cleanrl_utils.cli import run_cli

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "cleanba" / "cleanba_sac_continuous_action_envpool_mujoco.py"


@dataclasses.dataclass
class BenchArgs:
    env_ids: list[str] = dataclasses.field(default_factory=lambda: ["Pendulum-v1", "HalfCheetah-v4"])
    replay_ratios: list[float] = dataclasses.field(default_factory=lambda: [1.0, 0.25])
    updates: int = 24
    """updates per run (256 env steps each with the defaults)"""
    warmup_updates: int = 4
    """updates after learning starts left out of the steady state (the learner compiles in the first)"""
    learning_starts: int = 512


def measure(args: BenchArgs, env_id: str, replay_ratio: float, concurrency: bool) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        batch = 256  # the defaults: 2 actor threads x 4 envs x 32 steps
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
            str(args.updates * batch),
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
        subprocess.run(command, cwd=workdir, check=True, stdout=subprocess.DEVNULL)
        events = EventAccumulator(str(Path(workdir) / "runs" / "bench"), size_guidance={"scalars": 0})
        events.Reload()
        sps = events.Scalars("charts/SPS")
        first = -(-args.learning_starts // batch) + args.warmup_updates  # index of the first steady update
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
