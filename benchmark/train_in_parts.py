"""One part of a long run that does not fit one sitting: resume it from the previous part's pack, train until a wall
time budget, stop it with SIGTERM, pack its folder for the next part.

A GPU that is lent in windows of minutes (benchmark/gpu.sh's `breakout10m` section) trains a 10M-step run in parts.
Each part
  1. unpacks --part-in (the previous part's pack, carried to this machine as a file) into runs/{run name}, or, without
     it, starts the run afresh (an old runs/{run name} is removed);
  2. runs the script (the command after `--`, which names --run-name) under `timeout -s TERM --seconds`: at SIGTERM the
     script finishes its update, writes a checkpoint and exits 143 (docs/reliability.md); a script that does not end
     within --grace seconds more is killed (its newest periodic checkpoint is then what the next part resumes);
  3. packs runs/{run name} (the newest checkpoint, the TensorBoard events, every part's console log and parts.jsonl)
     into {out}/{name}_part{k}.tar.gz, split into pieces `.00`, `.01`, ... of at most --max-file-mib MiB if larger;
  4. appends one JSON line to {out}/{name}_parts.jsonl and to the run folder's parts.jsonl (which sets k, the part's
     index): start and end update and global step, wall seconds, steps per second, the last average return, the peak
     GPU memory (nvidia-smi, sampled every second, if present), the exit code (0: the run is finished).

A missing, unreadable or damaged --part-in (a piece missing, cut short, out of order or with a changed byte), or one
that holds no checkpoint of the run, is one `error:` line and exit code 2, before anything is started or changed on
disk: the whole pack is checked first, and an existing runs/{run name} is replaced only by a complete unpacked copy.
A script that refuses its flags (its one `error:` line, exit code 2, within seconds) gives that line and exit code 2
here too, with no part recorded or packed.

usage (from the repository root):
  python benchmark/train_in_parts.py --out OUT --name breakout10m [--part-in OUT/breakout10m_part1.tar.gz] \\
      --seconds 480 -- cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --run-name breakout10m ...
"""

import argparse
import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zlib
from pathlib import Path

from cleanrl_utils.cli import run_main
from cleanrl_utils.errors import UsageError

CHECKPOINT_SAVED = re.compile(r"checkpoint saved: update=(\d+) global_step=(\d+) (.*) in [0-9.]+s$")
RESUMED = re.compile(r"resumed from checkpoint: update=(\d+) global_step=(\d+)")
LOGGED = re.compile(r"^update=(\d+)/(\d+) global_step=(\d+) SPS=(\d+) .*avg_episodic_return=(\S+)")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        """argparse's own errors (an unknown flag, a value that is not a number) as one line too."""
        raise UsageError(message)


def run_name_of(command: list[str]) -> str:
    """The --run-name the script's command gives (one folder name: the script checks it)."""
    for i, word in enumerate(command):
        if word == "--run-name" and i + 1 < len(command):
            return command[i + 1]
        if word.startswith("--run-name="):
            return word.split("=", 1)[1]
    raise UsageError("the script's flags (after --) must give --run-name: the parts continue one run folder")


def pack_pieces(path: Path) -> list[Path]:
    """The files of a pack: `path` itself, or its pieces path.00, path.01, ... with none missing in between."""
    if path.is_file():
        return [path]
    pieces = sorted(path.parent.glob(f"{path.name}.[0-9][0-9]"))
    if not pieces:
        raise UsageError(f"--part-in {path}: no such file (nor its pieces {path.name}.00, ...)")
    for index, piece in enumerate(pieces):
        if piece.name != f"{path.name}.{index:02d}":
            found = ", ".join(piece.name for piece in pieces)
            raise UsageError(f"--part-in {path}: piece {path.name}.{index:02d} is missing (found {found})")
    return pieces


