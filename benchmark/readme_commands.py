"""Run the README's CPU commands over seeds: what each seed reaches, how long it takes, and a figure.

    uv run python benchmark/readme_commands.py --algorithms ppo impala sac --seeds 1 2 3 4 5 6 7 8 9 10

Each command is read from README.md (each bash block line that runs a script in cleanba/ on the CPU): the first of
each script is named after its algorithm (for PPO the quick start's), the others `{algorithm}@{env id}` (e.g.
`ppo@MiniGrid-Empty-5x5-v0`). It runs as written plus `--seed S --exp-name readme_{name}`, one run at a time; each
record keeps how many CPU cores other processes kept busy during its run (`other_load_cores`), and a wall time
measured beside more than a quarter of a core, or without that measurement (an older record), is marked in the table
and is no quiet machine's time (the README's promised times are checked against quiet runs only); `--extra-flags`
appends flags (a variant of the command, recorded with it).
A seed passes when its best average return over a window of consecutive env steps (10k on CartPole, 2k on Pendulum,
20k on HalfCheetah, ...) reaches the command's threshold (THRESHOLDS, with its source); the final average (the last
window) is recorded too. Each run appends a JSON line to --results (with the processor and the date); each command's
table (Markdown, for its docs page: the rate of seeds that pass and the worst seed's best window) is printed and its
figure, every seed's curve with the threshold, is written to static/readme_{name}_seeds.png. `--table-only` draws and
prints from the runs recorded in --results.
"""

import datetime
import json
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tool_helpers import (
    TimedRun,
    find_runs,
    machine,
    pyplot,
    quiet,
    read_records,
    read_run,
    readme_training_commands,
    save,
    timed_process,
)

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.flags import MAX_SEED

plt = pyplot()

SCRIPTS = {
    "ppo": "cleanba_ppo_envpool_impala_atari_wrapper.py",
    "impala": "cleanba_impala_envpool_impala_atari_wrapper.py",
    "ppo_continuous_action": "cleanba_ppo_continuous_action_envpool_mujoco.py",
    "sac": "cleanba_sac_continuous_action_envpool_mujoco.py",
    "r2d2": "cleanba_r2d2_envpool_impala_atari_wrapper.py",
    "muzero": "cleanba_muzero_envpool_impala_atari_wrapper.py",
    "ppo_anakin": "cleanba_ppo_anakin.py",
    "onpolicy_continuous_action": "cleanba_onpolicy_continuous_action_envpool_mujoco.py",
    "ppo_continuous_action_anakin": "cleanba_ppo_continuous_action_anakin.py",
    "pqn": "cleanba_pqn_envpool_impala_atari_wrapper.py",
}
# per env id: (threshold, where it comes from, the window in env steps over which the logged average is averaged)
THRESHOLDS = {
    "CartPole-v1": (400.0, "issue #28's bar for CartPole (the maximum is 500)", 10_000),
    "Pendulum-v1": (-250.0, "issue #28's bar for Pendulum (a random policy averages about -1200)", 2_048),
    # reaching the goal in the fewest steps (5) pays 1 - 0.9 x 5 / 100 = 0.955 (MiniGrid's reward); random play ~0.2
    "MiniGrid-Empty-5x5": (0.9, "issue #29's bar for MiniGrid-Empty-5x5 (the best return is 0.955)", 10_240),
    # envpool's MiniGrid, the Sebulba side of the README's Anakin-vs-Sebulba pair: acting one policy version behind, it
    # needs more steps than Anakin's 61k to reach 0.9, so its command's bar is a clear gain over random play (~0.2)
    "MiniGrid-Empty-5x5-v0": (0.5, "2.5x random play's 0.2 in Anakin's budget (the README's MiniGrid pair)", 10_240),
    # +1 per step while the pole is up, 1000 at most; random actions about 8
    "InvertedPendulum-v4": (500.0, "the MuJoCo PPO script's InvertedPendulum test bar (the pole up 500 steps)", 5_120),
    "HalfCheetah-v4": (
        1442.64,
        "CleanRL's ppo_continuous_action after 1M steps (CleanRL docs, PPO page, MuJoCo v4 table)",
        20_480,
    ),
    # DeepMind Control's smooth reward, at most 1 per step over 1000 steps; random actions about 364, a still cart
    # (action 0) about 710: 800 needs the pole balanced with the cart centered
    "CartpoleBalance-v1": (800.0, "issue #41's bar for CartpoleBalance (the maximum is 1000)", 32_768),
    # MuJoCo Playground's version of the same task (the Anakin side of the README's CartpoleBalance pair)
    "CartpoleBalance": (800.0, "issue #41's bar for CartpoleBalance (the maximum is 1000)", 32_768),
}
TAG = "charts/avg_episodic_return"


