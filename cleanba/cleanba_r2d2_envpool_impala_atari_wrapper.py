"""Sebulba R2D2 (Kapturowski et al. 2019, "Recurrent experience replay in distributed reinforcement learning") for
envpool's discrete-action envs (Atari, classic control, Football, VizDoom, MiniGrid, Procgen), with the prioritized
sequence replay on the learner devices, sharded along the env axis.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (value rescaling, n-step double Q
targets, priorities, burn-in), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is
the same for every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) comes from
cleanrl_utils/, one small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their own envpool and run
jitted inference on their actor device. Each thread hands its rollout to the learner through its own size-1
`rollout_queue`, already split along the env axis and placed on the learner devices (cleanrl_utils/data_path.py); the
learner answers through a size-1 `params_queue` per thread. Because the actor skips one `params_queue.get()` (its second
rollout), from update 2 on it acts with the policy one version behind the learner's (update 1's: the initial params,
lag 0; `--no-concurrency`: no skip, lag 0, no overlap). The learner is data-parallel over every process's learner
devices (`jax.jit` + `shard_map` over a 1-D mesh, gradients summed with `psum`), so `--distributed` scales it.

Recurrent and off-policy: a torso (IMPALA CNN or MLP), an LSTM core and a dueling Q head. Each actor carries the
recurrent state of each of its envs (zeroed at episode starts) and acts epsilon-greedily with the Ape-X epsilons over
all envs of all threads and processes. A rollout is cut into sequences of `--sequence-length` steps, overlapping by
half, each stored with the recurrent state at its start (R2D2's "stored state"). Each learner device keeps the
sequences of its envs in its replay shard (flashbax's prioritized item buffer), samples its part of every minibatch
by priority and updates their priorities. A sampled sequence's first `--burn-in` steps only warm the LSTM up; the
rest learn n-step double Q targets under the value rescaling h. `--replay-ratio` fixes the gradient steps per env
step, so a seed gives the same run.
"""

import os
import queue
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple

# before numpy loads OpenBLAS: envpool's VizDoom forks its game processes from several threads at once, which
# OpenBLAS's fork handler survives only with one thread (cleanrl_utils/envs.py, FORK_SAFE_ENV)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import flashbax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import rlax
from flax import struct
from flax.serialization import to_state_dict
from flax.training.train_state import TrainState
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from cleanrl_utils.actors import ActorThread
from cleanrl_utils.checkpoints import tree_digest
from cleanrl_utils.cli import run_cli
from cleanrl_utils.data_path import assemble_global_rollout, split_for_learners
from cleanrl_utils.devices import DeviceLayout, local_value, replicate
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool, obs_layout
from cleanrl_utils.errors import UsageError
from cleanrl_utils.evals.evaluate import RecurrentPolicy
from cleanrl_utils.flags import INT32_MAX, SebulbaArgs, check_flags, check_int32_counts, check_run_flags
from cleanrl_utils.logger import EpisodeStats, StageTimer
from cleanrl_utils.memory import checked_for_memory
from cleanrl_utils.replay_sizing import (
    check_minibatch_split,
    check_replay_envs_split,
    check_replay_fits,
    gradient_steps_per_update,
)
from cleanrl_utils.run import SebulbaRun
from cleanrl_utils.saved_model import check_save_model_flags

# envpool's Box spaces warn that they cast to float32
warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32")


