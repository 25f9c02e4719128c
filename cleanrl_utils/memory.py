"""Whether a compiled learner program fits the memory of its devices, checked before it first runs.

A program whose buffers do not fit ends a run badly: on a GPU, a RESOURCE_EXHAUSTED traceback; on a CPU, the kernel's
OOM killer (SIGKILL, no message at all; the default Breakout PPO update on a 24 GiB host). `checked_for_memory` wraps a
`jax.jit` function: its first call compiles it ahead of time (the call itself then reuses that executable: nothing
compiles twice), reads what XLA's buffer assignment allocates for it (`compiled.memory_analysis()`, per device), and
raises `OutOfDeviceMemory` (one `error:` line naming the flags that lower it, exit code 2) when that exceeds what the
devices have free: on a GPU or TPU, its allocator's `bytes_limit - bytes_in_use`; on a CPU, the host's `MemAvailable`
(or the cgroup's `memory.max - memory.current` where lower), shared by the process's CPU devices, so their needs add up.
"""

from collections.abc import Callable

from cleanrl_utils.errors import UsageError

GIB = 2**30
# the share of the host's available memory a program on CPU devices may take: the rest of the process grows while it
# runs (a Sebulba run's actor threads step their envs and fill their next rollout)
HOST_SHARE = 0.9


class OutOfDeviceMemory(UsageError):
    """A compiled program needs more memory than its devices have free (one `error:` line, exit code 2)."""


def program_need_bytes(memory_stats) -> int:
    """The bytes one device allocates to run a compiled program (XLA's `CompiledMemoryStats`): its temporary buffers
    and outputs, less the outputs that reuse a donated argument's buffer, plus its code. The arguments are not counted:
    they are on the device already."""
    return (
        memory_stats.temp_size_in_bytes
        + memory_stats.output_size_in_bytes
        - memory_stats.alias_size_in_bytes
        + memory_stats.generated_code_size_in_bytes
    )


def meminfo_available_bytes(meminfo: str) -> int | None:
    """`MemAvailable` of /proc/meminfo's text, in bytes (the kernel's estimate of what can be allocated without
    swapping); None where the line is missing (kernels before 3.14)."""
    for line in meminfo.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # "MemAvailable:   12345678 kB"
    return None


def cgroup_available_bytes(limit: str, current: str) -> int | None:
    """What a cgroup v2 (a container) still allows: its memory.max less its memory.current; None when unlimited."""
    limit, current = limit.strip(), current.strip()
    return int(limit) - int(current) if limit.isdigit() and current.isdigit() else None


def read_text(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def host_available_bytes() -> int | None:
    """What this process can still allocate on the host: the lower of MemAvailable and the cgroup's room (None where
    neither is known, e.g. no /proc)."""
    known = []
    meminfo = read_text("/proc/meminfo")
    if meminfo is not None:
        known.append(meminfo_available_bytes(meminfo))
    limit, current = read_text("/sys/fs/cgroup/memory.max"), read_text("/sys/fs/cgroup/memory.current")
    if limit is not None and current is not None:
        known.append(cgroup_available_bytes(limit, current))
    known = [value for value in known if value is not None]
    return min(known) if known else None


def accelerator_free_bytes(memory_stats: dict | None) -> int | None:
    """What JAX's allocator on a GPU or TPU can still hand out (`device.memory_stats()`): bytes_limit - bytes_in_use;
    None where the device does not say (CPU)."""
    if not memory_stats or "bytes_limit" not in memory_stats:
        return None
    return memory_stats["bytes_limit"] - memory_stats.get("bytes_in_use", 0)


def shortfall(need: int, devices: list, host_free: Callable[[], int | None]) -> tuple[int, int, str] | None:
    """(need, free, where) of the memory that `need` bytes on each of `devices` do not fit, or None when they fit (or
    nothing is known). The CPU devices of a process share the host's memory: their needs add up, against
    HOST_SHARE of what `host_free()` says is available."""
    cpus = [device for device in devices if device.platform == "cpu"]
    for device in devices:
        if device.platform != "cpu":
            free = accelerator_free_bytes(device.memory_stats())
            if free is not None and need > free:
                return need, free, f"free on {device}"
    if cpus:
        available = host_free()
        free = None if available is None else int(available * HOST_SHARE)
        if free is not None and need * len(cpus) > free:
            shared = f", shared by {len(cpus)} CPU devices" if len(cpus) > 1 else ""
            return need * len(cpus), free, f"this host can give it ({HOST_SHARE:.0%} of its available memory{shared})"
    return None


def check_fits(compiled, name: str, lower_it: str, host_free: Callable[[], int | None] = host_available_bytes):
    """Raises OutOfDeviceMemory when `compiled` (a `jax.stages.Compiled`) does not fit the free memory of this
    process's devices that it runs on; `name`: the program, `lower_it`: the flags that lower its memory."""
    import jax

    devices = {device for sharding in jax.tree.leaves(compiled.input_shardings) for device in sharding.device_set}
    local = sorted((d for d in devices if d.process_index == jax.process_index()), key=lambda d: d.id)
    missing = shortfall(program_need_bytes(compiled.memory_analysis()), local, host_free)
    if missing is not None:
        need, free, where = missing
        raise OutOfDeviceMemory(
            f"{name} needs {need / GIB:,.1f} GiB of memory, more than the {free / GIB:,.1f} GiB {where}: {lower_it}"
        )


def checked_for_memory(jitted: Callable, lower_it: str, name: str = "the learner's update") -> Callable:
    """`jitted` (a `jax.jit` function), whose first call (for each value of its static keyword arguments, e.g. a
    replay learner's `train`) first checks that its compiled program fits the free memory of its devices
    (`check_fits`: OutOfDeviceMemory otherwise; `lower_it`: the flags that lower its memory). The check compiles the
    program ahead of time; the call after it finds that executable in jit's cache: nothing compiles twice."""
    checked = set()

    def call(*args, **static):
        key = tuple(sorted(static.items()))
        if key not in checked:
            check_fits(jitted.lower(*args, **static).compile(), name, lower_it)
            checked.add(key)
        return jitted(*args, **static)

    return call