@dataclass
class Args:
    algorithms: list[str] = field(default_factory=lambda: list(SCRIPTS))
    """which commands to run: any of ppo, impala, ppo_continuous_action, sac, r2d2, muzero, ppo_anakin,
    onpolicy_continuous_action, ppo_continuous_action_anakin, pqn, or `{algorithm}@{env id}` for a script's further
    README command"""
    seeds: list[int] = field(default_factory=lambda: list(range(1, 11)))
    extra_flags: str = ""
    """flags appended to each command, one string (`--extra-flags="--rmsprop-eps 1e-5"`): a variant, recorded with
    the runs, its table and figure named apart"""
    results: str = "benchmark/results/readme_commands.jsonl"
    """one JSON line per run is appended here"""
    readme: str = "README.md"
    xla_cpu_max_isa: str = ""
    """run XLA's CPU code with at most this instruction set (AVX2, SSE4_2): the same seeds through other float
    rounding, which sends some seeds' runs elsewhere as another processor kind does (a stand-in for one, not one);
    recorded, and the runs, table and figure are named apart (`impala+isa_AVX2`)"""
    table_only: bool = False
    """run nothing: print the tables and draw the figures from the runs recorded in --results (the newest per seed)"""
    one_process: bool = False
    """an Anakin command's seeds (consecutive) in one process, `--num-seeds`: each seed's curve from its folder
    runs/{run}/seed{seed}, each record's wall time the whole process's; the runs, table and figure are named apart
    (`ppo_anakin+one_process`)"""


def readme_commands(readme: str) -> dict[str, str]:
    """name -> a CPU command in the README: the algorithm for the first that runs its script, `{algorithm}@{env id}`
    for the others."""
    commands = {}
    for command in readme_training_commands(readme):
        for algorithm, script in SCRIPTS.items():
            if f"cleanba/{script}" in command:
                commands[algorithm if algorithm not in commands else f"{algorithm}@{env_id_of(command)}"] = command
    return commands


def window_averages(steps: np.ndarray, values: np.ndarray, window: int) -> tuple[float, float, int]:
    """(best, final, first step of the best window): means of the logged values whose steps lie in a window of
    `window` env steps, (end - window, end], for each logged step `end` with a whole window of env steps before it
    (end >= window; the last step where none has); the final window ends at the last logged value, so best >= final."""
    ends = [e for e in steps if e >= window] or [steps[-1]]
    means = [values[(steps > e - window) & (steps <= e)].mean() for e in ends]
    best = int(np.nanargmax(means))
    final = values[steps > steps[-1] - window].mean()
    return float(means[best]), float(final), int(steps[steps > ends[best] - window][0])


def env_id_of(command: str) -> str:
    return shlex.split(command)[shlex.split(command).index("--env-id") + 1]


def isa_environment(max_isa: str) -> dict | None:
    """The runs' environment: this one, with XLA's CPU code limited to `max_isa` where given (the scripts append their
    device count to XLA_FLAGS, keeping this)."""
    if not max_isa:
        return None
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_max_isa={max_isa}".strip()
    return env


def seed_record(name: str, command: str, seed: int, *, run: TimedRun, run_dir: Path, max_isa: str) -> dict:
    """A seed's JSON line: the command, the machine and its instruction set, the wall time (and how busy other
    processes kept the CPU), the console's last update line and the seed's curve."""
    steps, _, values = read_run(run_dir, TAG)
    return {
        "algorithm": name,
        "seed": seed,
        "command": command,
        **machine(),
        **({"xla_cpu_max_isa": max_isa} if max_isa else {}),
        "date": datetime.date.today().isoformat(),
        "wall_s": round(run.wall, 1),
        **({} if run.other_load is None else {"other_load_cores": round(run.other_load, 2)}),
        "last": [line for line in run.process.stdout.splitlines() if line.startswith("update=")][-1],
        "run_dir": str(run_dir),
        "curve": [[int(step), float(value)] for step, value in zip(steps, values)],  # tables need no run folder
    }