def read_pack(path: Path, run_name: str) -> tarfile.TarFile:
    """The previous part's pack, checked whole before anything on disk changes: every byte of every piece, every
    member inside runs/{run_name}/, a checkpoint among them."""
    try:
        data = b"".join(piece.read_bytes() for piece in pack_pieces(path))
    except OSError as error:
        raise UsageError(f"--part-in {path}: cannot read {error.filename}: {error.strerror}") from None
    # Listing a tar.gz reads only its headers, so a changed byte in a file's data passes unnoticed. Decompressing it
    # whole checks gzip's own CRC-32 and length over every byte: a piece missing, cut short, out of order or with a
    # flipped byte fails here. It needs no digest file carried beside the pack (which could itself go missing).
    try:
        pack = tarfile.open(fileobj=io.BytesIO(gzip.decompress(data)), mode="r:")
        names = pack.getnames()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
        raise UsageError(
            f"--part-in {path}: not a pack of a part, or a damaged one: a piece missing, cut short, out of order or "
            f"changed ({error})"
        ) from None
    folder = f"runs/{run_name}"
    outside = [name for name in names if name != folder and not name.startswith(f"{folder}/")]
    if outside:
        raise UsageError(f"--part-in {path}: holds {outside[0]}, outside {folder}/ (a pack of another run?)")
    if not any(re.fullmatch(rf"{re.escape(folder)}/checkpoints/\d+", name) for name in names):
        raise UsageError(f"--part-in {path}: holds no checkpoint of {folder} (the previous part saved none)")
    return pack


