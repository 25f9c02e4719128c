"""cleanrl_utils.benchmark: local sweeps that survive failed runs, and Slurm job arrays from cleanba.slurm_template."""

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
from conftest import PPO_SCRIPT, REPO, load_script, script_env

TINY_CARTPOLE = (
    f"{sys.executable} {PPO_SCRIPT} --local-num-envs 4 --num-steps 16 --hiddens 8 --num-actor-threads 1 "
    "--total-timesteps 128"
)


def benchmark(flags: list[str], cwd, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cleanrl_utils.benchmark", *flags],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**script_env(env), "PYTHONPATH": str(REPO)},
    )


@pytest.mark.slow
def test_local_sweep_runs_every_command_and_reports_failures(workdir):
    result = benchmark(
        ["--env-ids", "CartPole-v1", "NotAnEnv-v0", "--num-seeds", "2", "--workers", "2", "--command", TINY_CARTPOLE],
        workdir,
    )
    assert result.returncode == 1
    for env_id in ["CartPole-v1", "NotAnEnv-v0"]:
        for seed in [1, 2]:
            assert f"running: {TINY_CARTPOLE} --env-id {env_id} --seed {seed}" in result.stdout
            if env_id == "NotAnEnv-v0":
                assert f"FAILED (exit code 2): {TINY_CARTPOLE} --env-id {env_id} --seed {seed}" in result.stderr
    assert "2 of 4 runs succeeded" in result.stdout
    runs = sorted(path.name.split("__")[0] + "__" + path.name.split("__")[2] for path in (workdir / "runs").iterdir())
    assert runs == ["CartPole-v1__1", "CartPole-v1__2"]  # the good runs finished despite the failing ones


def test_runs_are_tagged_with_the_git_commit(workdir):
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    show_tags = f"""{sys.executable} -c 'import os; print("TAGS=" + os.environ["WANDB_TAGS"])'"""
    result = benchmark(
        ["--env-ids", "CartPole-v1", "--num-seeds", "1", "--command", show_tags], REPO, env={"WANDB_TAGS": "mine"}
    )
    assert result.returncode == 0, result.stderr
    assert f"TAGS=mine,{commit}" in result.stdout


def render(workdir, extra_flags=()) -> tuple[subprocess.CompletedProcess, str]:
    result = benchmark(
        [
            "--env-ids",
            "CartPole-v1",
            "Breakout-v5",
            "--num-seeds",
            "2",
            "--start-seed",
            "3",
            "--workers",
            "3",
            "--command",
            "python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --distributed --learner-device-ids 1 2 3",
            "--slurm-template-path",
            str(REPO / "cleanba.slurm_template"),
            "--slurm-nodes",
            "2",
            "--slurm-ntasks",
            "4",
            "--slurm-gpus-per-task",
            "4",
            "--slurm-cpus-per-task",
            "12",
            "--slurm-log-dir",
            str(workdir / "slurm"),
            "--slurm-dry-run",
            *extra_flags,
        ],
        workdir,
    )
    scripts = list((workdir / "slurm").glob("*.slurm"))
    return result, scripts[0].read_text() if scripts else ""


def fake_slurm_commands(workdir, srun_exit_code: int = 0, preempt_time: str = "None"):
    """Stand-ins for srun (prints its command line, exits with `srun_exit_code`) and scontrol (shows a job with
    `preempt_time`, records a requeue): the rendered script's own logic, without a cluster (tests/test_slurm.py
    runs it on a real one)."""
    fake_bin = workdir / "bin"
    fake_bin.mkdir(exist_ok=True)
    (fake_bin / "srun").write_text(f'#!/bin/bash\necho "srun $*"\nexit {srun_exit_code}\n')
    (fake_bin / "scontrol").write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = show ]; then echo "JobId=$3 JobState=RUNNING PreemptTime={preempt_time}"; fi\n'
        f'if [ "$1" = requeue ]; then echo "requeue $2" >> {workdir}/requeued; fi\n'
    )
    for name in ["srun", "scontrol"]:
        (fake_bin / name).chmod(0o755)
    return fake_bin


