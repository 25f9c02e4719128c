#!/usr/bin/env bash
# Sebulba R2D2 on CartPole-v1 with the CPU settings of tests/test_r2d2.py's learning tests (16 envs, a 64-unit
# LSTM, replay ratio 1/16; sequences of 16 plain, 32 masked: see docs/rl-algorithms/r2d2.md for what differs from
# the paper's defaults and why): plain CartPole with the LSTM (to 120k env steps, as the test), and
# CartPole with its velocities hidden (tests/observation_mask.py zeroes observation entries 1 and 3) with the LSTM
# and with the feed-forward core. SEEDS (default "1 2 3") one after the other (runs named by --exp-name); then
# draws static/r2d2_cartpole.png and prints each experiment's final values (the mean of its last 10 logged values)
# of the return and of charts/SPS. Then the SPS of tiny Breakout (a 4-channel IMPALA CNN, an 8-unit LSTM; 2
# threads x 4 envs x 8 steps). Holds /tmp/cleanba-bench.lock throughout, so no other benchmark of this repository runs at the
# same time.
# usage: bash benchmark/r2d2_cartpole.sh   (from the repository root)
set -uo pipefail
exec 9>/tmp/cleanba-bench.lock
flock 9
S=cleanba/cleanba_r2d2_envpool_impala_atari_wrapper.py
CARTPOLE="--env-id CartPole-v1 --local-num-envs 16 --num-actor-threads 1 --n-step 3 --gamma 0.99 --lstm-size 64
          --hiddens 64 --minibatch-size 64 --buffer-size 160000 --learning-starts 2048 --learning-rate 5e-4
          --target-update-period 200 --replay-ratio 0.0625 --log-frequency 10 --checkpoint-frequency 0
          --actor-device-ids 0 --learner-device-ids 1"
PLAIN="--num-steps 16 --sequence-length 16 --burn-in 4 --total-timesteps 120000"  # test_cartpole_reaches_400's
MASKED="--num-steps 32 --sequence-length 32 --burn-in 8 --total-timesteps 150000"  # the masked tests'
SEEDS=${SEEDS:-"1 2 3"}
for seed in $SEEDS; do
  uv run python $S $CARTPOLE $PLAIN --seed "$seed" --exp-name r2d2_lstm | tail -n 2
  uv run python tests/observation_mask.py $S 1,3 $CARTPOLE $MASKED --seed "$seed" --exp-name r2d2_masked_lstm | tail -n 2
  uv run python tests/observation_mask.py $S 1,3 $CARTPOLE $MASKED --seed "$seed" --exp-name r2d2_masked_feedforward \
    --core feedforward | tail -n 2
done
uv run python benchmark/plot.py curves --env-id CartPole-v1 --exp-names r2d2_lstm r2d2_masked_lstm \
  r2d2_masked_feedforward --labels "LSTM" "LSTM, velocities hidden" "feed-forward, velocities hidden" \
  --tags charts/avg_episodic_return charts/SPS --output static/r2d2_cartpole.png \
  --title "Sebulba R2D2, CartPole-v1 (2-core CPU; a0-l1, 1 thread x 16 envs, Ape-X epsilons)"
name=bench_r2d2_breakout
rm -rf "runs/$name"
# tiny Breakout as in tests/test_r2d2.py's layout runs (2 threads x 4 envs x 8 steps, sequences of 8), 60 updates: on
# CPU the conv weight-gradients inside the gradient steps' lax.scan are slow (see "Performance")
uv run python $S --env-id Breakout-v5 --local-num-envs 4 --num-actor-threads 2 --num-steps 8 --sequence-length 8 \
  --burn-in 2 --channels 4 --hiddens 16 --lstm-size 8 --minibatch-size 4 --buffer-size 512 --learning-starts 0 \
  --replay-ratio 0.015625 --total-timesteps 3840 --log-frequency 10 --checkpoint-frequency 0 \
  --actor-device-ids 0 --learner-device-ids 1 --run-name "$name" | grep "^update=" | tail -n 1
