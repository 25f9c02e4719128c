#!/usr/bin/env bash
# The device kit rehearsed on this machine's CPU: what a lent GPU machine will do with it, before its minutes are spent.
#
#   1. the kit (benchmark/device_kit.py), built into DEVICE_KIT (default: benchmark/device_kit) if it holds none;
#   2. a fresh Python 3.12 venv (REHEARSAL_VENV, default /tmp/cleanba-rehearsal/venv; REHEARSAL_PYTHON: its Python,
#      default python3.12 or pyenv's 3.12) that holds only packages of the GPU machine's image, at its versions where
#      they are known (IMAGE below: JAX 0.11.2's CPU jaxlib, NumPy 2.5.2), none of the kit's (checked);
#   3. benchmark/gpu.sh with that venv's python3 first on PATH and PY unset, as on the GPU machine: it installs the kit
#      with pip --no-index --no-deps --target, prints the install time, and runs each section of
#      benchmark/DEVICE_RUNBOOK.md with tiny sizes: ceiling-sweep (Breakout-v5, 1 and 2
#      pools x 4 envs, 1 s each), learner and sync (PPO and IMPALA; SCRIPT_FLAGS: 4 envs x 8 steps), breakout10m
#      with the 10M run's flags (BREAKOUT10M_FLAGS' default: 4 actor threads, the Nature CNN, 2 epochs, ...; the
#      envs and steps SCRIPT_FLAGS') for REHEARSAL_PART_SECONDS (90) and a second part that resumes the first's pack,
#      pqn10m the same with PQN's run (PQN10M_FLAGS' default), and cleanba-upstream (tiny) when CLEANBA_PPO names
#      upstream's cleanba_ppo.py;
#   4. one line per section: ran, or failed (its log in the results folder).
#
# usage (from any folder; needs uv, the package index for steps 1 and 2 the first time, and 30 minutes of 2 busy cores):
#   bash benchmark/rehearse_device_kit.sh [results folder]   (default /tmp/cleanba-rehearsal/results; an earlier
#   rehearsal's results there are replaced)
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-/tmp/cleanba-rehearsal/results}
case $out in
-*)
  echo "error: results folder '$out': rehearse_device_kit.sh takes no flags (its settings are environment" \
    "variables)" >&2
  exit 2
  ;;
