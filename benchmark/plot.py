"""The figures of the docs (docs/, static/), drawn from the TensorBoard event files the runs wrote into runs/.

    # learning curves: one row per --tags entry, against env steps (left) and wall time (right);
    # a line is the mean over seeds, the band the spread (min to max)
    uv run python benchmark/plot.py curves --env-id CartPole-v1 --exp-names ppo_cartpole impala_cartpole \\
        --labels PPO IMPALA --output static/ppo_vs_impala.png
    # the same for explicit run folders (the seeds of one experiment), with a published result as a reference line
    uv run python benchmark/plot.py curves --runs runs/a runs/b runs/c --labels "Sebulba PPO" \
        --references "CleanRL at 1M steps=1442.64" --title "HalfCheetah-v4, 2-core CPU" --output static/curve.png
    # throughput: one bar per experiment (device layout), the final charts/SPS, mean and min..max over seeds
    uv run python benchmark/plot.py sps --env-id CartPole-v1 --exp-names sps_a0-l0 sps_a0-l1 --output static/sps.png
    # one panel per run (one env family each), with each env's random-policy return as a dashed line
    uv run python benchmark/plot.py panels --runs runs/a runs/b --labels A B --baselines 0.2 0.9 --output static/f.png

Runs are found by their default name {env_id}__{exp_name}__{seed}__{unix time}; for a seed run more than
once, the newest run counts. Wall time counts from the run's first event (written when the run starts
logging, after imports and device setup). `curves` also prints each experiment's final values per tag.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tool_helpers import find_runs, mean_and_spread, pyplot, read_run, save

from cleanrl_utils.cli import fail, run_cli

plt = pyplot()
import matplotlib.ticker  # noqa: E402 (after pyplot() has chosen the file-only backend)

HARDWARE = "2-core CPU (JAX on CPU)"


@dataclass
class Curves:
    """Learning curves: mean and spread over seeds, against env steps and against wall time."""

    output: str
    env_id: str = ""
    """with --exp-names: the env id in the run names"""
    exp_names: list[str] = field(default_factory=list)
    """the experiments, their runs found by run name in --runs-dir"""
    runs: list[str] = field(default_factory=list)
    """instead of --env-id/--exp-names: the run folders (runs/{run_name}) of one experiment, one per seed"""
    labels: list[str] = field(default_factory=list)
    """legend names of the experiments (default: the exp names; with --runs: the env id, else "runs")"""
    tags: list[str] = field(default_factory=lambda: ["charts/avg_episodic_return"])
    """the scalars to draw, one row each"""
    references: list[str] = field(default_factory=list)
    """horizontal lines in the first --tags row, each "label=value" (e.g. a published result)"""
    title: str = ""
    """the figure's title (default: "{env_id}, {hardware}")"""
    final_window: int = 10
    """a run's final value (printed): the mean of its last this many logged values"""
    runs_dir: str = "runs"
    hardware: str = HARDWARE
    """the machine, written in the default title"""


@dataclass
class Sps:
    """Throughput: the final charts/SPS (steps per second since the start, compilation included) per experiment."""

    env_id: str
    exp_names: list[str]
    output: str
    labels: list[str] = field(default_factory=list)
    """bar names (default: the exp names)"""
    runs_dir: str = "runs"
    hardware: str = HARDWARE


@dataclass
class Panels:
    """One panel per run (different envs, e.g. one per env family): its return against env steps, with a dashed
    line at the baseline given for it (e.g. a random policy's return)."""

    runs: list[str]
    output: str
    labels: list[str] = field(default_factory=list)
    """panel titles, one per run (default: the run folder names)"""
    baselines: list[float] = field(default_factory=list)
    """one per run: drawn as a dashed "random policy" line"""
    title: str = ""
    hardware: str = HARDWARE