def run_array_task(script_path, fake_bin, task_id: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script_path)],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PATH": f"{fake_bin}:{os.environ['PATH']}",
            "SLURM_JOB_NAME": "cleanba",
            "SLURM_JOB_ID": str(800 + task_id),
            "SLURM_ARRAY_TASK_ID": str(task_id),
            "SLURM_ARRAY_JOB_ID": "777",
            "SLURM_CPUS_PER_TASK": "12",
        },
    )


def test_slurm_template_renders_a_2_node_4_task_sweep(workdir):
    result, script = render(workdir)
    assert result.returncode == 0, result.stderr
    directives = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", script, flags=re.MULTILINE))
    assert directives == {
        "job-name": "cleanba",
        "array": "0-3%3",
        "nodes": "2",
        "ntasks": "4",
        "gpus-per-task": "4",
        "cpus-per-task": "12",
        "output": f"{workdir}/slurm/%x_%A_%a.out",
        "error": f"{workdir}/slurm/%x_%A_%a.err",
        "open-mode": "append",  # a requeued attempt appends to the log of the ones before
        "requeue": "",
    }
    assert "/home" not in script and "~" not in script and "{{" not in script
    script_path = workdir / "job.slurm"
    script_path.write_text(script)
    assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0
    # run each array task with a stand-in srun: every task starts the right run through srun
    fake_bin = fake_slurm_commands(workdir)
    expected = [("CartPole-v1", 3), ("Breakout-v5", 3), ("CartPole-v1", 4), ("Breakout-v5", 4)]
    for task_id, (env_id, seed) in enumerate(expected):
        task = run_array_task(script_path, fake_bin, task_id)
        assert task.returncode == 0, task.stderr
        # a stable run name per array task, so that a requeued task resumes its own run
        assert [line for line in task.stdout.splitlines() if line.startswith("srun ")] == [
            "srun python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py "
            f"--distributed --learner-device-ids 1 2 3 --env-id {env_id} --seed {seed} "
            f"--run-name {env_id}__cleanba__{seed}__777"
        ]
        assert f"job 777_{task_id} (restart 0) on " in task.stdout
    assert not (workdir / "requeued").exists()


@pytest.mark.parametrize(
    "exit_code, preempt_time, requeued",
    [(143, "2026-11-25T02:08:32", True), (143, "None", False), (1, "2026-11-25T02:08:32", False)],
    ids=["stopped-after-preemption", "stopped-by-scancel-or-time-limit", "failed"],
)
def test_the_job_requeues_itself_only_when_a_preempted_run_stopped_at_a_checkpoint(
    exit_code, preempt_time, requeued, workdir
):
    """Slurm records a job preempted with a grace time, that ends within it, as FAILED 143 and never requeues it:
    the script requeues itself when the run stopped on its signal (143) and the job shows a PreemptTime. A run that
    failed, or was stopped by scancel or a time limit, is not requeued."""
    result, script = render(workdir, ["--slurm-gpus-per-task", "0"])
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --gpus-per-task" not in script  # a CPU cluster: sbatch refuses a GPU request there
    script_path = workdir / "job.slurm"
    script_path.write_text(script)
    task = run_array_task(script_path, fake_slurm_commands(workdir, exit_code, preempt_time), 1)
    assert task.returncode == exit_code
    assert f"srun exited with code {exit_code}" in task.stdout
    if requeued:
        assert (workdir / "requeued").read_text() == "requeue 801\n"
        assert "job 777_1: preempted, requeued" in task.stdout
    else:
        assert not (workdir / "requeued").exists()


def test_partition_and_account_come_only_from_flags(workdir):
    result, script = render(workdir, ["--slurm-partition", "gpu", "--slurm-account", "rl-lab"])
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition=gpu\n" in script and "#SBATCH --account=rl-lab\n" in script


