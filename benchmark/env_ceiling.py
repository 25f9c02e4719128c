"""The environment ceiling: envpool alone, stepped with random actions, with the script's own env settings.

No agent, no device: the steps per second envpool gives on this machine's cores, which no Sebulba run with the
same envs can exceed. One pool of --num-envs envs per --pools thread (Sebulba: one pool per actor thread), the
cores split between the pools as the scripts split them (`--envpool-threads`, default: cores but one).

usage (from the repository root):
  uv run python benchmark/env_ceiling.py --env-id Breakout-v5 --num-envs 64 --pools 2 --json results.jsonl
"""

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import tyro

from cleanrl_utils.devices import envpool_num_threads
from cleanrl_utils.evals.evaluate import load_script

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class CeilingArgs:
    env_id: str = "Breakout-v5"
    """the envpool id (the script's make_env settings apply: IMPALA's Atari setup)"""
    num_envs: int = 64
    """envs per pool (Cleanba's default --local-num-envs)"""
    pools: int = 2
    """pools stepped at once, one Python thread each (Cleanba's default: 2 actor threads)"""
    envpool_threads: int = 0
    """threads of each pool (0: the scripts' default, this process's cores but one shared by the pools)"""
    steps: int = 2000
    """timed steps of each pool (after 100 untimed ones)"""
    script: Path = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
    """the script whose make_env is used"""
    json: Path | None = None
    """append the result as one JSON line to this file"""


def main(args: CeilingArgs):
    module = load_script(args.script)
    num_threads = envpool_num_threads(args.envpool_threads, args.pools)
    pools = [module.make_env(args.env_id, 1000 * i, args.num_envs, num_threads=num_threads) for i in range(args.pools)]
    rng = np.random.default_rng(0)
    actions = rng.integers(0, pools[0].action_space.n, size=(64, args.num_envs))

    def step(envs, count):
        envs.reset()
        for i in range(count):
            envs.step(actions[i % len(actions)])

    def run_all(count):
        threads = [threading.Thread(target=step, args=(envs, count)) for envs in pools]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - start

    run_all(100)
    seconds = run_all(args.steps)
    sps = args.pools * args.num_envs * args.steps / seconds
    result = {
        "env_id": args.env_id,
        "num_envs": args.num_envs,
        "pools": args.pools,
        "envpool_threads": num_threads,
        "cores": os.cpu_count(),
        "steps": args.steps,
        "sps": sps,
    }
    print(
        f"{args.env_id}: {args.pools} pool(s) x {args.num_envs} envs, {num_threads} envpool thread(s) each, "
        f"{os.cpu_count()} cores: {sps:,.0f} env steps/s (random actions)"
    )
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main(tyro.cli(CeilingArgs))
