"""benchmark/device_kit.py on small fake wheels (no network): the trimming (the dropped families' folders and the
libraries only they link, the registration module, METADATA, a RECORD that matches, installable by pip or uv), the
kit built against a lock (versions by Python 3.12's markers, sha256 checked), its manifest and size checks, bad input
as one `error:` line; the real KIT against the real uv.lock; and benchmark/gpu.sh's install of a kit."""

import csv
import hashlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, script_env

sys.path.insert(0, str(REPO / "benchmark"))
import device_kit  # noqa: E402
from device_kit import KitArgs, Part, check_kit, read_record, record_hash, trim_wheel  # noqa: E402

from cleanrl_utils.errors import RunError, UsageError  # noqa: E402

ENTRY = """# the registration of every family
import fakepool.atari.registration  # noqa: F401
import fakepool.mujoco.gym.registration  # noqa: F401
import fakepool.procgen.registration  # noqa: F401
"""


def registration(family: str) -> str:
    return f"from fakepool.registry import FAMILIES\n\nFAMILIES.append({family!r})\n"


FAKEPOOL = {  # a wheel shaped as envpool's: families in subfolders, vendored libraries that some of them link
    "fakepool/__init__.py": "import fakepool.entry  # noqa: F401\nfrom fakepool.registry import FAMILIES\n",
    "fakepool/registry.py": "FAMILIES = []\n",
    "fakepool/entry.py": ENTRY,
    "fakepool/python/api.py": "API = 1\n",
    "fakepool/atari/__init__.py": "",
    "fakepool/atari/registration.py": registration("atari"),
    "fakepool/atari/atari_envpool.so": b"\x7fELF atari libshared-9a.so.1\x00libc.so.6\x00",
    "fakepool/mujoco/__init__.py": "",
    "fakepool/mujoco/gym/__init__.py": "",
    "fakepool/mujoco/gym/registration.py": registration("mujoco"),
    "fakepool/mujoco/mujoco_envpool.so": b"\x7fELF mujoco libshared-9a.so.1\x00",
    "fakepool/procgen/__init__.py": "",
    "fakepool/procgen/registration.py": registration("procgen"),
    "fakepool/procgen/procgen_envpool.so": b"\x7fELF procgen libQt6Core-1b.so.6\x00",
    "fakepool.libs/libQt6Core-1b.so.6": b"\x7fELF qt" * 100,
    "fakepool.libs/libshared-9a.so.1": b"\x7fELF shared",
    "fakepool-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: fakepool\nVersion: 1.0\n"
    "Requires-Dist: numpy>=1.19\nRequires-Dist: fake-assets-mujoco<2,>=1\nRequires-Dist: glfw>=2\n",
    "fakepool-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    "fakepool-1.0.dist-info/top_level.txt": "fakepool\n",
}
TRIM = Part(
    "fakepool",
    "test",
    keep=("python", "atari"),
    entry="fakepool/entry.py",
    drop_requires=("fake-assets-mujoco", "glfw"),
)


def make_wheel(folder: Path, name: str, files: dict) -> Path:
    """A wheel of `files` (text or bytes) with a RECORD that matches them."""
    data = {path: content.encode() if isinstance(content, str) else content for path, content in files.items()}
    dist_info = next(path.split("/")[0] for path in data if path.split("/")[0].endswith(".dist-info"))
    record = io.StringIO()
    for path, content in data.items():
        csv.writer(record, lineterminator="\n").writerow([path, record_hash(content), len(content)])
    record.write(f"{dist_info}/RECORD,,\n")
    data[f"{dist_info}/RECORD"] = record.getvalue().encode()
    path = folder / name
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for member, content in data.items():
            wheel.writestr(member, content)
    return path


