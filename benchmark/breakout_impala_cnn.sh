#!/usr/bin/env bash
# static/breakout_impala_cnn.png: PPO with the default IMPALA CNN on Breakout-v5 for 16,384 steps (about
# 10 minutes on 2 CPU cores: docs/rl-algorithms/ppo.md's Atari-on-CPU command, run longer), one seed; the saved
# model is then evaluated for 4 games with a video of env 0 (videos/). Drawn from the run's TensorBoard events: the
# return, the throughput and the learner's time per update (s).
# usage: bash benchmark/breakout_impala_cnn.sh   (from the repository root)
set -euo pipefail
uv run python -m cleanrl_utils.benchmark --env-ids Breakout-v5 --num-seeds 1 --workers 1 --command \
  "uv run python cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py --exp-name ppo_breakout_impala_cnn --local-num-envs 8 --num-actor-threads 2 --num-steps 32 --actor-device-ids 0 --learner-device-ids 1 --total-timesteps 16384 --log-frequency 1 --save-model --eval-episodes 4 --capture-video"
uv run python benchmark/plot.py curves --env-id Breakout-v5 --exp-names ppo_breakout_impala_cnn \
  --labels "PPO, IMPALA CNN" --tags charts/avg_episodic_return charts/SPS stats/training_time \
  --output static/breakout_impala_cnn.png
