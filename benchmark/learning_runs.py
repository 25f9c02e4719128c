"""Learning runs over env ids x variants x seeds, with a table beside a published result and a figure: the MuJoCo PPO
script at CleanRL's scale (1M steps, beside CleanRL's ppo_continuous_action), the configurable on-policy agent's
comparison of policy losses (Andrychowicz et al. 2021), the Anakin PPO on pgx's MinAtar (20M steps, beside pgx's
MinAtar PPO example), and PQN on classic control (beside CleanRL's pqn.py table).

    # the MuJoCo PPO script's defaults on CleanRL's six MuJoCo v4 tasks, seeds 1-3
    uv run python benchmark/learning_runs.py --script ppo_continuous_action \\
        --results benchmark/results/mujoco_ppo.jsonl --output static/mujoco_ppo.png
    # each policy loss with its own defaults on HalfCheetah-v4 and Hopper-v4
    uv run python benchmark/learning_runs.py --script onpolicy --variants vpg ppo vtrace awr vmpo \\
        --env-ids HalfCheetah-v4 Hopper-v4
    # the Anakin PPO with pgx's MinAtar PPO settings on its five games (pgx's README reads the return at 20M)
    uv run python benchmark/learning_runs.py --script ppo_anakin --env-ids minatar-breakout minatar-asterix \\
        minatar-freeway minatar-seaquest minatar-space_invaders --total-timesteps 20000000 --final-window 1 \\
        --flags="--local-num-envs 4096 --num-steps 128 --update-epochs 3 --num-minibatches 128 --no-anneal-lr \\
        --learning-rate 3e-4 --clip-coef 0.2 --ent-coef 0.01 --hiddens 64 64 --log-frequency 1 \\
        --checkpoint-frequency 0 --save-model --eval-episodes 100" \\
        --results benchmark/results/minatar_ppo.jsonl --output static/minatar_ppo.png
    # CleanRL's own ppo_continuous_action.py (a checkout's copy; its own environment: CPU torch, gymnasium 0.29,
    # shimmy, dm-control) on DeepMind Control, beside the MuJoCo PPO script on envpool's same four tasks
    MUJOCO_GL=egl OMP_NUM_THREADS=1 uv run python benchmark/learning_runs.py --script cleanrl \
        --cleanrl-script ../cleanrl/cleanrl/ppo_continuous_action.py --python ../cleanrl/.venv/bin/python \
        --flags=--no-cuda --env-ids CheetahRun-v1 WalkerWalk-v1 CartpoleSwingup-v1 BallInCupCatch-v1 \
        --results benchmark/results/cleanrl_dm_control.jsonl --output static/cleanrl_dm_control.png
    # PQN at CleanRL's pqn.py settings (500k steps, 4 envs x 128 steps, 4 epochs x 4 minibatches) on its three tasks
    uv run python benchmark/learning_runs.py --script pqn --env-ids CartPole-v1 Acrobot-v1 MountainCar-v0 \
        --seeds 1 2 3 4 5 6 7 8 9 10 --total-timesteps 500000 --final-window 20 --flags="--num-actor-threads 1 \
        --local-num-envs 4 --end-e 0.05 --exploration-fraction 0.5 --log-frequency 1 --checkpoint-frequency 0" \
        --results benchmark/results/pqn_classic_control.jsonl --output static/pqn_classic_control.png
    uv run python benchmark/learning_runs.py ... --table-only        # the table and figure from --results
    # the same MinAtar runs on one GPU, five at a time, where python3 has JAX with CUDA (no uv)
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 benchmark/learning_runs.py --python python3 --jobs 5 ...

A variant of the on-policy script is its `--policy-loss`; of the MuJoCo PPO script, `default` (no flag) or any flags
given as `NAME=FLAGS`. Each run is `--env-id E --seed S --exp-name bench_{script}_{variant}` plus --flags (default: one
actor thread of 8 envs, the same 2048-step batch as the defaults' 2 threads x 4 envs with one busy thread per core here;
a0-l1; every update logged). A run's final return is the mean of its last --final-window logged
`charts/avg_episodic_return` (10 with every update logged: the last 20,480 env steps of a MuJoCo run; MinAtar's 1: each
env's last finished episode at the end, some of them begun updates before); with --save-model in --flags, the saved
model's evaluation (sampled actions, as pgx's example evaluates) is recorded too, as `eval_return`. The runs start
seed by seed (every env's seed 1 first, so a batch stopped early has whole seeds), --jobs at a time; each appends a
JSON line (with the processor, the GPU if any, and the date) to --results as it ends; the Markdown table (mean ± std
over seeds per variant and env, beside the published mean, marking a mean more than two of the published standard
deviations below it) is printed and the figure (mean over seeds, min-max band, the published mean as a line) is
written to --output.
"""