esac
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then  # an earlier rehearsal's results are replaced, nothing else
  [ -f "$out/rehearsal.log" ] ||
    { echo "error: results folder '$out' holds files but no rehearsal.log: name a new folder" >&2; exit 2; }
  rm -rf "${out:?}"/*
fi
venv=${REHEARSAL_VENV:-/tmp/cleanba-rehearsal/venv}
kit=${DEVICE_KIT:-$repo/benchmark/device_kit}
# the GPU machine's image, as far as the kit's sections import it: JAX, jaxlib and NumPy at its versions (KINDS.md's
# pip list), the rest of its packages at the newest versions that resolve with them (the image's are not known)
IMAGE="jax==0.11.2 jaxlib==0.11.2 numpy==2.5.2 flax==0.12.12 optax==0.2.8 chex==0.1.92 orbax-checkpoint==0.12.8
  tensorboard==2.21.0 tensorboard-data-server absl-py msgpack rich typing-extensions pyyaml protobuf cloudpickle
  matplotlib pillow scipy pandas tensorstore etils treescope toolz psutil packaging requests attrs wrapt six"

if [ ! -f "$kit/manifest.json" ]; then
  echo "== building the device kit into $kit"
  (cd "$repo" && uv run python benchmark/device_kit.py --output "$kit") || exit 1
fi
if [ ! -x "$venv/bin/python3" ]; then
  python=${REHEARSAL_PYTHON:-}
  if [ -z "$python" ]; then
    for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
      if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        python=$candidate
        break
      fi
    done
  fi
  [ -n "$python" ] || { echo "error: no Python 3.12 found: set REHEARSAL_PYTHON" >&2; exit 2; }
  echo "== a venv of the image's packages: $venv ($python)"
  "$python" -m venv "$venv" || exit 1
  # shellcheck disable=SC2086
  uv pip install -q --python "$venv/bin/python3" $IMAGE || exit 1
fi
"$venv/bin/python3" - "$kit/manifest.json" <<'EOF' || exit 1
import importlib.metadata, json, sys
names = [wheel["name"] for wheel in json.load(open(sys.argv[1]))["wheels"]]
present = []
for name in names:
    try:
        present.append(f"{name} {importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        pass
if present:
    sys.exit(f"error: the rehearsal's venv holds the kit's {', '.join(present)}: it would not test the kit")
print(f"== the venv: Python {sys.version.split()[0]}, none of the kit's {len(names)} distributions")
EOF

work=$(mktemp -d "${TMPDIR:-/tmp}/cleanba-rehearsal-runs.XXXXXX") || exit 1  # the runs (runs/), removed at the end
trap 'rm -rf "$work"' EXIT
out=$(mkdir -p "$out" && cd "$out" && pwd) || exit 1
cd "$work" || exit 1
export PATH="$venv/bin:$PATH" DEVICE_KIT=$kit PYTHONUNBUFFERED=1
unset PY
sections="ceiling-sweep learner sync breakout10m pqn10m"
[ -z "${CLEANBA_PPO:-}" ] || sections="$sections cleanba-upstream"
export SWEEP_ENV_ID=Breakout-v5 SWEEP_POOLS="1 2" SWEEP_ENVS=4 SWEEP_THREADS=1 SWEEP_SECONDS=1
export SCRIPT_FLAGS="--local-num-envs 4 --num-steps 8 --num-minibatches 2"  # the 10M run's flags, tiny sizes
export PART_SECONDS=${REHEARSAL_PART_SECONDS:-90}
export UPSTREAM_FLAGS="--local-num-envs 4 --num-steps 8 --channels 4 --hiddens 16 --num-minibatches 2 --update-epochs 1
  --updates 7 --warmup-updates 5"
started=$(date +%s)
# shellcheck disable=SC2086
bash "$repo/benchmark/gpu.sh" "$out" $sections 2>&1 | tee "$out/rehearsal.log"
for run in breakout10m pqn10m; do
  PART_IN=$out/${run}_part1.tar.gz bash "$repo/benchmark/gpu.sh" "$out" "$run" 2>&1 |
    tee "$out/rehearsal_${run}_part2.log"
done

echo "== the rehearsal, $(($(date +%s) - started)) s: the kit $(du -sm "$kit" | cut -f1) MiB"
grep -h "^== device kit:" "$out"/rehearsal*.log
status=0
check() {  # a section's line: ran (its result) or failed
  if [ -s "$out/$2" ] && ! grep -q "^!! .*$3" "$out"/rehearsal*.log; then
    echo "ran:    $1 ($2: $(wc -l <"$out/$2") line(s))"
  else
    echo "FAILED: $1 (see $out/rehearsal*.log)"
    status=1
  fi
}
check ceiling-sweep gpu_env_ceiling_sweep.jsonl env_ceiling.py
check learner gpu_learner.jsonl "--stages learner"
check sync gpu_sync.jsonl "sync-minibatches"
check "breakout10m, parts 1 and 2" breakout10m_parts.jsonl breakout10m
check "pqn10m, parts 1 and 2" pqn10m_parts.jsonl pqn10m
[ -z "${CLEANBA_PPO:-}" ] && echo "skipped: cleanba-upstream (CLEANBA_PPO: upstream's cleanba_ppo.py, not set)" ||
  check cleanba-upstream gpu_cleanba_upstream.jsonl upstream_cleanba.py
"$venv/bin/python3" - "$out" breakout10m pqn10m <<'EOF' || status=1
import json, sys
from pathlib import Path
failed = False
for run in sys.argv[2:]:
    try:
        parts = [json.loads(line) for line in open(Path(sys.argv[1]) / f"{run}_parts.jsonl")]
    except OSError:
        print(f"FAILED: {run}: no parts")
        failed = True
        continue
    if len(parts) != 2 or not 0 < parts[0]["end_update"] == parts[1]["start_update"] < parts[1]["end_update"]:
        print(f"FAILED: {run}: part 2 did not resume part 1 ({parts})")
        failed = True
        continue
    for p in parts:
        print(f"  {run} part {p['part']}: updates {p['start_update']} -> {p['end_update']}, exit code {p['exit_code']}")
sys.exit(failed)
EOF
exit $status
