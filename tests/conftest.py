"""Shared helpers: run a cleanba script the way a user does (a subprocess), and read what it wrote."""

import atexit
import functools
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

# in-process tests (the learner on a mesh) need several host devices: set before JAX starts a backend
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
# One JAX compilation cache for this test session, in this process and every run it starts (as a user's
# JAX_COMPILATION_CACHE_DIR would be): the tests start hundreds of runs of a few tiny configurations, and a run whose
# programs are cached starts in about 9 s instead of 15 (MuZero on CartPole). Every program, however small or quick
# to compile, is cached. A user's own cache is left alone.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _compilation_cache = tempfile.mkdtemp(prefix="cleanba-tests-jax-cache-")
    atexit.register(shutil.rmtree, _compilation_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

REPO = Path(__file__).resolve().parent.parent
PPO_SCRIPT = REPO / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
IMPALA_SCRIPT = REPO / "cleanba" / "cleanba_impala_envpool_impala_atari_wrapper.py"
MUJOCO_SCRIPT = REPO / "cleanba" / "cleanba_ppo_continuous_action_envpool_mujoco.py"
SAC_SCRIPT = REPO / "cleanba" / "cleanba_sac_continuous_action_envpool_mujoco.py"
MUZERO_SCRIPT = REPO / "cleanba" / "cleanba_muzero_envpool_impala_atari_wrapper.py"
R2D2_SCRIPT = REPO / "cleanba" / "cleanba_r2d2_envpool_impala_atari_wrapper.py"
ANAKIN_SCRIPT = REPO / "cleanba" / "cleanba_ppo_anakin.py"
CONTINUOUS_ANAKIN_SCRIPT = REPO / "cleanba" / "cleanba_ppo_continuous_action_anakin.py"
ONPOLICY_SCRIPT = REPO / "cleanba" / "cleanba_onpolicy_continuous_action_envpool_mujoco.py"
PQN_SCRIPT = REPO / "cleanba" / "cleanba_pqn_envpool_impala_atari_wrapper.py"
# JAX deprecations are errors in every run the tests start (the product must use today's JAX API). The exceptions
# are third-party: tensorflow-probability (imported by rlax through distrax) reads a deprecated jax.core attribute at
# import time, and jaxopt (MuJoCo Playground -> brax) warns that it is unmaintained; the filters name those modules.
SUBPROCESS_WARNINGS = (
    "error::DeprecationWarning,ignore::DeprecationWarning:tensorflow_probability.python.internal.backend.jax.ops,"
    "ignore::DeprecationWarning:jaxopt"
)
# tiny Atari settings: a few updates of a 4-channel IMPALA CNN on Breakout-v5
TINY_BREAKOUT = (
    "--env-id Breakout-v5 --local-num-envs 4 --num-steps 8 --channels 4 --hiddens 16 --num-minibatches "
    "2 --log-frequency 1"
).split()
TINY_BREAKOUT_PPO = [*TINY_BREAKOUT, "--update-epochs", "1"]
# tiny MuJoCo settings: a few updates of 8-unit MLPs on HalfCheetah-v4
TINY_HALFCHEETAH = (
    "--env-id HalfCheetah-v4 --local-num-envs 2 --num-steps 16 --hiddens 8 --num-minibatches 2 "
    "--update-epochs 2 --log-frequency 1"
).split()


def load_script(path: Path = PPO_SCRIPT):
    """Import a cleanba script as a module (for its pure functions)."""
    from cleanrl_utils.evals.evaluate import load_script as load

    return load(path)


def one_error_line(flags: list[str], script, workdir, monkeypatch, capsys) -> str:
    """What `python script.py FLAGS` prints, in this process: exit code 2, one error line, nothing started."""
    from cleanrl_utils.cli import run_cli

    module = load_script(script)
    monkeypatch.chdir(workdir)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(module.main, module.Args, flags)  # what `python script.py FLAGS` runs
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1, error_lines
    assert not (workdir / "runs").exists()  # nothing was started: no run folder, no replay allocated
    return error_lines[0]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run's TensorBoard event files: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


class Run:
    def __init__(self, completed: subprocess.CompletedProcess, seconds: float, cwd: Path, run_name: str):
        self.returncode, self.stdout, self.stderr = completed.returncode, completed.stdout, completed.stderr
        self.seconds, self.run_dir = seconds, cwd / "runs" / run_name

    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        return read_scalars(self.run_dir)


FAULT_INJECTION = REPO / "tests" / "fault_injection.py"

# the console's checkpoint and final lines (cleanrl_utils/checkpoints.py): update, global step and the state's
# digests as one string ("params sha256=..." and, per script, "stats sha256=...", "optimizer sha256=...", ...)
STATE = r"\w+ sha256=[0-9a-f]{64}(?: \w+ sha256=[0-9a-f]{64})*"
SAVED = re.compile(rf"checkpoint saved: update=(\d+) global_step=(\d+) ({STATE})")
RESUMED = re.compile(rf"resumed from checkpoint: update=(\d+) global_step=(\d+) ({STATE})")
FINAL = re.compile(rf"final ({STATE})")


def script_command(
    args: list[str], run_name: str | None, script: Path = PPO_SCRIPT, fault: list[str] | None = None
) -> list[str]:
    """The command a user runs; with `fault` (e.g. ["learner", "3"]) through tests/fault_injection.py."""
    injection = [str(FAULT_INJECTION), str(script), *fault] if fault else [str(script)]
    return [sys.executable, *injection, *(["--run-name", run_name] if run_name else []), *args]


def script_env(env: dict | None = None) -> dict:
    """The environment a user's run gets: JAX deprecations as errors, W&B offline, the script's own
    XLA_FLAGS (the tests' 4 host devices are not passed on, unless `env` sets XLA_FLAGS)."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**full_env, "PYTHONWARNINGS": SUBPROCESS_WARNINGS, "WANDB_MODE": "offline", **(env or {})}


def run_script(
    args: list[str],
    cwd: Path,
    run_name: str | None = "test",
    script: Path = PPO_SCRIPT,
    timeout: float = 300,
    env: dict | None = None,
) -> Run:
    start = time.time()
    completed = subprocess.run(
        script_command(args, run_name, script),
        cwd=cwd,
        env=script_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Run(completed, time.time() - start, cwd, run_name or "")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_processes(
    args: list[str],
    cwd: Path | list[Path],
    num_processes: int,
    run_name: str = "test",
    script: Path = PPO_SCRIPT,
    fault: list[str] | None = None,
    process_args: list[list[str]] | None = None,
    process_ids: list[int] | None = None,
) -> list[subprocess.Popen]:
    """A jax.distributed run of `num_processes` processes on 127.0.0.1, as on a cluster without Slurm; `cwd` is one
    folder for all, or one per process (hosts whose working directories differ); `process_args`: flags added to
    each process's command; `process_ids`: start only these processes (the others never arrive)."""
    coordinator = f"127.0.0.1:{free_port()}"
    cwds = cwd if isinstance(cwd, list) else [cwd] * num_processes
    process_args = process_args or [[] for _ in range(num_processes)]
    return [
        subprocess.Popen(
            script_command(
                [
                    *args,
                    *process_args[i],
                    "--distributed",
                    "--coordinator-address",
                    coordinator,
                    "--num-processes",
                    str(num_processes),
                    "--process-id",
                    str(i),
                ],
                run_name,
                script,
                fault,
            ),
            cwd=cwds[i],
            env=script_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (range(num_processes) if process_ids is None else process_ids)
    ]


def start_script(
    flags: list[str], cwd: Path, run_name: str, script: Path, command: list[str] | None = None
) -> subprocess.Popen:
    """The script as a user runs it, in the background; `command` (default: the user's command) replaces it."""
    return subprocess.Popen(
        command or script_command(flags, run_name, script),
        cwd=cwd,
        env=script_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish_script(process: subprocess.Popen, cwd: Path, run_name: str, timeout: float = 400) -> Run:
    out, err = process.communicate(timeout=timeout)
    return Run(subprocess.CompletedProcess(process.args, process.returncode, out, err), 0.0, cwd, run_name)


def finish_processes(processes: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each process of a jax.distributed run; none is left running."""
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            process.kill()
    return [(process.returncode, out, err) for process, (out, err) in zip(processes, outputs)]


def same_seed_and_resumed_runs(tmp_path_factory, name: str, start, flags: list[str]) -> dict:
    """The runs a replay script's determinism and resume tests read, started a few at a time: "first" (`flags`, a
    checkpoint after every update, so its console shows the digests of every update's state), "stopped" (the same
    seed again, SIGTERM after update 4: (exit code, stdout, stderr), and "stopped_scalars", what it logged), then
    "resumed" and "resumed_again" (its checkpoint resumed in its folder and in a copy in another folder).
    `start(flags, cwd, run_name)` starts one run."""
    workdir = tmp_path_factory.mktemp(name)
    first, stopped = start([*flags, "--checkpoint-frequency", "1"], workdir, "first"), None
    try:
        # "stopped" starts once "first" has compiled its programs (its update 3 learns in every replay script), so
        # that it loads them from the test session's compilation cache instead of compiling them beside it
        first_lines = wait_for_line(first, "update=3/")
        stopped = start(flags, workdir, "stopped")
        lines = wait_for_line(stopped, "update=4/")
        stopped.send_signal(signal.SIGTERM)
        out, err = stopped.communicate(timeout=120)
        result = {"first": finish_script(first, workdir, "first")}
        result["first"].stdout = "".join(first_lines) + result["first"].stdout
    finally:
        for process in [first, stopped]:
            if process is not None:
                process.kill()
    result["stopped"] = (stopped.returncode, "".join(lines) + out, err)
    result["stopped_scalars"] = read_scalars(workdir / "runs" / "stopped")
    copy = tmp_path_factory.mktemp(f"{name}_copy")  # the same run (--run-name is a flag of the run) in another folder
    shutil.copytree(workdir / "runs" / "stopped", copy / "runs" / "stopped")
    resumed, resumed_again = start(flags, workdir, "stopped"), start(flags, copy, "stopped")
    result["resumed"] = finish_script(resumed, workdir, "stopped")
    result["resumed_again"] = finish_script(resumed_again, copy, "stopped")
    return result


def assert_same_seed_same_run(runs: dict, digests: re.Pattern, tags: list[str]) -> list[int]:
    """The checks of `same_seed_and_resumed_runs`'s same-seed pair: the stopped run (the seed's second run) saved, at
    the update it stopped after, the very state (`digests`: its groups) the first run had there, and logged the same
    `tags` at every update up to it. Returns the env steps at which "first" logged `tags[0]`."""
    first, (returncode, out, err) = runs["first"], runs["stopped"]
    assert first.returncode == 0 and returncode == 143, first.stderr[-3000:] + err[-3000:]
    update = re.findall(r"checkpoint saved: update=(\d+)", out)[-1]
    at_update = rf"checkpoint saved: update={update} .*"
    first_state, stopped_state = (
        digests.search(re.search(at_update, text).group(0)).groups() for text in [first.stdout, out]
    )
    assert first_state == stopped_state, f"the states at update {update} differ"
    logged, stopped = first.scalars(), runs["stopped_scalars"]
    for tag in tags:
        assert 0 < len(stopped[tag]) < len(logged[tag]), tag
        assert stopped[tag] == logged[tag][: len(stopped[tag])], tag
    return [step for step, _ in logged[tags[0]]]


def resumes_on_other_layouts(tmp_path_factory, name: str, script: Path, flags: list[str], two: Path) -> dict:
    """Resumes of a replay script's checkpoints on other layouts, from a finished two-process run (`flags` with
    --actor-device-ids 0 --learner-device-ids 1 in each process: 2 learner devices; run folder `two`, checkpoints
    after every update, the 3 newest kept: U - 2, U - 1, U). "fewer": U - 2 resumed by one process on one learner
    device (two actor devices keep the batch), which saves U - 1 and U; "more": a U - 1 resumed by two processes again
    (the one "fewer" saved, or the two-process run's own where "fewer" refused).
    Returns {"fewer": Run, "more": [(exit code, stdout, stderr)] of each process}."""
    checkpoints = sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit())

    def copy_without(source: Path, folder: str, newest: int) -> Path:
        workdir = tmp_path_factory.mktemp(f"{name}_{folder}")
        shutil.copytree(source, workdir / "runs" / "two")
        for update in checkpoints[-newest:]:
            shutil.rmtree(workdir / "runs" / "two" / "checkpoints" / str(update))
        return workdir

    fewer_dir = copy_without(two, "fewer", newest=2)
    one_process = [*flags, "--actor-device-ids", "0", "1", "--learner-device-ids", "2"]  # the last value counts
    result = {"fewer": finish_script(start_script(one_process, fewer_dir, "two", script), fewer_dir, "two")}
    more_from = fewer_dir / "runs" / "two" if result["fewer"].returncode == 0 else two
    result["more"] = finish_processes(
        start_processes(flags, copy_without(more_from, "more", newest=1), 2, "two", script=script)
    )
    return result


def assert_resumes_on_other_layouts(runs: dict, digests: re.Pattern, refused: str | None = None):
    """The checks of `resumes_on_other_layouts`'s runs: each resume starts from the state that was saved, bit for bit
    (`digests`: the groups of a state's digests); the two processes of "more" end with the same state. `refused`:
    the start of the one error line with which "fewer" must stop (exit code 2), for a state that cannot move."""

    def saved(out: str, update: int) -> tuple:
        return digests.search(re.search(rf"checkpoint saved: update={update} .*", out).group(0)).groups()

    def resumed(out: str, update: int) -> tuple:
        return digests.search(re.search(rf"resumed from checkpoint: update={update} .*", out).group(0)).groups()

    two = runs["two"][0][1]
    newest = [int(update) for update in re.findall(r"checkpoint saved: update=(\d+)", two)][-3:]  # U - 2, U - 1, U
    fewer = runs["fewer"]
    if refused is None:
        assert fewer.returncode == 0, fewer.stderr[-3000:]
        assert resumed(fewer.stdout, newest[0]) == saved(two, newest[0])
        source = fewer.stdout
    else:
        assert fewer.returncode == 2, fewer.stderr[-3000:]
        errors = [line for line in fewer.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(refused), fewer.stderr[-3000:]
        assert "Traceback" not in fewer.stderr
        source = two
    finals = []
    for code, out, err in runs["more"]:
        assert code == 0, err[-3000:]
        assert resumed(out, newest[1]) == saved(source, newest[1])
        finals.append(digests.search(out.split("final ")[-1]).groups())
    assert finals[0] == finals[1], "the processes' states differ"


def wait_for_line(process: subprocess.Popen, prefix: str) -> list[str]:
    """Read `process`'s stdout up to a line starting with `prefix`; fail the test if the process ends first (so a
    test that signals a run "after update 3" cannot pass when the run died before it)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    process.wait(timeout=30)
    pytest.fail(
        f"the process ended (exit code {process.returncode}) before printing {prefix!r}:\n"
        f"{''.join(lines)[-2000:]}\n{process.stderr.read()[-3000:]}"
    )


@functools.cache
def why_procgen_cannot_start() -> str | None:
    """Why envpool's Procgen cannot start on this machine (it needs the system Qt 5 runtime), or None."""
    from cleanrl_utils.envs import check_env_id
    from cleanrl_utils.errors import UsageError

    try:
        check_env_id("BigfishEasy-v0", discrete=True)
    except UsageError as error:
        return str(error)
    return None


# About each test file's time in the whole suite, in seconds: its tests added up, setup included (estimates for CI's
# 2-core AMD EPYC, rounded, from the last CI runs' slowest durations and the time-by-file table of
# docs/contributing.md). pytest-xdist gives whole files to its two workers in the collection's order (`--dist
# loadfile --no-loadscope-reorder`, pyproject.toml): longest first, both workers end on short files at about the same
# time, not one on a long file started last (xdist's own order, by number of tests, started test_slurm.py's and
# test_distributed.py's 5 long tests among the last). A file not listed (a new one) goes first.
FILE_SECONDS = {
    "test_anakin.py": 450,
    "test_anakin_runs.py": 400,
    "test_r2d2.py": 330,
    "test_muzero.py": 260,
    "test_envs.py": 200,
    "test_reliability.py": 160,
    "test_sac.py": 150,
    "test_distributed.py": 147,
    "test_onpolicy.py": 145,
    "test_slurm.py": 136,
    "test_throughput.py": 120,
    "test_smoke.py": 72,
    "test_benchmark.py": 63,
    "test_pqn.py": 57,  # measured alone on a busy 2-core AMD EPYC (-n 0), not yet in a CI run
    "test_mujoco.py": 56,
    "test_impala.py": 43,
    "test_checkpoint.py": 37,
    "test_learning.py": 35,
    "test_lifecycle.py": 32,
    "test_benchmark_tools.py": 25,
    "test_math.py": 18,
    "test_evals.py": 18,
    "test_bad_input.py": 13,
    "test_utils.py": 4,
    "test_house_rules.py": 3,
    "test_memory.py": 1,
    "test_docs.py": 0,
}


def pytest_collection_modifyitems(config, items):
    """Learning runs beyond one per script (marked `extra_learning`: each env family's PPO run, the docs' longer
    commands, R2D2's memory pair) are deselected unless `-m` names the marker: `pytest -m extra_learning` runs them,
    as docs/contributing.md asks of an issue that changes an algorithm's code, beside benchmark/readme_commands.py.
    Then the longest files first (FILE_SECONDS), each file's tests in their own order."""
    extra = [item for item in items if item.get_closest_marker("extra_learning")]
    if extra and "extra_learning" not in (config.option.markexpr or ""):
        config.hook.pytest_deselected(items=extra)
        items[:] = [item for item in items if not item.get_closest_marker("extra_learning")]
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, float("inf")))  # stable: a file's order kept