import datetime
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tool_helpers import PGX_MINATAR_PPO, find_runs, machine, mean_and_spread, pyplot, read_records, read_run, save

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.errors import RunError

plt = pyplot()

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "ppo_continuous_action": "cleanba/cleanba_ppo_continuous_action_envpool_mujoco.py",
    "onpolicy": "cleanba/cleanba_onpolicy_continuous_action_envpool_mujoco.py",
    "ppo_anakin": "cleanba/cleanba_ppo_anakin.py",
    "pqn": "cleanba/cleanba_pqn_envpool_impala_atari_wrapper.py",
    # CleanRL's own ppo_continuous_action.py (its path in --cleanrl-script; never copied here), run by --python in an
    # environment with its dependencies (CPU torch, gymnasium, shimmy's dm_control wrappers); on envpool's DeepMind
    # Control ids it runs the same task through dm_control itself (CLEANRL_ENV_IDS)
    "cleanrl": None,
}
# CleanRL's benchmark page for ppo_continuous_action (openrlbenchmark, tag pr-424): ppo_continuous_action on
# MuJoCo v4 after 1M steps, mean ± std over its 3 seeds
CLEANRL_PPO = {
    "HalfCheetah-v4": (1442.64, 46.03),
    "Walker2d-v4": (2287.95, 571.78),
    "Hopper-v4": (2382.86, 271.74),
    "InvertedPendulum-v4": (963.09, 22.20),
    "Humanoid-v4": (716.11, 49.08),
    "Pusher-v4": (-40.38, 7.15),
    # its dm_control table (docs, tag v1.0.0-13-gcbd83f6): ppo_continuous_action after 1M steps, 3 seeds
    "CheetahRun-v1": (432.56, 82.54),
    "WalkerWalk-v1": (392.51, 56.25),
    "CartpoleSwingup-v1": (640.86, 11.44),
    "BallInCupCatch-v1": (900.78, 5.26),
}
# CleanRL's PQN page (docs/rl-algorithms/pqn.md, "Episode Rewards" of pqn.py): classic control after 500k steps,
# mean ± std over its seeds
CLEANRL_PQN = {
    "CartPole-v1": (495.13, 6.89),
    "Acrobot-v1": (-95.63, 5.73),
    "MountainCar-v0": (-200.00, 0.00),
}
# envpool's DeepMind Control ids -> the same tasks through gymnasium + shimmy, as CleanRL's script names them
CLEANRL_ENV_IDS = {
    "CheetahRun-v1": "dm_control/cheetah-run-v0",
    "WalkerWalk-v1": "dm_control/walker-walk-v0",
    "CartpoleSwingup-v1": "dm_control/cartpole-swingup-v0",
    "BallInCupCatch-v1": "dm_control/ball_in_cup-catch-v0",
}
PUBLISHED = {  # per script: (its name in the table, {env id: (mean, std)})
    "ppo_continuous_action": ("CleanRL ppo_continuous_action (published, 3 seeds)", CLEANRL_PPO),
    "onpolicy": ("CleanRL ppo_continuous_action (published, 3 seeds)", CLEANRL_PPO),
    "ppo_anakin": ("pgx's MinAtar PPO (its README's plot at 20M)", PGX_MINATAR_PPO),
    "pqn": ("CleanRL pqn.py (published)", CLEANRL_PQN),
    "cleanrl": ("CleanRL ppo_continuous_action (published, 3 seeds)", CLEANRL_PPO),
}
LAYOUT = "--num-actor-threads 1 --local-num-envs 8 --actor-device-ids 0 --learner-device-ids 1 --log-frequency 1"


