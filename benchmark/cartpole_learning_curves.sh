#!/usr/bin/env bash
# static/cartpole_learning_curves.png: PPO and IMPALA on CartPole-v1, 3 seeds each, run one after the other
# with the README's quick-start commands (PPO and IMPALA), then drawn from their TensorBoard events.
# usage: bash benchmark/cartpole_learning_curves.sh   (from the repository root; about 4 minutes on 2 CPU cores)
set -euo pipefail
LAYOUT="--local-num-envs 8 --num-actor-threads 1 --hiddens 64 64 --learning-rate 1e-3 --actor-device-ids 0 --learner-device-ids 1"
uv run python -m cleanrl_utils.benchmark --env-ids CartPole-v1 --num-seeds 3 --workers 1 --command \
  "uv run python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --exp-name ppo_cartpole $LAYOUT --num-steps 128 --clip-coef 0.2 --total-timesteps 250000"
uv run python -m cleanrl_utils.benchmark --env-ids CartPole-v1 --num-seeds 3 --workers 1 --command \
  "uv run python cleanba/cleanba_impala_envpool_impala_atari_wrapper.py --exp-name impala_cartpole $LAYOUT --num-steps 20 --num-minibatches 1 --total-timesteps 200000"
uv run python benchmark/plot.py curves --env-id CartPole-v1 --exp-names ppo_cartpole impala_cartpole \
  --labels PPO IMPALA --output static/cartpole_learning_curves.png
