"""The study's comparison of policy losses (Andrychowicz et al. 2021) at CPU scale: the configurable on-policy script
with each --policy-loss on HalfCheetah-v4 and Hopper-v4, 1M steps, seeds 1-3, everything else at its defaults.

    uv run python benchmark/onpolicy_losses.py                      # 30 runs, one at a time (about 45 min here)
    uv run python benchmark/onpolicy_losses.py --losses ppo --seeds 1 --env-ids Hopper-v4
    uv run python benchmark/onpolicy_losses.py --table-only         # the table and figure from --results
    # the learning test's command (tests/test_onpolicy.py), seeds 1-3 of every loss
    uv run python benchmark/onpolicy_losses.py --env-ids InvertedPendulum-v4 --total-timesteps 40960 \
        --flags="--num-actor-threads 1 --local-num-envs 8 --num-steps 128 --num-minibatches 16 --actor-device-ids 0
        --learner-device-ids 1 --log-frequency 5 --checkpoint-frequency 0" \
        --results benchmark/results/onpolicy_inverted_pendulum.jsonl --output static/onpolicy_inverted_pendulum.png

Each run is `--seed S --env-id E --policy-loss L --exp-name onpolicy_L` with the script's defaults, except --flags
(default: one actor thread of 8 envs, the same 2048-step batch as the defaults' 2 threads x 4 envs with one busy
thread per core here; a0-l1; every update logged). A run's final return is the mean of its last 10 logged
`charts/avg_episodic_return` (with every update logged, the last 20,480 env steps). Each run appends a JSON line to
--results; the Markdown table (mean and std over seeds per loss and env) is printed and the figure (mean over seeds,
min-max band) is written to --output, with CleanRL's published ppo_continuous_action returns at 1M steps as
reference lines (HalfCheetah-v4, Hopper-v4).
"""

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).parent))
from plot import find_runs, mean_and_spread, plt, read_run, save  # noqa: E402

SCRIPT = "cleanba/cleanba_onpolicy_continuous_action_envpool_mujoco.py"
LOSSES = ["vpg", "ppo", "vtrace", "awr", "vmpo"]
# CleanRL's docs, PPO page, ppo_continuous_action MuJoCo v4 table (openrlbenchmark tag pr-424): 1M steps
CLEANRL_PPO = {"HalfCheetah-v4": (1442.64, 46.03), "Hopper-v4": (2382.86, 271.74)}
FINAL_WINDOW = 10
LAYOUT = "--num-actor-threads 1 --local-num-envs 8 --actor-device-ids 0 --learner-device-ids 1 --log-frequency 1"


@dataclass
class Args:
    env_ids: list[str] = field(default_factory=lambda: list(CLEANRL_PPO))
    losses: list[str] = field(default_factory=lambda: list(LOSSES))
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    total_timesteps: int = 1_000_000
    flags: str = f"{LAYOUT} --checkpoint-frequency 0"
    """the script's other flags, one string"""
    results: str = "benchmark/results/onpolicy_losses.jsonl"
    output: str = "static/onpolicy_losses.png"
    table_only: bool = False


def run_one(env_id: str, loss: str, seed: int, total_timesteps: int, flags: str) -> dict:
    command = [
        *("uv", "run", "python", SCRIPT, "--env-id", env_id, "--policy-loss", loss, "--seed", str(seed)),
        *("--exp-name", f"onpolicy_{loss}", "--total-timesteps", str(total_timesteps), *flags.split()),
    ]
    started = time.time()
    completed = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - started
    if completed.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{completed.stderr[-3000:]}")
    run_dir = find_runs("runs", env_id, f"onpolicy_{loss}")[seed]
    _, _, returns = read_run(run_dir, "charts/avg_episodic_return")
    return {
        "env_id": env_id,
        "loss": loss,
        "seed": seed,
        "final_return": float(returns[-FINAL_WINDOW:].mean()),
        "best_return": float(returns.max()),
        "last_return": float(returns[-1]),
        "wall_s": round(wall, 1),
        "run_dir": str(run_dir),
        "machine": platform.processor() or platform.machine(),
    }


def table(records: list[dict], env_ids: list[str], losses: list[str]) -> str:
    lines = [
        "| policy loss | " + " | ".join(f"{env_id} (final, mean ± std over seeds)" for env_id in env_ids) + " |",
        "|---|" + "---|" * len(env_ids),
    ]
    for loss in losses:
        cells = []
        for env_id in env_ids:
            finals = [r["final_return"] for r in records if r["env_id"] == env_id and r["loss"] == loss]
            cells.append(f"{np.mean(finals):,.1f} ± {np.std(finals):,.1f} (n={len(finals)})" if finals else "-")
        lines.append(f"| {loss} | " + " | ".join(cells) + " |")
    if all(env_id in CLEANRL_PPO for env_id in env_ids):
        published = " | ".join(f"{m:,.2f} ± {s:,.2f}" for m, s in (CLEANRL_PPO[e] for e in env_ids))
        lines.append(f"| CleanRL ppo_continuous_action (published) | {published} |")
    return "\n".join(lines)


def figure(records: list[dict], env_ids: list[str], losses: list[str], output: str):
    fig, axes = plt.subplots(1, len(env_ids), figsize=(6 * len(env_ids), 4.2), squeeze=False)
    for ax, env_id in zip(axes[0], env_ids):
        for loss in losses:
            runs = [Path(r["run_dir"]) for r in records if r["env_id"] == env_id and r["loss"] == loss]
            if not runs:
                continue
            series = [read_run(run, "charts/avg_episodic_return") for run in runs]
            grid, mean, low, high = mean_and_spread([s[0] for s in series], [s[2] for s in series])
            (line,) = ax.plot(grid, mean, label=f"{loss} ({len(runs)} seeds)")
            ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.15)
        if env_id in CLEANRL_PPO:
            published = CLEANRL_PPO[env_id][0]
            ax.axhline(
                published, color="black", linestyle="--", linewidth=1, label=f"CleanRL PPO at 1M ({published:g})"
            )
        ax.set(title=env_id, xlabel="env steps", ylabel="average episodic return")
        ax.legend(fontsize=8)
    fig.suptitle("Policy losses of the configurable on-policy agent\n(2-core CPU; mean over seeds, band: min-max)")
    fig.tight_layout()
    save(fig, output)


def main(args: Args):
    results = Path(args.results)
    if not args.table_only:
        results.parent.mkdir(parents=True, exist_ok=True)
        for env_id in args.env_ids:
            for loss in args.losses:
                for seed in args.seeds:
                    record = run_one(env_id, loss, seed, args.total_timesteps, args.flags)
                    print(json.dumps(record), flush=True)
                    with results.open("a") as file:
                        file.write(json.dumps(record) + "\n")
    records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    # the newest record of each (env, loss, seed)
    records = list({(r["env_id"], r["loss"], r["seed"]): r for r in records}.values())
    print(table(records, args.env_ids, args.losses))
    figure(records, args.env_ids, args.losses, args.output)


if __name__ == "__main__":
    main(tyro.cli(Args))