@dataclass
class Args:
    script: str = "onpolicy"
    """ppo_continuous_action, onpolicy, ppo_anakin, pqn or cleanrl"""
    env_ids: list[str] = field(default_factory=lambda: list(CLEANRL_PPO))
    variants: list[str] = field(default_factory=lambda: ["default"])
    """the on-policy script's --policy-loss values; for both scripts `default` (no flag) or NAME=FLAGS"""
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    total_timesteps: int = 1_000_000
    flags: str = f"{LAYOUT} --checkpoint-frequency 0"
    """the script's other flags, one string"""
    results: str = "benchmark/results/onpolicy_losses.jsonl"
    output: str = "static/onpolicy_losses.png"
    final_window: int = 10
    """the number of last logged returns whose mean is a run's final return"""
    table_only: bool = False
    python: str = "uv run python"
    """the command that runs the script (e.g. `python3` where JAX with CUDA is installed and uv is not)"""
    jobs: int = 1
    """runs at a time: one on a CPU (two runs share its cores); several can share one GPU"""
    cleanrl_script: str = ""
    """with --script cleanrl: the path of CleanRL's ppo_continuous_action.py"""


def variant_flags(script: str, variant: str) -> tuple[str, list[str]]:
    """(name, flags) of a variant."""
    if "=" in variant:
        name, flags = variant.split("=", 1)
        return name, flags.split()
    if variant == "default":
        return variant, []
    if script == "onpolicy":
        return variant, ["--policy-loss", variant]
    fail(f"--variants: {variant!r} is not `default` or NAME=FLAGS")


def run_one(args: Args, env_id: str, variant: str, seed: int) -> dict:
    name, flags = variant_flags(args.script, variant)
    exp_name = f"bench_{args.script}_{name}"
    if args.script == "cleanrl":
        script, run_env_id = args.cleanrl_script, CLEANRL_ENV_IDS.get(env_id, env_id)
    else:  # from any folder (benchmark/gpu.sh's sections run from the caller's)
        script, run_env_id = str(REPO / SCRIPTS[args.script]), env_id
    command = [
        *shlex.split(args.python),
        script,
        *("--env-id", run_env_id, "--seed", str(seed), *flags),
        *("--exp-name", exp_name, "--total-timesteps", str(args.total_timesteps), *args.flags.split()),
    ]
    started = time.time()
    completed = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - started
    if completed.returncode != 0:
        raise RunError(f"{' '.join(command)} failed:\n{completed.stderr[-3000:]}")
    run_dir = find_runs("runs", run_env_id, exp_name)[seed]
    _, _, returns = read_run(run_dir, return_tag(args.script))
    evaluation = {}
    if "--save-model" in command:  # the saved model's evaluation (sampled actions unless --eval-greedy)
        evaluation = {"eval_return": float(read_run(run_dir, "eval/episodic_return")[2].mean())}
    return {
        "script": args.script,
        "env_id": env_id,
        "variant": name,
        "seed": seed,
        "command": " ".join(command),
        "final_return": float(returns[-args.final_window :].mean()),
        "best_return": float(returns.max()),
        "last_return": float(returns[-1]),
        **evaluation,
        "wall_s": round(wall, 1),
        "run_dir": str(run_dir),
        **machine(),
        "date": datetime.date.today().isoformat(),
    }


def return_tag(script: str) -> str:
    """The scalar a run's returns are read from: CleanRL's script logs one per finished episode (with its one env, the
    last 10 are the last 10k steps); ours log the mean of the episodes finished in each update."""
    return "charts/episodic_return" if script == "cleanrl" else "charts/avg_episodic_return"


def machines(records: list[dict]) -> str:
    """Where the records ran: the accelerator where one was used, else the processor, with the dates."""
    where = sorted({(r.get("accelerator") or r.get("processor", "?"), r.get("date", "?")) for r in records})
    return "; ".join(f"{machine} ({date})" for machine, date in where)


def table(records: list[dict], env_ids: list[str], variants: list[str], script: str) -> str:
    published_name, published = PUBLISHED[script]
    lines = [
        "| variant | " + " | ".join(f"{env_id} (mean ± std over seeds)" for env_id in env_ids) + " |",
        "|---|" + "---|" * len(env_ids),
    ]
    # the saved model's evaluation (--save-model in --flags) has a row of its own: pgx's example reports that measure
    measures = [("final_return", "")]
    if any("eval_return" in r for r in records):
        measures.append(("eval_return", ": saved model"))
    for variant in variants:
        for measure, suffix in measures:
            cells = []
            for env_id in env_ids:
                values = [
                    r[measure]
                    for r in records
                    if r["env_id"] == env_id and r.get(measure) is not None and r["variant"] == variant
                ]
                if not values:
                    cells.append("-")
                    continue
                cell = f"{np.mean(values):,.1f} ± {np.std(values):,.1f} (n={len(values)}, worst {min(values):,.1f})"
                mean, std = published.get(env_id, (None, None))
                if std is not None and np.mean(values) < mean - 2 * std:
                    cell += " **below**"  # more than two of the published standard deviations under its mean
                cells.append(cell)
            lines.append(f"| {variant}{suffix} | " + " | ".join(cells) + " |")
    cells = [published_cell(*published[env_id]) if env_id in published else "-" for env_id in env_ids]
    lines.append(f"| {published_name} | " + " | ".join(cells) + " |")
    lines.append(f"\nRun on {machines(records)}.")
    return "\n".join(lines)


