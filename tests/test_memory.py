"""The memory check of a compiled learner program (cleanrl_utils/memory.py): its arithmetic on fake devices, what it
reads from the host, and the wrapper on real programs (one larger than any host). A whole run stopped by it:
tests/test_reliability.py."""

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cleanrl_utils.errors import UsageError
from cleanrl_utils.memory import (
    HOST_SHARE,
    OutOfDeviceMemory,
    checked_for_memory,
    host_available_bytes,
    meminfo_available_bytes,
    own_cgroup_folders,
    own_cgroup_memory,
    program_need_bytes,
    shortfall,
)

GIB = 2**30


class FakeDevice:
    """A device as JAX shows one: its platform and, on a GPU, its allocator's statistics."""

    def __init__(self, platform: str, stats: dict | None = None, index: int = 0):
        self.platform, self.stats, self.index = platform, stats, index

    def memory_stats(self):
        return self.stats

    def __str__(self):
        return f"cuda:{self.index}"


def test_the_need_is_temporaries_and_new_outputs_and_code_not_arguments():
    stats = SimpleNamespace(
        temp_size_in_bytes=5 * GIB,
        output_size_in_bytes=3 * GIB,
        alias_size_in_bytes=2 * GIB,  # outputs written into donated arguments' buffers
        generated_code_size_in_bytes=1024,
        argument_size_in_bytes=100 * GIB,  # on the device already
    )
    assert program_need_bytes(stats) == 6 * GIB + 1024


def test_what_a_gpu_has_free_is_its_limit_less_what_is_in_use():
    gpu = FakeDevice("gpu", {"bytes_limit": 4 * GIB, "bytes_in_use": 2 * GIB, "peak_bytes_in_use": 3 * GIB})
    assert shortfall(3 * GIB, [gpu], host_free=lambda: None) == (3 * GIB, 2 * GIB, "free on cuda:0")
    assert shortfall(2 * GIB, [gpu], host_free=lambda: None) is None
    two = [FakeDevice("gpu", {"bytes_limit": 8 * GIB}), FakeDevice("gpu", {"bytes_limit": 2 * GIB}, index=1)]
    assert shortfall(3 * GIB, two, host_free=lambda: None) == (3 * GIB, 2 * GIB, "free on cuda:1")  # the tighter
    assert shortfall(10**15, [FakeDevice("tpu", None)], host_free=lambda: None) is None  # a device that does not say


def test_the_cpu_devices_of_a_process_share_a_share_of_the_hosts_available_memory():
    cpus = [FakeDevice("cpu", index=i) for i in range(3)]
    host = lambda: 10 * GIB  # noqa: E731
    usable = int(10 * GIB * HOST_SHARE)
    assert shortfall(4 * GIB, cpus[:2], host) is None  # 8 GiB of 9
    assert shortfall(12 * GIB, cpus[:1], host) == (
        12 * GIB,
        usable,
        "this host can give it (90% of its available memory)",
    )
    assert shortfall(4 * GIB, cpus, host) == (
        12 * GIB,
        usable,
        "this host can give it (90% of its available memory, shared by 3 CPU devices)",
    )
    assert shortfall(10**15, cpus, host_free=lambda: None) is None  # nothing known: no check


def test_the_hosts_available_memory_from_proc_meminfo():
    meminfo = "MemTotal:       24684092 kB\nMemFree:        20509760 kB\nMemAvailable:   21718448 kB\n"
    assert meminfo_available_bytes(meminfo) == 21718448 * 1024
    assert meminfo_available_bytes("MemTotal:       24684092 kB\n") is None  # kernels before 3.14
    with open("/proc/meminfo") as file:
        total = int(file.read().split("MemTotal:")[1].split()[0]) * 1024
    assert 0 < host_available_bytes() <= total


