"""Every benchmark tool's bad input, as a user gives it (from the repository root): a missing, binary or folder input
file, a bad value, an unknown flag. Each is one `error:` line on stderr naming the flag (or argument) and what is
allowed, exit code 2, before any heavy work: no traceback, no run started. Each tool's first case runs as the user's
process (its own interpreter, imports and `sys.path`); its other cases run the same `__main__` code with the same
arguments in this process (runpy), without starting another interpreter that imports JAX or matplotlib again."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, script_env


def tool(name: str) -> list[str]:
    return ["bash" if name.endswith(".sh") else sys.executable, str(REPO / "benchmark" / name)]


# (the command, what its error line must name): {missing} a path that does not exist, {binary} a file of bytes that
# are not UTF-8 text ({binary_py} the same named .py), {text} a text file that is not JSON lines, {folder} an empty
# folder, {tmp} a folder for outputs
CASES = {
    # benchmark/anakin_vs_sebulba.py
    "anakin_vs_sebulba unknown flag": ("anakin_vs_sebulba.py --no-such-flag", "--no-such-flag"),
    "anakin_vs_sebulba bad part": ("anakin_vs_sebulba.py --parts bogus", "--parts"),
    "anakin_vs_sebulba negative seed": ("anakin_vs_sebulba.py --seeds -1", "--seeds"),
    "anakin_vs_sebulba missing results": ("anakin_vs_sebulba.py --table-only --results {missing}", "--results"),
    "anakin_vs_sebulba binary results": ("anakin_vs_sebulba.py --table-only --results {binary}", "--results"),
    "anakin_vs_sebulba missing readme": (
        "anakin_vs_sebulba.py --parts side --readme {missing} --results {tmp}/r.jsonl",
        "--readme",
    ),
    "anakin_vs_sebulba binary readme": (
        "anakin_vs_sebulba.py --parts side --readme {binary} --results {tmp}/r.jsonl",
        "--readme",
    ),
    # benchmark/anakin_seeds.py
    "anakin_seeds unknown flag": ("anakin_seeds.py --no-such-flag", "--no-such-flag"),
    "anakin_seeds unknown command": ("anakin_seeds.py --command ppo", "--command"),
    "anakin_seeds zero seeds": ("anakin_seeds.py --num-seeds 0", "--num-seeds"),
    "anakin_seeds seeds past the seed range": ("anakin_seeds.py --num-seeds 5000000000", "--num-seeds"),
    "anakin_seeds processes past the seed range": ("anakin_seeds.py --processes 5000000000", "--processes"),
    "anakin_seeds missing readme": ("anakin_seeds.py --readme {missing}", "--readme"),
    # benchmark/env_ceiling.py
    "env_ceiling unknown flag": ("env_ceiling.py --no-such-flag", "--no-such-flag"),
    "env_ceiling not a number": ("env_ceiling.py --seconds soon", "--seconds"),
    "env_ceiling missing script": ("env_ceiling.py --script {missing}", "--script"),
    "env_ceiling binary script": ("env_ceiling.py --script {binary_py}", "--script"),
    "env_ceiling unknown env": ("env_ceiling.py --env-id Bogus-v9 --steps 1", "--env-id"),
    # benchmark/haiku_init.py: a script's path, then its flags
    "haiku_init no script": ("haiku_init.py", "script"),
    "haiku_init unknown flag": ("haiku_init.py --no-such-flag", "script"),
    "haiku_init missing script": ("haiku_init.py {missing}", "script"),
    "haiku_init binary script": ("haiku_init.py {binary_py}", "script"),
    # benchmark/jax_env_ceiling.py
    "jax_env_ceiling unknown flag": ("jax_env_ceiling.py --no-such-flag", "--no-such-flag"),
    "jax_env_ceiling bad part": ("jax_env_ceiling.py --parts bogus --results {tmp}/r.jsonl", "--parts"),
    "jax_env_ceiling zero envs": ("jax_env_ceiling.py --num-envs 0 --results {tmp}/r.jsonl", "--num-envs"),
    "jax_env_ceiling zero repeats": ("jax_env_ceiling.py --repeats 0 --results {tmp}/r.jsonl", "--repeats"),
    "jax_env_ceiling unknown env": ("jax_env_ceiling.py --env-ids Bogus --results {tmp}/r.jsonl", "--env-ids"),
    # benchmark/learning_runs.py
    "learning_runs unknown flag": ("learning_runs.py --no-such-flag", "--no-such-flag"),
    "learning_runs unknown script": ("learning_runs.py --script bogus", "--script"),
    "learning_runs zero jobs": ("learning_runs.py --jobs 0 --results {tmp}/r.jsonl", "--jobs"),
    "learning_runs missing cleanrl script": (
        "learning_runs.py --script cleanrl --cleanrl-script {missing}",
        "--cleanrl-script",
    ),
    "learning_runs missing results": ("learning_runs.py --table-only --results {missing}", "--results"),
    "learning_runs binary results": ("learning_runs.py --table-only --results {binary}", "--results"),
    # benchmark/muzero_search_throughput.py
    "muzero_search_throughput unknown flag": ("muzero_search_throughput.py --no-such-flag", "--no-such-flag"),
    "muzero_search_throughput zero envs": (
        "muzero_search_throughput.py --envs-per-thread 0 --out {tmp}/r.jsonl",
        "--envs-per-thread",
    ),
    "muzero_search_throughput negative seconds": (
        "muzero_search_throughput.py --seconds -1 --out {tmp}/r.jsonl",
        "--seconds",
    ),
    "muzero_search_throughput unknown env": (
        "muzero_search_throughput.py --env-ids Bogus-v9 --out {tmp}/r.jsonl",
        "--env-ids",
    ),
    # benchmark/pgx_minatar_check.py
    "pgx_minatar_check unknown flag": (
        "pgx_minatar_check.py --logs {tmp}/logs --results {tmp}/r.jsonl --no-such-flag",
        "--no-such-flag",
    ),
    "pgx_minatar_check unknown game": (
        "pgx_minatar_check.py --logs {tmp}/logs --results {tmp}/r.jsonl --env-id pong",
        "--env-id",
    ),
    "pgx_minatar_check unknown variant": (
        "pgx_minatar_check.py --logs {tmp}/logs --results {tmp}/r.jsonl --variants default orthogonal",
        "--variants orthogonal",
    ),
    "pgx_minatar_check missing example": (
        "pgx_minatar_check.py --logs {tmp}/logs --results {tmp}/r.jsonl --pgx-train {missing}",
        "--pgx-train",
    ),
    "pgx_minatar_check binary example": (
        "pgx_minatar_check.py --logs {tmp}/logs --results {tmp}/r.jsonl --pgx-train {binary}",
        "--pgx-train",
    ),
    "pgx_minatar_check missing logs": (
        "pgx_minatar_check.py --from-logs --logs {missing} --results {tmp}/r.jsonl",
        "--logs",
    ),
    "pgx_minatar_check binary log": (
        "pgx_minatar_check.py --from-logs --logs {binary_logs} --results {tmp}/r.jsonl",
        "--logs",
    ),
    # benchmark/plot.py
    "plot unknown flag": ("plot.py curves --output {tmp}/f.png --no-such-flag", "--no-such-flag"),
    "plot unknown subcommand": ("plot.py bars --output {tmp}/f.png", "bars"),
    "plot missing run": ("plot.py curves --runs {missing} --output {tmp}/f.png", "--runs"),
    "plot binary run": ("plot.py panels --runs {binary} --output {tmp}/f.png", "--runs"),
    "plot empty run folder": ("plot.py curves --runs {folder} --output {tmp}/f.png", "--runs"),
    "plot no runs of an experiment": (
        "plot.py sps --env-id CartPole-v1 --exp-names none --runs-dir {folder} --output {tmp}/f.png",
        "--exp-names",
    ),
    # benchmark/readme_commands.py
    "readme_commands unknown flag": ("readme_commands.py --no-such-flag", "--no-such-flag"),
    "readme_commands one process of sebulba": ("readme_commands.py --one-process --algorithms ppo", "--one-process"),
    "readme_commands one process of no seeds": (
        "readme_commands.py --one-process --algorithms ppo_anakin --seeds",
        "--seeds",
    ),
    "readme_commands negative seed": ("readme_commands.py --algorithms ppo --seeds -1", "--seeds"),
    "readme_commands one process of gaps": (
        "readme_commands.py --one-process --algorithms ppo_anakin --seeds 1 3",
        "--one-process",
    ),
    "readme_commands unknown algorithm": ("readme_commands.py --algorithms bogus", "--algorithms"),
    "readme_commands missing results": ("readme_commands.py --table-only --results {missing}", "--results"),
    "readme_commands binary results": ("readme_commands.py --table-only --results {binary}", "--results"),
    "readme_commands results not JSON": ("readme_commands.py --table-only --results {text}", "--results"),
    "readme_commands another tools results": (
        "readme_commands.py --table-only --results benchmark/results/mujoco_ppo.jsonl",
        "--results",
    ),
    "learning_runs another tools results": (
        "learning_runs.py --table-only --results benchmark/results/readme_commands.jsonl",
        "--results",
    ),
    "readme_commands missing readme": ("readme_commands.py --readme {missing} --results {tmp}/r.jsonl", "--readme"),
    "readme_commands binary readme": ("readme_commands.py --readme {binary} --results {tmp}/r.jsonl", "--readme"),
    # benchmark/sac_throughput.py
    "sac_throughput unknown flag": ("sac_throughput.py --no-such-flag", "--no-such-flag"),
    "sac_throughput zero updates": ("sac_throughput.py --updates 0", "--updates"),
    "sac_throughput negative replay ratio": ("sac_throughput.py --replay-ratios -1", "--replay-ratios"),
    "sac_throughput unknown env": ("sac_throughput.py --env-ids Bogus-v9", "--env-ids"),
    # benchmark/script_shape.py
    "script_shape unknown flag": ("script_shape.py --no-such-flag", "--no-such-flag"),
    "script_shape unknown revision": ("script_shape.py --rev no-such-revision", "--rev"),
    # benchmark/throughput.py
    "throughput unknown flag": ("throughput.py --no-such-flag", "--no-such-flag"),
    "throughput missing script": ("throughput.py --script {missing} -- --env-id CartPole-v1", "--script"),
    "throughput binary script": ("throughput.py --script {binary_py} -- --env-id CartPole-v1", "--script"),
    "throughput bad script flag": ("throughput.py -- --env-id CartPole-v1 --num-steps 0", "--num-steps"),
    "throughput missing summary": ("throughput.py --summarize {missing}", "--summarize"),
    "throughput binary summary": ("throughput.py --summarize {binary}", "--summarize"),
    "throughput summary not JSON": ("throughput.py --summarize {text}", "--summarize"),
    # benchmark/train_in_parts.py
    "train_in_parts unknown flag": (
        "train_in_parts.py --out {tmp}/out --name n --no-such-flag -- script.py --run-name n",
        "--no-such-flag",
    ),
    "train_in_parts zero seconds": (
        "train_in_parts.py --out {tmp}/out --name n --seconds 0 -- script.py --run-name n",
        "--seconds",
    ),
    "train_in_parts missing pack": (
        "train_in_parts.py --out {tmp}/out --name n --part-in {missing} -- script.py --run-name n",
        "--part-in",
    ),
    "train_in_parts binary pack": (
        "train_in_parts.py --out {tmp}/out --name n --part-in {binary} -- script.py --run-name n",
        "--part-in",
    ),
    # benchmark/upstream_cleanba.py
    "upstream_cleanba unknown flag": (
        "upstream_cleanba.py --cleanba-ppo {missing} --results {tmp}/r.jsonl --logs {tmp}/logs --no-such-flag",
        "--no-such-flag",
    ),
    "upstream_cleanba missing script": (
        "upstream_cleanba.py --cleanba-ppo {missing} --results {tmp}/r.jsonl --logs {tmp}/logs",
        "--cleanba-ppo",
    ),
    "upstream_cleanba binary script": (
        "upstream_cleanba.py --cleanba-ppo {binary} --results {tmp}/r.jsonl --logs {tmp}/logs",
        "--cleanba-ppo",
    ),
    "upstream_cleanba zero timeout": (
        "upstream_cleanba.py --cleanba-ppo {binary} --results {tmp}/r.jsonl --logs {tmp}/logs --timeout 0",
        "--timeout",
    ),
    # benchmark/gpu.sh OUT SECTIONS...
    "gpu.sh unknown flag": ("gpu.sh --help", "--help"),
    "gpu.sh unknown section": (  # the first section would run for minutes before the second was read
        "gpu.sh {tmp}/out ceiling curves",
        "unknown section 'curves' (allowed: ceiling throughput curve minatar jax-ceiling pgx-check cleanba-upstream "
        "ceiling-sweep breakout10m pqn10m learner sync)",
    ),
    # benchmark/throughput.sh [RESULTS [SCRIPTS FOLDER]]
    "throughput.sh unknown flag": ("throughput.sh --help", "--help"),
    "throughput.sh missing scripts folder": ("throughput.sh {tmp}/r.jsonl {missing}", "scripts folder"),
    "throughput.sh too many arguments": ("throughput.sh {tmp}/r.jsonl cleanba more", "more"),
    # cleanrl_utils/benchmark.py (python -m), the sweep the shell scripts run
    "benchmark sweep zero seeds": ("-m cleanrl_utils.benchmark --num-seeds 0", "--num-seeds"),
    "benchmark sweep missing template": (
        "-m cleanrl_utils.benchmark --slurm-template-path {missing} --slurm-dry-run",
        "--slurm-template-path",
    ),
    "benchmark sweep binary template": (
        "-m cleanrl_utils.benchmark --slurm-template-path {binary} --slurm-dry-run --slurm-log-dir {tmp}/slurm",
        "--slurm-template-path",
    ),
}


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    """The placeholders of CASES, in this test's own folder (a tool that wrongly creates {missing} fails one case)."""
    binary = bytes(range(256)) * 8  # not UTF-8, not gzip, not an event file
    paths = {"tmp": tmp_path, "missing": tmp_path / "missing", "folder": tmp_path / "empty"}
    paths |= {"binary": tmp_path / "binary", "binary_py": tmp_path / "binary.py", "text": tmp_path / "text.jsonl"}
    paths["binary_logs"] = tmp_path / "logs"
    paths["folder"].mkdir()
    paths["binary_logs"].mkdir()
    for path in [paths["binary"], paths["binary_py"], paths["binary_logs"] / "default_1.log"]:
        path.write_bytes(binary)
    paths["text"].write_text("a text file, not JSON lines\n")
    return paths


