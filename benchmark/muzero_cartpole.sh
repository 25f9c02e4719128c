#!/usr/bin/env bash
# static/muzero_cartpole.png: MuZero (Gumbel search, 8 simulations) on CartPole-v1, 3 seeds, run one after the other
# with the learning test's CPU settings (tests/test_muzero.py: CARTPOLE_MUZERO), then drawn from their TensorBoard
# events, with the bar of 400 as a reference line.
# usage: bash benchmark/muzero_cartpole.sh   (from the repository root; a few minutes on 2 CPU cores)
set -euo pipefail
SETTINGS="--local-num-envs 32 --num-actor-threads 1 --num-steps 8 --hiddens 64 --embedding-size 32 --support-size 10 \
--gamma 0.99 --num-simulations 8 --max-num-considered-actions 2 --minibatch-size 128 --buffer-size 8192 \
--replay-ratio 0.125 --learning-rate 1e-3 --actor-device-ids 0 --learner-device-ids 1 --checkpoint-frequency 0"
uv run python -m cleanrl_utils.benchmark --env-ids CartPole-v1 --num-seeds 3 --workers 1 --command \
  "uv run python cleanba/cleanba_muzero_envpool_impala_atari_wrapper.py --exp-name muzero_cartpole $SETTINGS --total-timesteps 122880"
uv run python benchmark/plot.py curves --env-id CartPole-v1 --exp-names muzero_cartpole --labels "Sebulba MuZero" \
  --references "the issue's bar=400" --output static/muzero_cartpole.png
