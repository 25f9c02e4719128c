"""pgx's own MinAtar PPO example beside the Anakin PPO at its settings, on one GPU, seed by seed.

    python3 benchmark/pgx_minatar_check.py --pgx-train PGX/examples/minatar-ppo/train.py --logs OUT/logs \\
        --results OUT/pgx_minatar_check.jsonl --pgx-seeds 0 1 2 --ours-seeds 1 2 3 --jobs 8
    python3 benchmark/pgx_minatar_check.py --from-logs --logs OUT/logs --results OUT/pgx_minatar_check.jsonl

pgx's README plots its example's evaluation return at 20M steps; this measures what the example itself gives today,
on the same machine as ours. Its `train.py` (a checkout of sotetsuk/pgx, `key=value` arguments, dm-haiku installed)
runs unchanged, with benchmark/pgx-stand-ins first on PYTHONPATH: W&B, OmegaConf, pydantic and distrax do not run
beside today's JAX or offline. Its measure is the mean return of the sampled policy over 100 envs' first episodes
after the last update; ours the saved model's 100 episodes (`--save-model --eval-episodes 100`), sampled actions.
Variants of ours: `default` (the script as it is) and `haiku` (the same run through benchmark/haiku_init.py:
haiku's default initializers, as pgx's network has). All runs start together (`--jobs` at a time, sharing the GPU),
each with its log in --logs; `--from-logs` reads the logs only. A JSON line per run goes to --results, then a table.
"""

import ast
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tool_helpers import PGX_MINATAR_PPO, machine

from cleanrl_utils.cli import fail, read_input, run_cli

BENCHMARK = Path(__file__).parent
# the stand-ins for wandb, pydantic, omegaconf and distrax: a folder whose name is no Python name, so that neither
# benchmark/ nor the repository on sys.path imports them; only pgx's example finds them, on its PYTHONPATH
STAND_INS = BENCHMARK / "pgx-stand-ins"
# pgx's examples/minatar-ppo settings (docs/studies/minatar_pgx.md)
PGX_PPO = (
    "--local-num-envs 4096 --num-steps 128 --update-epochs 3 --num-minibatches 128 --no-anneal-lr "
    "--learning-rate 3e-4 --clip-coef 0.2 --ent-coef 0.01 --hiddens 64 64"
)


@dataclass
class Args:
    logs: str
    """the folder of the runs' logs"""
    results: str
    """JSON lines, one per run, appended"""
    pgx_train: str = ""
    """pgx's examples/minatar-ppo/train.py (needed unless --from-logs)"""
    env_id: str = "minatar-breakout"
    pgx_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    ours_seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    variants: list[str] = field(default_factory=lambda: ["default", "haiku"])
    total_timesteps: int = 20_000_000
    jobs: int = 8
    python: str = "python3"
    from_logs: bool = False
    ran_on: str = ""
    """with --from-logs: the accelerator the logs came from (the records' own machine otherwise)"""


def commands(args: Args) -> dict[str, tuple[list[str], dict]]:
    """{log name: (command, extra environment)} of every run."""
    runs = {}
    stand_ins = {"PYTHONPATH": os.pathsep.join([str(STAND_INS), os.environ.get("PYTHONPATH", "")])}
    for seed in args.pgx_seeds:
        options = [f"env_name={args.env_id}", f"seed={seed}", f"total_timesteps={args.total_timesteps}"]
        runs[f"pgx_{seed}"] = ([*shlex.split(args.python), args.pgx_train, *options], stand_ins)
    for variant in args.variants:
        wrapper = [str(BENCHMARK / "haiku_init.py")] if variant == "haiku" else []
        for seed in args.ours_seeds:
            flags = f"{PGX_PPO} --env-id {args.env_id} --seed {seed} --total-timesteps {args.total_timesteps}"
            flags += f" --exp-name pgx_check_{variant} --checkpoint-frequency 0 --save-model --eval-episodes 100"
            runs[f"{variant}_{seed}"] = (
                [
                    *shlex.split(args.python),
                    *wrapper,
                    str(BENCHMARK.parent / "cleanba" / "cleanba_ppo_anakin.py"),
                    *flags.split(),
                ],
                {},
            )
    return runs


def run(name: str, command: list[str], env: dict, logs: Path) -> float:
    started = time.time()
    with open(logs / f"{name}.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    return time.time() - started


def record(log: Path) -> dict | None:
    """A run's record from its log: pgx's last printed evaluation, or our saved model's evaluation."""
    variant, seed = log.stem.rsplit("_", 1)
    text = read_input(log, "--logs", "the runs' console logs (text)")
    if variant == "pgx":
        evaluations = [ast.literal_eval(line) for line in text.splitlines() if "/eval_R" in line]
        if not evaluations:
            return None
        last = evaluations[-1]
        eval_return = next(v for k, v in last.items() if k.endswith("/eval_R"))
        return {"variant": "pgx example", "seed": int(seed), "eval_return": eval_return, "steps": last["steps"]}
    evaluated = re.search(r"^evaluated .*: (\d+) episodes, episodic_return=([-\d.]+)", text, re.M)
    updates = re.findall(r"^update=\d+/\d+ global_step=(\d+) .*avg_episodic_return=([-\d.na]+)", text, re.M)
    if evaluated is None or not updates:
        return None
    return {
        "variant": f"ours, {variant}",
        "seed": int(seed),
        "eval_return": float(evaluated.group(2)),
        "steps": int(updates[-1][0]),
        "training_return": float(updates[-1][1]),
    }


def main(args: Args) -> None:
    if args.env_id not in PGX_MINATAR_PPO:
        fail(f"--env-id {args.env_id!r} is not one of pgx's MinAtar games: {', '.join(PGX_MINATAR_PPO)}")
    if unknown := sorted(set(args.variants) - {"default", "haiku"}):
        fail(f"--variants {' '.join(unknown)}: each must be default or haiku")
    if args.jobs < 1:
        fail(f"--jobs must be positive (got {args.jobs})")
    logs = Path(args.logs)
    if args.from_logs and not logs.is_dir():
        fail(f"--logs {logs}: not a folder; with --from-logs, the folder of the runs' logs")
    if not args.from_logs:  # its text (another Python may run it: not compiled here)
        read_input(args.pgx_train, "--pgx-train", "pgx's examples/minatar-ppo/train.py")
    logs.mkdir(parents=True, exist_ok=True)
    walls = {}
    if not args.from_logs:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {
                name: pool.submit(run, name, command, env, logs) for name, (command, env) in commands(args).items()
            }
            walls = {name: round(future.result(), 1) for name, future in futures.items()}
    records = []
    for log in sorted(logs.glob("*.log")):
        if (entry := record(log)) is None:
            print(f"{log}: no evaluation (the run did not finish)")
            continue
        entry.update(env_id=args.env_id, wall_s=walls.get(log.stem), date=datetime.date.today().isoformat())
        records.append({**entry, **({"accelerator": args.ran_on} if args.ran_on else machine())})
    with open(args.results, "a") as f:
        for entry in records:
            f.write(json.dumps(entry) + "\n")
    print(f"| {args.env_id} | seeds: evaluation return | mean ± std |\n|---|---|---|")
    for variant in sorted({r["variant"] for r in records}):
        values = [r["eval_return"] for r in sorted(records, key=lambda r: r["seed"]) if r["variant"] == variant]
        print(
            f"| {variant} | {' / '.join(f'{v:.1f}' for v in values)} | {np.mean(values):.1f} ± {np.std(values):.1f} |"
        )
    print(f"| pgx's README plot at 20M | - | {PGX_MINATAR_PPO[args.env_id][0]} |")


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