@dataclass
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then R2D2's
    env_id: str = "Breakout-v5"
    """the id of an envpool env with discrete actions: Atari, classic control, Football, VizDoom, MiniGrid,
    Procgen (cleanrl_utils/envs.py); images go into the IMPALA CNN, vectors and dicts (flattened) into an MLP"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 50_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    buffer_size: int = 100_000
    """the replay's capacity in observations, over all learner devices; it holds --buffer-size / (--sequence-length
    / 2) sequences (R2D2 Table 1: 4e6 observations, 1e5 sequences: with uint8 Atari frames stored twice, as
    overlapping sequences are, that is 225 GB of device memory; 1e5 takes 5.6 GB) (positive)"""
    minibatch_size: int = 64
    """the sequences of each gradient step, over all learner devices (R2D2 Table 1: 64) (positive)"""
    replay_ratio: float = 1 / 1024
    """gradient steps per env step (R2D2 fixes no ratio: its learner runs as fast as it can; 1/1024 learns each
    stored step about 2.5 times: 64 sequences x 40 learned steps per 1024 env steps) (positive, finite)"""
    learning_starts: int = 50_000
    """env steps stored before the first gradient step (Ape-X, Horgan et al. 2018: 50,000) (non-negative)"""
    learning_rate: float = 1e-4
    """Adam's learning rate (R2D2 Table 1: 1e-4) (positive, finite)"""
    adam_eps: float = 1e-3
    """Adam's epsilon (R2D2 Table 1: 1e-3) (positive, finite)"""
    local_num_envs: int = 64
    """the number of parallel game environments of each actor thread (positive)"""
    num_steps: int = 80
    """the number of steps of each rollout, a multiple of --sequence-length / 2 (R2D2 actors fetch the params
    every 400 env steps; here the actor is one update behind) (positive)"""
    gamma: float = 0.997
    """the discount factor gamma (R2D2 Table 1: 0.997) (in [0, 1])"""
    n_step: int = 5
    """the steps of the n-step double Q targets (R2D2 Table 1: 5) (positive)"""
    sequence_length: int = 80
    """the steps of each stored sequence, even: sequences overlap by half (R2D2 Table 1: 80, overlap 40) (positive)"""
    burn_in: int = 40
    """the first steps of a sampled sequence that only warm the LSTM up (R2D2 Table 1: 40) (non-negative, less
    than --sequence-length - 1)"""
    target_update_period: int = 2500
    """gradient steps between copies of the online network into the target (R2D2 Table 1: 2500) (in [1, 2**31 - 1])"""
    priority_exponent: float = 0.9
    """alpha: sequences are sampled with probability priority^alpha (R2D2 Table 1: 0.9) (in [0, 1])"""
    importance_exponent: float = 0.6
    """beta of the importance-sampling weights (N P)^-beta (R2D2 Table 1: 0.6) (in [0, 1])"""
    priority_eta: float = 0.9
    """a sequence's priority: eta max|td| + (1 - eta) mean|td| of its learned steps (R2D2 Table 1: 0.9) (in [0, 1])"""
    core: Literal["lstm", "feedforward"] = "lstm"
    """the recurrent core: lstm (R2D2), or feedforward (a ReLU layer of --lstm-size and no memory: the ablation)"""
    lstm_size: int = 512
    """the units of the LSTM core (R2D2 Sec. 2.3: 512) (positive)"""
    channels: list[int] = field(default_factory=lambda: [16, 32, 32])
    """the channels of the IMPALA CNN's residual stacks (Espeholt et al. 2018, Fig. 3) (positive)"""
    hiddens: list[int] = field(default_factory=lambda: [256])
    """the hidden layers after the CNN (IMPALA: one of 256), or of the MLP for vector observations (positive)"""

    # derived when the run starts (set_runtime_values), not flags
    gradient_steps: int = field(init=False, default=0)
    """gradient steps per learner update: --replay-ratio x batch_size"""
    learning_starts_updates: int = field(init=False, default=0)
    """the updates that only fill the replay: the learner's gradient steps start after them"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(
        args,
        positive_ints="local_num_envs num_steps buffer_size minibatch_size n_step sequence_length lstm_size".split(),
        non_negative_ints=["learning_starts", "burn_in"],
        positive=["learning_rate", "adam_eps", "replay_ratio"],
        unit_interval=["gamma", "priority_exponent", "importance_exponent", "priority_eta"],
        positive_int_lists=["channels", "hiddens"],
        # optax.periodic_update compares it with the int32 step in jit
        ranges={"target_update_period": (1, INT32_MAX)},
    )
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
    length, burn_in = args.sequence_length, args.burn_in
    if length % 2 != 0:
        raise UsageError(f"--sequence-length ({length}) must be even: sequences overlap by half")
    if burn_in >= length - 1:
        raise UsageError(
            f"--burn-in ({burn_in}) must be less than --sequence-length - 1 ({length - 1}): a sequence learns its "
            "steps after the burn-in that have a next step"
        )
    if args.n_step > length - 1 - burn_in:  # a return stops at its sequence's end
        raise UsageError(
            f"--n-step ({args.n_step}) must be at most --sequence-length - 1 - --burn-in ({length - 1 - burn_in}): "
            "no learned step of a sequence has more rewards after it, so a longer n would be ignored"
        )
    if length > args.num_steps or args.num_steps % (length // 2) != 0:
        raise UsageError(
            f"--num-steps ({args.num_steps}) must be a multiple of --sequence-length / 2 ({length // 2}) and at "
            f"least --sequence-length ({length})"
        )
    check_replay_envs_split(args)  # each actor thread splits its envs over the learner devices
    check_save_model_flags(args, __file__)  # --capture-video, --upload-model, before training


# ---------------------------------------------------------------- environments


def make_env(
    env_id: str,
    seed: int,
    num_envs: int,
    render_mode: str | None = None,
    num_threads: int = 0,
    env_options: Sequence[str] = (),
):
    """envpool gymnasium envs with the family's cited options, dict observations flattened (cleanrl_utils/envs.py);
    env i is seeded with seed + i; render_mode="rgb_array" makes envs.render() return env 0's frame (videos)."""
    return make_envpool(env_id, seed, num_envs, render_mode=render_mode, num_threads=num_threads, overrides=env_options)


# ---------------------------------------------------------------- networks


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        inputs = x
        x = nn.relu(x)
        x = nn.Conv(self.channels, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.Conv(self.channels, kernel_size=(3, 3))(x)
        return x + inputs


class ConvSequence(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, kernel_size=(3, 3))(x)
        x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
        x = ResidualBlock(self.channels)(x)
        x = ResidualBlock(self.channels)(x)
        return x


class ImpalaCNN(nn.Module):
    """The IMPALA "deep" torso (Espeholt et al. 2018, Fig. 3). Observations stay uint8 until here."""

    channels: Sequence[int]
    hiddens: Sequence[int]
    channel_first: bool  # Atari, Procgen: (N, C, H, W); Football's mini map: (N, H, W, C)

    @nn.compact
    def __call__(self, x):
        if self.channel_first:
            x = jnp.transpose(x, (0, 2, 3, 1))
        x = x.astype(jnp.float32) / 255.0
        for channels in self.channels:
            x = ConvSequence(channels)(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden)(x))
        return x


