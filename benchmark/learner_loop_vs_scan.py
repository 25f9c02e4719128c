"""Why the PPO learner loops over minibatches in Python instead of `lax.scan`: measure both.

One PPO update (epochs x minibatches of the IMPALA CNN) on one device, same data, same math:
  loop: a Python loop calling one jitted minibatch step (what the cleanba scripts do)
  scan: one jitted function scanning the minibatch step over all minibatches (Cleanba's way)
Prints compile and steady-state seconds for each, and the ratio, measured in this one process.

usage: uv run python benchmark/learner_loop_vs_scan.py [--envs 16 --steps 32 --minibatches 4 --epochs 4 --repeats 3]
"""

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

SCRIPT = Path(__file__).resolve().parent.parent / "cleanba" / "cleanba_ppo_envpool_impala_atari_wrapper.py"
spec = importlib.util.spec_from_file_location("ppo", SCRIPT)
ppo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ppo)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    cli = parser.parse_args()
    samples = cli.envs * cli.steps
    rng = np.random.default_rng(0)
    batch = (
        rng.integers(0, 255, size=(samples, 4, 84, 84), dtype=np.uint8),  # obs
        rng.integers(0, 4, size=samples).astype(np.int32),  # actions
        np.full(samples, np.log(0.25), np.float32),  # old logprobs
        rng.normal(size=samples).astype(np.float32),  # old values
        rng.normal(size=samples).astype(np.float32),  # advantages
        rng.normal(size=samples).astype(np.float32),  # returns
        np.ones(samples, bool),  # valid
    )
    batch = jax.tree.map(jnp.asarray, batch)
    agent = ppo.Agent(action_dim=4, channels=(16, 32, 32), hiddens=(256,), obs_layout="chw")
    params = jax.device_get(agent.init(jax.random.key(0), batch[0][:1]))
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(2.5e-4, eps=1e-5))

    def minibatch_step(state, minibatch):
        obs, actions, old_logprobs, old_values, advantages, returns, valid = minibatch

        def loss_fn(params):
            logits, values = agent.apply(params, obs)
            logprobs, entropy = ppo.categorical_logprob_entropy(logits, actions)
            pg, v, ent, _ = ppo.ppo_loss_terms(logprobs, entropy, values, old_logprobs, old_values, advantages,
                                               returns, valid, jnp.float32(valid.shape[0]), 0.1, True)
            return pg - 0.01 * ent + 0.5 * v

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    def minibatches(permutation):
        return jax.tree.map(lambda x: x[permutation].reshape(cli.minibatches, -1, *x.shape[1:]), batch)

    loop_step = jax.jit(minibatch_step, donate_argnums=(0,))

    def loop_update(state, key):
        for _ in range(cli.epochs):
            key, subkey = jax.random.split(key)
            stacked = minibatches(jax.random.permutation(subkey, samples))
            for i in range(cli.minibatches):
                state, loss = loop_step(state, jax.tree.map(lambda x: x[i], stacked))
        return state, loss

    @jax.jit
    def scan_update(state, key):
        def epoch(state, key):
            permutation = jax.random.permutation(key, samples)
            stacked = jax.tree.map(lambda x: x[permutation].reshape(cli.minibatches, -1, *x.shape[1:]), batch)
            return jax.lax.scan(minibatch_step, state, stacked)

        state, losses = jax.lax.scan(epoch, state, jax.random.split(key, cli.epochs))
        return state, losses[-1, -1]

    print(f"one PPO update: {samples} samples, {cli.epochs} epochs x {cli.minibatches} minibatches, IMPALA CNN, "
          f"{jax.devices()[0].platform}")
    results = {}
    for name, update in [("loop", loop_update), ("scan", scan_update)]:
        times = []
        for repeat in range(cli.repeats + 1):  # the first call compiles
            state = TrainState.create(apply_fn=None, params=jax.tree.map(jnp.array, params), tx=tx)
            start = time.time()
            state, loss = update(state, jax.random.key(repeat))
            jax.block_until_ready(loss)
            times.append(time.time() - start)
        results[name] = statistics.median(times[1:])
        print(f"{name}: first call (with compile) {times[0]:.1f}s, then median {results[name]:.2f}s "
              f"(min {min(times[1:]):.2f}, max {max(times[1:]):.2f})", flush=True)
    print(f"scan / loop steady-state time: {results['scan'] / results['loop']:.1f}x")


if __name__ == "__main__":
    main()