def first_cases() -> set[str]:
    """Each tool's first case: the ones run as the user's process."""
    firsts = {}
    for case, (command, _) in CASES.items():
        firsts.setdefault(command.split()[0], case)
    return set(firsts.values())


IN_A_PROCESS = first_cases()


def run_in_a_process(words: list[str]) -> tuple[int, str]:
    """`python benchmark/TOOL ...` (bash for the shell tools, `python -m` for the sweep) from the repository root."""
    argv = [sys.executable, *words] if words[0] == "-m" else [*tool(words[0]), *words[1:]]
    # from the repository root, as the tools' usage lines run them; the shell tools' Python is this one
    completed = subprocess.run(
        argv, cwd=REPO, env={**script_env(), "PY": sys.executable}, capture_output=True, text=True, timeout=120
    )
    return completed.returncode, completed.stderr


def run_in_this_process(words: list[str], monkeypatch, capfd) -> tuple[int, str]:
    """What `python benchmark/TOOL ...` runs, in this process: the tool's file as `__main__` with the same argv,
    working directory, `sys.path[0]` and environment (script_env's, but the tests' XLA_FLAGS kept: a tool that starts
    JAX here starts it for the tests after it too); the environment and sys.path are restored after."""
    path = REPO / "benchmark" / words[0]
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(path), *words[1:]])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    environ = dict(os.environ)
    os.environ.update(WANDB_MODE="offline", PY=sys.executable)
    capfd.readouterr()
    try:
        with pytest.raises(SystemExit) as exit_info:  # any other exception fails the case
            runpy.run_path(str(path), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return exit_info.value.code, capfd.readouterr().err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_error_line_and_exit_code_2(case, inputs, monkeypatch, capfd):
    command, named = CASES[case]
    words = [word.format(**inputs) for word in command.split()]
    if case in IN_A_PROCESS or not words[0].endswith(".py"):
        returncode, stderr = run_in_a_process(words)
    else:
        returncode, stderr = run_in_this_process(words, monkeypatch, capfd)
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert named in lines[0], lines[0]
    assert returncode == 2, stderr
    assert not inputs["missing"].exists()  # a missing input is not created (e.g. empty, by an append)