class MLP(nn.Module):
    """ReLU MLP with flax's default init, on float32 inputs."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32)
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden)(x))
        return x


def reset_state(state, episode_starts):
    """Zero the recurrent state of the envs whose episode starts at this step: no memory crosses an episode end."""
    return jax.tree.map(lambda s: jnp.where(episode_starts[:, None], 0.0, s), state)


class CoreStep(nn.Module):
    """One step of the core on (envs, features): an LSTM (R2D2), or a feed-forward ReLU layer that passes the
    state through unchanged (the memoryless ablation: same inputs, same size)."""

    core: str
    size: int

    @nn.compact
    def __call__(self, state, inputs):
        x, episode_starts = inputs
        state = reset_state(state, episode_starts)
        if self.core == "lstm":
            return nn.OptimizedLSTMCell(self.size)(state, x)
        return state, nn.relu(nn.Dense(self.size)(x))


def initial_state(num_envs: int, size: int):
    """The LSTM's (cell, hidden) state of `num_envs` envs at an episode start: zeros."""
    return jnp.zeros((num_envs, size)), jnp.zeros((num_envs, size))


class Agent(nn.Module):
    """Torso -> core -> dueling Q head (Wang et al. 2016), on time-major sequences: obs (T, envs, ...),
    episode_starts (T, envs) and the state before the first step; returns Q (T, envs, actions) and the last state."""

    action_dim: int
    channels: Sequence[int]
    hiddens: Sequence[int]
    obs_layout: str  # cleanrl_utils.envs.obs_layout: "chw" or "hwc" images, or "vector"
    core: str
    lstm_size: int

    @nn.compact
    def __call__(self, obs, episode_starts, state):
        num_steps, num_envs = obs.shape[:2]
        x = obs.reshape((num_steps * num_envs, *obs.shape[2:]))
        if self.obs_layout != "vector":
            x = ImpalaCNN(self.channels, self.hiddens, self.obs_layout == "chw")(x)
        else:
            x = MLP(self.hiddens)(x)
        scan = nn.scan(CoreStep, variable_broadcast="params", split_rngs={"params": False})
        inputs = (x.reshape((num_steps, num_envs, -1)), episode_starts)
        state, x = scan(self.core, self.lstm_size)(state, inputs)
        value, advantages = nn.Dense(1)(x), nn.Dense(self.action_dim)(x)
        return value + advantages - advantages.mean(-1, keepdims=True), state


@struct.dataclass
class AgentState:
    """Everything the learner trains: the online network with its Adam state, and the target network."""

    online: TrainState
    target_params: dict


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, AgentState]:
    """The network for --env-id and its training state (params, Adam state, target params), on the host."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    layout = obs_layout(args.env_id)  # images into the IMPALA CNN, vectors into the MLP
    agent = Agent(int(action_space.n), tuple(args.channels), tuple(args.hiddens), layout, args.core, args.lstm_size)
    obs = np.zeros((1, 1, *obs_space.shape), obs_space.dtype)  # one step of one env
    params = agent.init(key, obs, np.ones((1, 1), bool), initial_state(1, args.lstm_size))
    tx = optax.adam(args.learning_rate, eps=args.adam_eps)  # R2D2 Table 1
    online = TrainState.create(apply_fn=None, params=params, tx=tx)
    return agent, AgentState(online, jax.tree.map(np.copy, params))


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1.
    It holds the last --sequence-length / 2 steps of the previous rollout, then --num-steps new ones, so that the
    learner cuts it into sequences overlapping by half: the replay's items, Rollouts too, batch-major (sequences,
    --sequence-length, ...; states: sequences, --lstm-size). envpool returns an episode's true last observation with
    its end flag and resets on the next step: that reset step's row is not `valid` (never learned); the row after it
    starts the new episode (`episode_starts`: the state is zeroed before it)."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray
    episode_starts: np.ndarray
    # (sequences, envs, --lstm-size): the LSTM state before each sequence's first row
    start_cells: np.ndarray
    start_hiddens: np.ndarray


def cut_sequences(storage: Rollout, sequence_length: int) -> Rollout:
    """The overlapping sequences of a rollout: sequence k covers rows [k L/2, k L/2 + L), of every env;
    items are ordered sequence-major (all envs of sequence 0, then of sequence 1, ...)."""
    period, num_sequences = sequence_length // 2, storage.start_cells.shape[0]

    def cut(x):
        windows = jnp.stack([x[k * period : k * period + sequence_length] for k in range(num_sequences)])
        windows = jnp.swapaxes(windows, 1, 2)  # (sequences, envs, L, ...)
        return windows.reshape((-1, *windows.shape[2:]))

    fields = [cut(getattr(storage, name)) for name in Rollout._fields[:7]]
    states = [x.reshape((-1, x.shape[-1])) for x in (storage.start_cells, storage.start_hiddens)]
    return Rollout(*fields, *states)


def apex_epsilons(global_env_indices: np.ndarray, num_envs: int, base: float = 0.4, alpha: float = 7.0) -> np.ndarray:
    """Ape-X's exploration (Horgan et al. 2018, Sec. 4; R2D2 Sec. 2.3): env i of N acts epsilon-greedily with
    eps_i = base^(1 + alpha i / (N - 1)), from 0.4 down to 0.4^8; one env gets 0.4."""
    exponent = 1 + alpha * global_env_indices / max(num_envs - 1, 1)
    return np.power(base, exponent).astype(np.float32)


def n_step_double_q_targets(*, rewards, terminations, truncations, online_next_q, target_next_q, gamma, n_step):
    """n-step double Q targets under the value rescaling h (R2D2 Sec. 2.3; Pohlen et al. 2018), time-major (T, B):
    transition t (row t to row t+1) has reward r_t and Q(row t+1, .) from both networks.

    y_t = h(sum_{k<m} gamma^k r_{t+k} + gamma^m h^-1(Q_target(s_{t+m}, argmax_a Q_online(s_{t+m}, a)))), m = n or
    fewer: the sum stops at a termination (no bootstrap), at a truncation (it bootstraps from the true last
    observation, the next row) and at the end of the sequence (it bootstraps from the last row)."""
    next_actions = jnp.argmax(online_next_q, axis=-1)
    next_values = jnp.take_along_axis(target_next_q, next_actions[..., None], axis=-1).squeeze(-1)
    discounts = gamma * (1.0 - terminations)
    # rlax: a trace coefficient 0 at a truncation makes the return bootstrap there in full, from its next row
    returns = partial(rlax.transformed_n_step_returns, rlax.SIGNED_HYPERBOLIC_PAIR, n=n_step)
    return jax.vmap(lambda r, d, v, trace: returns(r, d, v, lambda_t=trace), in_axes=1, out_axes=1)(
        rewards, discounts, next_values, 1.0 - truncations
    )


def learned_steps(valid, burn_in: int):
    """Which transitions of time-major (T, B) sequences the loss learns: valid ones after the burn-in, each with a
    next row in the sequence (the last row only serves as a bootstrap). Returns (T - 1, B) booleans."""
    steps = jnp.arange(valid.shape[0] - 1)[:, None]
    return jnp.logical_and(valid[:-1], steps >= burn_in)


def sequence_priorities(abs_td, mask, eta: float):
    """R2D2 Sec. 2.3: p = eta max_t |td_t| + (1 - eta) mean_t |td_t| over each sequence's learned steps (T, B);
    0 for a sequence without any (it has nothing to learn)."""
    abs_td = jnp.where(mask, abs_td, 0.0)
    mean = abs_td.sum(0) / jnp.maximum(mask.sum(0), 1)
    return eta * abs_td.max(0) + (1 - eta) * mean


def importance_weights(scaled_probabilities, exponent: float):
    """Prioritized replay's correction (Schaul et al. 2016): (N P(i))^-beta, before the division by the largest."""
    return scaled_probabilities**-exponent


