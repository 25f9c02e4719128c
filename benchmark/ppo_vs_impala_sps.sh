#!/usr/bin/env bash
# SPS of the PPO and IMPALA scripts on the same configs, run one after the other in this session.
# usage: bash benchmark/ppo_vs_impala_sps.sh   (from the repository root)
set -euo pipefail
CARTPOLE="--env-id CartPole-v1 --local-num-envs 8 --num-actor-threads 1 --hiddens 64 64 --actor-device-ids 0
          --learner-device-ids 1 --total-timesteps 100000 --log-frequency 1000"
BREAKOUT="--env-id Breakout-v5 --local-num-envs 4 --num-steps 8 --num-actor-threads 2 --channels 4 --hiddens 16
          --num-minibatches 2 --actor-device-ids 0 --learner-device-ids 1 --total-timesteps 2560 --log-frequency 1000"
for config in CARTPOLE BREAKOUT; do
  for algorithm in ppo impala; do
    start=$EPOCHREALTIME
    sps=$(uv run python cleanba/cleanba_${algorithm}_envpool_impala_atari_wrapper.py ${!config} \
          --run-name "bench_${algorithm}_${config}" 2>&1 | grep -o ' SPS=[0-9]*' | tail -n 1)
    echo "$config $algorithm:$sps, wall $(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $start}")s"
  done
done
