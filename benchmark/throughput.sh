#!/usr/bin/env bash
# The stage tables of benchmark/throughput.py for every script and config of docs/performance.md,
# 1 and 2 actor threads each; then the markdown table of all of them.
# usage: bash benchmark/throughput.sh [results.jsonl [scripts folder]]   (from the repository root; ~20 min on 2 cores)
set -euo pipefail
out=${1:-throughput.jsonl}
dir=${2:-cleanba}
# the arguments are checked before the first of the runs (a bad one would otherwise fail minutes in, or be a file name)
usage="usage: bash benchmark/throughput.sh [results.jsonl [scripts folder]]"
[ $# -le 2 ] || { echo "error: too many arguments (from '$3' on); $usage" >&2; exit 2; }
case $out in -*) echo "error: results file '$out': throughput.sh takes no flags; $usage" >&2; exit 2 ;; esac
for algorithm in ppo impala; do
  [ -f "$dir/cleanba_${algorithm}_envpool_impala_atari_wrapper.py" ] ||
    { echo "error: scripts folder '$dir' has no cleanba_${algorithm}_envpool_impala_atari_wrapper.py; $usage" >&2; exit 2; }
done
harness="uv run python benchmark/throughput.py --json $out --repeats 3 --full-repeats 2"
CARTPOLE="--env-id CartPole-v1 --hiddens 64 64 --actor-device-ids 0 --learner-device-ids 1"
BREAKOUT_TINY="--env-id Breakout-v5 --num-steps 32 --channels 4 --hiddens 16 --num-minibatches 2 --local-num-envs 8
               --actor-device-ids 0 --learner-device-ids 1"
for algorithm in ppo impala; do
  script=$dir/cleanba_${algorithm}_envpool_impala_atari_wrapper.py
  for threads in 1 2; do
    $harness --script $script --full-updates 60 -- $CARTPOLE --local-num-envs 8 --num-actor-threads $threads
    $harness --script $script --full-updates 30 -- $CARTPOLE --local-num-envs 32 --num-actor-threads $threads
    $harness --script $script --full-updates 30 -- $BREAKOUT_TINY --num-actor-threads $threads
  done
done
if [ -f $dir/cleanba_ppo_continuous_action_envpool_mujoco.py ]; then
  for threads in 1 2; do  # the script's defaults (PPO paper: 2048 steps per update), 10 epochs x 32 minibatches
    $harness --script $dir/cleanba_ppo_continuous_action_envpool_mujoco.py --full-updates 12 -- --env-id HalfCheetah-v4 \
      --actor-device-ids 0 --learner-device-ids 1 --num-actor-threads $threads --local-num-envs $((8 / threads))
  done
fi
uv run python benchmark/throughput.py --summarize "$out"