def test_several_tasks_need_a_distributed_command(workdir):
    result = benchmark(
        [
            "--command",
            "python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py",
            "--slurm-template-path",
            str(REPO / "cleanba.slurm_template"),
            "--slurm-ntasks",
            "2",
            "--slurm-dry-run",
        ],
        workdir,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: --slurm-ntasks > 1 starts several processes per run: add --distributed to --command"
    )


# ---------------------------------------------------------------- benchmark/readme_commands.py


def test_readme_commands_finds_every_algorithms_cpu_command_with_a_known_bar():
    sys.path.insert(0, str(REPO / "benchmark"))
    import readme_commands

    commands = readme_commands.readme_commands(str(REPO / "README.md"))
    assert sorted(name for name in commands if "@" not in name) == sorted(readme_commands.SCRIPTS)
    assert "ppo@MiniGrid-Empty-5x5-v0" in commands  # Sebulba's side of the Anakin comparison
    for name, command in commands.items():
        assert command.startswith(f"uv run python cleanba/{readme_commands.SCRIPTS[name.split('@')[0]]} "), command
        assert "--extra" not in command and "\\" not in command and "pip" not in command, command
        assert readme_commands.env_id_of(command) in readme_commands.THRESHOLDS, command


def written_values(flags: list[str]) -> dict[str, list]:
    """{field: its values} as a command's words write them: `--name V ...` (numbers as numbers); a flag alone is
    True, `--no-name` alone False."""
    written: dict[str, list] = {}
    for word in flags:
        if word.startswith("--"):
            written[word[2:].replace("-", "_")] = values = []
            continue
        try:
            values.append(ast.literal_eval(word))
        except (ValueError, SyntaxError):  # a word, not a number
            values.append(word)
    return {
        field if values else field.removeprefix("no_"): values or [not field.startswith("no_")]
        for field, values in written.items()
    }


def test_readme_commands_parse_and_pass_their_scripts_checks():
    """Every README CPU command's flags are its script's, reach the run as written (each flag's value, after the
    script's own defaults for what a command leaves unset: the on-policy script's per-loss ones), and pass the checks
    a run makes before training (what they learn, ten seeds each, is benchmark/readme_commands.py's:
    docs/rl-algorithms/*.md)."""
    sys.path.insert(0, str(REPO / "benchmark"))
    import readme_commands

    from cleanrl_utils.cli import parse_flags

    for name, command in readme_commands.readme_commands(str(REPO / "README.md")).items():
        words = shlex.split(command)
        assert words[:4] == ["uv", "run", "python", f"cleanba/{readme_commands.SCRIPTS[name.split('@')[0]]}"]
        module = load_script(REPO / words[3])
        args = getattr(module, "with_loss_defaults", lambda args: args)(parse_flags(module.Args, words[4:]))
        module.validate_args(args)
        written = written_values(words[4:])
        assert written["env_id"] == [readme_commands.env_id_of(command)] == [args.env_id], command
        for field, values in written.items():
            value = getattr(args, field)
            assert (list(value) if isinstance(value, (list, tuple)) else [value]) == values, (name, field, value)


def test_window_averages_match_a_plain_loop():
    sys.path.insert(0, str(REPO / "benchmark"))
    from readme_commands import window_averages

    rng = np.random.default_rng(0)
    steps = np.cumsum(rng.integers(100, 900, size=200))
    values = rng.normal(size=200).cumsum()
    best, final, best_from = window_averages(steps, values, 10_000)
    windows = {}  # the first step of each window ending at a logged step with 10k env steps before it -> its mean
    for end in steps:
        if end >= 10_000:
            inside = [(s, v) for s, v in zip(steps, values) if end - 10_000 < s <= end]
            windows[int(inside[0][0])] = sum(v for _, v in inside) / len(inside)
    assert best_from == max(windows, key=windows.get) and np.isclose(best, max(windows.values()))
    last = [v for s, v in zip(steps, values) if s > steps[-1] - 10_000]
    assert np.isclose(final, sum(last) / len(last)) and best >= final


