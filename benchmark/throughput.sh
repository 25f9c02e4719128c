#!/usr/bin/env bash
# The stage table of benchmark/throughput.py for every script and config of the README's performance section.
# usage: bash benchmark/throughput.sh [results.jsonl]   (from the repository root; ~25 min on a 2-core CPU)
set -euo pipefail
out=${1:-throughput.jsonl}
CARTPOLE="--env-id CartPole-v1 --hiddens 64 64 --actor-device-ids 0 --learner-device-ids 1"
BREAKOUT_TINY="--env-id Breakout-v5 --num-steps 32 --channels 4 --hiddens 16 --num-minibatches 2 --actor-device-ids 0
               --learner-device-ids 1"
for algorithm in ppo impala; do
  script=cleanba/cleanba_${algorithm}_envpool_impala_atari_wrapper.py
  for threads in 1 2; do
    uv run python benchmark/throughput.py --script $script --json "$out" -- $CARTPOLE --local-num-envs 8 --num-actor-threads $threads
    uv run python benchmark/throughput.py --script $script --json "$out" -- $CARTPOLE --local-num-envs 32 --num-actor-threads $threads
    uv run python benchmark/throughput.py --script $script --json "$out" --full-updates 30 -- $BREAKOUT_TINY --local-num-envs 8 --num-actor-threads $threads
  done
done
