"""Many seeds in one Anakin program (--num-seeds) against one process per seed: the wall time of a README command.

    uv run python benchmark/anakin_seeds.py --command ppo_anakin --num-seeds 1 2 4 8 16 32 64 --processes 10

The README's command (`ppo_anakin`: the MiniGrid one, `ppo_continuous_action_anakin`: CartpoleBalance) runs once for
each N of --num-seeds, as written plus `--num-seeds N --seed 1`, then (--processes P) as P processes of one seed
each, seeds 1..P, one after another: one line each, with the wall time (start-up and compiling included) and each
seed's last logged average return (its folder runs/{run}/seed{seed}; the run's own with one seed), is appended to
--results and printed. Run it on a quiet machine: the times are the comparison.
"""

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tool_helpers import machine, read_run, readme_training_commands, timed_process

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.flags import MAX_SEED

SCRIPTS = {
    "ppo_anakin": "cleanba/cleanba_ppo_anakin.py",
    "ppo_continuous_action_anakin": "cleanba/cleanba_ppo_continuous_action_anakin.py",
}


@dataclass
class Args:
    command: str = "ppo_anakin"
    """the README command of this Anakin script: ppo_anakin (MiniGrid) or ppo_continuous_action_anakin
    (CartpoleBalance)"""
    num_seeds: list[int] = field(default_factory=lambda: [1, 10])
    """the seeds of each one-process run (each in [1, 2**32 - 1]: seeds 1 .. N)"""
    processes: int = 10
    """then as many one-seed processes, one after another, seeds 1 .. P (0: none)"""
    results: str = "benchmark/results/anakin_seeds.jsonl"
    """one JSON line per run is appended here"""
    readme: str = "README.md"


def readme_command(readme: str, script: str) -> str:
    """The README's CPU command of `script` (the first that runs it)."""
    commands = [command for command in readme_training_commands(readme) if script in command]
    if not commands:
        fail(f"--readme: {readme} has no command running {script}")
    return commands[0]


def timed_run(command: str, flags: list[str], run_name: str, seeds: list[int]) -> dict:
    """One process: its wall time and each seed's last logged average return."""
    argv = [*shlex.split(command), *flags, "--run-name", run_name]
    _, wall, other_load = timed_process(argv)
    folders = [Path("runs", run_name, f"seed{seed}") for seed in seeds] if len(seeds) > 1 else [Path("runs", run_name)]
    final = [float(read_run(folder, "charts/avg_episodic_return")[2][-1]) for folder in folders]
    load = {} if other_load is None else {"other_load_cores": round(other_load, 2)}
    return {"wall_s": round(wall, 1), **load, "seeds": seeds, "final_returns": [round(value, 4) for value in final]}


def main(args: Args) -> int:
    if args.command not in SCRIPTS:
        fail(f"--command must be one of {list(SCRIPTS)}, got {args.command!r}")
    # the runs' seeds are 1 .. N (and 1 .. P): within the scripts' seed range, as their --num-seeds check asks
    if not args.num_seeds or not all(1 <= n <= MAX_SEED for n in args.num_seeds):
        fail(f"--num-seeds must be integers in [1, {MAX_SEED}] (the runs' seeds are 1 .. N), got {args.num_seeds}")
    if not 0 <= args.processes <= MAX_SEED:
        fail(f"--processes must be in [0, {MAX_SEED}] (their seeds are 1 .. P), got {args.processes}")
    command = readme_command(args.readme, SCRIPTS[args.command])
    stamp = int(time.time())
    runs = [
        ("one process", f"seeds{n}_{stamp}", ["--num-seeds", str(n), "--seed", "1"], list(range(1, n + 1)))
        for n in args.num_seeds
    ]
    runs += [("one seed a process", f"seed{s}_{stamp}", ["--seed", str(s)], [s]) for s in range(1, args.processes + 1)]
    for mode, run_name, flags, seeds in runs:
        record = {"command": command, "mode": mode, **timed_run(command, flags, run_name, seeds), **machine()}
        print(json.dumps(record), flush=True)
        with open(args.results, "a") as results:
            results.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