def install(wheel: Path, target: Path):
    """pip install --no-index --no-deps --target, as gpu.sh does (uv's installer where this Python has no pip)."""
    if importlib.util.find_spec("pip"):
        argv = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target)]
    elif shutil.which("uv"):
        argv = ["uv", "pip", "install", "-q", "--offline", "--no-index", "--no-deps", "--python", sys.executable]
        argv += ["--target", str(target)]
    else:
        pytest.skip("neither pip nor uv to install a wheel with")
    completed = subprocess.run([*argv, str(wheel)], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr


def test_trimming_keeps_the_named_families_and_gives_a_wheel_that_installs(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    source = make_wheel(tmp_path / "in", "fakepool-1.0-py3-none-any.whl", FAKEPOOL)
    assert read_record(source) == []
    report = trim_wheel(source, tmp_path / "out", TRIM)
    trimmed = tmp_path / "out" / source.name
    with zipfile.ZipFile(trimmed) as wheel:
        names = wheel.namelist()
        entry = wheel.read("fakepool/entry.py").decode()
        metadata = wheel.read("fakepool-1.0.dist-info/METADATA").decode()
    assert sorted(names) == sorted(
        [
            name
            for name in FAKEPOOL
            if not name.startswith(("fakepool/mujoco", "fakepool/procgen", "fakepool.libs/libQt"))
        ]
        + ["fakepool-1.0.dist-info/RECORD"]
    )  # the library that a kept binary links stays, Qt (procgen's only) goes
    assert names[-1] == "fakepool-1.0.dist-info/RECORD"
    assert [line for line in entry.splitlines() if line.startswith("import")] == [
        "import fakepool.atari.registration  # noqa: F401"
    ]
    assert "Requires-Dist: numpy>=1.19" in metadata and "mujoco" not in metadata and "glfw" not in metadata
    assert read_record(trimmed) == []
    assert report["dropped_folders"] == [
        "fakepool.libs/libQt6Core-1b.so.6",
        "fakepool/mujoco",
        "fakepool/procgen",
    ]
    assert report["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    install(trimmed, tmp_path / "site")
    imported = subprocess.run(
        [sys.executable, "-c", "import fakepool; print(fakepool.FAMILIES)"],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert imported.stdout.strip() == "['atari']", imported.stderr


def test_read_record_names_a_file_that_does_not_match_its_row(tmp_path):
    files = {"pkg/a.py": "A = 1\n", "pkg-1.0.dist-info/METADATA": "Name: pkg\n"}
    wheel = make_wheel(tmp_path, "pkg-1.0-py3-none-any.whl", files)
    changed = tmp_path / "changed.whl"
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(changed, "w") as out:
        for name in source.namelist():
            out.writestr(name, b"A = 2\n" if name == "pkg/a.py" else source.read(name))
        out.writestr("pkg/extra.py", "")
    assert read_record(changed) == [
        "changed.whl: pkg/a.py does not match its RECORD row",
        "changed.whl: pkg/extra.py is not in RECORD",
    ]


@pytest.mark.parametrize("layout", ["kept folder gone", "entry imports none kept"])
def test_trimming_refuses_a_wheel_whose_layout_changed(tmp_path, layout):
    files = dict(FAKEPOOL)
    if layout == "kept folder gone":
        files = {name: content for name, content in files.items() if not name.startswith("fakepool/atari/")}
    else:
        files["fakepool/entry.py"] = "import fakepool.procgen.registration\n"
    source = make_wheel(tmp_path, "fakepool-1.0-py3-none-any.whl", files)
    (tmp_path / "out").mkdir()
    with pytest.raises(RunError, match="layout changed"):
        trim_wheel(source, tmp_path / "out", TRIM)


def fake_lock(tmp_path: Path, wheels: dict[str, Path]) -> Path:
    """A uv.lock of fakepool 1.0 and of fakedep 0.9 (Python < 3.12) and 1.0 (3.12 on), with the wheels' sha256."""

    def files(*names):
        rows = []
        for name in names:
            sha256 = hashlib.sha256(wheels[name].read_bytes()).hexdigest() if name in wheels else "0" * 64
            rows.append(f'{{ url = "wheels/{name}", hash = "sha256:{sha256}", size = 1 }}')
        return ", ".join(rows)

    lock = tmp_path / "uv.lock"
    lock.write_text(
        f"""version = 1
[[package]]
name = "fakepool"
version = "1.0"
wheels = [{files("fakepool-1.0-py3-none-any.whl", "fakepool-1.0-cp311-cp311-win_amd64.whl")}]

[[package]]
name = "fakedep"
version = "0.9"
resolution-markers = ["python_full_version < '3.12'"]
wheels = [{files("fakedep-0.9-py3-none-any.whl")}]

[[package]]
name = "fakedep"
version = "1.0"
resolution-markers = ["python_full_version >= '3.13'", "python_full_version == '3.12.*'"]
wheels = [{files("fakedep-1.0-py3-none-any.whl")}]
"""
    )
    return lock


@pytest.fixture
def fake_kit(tmp_path, monkeypatch):
    """KIT as fakepool (trimmed) and fakedep, their wheels in tmp/wheels, a lock of them: the arguments of a build."""
    (tmp_path / "wheels").mkdir()
    pool = make_wheel(tmp_path / "wheels", "fakepool-1.0-py3-none-any.whl", FAKEPOOL)
    dep = make_wheel(tmp_path / "wheels", "fakedep-1.0-py3-none-any.whl", {"fakedep-1.0.dist-info/METADATA": "x\n"})
    make_wheel(tmp_path / "wheels", "fakedep-0.9-py3-none-any.whl", {"fakedep-0.9.dist-info/METADATA": "y\n"})
    lock = fake_lock(tmp_path, {pool.name: pool, dep.name: dep})
    monkeypatch.setattr(device_kit, "KIT", [TRIM, Part("fakedep", "fakepool's")])
    return KitArgs(output=tmp_path / "kit", wheels=tmp_path / "wheels", lock=lock)


def test_a_kit_is_the_locked_wheels_for_python_3_12_with_a_manifest_that_checks(fake_kit, capsys):
    assert device_kit.main(fake_kit) == 0
    kit = fake_kit.output
    manifest = json.loads((kit / "manifest.json").read_text())
    assert [(w["name"], w["version"], w["file"]) for w in manifest["wheels"]] == [
        ("fakepool", "1.0", "fakepool-1.0-py3-none-any.whl"),
        ("fakedep", "1.0", "fakedep-1.0-py3-none-any.whl"),  # 3.12's version, not 0.9
    ]
    assert manifest["wheels"][0]["trimmed"]["kept"] == ["python", "atari"]
    assert manifest["total_bytes"] == sum((kit / w["file"]).stat().st_size for w in manifest["wheels"])
    assert manifest["left_out"] and check_kit(kit) == []
    printed = capsys.readouterr().out
    assert "kit: 2 wheels" in printed and "MiB of 64 MiB" in printed
    assert device_kit.main(fake_kit) == 0  # an earlier kit in --output is replaced
    with open(kit / "fakedep-1.0-py3-none-any.whl", "ab") as wheel:
        wheel.write(b"!")
    (kit / "stray-1.0-py3-none-any.whl").write_bytes(b"")
    (kit / "fakepool-1.0-py3-none-any.whl").unlink()
    assert check_kit(kit) == [
        "fakepool-1.0-py3-none-any.whl: missing",
        "fakedep-1.0-py3-none-any.whl: not the manifest's (bytes or sha256)",
        "stray-1.0-py3-none-any.whl: not in the manifest",
        f"total {(kit / 'fakedep-1.0-py3-none-any.whl').stat().st_size} bytes, the manifest says "
        f"{manifest['total_bytes']}",
    ]


def test_a_kit_over_the_budget_or_from_a_changed_wheel_is_a_run_error(fake_kit):
    fake_kit.budget_mib = 0.001
    with pytest.raises(RunError, match="exceed --budget-mib 0.001"):
        device_kit.main(fake_kit)
    fake_kit.budget_mib = 64
    with open(fake_kit.wheels / "fakedep-1.0-py3-none-any.whl", "ab") as wheel:
        wheel.write(b"!")
    with pytest.raises(RunError, match="sha256 is not uv.lock's"):
        device_kit.main(fake_kit)


def test_a_kit_refuses_missing_wheels_and_a_folder_that_is_not_a_kit(fake_kit):
    (fake_kit.wheels / "fakedep-1.0-py3-none-any.whl").unlink()
    with pytest.raises(UsageError, match=r"^--wheels .*: no wheel of fakedep 1.0 for CPython 3.12"):
        device_kit.main(fake_kit)
    fake_kit.output.mkdir()
    (fake_kit.output / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=r"^--output .*: holds files but no kit"):
        device_kit.main(fake_kit)
    assert (fake_kit.output / "notes.txt").read_text() == "mine"


def test_what_travels_is_the_tracked_and_untracked_not_ignored_files(tmp_path):
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / ".gitignore").write_text("ignored/\n")  # 9 bytes
    (tmp_path / "tracked.txt").write_text("x" * 10)
    subprocess.run([*git, "add", ".gitignore", "tracked.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "t"], check=True)
    (tmp_path / "untracked.txt").write_text("y" * 5)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big.whl").write_bytes(b"z" * 1000)
    assert device_kit.travel_bytes(tmp_path) == 9 + 10 + 5


def test_every_part_of_the_kit_has_one_locked_version_and_a_wheel_for_the_gpu_machine():
    lock = device_kit.read_lock(REPO / "uv.lock")
    for part in device_kit.KIT:
        entry = device_kit.locked(lock, part.name)
        assert device_kit.device_wheels(entry), f"{part.name} {entry['version']}: no cp312 manylinux x86-64 wheel"
    assert device_kit.locked(lock, "envpool")["version"] == "1.2.7"  # docs/performance.md's measurements' envpool


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--budget-mib 0", "--budget-mib"),
        ("--wheels {tmp}/missing", "--wheels"),
        ("--output {tmp}/file", "--output"),
        ("--lock {tmp}/missing", "--lock"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_code_2(tmp_path, flags, named):
    (tmp_path / "file").write_text("a file, not a folder")
    argv = [sys.executable, str(REPO / "benchmark" / "device_kit.py"), *flags.format(tmp=tmp_path).split()]
    if "--output" not in flags:
        argv += ["--output", str(tmp_path / "kit")]
    completed = subprocess.run(argv, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=60)
    lines = completed.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {named}"), completed.stderr
    assert completed.returncode == 2 and not (tmp_path / "kit").exists() and not (tmp_path / "missing").exists()


def test_gpu_sh_installs_a_kit_and_runs_python3_when_py_is_unset(tmp_path):
    """gpu.sh with a kit and no PY: python3's pip installs it (--no-index --no-deps --target), the install time is
    printed, and the sections run python3 with the kit and the repository on PYTHONPATH (python3 here: a stand-in
    that prints its arguments); with DEVICE_KIT naming a folder without a kit, one error line."""
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "manifest.json").write_text("{}")
    (kit / "a-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "bin").mkdir()
    stand_in = tmp_path / "bin" / "python3"
    stand_in.write_text('#!/bin/sh\necho "python3 $*"; echo "PYTHONPATH=$PYTHONPATH"\n')
    stand_in.chmod(0o755)
    env = {k: v for k, v in script_env().items() if k != "PY"}
    env |= {"PATH": f"{tmp_path / 'bin'}:{env['PATH']}", "DEVICE_KIT": str(kit), "SCRIPT_FLAGS": "--num-steps 8"}
    gpu_sh = ["bash", str(REPO / "benchmark" / "gpu.sh"), str(tmp_path / "out"), "sync"]
    completed = subprocess.run(gpu_sh, env={**env, "LEARNER_ALGORITHMS": "ppo"}, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    install = next(line for line in lines if line.startswith("python3 -m pip install"))
    assert "--no-index --no-deps" in install and install.endswith(str(kit / "a-1.0-py3-none-any.whl"))
    site = install.split("--target ")[1].split()[0]
    assert any(line.startswith("== device kit: 1 wheels") and line.endswith(" s") for line in lines)
    runs = [line for line in lines if line.startswith("== python3 ") and "--script" in line]
    assert len(runs) == 2 and all(line.endswith("--num-steps 8") for line in runs)
    assert any(line.startswith(f"PYTHONPATH={site}:{REPO}") for line in lines)
    assert not Path(site).exists()  # the temporary install is removed at the end
    env["DEVICE_KIT"] = str(tmp_path / "bin")
    completed = subprocess.run(gpu_sh, env=env, capture_output=True, text=True)
    assert completed.returncode == 2 and completed.stderr.startswith(f"error: DEVICE_KIT '{tmp_path / 'bin'}'")