def run_folders(runs: list[str]) -> list[Path]:
    """--runs, each checked to be a run folder (its TensorBoard events in it) before anything is drawn."""
    for run in runs:
        if not Path(run).is_dir():
            fail(f"--runs: {run} is not a directory")
        if not any(Path(run).glob("events.out.tfevents.*")):
            fail(f"--runs: {run} holds no TensorBoard events (events.out.tfevents.*): not a run folder")
    return [Path(run) for run in runs]


def experiment_runs(args: Curves) -> dict[str, list[Path]]:
    """label -> the run directories (one per seed) of each experiment: the --runs, or those of each --exp-names."""
    if bool(args.runs) == bool(args.exp_names):
        fail("give either --runs (run folders) or --env-id with --exp-names")
    if args.runs:
        labels = args.labels or [args.env_id or "runs"]
        if len(labels) != 1:
            fail(f"--labels needs one name for the --runs (the seeds of one experiment), got {len(labels)}")
        return {labels[0]: run_folders(args.runs)}
    if not args.env_id:
        fail("--exp-names needs --env-id (runs are found by the name {env_id}__{exp_name}__{seed}__{time})")
    labels = args.labels or args.exp_names
    if len(labels) != len(args.exp_names):
        fail(f"--labels needs one name per --exp-names entry ({len(args.exp_names)}), got {len(labels)}")
    if len(set(labels)) != len(labels):
        fail(f"--labels must differ from each other, got {labels}")
    return {
        label: list(find_runs(args.runs_dir, args.env_id, exp_name).values())
        for exp_name, label in zip(args.exp_names, labels)
    }


def parse_references(references: list[str]) -> list[tuple[str, float]]:
    parsed = []
    for reference in references:
        label, _, value = reference.rpartition("=")
        try:
            parsed.append((label, float(value)))
        except ValueError:
            fail(f'--references takes "label=value" with a number as value, got {reference!r}')
        if not label:
            fail(f'--references takes "label=value" with a non-empty label, got {reference!r}')
    return parsed