def test_the_best_window_can_hold_the_last_logged_value():
    # a curve that rises to its end: the best window is the final one (the old windows stopped a window early and
    # reported a "best" below the final average: V-MPO's "worst at 610" ended at 753.6)
    sys.path.insert(0, str(REPO / "benchmark"))
    from readme_commands import window_averages

    steps = np.arange(1, 21) * 1_000
    best, final, best_from = window_averages(steps, steps / 1_000.0, 5_000)
    assert (best, final, best_from) == (18.0, 18.0, 16_000)


@pytest.mark.parametrize("one_process", [False, True])
def test_readme_commands_max_isa_reaches_the_runs_xla_flags_and_their_records(monkeypatch, tmp_path, one_process):
    """--xla-cpu-max-isa reaches the script's XLA_FLAGS beside flags already set (the scripts append their device
    count to it, keeping both), one seed a run or all in one process (--one-process), and every record says so: no
    record is named `+isa_AVX2` without having run with it."""
    sys.path.insert(0, str(REPO / "benchmark"))
    import readme_commands

    environments = []

    def timed_process(argv, env=None):
        environments.append(env)
        stdout = "update=1/1 global_step=1 avg_episodic_return=0.50\n"
        return readme_commands.TimedRun(subprocess.CompletedProcess(argv, 0, stdout, ""), 1.0, 0.0)

    monkeypatch.setattr(readme_commands, "timed_process", timed_process)
    monkeypatch.setattr(readme_commands, "find_runs", lambda *_: {seed: tmp_path for seed in (1, 2)})
    monkeypatch.setattr(readme_commands, "read_run", lambda *_: (np.array([1]), None, np.array([0.5])))
    monkeypatch.setattr(readme_commands, "draw", lambda *_: None)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    results = tmp_path / "records.jsonl"
    args = readme_commands.Args(
        algorithms=["ppo_anakin"], seeds=[1, 2], results=str(results), xla_cpu_max_isa="AVX2", one_process=one_process
    )
    readme_commands.main(args)
    assert [env["XLA_FLAGS"] for env in environments] == ["--xla_cpu_enable_fast_math=false --xla_cpu_max_isa=AVX2"] * (
        1 if one_process else 2
    )
    records = [json.loads(line) for line in results.read_text().splitlines()]
    suffix = "+isa_AVX2+one_process" if one_process else "+isa_AVX2"
    assert [(r["algorithm"], r["seed"], r["xla_cpu_max_isa"]) for r in records] == [
        (f"ppo_anakin{suffix}", seed, "AVX2") for seed in (1, 2)
    ]


def test_readme_commands_table_of_a_record_without_curve_or_run_folder_is_one_line(workdir):
    sys.path.insert(0, str(REPO / "benchmark"))
    import readme_commands

    command = readme_commands.readme_commands(str(REPO / "README.md"))["impala"]
    record = {"algorithm": "impala", "seed": 3, "command": command, "run_dir": "runs/gone"}
    (workdir / "results.jsonl").write_text(json.dumps(record) + "\n")
    process = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "readme_commands.py"), "--algorithms", "impala", "--table-only"]
        + ["--results", "results.jsonl", "--readme", str(REPO / "README.md")],
        cwd=workdir,
        capture_output=True,
        text=True,
    )
    assert process.returncode == 2, process.stderr
    assert process.stderr == "error: seed 3's record keeps no curve and runs/gone is gone: run the seed again\n"


# ---------------------------------------------------------------- benchmark/learning_runs.py