def run_seed(name: str, command: str, seed: int, max_isa: str = "") -> dict:
    exp_name = "readme_" + re.sub(r"[^A-Za-z0-9._-]", "_", name)
    argv = [*shlex.split(command), "--seed", str(seed), "--exp-name", exp_name]
    run = timed_process(argv, isa_environment(max_isa))
    run_dir = find_runs("runs", env_id_of(command), exp_name)[seed]  # the newest run of this seed: this one
    return seed_record(name, command, seed, run=run, run_dir=run_dir, max_isa=max_isa)


def run_seeds_in_one_process(name: str, command: str, seeds: list[int], max_isa: str = "") -> dict[int, dict]:
    """An Anakin command with `--num-seeds`: one process for all `seeds`, a record per seed (its folder's curve)."""
    run_name = f"readme_{re.sub(r'[^A-Za-z0-9._-]', '_', name)}_{int(time.time())}"
    argv = [*shlex.split(command), "--seed", str(seeds[0]), "--num-seeds", str(len(seeds)), "--run-name", run_name]
    run = timed_process(argv, isa_environment(max_isa))
    records = {}
    for seed in seeds:
        run_dir = Path("runs", run_name, f"seed{seed}") if len(seeds) > 1 else Path("runs", run_name)
        record = seed_record(name, command, seed, run=run, run_dir=run_dir, max_isa=max_isa)
        records[seed] = {**record, "seeds_in_the_process": len(seeds)}
    return records


def summarize(env_id: str, records: dict[int, dict]) -> list[dict]:
    threshold, _, window = THRESHOLDS[env_id]
    rows = []
    for _, record in sorted(records.items()):
        if "curve" in record:
            steps, values = (np.array(column) for column in zip(*record["curve"]))
        elif Path(record["run_dir"]).is_dir():  # a record from before the curves were kept: its run folder
            steps, _, values = read_run(Path(record["run_dir"]), TAG)
        else:
            fail(f"seed {record['seed']}'s record keeps no curve and {record['run_dir']} is gone: run the seed again")
        best, final, best_start = window_averages(steps, values, window)
        reached = steps[np.argmax(values >= threshold)] if (values >= threshold).any() else None
        rows.append(
            {
                **record,
                "best": best,
                "best_from": best_start,
                "final": final,
                "first_reached": None if reached is None else int(reached),
                "passed": best >= threshold,
                "curve": (steps, values),
            }
        )
    return rows


def load_note(row: dict) -> str:
    """Why a run's wall time is not a quiet machine's."""
    if row.get("other_load_cores") is None:
        return " (load not measured)"
    return f" (beside {row['other_load_cores']:.1f} cores of other load)"


def print_table(algorithm: str, env_id: str, rows: list[dict]):
    threshold, source, window = THRESHOLDS[env_id]
    print(f"\n{algorithm} on {env_id}: threshold {threshold:g} ({source}); windows of {window:,} env steps")
    print(f"command: {rows[0]['command']}")
    print("| seed | best window average (from step) | final window average | first logged >= threshold | wall time |")
    print("|---|---|---|---|---|")
    decimals = 3 if abs(threshold) < 10 else 1  # MiniGrid's returns are below 1
    for row in rows:
        reached = "never" if row["first_reached"] is None else f"step {row['first_reached']:,}"
        best, final = f"{row['best']:,.{decimals}f}", f"{row['final']:,.{decimals}f}"
        load = "" if quiet(row) else load_note(row)
        print(f"| {row['seed']} | {best} ({row['best_from']:,}) | {final} | {reached} | {row['wall_s']:.0f} s{load} |")
    passed = sum(row["passed"] for row in rows)
    quiet_walls = [row["wall_s"] for row in rows if quiet(row)]
    walls = quiet_walls or [row["wall_s"] for row in rows]
    if len(quiet_walls) == len(rows):
        load = ""
    else:
        load = " (of the quiet runs; the others not quiet)" if quiet_walls else " (no run quiet)"
    worst = min(rows, key=lambda row: row["best"])
    where = {(row.get("processor", "?"), row.get("date", "?")) for row in rows}
    print(
        f"\n{passed} of {len(rows)} seeds reach {threshold:g}, the worst seed's best window "
        f"{worst['best']:,.{decimals}f} (seed {worst['seed']}); wall time {min(walls):.0f}-{max(walls):.0f} s"
        + load
        + ", "
        + ("all seeds in one process" if "seeds_in_the_process" in rows[0] else "one run at a time")
        + ", on "
        + "; ".join(f"{cpu} ({date})" for cpu, date in sorted(where))
    )


