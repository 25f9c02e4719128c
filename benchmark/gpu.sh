#!/usr/bin/env bash
# On one GPU: Sebulba's Atari throughput against the environment ceiling and a learning curve; Anakin on MinAtar.
#
#   (a) ceiling     envpool Breakout-v5 alone with random actions on all cores (benchmark/env_ceiling.py): 2 pools x
#                   64 envs (Cleanba's 2 actor threads) and 1 pool x 128 envs
#   (b) throughput  PPO and IMPALA on Breakout-v5, default IMPALA CNN and the default sizes (2 actor threads x
#                   60 envs PPO, 64 IMPALA; 128 / 20 steps), actor and learner on GPU 0 (a0-l0): the stages alone
#                   and the script's steady SPS (benchmark/throughput.py), peak GPU memory
#   (c) curve       PPO Breakout-v5 with the defaults for CURVE_SECONDS (600) of wall time, stopped with SIGTERM (the
#                   script checkpoints and exits 143), then static/gpu_breakout_ppo.png against a random policy
#   (d) minatar     the Anakin PPO with pgx's MinAtar PPO example's settings on its five games at 20M steps, seeds
#                   MINATAR_SEEDS (1 2 3), MINATAR_JOBS (5) runs at a time sharing the GPU (benchmark/learning_runs.py;
#                   the saved model evaluated over 100 episodes), table and figure beside pgx's published returns
#   (e) jax-ceiling the env step alone of each MinAtar game at CEILING_ENVS (4,096 65,536) envs and the MinAtar network's gradient
#                   (benchmark/jax_env_ceiling.py), then the Anakin PPO alone on Breakout at pgx's settings for
#                   ANAKIN_UPDATES (8) updates: its steady SPS, as a fraction of the env step's at 4,096 envs
#   (f) pgx-check   not in the default list: pgx's own MinAtar PPO example (PGX_TRAIN: a checkout's
#                   examples/minatar-ppo/train.py, run with benchmark/pgx-stand-ins) beside the Anakin PPO as it is and
#                   with haiku's initializers, on Breakout at 20M steps, seeds PGX_SEEDS (0-7) and OURS_SEEDS (1-8),
#                   all sharing the GPU (benchmark/pgx_minatar_check.py; the example needs dm-haiku installed)
#   (g) ceiling-sweep not in the default list: lscpu and nvidia-smi into the results folder, then envpool
#                   SWEEP_ENV_ID (Breakout-v5) alone, stepped synchronously with random actions
#                   (benchmark/env_ceiling.py, one process), every combination of SWEEP_POOLS (2 4 8) pools x
#                   SWEEP_ENVS (16 32 64) envs each x SWEEP_THREADS (0 4 8 16; 0: the scripts' default, cores but one
#                   shared by the pools) envpool threads per pool, each timed for SWEEP_SECONDS (4) s: 36 x 4 s plus
#                   each one's env creation and 100 untimed steps, sized for about 5 minutes (not yet measured)
#   (h) breakout10m not in the default list: one part of the PPO Breakout-v5 run at CleanRL's 10M steps
#                   (BREAKOUT10M_FLAGS), on GPU 0 (a0-l0), that fits one command on a lent GPU
#                   (benchmark/train_in_parts.py): resumes the previous part's pack PART_IN (none: a fresh run), trains
#                   for PART_SECONDS (480) of wall time, stops it with SIGTERM (the script checkpoints, exits 143),
#                   packs runs/breakout10m (newest checkpoint, TensorBoard events, console logs) into
#                   breakout10m_part{k}.tar.gz (pieces .00, .01, ... if over 15 MiB); PART_SCRIPT replaces the
#                   script's path (the CPU test injects slow checkpoints through it)
#   (i) pqn10m      not in the default list: one part of the PQN Breakout-v5 run at 10M steps (PQN10M_FLAGS: the
#                   PQN paper's Atari settings, docs/rl-algorithms/pqn.md#breakout-v5-at-10m-steps-on-one-gpu), as
#                   breakout10m does it (PART_IN, PART_SECONDS, PART_SCRIPT), packed into pqn10m_part{k}.tar.gz
#   (j) learner     not in the default list: the learner alone (benchmark/throughput.py --stages learner), its
#                   microseconds per sample for each --network (impala nature) x --compute-dtype (float32 bfloat16),
#                   LEARNER_ALGORITHMS (ppo impala) on Breakout-v5 with the defaults, a0-l0; gpu_learner.jsonl
#   (k) sync        not in the default list: the full script's steady SPS without and with --sync-minibatches (the
#                   learner waits for each minibatch step, so pending actor inference runs between them), one right
#                   after the other, LEARNER_ALGORITHMS on Breakout-v5, a0-l0; gpu_sync.jsonl
#   (l) cleanba-upstream not in the default list: upstream Cleanba's PPO (CLEANBA_PPO: its cleanba/cleanba_ppo.py,
#                   git-ignored under benchmark/upstream/, run with the edits today's JAX, flax and envpool need) and
#                   ours, one after the other, PPO Breakout-v5 at our defaults, a0-l0, 30 updates each
#                   (benchmark/upstream_cleanba.py; UPSTREAM_FLAGS adds its flags): both steady SPS and the ratio,
#                   ours over upstream's, in gpu_cleanba_upstream.jsonl, upstream's console in cleanba_upstream_logs
#
# usage (from any folder, on a machine with an NVIDIA GPU; the runs go to the current folder's runs/, the figures of
# the docs to the repository's static/, relative paths given (results folder, PART_IN, CLEANBA_PPO, PGX_TRAIN) are
# the current folder's):
#   bash benchmark/gpu.sh [results folder] [sections...]
#   default: the repository's benchmark/results, all of: ceiling throughput curve minatar jax-ceiling
#   the 10M run, one command per part: bash benchmark/gpu.sh OUT breakout10m, then, with the previous part's pack
#   copied into the working tree (PART_IN: its path, or the stem of its pieces),
#   PART_IN=benchmark/results/breakout10m_part1.tar.gz bash benchmark/gpu.sh OUT breakout10m
#   PQN's 10M run the same way: bash benchmark/gpu.sh OUT pqn10m, then PART_IN=... bash benchmark/gpu.sh OUT pqn10m
#   upstream Cleanba beside ours (docs/performance.md#upstream-cleanba-beside-ours):
#   CLEANBA_PPO=benchmark/upstream/cleanba_ppo.py bash benchmark/gpu.sh OUT cleanba-upstream
# PY picks the interpreter (default: uv with the CUDA extra; on a machine without network, the device kit below).
# SCRIPT_FLAGS: more flags for the learner, sync, breakout10m and pqn10m sections' runs, after theirs (the last value
# of a flag counts: smaller sizes for a rehearsal on a CPU).
# The device kit (benchmark/device_kit.py, benchmark/DEVICE_RUNBOOK.md): when PY is
# unset and DEVICE_KIT (default: the repository's benchmark/device_kit) holds one, its wheels are installed with
# python3's pip (--no-index --no-deps) into a temporary folder put on PYTHONPATH with the repository, and python3
# runs everything (a lent GPU machine: its image has JAX, flax, optax, TensorBoard; the kit the rest); its install
# time is printed, python3's pip list goes to pip_list.txt; PY="uv run --extra cuda12 python" keeps uv.
# Results: gpu_env_ceiling.jsonl, gpu_throughput.jsonl (one JSON line per config, markdown table printed),
# gpu_curve.txt, gpu_minatar_ppo.jsonl and .png, gpu_jax_env_ceiling.jsonl, gpu_anakin_minatar_sps.txt,
# gpu_env_ceiling_sweep.jsonl with lscpu.txt and nvidia_smi.txt, breakout10m_parts.jsonl (one JSON line per part)
# with each part's breakout10m_part{k}.log and pack (pqn10m_ the same); the runs stay in runs/.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)  # the scripts and tools are named by their path in it
out=${1:-$repo/benchmark/results}
shift || true
sections=${*:-ceiling throughput curve minatar jax-ceiling}
kit=${DEVICE_KIT:-$repo/benchmark/device_kit}
[ -z "${PY:-}" ] && [ -f "$kit/manifest.json" ] && use_kit=1 || use_kit=
PY=${PY:-uv run --extra cuda12 python}
export UV_PROJECT=${UV_PROJECT:-$repo}  # the default PY's uv finds the project from any folder
CURVE_SECONDS=${CURVE_SECONDS:-600}
MINATAR=${MINATAR:-minatar-breakout minatar-asterix minatar-freeway minatar-seaquest minatar-space_invaders}
# pgx's examples/minatar-ppo settings (docs/studies/minatar_pgx.md)
PGX_PPO="--local-num-envs 4096 --num-steps 128 --update-epochs 3 --num-minibatches 128 --no-anneal-lr \
  --learning-rate 3e-4 --clip-coef 0.2 --ent-coef 0.01 --hiddens 64 64"
