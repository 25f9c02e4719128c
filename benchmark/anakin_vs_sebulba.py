"""Anakin and Sebulba side by side on the same MiniGrid task and machine, then Anakin's throughput as it grows.

    uv run python benchmark/anakin_vs_sebulba.py --seeds 1 2 3

1. **Side by side**: the README's two MiniGrid-Empty-5x5 commands (Sebulba PPO on envpool's
   MiniGrid-Empty-5x5-v0, Anakin PPO on xminigrid's MiniGrid-Empty-5x5: the same PPO, network and hyperparameters,
   1,024 env steps per update), with --side-total-timesteps, and the Sebulba one again with --no-concurrency (lag
   0, as Anakin), each seed one after the other: the steady SPS (env steps per second between the 5th and the
   last update, compilation left out), the wall time from process start to the first update from which the mean
   of 5 logged average returns reaches --target (the first few episodes to end are the short, successful ones:
   a single logged value can reach it by luck), and the whole run's wall time.
2. **Scaling**: Anakin's steady SPS with 64 ... 4096 envs per device (--num-steps 32, --envs-updates updates each),
   on one host device and on two (`--learner-device-ids 0 1`, the envs per device kept: twice the envs), on
   MiniGrid-Empty-5x5 or, with --scaling-env-id, on another family's env (the same PPO and MLP), e.g.
   `--parts scaling --scaling-env-id Craftax-Classic-Symbolic-v1 --envs-per-device 1024 --devices 1`.

One run at a time, so the numbers are a quiet machine's. On a CPU the ratios are the claim, not the absolute SPS
(the two host devices share the same cores). Every run appends a JSON line to --results; the tables are printed
(Markdown, for docs/studies/anakin_vs_sebulba.md) and the figure is written to static/anakin_vs_sebulba.png.
`--table-only` prints and draws from --results.
"""

import json
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tool_helpers import pyplot, read_records, read_run, readme_training_commands, save

from cleanrl_utils.cli import fail, run_cli

plt = pyplot()

SEBULBA, ANAKIN = "cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py", "cleanba/cleanba_ppo_anakin.py"
# name -> (script, flags added to its README command): Sebulba as the README runs it (the actor one policy version
# behind), Sebulba with lag 0 (the actor waits for the newest params, as Anakin's always are), Anakin
ARCHITECTURES = {
    "Sebulba": (SEBULBA, []),
    "Sebulba --no-concurrency": (SEBULBA, ["--no-concurrency"]),
    "Anakin": (ANAKIN, []),
}
SUSTAINED = 5  # the time to a return: the first logged update from which the mean of 5 logged updates reaches it
TASK = "MiniGrid-Empty-5x5"  # envpool's id adds -v0
SCALING_FLAGS = "--num-steps 32 --num-minibatches 4 --update-epochs 4 --learning-rate 1e-3 --hiddens 64 64"
STEADY_FROM_UPDATE = 5  # the steady SPS counts from the 5th update's log: compilation and warm-up are before it


@dataclass
class Args:
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    """seeds of the side-by-side runs"""
    target: float = 0.9
    """the average return both architectures are timed to (the best on MiniGrid-Empty-5x5 is 0.955)"""
    envs_per_device: list[int] = field(default_factory=lambda: [64, 256, 1024, 4096])
    """Anakin's --local-num-envs values of the scaling runs"""
    envs_updates: int = 20
    """updates of each scaling run"""
    devices: list[int] = field(default_factory=lambda: [1, 2])
    """numbers of host devices of the scaling runs"""
    scaling_env_id: str = TASK
    """the Anakin script's --env-id of the scaling runs (any family: MiniGrid-Empty-5x5, minatar-breakout,
    Craftax-Classic-Symbolic-v1, ...; the figure draws MiniGrid's)"""
    results: str = "benchmark/results/anakin_vs_sebulba.jsonl"
    readme: str = "README.md"
    side_total_timesteps: int = 122_880
    """--total-timesteps of the side-by-side runs (120 updates: Sebulba, one version behind, needs about 100k)"""
    parts: list[str] = field(default_factory=lambda: ["side", "scaling"])
    """which measurements to run (side, scaling); the tables show the newest recorded run of every point"""
    table_only: bool = False


def readme_command(readme: str, script: str) -> str:
    for command in readme_training_commands(readme):
        if script in command and TASK in command:
            return command
    fail(f"--readme: {readme} has no {TASK} command of {script}")