def unroll(agent: Agent, params, sequences: Rollout, burn_in: int):
    """Q of every row of time-major sequences from their stored start states; the first `burn_in` rows only
    warm the state up: no gradient flows into them (R2D2 Sec. 3, "burn-in")."""
    state = (sequences.start_cells, sequences.start_hiddens)
    if burn_in:
        _, state = agent.apply(params, sequences.obs[:burn_in], sequences.episode_starts[:burn_in], state)
        state = jax.lax.stop_gradient(state)
    q, _ = agent.apply(params, sequences.obs[burn_in:], sequences.episode_starts[burn_in:], state)
    return jnp.concatenate([jnp.zeros((burn_in, *q.shape[1:]), q.dtype), q]) if burn_in else q


def r2d2_loss(params, *, agent: Agent, target_params, sequences: Rollout, weights, normalizer, burn_in, gamma, n_step):
    """0.5 x squared TD error, averaged over each sequence's learned steps, weighted by its importance weight,
    summed over the sequences / normalizer (the global minibatch size). Aux: |td| (T - 1, B), the mask, Q."""
    q = unroll(agent, params, sequences, burn_in)
    target_q = unroll(agent, target_params, sequences, burn_in)
    rows = {name: getattr(sequences, name)[:-1] for name in ("rewards", "terminations", "truncations")}
    # Q of each transition's next row
    next_q = {"online_next_q": q[1:], "target_next_q": target_q[1:]}
    targets = jax.lax.stop_gradient(n_step_double_q_targets(**rows, **next_q, gamma=gamma, n_step=n_step))
    taken_q = jnp.take_along_axis(q[:-1], sequences.actions[:-1, :, None], axis=-1).squeeze(-1)
    td = targets - taken_q
    mask = learned_steps(sequences.valid, burn_in)
    per_sequence = 0.5 * jnp.where(mask, td**2, 0.0).sum(0) / jnp.maximum(mask.sum(0), 1)
    return (weights * per_sequence).sum() / normalizer, (jnp.abs(td), mask, taken_q)


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, episode_starts, state, epsilons, key) -> (actions, state, key)
    value: Callable | None  # (params, obs) -> V(obs), the bootstrap's; None: the learner values it


def make_actor_fns(agent: Agent) -> ActorFns:
    @jax.jit
    def act(params, obs, episode_starts, state, epsilons, key):
        """One epsilon-greedy step of every env; the recurrent state stays on the actor device."""
        q, state = agent.apply(params, obs[None], episode_starts[None], state)
        key, explore_key, action_key = jax.random.split(key, 3)
        greedy = jnp.argmax(q[0], axis=-1)
        random_actions = jax.random.randint(action_key, greedy.shape, 0, q.shape[-1])
        explore = jax.random.uniform(explore_key, greedy.shape) < epsilons
        return jnp.where(explore, random_actions, greedy), state, key

    return ActorFns(act, None)


def actor_params(agent_state: AgentState):
    """What the actors act with: the online network's params."""
    return agent_state.online.params