def test_learning_runs_table_only_prints_mean_and_std_beside_cleanrl_and_draws_the_figure(workdir):
    """--table-only over recorded runs: the mean ± std over seeds of each variant's final returns (NumPy), CleanRL's
    number where it publishes one and "-" where not (CartpoleBalance-v1), a mean more than two of CleanRL's stds
    below its mean marked, the saved models' evaluations in a row of their own, and the figure written."""
    from cleanrl_utils.summary_writer import SummaryWriter

    finals = {("Hopper-v4", 1): 1500.0, ("Hopper-v4", 2): 1000.0, ("CartpoleBalance-v1", 1): 900.0}
    with open(workdir / "results.jsonl", "w") as results:
        for (env_id, seed), final in finals.items():
            run_dir = workdir / "runs" / f"{env_id}__mujoco_onpolicy_ppo__{seed}__1"
            writer = SummaryWriter(str(run_dir), use_wandb=False, resume_step=0)
            for step in range(1, 11):
                writer.add_scalars({"charts/avg_episodic_return": final * step / 10}, step * 2048)
            writer.close()
            record = {"script": "onpolicy", "env_id": env_id, "variant": "ppo", "seed": seed}
            # a saved model's evaluation (--save-model) for the Hopper runs: a row of its own
            evaluation = {"eval_return": final + 100} if env_id == "Hopper-v4" else {}
            results.write(json.dumps({**record, "final_return": final, "run_dir": str(run_dir), **evaluation}) + "\n")
    process = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "learning_runs.py"), "--table-only", "--variants", "ppo"]
        + ["--env-ids", "Hopper-v4", "CartpoleBalance-v1", "--seeds", "1", "2"]
        + ["--results", "results.jsonl", "--output", "figure.png"],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr[-2000:]
    hopper = f"{np.mean([1500.0, 1000.0]):,.1f} ± {np.std([1500.0, 1000.0]):,.1f} (n=2, worst 1,000.0)"
    hopper += " **below**"  # < 2382.86 - 2 x 271.74
    assert f"| ppo | {hopper} | 900.0 ± 0.0 (n=1, worst 900.0) |" in process.stdout, process.stdout
    assert "| ppo: saved model | 1,350.0 ± 250.0 (n=2, worst 1,100.0) **below** | - |" in process.stdout
    assert "| CleanRL ppo_continuous_action (published, 3 seeds) | 2,382.86 ± 271.74 | - |" in process.stdout
    assert (workdir / "figure.png").stat().st_size > 10_000


STAND_IN_CLEANRL = """
import sys, time
from cleanrl_utils.summary_writer import SummaryWriter
flags = dict(zip(sys.argv[1::2], sys.argv[2::2]))
assert "--no-cuda" in sys.argv
run_dir = f"runs/{flags['--env-id']}__{flags['--exp-name']}__{flags['--seed']}__{int(time.time())}"
writer = SummaryWriter(run_dir, use_wandb=False, resume_step=0)
for episode in range(1, 21):  # one return per finished 1,000-step episode, as CleanRL's script logs them
    writer.add_scalars({"charts/episodic_return": 10.0 * episode}, episode * 1000)
writer.close()
"""


def test_learning_runs_runs_cleanrls_own_script_on_the_dm_control_id_and_reads_its_per_episode_returns(workdir):
    """--script cleanrl: the script at --cleanrl-script (a stand-in here: the suite has no copy of CleanRL's) runs on
    gymnasium's dm_control id of the envpool task, with --flags; a run's final return is the mean of its last 10
    episodes' returns, tabled under envpool's id beside CleanRL's published dm_control number."""
    (workdir / "ppo_continuous_action.py").write_text(STAND_IN_CLEANRL)
    command = [sys.executable, str(REPO / "benchmark" / "learning_runs.py"), "--script", "cleanrl"]
    command += ["--python", sys.executable, "--flags=--no-cuda", "--env-ids", "WalkerWalk-v1", "--seeds", "1"]
    command += ["--results", "results.jsonl", "--output", "figure.png"]
    missing = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --cleanrl-script must be"), missing.stderr
    command += ["--cleanrl-script", "ppo_continuous_action.py"]
    process = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr[-2000:]
    (record,) = [json.loads(line) for line in (workdir / "results.jsonl").read_text().splitlines()]
    assert "--env-id dm_control/walker-walk-v0 --seed 1" in record["command"]
    assert record["final_return"] == np.mean(10.0 * np.arange(11, 21))
    assert "| default | 155.0 ± 0.0 (n=1, worst 155.0) **below** |" in process.stdout, process.stdout
    assert "| CleanRL ppo_continuous_action (published, 3 seeds) | 392.51 ± 56.25 |" in process.stdout