def run(argv: list[str], workdir: Path, run_name: str) -> dict:
    """One run, as a user starts it; its wall time, steady SPS and return curve (seconds from process start)."""
    print(f"running: {shlex.join(argv)}", flush=True)
    shutil.rmtree(workdir / "runs" / run_name, ignore_errors=True)  # a run of an earlier benchmark: not resumed
    start = time.time()
    process = subprocess.run([*argv, "--run-name", run_name], capture_output=True, text=True, cwd=workdir)
    wall = time.time() - start
    if process.returncode != 0:
        fail(f"{run_name} exited with {process.returncode}: {process.stderr[-2000:]}")
    run_dir = workdir / "runs" / run_name
    steps, seconds, _ = read_run(run_dir, "charts/SPS", since=start)
    first = STEADY_FROM_UPDATE - 1 if len(steps) > STEADY_FROM_UPDATE else 0
    steady_sps = (steps[-1] - steps[first]) / (seconds[-1] - seconds[first])
    return_steps, return_seconds, returns = read_run(run_dir, "charts/avg_episodic_return", since=start)
    return {
        "command": shlex.join(argv),
        "wall_s": round(wall, 2),
        "steady_sps": round(float(steady_sps)),
        "curve": [return_steps.tolist(), return_seconds.round(3).tolist(), returns.tolist()],
    }


def reached(record: dict, target: float) -> tuple[float, int] | None:
    """(seconds from process start, env steps) at the first logged update from which the mean of SUSTAINED logged
    average returns is at least `target`."""
    steps, seconds, returns = (np.array(x) for x in record["curve"])
    means = np.convolve(returns, np.ones(SUSTAINED) / SUSTAINED, mode="valid")
    hits = np.flatnonzero(means >= target)
    return None if len(hits) == 0 else (float(seconds[hits[0]]), int(steps[hits[0]]))


def side_by_side_table(records: list[dict], target: float):
    print(f"\n{TASK}, the README's commands: seeds one after the other ({platform.machine()}, one run at a time)")
    print(f"| run | seed | steady SPS | wall time to return {target:g} (env steps) | whole run |")
    print("|---|---|---|---|---|")
    for record in records:
        hit = reached(record, target)
        to_target = "never" if hit is None else f"{hit[0]:.1f} s ({hit[1]:,})"
        print(
            f"| {record['architecture']} | {record['seed']} | {record['steady_sps']:,} | {to_target} "
            f"| {record['wall_s']:.1f} s |"
        )
    for name in ARCHITECTURES:
        rows = [r for r in records if r["architecture"] == name]
        hits = [reached(r, target) for r in rows]
        times = [h[0] for h in hits if h is not None]
        print(
            f"{name}: median steady SPS {np.median([r['steady_sps'] for r in rows]):,.0f}, median time to "
            f"{target:g} {np.median(times) if times else float('nan'):.1f} s ({len(times)} of {len(rows)} seeds), "
            f"median run {np.median([r['wall_s'] for r in rows]):.1f} s"
        )
    median_sps = {n: np.median([r["steady_sps"] for r in records if r["architecture"] == n]) for n in ARCHITECTURES}
    print(f"Anakin / Sebulba steady SPS: {median_sps['Anakin'] / median_sps['Sebulba']:.2f}x")


def scaling_table(records: list[dict], env_id: str):
    print(f"\nAnakin's steady SPS on {env_id} ({SCALING_FLAGS}), {platform.machine()}, one run at a time")
    devices = sorted({r["devices"] for r in records})
    print("| envs per device | " + " | ".join(f"{d} host device{'s' * (d > 1)}" for d in devices) + " |")
    print("|---" * (len(devices) + 1) + "|")
    for envs in sorted({r["envs_per_device"] for r in records}):
        cells = []
        for d in devices:
            row = [r for r in records if r["envs_per_device"] == envs and r["devices"] == d]
            cells.append(f"{row[-1]['steady_sps']:,} ({envs * d:,} envs)" if row else "-")
        print(f"| {envs:,} | " + " | ".join(cells) + " |")


