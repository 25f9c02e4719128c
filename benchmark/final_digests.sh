#!/usr/bin/env bash
# The final state digests of one small run of each script, with the settings of its same-seed test: a refactor that
# must not change what the scripts compute ("Shape v2") prints the same lines before and after. The digests depend
# on the processor (XLA's CPU code differs between machines): compare lines printed on one machine.
# usage: bash benchmark/final_digests.sh > before.txt; (change the code); bash benchmark/final_digests.sh | diff before.txt -
# (from the repository root; 6 to 13 minutes on 2 shared Intel Xeon cores, measured twice on 2026-11-27)
set -euo pipefail
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT
root=$(pwd)
run() {  # name script flags...: the final line, without the process number
  local name=$1 script=$2
  shift 2
  (cd "$workdir" && uv run --project "$root" python "$root/cleanba/$script" --run-name "$name" "$@" 2>/dev/null) |
    sed -n "s/^process 0: final /$name: /p"
}
# tests/test_learning.py::test_same_seed_same_run
run ppo cleanba_ppo_envpool_impala_atari_wrapper.py --env-id CartPole-v1 --num-steps 128 --hiddens 64 64 \
  --clip-coef 0.2 --learning-rate 1e-3 --learner-device-ids 1 2 --num-actor-threads 2 --local-num-envs 8 \
  --total-timesteps 8192 --seed 7
# tests/test_impala.py::test_same_seed_same_run
run impala cleanba_impala_envpool_impala_atari_wrapper.py --env-id CartPole-v1 --local-num-envs 8 --num-steps 20 \
  --num-minibatches 1 --hiddens 64 64 --learning-rate 1e-3 --actor-device-ids 0 --learner-device-ids 1 \
  --num-actor-threads 2 --total-timesteps 9600 --seed 3
# tests/test_mujoco.py::test_same_seed_same_params_and_statistics (without --save-model: the same state)
run mujoco_ppo cleanba_ppo_continuous_action_envpool_mujoco.py --env-id Hopper-v4 --local-num-envs 2 --num-steps 16 \
  --hiddens 8 --num-minibatches 2 --update-epochs 2 --num-actor-threads 2 --actor-device-ids 0 \
  --learner-device-ids 1 2 --total-timesteps 256 --checkpoint-frequency 2 --seed 3
# tests/test_sac.py, test_r2d2.py, test_muzero.py: the tiny settings of their same-seed runs, 8 updates (the tests now
# run 12; these stay at 8, as when the digests of benchmark/results/final_digests_*_shape_v2.txt were recorded)
run sac cleanba_sac_continuous_action_envpool_mujoco.py --env-id Pendulum-v1 --local-num-envs 4 \
  --num-actor-threads 1 --num-steps 8 --hiddens 16 --minibatch-size 16 --buffer-size 512 --learning-starts 64 \
  --replay-ratio 0.25 --actor-device-ids 0 --learner-device-ids 1 --total-timesteps 256 --seed 3
run r2d2 cleanba_r2d2_envpool_impala_atari_wrapper.py --env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 \
  --num-steps 8 --sequence-length 8 --burn-in 2 --n-step 2 --lstm-size 8 --hiddens 16 --minibatch-size 4 \
  --buffer-size 256 --learning-starts 64 --replay-ratio 0.0625 --target-update-period 4 --actor-device-ids 0 \
  --learner-device-ids 1 --total-timesteps 256 --seed 3
run muzero cleanba_muzero_envpool_impala_atari_wrapper.py --env-id CartPole-v1 --local-num-envs 4 \
  --num-actor-threads 1 --num-steps 8 --hiddens 16 --embedding-size 8 --support-size 5 --num-simulations 4 \
  --unroll-steps 3 --td-steps 3 --minibatch-size 8 --buffer-size 512 --replay-ratio 0.125 --actor-device-ids 0 \
  --learner-device-ids 1 --total-timesteps 256 --seed 3
# tests/test_anakin.py's tiny settings on two learner devices, 20 updates
run ppo_anakin cleanba_ppo_anakin.py --local-num-envs 8 --num-steps 16 --hiddens 16 --num-minibatches 2 \
  --update-epochs 2 --learner-device-ids 0 1 --total-timesteps 5120 --seed 3
# tests/test_onpolicy.py's V-MPO run (V-trace advantages, two learner devices), 10 updates
run onpolicy cleanba_onpolicy_continuous_action_envpool_mujoco.py --env-id Hopper-v4 --num-actor-threads 1 \
  --local-num-envs 4 --num-steps 16 --hiddens 8 --num-minibatches 2 --update-epochs 2 --actor-device-ids 0 \
  --learner-device-ids 1 2 --policy-loss vmpo --advantage-estimator vtrace --total-timesteps 640 --seed 3
# tests/test_anakin.py's tiny settings, the continuous script on CartpoleBalance with two learner devices, 10 updates
run ppo_anakin_continuous cleanba_ppo_continuous_action_anakin.py --env-id CartpoleBalance --local-num-envs 8 \
  --num-steps 16 --hiddens 16 --num-minibatches 2 --update-epochs 2 --learner-device-ids 0 1 --total-timesteps 2560 \
  --seed 3