# ---------------------------------------------------------------- benchmark/anakin_vs_sebulba.py


def test_time_to_a_return_is_the_first_update_of_a_sustained_mean_as_a_plain_loop_finds_it():
    sys.path.insert(0, str(REPO / "benchmark"))
    from anakin_vs_sebulba import SUSTAINED, reached

    rng = np.random.default_rng(1)
    steps = np.arange(1, 121) * 1024
    seconds = 8.0 + np.arange(120) * 0.05
    returns = np.clip(np.linspace(0.1, 1.0, 120) + rng.normal(scale=0.15, size=120), 0, 0.955)
    returns[0] = 0.95  # the first episodes to end are short, successful ones: one lucky logged value
    record = {"curve": [steps.tolist(), seconds.tolist(), returns.tolist()]}
    expected = None
    for i in range(len(returns) - SUSTAINED + 1):
        if sum(returns[i : i + SUSTAINED]) / SUSTAINED >= 0.9:
            expected = (seconds[i], steps[i])
            break
    assert expected is not None and expected[1] > steps[0]
    assert reached(record, 0.9) == (float(expected[0]), int(expected[1]))
    assert reached(record, 2.0) is None


# ---------------------------------------------------------------- benchmark/jax_env_ceiling.py


@pytest.mark.slow  # an end-to-end run of over ~9 s: 54 s of a loaded quick tier
def test_jax_env_ceiling_writes_a_line_per_env_size_and_torso(workdir):
    """Tiny settings: an env step rate for each library's env and size, and the gradient time of both MinAtar torsos
    inside and outside `lax.scan`, each a JSON line with the processor."""
    process = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "jax_env_ceiling.py"), "--num-envs", "8", "16", "--num-steps", "4"]
        + ["--repeats", "1", "--minibatch-size", "16", "--results", "ceiling.jsonl"],
        cwd=workdir,
        capture_output=True,
        text=True,
        env=script_env(),
    )
    assert process.returncode == 0, process.stderr[-3000:]
    lines = [json.loads(line) for line in (workdir / "ceiling.jsonl").read_text().splitlines()]
    steps = {(line["env_id"], line["num_envs"]) for line in lines if line["part"] == "step"}
    assert steps == {(env_id, n) for env_id in ["MiniGrid-Empty-5x5", "minatar-breakout"] for n in (8, 16)}
    torsos = {(line["torso"], line["scanned"]) for line in lines if line["part"] == "torso"}
    assert torsos == {(torso, scanned) for torso in ["patches", "conv"] for scanned in (False, True)}
    assert all(line.get("sps", line.get("ms")) > 0 and line["processor"] for line in lines)


# ---------------------------------------------------------------- benchmark/pgx_minatar_check.py


STAND_INS = REPO / "benchmark" / "pgx-stand-ins"