def first_rows(args: Args, obs_space) -> Rollout:
    """What comes before an actor's first rollout: --sequence-length / 2 rows that are not valid (each an episode
    start) and the zero state before them."""
    shape = (args.sequence_length // 2, args.local_num_envs)
    obs_dtype = np.uint8 if obs_space.dtype == np.uint8 else np.float32
    obs = np.zeros((*shape, *obs_space.shape), obs_dtype)
    floats = [np.zeros(shape, np.float32) for _ in range(3)]  # rewards, terminations, truncations
    # the cells and hiddens
    states = [np.zeros((1, shape[1], args.lstm_size), np.float32) for _ in range(2)]
    return Rollout(obs, np.zeros(shape, np.int32), *floats, np.zeros(shape, bool), np.ones(shape, bool), *states)


def next_rows(rows: Rollout, num_steps: int, period: int) -> Rollout:
    """New arrays for the next rollout (the last ones may still be on their way to the learner): the previous
    rollout's last `period` rows and the state before them start this one's first sequence; then room for
    `num_steps` rows and the states before the sequences that start in them."""
    carry = lambda x, keep, new: np.concatenate([x[-keep:], np.empty((new, *x.shape[1:]), x.dtype)])
    states = [carry(x, 1, num_steps // period) for x in (rows.start_cells, rows.start_hiddens)]
    return Rollout(*(carry(x, period, num_steps) for x in rows[:7]), *states)


def actor_loop(*, args: Args, thread: ActorThread, key, make_envs, actor_fns: ActorFns, params_queue, rollout_queue):
    """An actor thread's life: steps its envpool (`make_envs(seed, num_threads)`), acts on its actor device with
    `key` and each env's recurrent state, ships one rollout per update to the learner."""
    num_envs, num_steps, period = args.local_num_envs, args.num_steps, args.sequence_length // 2
    env_seed = thread.env_seed(args.seed, num_envs)
    envs = make_envs(env_seed, num_threads=thread.envpool_threads)
    key = thread.key(key)
    # among the envs of every thread and process
    env_indices = thread.global_index * num_envs + np.arange(num_envs)
    epsilons = jax.device_put(apex_epsilons(env_indices, args.batch_size // num_steps), thread.device)
    next_obs, _ = envs.reset()
    state = jax.device_put(initial_state(num_envs, args.lstm_size), thread.device)
    next_episode_starts = np.ones(num_envs, dtype=bool)
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    rows = first_rows(args, envs.observation_space)
    episodes, timer = EpisodeStats(num_envs), StageTimer()
    for update in range(thread.start_update + 1, args.num_updates + 1):
        with timer("params_queue_get_time"):
            # skipping the second get makes the actor exactly one policy version behind the learner
            if update != thread.start_update + 2 or not args.concurrency:
                params, actor_policy_version = thread.get(params_queue)
        with timer("rollout_time"):
            rows = next_rows(rows, num_steps, period)
            for step in range(num_steps):
                thread.check_stopped()
                if step % period == 0:  # a sequence starts at this row: store the state before it
                    sequence = 1 + step // period
                    rows.start_cells[sequence], rows.start_hiddens[sequence] = jax.device_get(state)
                with timer("inference_time"):
                    action, state, key = actor_fns.act(params, next_obs, next_episode_starts, state, epsilons, key)
                    action = np.asarray(action)
                with timer("env_step_time"):
                    step_obs, reward, terminated, truncated, info = envs.step(action)
                with timer("storage_time"):
                    row = period + step
                    rows.obs[row], rows.actions[row], rows.rewards[row] = next_obs, action, reward
                    rows.terminations[row], rows.truncations[row] = terminated, truncated
                    rows.valid[row] = ~previous_episode_end
                    rows.episode_starts[row] = next_episode_starts
                    episodes.step(reward, terminated, truncated, info, counted=rows.valid[row])
                    # the row after envpool's reset step starts a new episode (the reset step's row still holds the
                    # ended episode's true last observation: its Q, with the old state, is a truncation's bootstrap)
                    next_episode_starts = previous_episode_end
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs
        # the last sequence start is the next rollout's first: it is not shipped
        storage = rows._replace(start_cells=rows.start_cells[:-1], start_hiddens=rows.start_hiddens[:-1])
        # one host-to-device copy per learner device
        storage = split_for_learners(storage, thread.learner_devices)
        with timer("rollout_queue_put_time"):  # logged with the next rollout
            thread.put(rollout_queue, (storage, actor_policy_version, {**timer.read(), **episodes.read()}))


# ---------------------------------------------------------------- learner


class LearnerState(NamedTuple):
    """What the learner carries from update to update, and what a checkpoint holds."""

    agent: AgentState  # online params, Adam state and target params, replicated
    key: jax.Array  # the learner's PRNG key (minibatch samples), the same in every process
    # one shard per learner device
    replay: flashbax.buffers.prioritised_trajectory_buffer.PrioritisedTrajectoryBufferState


class Minibatch(NamedTuple):
    """One gradient step's samples (first axis: sequences): the sequences and N P(i), the size of the shard they
    were sampled from times their probability there (what the importance weights need)."""

    sequences: Rollout
    scaled_probabilities: jax.Array


class LearnerFns(NamedTuple):
    init_replay: Callable  # () -> the empty replay, sharded along the env axis over the mesh
    update: Callable  # (state: LearnerState, rollout, train) -> (state, metrics)
    # (agent_state, minibatch) -> (agent_state, metrics, priorities): one step on a given global minibatch
    gradient_step: Callable


def r2d2_gradient_step(agent_state: AgentState, minibatch: Minibatch, *, agent: Agent, args: Args):
    """One R2D2 step on a learner device's part of the global minibatch, inside `shard_map` over the mesh axis
    "batch": the importance-weighted loss, gradients summed over the devices, Adam, the periodic target copy.
    Returns (agent_state, metrics, the new priorities of this device's sequences)."""
    sequences = minibatch.sequences._replace(  # time-major, as the network unrolls
        **{name: jnp.swapaxes(getattr(minibatch.sequences, name), 0, 1) for name in Rollout._fields[:7]}
    )
    # flashbax's float32 sum tree can land on an empty slot (probability 0): such a sample is not learned
    sampled = minibatch.scaled_probabilities > 0
    probabilities = jnp.where(sampled, minibatch.scaled_probabilities, 1.0)
    weights = jnp.where(sampled, importance_weights(probabilities, args.importance_exponent), 0.0)
    # the largest weight of the global minibatch is 1
    weights = weights / jax.lax.pmax(weights.max(), "batch")
    # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
    # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
    local_params = jax.lax.pcast(agent_state.online.params, "batch", to="varying")
    # the loss of this device's sequences over the global minibatch size: their psum is the minibatch's loss
    settings = dict(normalizer=float(args.minibatch_size), burn_in=args.burn_in, gamma=args.gamma, n_step=args.n_step)
    loss_fn = partial(r2d2_loss, agent=agent, **settings)
    (loss, (abs_td, mask, taken_q)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        local_params, target_params=agent_state.target_params, sequences=sequences, weights=weights
    )
    priorities = jnp.where(sampled, sequence_priorities(abs_td, mask, args.priority_eta), 0.0)
    count = jnp.maximum(jax.lax.psum(mask.sum(), "batch"), 1)
    metrics = {
        "losses/td_loss": loss,
        "losses/q_values": jnp.where(mask, taken_q, 0.0).sum() / count,
        "losses/abs_td": jnp.where(mask, abs_td, 0.0).sum() / count,
        "losses/priority": priorities.sum() / args.minibatch_size,
        "losses/importance_weight": weights.sum() / args.minibatch_size,
    }
    grads, metrics = jax.lax.psum((grads, metrics), "batch")
    online = agent_state.online.apply_gradients(grads=grads)
    target_params = optax.periodic_update(
        online.params, agent_state.target_params, online.step, args.target_update_period
    )
    return agent_state.replace(online=online, target_params=target_params), metrics, priorities


def replay_capacity(args: Args, num_learner_devices: int) -> int:
    """Sequences per learner device: --buffer-size observations, one new sequence every --sequence-length / 2."""
    return args.buffer_size // (args.sequence_length // 2) // num_learner_devices


def make_replay_buffer(args: Args, num_learner_devices: int):
    """flashbax's prioritized item buffer of one learner device: its share of the capacity and of each minibatch.
    New sequences get the largest priority seen so far (Schaul et al. 2016; R2D2's actors compute it instead)."""
    return flashbax.make_prioritised_item_buffer(
        max_length=replay_capacity(args, num_learner_devices),
        min_length=1,
        add_batches=True,
        sample_batch_size=args.minibatch_size // num_learner_devices,
        priority_exponent=args.priority_exponent,
        device=jax.default_backend() if jax.default_backend() in ("cpu", "gpu", "tpu") else "cpu",
    )


def replay_item(args: Args) -> Rollout:
    """One sequence as the replay stores it: --sequence-length rows and the LSTM state before them."""
    obs_space, _ = env_spaces(args.env_id, args.env_options)
    length = args.sequence_length
    obs_dtype = jnp.uint8 if obs_space.dtype == np.uint8 else jnp.float32
    obs = jnp.zeros((length, *obs_space.shape), obs_dtype)
    floats, flags, state = jnp.zeros(length), jnp.zeros(length, bool), jnp.zeros(args.lstm_size)
    # obs, actions, then rewards, terminations, truncations; valid, episode_starts; start_cells, start_hiddens
    return Rollout(obs, jnp.zeros(length, jnp.int32), floats, floats, floats, flags, flags, state, state)


def replay_shard_specs(local_buffer, item: Rollout):
    """The replay over the mesh: a device's experience, (1, capacity, ...), and its sum tree's 1-D nodes are sharded
    over the devices; the write position and the largest priority are the same on every device."""
    shard = jax.eval_shape(local_buffer.init, item)
    tree_specs = shard.sum_tree_state.replace(nodes=P("batch"), max_recorded_priority=P())
    counters = dict.fromkeys(["current_index", "is_full", "running_index"], P())
    experience = Rollout(*[P(None, "batch")] * len(Rollout._fields))
    return shard.replace(experience=experience, sum_tree_state=tree_specs, **counters)


def typed_replay(replay):
    """The largest priority float32 from the start: flashbax's weakly typed 1.0 made update_step compile twice."""
    largest = jax.lax.convert_element_type(replay.sum_tree_state.max_recorded_priority, jnp.float32)
    return replay.replace(sum_tree_state=replay.sum_tree_state.replace(max_recorded_priority=largest))


def prioritized_step(carry, step_key, *, local_buffer, capacity: int, gradient_step: Callable):
    """One `lax.scan` step per learner device: its minibatch part, sampled by priority, learned and re-prioritized."""
    agent_state, replay = carry
    device_key = jax.random.fold_in(step_key, jax.lax.axis_index("batch"))
    sample = local_buffer.sample(replay, device_key)
    stored = jnp.where(replay.is_full, capacity, replay.current_index)
    minibatch = Minibatch(sample.experience, stored * sample.probabilities)
    agent_state, metrics, priorities = gradient_step(agent_state, minibatch)
    tree = local_buffer.set_priorities(replay, sample.indices, priorities).sum_tree_state
    # new sequences get the largest priority of all shards: the same on every device
    tree = tree.replace(max_recorded_priority=jax.lax.pmax(tree.max_recorded_priority, "batch"))
    return (agent_state, replay.replace(sum_tree_state=tree)), metrics


def make_learner_fns(args: Args, agent: Agent, mesh: Mesh) -> LearnerFns:
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices; each device keeps
    the replay shard of its envs, samples its part of every minibatch, and the gradients are summed with `psum`."""
    replicated, sharded_envs, sharded_samples = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    sample_specs = Rollout(*([sharded_samples] * len(Rollout._fields)))
    minibatch_specs = Minibatch(sample_specs, sharded_samples)
    num_devices, capacity = mesh.devices.size, replay_capacity(args, mesh.devices.size)
    local_buffer = make_replay_buffer(args, num_devices)
    item = replay_item(args)
    replay_specs = replay_shard_specs(local_buffer, item)
    # check_vma=False: flashbax's sum tree mixes per-device and replicated values in its loops, which shard_map's
    # type check refuses; the psums below are explicit (no implicit sum of the gradients either way)
    shard_map = partial(jax.shard_map, mesh=mesh, check_vma=False)
    local_gradient_step = partial(r2d2_gradient_step, agent=agent, args=args)
    step = partial(prioritized_step, local_buffer=local_buffer, capacity=capacity, gradient_step=local_gradient_step)

    init_shard = lambda: typed_replay(local_buffer.init(item))
    init_replay = jax.jit(jax.shard_map(init_shard, mesh=mesh, in_specs=(), out_specs=replay_specs))

    def local_update(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        """Per device: its envs' sequences into its replay shard, then --replay-ratio x batch gradient steps."""
        replay = local_buffer.add(replay, cut_sequences(storage, args.sequence_length))
        if not train:
            return agent_state, replay, {}
        keys = jax.random.split(key, args.gradient_steps)
        (agent_state, replay), metrics = jax.lax.scan(step, (agent_state, replay), keys)
        return agent_state, replay, jax.tree.map(jnp.mean, metrics)

    @partial(jax.jit, static_argnames="train", donate_argnums=(0, 1))
    def update_step(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        return shard_map(
            partial(local_update, train=train),
            in_specs=(replicated, replay_specs, rollout_specs, replicated),
            out_specs=(replicated, replay_specs, replicated),
        )(agent_state, replay, storage, key)

    # its first call stops the run with one line if it cannot fit the devices' free memory (cleanrl_utils/memory.py)
    update_step = checked_for_memory(update_step, "lower --minibatch-size or --sequence-length")

    def update(state: LearnerState, storage: Rollout, train: bool) -> tuple[LearnerState, dict]:
        agent_state, key, replay = state
        key, update_key = jax.random.split(key)
        agent_state, replay, metrics = update_step(agent_state, replay, storage, update_key, train=train)
        metrics["stats/gradient_steps"] = args.gradient_steps * train
        return LearnerState(agent_state, key, replay), metrics

    gradient_step = shard_map(
        local_gradient_step, in_specs=(replicated, minibatch_specs), out_specs=(replicated, replicated, sharded_samples)
    )
    return LearnerFns(init_replay, update, jax.jit(gradient_step))


# ---------------------------------------------------------------- evaluation: what --save-model saves, and its policy
# (what the evaluator and the tools call in this script: cleanrl_utils/script_contract.py)

# the evaluation's epsilon without --eval-greedy (a choice: small, so that the agent cannot loop forever)
EVAL_EPSILON = 0.01


def saved_model(state: LearnerState) -> dict:
    """What --save-model writes next to the flags: what `make_eval_policy` reads."""
    # the Q network: what evaluation needs
    return {"params": to_state_dict(local_value(state.agent.online.params))}


def make_eval_policy(args: Args, model: dict, greedy: bool) -> RecurrentPolicy:
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: epsilon-greedy (greedy: 0) with
    each env's recurrent state, zeroed after the evaluator's `episodes_ended(ended)` (past envpool's reset step)."""
    agent, _ = make_agent(args, jax.random.key(0))
    act, params = make_actor_fns(agent).act, jax.tree.map(jnp.asarray, model["params"])
    epsilon = 0.0 if greedy else EVAL_EPSILON

    class Policy:  # a RecurrentPolicy (cleanrl_utils/evals/evaluate.py)
        state = episode_starts = previous_end = None

        def __call__(self, obs: np.ndarray, key: jax.Array):
            if self.state is None:
                self.state = initial_state(len(obs), args.lstm_size)
                self.episode_starts = np.ones(len(obs), bool)
                self.previous_end = np.zeros(len(obs), bool)
            epsilons = jnp.full(len(obs), epsilon)
            actions, self.state, key = act(params, obs, self.episode_starts, self.state, epsilons, key)
            self.episode_starts = self.previous_end
            return np.asarray(actions), key

        def episodes_ended(self, ended: np.ndarray):
            self.previous_end = np.asarray(ended, bool)

    return Policy()


# ---------------------------------------------------------------- main: the Sebulba protocol


def set_runtime_values(args: Args, layout: DeviceLayout):
    """What the run derives beyond the batch (cleanrl_utils.flags.derive_batch_values): not flags."""
    args.gradient_steps = gradient_steps_per_update(args.replay_ratio, args.batch_size)
    # the first update's sequences are in the replay before its gradient steps sample it
    args.learning_starts_updates = args.learning_starts // args.batch_size
    num_learner_devices = len(layout.global_learner_devices)
    check_minibatch_split(args.minibatch_size, num_learner_devices)
    new_sequences = args.global_num_envs * args.num_steps // (args.sequence_length // 2) // num_learner_devices
    needed = max(new_sequences, args.minibatch_size // num_learner_devices)
    if replay_capacity(args, num_learner_devices) < needed:
        raise UsageError(
            f"--buffer-size ({args.buffer_size}) must hold the sequences of one update and one minibatch on each "
            f"learner device ({needed} sequences of --sequence-length / 2 = {args.sequence_length // 2} new "
            "observations)"
        )
    # in int32: the online network's step (its copies into the target) and flashbax's running index
    counts = {"gradient steps": ("--replay-ratio x env steps per update", args.gradient_steps)}
    per_device = "env steps per update / (--sequence-length / 2) / learner devices"
    check_int32_counts(
        args, {**counts, "sequences written to each learner device's replay": (per_device, new_sequences)}
    )
    # --buffer-size against the learner devices' memory, before the replay is allocated
    init_shard = make_replay_buffer(args, num_learner_devices).init
    check_replay_fits(args.buffer_size, init_shard, replay_item(args), layout.learner_devices, new_rows=new_sequences)


def state_summary(state: LearnerState) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states. The replay's digest is
    of the whole replay, whatever its layout, the same in every process (each computes the part it holds)."""
    agent = state.agent
    return (
        f"params sha256={tree_digest((agent.online.params, agent.target_params))} "
        f"optimizer sha256={tree_digest(agent.online.opt_state)} replay sha256={tree_digest(state.replay)}"
    )


def main(args: Args) -> int:
    validate_args(args)  # bad flags stop here, before JAX starts a backend
    # devices, run folder, checkpoints, signals; `run.args`: a copy of the flags with the sizes the layout gives them
    # (the batch, the global env count, the updates: cleanrl_utils/flags.py) and the run's name
    run = SebulbaRun(args, __file__, set_runtime_values)
    args = run.args
    # the agent and learner keys are the same in every process; each actor thread folds the update the run starts at
    # and its global index into actor_key, so no two threads, processes or resumed runs sample with the same key
    agent_key, learner_key, actor_key = jax.random.split(jax.random.key(args.seed), 3)
    agent, agent_state = make_agent(args, agent_key)
    # data-parallel over run.mesh, every process's learner devices; the first call of each of its programs stops the
    # run with one line if the program cannot fit the devices' free memory (cleanrl_utils/memory.py)
    learner = make_learner_fns(args, agent, run.mesh)
    # the newest checkpoint of the run (its replay needs no repair: the actors' first sequences start with invalid
    # rows), or this fresh state; then the actor threads, seeded for the update it is at
    state = LearnerState(replicate(agent_state, run.mesh), learner_key, learner.init_replay())
    state, actor_threads = run.start(state, state_summary)

    # Sebulba: each actor thread has a size-1 params queue from the learner and a size-1 rollout queue to it
    params_queues = [queue.Queue(maxsize=1) for _ in actor_threads]
    rollout_queues = [queue.Queue(maxsize=1) for _ in actor_threads]
    make_envs = partial(make_env, args.env_id, num_envs=args.local_num_envs, env_options=args.env_options)
    actor = partial(actor_loop, args=args, key=actor_key, make_envs=make_envs, actor_fns=make_actor_fns(agent))
    for thread, params_queue, rollout_queue in zip(actor_threads, params_queues, rollout_queues):
        run.start_actor(actor, thread, params_queue=params_queue, rollout_queue=rollout_queue)

    run.broadcast(params_queues, actor_params(state.agent), version=run.start_update)
    # SIGTERM or Ctrl-C (cleanrl_utils/preemption.py): alone, the process stops its actors at once; with several, the
    # processes first agree on an update boundary. Either way the update in flight is finished and logged, the loop
    # ends, `run.finish` checkpoints that update and the run exits 143 (130 for Ctrl-C): the same command resumes it.
    # An actor's failure is raised by `run.supervise()`, with its traceback.
    with run.supervise():
        for update in run.updates():
            # every actor thread's rollout (each skipped one params get: it acts one version behind)
            outputs = run.get_rollouts(rollout_queues)
            # each thread sent each learner device its share of envs; one global array, sharded over the learner
            # devices (cleanrl_utils/data_path.py)
            storage = assemble_global_rollout(outputs.storages, run.mesh, args.global_num_envs)
            train = update > args.learning_starts_updates  # the replay is still filling up
            # the update donates its input: a copy (but the replay's) is kept in case it diverges
            before = run.copy_learner_state(state)
            state, metrics = learner.update(state, storage, train)
            # NaN or inf: checkpoints `before` and stops the run
            metrics = run.wait_for_finite(update, state, metrics, before)
            # the actors get version `update` only now that it is finite; after the last update none waits for one
            if update < args.num_updates:
                run.broadcast(params_queues, actor_params(state.agent), version=update)
            # logged; checkpointed every --checkpoint-frequency
            run.end_update(update, state, metrics, outputs)
    return run.finish(state, saved_model)  # final checkpoint and digests, --save-model, exit code


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
