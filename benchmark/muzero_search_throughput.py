"""MuZero's actor search throughput: search steps/s (envs searched per second) and simulations/s of one actor
thread's jitted search (the script's own `make_actor_fns(...).act`: represent, mctx search, one device-to-host
copy) against the envs per thread, on CartPole-v1 (MLPs) and Breakout-v5 (a tiny residual torso).

Sebulba batches the search over all envs of a thread: one call searches every env at once, so steps/s should grow
with envs per thread until the device is busy. Observations are the envs' own (envpool reset); params are the
initial ones (the search's cost does not depend on their values). Each point: compile, --warmup calls, then
--seconds of calls. Prints a markdown table (for the docs) and writes JSON lines to --out. Holds
/tmp/cleanba-bench.lock, like the other benchmarks, so that no other benchmark of this repository runs at once.

usage (from the repository root): uv run python benchmark/muzero_search_throughput.py [--seconds 5]
"""

import dataclasses
import fcntl
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.evals.evaluate import load_script

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "cleanba" / "cleanba_muzero_envpool_impala_atari_wrapper.py"
# the settings of the learning test (CartPole) and of the smoke tests (tiny Breakout)
SETTINGS = {
    "CartPole-v1": dict(
        hiddens=[64], embedding_size=32, support_size=10, num_simulations=8, max_num_considered_actions=2
    ),
    "Breakout-v5": dict(
        channels=[4, 4], num_blocks=1, hiddens=[16], support_size=5, num_simulations=8, max_num_considered_actions=4
    ),
}


@dataclasses.dataclass
class BenchArgs:
    env_ids: list[str] = dataclasses.field(default_factory=lambda: ["CartPole-v1", "Breakout-v5"])
    envs_per_thread: list[int] = dataclasses.field(default_factory=lambda: [1, 4, 16, 64, 256])
    seconds: float = 5.0
    """time each point is measured for, after compilation and warmup"""
    warmup: int = 3
    out: str = "benchmark/results/muzero_search_throughput.jsonl"


def measure(muzero, env_id: str, num_envs: int, seconds: float, warmup: int) -> dict:
    args = muzero.Args(env_id=env_id, local_num_envs=num_envs, **SETTINGS[env_id])
    agent, state = muzero.make_agent(args, jax.random.key(0))
    act = muzero.make_actor_fns(agent, args).act
    envs = muzero.make_env(env_id, 0, num_envs)
    obs, _ = envs.reset()
    params, key = jax.device_put(state.params), jax.random.key(0)
    for _ in range(warmup):  # the first compiles
        output, key = act(params, obs, key)
        np.asarray(output)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        output, key = act(params, obs, key)
        np.asarray(output)  # the actor waits for the action on the host each step
        calls += 1
    elapsed = time.perf_counter() - start
    envs.close()
    return {
        "env_id": env_id,
        "envs_per_thread": num_envs,
        "num_simulations": args.num_simulations,
        "search_steps_per_second": calls * num_envs / elapsed,
        "simulations_per_second": calls * num_envs * args.num_simulations / elapsed,
        "ms_per_call": 1000 * elapsed / calls,
        "device": str(jax.devices()[0].platform),
    }


def main(args: BenchArgs):
    if not args.env_ids or not set(args.env_ids) <= set(SETTINGS):
        fail(f"--env-ids must be one or more of {', '.join(SETTINGS)} (the settings measured), got {args.env_ids}")
    if not args.envs_per_thread or min(args.envs_per_thread) < 1:
        fail(f"--envs-per-thread must be one or more positive integers (got {args.envs_per_thread})")
    if not 0 < args.seconds < float("inf") or args.warmup < 1:
        fail(f"--seconds must be positive and finite, --warmup positive (got {args.seconds}, {args.warmup})")
    with open("/tmp/cleanba-bench.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        muzero = load_script(SCRIPT, ("evaluation", "run", "sebulba"))
        rows = [
            measure(muzero, env_id, n, args.seconds, args.warmup)
            for env_id in args.env_ids
            for n in args.envs_per_thread
        ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print("| env | envs per thread | search steps/s | simulations/s | ms per search call |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['env_id']} | {row['envs_per_thread']} | {row['search_steps_per_second']:,.0f} | "
            f"{row['simulations_per_second']:,.0f} | {row['ms_per_call']:.1f} |"
        )


if __name__ == "__main__":
    sys.exit(run_cli(main, BenchArgs))