def stand_in(name: str):
    """A module of benchmark/pgx-stand-ins, loaded under its own name (not as the real package it stands for)."""
    spec = importlib.util.spec_from_file_location(f"stand_in_{name}", STAND_INS / name / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pgx_stand_ins_shadow_no_package_from_the_repository_or_benchmark():
    """With the repository and benchmark/ first on sys.path (as the tests and the tools have them), wandb, pydantic,
    omegaconf and distrax are the real packages (or absent), never the stand-ins: their folder's name is no Python
    name, and only pgx_minatar_check.py's PYTHONPATH for pgx's example names it."""
    sys.path.insert(0, str(REPO / "benchmark"))
    import pgx_minatar_check

    assert pgx_minatar_check.STAND_INS == STAND_INS and not STAND_INS.name.isidentifier()
    names = sorted(path.parent.name for path in STAND_INS.glob("*/__init__.py"))
    assert names == ["distrax", "omegaconf", "pydantic", "wandb"]
    find = "import importlib.util, sys; sys.path[:0] = sys.argv[1:3]; "
    find += "print(*[str(getattr(importlib.util.find_spec(name), 'origin', None)) for name in sys.argv[3:]])"
    found = subprocess.run(
        [sys.executable, "-c", find, str(REPO), str(REPO / "benchmark"), *names],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO / "benchmark",
    ).stdout.split()
    assert len(found) == 4 and not any(str(STAND_INS) in origin for origin in found), found


def test_pgx_stand_ins_are_distraxs_distribution_and_read_pgxs_arguments(monkeypatch):
    """pgx's example runs with benchmark/pgx-stand-ins first on its path: its Categorical must be distrax's, and its
    `key=value` arguments must reach its config with their types (its seed above all)."""
    import distrax
    import jax

    logits = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32) * 3
    actions = np.arange(5) % 6
    categorical = stand_in("distrax").Categorical
    ours, theirs = categorical(logits=logits), distrax.Categorical(logits=logits)
    np.testing.assert_allclose(ours.log_prob(actions), theirs.log_prob(actions), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours.entropy(), theirs.entropy(), rtol=1e-5, atol=1e-6)
    probabilities = [0.2, 0.5, 0.3]
    samples = np.asarray(categorical(np.log([probabilities] * 20000)).sample(jax.random.key(0)))
    np.testing.assert_allclose(np.bincount(samples, minlength=3) / 20000, probabilities, atol=0.015)

    class Config(stand_in("pydantic").BaseModel):
        env_name: str = "minatar-breakout"
        seed: int = 0
        lr: float = 0.0003

    omegaconf = stand_in("omegaconf").OmegaConf
    monkeypatch.setattr(sys, "argv", ["train.py", "seed=7", "lr=0.001", "env_name=minatar-freeway"])
    config = Config(**omegaconf.to_object(omegaconf.from_cli()))
    assert config.dict() == {"env_name": "minatar-freeway", "seed": 7, "lr": 0.001}
    with pytest.raises(TypeError, match="unknown field"):
        Config(sed=7)


def test_pgx_check_reads_pgx_and_our_logs_and_runs_ours_through_haiku_init(tmp_path):
    sys.path.insert(0, str(REPO / "benchmark"))
    import pgx_minatar_check

    (tmp_path / "pgx_3.log").write_text(
        "PPOConfig(...)\n{'sec': 1.0, 'minatar-breakout/eval_R': 0.5, 'steps': 0}\n"
        "{'sec': 55.3, 'minatar-breakout/eval_R': 41.95, 'steps': 19922944}\n"
    )
    (tmp_path / "haiku_4.log").write_text(
        "update=38/38 global_step=19922944 SPS=140993 avg_episodic_return=29.97 actor_policy_version=37\n"
        "evaluated runs/x/haiku.cleanrl_model (sampled actions): 100 episodes, episodic_return=50.31 +- 46.06 in 9s\n"
    )
    (tmp_path / "default_5.log").write_text("update=3/38 global_step=1572864 SPS=1 avg_episodic_return=2.0\n")
    assert pgx_minatar_check.record(tmp_path / "pgx_3.log") == {
        "variant": "pgx example",
        "seed": 3,
        "eval_return": 41.95,
        "steps": 19922944,
    }
    assert pgx_minatar_check.record(tmp_path / "haiku_4.log") == {
        "variant": "ours, haiku",
        "seed": 4,
        "eval_return": 50.31,
        "steps": 19922944,
        "training_return": 29.97,
    }
    assert pgx_minatar_check.record(tmp_path / "default_5.log") is None  # stopped before its evaluation
    args = pgx_minatar_check.Args(logs="l", results="r", pgx_train="train.py", pgx_seeds=[0], ours_seeds=[1])
    runs = pgx_minatar_check.commands(args)
    assert sorted(runs) == ["default_1", "haiku_1", "pgx_0"]
    assert runs["pgx_0"][0][-3:] == ["env_name=minatar-breakout", "seed=0", "total_timesteps=20000000"]
    assert runs["pgx_0"][1]["PYTHONPATH"].startswith(str(STAND_INS))
    assert runs["haiku_1"][0][1].endswith("benchmark/haiku_init.py") and "haiku_init.py" not in runs["default_1"][0]
    # its bad input: tests/test_benchmark_tools.py


