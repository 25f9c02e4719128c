"""What the tools in benchmark/ share: the files they read (JSON lines and scripts, a missing or binary one named by
its flag), timed runs and whether a record's machine was quiet, run folders, TensorBoard scalars, figures, the machine
a record ran on, the README's commands. Each tool's entry is `cleanrl_utils.cli.run_cli` (`run_main` for
train_in_parts.py's argparse and haiku_init.py's script), so bad input is one `error:` line with exit code 2
everywhere (tests/test_benchmark_tools.py runs each tool's); `fail` and `read_input` come from there too.

A tool imports it as `tool_helpers`: a script's folder is first on its `sys.path` (the tests put benchmark/ there).
matplotlib and TensorBoard are imported where used.
"""

import json
import os
import platform
import re
import resource
import shlex
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cleanrl_utils.cli import fail, read_input
from cleanrl_utils.errors import RunError, UsageError


def read_records(path, flag: str, keys: tuple[str, ...] = ()) -> list[dict]:
    """The records of a results file the user named with `flag`: one JSON object a line (blank lines skipped), each
    with `keys` (a results file of another tool has others)."""
    records = []
    for number, line in enumerate(read_input(path, flag, "JSON lines, one record each").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            fail(f"{flag} {path}: line {number} is not a JSON object; expected JSON lines, one record each")
        missing = [key for key in keys if key not in record]
        if missing:
            fail(f"{flag} {path}: line {number} has no {', '.join(missing)}: not a record of this tool")
        records.append(record)
    return records


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process of the machine has used since boot (/proc/stat: all but idle and I/O wait), or None
    where there is no /proc/stat."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's ended children and their descendants (what the runs a tool starts used)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class TimedRun(NamedTuple):
    process: subprocess.CompletedProcess
    wall: float  # seconds, start to exit
    other_load: float | None  # the CPU cores other processes kept busy meanwhile, on average (None: not measurable)


def timed_process(argv: list[str], env: dict | None = None) -> TimedRun:
    """A run a tool starts, printed first, its output captured, timed, and how busy the rest of the machine kept the
    CPU meanwhile (a wall time measured beside other load is not a quiet machine's); a RunError (exit 1) with its
    stderr's end if it failed."""
    print(f"running: {shlex.join(argv)}", flush=True)
    busy_before, ours_before, start = busy_cpu_seconds(), children_cpu_seconds(), time.time()
    process = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall, busy_after = time.time() - start, busy_cpu_seconds()
    if process.returncode != 0:
        raise RunError(f"{shlex.join(argv)} exited with {process.returncode}: {process.stderr[-2000:]}")
    ours = children_cpu_seconds() - ours_before
    other = None if busy_before is None else max(0.0, (busy_after - busy_before - ours) / wall)
    return TimedRun(process, wall, other)


QUIET_LOAD_CORES = 0.25


def quiet(record: dict) -> bool:
    """Whether a benchmark record's wall time is a quiet machine's: other processes kept at most a quarter of a core
    busy during its run. A record without the measurement (from before it was made, or where /proc/stat is missing)
    is not: nothing says its machine was quiet."""
    load = record.get("other_load_cores")
    return load is not None and load <= QUIET_LOAD_CORES


def python_script(path, flag: str) -> Path:
    """`path`, checked to be a Python script this interpreter can run (a file of UTF-8 text that compiles): one line
    naming `flag` otherwise, before any import or run."""
    if Path(path).suffix != ".py":
        fail(f"{flag} {path}: not a Python script (.py)")
    try:
        compile(read_input(path, flag, "a Python script"), str(path), "exec")
    except (SyntaxError, ValueError) as error:  # ValueError: a NUL byte
        fail(f"{flag} {path}: not a Python script this Python can run ({error})")
    return Path(path)


def check_each(flag: str, values, check):
    """`check(value)` for each value of a tool's list flag, its UsageError's line naming the tool's flag too (the
    check names the scripts' own flag, e.g. --env-id for a tool's --env-ids)."""
    for value in values:
        try:
            check(value)
        except UsageError as error:
            fail(f"{flag}: {error}")


# pgx's MinAtar PPO example (sotetsuk/pgx, examples/minatar-ppo/assets/*.png, its README's plots): the last point of
# each curve at 20M steps, read from the plot (the evaluation return of the sampled policy, one episode in each of 100
# envs, mean over its seeds; the plots' bands are not given as numbers, so std is None)
PGX_MINATAR_PPO = {
    "minatar-breakout": (50.0, None),
    "minatar-asterix": (22.3, None),
    "minatar-freeway": (63.5, None),
    "minatar-seaquest": (54.3, None),
    "minatar-space_invaders": (144.5, None),
}


def find_runs(runs_dir: str, env_id: str, exp_name: str) -> dict[int, Path]:
    """seed -> the newest run directory of (env_id, exp_name, seed), by the default run name
    {env_id}__{exp_name}__{seed}__{unix time}."""
    newest: dict[int, tuple[int, Path]] = {}
    for path in Path(runs_dir).glob(f"{env_id}__{exp_name}__*__*"):
        parts = path.name.split("__")
        if len(parts) != 4 or parts[1] != exp_name or not (parts[2].isdigit() and parts[3].isdigit()):
            continue
        seed, started = int(parts[2]), int(parts[3])
        if seed not in newest or started > newest[seed][0]:
            newest[seed] = (started, path)
    if not newest:
        fail(f"no runs of --exp-names {exp_name} on {env_id} in {runs_dir}/")
    return {seed: path for seed, (_, path) in sorted(newest.items())}


def read_run(run_dir: Path, tag: str, since: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, seconds since `since` (a unix time; default: the run's first event), values) of one scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(run_dir).is_dir():  # a results file's run folder that is gone (another machine's, or removed)
        fail(f"{run_dir}: no such run folder (run from the folder the runs were made in)")
    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    if tag not in accumulator.Tags()["scalars"]:
        fail(f"{run_dir} has no scalar {tag}")
    events = accumulator.Scalars(tag)
    start = accumulator.FirstEventTimestamp() if since is None else since
    return (
        np.array([e.step for e in events]),
        np.array([e.wall_time - start for e in events]),
        np.array([e.value for e in events]),
    )


def mean_and_spread(xs: list[np.ndarray], ys: list[np.ndarray]):
    """Each seed interpolated onto a common grid over the x range that all seeds cover."""
    grid = np.linspace(max(x[0] for x in xs), min(x[-1] for x in xs), 200)
    on_grid = np.stack([np.interp(grid, x, y) for x, y in zip(xs, ys)])
    return grid, on_grid.mean(0), on_grid.min(0), on_grid.max(0)


def pyplot():
    """matplotlib.pyplot, drawing into files only (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(figure, output: str):
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    print(f"wrote {output} ({Path(output).stat().st_size // 1024} KB)")


def processor() -> str:
    """The CPU's model name (a seed's run depends on it: XLA's CPU code differs between processors)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def accelerator() -> str | None:
    """The GPU's name (nvidia-smi), or None on a machine without one."""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True)
    except OSError:
        return None
    return names.stdout.decode().strip().splitlines()[0] if names.returncode == 0 and names.stdout.strip() else None


def machine() -> dict:
    """What a record says of where it ran: the processor, and the GPU where there is one."""
    return {"processor": processor(), **({"accelerator": gpu} if (gpu := accelerator()) else {})}


def readme_training_commands(readme: str) -> list[str]:
    """The README's CPU training commands, in order (continuation lines joined; `pip install uv && ` dropped; the GPU
    command, with `--extra`, skipped)."""
    blocks = re.findall(r"```bash\n(.*?)```", read_input(readme, "--readme", "the README (Markdown)"), flags=re.S)
    lines = [
        " ".join(line.replace("pip install uv && ", "").split())
        for b in blocks
        for line in b.replace("\\\n", " ").splitlines()
    ]
    return [line for line in lines if "cleanba/cleanba_" in line and "--env-id" in line and "--extra" not in line]