def published_cell(mean: float, std: float | None) -> str:
    return f"{mean:,.2f}" if std is None else f"{mean:,.2f} ± {std:,.2f}"


def figure(records: list[dict], env_ids: list[str], variants: list[str], script: str, output: str):
    published_name, published = PUBLISHED[script]
    columns = min(len(env_ids), 3)
    rows = -(-len(env_ids) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    for ax, env_id in zip(axes.flat, env_ids):
        for variant in variants:
            runs = [Path(r["run_dir"]) for r in records if r["env_id"] == env_id and r["variant"] == variant]
            if not runs:
                continue
            series = [read_run(run, return_tag(script)) for run in runs]
            grid, mean, low, high = mean_and_spread([s[0] for s in series], [s[2] for s in series])
            (line,) = ax.plot(grid, mean, label=f"{variant} ({len(runs)} seeds)")
            ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.15)
            evaluations = [
                r["eval_return"]
                for r in records
                if r["env_id"] == env_id and r["variant"] == variant and r.get("eval_return") is not None
            ]
            if evaluations:  # the saved models' evaluation at the end: mean over seeds, bar from min to max
                mean = np.mean(evaluations)
                spread = [[mean - min(evaluations)], [max(evaluations) - mean]]
                ax.errorbar(
                    grid[-1],
                    mean,
                    yerr=spread,
                    fmt="o",
                    color=line.get_color(),
                    capsize=4,
                    label=f"{variant}: saved model, {len(evaluations)} seeds",
                )
        if env_id in published:
            mean = published[env_id][0]
            ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"{published_name}: {mean:g}")
        ylabel = "episodic return" if script == "cleanrl" else "average episodic return"
        ax.set(title=env_id, xlabel="env steps", ylabel=ylabel)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(env_ids) :]:
        ax.set_visible(False)
    title = {
        "ppo_continuous_action": "MuJoCo PPO",
        "onpolicy": "Policy losses of the configurable on-policy agent",
        "ppo_anakin": "Anakin PPO on pgx's MinAtar",
        "pqn": "PQN at CleanRL's pqn.py settings",
        "cleanrl": "CleanRL's own ppo_continuous_action.py",
    }[script]
    fig.suptitle(f"{title}\n({machines(records)}; mean over seeds, band: min-max)")
    fig.tight_layout()
    save(fig, output)


def main(args: Args):
    if args.script not in SCRIPTS:
        fail(f"--script must be one of {list(SCRIPTS)}, got {args.script!r}")
    if args.script == "cleanrl" and not Path(args.cleanrl_script).is_file():
        fail(f"--cleanrl-script must be the path of CleanRL's ppo_continuous_action.py, got {args.cleanrl_script!r}")
    names = [variant_flags(args.script, variant)[0] for variant in args.variants]
    results = Path(args.results)
    if args.jobs < 1:
        fail(f"--jobs must be positive, got {args.jobs}")
    if not args.table_only:
        results.parent.mkdir(parents=True, exist_ok=True)
        runs = [(env_id, variant, seed) for seed in args.seeds for env_id in args.env_ids for variant in args.variants]

        def run_and_record(run):
            record = run_one(args, *run)
            print(json.dumps(record), flush=True)
            with results.open("a") as file:  # one write of a whole line: lines of parallel runs do not mix
                file.write(json.dumps(record) + "\n")

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(run_and_record, runs))
    records = read_records(results, "--results", keys=("env_id", "variant", "seed"))
    # the newest record of each (env, variant, seed) of this script
    records = {(r["env_id"], r["variant"], r["seed"]): r for r in records if r.get("script") == args.script}
    records = [r for (env_id, _, seed), r in records.items() if env_id in args.env_ids and seed in args.seeds]
    print(table(records, args.env_ids, names, args.script))
    figure(records, args.env_ids, names, args.script, args.output)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