def test_haiku_init_gives_every_layer_haikus_truncated_normal():
    """Each kernel's std x sqrt(fan_in) (those of 256 numbers or more) is about 0.88, haiku's cut normal of stddev
    1/sqrt(fan_in), where the script's own orthogonal init gives sqrt(2) or 0.01 (in a process of its own: the
    replacement is global)."""
    code = (
        "import sys, jax, numpy as np; sys.path[:0] = ['benchmark', 'tests']; import haiku_init; "
        "haiku_init.use_haiku_initializers(); from conftest import ANAKIN_SCRIPT, load_script; "
        "script = load_script(ANAKIN_SCRIPT); "
        "args = script.Args(env_id='minatar-breakout', hiddens=[64, 64]); "
        "params = script.make_agent(args, jax.random.key(0))[1].params; "
        "kernels = [k for k in jax.tree.leaves(params) if k.ndim == 2 and k.size >= 256]; "
        "print([round(float(np.std(k) * np.sqrt(k.shape[0])), 2) for k in kernels])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env=script_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]
    scales = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(scales) == 6 and all(0.8 < scale < 0.96 for scale in scales), scales  # all but the 2 heads


def test_a_results_files_run_folder_that_is_gone_is_one_line(tmp_path):
    """A table or figure from records whose run folders are on another machine (or removed): one line naming the
    folder, not TensorBoard's DirectoryDeletedError."""
    sys.path.insert(0, str(REPO / "benchmark"))
    from tool_helpers import read_run

    from cleanrl_utils.errors import UsageError

    with pytest.raises(UsageError, match=r"gone: no such run folder"):
        read_run(tmp_path / "gone", "charts/avg_episodic_return")


def test_a_timed_run_beside_a_busy_process_is_not_a_quiet_machines(tmp_path):
    """benchmark tools record how busy other processes kept the CPU during each timed run: beside a process that
    spins on one core the run is marked, and the README's promised times skip such records (test_docs.py), as they
    skip a record without the measurement (from before it was made)."""
    sys.path.insert(0, str(REPO / "benchmark"))
    from tool_helpers import QUIET_LOAD_CORES, quiet, timed_process

    spin = "import time\nend = time.time() + {}\nwhile time.time() < end: pass"
    burner = subprocess.Popen([sys.executable, "-c", spin.format(4)])
    try:
        run = timed_process([sys.executable, "-c", spin.format(1.5)])
    finally:
        burner.kill()
        burner.wait()
    assert run.process.returncode == 0 and run.wall >= 1.5
    assert run.other_load >= 0.5  # at least the burner's share of a core
    assert not quiet({"wall_s": run.wall, "other_load_cores": run.other_load})
    assert quiet({"wall_s": 40.0, "other_load_cores": QUIET_LOAD_CORES})
    assert not quiet({"wall_s": 40.0}) and not quiet({"wall_s": 40.0, "other_load_cores": None})