def fake_host(root, self_cgroup: str, mountinfo: str, cgroups: dict[str, dict[str, str]]) -> str:
    """A host's /proc and cgroup files under `root`: /proc/self/cgroup, /proc/self/mountinfo, 24 GiB available, and
    each cgroup folder's files ({folder: {file: text}})."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(self_cgroup)
    (root / "proc" / "self" / "mountinfo").write_text(mountinfo)
    (root / "proc" / "meminfo").write_text(f"MemAvailable:   {24 * GIB // 1024} kB\n")
    for folder, files in cgroups.items():
        (root / folder.strip("/")).mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (root / folder.strip("/") / name).write_text(text)
    return str(root)


V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
V2_MOUNT = "28 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
UNLIMITED_V1 = "9223372036854771712\n"


def test_a_cgroup_v1_job_and_its_ancestors_limit_the_room(tmp_path):
    """A Slurm job under task/cgroup (cgroup v1): the job's limit, and its user's lower limit above it; the usage less
    the inactive page cache, which the kernel reclaims before it kills."""
    memory = "/sys/fs/cgroup/memory"
    root = fake_host(
        tmp_path,
        "4:memory:/slurm/uid_0/job_7/step_0/task_0\n1:cpu:/\n0::/\n",
        V1_MOUNTS,
        {
            f"{memory}/slurm/uid_0/job_7/step_0/task_0": {
                "memory.limit_in_bytes": UNLIMITED_V1,
                "memory.usage_in_bytes": str(GIB),
            },
            f"{memory}/slurm/uid_0/job_7": {
                "memory.limit_in_bytes": str(3 * GIB),
                "memory.usage_in_bytes": str(2 * GIB),
                "memory.stat": f"cache 123\ntotal_inactive_file {GIB // 2}\n",
            },
            f"{memory}/slurm/uid_0": {"memory.limit_in_bytes": str(8 * GIB), "memory.usage_in_bytes": str(7 * GIB)},
            memory: {"memory.limit_in_bytes": UNLIMITED_V1, "memory.usage_in_bytes": str(9 * GIB)},
        },
    )
    assert own_cgroup_memory(root) == [(3 * GIB, GIB + GIB // 2), (8 * GIB, 7 * GIB)]
    assert host_available_bytes(root) == GIB  # the user's room: 8 - 7 GiB, less than the job's 1.5 and the host's 24


def test_a_cgroup_v2_scope_and_a_container_namespace_limit_the_room(tmp_path):
    """cgroup v2: a systemd scope's memory.max (an ancestor without memory files counts for nothing); a container
    whose cgroup namespace shows `0::/` and mounts its own cgroup as the root: the mount's files."""
    scope = "/sys/fs/cgroup/user.slice/run-r1.scope"
    files = {"memory.max": str(3 * GIB), "memory.current": str(GIB), "memory.stat": f"inactive_file {GIB // 4}\n"}
    root = fake_host(
        tmp_path / "scope",
        "0::/user.slice/run-r1.scope\n",
        V2_MOUNT,
        {scope: files, "/sys/fs/cgroup/user.slice": {}, "/sys/fs/cgroup": {"memory.current": str(5 * GIB)}},
    )
    assert own_cgroup_memory(root) == [(3 * GIB, GIB - GIB // 4)]
    assert host_available_bytes(root) == 3 * GIB - (GIB - GIB // 4)
    container = fake_host(
        tmp_path / "container",
        "0::/\n",
        "28 23 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n",
        {"/sys/fs/cgroup": {"memory.max": str(2 * GIB), "memory.current": str(GIB)}},
    )
    assert own_cgroup_memory(container) == [(2 * GIB, GIB)]
    unlimited = fake_host(
        tmp_path / "unlimited",
        "0::/a\n",
        V2_MOUNT,
        {"/sys/fs/cgroup/a": {"memory.max": "max\n", "memory.current": "1"}},
    )
    assert own_cgroup_memory(unlimited) == [] and host_available_bytes(unlimited) == 24 * GIB


def test_mount_points_whose_names_are_not_utf8_are_read_as_their_bytes(tmp_path):
    """Linux allows any bytes in a name, and /proc/self/mountinfo carries them as they are: a mount point that is not
    UTF-8 (here a Latin-1 one, beside the cgroup's, and the cgroup's own) neither stops the check nor hides a limit."""
    cgroup = b"/sys/fs/cgroup/caf\xe9"  # the cgroup hierarchy, mounted at a Latin-1 name
    root = fake_host(tmp_path, "0::/job\n", "", {})
    mounts = b"40 23 0:50 / /media/caf\xe9 rw - vfat /dev/sdb1 rw\n28 23 0:26 / %s rw - cgroup2 cgroup2 rw\n" % cgroup
    (tmp_path / "proc" / "self" / "mountinfo").write_bytes(mounts)
    job = os.fsencode(tmp_path) + cgroup + b"/job"
    os.makedirs(job)
    for name, value in [(b"memory.max", 3 * GIB), (b"memory.current", GIB)]:
        with open(job + b"/" + name, "w") as file:
            file.write(str(value))
    assert own_cgroup_memory(root) == [(3 * GIB, GIB)]
    assert host_available_bytes(root) == 2 * GIB


def test_this_hosts_own_cgroups_are_found():
    """The real /proc/self/cgroup and mountinfo: the innermost memory cgroup first, up to its hierarchy's mount."""
    with open("/proc/self/cgroup") as cgroup, open("/proc/self/mountinfo") as mountinfo:
        folders = own_cgroup_folders(cgroup.read(), mountinfo.read())
    memory_folders = [folder for folder, _ in folders if os.path.exists(os.path.join(folder, "memory.stat"))]
    assert memory_folders, folders
    assert all(os.path.isdir(folder) for folder, _ in folders), folders


def test_the_checked_program_is_the_jitted_one_compiled_once_with_its_donation():
    traces = []

    def double_and_total(x, y):
        traces.append(x.shape)
        return x * 2, (x @ y).sum()

    jitted = jax.jit(double_and_total, donate_argnums=(0,))
    checked = checked_for_memory(jitted, "lower --nothing")
    x, y = jnp.arange(16.0).reshape(4, 4), jnp.ones((4, 4))
    expected = (np.arange(16.0).reshape(4, 4) * 2, (np.arange(16.0).reshape(4, 4) @ np.ones((4, 4))).sum())
    doubled, total = checked(x, y)
    np.testing.assert_array_equal(doubled, expected[0])
    assert float(total) == expected[1]
    assert x.is_deleted()  # the donated argument: the wrapper keeps jit's donation
    checked(jnp.ones((4, 4)), y)
    assert len(traces) == 1 and jitted._cache_size() == 1  # the check's compile is the one jit runs


def test_a_program_larger_than_the_host_stops_before_it_runs():
    def huge(x):  # a sort of 2**38 float32s: a 1 TiB temporary (a sort cannot be fused away)
        return jnp.sort(jnp.broadcast_to(x, (2**18, 2**20)), axis=0)[0]

    checked = checked_for_memory(jax.jit(huge), "lower --huge", name="the huge program")
    with pytest.raises(OutOfDeviceMemory) as error_info:
        checked(jnp.ones(2**20))
    assert isinstance(error_info.value, UsageError)  # one `error:` line, exit code 2
    assert str(error_info.value).startswith("the huge program needs 1,024.0 GiB of memory, more than the ")
    assert str(error_info.value).endswith(" GiB this host can give it (90% of its available memory): lower --huge")