def plot_curves(args: Curves):
    runs = experiment_runs(args)
    references = parse_references(args.references)
    if args.final_window < 1:
        fail(f"--final-window must be at least 1, got {args.final_window}")
    figure, axes = plt.subplots(len(args.tags), 2, figsize=(11, 0.4 + 3.1 * len(args.tags)), squeeze=False)
    finals = []  # (label, tag, the final value of each seed)
    for row, tag in enumerate(args.tags):
        for (label, run_dirs), color in zip(runs.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
            series = [read_run(path, tag) for path in run_dirs]
            finals.append((label, tag, [values[-args.final_window :].mean() for _, _, values in series]))
            seeds = len(series)
            for column, x_index in enumerate([0, 1]):  # env steps, wall time
                axis = axes[row][column]
                if seeds == 1:
                    axis.plot(series[0][x_index], series[0][2], color=color, label=f"{label} (1 seed)")
                    continue
                grid, mean, low, high = mean_and_spread([s[x_index] for s in series], [s[2] for s in series])
                axis.plot(grid, mean, color=color, label=f"{label} ({seeds} seeds: mean, min-max)")
                axis.fill_between(grid, low, high, color=color, alpha=0.2, linewidth=0)
        for (label, value), color in zip(references if row == 0 else [], ["tab:red", "tab:purple", "tab:brown"] * 9):
            for axis in axes[row]:
                axis.axhline(value, linestyle="--", color=color, linewidth=1.2, label=label)
        for column, xlabel in enumerate(["environment steps", "wall time (s)"]):
            axes[row][column].set_xlabel(xlabel)
            axes[row][column].set_ylabel(tag)
            axes[row][column].grid(alpha=0.3)
        axes[row][0].legend(loc="best", fontsize=8)
    figure.suptitle(args.title or ", ".join(filter(None, [args.env_id, args.hardware])))
    figure.tight_layout()
    save(figure, args.output)
    print(
        f"| experiment | scalar | final value per seed (mean of the last {args.final_window} logged) "
        "| mean | std | min - max |\n|---|---|---|---|---|---|"
    )
    for label, tag, values in finals:
        print(
            f"| {label.replace(chr(10), ' ')} | {tag} | {', '.join(f'{v:,.1f}' for v in values)} "
            f"| {np.mean(values):,.1f} | {np.std(values):,.1f} | {min(values):,.1f} - {max(values):,.1f} |"
        )


def plot_sps(args: Sps):
    labels = args.labels or args.exp_names
    if len(labels) != len(args.exp_names):
        fail(f"--labels needs one name per --exp-names entry ({len(args.exp_names)}), got {len(labels)}")
    rows = []
    for exp_name, label in zip(args.exp_names, labels):
        finals = [
            read_run(path, "charts/SPS")[2][-1] for path in find_runs(args.runs_dir, args.env_id, exp_name).values()
        ]
        rows.append((label, np.mean(finals), np.min(finals), np.max(finals), len(finals)))
    figure, axis = plt.subplots(figsize=(8, 3.8))
    positions = np.arange(len(rows))
    means = np.array([row[1] for row in rows])
    errors = np.array([[row[1] - row[2] for row in rows], [row[3] - row[1] for row in rows]])
    axis.bar(positions, means, yerr=errors, capsize=4, color="tab:blue", alpha=0.8)
    for position, mean in zip(positions, means):
        axis.text(position, mean * 0.5, f"{mean:,.0f}", ha="center", color="white", fontweight="bold")
    axis.set_xticks(positions, [row[0] for row in rows])
    axis.set_ylabel("steps per second (SPS)")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title(
        f"{args.env_id} throughput by device layout, {args.hardware}\n"
        f"(final SPS since the start of each run; bars: mean of {rows[0][4]} seeds, whiskers: min-max)",
        fontsize=10,
    )
    figure.tight_layout()
    save(figure, args.output)
    print("| layout | SPS (mean) | min - max | seeds |\n|---|---|---|---|")
    for label, mean, low, high, seeds in rows:
        print(f"| {label.replace(chr(10), ' ')} | {mean:,.0f} | {low:,.0f} - {high:,.0f} | {seeds} |")


def plot_panels(args: Panels):
    runs = run_folders(args.runs)
    labels = args.labels or [run.name for run in runs]
    if len(labels) != len(args.runs) or (args.baselines and len(args.baselines) != len(args.runs)):
        fail(f"--labels and --baselines need one entry per --runs entry ({len(args.runs)})")
    figure, axes = plt.subplots(1, len(args.runs), figsize=(3.6 * len(args.runs), 3.4), squeeze=False)
    print("| run | final return (mean of the last 5 logged) | random policy | env steps |\n|---|---|---|---|")
    for index, (run, label, axis) in enumerate(zip(runs, labels, axes[0])):
        steps, _, values = read_run(run, "charts/avg_episodic_return")
        axis.plot(steps, values, color="tab:blue", label="Sebulba agent")
        baseline = args.baselines[index] if args.baselines else None
        if baseline is not None:
            axis.axhline(baseline, linestyle="--", color="tab:red", linewidth=1.2, label="random policy")
        axis.set_title(label, fontsize=9)
        axis.set_xlabel("environment steps")
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:g}k"))  # no overlap
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize=7)
        baseline_cell = "" if baseline is None else f"{baseline:,.3f}"
        print(f"| {label} | {values[-5:].mean():,.3f} | {baseline_cell} | {steps[-1]:,} |")
    axes[0][0].set_ylabel("charts/avg_episodic_return")
    figure.suptitle(args.title or args.hardware)
    figure.tight_layout()
    save(figure, args.output)


def main(args: Curves | Sps | Panels):
    {Curves: plot_curves, Sps: plot_sps, Panels: plot_panels}[type(args)](args)


if __name__ == "__main__":
    sys.exit(run_cli(main, Curves | Sps | Panels))
