"""The environment ceiling: envpool alone, stepped with random actions, with the script's own env settings.

No agent, no device: the steps per second envpool gives on this machine's cores, which no Sebulba run with the
same envs can exceed. One pool of --num-envs envs per --pools thread (Sebulba: one pool per actor thread), the
cores split between the pools as the scripts split them (`--envpool-threads`, default: cores but one). Each pool is
stepped synchronously (`envs.step`), as an actor thread steps it. Several values of --pools, --num-envs and
--envpool-threads measure every combination in one process, one result (and JSON line) each; `--seconds` times each
for a fixed wall time instead of a fixed number of steps, so that a sweep's duration is known in advance.

usage (from the repository root):
  uv run python benchmark/env_ceiling.py --env-id Breakout-v5 --num-envs 64 --pools 2 --json results.jsonl
  uv run python benchmark/env_ceiling.py --pools 2 4 8 --num-envs 16 32 64 --envpool-threads 0 4 --seconds 4
"""

import dataclasses
import gc
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
from tool_helpers import python_script

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.devices import envpool_num_threads
from cleanrl_utils.envs import check_env_id
from cleanrl_utils.evals.evaluate import load_script

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class CeilingArgs:
    env_id: str = "Breakout-v5"
    """the envpool id (the script's make_env settings apply: IMPALA's Atari setup)"""
    num_envs: list[int] = dataclasses.field(default_factory=lambda: [64])
    """envs per pool (Cleanba's default --local-num-envs); several: each is measured"""
    pools: list[int] = dataclasses.field(default_factory=lambda: [2])
    """pools stepped at once, one Python thread each (Cleanba's default: 2 actor threads); several: each is measured"""
    envpool_threads: list[int] = dataclasses.field(default_factory=lambda: [0])
    """threads of each pool (0: the scripts' default, this process's cores but one shared by the pools); several:
    each is measured"""
    steps: int = 2000
    """timed steps of each pool (after 100 untimed ones)"""
    seconds: float = 0.0
    """if positive: each pool steps for this many seconds of wall time instead of --steps steps"""
    script: Path = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
    """the script whose make_env is used"""
    json: Path | None = None
    """append the result as one JSON line to this file"""


def bad_flag(args: CeilingArgs) -> str | None:
    """What is wrong with the flags, in one line naming the flag, or None."""
    for name, smallest in [("pools", 1), ("num_envs", 1), ("envpool_threads", 0)]:
        values = getattr(args, name)
        if not values or min(values) < smallest:
            return f"--{name.replace('_', '-')} must be {'positive' if smallest else 'non-negative'} (got {values})"
    if args.steps < 1:
        return f"--steps must be positive (got {args.steps})"
    if not 0 <= args.seconds < float("inf"):
        return f"--seconds must be non-negative and finite (got {args.seconds})"
    return None


def measure(module, env_id: str, num_envs: int, pools: int, envpool_threads: int, steps: int, seconds: float):
    """Env steps per second of `pools` pools of `num_envs` envs stepped at once, each by its own thread: (steps of
    each pool on average, wall seconds, steps per second), after 100 untimed steps."""
    num_threads = envpool_num_threads(envpool_threads, pools)
    envs_of_pools = [module.make_env(env_id, 1000 * i, num_envs, num_threads=num_threads) for i in range(pools)]
    rng = np.random.default_rng(0)
    actions = rng.integers(0, envs_of_pools[0].action_space.n, size=(64, num_envs))
    steps_taken = [0] * pools

    def step(index: int, count: int, deadline: float):
        envs = envs_of_pools[index]
        envs.reset()
        i = 0
        while i < count or time.perf_counter() < deadline:
            envs.step(actions[i % len(actions)])
            i += 1
        steps_taken[index] = i

    def run_all(count: int, duration: float) -> float:
        start = time.perf_counter()
        threads = [threading.Thread(target=step, args=(i, count, start + duration)) for i in range(pools)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    run_all(100, 0.0)
    elapsed = run_all(0, seconds) if seconds > 0 else run_all(steps, 0.0)
    envs_of_pools.clear()  # the pools' threads end before the next configuration starts its own
    gc.collect()
    return sum(steps_taken) / pools, elapsed, num_envs * sum(steps_taken) / elapsed, num_threads


def main(args: CeilingArgs):
    if (error := bad_flag(args)) is not None:
        fail(error)
    module = load_script(python_script(args.script, "--script"))
    check_env_id(args.env_id, discrete=True)  # random actions of a discrete action space
    for pools, num_envs, envpool_threads in itertools.product(args.pools, args.num_envs, args.envpool_threads):
        steps, seconds, sps, num_threads = measure(
            module, args.env_id, num_envs, pools, envpool_threads, args.steps, args.seconds
        )
        result = {
            "env_id": args.env_id,
            "num_envs": num_envs,
            "pools": pools,
            "envpool_threads": num_threads,
            "cores": os.cpu_count(),
            "steps": steps,
            "seconds": seconds,
            "sps": sps,
        }
        print(
            f"{args.env_id}: {pools} pool(s) x {num_envs} envs, {num_threads} envpool thread(s) each, "
            f"{os.cpu_count()} cores: {sps:,.0f} env steps/s (random actions)",
            flush=True,
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    sys.exit(run_cli(main, CeilingArgs))