def unpack(pack: tarfile.TarFile, run_dir: Path):
    """The pack's runs/{run_name} in place of `run_dir`: unpacked beside it first, so a failure (a full disk) leaves
    the old folder as it was and no half-unpacked one."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.unpacking-", dir=run_dir.parent))
    try:
        pack.extractall(staging, filter="data")
        if run_dir.exists():
            print(f"replacing {run_dir} with the pack's copy")
            os.rename(run_dir, staging / "replaced")  # removed with the staging folder, once the new one is in place
        os.rename(staging / "runs" / run_dir.name, run_dir)  # the pack holds runs/{run_name}/...
    finally:
        shutil.rmtree(staging)


def parts_done(run_dir: Path) -> int:
    parts = run_dir / "parts.jsonl"
    return len(parts.read_text().splitlines()) if parts.exists() else 0


class GpuMemory:
    """The peak of nvidia-smi's used memory of GPU 0 (MiB), sampled every second while the part runs; None without
    nvidia-smi."""

    def __init__(self):
        self.peak_mib, self.stopped = None, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True) if shutil.which("nvidia-smi") else None
        if self.thread:
            self.thread.start()

    def sample(self):
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"]
        while not self.stopped.wait(1.0):
            completed = subprocess.run(query, capture_output=True, text=True)
            if completed.returncode == 0 and completed.stdout.strip().isdigit():
                self.peak_mib = max(self.peak_mib or 0, int(completed.stdout.strip()))

    def stop(self) -> int | None:
        self.stopped.set()
        if self.thread:
            self.thread.join()
        return self.peak_mib


def train(command: list[str], seconds: float, grace: float, log: Path) -> tuple[int, list[str]]:
    """The script under `timeout -s TERM`: (exit code, console lines); the console goes to `log` and stdout."""
    timed = ["timeout", "--preserve-status", "-s", "TERM", "-k", str(grace), str(seconds), sys.executable, *command]
    lines = []
    with open(log, "w") as log_file:
        process = subprocess.Popen(timed, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            log_file.write(line)
            print(line, end="", flush=True)
        return process.wait(), lines


def newest_checkpoint(run_dir: Path) -> int | None:
    updates = [int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()]
    return max(updates) if updates else None


def pack_run(run_dir: Path, destination: Path, max_bytes: int) -> list[Path]:
    """runs/{run_name} with its newest checkpoint only (the next part resumes from it), gzipped; pieces of at most
    `max_bytes` bytes if larger."""
    newest = newest_checkpoint(run_dir)

    def keep(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
        parts = Path(member.name).parts  # runs, {run_name}, ...
        if len(parts) >= 4 and parts[2] == "checkpoints" and parts[3] != str(newest):
            return None
        return None if parts[-1] == ".lock" else member

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as pack:
        pack.add(run_dir, arcname=f"runs/{run_dir.name}", filter=keep)
    data = buffer.getvalue()
    for old in [destination, *destination.parent.glob(f"{destination.name}.[0-9][0-9]")]:
        old.unlink(missing_ok=True)
    if len(data) <= max_bytes:
        destination.write_bytes(data)
        return [destination]
    pieces = [destination.with_name(f"{destination.name}.{i:02d}") for i in range(-(-len(data) // max_bytes))]
    for i, piece in enumerate(pieces):
        piece.write_bytes(data[i * max_bytes : (i + 1) * max_bytes])
    return pieces


def summary(lines: list[str], exit_code: int, part: int, run_dir: Path, wall: float) -> dict:
    """The part's JSON line, from its console: where it started (the resumed checkpoint) and ended (its newest saved
    checkpoint, what the next part resumes), its rates and last logged return."""
    resumed, saved, logged = (
        [m for m in map(pattern.search, lines) if m] for pattern in [RESUMED, CHECKPOINT_SAVED, LOGGED]
    )
    start_update, start_step = (int(resumed[0].group(1)), int(resumed[0].group(2))) if resumed else (0, 0)
    end_update, end_step = (int(saved[-1].group(1)), int(saved[-1].group(2))) if saved else (start_update, start_step)
    return {
        "part": part,
        "run_name": run_dir.name,
        "exit_code": exit_code,
        "finished": exit_code == 0,
        "start_update": start_update,
        "end_update": end_update,
        "num_updates": int(logged[-1].group(2)) if logged else None,
        "start_global_step": start_step,
        "end_global_step": end_step,
        "wall_seconds": round(wall, 1),
        "sps_wall": round((end_step - start_step) / wall, 1),  # start-up and compilation included
        "sps_logged": int(logged[-1].group(4)) if logged else None,  # the script's own, from its first update on
        "last_logged_update": int(logged[-1].group(1)) if logged else None,
        "avg_episodic_return": float(logged[-1].group(5)) if logged else None,
        "end_state": saved[-1].group(3) if saved else None,  # the digests of the state the next part resumes
    }


def refusal(lines: list[str], exit_code: int) -> str | None:
    """The script's own error line when it refused its flags (exit code 2 before any update was logged or saved),
    without its `error: `; None when it ran."""
    if exit_code != 2 or any(LOGGED.search(line) or CHECKPOINT_SAVED.search(line) for line in lines):
        return None
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    return errors[-1] if errors else "the script exited with code 2 before its first update"


def main(argv: list[str]) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder the pack and the JSON lines go to")
    parser.add_argument("--name", required=True, help="the files' stem: {name}_part{k}.tar.gz, {name}_parts.jsonl")
    parser.add_argument("--part-in", type=Path, help="the previous part's pack (or the first of its pieces' stem)")
    parser.add_argument("--seconds", type=float, default=480.0, help="the part's wall time budget until SIGTERM")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds after SIGTERM until SIGKILL")
    parser.add_argument("--max-file-mib", type=float, default=15.0, help="the largest piece of a pack (MiB)")
    parser.add_argument("command", nargs="+", help="after --: the script and its flags (--run-name among them)")
    args = parser.parse_args(argv)
    for name in ["seconds", "grace", "max_file_mib"]:
        if not 0 < getattr(args, name) < float("inf"):
            raise UsageError(f"--{name.replace('_', '-')} must be positive and finite (got {getattr(args, name)})")
    run_name = run_name_of(args.command)
    pack = read_pack(args.part_in, run_name) if args.part_in else None
    run_dir = Path("runs") / run_name
    command = list(args.command)
    if pack:
        unpack(pack, run_dir)
        command.append("--resume")  # fails rather than starting afresh if the checkpoint cannot be read
    elif run_dir.exists():
        print(f"removing {run_dir}: a part without --part-in starts afresh")
        shutil.rmtree(run_dir)
    part = parts_done(run_dir) + 1
    created = [folder for folder in [run_dir, run_dir.parent] if not folder.exists()]  # removed if the script refuses
    run_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"== part {part} of {run_name}: {args.seconds:.0f} s", flush=True)
    memory, start = GpuMemory(), time.time()
    exit_code, lines = train(command, args.seconds, args.grace, run_dir / f"part{part}.log")
    result = summary(lines, exit_code, part, run_dir, time.time() - start)
    result["peak_gpu_memory_mib"] = memory.stop()
    if error := refusal(lines, exit_code):  # no part ran: nothing is recorded or packed, the run is as it was
        (run_dir / f"part{part}.log").unlink()
        for folder in created:
            shutil.rmtree(folder)
        raise UsageError(error)
    with open(run_dir / "parts.jsonl", "a") as parts:
        parts.write(json.dumps(result) + "\n")
    shutil.copy(run_dir / f"part{part}.log", args.out / f"{args.name}_part{part}.log")
    pieces = pack_run(run_dir, args.out / f"{args.name}_part{part}.tar.gz", int(args.max_file_mib * 2**20))
    result["pack"] = [piece.name for piece in pieces]
    with open(args.out / f"{args.name}_parts.jsonl", "a") as parts:
        parts.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    # a stopped part (143) or a finished run (0) is what a part should end with; anything else failed
    return 0 if exit_code in (0, 143) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, sys.argv[1:]))
