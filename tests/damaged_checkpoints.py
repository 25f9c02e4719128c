"""Damaged checkpoints of each script, resumed one after the other in one process as `--resume` reads them: what
`tests/test_reliability.py::test_every_damaged_checkpoint_of_every_script_is_one_line` runs.

    python tests/damaged_checkpoints.py WORKDIR SCRIPT FLAGS...

The script's `main` runs up to `run.start` (its fresh learner state, with the replay or the envs), which is saved as a
checkpoint; then each case copies it, damages one file and restores it with the run's own `Checkpoints.restore`: bytes
flipped at offsets spread over the data file (so every array in it is hit by some case), the data file emptied or cut
in half, the same for the OCDBT manifest, the metadata files cut in half; the data file's cases twice (what the
abandoned reads print is timing-dependent). A case's result goes to stdout as a JSON line; a refused checkpoint's
error goes to stderr as the one `error:` line the CLI prints, from the main thread, as the CLI does. The caller
checks that stderr holds those lines and nothing else, at the end of the process too.
"""

import json
import shutil
import sys
from pathlib import Path

FLIPS = 6  # offsets per data file
REPEATS = 2


class Started(Exception):
    """Raised from `run.start` once the script's fresh state exists."""


def fresh_state(script: Path, flags: list[str]):
    """(run, state, summary): the script's run object and fresh learner state, as its `main` makes them."""
    from cleanrl_utils.cli import parse_flags
    from cleanrl_utils.evals.evaluate import load_script
    from cleanrl_utils.run import Run

    module = load_script(script)
    captured = {}

    def start(run, state, summary):
        captured.update(run=run, state=state, summary=summary)
        raise Started

    Run.start = start
    args = parse_flags(module.Args, flags)
    try:
        module.main(getattr(module, "with_loss_defaults", lambda args: args)(args))
    except Started:
        pass
    return captured["run"], captured["state"], captured["summary"]


def damaged(kind: str, data: bytes, offset: float) -> bytes:
    if kind == "flip":
        data = bytearray(data)
        start = min(int(len(data) * offset), max(len(data) - 8, 0))
        for i in range(start, min(start + 8, len(data))):
            data[i] ^= 0xFF
        return bytes(data)
    return b"" if kind == "zero" else data[: len(data) // 2]


def cases(checkpoint: Path) -> list[tuple[str, str, float]]:
    """(file relative to the checkpoint, damage, offset) of every case."""
    state = checkpoint / "state"
    data = max((p for p in (state / "d").iterdir()), key=lambda p: p.stat().st_size).relative_to(checkpoint)
    flips = [(str(data), "flip", (i + 0.5) / FLIPS) for i in range(FLIPS)]
    whole = [(str(data), kind, 0.5) for kind in ("zero", "cut")]
    manifest = [("state/manifest.ocdbt", kind, 0.5) for kind in ("flip", "zero", "cut")]
    metadata = [(name, "cut", 0.5) for name in ("state/_METADATA", "state/array_metadatas/process_0", "meta/metadata")]
    return (flips + whole) * REPEATS + manifest + metadata


def main(workdir: Path, script: Path, flags: list[str]):
    from cleanrl_utils.checkpoints import CheckpointError, Checkpoints
    from cleanrl_utils.flags import computation_flags, settable_flags

    run, state, summary = fresh_state(script, flags)
    args = run.args
    run.checkpoints.save(1, state, global_step=args.batch_size, flags=settable_flags(args), summary=summary(state))
    run.checkpoints.close()
    saved = Path(run.checkpoints.directory).resolve() / "1"
    for number, (name, kind, offset) in enumerate(cases(saved)):
        folder = workdir / f"case{number}"
        shutil.copytree(saved, folder / "1")
        target = folder / "1" / name
        target.write_bytes(damaged(kind, target.read_bytes(), offset))
        checkpoints = Checkpoints(str(folder), keep=3, world_size=1)
        try:
            checkpoints.restore(
                state, batch_size=args.batch_size, flags=computation_flags(args), resume=True, summary=summary
            )
            result = "resumed"  # a file this state does not read (its digest is checked)
        except CheckpointError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            result = "refused"
        print(json.dumps({"file": name, "damage": kind, "offset": offset, "result": result}), flush=True)
        checkpoints.close()
        shutil.rmtree(folder)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
