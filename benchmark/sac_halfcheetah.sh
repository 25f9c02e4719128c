#!/usr/bin/env bash
# Sebulba SAC on HalfCheetah-v4 with the script's defaults (CleanRL's sac_continuous_action / SAC paper settings:
# 1M replay, minibatch 256, 256x256 ReLU MLPs, replay ratio 1), a0-l1, seeds 1 2 3 one after the other, each for
# SECONDS_PER_SEED of wall time (default 600) and then stopped with SIGTERM (it checkpoints and exits 143). Prints
# each run's last console line, then draws static/sac_halfcheetah.png. Holds /tmp/cleanba-bench.lock throughout, so
# no other benchmark of this repository runs at the same time.
# usage: bash benchmark/sac_halfcheetah.sh   (from the repository root; SEEDS="1" for one seed)
set -uo pipefail
exec 9>/tmp/cleanba-bench.lock
flock 9
S=cleanba/cleanba_sac_continuous_action_envpool_mujoco.py
SEEDS=${SEEDS:-"1 2 3"}
runs=()
for seed in $SEEDS; do
  name="bench_sac_HalfCheetah-v4_$seed"
  rm -rf "runs/$name"  # a fresh run, not a resume of an earlier benchmark
  timeout -s TERM --kill-after 120 "${SECONDS_PER_SEED:-600}" uv run python $S --env-id HalfCheetah-v4 --seed "$seed" \
    --actor-device-ids 0 --learner-device-ids 1 --total-timesteps 1000000 --log-frequency 20 --run-name "$name" \
    --checkpoint-frequency 0 | grep -v "^checkpoint saved" | tail -n 3
  runs+=("runs/$name")
done
uv run python benchmark/plot.py curves --runs "${runs[@]}" --labels "Sebulba SAC" \
  --output static/sac_halfcheetah.png \
  --title "Sebulba SAC, HalfCheetah-v4 (2-core CPU, JAX on CPU; a0-l1, 2 actor threads x 4 envs, replay ratio 1)" \
  --references "CleanRL sac_continuous_action at 1M steps (HalfCheetah-v2, 9634.89 +- 1423.73)=9634.89"