def draw(algorithm: str, env_id: str, rows: list[dict]):
    threshold, _, _ = THRESHOLDS[env_id]
    figure, axis = plt.subplots(figsize=(7, 3.6))
    for row in rows:
        steps, values = row["curve"]
        axis.plot(steps, values, linewidth=1.2, label=f"seed {row['seed']}")
    axis.axhline(threshold, linestyle="--", color="black", linewidth=1, label=f"{threshold:g}")
    axis.set_xlabel("environment steps")
    axis.set_ylabel(TAG)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="best")
    axis.set_title(f"{algorithm}: the README command on {env_id}, {len(rows)} seeds, 2-core CPU", fontsize=10)
    figure.tight_layout()
    save(figure, f"static/readme_{re.sub(r'[^A-Za-z0-9._-]', '_', algorithm)}_seeds.png")


def main(args: Args):
    unknown = sorted(a for a in args.algorithms if a.split("@")[0] not in SCRIPTS)
    if unknown:
        fail(f"--algorithms: unknown {unknown}; expected any of {list(SCRIPTS)} (or ALGORITHM@ENV_ID)")
    if not args.seeds or not all(0 <= seed <= MAX_SEED for seed in args.seeds):
        fail(f"--seeds must be one or more seeds in [0, {MAX_SEED}], got {args.seeds}")
    if args.one_process:
        sebulba = [name for name in args.algorithms if not name.split("@")[0].endswith("anakin")]
        if sebulba:
            fail(f"--one-process: {sebulba} run a Sebulba script; only the Anakin scripts train seeds in one process")
        if args.seeds != list(range(args.seeds[0], args.seeds[0] + len(args.seeds))):
            fail(f"--one-process needs consecutive --seeds (one program trains seeds S .. S + N - 1), got {args.seeds}")
    commands = readme_commands(args.readme)
    missing = [a for a in args.algorithms if a not in commands]
    if missing:
        fail(f"--readme: {args.readme} has no command for {missing} (it has {list(commands)})")
    for name in args.algorithms:
        extra = shlex.split(args.extra_flags)
        command = " ".join([commands[name], *extra])
        algorithm = name if not extra else f"{name}+{'_'.join(extra).lstrip('-')}"
        if args.xla_cpu_max_isa:
            algorithm += f"+isa_{args.xla_cpu_max_isa}"
        if args.one_process:
            algorithm += "+one_process"
        records: dict[int, dict] = {}
        if args.table_only:
            for record in read_records(args.results, "--results", keys=("algorithm", "seed", "command")):
                if record["algorithm"] == algorithm and record["seed"] in args.seeds and record["command"] == command:
                    records[record["seed"]] = record  # the newest line of a seed counts
        elif args.one_process:
            records = run_seeds_in_one_process(algorithm, command, args.seeds, args.xla_cpu_max_isa)
            with open(args.results, "a") as results:
                results.writelines(json.dumps(record) + "\n" for record in records.values())
        else:
            for seed in args.seeds:
                records[seed] = run_seed(algorithm, command, seed, args.xla_cpu_max_isa)
                with open(args.results, "a") as results:
                    results.write(json.dumps(records[seed]) + "\n")
        if not records:
            fail(f"--results: {args.results} has no run of {algorithm}'s current README command")
        env_id = env_id_of(command)
        rows = summarize(env_id, records)
        print_table(algorithm, env_id, rows)
        draw(algorithm, env_id, rows)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
