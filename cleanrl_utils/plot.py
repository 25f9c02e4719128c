"""Learning curves of Cleanba runs from their TensorBoard files: one line per run (seed), their mean and
spread, optional reference lines; prints each run's final value and final SPS.

    python -m cleanrl_utils.plot --runs runs/a runs/b runs/c --output static/curve.png \\
        --title "HalfCheetah-v4" --references "CleanRL PPO at 1M steps=1442.64"
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tyro


@dataclass
class Args:
    runs: list[str]
    """the run folders (runs/{run_name}), one per seed"""
    output: str
    """the PNG to write"""
    tag: str = "charts/avg_episodic_return"
    """the scalar to plot against the environment steps"""
    title: str = ""
    """the figure's title (say which hardware the runs ran on)"""
    ylabel: str = "average episodic return"
    """the y-axis label"""
    references: list[str] = field(default_factory=list)
    """horizontal reference lines, each "label=value" (e.g. a published result)"""
    final_window: int = 10
    """a run's final value: the mean of its last this many logged values"""


def read_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run's TensorBoard event files: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def main(args: Args) -> int:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    curves, finals = [], []
    for run in args.runs:
        scalars = read_scalars(run)
        if args.tag not in scalars:
            print(f"error: --runs: {run} has no scalar {args.tag!r}", file=sys.stderr)
            return 2
        steps, values = map(np.asarray, zip(*scalars[args.tag]))
        curves.append((steps, values))
        finals.append(values[-args.final_window:].mean())
        print(f"{run}: final {args.tag} {finals[-1]:.1f} (mean of the last {min(args.final_window, len(values))} "
              f"logged values, last step {steps[-1]}), final SPS {scalars['charts/SPS'][-1][1]:.0f}")
    print(f"{len(finals)} runs: final {args.tag} mean {np.mean(finals):.1f}, std {np.std(finals):.1f}, "
          f"min {np.min(finals):.1f}, max {np.max(finals):.1f}")

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for run, (steps, values) in zip(args.runs, curves):
        axes.plot(steps, values, linewidth=0.8, alpha=0.6, label=Path(run).name)
    if len(curves) > 1:  # the runs' mean and min-max band on a common grid of steps
        grid = np.linspace(max(s[0] for s, _ in curves), min(s[-1] for s, _ in curves), 200)
        on_grid = np.array([np.interp(grid, steps, values) for steps, values in curves])
        axes.fill_between(grid, on_grid.min(0), on_grid.max(0), color="black", alpha=0.1, linewidth=0)
        axes.plot(grid, on_grid.mean(0), color="black", linewidth=2, label=f"mean of {len(curves)} runs, band min-max")
    for reference in args.references:
        label, value = reference.rsplit("=", 1)
        axes.axhline(float(value), linestyle="--", color="tab:red", linewidth=1.2, label=label)
    axes.set_xlabel("environment steps")
    axes.set_ylabel(args.ylabel)
    axes.set_title(args.title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="lower right")
    figure.savefig(args.output, dpi=120, bbox_inches="tight")
    print(f"figure written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
