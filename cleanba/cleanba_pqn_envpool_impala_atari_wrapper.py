"""Sebulba PQN (Gallici et al. 2024, "Simplifying Deep Temporal Difference Learning", ICLR 2025) for envpool's
discrete-action envs (Atari, classic control, Football, VizDoom, MiniGrid, Procgen).

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (epsilon schedule, Q(lambda)
targets, TD loss), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is the same for
every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) comes from cleanrl_utils/, one
small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their own envpool and run
jitted inference on their actor device. Each thread hands its rollout to the learner through its own size-1
`rollout_queue`, already split along the env axis and placed on the learner devices (cleanrl_utils/data_path.py); the
learner answers through a size-1 `params_queue` per thread. Because the actor skips one `params_queue.get()` (its second
rollout), from update 2 on it acts with the policy one version behind the learner's (update 1's: the initial params,
lag 0; `--no-concurrency`: no skip, lag 0, no overlap). The learner is data-parallel over every process's learner
devices (`jax.jit` + `shard_map` over a 1-D mesh, gradients summed with `psum`), so `--distributed` scales it.

PQN in one paragraph: a Q-network with LayerNorm after every hidden layer, epsilon-greedy actors, and neither a replay
buffer nor a target network: each update regresses Q(s, a) on Q(lambda) targets of the rollout it was sent, in PPO's
shape (epochs of minibatches). The targets bootstrap from max_a Q of the rollout's observations: recomputed with the
learner's current params at the start of the update (`--q-lambda-targets learner`), or the values the actor recorded
while acting, with params one version behind (`actor`).
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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
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
from cleanrl_utils.flags import (
    RunSetting,
    SebulbaArgs,
    check_envs_split,
    check_flags,
    check_int32_counts,
    check_run_flags,
)
from cleanrl_utils.logger import EpisodeStats, StageTimer
from cleanrl_utils.memory import checked_for_memory
from cleanrl_utils.run import SebulbaRun
from cleanrl_utils.saved_model import check_save_model_flags

# envpool's Box spaces warn that they cast to float32
warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32")


@dataclass
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then PQN's
    env_id: str = "Breakout-v5"
    """the id of an envpool env with discrete actions: Atari, classic control, Football, VizDoom, MiniGrid,
    Procgen (cleanrl_utils/envs.py); images go into a CNN (--network), vectors and dicts (flattened) into an MLP"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (CleanRL's
    pqn_atari_envpool.py: 10M) (in [1, 2**53])"""
    learning_rate: float = 2.5e-4
    """the learning rate of RAdam (CleanRL's pqn.py and pqn_atari_envpool.py) (positive, finite)"""
    local_num_envs: int = 4
    """the number of parallel game environments of each actor thread (2 threads x 4: the 8 envs of CleanRL's
    pqn_atari_envpool.py) (positive)"""
    num_steps: int = 128
    """the number of steps of each rollout (CleanRL's pqn.py and pqn_atari_envpool.py: 128) (positive)"""
    anneal_lr: bool = True
    """toggle linear annealing of the learning rate to 0 (CleanRL's PQN scripts)"""
    gamma: float = 0.99
    """the discount factor gamma (CleanRL's PQN scripts) (in [0, 1])"""
    q_lambda: float = 0.65
    """the lambda of the Q(lambda) targets (PQN paper's Atari setting; CleanRL's PQN scripts) (in [0, 1])"""
    q_lambda_targets: Literal["learner", "actor"] = "learner"
    """whose max_a Q the Q(lambda) targets bootstrap from: learner (recomputed with the learner's params at the start
    of each update, the params the update then trains, as in CleanRL's PQN, which acts and learns in turn) or actor
    (the values recorded while acting, one params version behind; no extra forward pass; 2 of 10 CartPole seeds
    never reached 500 with it, none with learner: docs/rl-algorithms/pqn.md#the-lag-and-the-targets-ten-seeds)"""
    num_minibatches: int = 4
    """the number of mini-batches per epoch, on each learner device (CleanRL's PQN scripts) (positive)"""
    update_epochs: int = 4
    """the K epochs over each rollout (CleanRL's PQN scripts) (positive)"""
    start_e: float = 1.0
    """the epsilon of epsilon-greedy acting at the start (CleanRL's PQN scripts) (in [0, 1])"""
    end_e: float = 0.01
    """the epsilon after --exploration-fraction of --total-timesteps, and in evaluation without --eval-greedy
    (CleanRL's pqn_atari_envpool.py; its pqn.py for classic control: 0.05) (in [0, 1])"""
    exploration_fraction: float = 0.1
    """the fraction of --total-timesteps over which epsilon goes linearly from --start-e to --end-e (CleanRL's
    pqn_atari_envpool.py; its pqn.py: 0.5) (in (0, 1])"""
    max_grad_norm: float = 10.0
    """the maximum norm for the gradient clipping (CleanRL's PQN scripts) (positive, finite)"""
    channels: list[int] = field(default_factory=lambda: [16, 32, 32])
    """the channels of the IMPALA CNN's residual stacks, with --network impala (Espeholt et al. 2018, Fig. 3)
    (positive)"""
    hiddens: list[int] = field(default_factory=lambda: [120, 84])
    """the hidden layers of the MLP for vector observations (CleanRL's pqn.py: 120, 84), or after the IMPALA CNN with
    --network impala (positive)"""
    network: Literal["nature", "impala"] = "nature"
    """the torso for image observations, with LayerNorm after each layer: nature (the Nature DQN CNN of Mnih et al.
    2015, as in CleanRL's pqn_atari_envpool.py) or impala (the IMPALA CNN of --channels and --hiddens)"""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """the dtype of the image torso's activations (bfloat16: faster convolutions on GPUs); params, optimizer
    state, Q head and losses stay float32"""
    sync_minibatches: RunSetting[bool] = False
    """the learner waits for each minibatch step to finish before dispatching the next, so that actor inference
    on the same GPU runs between the steps instead of behind the whole update (the same results)"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(
        args,
        positive_ints=["local_num_envs", "num_steps", "num_minibatches", "update_epochs"],
        positive=["learning_rate", "max_grad_norm"],
        unit_interval=["gamma", "q_lambda", "start_e", "end_e"],
        positive_int_lists=["channels", "hiddens"],
    )
    if not 0 < args.exploration_fraction <= 1:  # NaN fails too
        raise UsageError(f"--exploration-fraction must be in (0, 1], got {args.exploration_fraction}")
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
    threads = len(args.actor_device_ids) * args.num_actor_threads
    learners = len(args.learner_device_ids)
    # the env counts the split's error suggests give whole minibatches too
    check_envs_split(args, lambda envs: args.num_steps * threads * envs // learners % args.num_minibatches == 0)
    envs_per_learner_device = threads * args.local_num_envs // learners
    if (args.num_steps * envs_per_learner_device) % args.num_minibatches != 0:
        raise UsageError(
            f"--num-minibatches ({args.num_minibatches}) must divide the samples per learner device "
            f"(--num-steps x envs per learner device = {args.num_steps} x {envs_per_learner_device})"
        )
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


def layer_norm(x, dtype):
    """LayerNorm over all of a sample's features, with a scale and bias for each: PyTorch's nn.LayerNorm(sample
    shape) of CleanRL's PQN scripts (after a convolution, its H, W and C together). Statistics in float32."""
    axes = tuple(range(1 - x.ndim, 0))  # every axis but the batch's
    return nn.LayerNorm(reduction_axes=axes, feature_axes=axes, dtype=dtype)(x)


class ResidualBlock(nn.Module):
    channels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        inputs = x
        x = nn.relu(x)
        x = layer_norm(nn.Conv(self.channels, kernel_size=(3, 3), dtype=self.dtype)(x), self.dtype)
        x = nn.relu(x)
        x = layer_norm(nn.Conv(self.channels, kernel_size=(3, 3), dtype=self.dtype)(x), self.dtype)
        return x + inputs


class ConvSequence(nn.Module):
    channels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        x = layer_norm(nn.Conv(self.channels, kernel_size=(3, 3), dtype=self.dtype)(x), self.dtype)
        x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
        x = ResidualBlock(self.channels, self.dtype)(x)
        x = ResidualBlock(self.channels, self.dtype)(x)
        return x


class ImpalaCNN(nn.Module):
    """The IMPALA "deep" torso (Espeholt et al. 2018, Fig. 3) with LayerNorm after each convolution and dense layer.
    Observations stay uint8 until here; activations are `dtype`, params float32 (flax casts them for each layer)."""

    channels: Sequence[int]
    hiddens: Sequence[int]
    channel_first: bool  # Atari, VizDoom, Procgen: (N, C, H, W); Football's mini map: (N, H, W, C)
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        x = (jnp.transpose(x, (0, 2, 3, 1)) if self.channel_first else x).astype(self.dtype) / 255.0
        for channels in self.channels:
            x = ConvSequence(channels, self.dtype)(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        for hidden in self.hiddens:
            x = nn.relu(layer_norm(nn.Dense(hidden, dtype=self.dtype)(x), self.dtype))
        return x


class NatureCNN(nn.Module):
    """The Nature DQN torso (Mnih et al. 2015, Methods: 32 8x8 filters stride 4, 64 4x4 stride 2, 64 3x3 stride 1,
    a dense layer of 512, all ReLU) with LayerNorm before each ReLU, initialized as CleanRL's pqn_atari_envpool.py:
    orthogonal with gain sqrt(2), biases 0."""

    channel_first: bool  # as ImpalaCNN's
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        x = (jnp.transpose(x, (0, 2, 3, 1)) if self.channel_first else x).astype(self.dtype) / 255.0
        init = nn.initializers.orthogonal(np.sqrt(2))
        for features, size, stride in [(32, 8, 4), (64, 4, 2), (64, 3, 1)]:
            conv = nn.Conv(
                features, (size, size), (stride, stride), padding="VALID", kernel_init=init, dtype=self.dtype
            )
            x = nn.relu(layer_norm(conv(x), self.dtype))
        x = x.reshape((x.shape[0], -1))
        return nn.relu(layer_norm(nn.Dense(512, kernel_init=init, dtype=self.dtype)(x), self.dtype))


class MLP(nn.Module):
    """Torso for vector observations (classic control; MiniGrid and other dicts flattened by make_env): dense,
    LayerNorm, ReLU per hidden layer, as CleanRL's pqn.py."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32)
        for hidden in self.hiddens:
            dense = nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))
            x = nn.relu(layer_norm(dense(x), jnp.float32))
        return x


class Agent(nn.Module):
    """The Q-network: Q(obs, a) for every action, from an image torso (--network) or an MLP."""

    action_dim: int
    channels: Sequence[int]
    hiddens: Sequence[int]
    obs_layout: str  # cleanrl_utils.envs.obs_layout: "chw" or "hwc" images, or "vector"
    network: str = "nature"  # the image torso: "nature" or "impala"
    compute_dtype: str = "float32"  # the image torso's activations

    @nn.compact
    def __call__(self, obs):
        if self.obs_layout != "vector":
            channel_first, dtype = self.obs_layout == "chw", jnp.dtype(self.compute_dtype)
            if self.network == "nature":
                torso = NatureCNN(channel_first, dtype)
            else:
                torso = ImpalaCNN(self.channels, self.hiddens, channel_first, dtype)
            hidden = torso(obs).astype(jnp.float32)  # the head and losses in float32
        else:
            hidden = MLP(self.hiddens)(obs)
        # CleanRL's PQN initializes its Q head as every layer: orthogonal, gain sqrt(2)
        return nn.Dense(self.action_dim, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(hidden)


def make_network(args: Args) -> Agent:
    """The Q-network of the flags for --env-id's action space (what make_agent trains and make_eval_policy loads)."""
    space = env_spaces(args.env_id, args.env_options)[1]
    layout = obs_layout(args.env_id)
    return Agent(int(space.n), tuple(args.channels), tuple(args.hiddens), layout, args.network, args.compute_dtype)


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, TrainState]:
    """The network for --env-id and its training state (params and optimizer), on the host."""
    obs_space = env_spaces(args.env_id, args.env_options)[0]
    agent = make_network(args)

    def linear_schedule(count):
        # anneal over all optimizer steps, constant within an update: updates x epochs x minibatches (CleanRL's PQN)
        frac = 1.0 - (count // (args.num_minibatches * args.update_epochs)) / args.num_updates
        return args.learning_rate * frac

    return agent, TrainState.create(
        apply_fn=None,
        params=agent.init(key, np.zeros((1, *obs_space.shape), obs_space.dtype)),
        tx=optax.chain(
            optax.clip_by_global_norm(args.max_grad_norm),
            # RAdam with its default epsilon, as CleanRL's PQN scripts (torch.optim.RAdam)
            optax.inject_hyperparams(optax.radam)(
                learning_rate=linear_schedule if args.anneal_lr else args.learning_rate
            ),
        ),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1."""

    obs: np.ndarray
    actions: np.ndarray
    q_values: np.ndarray  # max_a Q(obs, a) with the actor's params (--q-lambda-targets actor)
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray  # False for envpool's reset step after an episode end: its action is ignored
    epsilons: np.ndarray  # the epsilon each step was taken with (charts/epsilon)
    bootstrap_obs: np.ndarray  # (1, envs, ...): the observation after the last step
    bootstrap_q_value: np.ndarray  # (1, envs): its max_a Q with the actor's params


class Batch(NamedTuple):
    """The learner's samples: a rollout with its Q(lambda) targets, flattened over (time, envs)."""

    obs: jax.Array
    actions: jax.Array
    targets: jax.Array
    valid: jax.Array
    epsilons: jax.Array


def epsilon_at(global_step, *, start_e: float, end_e: float, exploration_fraction: float, total_timesteps: int):
    """The actors' epsilon at `global_step` (env steps of every env of every process; a NumPy array of them too):
    linear from start_e to end_e over the first exploration_fraction of total_timesteps, then end_e (CleanRL's
    linear_schedule). A function of the global step alone: a resumed run continues it from its checkpoint's step."""
    progress = np.minimum(np.asarray(global_step, np.float64) / (exploration_fraction * total_timesteps), 1.0)
    return start_e + (end_e - start_e) * progress


def rollout_epsilons(args: Args, update: int) -> np.ndarray:
    """The epsilon of each env step of update `update`'s rollout, (num_steps,) float32: step s (from 0) is global
    step (update - 1) x batch + (s + 1) x envs of every thread and process: the step itself counts, as in CleanRL."""
    global_steps = (update - 1) * args.batch_size + np.arange(1, args.num_steps + 1) * args.global_num_envs
    schedule = dict(start_e=args.start_e, end_e=args.end_e, exploration_fraction=args.exploration_fraction)
    return epsilon_at(global_steps, **schedule, total_timesteps=args.total_timesteps).astype(np.float32)


def epsilon_greedy(q_values, epsilon, key):
    """Each row's greedy action, replaced with probability `epsilon` by a uniformly random one."""
    explore_key, action_key = jax.random.split(key)
    random_actions = jax.random.randint(action_key, q_values.shape[:-1], 0, q_values.shape[-1])
    explore = jax.random.uniform(explore_key, q_values.shape[:-1]) < epsilon
    return jnp.where(explore, random_actions, jnp.argmax(q_values, axis=-1))


def q_lambda_targets(*, rewards, q_values, bootstrap_q_value, terminations, truncations, gamma, q_lambda):
    """PQN's Q(lambda) returns (Gallici et al. 2024; CleanRL's pqn.py) on time-major (T, N) arrays, from the
    rewards and `q_values`, max_a Q of each step's observation:
        G_t = r_t + gamma (1 - term_t) ((1 - lambda_t) max_a Q(s_{t+1}, a) + lambda_t G_{t+1}),
    lambda_t = q_lambda, or 0 where an episode ends at t, and G_T = max_a Q(s_T) after the last step. envpool returns
    an episode's true last observation with its end flag and resets on the next step, so s_{t+1} of an ending step is
    that observation: a termination stops the bootstrap, a time-limit truncation bootstraps from it, and either end
    cuts the lambda-trace (the next step is envpool's reset step, masked out of the loss by `valid`)."""
    next_q_values = jnp.concatenate([q_values[1:], bootstrap_q_value[None]], axis=0)
    traces = q_lambda * (1.0 - jnp.logical_or(terminations, truncations))

    def backward(next_target, step):
        reward, next_q_value, terminated, trace = step
        target = reward + gamma * (1.0 - terminated) * ((1.0 - trace) * next_q_value + trace * next_target)
        return target, target

    steps = (rewards, next_q_values, terminations, traces)
    return jax.lax.scan(backward, bootstrap_q_value, steps, reverse=True)[1]


def prepare_batch(params, storage: Rollout, *, agent: Agent, args: Args) -> Batch:
    """A learner device's envs of the rollout as samples: Q(lambda) targets, then (time, envs) flattened. The targets
    bootstrap from max_a Q of `params` (--q-lambda-targets learner: one forward pass over the rollout), or of the
    actor's params, as it recorded them (actor)."""
    flat = lambda x: x.reshape((-1, *x.shape[2:]))
    q_values, bootstrap_q_value = storage.q_values, storage.bootstrap_q_value[0]
    if args.q_lambda_targets == "learner":
        q_values = agent.apply(params, flat(storage.obs)).max(-1).reshape(storage.q_values.shape)
        bootstrap_q_value = agent.apply(params, storage.bootstrap_obs[0]).max(-1)
    targets = q_lambda_targets(
        rewards=storage.rewards,
        q_values=q_values,
        bootstrap_q_value=bootstrap_q_value,
        terminations=storage.terminations,
        truncations=storage.truncations,
        gamma=args.gamma,
        q_lambda=args.q_lambda,
    )
    return Batch(*map(flat, (storage.obs, storage.actions, targets, storage.valid, storage.epsilons)))


def td_loss_terms(*, q_taken, targets, valid, normalizer):
    """The squared TD error (Q(s, a) - G)^2 (CleanRL's PQN: mse_loss, no 1/2) and Q(s, a), each a sum over the valid
    samples / normalizer. Returns (td_loss, q_values)."""
    valid = valid.astype(jnp.float32)
    return ((q_taken - targets) ** 2 * valid).sum() / normalizer, (q_taken * valid).sum() / normalizer


def pqn_loss(params, minibatch: Batch, *, agent: Agent):
    """A learner device's part of the PQN loss of the global minibatch (a sum over its valid samples divided by the
    whole minibatch's count: the parts add up to the loss); inside `shard_map` over the mesh axis "batch".
    Returns (td_loss, (q_values, epsilon))."""
    q_all = agent.apply(params, minibatch.obs)
    q_taken = jnp.take_along_axis(q_all, minibatch.actions[:, None], axis=-1).squeeze(-1)
    normalizer = jnp.maximum(jax.lax.psum(minibatch.valid.sum(), "batch"), 1).astype(jnp.float32)
    td_loss, q_values = td_loss_terms(
        q_taken=q_taken, targets=minibatch.targets, valid=minibatch.valid, normalizer=normalizer
    )
    # the mean epsilon over every sample (not only the valid): a function of the global steps alone
    epsilon = minibatch.epsilons.sum() / jax.lax.psum(minibatch.epsilons.size, "batch")
    return td_loss, (q_values, epsilon)


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key, epsilon) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> max_a Q(obs), the bootstrap's; None: the learner's


def make_actor_fns(agent: Agent) -> ActorFns:
    @jax.jit
    def act(params, obs, key, epsilon):
        q_values = agent.apply(params, obs)
        key, subkey = jax.random.split(key)
        action = epsilon_greedy(q_values, epsilon, subkey)  # on the actor device
        # one array: one device-to-host copy per env step instead of two (float32 holds action ids exactly)
        return jnp.stack([action.astype(jnp.float32), q_values.max(-1)]), key

    @jax.jit
    def value(params, obs):
        return agent.apply(params, obs).max(-1)

    return ActorFns(act, value)


def actor_params(agent_state: TrainState):
    """What the actors act with."""
    return agent_state.params


def actor_loop(*, args: Args, thread: ActorThread, key, make_envs, actor_fns: ActorFns, params_queue, rollout_queue):
    """An actor thread's life: steps its envpool (`make_envs(seed, num_threads)`), acts on its actor device with
    `key`, ships one rollout per update to the learner."""
    envs = make_envs(thread.env_seed(args.seed, args.local_num_envs), num_threads=thread.envpool_threads)
    key = thread.key(key)
    num_envs, num_steps, obs_space = args.local_num_envs, args.num_steps, envs.observation_space
    next_obs, _ = envs.reset()
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    episodes, timer = EpisodeStats(num_envs), StageTimer()
    for update in range(thread.start_update + 1, args.num_updates + 1):
        with timer("params_queue_get_time"):
            # skipping the second get makes the actor exactly one policy version behind the learner
            if update != thread.start_update + 2 or not args.concurrency:
                params, actor_policy_version = thread.get(params_queue)
        with timer("rollout_time"):
            obs = np.empty((num_steps, num_envs, *obs_space.shape), dtype=obs_space.dtype)
            actions = np.empty((num_steps, num_envs), dtype=np.int32)
            q_values, rewards, terminations, truncations = (
                np.empty((num_steps, num_envs), dtype=np.float32) for _ in range(4)
            )
            valid = np.empty((num_steps, num_envs), dtype=bool)
            epsilons = rollout_epsilons(args, update)  # the schedule at each step's global step
            for step in range(num_steps):
                thread.check_stopped()
                with timer("inference_time"):
                    step_outputs, key = actor_fns.act(params, next_obs, key, epsilons[step])
                    action, q_value = np.asarray(step_outputs)
                    action = action.astype(np.int32)
                with timer("env_step_time"):
                    step_obs, reward, terminated, truncated, info = envs.step(action)
                with timer("storage_time"):
                    obs[step], actions[step], q_values[step] = next_obs, action, q_value
                    rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
                    valid[step] = ~previous_episode_end
                    episodes.step(reward, terminated, truncated, info, counted=valid[step])
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs
            with timer("inference_time"):
                bootstrap = next_obs[None], np.asarray(actor_fns.value(params, next_obs))[None]
        epsilons = np.repeat(epsilons[:, None], num_envs, axis=1)  # per sample, as every field
        storage = Rollout(obs, actions, q_values, rewards, terminations, truncations, valid, epsilons, *bootstrap)
        # one host-to-device copy per learner device
        storage = split_for_learners(storage, thread.learner_devices)
        with timer("rollout_queue_put_time"):  # logged with the next rollout
            thread.put(rollout_queue, (storage, actor_policy_version, {**timer.read(), **episodes.read()}))


# ---------------------------------------------------------------- learner


class LearnerState(NamedTuple):
    """What the learner carries from update to update, and what a checkpoint holds."""

    agent: TrainState  # params and optimizer state, replicated over the learner devices
    key: jax.Array  # the learner's PRNG key (minibatch shuffles), the same in every process


def make_learner_update(args: Args, agent: Agent, mesh: Mesh) -> Callable:
    """The data-parallel learner (`shard_map` over the mesh axis "batch"): epochs x minibatches are a Python loop over
    one compiled minibatch step: on CPU, XLA compiles a conv weight-gradient inside `lax.scan` into a very slow loop,
    and on an H100 the loop was as fast as one scanned program (docs/performance.md#on-a-gpu)."""
    replicated, sharded_envs, sharded_steps = P(), P(None, "batch"), P("batch")
    shard_map = partial(jax.shard_map, mesh=mesh)
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    batch_specs = Batch(*([sharded_steps] * len(Batch._fields)))
    minibatch_size = args.num_steps * args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    minibatch_size //= len(args.learner_device_ids) * args.num_minibatches
    names = ["losses/td_loss", "losses/q_values", "charts/epsilon"]
    loss_fn = partial(pqn_loss, agent=agent)

    def minibatch_update(agent_state: TrainState, batch: Batch, permutation, minibatch_index):
        indices = jax.lax.dynamic_slice_in_dim(permutation, minibatch_index * minibatch_size, minibatch_size)
        minibatch = jax.tree.map(lambda x: jnp.take(x, indices, axis=0), batch)
        # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
        # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
        local_params = jax.lax.pcast(agent_state.params, "batch", to="varying")
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(local_params, minibatch)
        grads, loss, metrics = jax.lax.psum((grads, loss, metrics), "batch")
        agent_state = agent_state.apply_gradients(grads=grads)
        return agent_state, (loss, *metrics)

    def shuffle(key):
        """Each learner device permutes its own samples with its own key."""
        key = jax.random.fold_in(key, jax.lax.axis_index("batch"))
        return jax.random.permutation(key, minibatch_size * args.num_minibatches)

    batch_of = partial(prepare_batch, agent=agent, args=args)
    batch_of = jax.jit(shard_map(batch_of, in_specs=(replicated, rollout_specs), out_specs=batch_specs))
    minibatch_specs = (replicated, batch_specs, sharded_steps, replicated)
    minibatch_update = shard_map(minibatch_update, in_specs=minibatch_specs, out_specs=(replicated, replicated))
    minibatch_update = jax.jit(minibatch_update, donate_argnums=(0,))
    # each one's first call stops the run with one line if it cannot fit the devices' free memory
    # (cleanrl_utils/memory.py): the targets pass holds the whole batch, a minibatch step its minibatch
    batch_of = checked_for_memory(batch_of, "lower --local-num-envs or --num-steps", "the learner's targets pass")
    lower_memory = "raise --num-minibatches, or lower --local-num-envs or --num-steps"
    minibatch_update = checked_for_memory(minibatch_update, lower_memory)
    shuffle = jax.jit(shard_map(shuffle, in_specs=(replicated,), out_specs=sharded_steps))

    def update(state: LearnerState, storage: Rollout) -> tuple[LearnerState, dict]:
        agent_state, key = state
        # the targets, from the params this update starts from (--q-lambda-targets learner)
        batch = batch_of(agent_state.params, storage)
        metrics = []
        for _ in range(args.update_epochs):
            key, shuffle_key = jax.random.split(key)
            permutation = shuffle(shuffle_key)
            for index in range(args.num_minibatches):
                agent_state, minibatch_metrics = minibatch_update(agent_state, batch, permutation, jnp.int32(index))
                # one learner program queued at a time: inference gets between
                if args.sync_minibatches:
                    jax.block_until_ready(agent_state)
                metrics.append(minibatch_metrics)
        metrics = dict(zip(names, jax.tree.map(lambda *x: jnp.stack(x).mean(), *metrics)))
        metrics["charts/learning_rate"] = agent_state.opt_state[1].hyperparams["learning_rate"]
        return LearnerState(agent_state, key), metrics

    return update


# ---------------------------------------------------------------- evaluation: what --save-model saves, and its policy
# (cleanrl_utils.evals.evaluate and the benchmarks import `make_env`, `make_eval_policy`, `Args`, `make_agent`,
# `make_actor_fns`, `actor_params`, `actor_loop`, `make_learner_update`, `LearnerState`, `validate_args` and
# `check_runtime_values` from this script)


def saved_model(state: LearnerState) -> dict:
    """What --save-model writes next to the flags: what `make_eval_policy` reads."""
    return {"params": to_state_dict(local_value(state.agent.params))}


def make_eval_policy(args: Args, model: dict, greedy: bool):
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: greedy takes the action of
    the highest Q-value, otherwise epsilon-greedy with --end-e, the epsilon training ended with."""
    agent = make_network(args)
    params = jax.tree.map(jnp.asarray, model["params"])
    epsilon = 0.0 if greedy else args.end_e

    @jax.jit
    def act(params, obs, key):
        key, subkey = jax.random.split(key)
        return epsilon_greedy(agent.apply(params, obs), epsilon, subkey), key

    def policy(obs: np.ndarray, key: jax.Array):
        actions, key = act(params, obs, key)
        return np.asarray(actions), key

    return policy


# ---------------------------------------------------------------- main: the Sebulba protocol


def check_runtime_values(args: Args, layout: DeviceLayout):
    """Checks of what the run derives from the flags and the layout (the batch: cleanrl_utils.flags)."""
    # RAdam's steps per update
    schedule = ("--update-epochs x --num-minibatches", args.update_epochs * args.num_minibatches)
    check_int32_counts(args, {"optimizer steps": schedule})


def state_summary(state: LearnerState) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states."""
    return f"params sha256={tree_digest(state.agent.params)}"


def main(args: Args) -> int:
    validate_args(args)  # bad flags stop here, before JAX starts a backend
    # devices, run folder, checkpoints, signals; `run.args`: a copy of the flags with the sizes the layout gives them
    # (the batch, the global env count, the updates: cleanrl_utils/flags.py) and the run's name
    run = SebulbaRun(args, __file__, check_runtime_values)
    args = run.args
    # the agent and learner keys are the same in every process; each actor thread folds the update the run starts at
    # and its global index into actor_key, so no two threads, processes or resumed runs sample with the same key
    agent_key, learner_key, actor_key = jax.random.split(jax.random.key(args.seed), 3)
    agent, agent_state = make_agent(args, agent_key)
    # data-parallel over run.mesh, every process's learner devices; the first call of each of its programs stops the
    # run with one line if the program cannot fit the devices' free memory (cleanrl_utils/memory.py)
    learner_update = make_learner_update(args, agent, run.mesh)
    # the newest checkpoint of the run, or this fresh state; then the actor threads, seeded for the update it is at
    state = LearnerState(replicate(agent_state, run.mesh), learner_key)
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
            # the update donates its input: a copy is kept in case it diverges
            before = run.copy_learner_state(state)
            state, metrics = learner_update(state, storage)
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
