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
# Procgen: PPO with the IMPALA CNN (Procgen paper's PPO: lr 5e-4, gamma 0.999, lambda 0.95, 3 epochs, ent 0.01)
run seed_envs_procgen $PPO --env-id BigfishEasy-v0 --local-num-envs 32 --num-steps 64 --num-minibatches 8 \
  --update-epochs 3 --learning-rate 5e-4 --gamma 0.999 --gae-lambda 0.95 --ent-coef 0.01 --channels 16 32 32 \
  --total-timesteps 40960 --log-frequency 5
# Football: PPO with the IMPALA CNN on one SMM frame
run seed_envs_football $PPO --env-id gfootball/academy_empty_goal_close-v1 --local-num-envs 16 --num-steps 64 \
  --num-minibatches 4 --update-epochs 2 --channels 16 32 32 --total-timesteps 40960 --log-frequency 5
# VizDoom: PPO with one 4-channel IMPALA CNN stage on 4 stacked RGB frames (the README's table row)
run seed_envs_vizdoom $PPO --env-id Basic-v1 --local-num-envs 16 --num-steps 32 --num-minibatches 4 \
  --update-epochs 2 --learning-rate 5e-4 --channels 4 --hiddens 64 --total-timesteps 40960 --log-frequency 5
baselines=()
for env in MiniGrid-Empty-5x5-v0 CartpoleBalance-v1 BigfishEasy-v0 gfootball/academy_empty_goal_close-v1 Basic-v1; do
  line=$(uv run python -m cleanrl_utils.envs "$env" 100 2>/dev/null | tail -1)
  echo "$line"
  baselines+=("$(echo "$line" | awk '{print $4}' | tr -d :)")
done
uv run python benchmark/plot.py panels --runs runs/seed_envs_minigrid runs/seed_envs_dmc runs/seed_envs_procgen \
  runs/seed_envs_football runs/seed_envs_vizdoom --labels "MiniGrid-Empty-5x5-v0 (PPO)" \
  "CartpoleBalance-v1 (MuJoCo PPO)" "BigfishEasy-v0 (PPO)" "academy_empty_goal_close (PPO)" "Basic-v1 (PPO)" --baselines "${baselines[@]}" \
  --output static/seed_envs.png --title "Seed-system env families, seed 1, 2-core CPU (JAX on CPU)"
