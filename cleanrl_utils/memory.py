"""Whether a compiled learner program fits the memory of its devices, checked before it first runs.

A program whose buffers do not fit ends a run badly: on a GPU, a RESOURCE_EXHAUSTED traceback; on a CPU, the kernel's
OOM killer (SIGKILL, no message at all; the default Breakout PPO update on a 24 GiB host). `checked_for_memory` wraps a
`jax.jit` function: its first call compiles it ahead of time (the call itself then reuses that executable: nothing
compiles twice), reads what XLA's buffer assignment allocates for it (`compiled.memory_analysis()`, per device), and
raises `OutOfDeviceMemory` (one `error:` line naming the flags that lower it, exit code 2) when that exceeds what the
devices have free: on a GPU or TPU, its allocator's `bytes_limit - bytes_in_use`; on a CPU, the host's `MemAvailable`
or, where lower, the room this process's cgroup and each of its ancestors leave (a container, a systemd scope, a
Slurm job under task/cgroup: `own_cgroup_memory`, cgroup v1 and v2), shared by the process's CPU devices, so their
needs add up.
"""

import os
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


UNLIMITED = 2**62  # cgroup v1 writes "no limit" as 9223372036854771712
# the files of a cgroup's limit and usage, and memory.stat's counter of its reclaimable page cache, by version
CGROUP_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def own_cgroup_folders(self_cgroup: str, mountinfo: str, root: str = "") -> list[tuple[str, str]]:
    """(folder, version) of this process's cgroup in each hierarchy that may hold the memory controller, and of each
    ancestor up to the hierarchy's mount, innermost first. /proc/self/cgroup's lines give the paths (v1:
    `N:...memory...:/path`; v2: `0::/path`); /proc/self/mountinfo gives where each hierarchy is mounted (fields 4 and
    5: the root it mounts and the mount point; after " - ": the type, the source, the options). A path outside the
    mounted root (a container's own namespace) is the mount itself. `root` prefixes the paths (a test's fake tree)."""
    mounts = []  # (type, options, mounted root, mount point)
    for line in mountinfo.splitlines():
        fields, _, after = line.partition(" - ")
        fields, after = fields.split(), after.split()
        if len(fields) >= 5 and len(after) >= 3 and after[0] in ("cgroup", "cgroup2"):
            mounts.append((after[0], after[2].split(","), fields[3], fields[4]))
    found = []
    for line in self_cgroup.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        version = "v2" if hierarchy == "0" else "v1"
        if version == "v1" and "memory" not in controllers.split(","):
            continue
        for kind, options, mounted_root, mount_point in mounts:
            if kind != {"v1": "cgroup", "v2": "cgroup2"}[version] or (version == "v1" and "memory" not in options):
                continue
            relative = path[len(mounted_root) :] if path.startswith(mounted_root) else ""
            top = os.path.normpath(root + mount_point)
            folder = os.path.normpath(f"{top}/{relative.strip('/')}")
            while folder.startswith(top):
                found.append((folder, version))
                if folder == top:
                    break
                folder = os.path.dirname(folder)
    return found


def cgroup_limit_and_usage(limit: str, usage: str, stat: str, version: str) -> tuple[int, int] | None:
    """A cgroup's memory limit and usage (its files' texts), the usage less its inactive page cache (reclaimable:
    memory.stat's `inactive_file`, v1's `total_inactive_file`); None when unlimited (v2's "max", v1's 2**63 - 1
    rounded to pages)."""
    limit, usage = limit.strip(), usage.strip()
    if not (limit.isdigit() and usage.isdigit()) or int(limit) >= UNLIMITED:
        return None
    counters = dict(line.split(maxsplit=1) for line in stat.splitlines() if " " in line)
    inactive = int(counters.get(CGROUP_FILES[version][2], "0"))
    return int(limit), max(0, int(usage) - inactive)


def own_cgroup_memory(root: str = "") -> list[tuple[int, int]]:
    """(limit, usage) of each of this process's cgroups, and their ancestors, that limit memory (`own_cgroup_folders`,
    `cgroup_limit_and_usage`); `root` prefixes every path read (a test's fake tree)."""
    self_cgroup, mountinfo = read_text(f"{root}/proc/self/cgroup"), read_text(f"{root}/proc/self/mountinfo")
    if self_cgroup is None or mountinfo is None:
        return []
    found = []
    for folder, version in own_cgroup_folders(self_cgroup, mountinfo, root):
        limit_file, usage_file, _ = CGROUP_FILES[version]
        limit, usage = read_text(f"{folder}/{limit_file}"), read_text(f"{folder}/{usage_file}")
        if limit is not None and usage is not None:
            level = cgroup_limit_and_usage(limit, usage, read_text(f"{folder}/memory.stat") or "", version)
            found += [level] if level is not None else []
    return found


def read_text(path: str) -> str | None:
    """A file's text, None if it cannot be read. Bytes that are not UTF-8 (a mount point's name in
    /proc/self/mountinfo may be any bytes) come back as surrogate escapes, which `open` turns back into those bytes."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as file:
            return file.read()
    except OSError:
        return None


def host_available_bytes(root: str = "") -> int | None:
    """What this process can still allocate on the host: the lower of MemAvailable and the room each of its cgroups
    leaves (None where neither is known, e.g. no /proc)."""
    meminfo = read_text(f"{root}/proc/meminfo")
    known = [meminfo_available_bytes(meminfo) if meminfo is not None else None]
    known += [limit - usage for limit, usage in own_cgroup_memory(root)]
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


def check_copies_fit(tree, copies: int, name: str, lower_it: str, host_free: Callable[[], int | None] = None):
    """Raises OutOfDeviceMemory when `copies` more of `tree` (global arrays: each device's part of them) do not fit
    the free memory of this process's devices that hold it; checked before they are made (e.g. the learner states of
    an Anakin run's --num-seeds, before the first seed's is copied)."""
    import jax

    leaves = jax.tree.leaves(tree)
    local = sorted({shard.device for leaf in leaves for shard in leaf.addressable_shards}, key=lambda d: d.id)
    need = copies * sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == local[0])
    missing = shortfall(need, local, host_free or host_available_bytes)
    if missing is not None:
        need, free, where = missing
        raise OutOfDeviceMemory(
            f"{name} need {need / GIB:,.1f} GiB of memory, more than the {free / GIB:,.1f} GiB {where}: {lower_it}"
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