def pytest_runtest_setup(item):
    """A test marked `procgen` needs the system Qt 5 runtime: without it, it is skipped (one summary line says why),
    unless CLEANBA_REQUIRE_QT5 is set (.ci/run installed the runtime for these tests): then it fails."""
    if item.get_closest_marker("procgen") and (reason := why_procgen_cannot_start()) is not None:
        if os.environ.get("CLEANBA_REQUIRE_QT5"):
            pytest.fail(f"CLEANBA_REQUIRE_QT5 is set, but Procgen cannot start here: {reason}")
        pytest.skip(f"Procgen: {reason}")


def pytest_terminal_summary(terminalreporter):
    """One line for each group of tests that could not run here for want of system packages, and why: the real-Slurm
    tests (tests/test_slurm.py) and the Procgen ones (read from their skip reports, which reach this process from every
    pytest-xdist worker)."""
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        if not isinstance(report.longrepr, tuple):
            continue
        reason = report.longrepr[2].removeprefix("Skipped: ")
        if report.nodeid.startswith("tests/test_slurm.py"):
            reasons.setdefault("the Slurm tests", [reason, 0])[1] += 1
        elif reason.startswith("Procgen: "):
            reasons.setdefault("the Procgen tests", [reason.removeprefix("Procgen: "), 0])[1] += 1
    for group, (reason, count) in reasons.items():
        terminalreporter.write_line(f"{group} did not run ({count}): {reason}")


