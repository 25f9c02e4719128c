"""The ceiling of the Anakin script on this machine, per JAX env library: how fast the env step alone runs, and what
the MinAtar network's gradient costs inside the update's `lax.scan`.

    uv run python benchmark/jax_env_ceiling.py --env-ids MiniGrid-Empty-5x5 minatar-breakout --num-envs 32 1024 4096

1. **Env step** (`--parts step`): uniformly random actions, a jitted `lax.scan` of `--num-steps` batched steps of
   the script's adapter (cleanrl_utils/jax_envs.py, envpool's auto-reset included), timed over `--repeats` calls
   after one to compile: env steps per second, the most an Anakin PPO run of that env and size could step.
2. **Torso gradient** (`--parts torso`): the gradient of the actor-critic's outputs for one minibatch of
   `--minibatch-size` MinAtar observations, with the script's MinAtar torso (a Dense layer on 2x2 patches) and with
   the same torso written as `nn.Conv`, each as one jitted call and inside a `lax.scan` of 4 steps (as the
   update's minibatches run): milliseconds per minibatch.

One measurement at a time; each appends a JSON line (with the processor, the GPU if any, and the date) to --results
and the tables are printed. On a CPU other processes' load changes every number: run it on a quiet machine.
"""

import datetime
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from tool_helpers import check_each, machine

from cleanrl_utils.cli import fail, run_cli
from cleanrl_utils.errors import UsageError
from cleanrl_utils.evals.evaluate import load_script
from cleanrl_utils.jax_envs import check_env_id, make_jax_env


@dataclass
class Args:
    env_ids: list[str] = field(default_factory=lambda: ["MiniGrid-Empty-5x5", "minatar-breakout"])
    num_envs: list[int] = field(default_factory=lambda: [32, 256, 1024, 4096])
    num_steps: int = 128
    repeats: int = 3
    minibatch_size: int = 4096
    parts: list[str] = field(default_factory=lambda: ["step", "torso"])
    results: str = "benchmark/results/jax_env_ceiling.jsonl"


def env_step_sps(env_id: str, num_envs: int, num_steps: int, repeats: int) -> float:
    env = make_jax_env(env_id)

    def steps(states, key):
        def step(states, key):
            actions = jax.vmap(env.sample_action)(jax.random.split(key, num_envs))
            states = env.step_envs(states, actions)
            return states, jax.vmap(env.reward)(states).sum()

        return jax.lax.scan(step, states, jax.random.split(key, num_steps))

    states = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(0), num_envs))
    steps = jax.jit(steps)
    states, rewards = jax.block_until_ready(steps(states, jax.random.key(1)))  # compiles
    started = time.perf_counter()
    for repeat in range(repeats):
        states, rewards = jax.block_until_ready(steps(states, jax.random.key(2 + repeat)))
    return repeats * num_steps * num_envs / (time.perf_counter() - started)


def torso_gradient_ms(torso: str, minibatch_size: int, scanned: bool) -> float:
    """Milliseconds per minibatch of the actor-critic's gradient on MinAtar-shaped observations."""
    anakin = load_script(Path(__file__).parent.parent / "cleanba" / "cleanba_ppo_anakin.py")

    class ConvTorso(nn.Module):
        """The script's torso with nn.Conv in place of the patch layer (the same function)."""

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(32, (2, 2), padding="SAME")(x.astype(jnp.float32)))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
            return nn.relu(nn.Dense(64)(x.reshape((x.shape[0], -1))))

    class Network(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = (anakin.MinAtarTorso() if torso == "patches" else ConvTorso())(x)
            logits, value = anakin.MLP((64, 64))(x), anakin.MLP((64, 64))(x)
            return nn.Dense(3)(logits).sum() + nn.Dense(1)(value).sum()

    network = Network()
    obs = jnp.asarray(np.random.default_rng(0).random((4, minibatch_size, 10, 10, 4)) > 0.8)
    params = network.init(jax.random.key(0), obs[0, :1])
    grad = jax.grad(network.apply)
    if scanned:
        step = lambda params, o: (jax.tree.map(lambda p, g: p - 1e-4 * g, params, grad(params, o)), None)
        call, calls = jax.jit(lambda params, obs: jax.lax.scan(step, params, obs)[0]), 4
        argument = obs
    else:
        call, calls, argument = jax.jit(grad), 1, obs[0]
    jax.block_until_ready(call(params, argument))
    started = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(call(params, argument))
    return (time.perf_counter() - started) / (3 * calls) * 1000


def check_either_kind(env_id: str):
    """An id of an Anakin script of either action kind (the step is timed with the env's own random actions); the
    discrete kind's line if neither (it names the ids the MinAtar torso's part is about)."""
    try:
        check_env_id(env_id, discrete=True)
    except UsageError as discrete_error:
        try:
            check_env_id(env_id, discrete=False)
        except UsageError:
            raise discrete_error from None


def record(results: Path, **fields):
    line = {**fields, **machine(), "date": datetime.date.today().isoformat()}
    print(json.dumps(line), flush=True)
    with results.open("a") as file:
        file.write(json.dumps(line) + "\n")


def main(args: Args):
    unknown = sorted(set(args.parts) - {"step", "torso"})
    if unknown:
        fail(f"--parts: unknown {unknown}; expected step and/or torso")
    for name, values in [("num_envs", args.num_envs), ("num_steps", [args.num_steps]), ("repeats", [args.repeats])]:
        if not values or min(values) < 1:
            fail(f"--{name.replace('_', '-')} must be one or more positive integers (got {values})")
    if args.minibatch_size < 1:
        fail(f"--minibatch-size must be a positive integer (got {args.minibatch_size})")
    if "step" in args.parts:
        check_each("--env-ids", args.env_ids, check_either_kind)
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    if "step" in args.parts:
        for env_id in args.env_ids:
            for num_envs in args.num_envs:
                sps = env_step_sps(env_id, num_envs, args.num_steps, args.repeats)
                record(results, part="step", env_id=env_id, num_envs=num_envs, num_steps=args.num_steps, sps=sps)
    if "torso" in args.parts:
        for torso in ["patches", "conv"]:
            for scanned in [False, True]:
                ms = torso_gradient_ms(torso, args.minibatch_size, scanned)
                record(results, part="torso", torso=torso, scanned=scanned, minibatch_size=args.minibatch_size, ms=ms)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
