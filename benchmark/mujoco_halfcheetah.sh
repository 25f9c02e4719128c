#!/usr/bin/env bash
# Sebulba PPO on HalfCheetah-v4, 1M steps, the script's defaults (PPO paper Table 3 settings, 2 actor threads x
# 4 envs x 256 steps), a0-l1, seeds 1 2 3 one after the other. Prints each run's wall time, final SPS and final
# average return, then draws static/mujoco_halfcheetah.png. Holds /tmp/cleanba-bench.lock throughout, so no other
# benchmark of this repository runs at the same time.
# usage: bash benchmark/mujoco_halfcheetah.sh   (from the repository root; SEEDS="1" for one seed)
set -euo pipefail
exec 9>/tmp/cleanba-bench.lock
flock 9
S=cleanba/cleanba_ppo_continuous_action_envpool_mujoco.py
SEEDS=${SEEDS:-"1 2 3"}
runs=()
for seed in $SEEDS; do
  name="bench_mujoco_HalfCheetah-v4_$seed"
  rm -rf "runs/$name"  # a fresh run, not a resume of an earlier benchmark
  start=$EPOCHREALTIME
  uv run python $S --env-id HalfCheetah-v4 --seed "$seed" --actor-device-ids 0 --learner-device-ids 1 \
    --total-timesteps 1000000 --log-frequency 61 --run-name "$name" | grep -v "^checkpoint saved"
  echo "seed $seed: wall $(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $start}")s"
  runs+=("runs/$name")
done
uv run python benchmark/plot.py curves --runs "${runs[@]}" --labels "Sebulba PPO" \
  --output static/mujoco_halfcheetah.png \
  --title "Sebulba PPO, HalfCheetah-v4 (2-core CPU, JAX on CPU; a0-l1, 2 actor threads x 4 envs)" \
  --references "CleanRL ppo_continuous_action at 1M steps (1442.64 +- 46.03)=1442.64"
