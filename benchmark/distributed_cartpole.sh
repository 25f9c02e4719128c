#!/usr/bin/env bash
# One process vs two jax.distributed processes on this host, same CartPole-v1 config and global batch
# (1 x 8 envs vs 2 x 4 envs, a0-l1 in each process). Prints wall time, final SPS and best average return.
# usage: bash benchmark/distributed_cartpole.sh   (from the repository root)
set -euo pipefail
S=cleanba/cleanba_ppo_envpool_impala_atari_wrapper.py
FLAGS="--env-id CartPole-v1 --num-steps 128 --hiddens 64 64 --clip-coef 0.2 --learning-rate 1e-3 --num-actor-threads 1
       --actor-device-ids 0 --learner-device-ids 1 --total-timesteps 250000 --log-frequency 1"
out=$(mktemp -d)
summary() {  # $1 label, $2 seconds, $3 log of process 0
  sps=$(grep -o ' SPS=[0-9]*' "$3" | tail -n 1)
  best=$(grep -o 'avg_episodic_return=[0-9.]*' "$3" | cut -d= -f2 | sort -g | tail -n 1)
  echo "$1: wall ${2}s, final$sps, best avg_episodic_return $best"
}
start=$EPOCHREALTIME
uv run python $S $FLAGS --local-num-envs 8 --run-name bench_d1 > "$out/d1.log" 2>&1
summary "1 process x 8 envs" "$(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $start}")" "$out/d1.log"
port=$((20000 + RANDOM % 20000))
start=$EPOCHREALTIME
for i in 0 1; do
  uv run python $S $FLAGS --local-num-envs 4 --run-name bench_d2 --distributed \
    --coordinator-address 127.0.0.1:$port --num-processes 2 --process-id $i > "$out/d2_$i.log" 2>&1 &
done
wait
summary "2 processes x 4 envs" "$(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $start}")" "$out/d2_0.log"
grep -h "final params sha256" "$out"/d2_*.log