SECTIONS="ceiling throughput curve minatar jax-ceiling pgx-check cleanba-upstream ceiling-sweep breakout10m pqn10m"
SECTIONS="$SECTIONS learner sync"
# every argument is checked before the first section runs: a typo in the last section would otherwise end the command
# after hours of the others, and a flag (there are none: the settings are environment variables) would be a folder
case $out in
-*)
  echo "error: results folder '$out': gpu.sh takes no flags (its settings are environment variables); usage:" \
    "bash benchmark/gpu.sh [results folder] [sections...]" >&2
  exit 2
  ;;
esac
for section in $sections; do
  case " $SECTIONS " in
  *" $section "*) ;;
  *)
    echo "error: unknown section '$section' (allowed: $SECTIONS)" >&2
    exit 2
    ;;
  esac
  [ "$section" != pgx-check ] || [ -f "${PGX_TRAIN:-}" ] ||
    { echo "error: pgx-check needs PGX_TRAIN, pgx's examples/minatar-ppo/train.py" >&2; exit 2; }
  [ "$section" != cleanba-upstream ] || [ -f "${CLEANBA_PPO:-}" ] ||
    { echo "error: cleanba-upstream needs CLEANBA_PPO, upstream Cleanba's cleanba/cleanba_ppo.py" >&2; exit 2; }