@pytest.fixture
def workdir(tmp_path) -> Path:
    return tmp_path


# PPO on CartPole-v1 as in the README: CleanRL's classic-control network (two 64-unit tanh layers), clip 0.2
CARTPOLE_PPO = "--env-id CartPole-v1 --num-steps 128 --hiddens 64 64 --clip-coef 0.2 --learning-rate 1e-3".split()
CARTPOLE_LEARNING = [
    *CARTPOLE_PPO,
    "--num-actor-threads",
    "1",
    "--actor-device-ids",
    "0",
    "--learner-device-ids",
    "1",
    "--total-timesteps",
    "250000",
    "--log-frequency",
    "50",
]


@pytest.fixture(scope="session")
def cartpole_learning_run(tmp_path_factory) -> Run:
    """One 250k-step PPO CartPole run with 8 envs in one process, shared by the tests that need it."""
    return run_script(
        [*CARTPOLE_LEARNING, "--local-num-envs", "8"], tmp_path_factory.mktemp("cartpole"), "one", timeout=400
    )


def best_window(returns: list[tuple[int, float]], env_steps: int) -> float:
    """The best mean of the (env step, value) pairs logged within `env_steps` consecutive env steps: what a run
    "reaches" (stricter than its best single value), as benchmark/readme_commands.py reports it for the docs."""
    sys.path.insert(0, str(REPO / "benchmark"))
    from readme_commands import window_averages

    steps, values = (np.array(column) for column in zip(*returns))
    return window_averages(steps, values, env_steps)[0]


def page_command_flags(name: str, script: Path, page: Path = REPO / "README.md") -> list[str]:
    """The flags of a page's CPU command as benchmark/readme_commands.py names it (`r2d2`, `{algorithm}@{env id}`):
    what a user copies from the README or a docs page, run as written."""
    sys.path.insert(0, str(REPO / "benchmark"))
    from readme_commands import readme_commands

    command = shlex.split(readme_commands(str(page))[name])
    return command[command.index(str(script.relative_to(REPO))) + 1 :]


def untrained_gaussian_return(make_env, env_id: str, episodes: int = 200) -> float:
    """The average return of N(0, 1) actions (clipped to [-3, 3]; the env clips to its bounds), what an untrained
    Gaussian policy does (mean near 0, std 1), counted as the evaluator counts episodes; `make_env` is a script's."""
    from cleanrl_utils.evals.evaluate import run_episodes

    rng = np.random.default_rng(0)
    envs = make_env(env_id, 0, 8, num_threads=1)
    random_policy = lambda obs, key: (np.clip(rng.normal(size=(len(obs), *envs.action_space.shape)), -3, 3), key)
    return float(np.mean(run_episodes(envs, random_policy, episodes, None)))
