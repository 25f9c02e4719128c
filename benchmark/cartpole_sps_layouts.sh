#!/usr/bin/env bash
# static/cartpole_sps_layouts.png and docs/performance.md's SPS table: PPO on CartPole-v1 (quick-start network, 8 envs
# per actor thread, 100k steps) in each device layout, with 1 and 2 actor threads, 3 seeds each, one run at a time.
# usage: bash benchmark/cartpole_sps_layouts.sh   (from the repository root; about 5 minutes on 2 CPU cores)
set -euo pipefail
FLAGS="--local-num-envs 8 --num-steps 128 --hiddens 64 64 --clip-coef 0.2 --learning-rate 1e-3 --total-timesteps 100000"
LAYOUTS=(  # exp name suffix | flags
  "a0-l0_1thread|--actor-device-ids 0 --learner-device-ids 0 --num-actor-threads 1"
  "a0-l1_1thread|--actor-device-ids 0 --learner-device-ids 1 --num-actor-threads 1"
  "a0-l1,2_1thread|--actor-device-ids 0 --learner-device-ids 1 2 --num-actor-threads 1"
  "a0-l0_2threads|--actor-device-ids 0 --learner-device-ids 0 --num-actor-threads 2"
  "a0-l1_2threads|--actor-device-ids 0 --learner-device-ids 1 --num-actor-threads 2"
)
names=()
for layout in "${LAYOUTS[@]}"; do
  name="sps_${layout%%|*}"
  names+=("$name")
  uv run python -m cleanrl_utils.benchmark --env-ids CartPole-v1 --num-seeds 3 --workers 1 --command \
    "uv run python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --exp-name $name $FLAGS ${layout#*|}"
done
uv run python benchmark/plot.py sps --env-id CartPole-v1 --exp-names "${names[@]}" \
  --labels "a0-l0
1 thread" "a0-l1
1 thread" "a0-l1,2
1 thread" "a0-l0
2 threads" "a0-l1
2 threads" --output static/cartpole_sps_layouts.png
