#!/usr/bin/env bash
# The env families of the seed systems on this 2-core CPU: one cheap task per family, seed 1, a CPU-minutes budget
# each (the GPU-scale budgets of SEED RL / Procgen are out of reach here). Prints each run's final lines and the
# random policy's mean return measured on the same env, then draws static/seed_envs.png.
# Holds /tmp/cleanba-bench.lock throughout, so no other benchmark of this repository runs at the same time.
# usage: bash benchmark/seed_envs.sh   (from the repository root)
set -euo pipefail
exec 9>/tmp/cleanba-bench.lock
flock 9
PPO=cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py
MUJOCO=cleanba/cleanba_ppo_continuous_action_envpool_mujoco.py
common=(--seed 1 --num-actor-threads 1 --checkpoint-frequency 0)
run() {  # run NAME SCRIPT FLAGS...: a fresh run, its wall time, its last two log lines
  local name=$1 script=$2; shift 2
  rm -rf "runs/$name"
  local start=$EPOCHREALTIME
  uv run python "$script" "${common[@]}" --run-name "$name" "$@" | grep "^update=" | tail -2
  echo "$name: wall $(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $start}")s"
}
# MiniGrid: rl-starter-files' PPO settings (lr 1e-3, 4 epochs), 16 envs x 32 steps
run seed_envs_minigrid $PPO --env-id MiniGrid-Empty-5x5-v0 --local-num-envs 16 --num-steps 32 --num-minibatches 4 \
  --update-epochs 4 --learning-rate 1e-3 --hiddens 64 64 --total-timesteps 61440 --log-frequency 5
# dm_control: the MuJoCo PPO script's defaults (PPO paper Table 3), 200k steps
run seed_envs_dmc $MUJOCO --env-id CartpoleBalance-v1 --total-timesteps 200000 --log-frequency 10
# Procgen: one level with Procgen's simplified visuals (the learning test's env, tests/test_envs.py), PPO with a
# CPU-sized IMPALA CNN (one 4-channel stage, 32 hidden), 64 envs x 16 steps, lr 2e-3
procgen_options=(num_levels=1 use_backgrounds=False restrict_themes=True use_monochrome_assets=True)
run seed_envs_procgen $PPO --env-id BigfishEasy-v0 --env-options "${procgen_options[@]}" --local-num-envs 64 \
  --num-steps 16 --num-minibatches 4 --update-epochs 2 --learning-rate 2e-3 --channels 4 --hiddens 32 \
  --total-timesteps 65536 --log-frequency 8
# Football: the learning test's settings (tests/test_envs.py): CPU-sized IMPALA CNN on one SMM frame, lr 1e-3
run seed_envs_football $PPO --env-id gfootball/academy_empty_goal_close-v1 --local-num-envs 16 --num-steps 32 \
  --num-minibatches 4 --update-epochs 2 --learning-rate 1e-3 --channels 4 --hiddens 32 --total-timesteps 24576 \
  --log-frequency 4
# VizDoom: DefendTheCenter (the learning test's task) on cheaper frames through --env-options (one 30x45 RGB frame:
# the resolution of ViZDoom's own DQN example), CPU-sized IMPALA CNN
vizdoom_options=(img_height=30 img_width=45 stack_num=1)
run seed_envs_vizdoom $PPO --env-id DefendTheCenter-v1 --env-options "${vizdoom_options[@]}" --local-num-envs 16 \
  --num-steps 32 --num-minibatches 4 --update-epochs 2 --learning-rate 1e-3 --channels 4 --hiddens 32 \
  --total-timesteps 49152 --log-frequency 8
baselines=()
for env_and_options in MiniGrid-Empty-5x5-v0 CartpoleBalance-v1 "BigfishEasy-v0 ${procgen_options[*]}" \
  gfootball/academy_empty_goal_close-v1 "DefendTheCenter-v1 ${vizdoom_options[*]}"; do
  read -r env options <<< "$env_and_options"
  line=$(uv run python -m cleanrl_utils.envs "$env" 100 $options 2>/dev/null | tail -1)
  echo "$line"
  baselines+=("$(echo "$line" | awk '{print $4}' | tr -d :)")
done
uv run python benchmark/plot.py panels --runs runs/seed_envs_minigrid runs/seed_envs_dmc runs/seed_envs_procgen \
  runs/seed_envs_football runs/seed_envs_vizdoom --labels "MiniGrid-Empty-5x5-v0 (PPO)" \
  "CartpoleBalance-v1 (MuJoCo PPO)" "BigfishEasy-v0, one level (PPO)" "academy_empty_goal_close (PPO)" "DefendTheCenter-v1 (PPO)" --baselines "${baselines[@]}" \
  --output static/seed_envs.png --title "Seed-system env families, seed 1, 2-core CPU (JAX on CPU)"