def draw(side: list[dict], scaling: list[dict], target: float):
    figure, (curves, sps) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {"Sebulba": "tab:blue", "Sebulba --no-concurrency": "tab:green", "Anakin": "tab:orange"}
    for record in side:
        _, seconds, returns = record["curve"]
        label = record["architecture"] if record["seed"] == side[0]["seed"] else None
        curves.plot(seconds, returns, color=colors[record["architecture"]], linewidth=1.2, label=label)
    curves.axhline(target, linestyle="--", color="black", linewidth=1, label=f"{target:g}")
    curves.set_xlabel("seconds from process start (compilation included)")
    curves.set_ylabel("charts/avg_episodic_return")
    curves.set_title(f"{TASK}, the README's commands, {len({r['seed'] for r in side})} seeds each", fontsize=10)
    curves.legend(fontsize=8)
    for d in sorted({r["devices"] for r in scaling}):
        rows = sorted((r for r in scaling if r["devices"] == d), key=lambda r: r["envs_per_device"])
        sps.plot([r["envs_per_device"] for r in rows], [r["steady_sps"] for r in rows], marker="o", label=f"{d} dev")
    sebulba = [r["steady_sps"] for r in side if r["architecture"] == "Sebulba"]
    if sebulba:
        sps.axhline(np.median(sebulba), linestyle=":", color=colors["Sebulba"], label="Sebulba, README command")
    sps.set_xscale("log", base=2)
    sps.set_yscale("log")
    sps.set_xlabel("Anakin: envs per device (--local-num-envs)")
    sps.set_ylabel("steady env steps per second")
    sps.set_title(f"Anakin's throughput, {platform.machine()} CPU (host devices share its cores)", fontsize=10)
    sps.legend(fontsize=8)
    for axis in (curves, sps):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    save(figure, "static/anakin_vs_sebulba.png")


def main(args: Args):
    for name, values in [("--seeds", args.seeds), ("--envs-per-device", args.envs_per_device)]:
        if not values or min(values) < (0 if name == "--seeds" else 1):
            fail(f"{name} must be one or more {'non-negative' if name == '--seeds' else 'positive'} integers")
    if not args.devices or min(args.devices) < 1 or args.envs_updates < STEADY_FROM_UPDATE + 1:
        fail(f"--devices must be positive and --envs-updates at least {STEADY_FROM_UPDATE + 1}")
    unknown = sorted(set(args.parts) - {"side", "scaling"})
    if unknown:
        fail(f"--parts: unknown {unknown}; expected side and/or scaling")
    workdir = Path("benchmark/results/anakin_vs_sebulba_runs")
    records = []
    if not args.table_only and "side" in args.parts:
        workdir.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            for name, (script, extra) in ARCHITECTURES.items():
                command = shlex.split(readme_command(args.readme, script).replace("uv run python ", ""))
                argv = [sys.executable, str(Path(command[0]).resolve()), *command[1:], *extra]
                argv += ["--total-timesteps", str(args.side_total_timesteps), "--seed", str(seed)]
                run_name = f"{name.replace(' --', '-')}-{seed}"
                records.append({"part": "side", "architecture": name, "seed": seed, **run(argv, workdir, run_name)})
    if not args.table_only and "scaling" in args.parts:
        workdir.mkdir(parents=True, exist_ok=True)
        for devices in args.devices:
            for envs in args.envs_per_device:
                flags = [*shlex.split(SCALING_FLAGS), "--local-num-envs", str(envs), "--checkpoint-frequency", "0"]
                flags += ["--total-timesteps", str(envs * devices * 32 * args.envs_updates), "--log-frequency", "5"]
                flags += ["--learner-device-ids", *map(str, range(devices))]
                argv = [sys.executable, str(Path(ANAKIN).resolve()), "--env-id", args.scaling_env_id, *flags]
                result = run(argv, workdir, f"scaling-{args.scaling_env_id}-{envs}-{devices}")
                point = {"envs_per_device": envs, "devices": devices, "env_id": args.scaling_env_id}
                records.append({"part": "scaling", **point, **result})
    if records:  # --table-only reads --results: a missing one is an error, not created empty
        with open(args.results, "a") as results:
            for record in records:
                results.write(json.dumps(record) + "\n")
    records = read_records(args.results, "--results", keys=("part",))
    # the newest run of each seed and of each scaling point counts
    key = lambda r: (r["part"], r.get("architecture"), r.get("seed"), r.get("envs_per_device"), r.get("devices"))
    newest = {(*key(r), r.get("env_id", TASK)): r for r in records}  # the scaling runs before --scaling-env-id: TASK
    side = [r for r in newest.values() if r["part"] == "side" and r["seed"] in args.seeds]
    scaling = [r for r in newest.values() if r["part"] == "scaling" and r.get("env_id", TASK) == TASK]
    if not side or not scaling:
        fail(f"--results: {args.results} holds no side-by-side or no scaling runs")
    side_by_side_table(side, args.target)
    scaling_table(scaling, TASK)
    if args.scaling_env_id != TASK:
        scaling_table([r for r in newest.values() if r.get("env_id") == args.scaling_env_id], args.scaling_env_id)
    draw(side, scaling, args.target)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