done
if [[ -n "${PART_IN:-}" && " $sections " == *" breakout10m "* && " $sections " == *" pqn10m "* ]]; then
  echo "error: PART_IN names one run's pack: give breakout10m or pqn10m, not both, with it" >&2
  exit 2
fi
[ -z "${DEVICE_KIT:-}" ] || [ -f "$DEVICE_KIT/manifest.json" ] || {
  echo "error: DEVICE_KIT '$DEVICE_KIT' holds no device kit (no manifest.json; benchmark/device_kit.py builds one)" >&2
  exit 2
}
mkdir -p "$out"
if [ -n "$use_kit" ]; then
  site=$(mktemp -d "${TMPDIR:-/tmp}/cleanba-device-kit.XXXXXX")
  trap 'rm -rf "$site"' EXIT
  started=$(date +%s.%N)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$site" "$kit"/*.whl || { echo "error: python3's pip could not install the device kit $kit" >&2; exit 1; }
  seconds=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  wheels=$(ls "$kit"/*.whl | wc -l)
  echo "== device kit: $wheels wheels ($(du -sm "$kit" | cut -f1) MiB) installed into $site in ${seconds} s"
  export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
  python3 -m pip list --disable-pip-version-check >"$out/pip_list.txt" 2>&1
  python3 -c 'import sys, jax, jaxlib, flax, optax, numpy, envpool
versions = ", ".join(f"{m.__name__} {m.__version__}" for m in [jax, jaxlib, flax, optax, numpy, envpool])
print(f"== python3 {sys.version.split()[0]}: {versions}; {jax.devices()}")' ||
    { echo "error: python3 cannot import what the sections need, with the device kit installed" >&2; exit 1; }
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the harness and the run it starts share the GPU; memory as used
# the runs of one game share their compiled update: seed 2 reuses seed 1's
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/cleanba-jax-cache}
status=0
step() { echo "== $*"; "$@" || { echo "!! failed ($?): $*"; status=1; }; }
GPU0="--actor-device-ids 0 --learner-device-ids 0"
# the 10M-step Breakout run (the issue's target: an average return of 400 at 10M steps within 12 minutes of training
# on one H100, about 14,000 steps/s; CleanRL's PPO reaches 430 +- 8 at 10M steps): rl_games' recipe of few, large
# updates (8,192 samples, 2 epochs of 1,024-sample minibatches, learning rate 8e-4, clip 0.2) with the Nature CNN, its
# envs in 4 synchronous pools of 32 (one per actor thread) to pass the 2-pool env ceiling, each minibatch step waited
# for so that inference runs between them (why: benchmark/DEVICE_RUNBOOK.md#the-10m-runs-flags); a fixed run name and seed
# (every part continues one run), a checkpoint every 100 updates (819k steps, about a minute at that rate) so that a
# part killed past its grace time loses little, the console every update
BREAKOUT10M_FLAGS=${BREAKOUT10M_FLAGS:-"--env-id Breakout-v5 $GPU0 --total-timesteps 10000000 --seed 1 \
  --run-name breakout10m --exp-name breakout10m --network nature --num-actor-threads 4 --local-num-envs 32 \
  --num-steps 64 --num-minibatches 8 --update-epochs 2 --learning-rate 8e-4 --clip-coef 0.2 --sync-minibatches \
  --log-frequency 1 --checkpoint-frequency 100 --checkpoint-keep 2"}
# PQN's 10M-step Breakout run (the issue's target: an average return of 385 at 10M steps within 15 minutes of training,
# CleanRL's PQN 384.85 in 42.8 minutes): the PQN paper's Atari settings (purejaxql's pqn_atari: 128 envs x 32 steps,
# 2 epochs of 32 minibatches, epsilon to 0.001 over the first 10%, a constant learning rate), its 128 envs in the same
# 4 pools of 32 as PPO's run (why: docs/rl-algorithms/pqn.md#breakout-v5-at-10m-steps-on-one-gpu); a checkpoint every
# 200 updates (819k steps)
PQN10M_FLAGS=${PQN10M_FLAGS:-"--env-id Breakout-v5 $GPU0 --total-timesteps 10000000 --seed 1 --run-name pqn10m \
  --exp-name pqn10m --network nature --num-actor-threads 4 --local-num-envs 32 --num-steps 32 --num-minibatches 32 \
  --update-epochs 2 --end-e 0.001 --no-anneal-lr --sync-minibatches --log-frequency 1 --checkpoint-frequency 200 \
  --checkpoint-keep 2"}
# one part of a run of NAME (the script and its flags after that): benchmark/train_in_parts.py, resuming PART_IN
train_part() {
  local name=$1 script=$2
  shift 2
  # shellcheck disable=SC2086
  $PY "$repo/benchmark/train_in_parts.py" --out "$out" --name "$name" --seconds "${PART_SECONDS:-480}" \
    ${PART_IN:+--part-in "$PART_IN"} -- ${PART_SCRIPT:-"$script"} "$@" ${SCRIPT_FLAGS:-}
  code=$?
  [ "$code" -ne 2 ] || exit 2  # a bad flag or a missing, unreadable or damaged PART_IN: one error line, nothing started
  [ "$code" -eq 0 ] || { echo "!! $name part failed ($code)"; status=1; }
}

for section in $sections; do
  case $section in
  ceiling)
    step $PY "$repo/benchmark/env_ceiling.py" --env-id Breakout-v5 --num-envs 64 --pools 2 \
      --json "$out/gpu_env_ceiling.jsonl"
    step $PY "$repo/benchmark/env_ceiling.py" --env-id Breakout-v5 --num-envs 128 --pools 1 \
      --envpool-threads "$(nproc)" --json "$out/gpu_env_ceiling.jsonl"
    ;;
  throughput)
    for algorithm in ppo impala; do
      step $PY "$repo/benchmark/throughput.py" \
        --script "$repo/cleanba/cleanba_${algorithm}_envpool_impala_atari_wrapper.py" --json "$out/gpu_throughput.jsonl" \
        --repeats 3 --stage-rollouts 2 --full-repeats 1 --full-updates 25 \
        -- --env-id Breakout-v5 $GPU0
    done
    step $PY "$repo/benchmark/throughput.py" --summarize "$out/gpu_throughput.jsonl"
    ;;
  curve)
    echo "== PPO Breakout-v5 for ${CURVE_SECONDS}s"
    timeout --preserve-status -s TERM "$CURVE_SECONDS" $PY "$repo/cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py" \
      --env-id Breakout-v5 $GPU0 --run-name gpu_breakout_ppo --exp-name gpu_breakout_ppo --log-frequency 10 \
      --checkpoint-frequency 0 --total-timesteps 50000000 2>&1 | tee "$out/gpu_curve.txt" | grep -E "^update=(1|[0-9]*0)/|error" | tail -40
    code=${PIPESTATUS[0]}
    [ "$code" -eq 0 ] || [ "$code" -eq 143 ] || { echo "!! curve run failed ($code)"; status=1; }
    # random policy on Breakout: 1.7 (Mnih et al. 2015, Nature DQN, Extended Data Table 2)
    step $PY "$repo/benchmark/plot.py" curves --runs runs/gpu_breakout_ppo --labels "Sebulba PPO, a0-l0" \
      --tags charts/avg_episodic_return charts/SPS --references "random policy=1.7" \
      --title "Breakout-v5, PPO on 1 GPU (${CURVE_SECONDS} s)" --output "$repo/static/gpu_breakout_ppo.png"
    cp "$repo/static/gpu_breakout_ppo.png" "$out/" 2>/dev/null || true
    ;;
  minatar)
    # shellcheck disable=SC2086
    step $PY "$repo/benchmark/learning_runs.py" --python "$PY" --jobs "${MINATAR_JOBS:-5}" --script ppo_anakin \
      --env-ids $MINATAR --seeds ${MINATAR_SEEDS:-1 2 3} --total-timesteps "${MINATAR_TIMESTEPS:-20000000}" \
      --final-window 1 --flags="$PGX_PPO --log-frequency 1 --checkpoint-frequency 0 --save-model --eval-episodes 100" \
      --results "$out/gpu_minatar_ppo.jsonl" --output "$out/gpu_minatar_ppo.png"
    ;;
  jax-ceiling)
    # shellcheck disable=SC2086
    step $PY "$repo/benchmark/jax_env_ceiling.py" --env-ids $MINATAR --num-envs ${CEILING_ENVS:-4096 65536} \
      --results "$out/gpu_jax_env_ceiling.jsonl"
    updates=${ANAKIN_UPDATES:-8}
    echo "== Anakin PPO alone, minatar-breakout, pgx's settings, $updates updates"
    # shellcheck disable=SC2086
    $PY "$repo/cleanba/cleanba_ppo_anakin.py" --env-id minatar-breakout $PGX_PPO \
      --total-timesteps $((updates * 524288)) --exp-name gpu_anakin_sps --log-frequency 1 --checkpoint-frequency 0 2>&1 \
      | tee "$out/gpu_anakin_minatar_sps.txt" | grep -E "^update=|error"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!! Anakin SPS run failed"; status=1; }
    ;;
  pgx-check)
    # shellcheck disable=SC2086
    step $PY "$repo/benchmark/pgx_minatar_check.py" --pgx-train "$PGX_TRAIN" --python "$PY" \
      --logs "$out/pgx_check_logs" --results "$out/gpu_pgx_minatar_check.jsonl" \
      --pgx-seeds ${PGX_SEEDS:-0 1 2 3 4 5 6 7} --ours-seeds ${OURS_SEEDS:-1 2 3 4 5 6 7 8} --jobs "${PGX_CHECK_JOBS:-24}"
    ;;
  cleanba-upstream)
    # shellcheck disable=SC2086
    step $PY "$repo/benchmark/upstream_cleanba.py" --cleanba-ppo "$CLEANBA_PPO" --results "$out/gpu_cleanba_upstream.jsonl" \
      --logs "$out/cleanba_upstream_logs" $GPU0 ${UPSTREAM_FLAGS:-}
    ;;
  ceiling-sweep)
    { lscpu || echo "lscpu failed"; } >"$out/lscpu.txt" 2>&1
    { nvidia-smi || echo "nvidia-smi failed (no NVIDIA GPU?)"; } >"$out/nvidia_smi.txt" 2>&1
    # shellcheck disable=SC2086
    step $PY "$repo/benchmark/env_ceiling.py" --env-id "${SWEEP_ENV_ID:-Breakout-v5}" --pools ${SWEEP_POOLS:-2 4 8} \
      --num-envs ${SWEEP_ENVS:-16 32 64} --envpool-threads ${SWEEP_THREADS:-0 4 8 16} --seconds "${SWEEP_SECONDS:-4}" \
      --json "$out/gpu_env_ceiling_sweep.jsonl"
    ;;
  breakout10m)
    # shellcheck disable=SC2086
    train_part breakout10m "$repo/cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py" $BREAKOUT10M_FLAGS
    ;;
  pqn10m)
    # shellcheck disable=SC2086
    train_part pqn10m "$repo/cleanba/cleanba_pqn_envpool_impala_atari_wrapper.py" $PQN10M_FLAGS
    ;;
  learner)
    for algorithm in ${LEARNER_ALGORITHMS:-ppo impala}; do
      for network in impala nature; do
        for dtype in float32 bfloat16; do
          step $PY "$repo/benchmark/throughput.py" \
            --script "$repo/cleanba/cleanba_${algorithm}_envpool_impala_atari_wrapper.py" --stages learner \
            --repeats 3 --stage-rollouts 1 --json "$out/gpu_learner.jsonl" \
            -- --env-id Breakout-v5 $GPU0 --network $network --compute-dtype $dtype ${SCRIPT_FLAGS:-}
        done
      done
    done
    step $PY "$repo/benchmark/throughput.py" --summarize "$out/gpu_learner.jsonl"
    ;;
  sync)
    for algorithm in ${LEARNER_ALGORITHMS:-ppo impala}; do
      for sync in --no-sync-minibatches --sync-minibatches; do
        step $PY "$repo/benchmark/throughput.py" \
          --script "$repo/cleanba/cleanba_${algorithm}_envpool_impala_atari_wrapper.py" --json "$out/gpu_sync.jsonl" \
          --repeats 1 --stage-rollouts 1 --full-repeats 1 --full-updates 15 \
          -- --env-id Breakout-v5 $GPU0 $sync ${SCRIPT_FLAGS:-}
      done
    done
    step $PY "$repo/benchmark/throughput.py" --summarize "$out/gpu_sync.jsonl"
    ;;
  esac
done
exit $status
