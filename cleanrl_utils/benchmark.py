"""Run one training command over env ids x seeds: on local workers, or as a Slurm job array.

    python -m cleanrl_utils.benchmark --env-ids CartPole-v1 Acrobot-v1 --num-seeds 3 --workers 2 \\
        --command "uv run python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --track"

Each run is `{command} --env-id {env_id} --seed {seed}`. Every command is printed. Locally, a failed
run is reported with its command and exit code, the other runs go on, and the tool exits non-zero at
the end. With --slurm-template-path the sweep becomes one job array (one array task per run; each
task has --slurm-ntasks tasks over --slurm-nodes nodes, started by srun: one jax.distributed process
each). W&B runs are tagged with the git commit (WANDB_TAGS).

The tools of benchmark/ have their shared helpers in benchmark/tool_helpers.py.
"""

import os
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from cleanrl_utils.cli import fail, read_input, run_cli


@dataclass
class Args:
    env_ids: list[str] = field(default_factory=lambda: ["CartPole-v1"])
    """the ids of the environments to run"""
    command: str = "uv run python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py"
    """the training command; --env-id and --seed are appended"""
    num_seeds: int = 3
    """the number of seeds of each environment"""
    start_seed: int = 1
    """the first seed"""
    workers: int = 1
    """how many runs at once: local processes, or the job array's concurrency limit"""
    slurm_template_path: str | None = None
    """submit the sweep as a Slurm job array rendered from this template (e.g. cleanba.slurm_template)"""
    slurm_gpus_per_task: int = 1
    """GPUs per Slurm task (per jax.distributed process; 0: no GPU request, for CPU clusters)"""
    slurm_cpus_per_task: int = 8
    """CPUs per Slurm task"""
    slurm_ntasks: int = 1
    """Slurm tasks per run: jax.distributed processes (more than one needs --distributed in --command)"""
    slurm_nodes: int = 1
    """nodes per run"""
    slurm_partition: str | None = None
    """the partition (default: none written, so sbatch's own SBATCH_PARTITION or the cluster default applies)"""
    slurm_account: str | None = None
    """the account (default: none written, so SBATCH_ACCOUNT or the cluster default applies)"""
    slurm_job_name: str = "cleanba"
    """the job's name"""
    slurm_log_dir: str = "slurm"
    """where the rendered job script and the tasks' output go (relative paths: to the submit directory)"""
    slurm_dry_run: bool = False
    """render and print the job script, do not submit it"""


def run_commands(args: Args) -> list[str]:
    return [
        f"{args.command} --env-id {env_id} --seed {seed}"
        for seed in range(args.start_seed, args.start_seed + args.num_seeds)
        for env_id in args.env_ids
    ]


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def wandb_tags() -> str:
    """The user's WANDB_TAGS plus the git commit the runs are made from."""
    tags = [tag for tag in os.environ.get("WANDB_TAGS", "").split(",") if tag]
    commit = git_commit()
    return ",".join(tags + [commit] if commit else tags)


def run_locally(commands: list[str], workers: int) -> int:
    env = {**os.environ, "WANDB_TAGS": wandb_tags()}

    def run(command: str) -> tuple[str, int]:
        print(f"running: {command}", flush=True)
        return command, subprocess.run(shlex.split(command), env=env).returncode

    with ThreadPoolExecutor(max_workers=workers) as executor:
        results = list(executor.map(run, commands))
    failures = [(command, code) for command, code in results if code != 0]
    for command, code in failures:
        print(f"FAILED (exit code {code}): {command}", file=sys.stderr)
    print(f"{len(results) - len(failures)} of {len(results)} runs succeeded", flush=True)
    return 1 if failures else 0


def render_slurm_script(args: Args, template: str) -> str:
    """Fill the template's {{placeholders}}; every placeholder must be known and used."""
    seeds = range(args.start_seed, args.start_seed + args.num_seeds)
    runs = [(env_id, seed) for seed in seeds for env_id in args.env_ids]
    sbatch_extra = "".join(
        f"#SBATCH --{name}={value}\n"
        for name, value in [
            ("gpus-per-task", args.slurm_gpus_per_task),  # 0: a CPU cluster, where a GPU request is refused
            ("partition", args.slurm_partition),
            ("account", args.slurm_account),
        ]
        if value
    )
    values = {
        "job_name": args.slurm_job_name,
        "array": f"0-{len(runs) - 1}%{args.workers}",
        "nodes": str(args.slurm_nodes),
        "ntasks": str(args.slurm_ntasks),
        "cpus_per_task": str(args.slurm_cpus_per_task),
        "log_dir": args.slurm_log_dir,
        "sbatch_extra": sbatch_extra.rstrip("\n"),
        "env_ids": " ".join(shlex.quote(env_id) for env_id, _ in runs),
        "seeds": " ".join(str(seed) for _, seed in runs),
        "command": args.command,
        "wandb_tags": shlex.quote(wandb_tags()),
    }
    for name, value in values.items():
        placeholder = "{{" + name + "}}"
        if placeholder not in template:
            fail(f"--slurm-template-path: the template has no {placeholder}")
        template = template.replace(placeholder, value)
    if "{{" in template:
        fail(f"--slurm-template-path: unknown placeholder {template[template.index('{{') :].split('}}')[0]}}}}}")
    return template


def submit_slurm(args: Args) -> int:
    template = read_input(args.slurm_template_path, "--slurm-template-path", "a Slurm job script template")
    script = render_slurm_script(args, template)
    log_dir = Path(args.slurm_log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    script_path = log_dir / f"{args.slurm_job_name}_{int(time.time())}.slurm"
    script_path.write_text(script)
    print(f"job script: {script_path}\n{script}", flush=True)
    if args.slurm_dry_run:
        return 0
    if shutil.which("sbatch") is None:
        fail("--slurm-template-path: sbatch is not installed here (use --slurm-dry-run to only render the script)")
    return subprocess.run(["sbatch", str(script_path)]).returncode


def main(args: Args) -> int:
    for name in ["num_seeds", "workers", "slurm_gpus_per_task", "slurm_cpus_per_task", "slurm_ntasks", "slurm_nodes"]:
        least = 0 if name == "slurm_gpus_per_task" else 1
        if getattr(args, name) < least:
            kind = "a non-negative" if least == 0 else "a positive"
            fail(f"--{name.replace('_', '-')} must be {kind} integer, got {getattr(args, name)}")
    if not args.env_ids:
        fail("--env-ids needs at least one environment id")
    if args.slurm_template_path is not None:
        if not Path(args.slurm_template_path).is_file():
            fail(f"--slurm-template-path {args.slurm_template_path!r} is not a file")
        if args.slurm_ntasks > 1 and "--distributed" not in shlex.split(args.command):
            fail("--slurm-ntasks > 1 starts several processes per run: add --distributed to --command")
        if args.slurm_nodes > args.slurm_ntasks:
            fail(f"--slurm-nodes ({args.slurm_nodes}) must not exceed --slurm-ntasks ({args.slurm_ntasks})")
    commands = run_commands(args)
    for command in commands:
        print(command)
    if args.slurm_template_path is not None:
        return submit_slurm(args)
    return run_locally(commands, args.workers)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
