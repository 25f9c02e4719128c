"""Sebulba PPO (Hessel et al. 2021, "Podracer architectures") for envpool's discrete-action envs (Atari, classic
control, Football, VizDoom, MiniGrid, Procgen).

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (advantage estimation, losses), the
actor thread, the learner update, and `main`: the Sebulba protocol itself. What is the same for every algorithm
(checkpoints, preemption, device layout, logging, stop-aware queues) comes from cleanrl_utils/, one small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their own envpool and run
jitted inference on their actor device. Each thread hands its rollout to the learner through its own size-1
`rollout_queue`, already split along the env axis and placed on the learner devices (cleanrl_utils/data_path.py); the
learner answers through a size-1 `params_queue` per thread. Because the actor skips one `params_queue.get()` (its second
rollout), from update 2 on it acts with the policy one version behind the learner's (update 1's: the initial params,
lag 0; `--no-concurrency`: no skip, lag 0, no overlap). The learner is data-parallel over every process's learner
devices (`jax.jit` + `shard_map` over a 1-D mesh, gradients summed with `psum`), so `--distributed` scales it.
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
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then PPO's
    env_id: str = "Breakout-v5"
    """the id of an envpool env with discrete actions: Atari, classic control, Football, VizDoom, MiniGrid,
    Procgen (cleanrl_utils/envs.py); images go into a CNN (--network), vectors and dicts (flattened) into MLPs"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 50_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer (PPO paper, Table 5) (positive, finite)"""
    local_num_envs: int = 60
    """the number of parallel game environments of each actor thread (60 as in Cleanba's early scripts: 1, 2, 3, 4
    and 6 learner devices, its README's layouts, divide it; docs/usage.md#device-layouts) (positive)"""
    num_steps: int = 128
    """the number of steps of each rollout (PPO paper, Table 5: horizon 128) (positive)"""
    anneal_lr: bool = True
    """toggle linear annealing of the learning rate to 0 (PPO paper, Table 5: alpha annealed)"""
    gamma: float = 0.99
    """the discount factor gamma (PPO paper, Table 5) (in [0, 1])"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation (PPO paper, Table 5) (in [0, 1])"""
    num_minibatches: int = 4
    """the number of mini-batches per epoch, on each learner device (positive)"""
    update_epochs: int = 4
    """the K epochs to update the policy (PPO paper Table 5 uses 3; CleanRL and Cleanba use 4) (positive)"""
    norm_adv: bool = True
    """toggles advantages normalization (with the mean and std of the whole minibatch, over every learner device)"""
    clip_coef: float = 0.1
    """the surrogate clipping coefficient (PPO paper, Table 5: 0.1 x alpha) (positive, finite)"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function (as in OpenAI baselines)"""
    ent_coef: float = 0.01
    """coefficient of the entropy (PPO paper, Table 5: c2 = 0.01) (non-negative, finite)"""
    vf_coef: float = 0.5
    """coefficient of the value function (baselines' PPO2 Atari setting, shared torso) (non-negative, finite)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping (baselines' PPO2) (positive, finite)"""
    channels: list[int] = field(default_factory=lambda: [16, 32, 32])
    """the channels of the IMPALA CNN's residual stacks (Espeholt et al. 2018, Fig. 3) (positive)"""
    hiddens: list[int] = field(default_factory=lambda: [256])
    """the hidden layers after the IMPALA CNN (IMPALA: one of 256), or of the MLP for vector observations (positive)"""
    network: Literal["impala", "nature"] = "impala"
    """the torso for image observations: impala (the IMPALA CNN of --channels and --hiddens) or nature (the
    Nature DQN CNN of Mnih et al. 2015, as in CleanRL's PPO on Atari)"""
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    """the dtype of the image torso's activations (bfloat16: faster convolutions on GPUs); params, optimizer
    state, heads and losses stay float32"""
    sync_minibatches: RunSetting[bool] = False
    """the learner waits for each minibatch step to finish before dispatching the next, so that actor inference
    on the same GPU runs between the steps instead of behind the whole update (the same results)"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(
        args,
        positive_ints=["local_num_envs", "num_steps", "num_minibatches", "update_epochs"],
        positive=["learning_rate", "clip_coef", "max_grad_norm"],
        non_negative=["ent_coef", "vf_coef"],
        unit_interval=["gamma", "gae_lambda"],
        positive_int_lists=["channels", "hiddens"],
    )
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


class ResidualBlock(nn.Module):
    channels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        inputs = x
        x = nn.relu(x)
        x = nn.Conv(self.channels, kernel_size=(3, 3), dtype=self.dtype)(x)
        x = nn.relu(x)
        x = nn.Conv(self.channels, kernel_size=(3, 3), dtype=self.dtype)(x)
        return x + inputs


class ConvSequence(nn.Module):
    channels: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.channels, kernel_size=(3, 3), dtype=self.dtype)(x)
        x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding="SAME")
        x = ResidualBlock(self.channels, self.dtype)(x)
        x = ResidualBlock(self.channels, self.dtype)(x)
        return x


class ImpalaCNN(nn.Module):
    """The IMPALA "deep" torso (Espeholt et al. 2018, Fig. 3). Observations stay uint8 until here; activations are
    `dtype`, params float32 (flax casts them for each layer)."""

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
            x = nn.relu(nn.Dense(hidden, dtype=self.dtype)(x))
        return x


class NatureCNN(nn.Module):
    """The Nature DQN torso (Mnih et al. 2015, Methods: 32 8x8 filters stride 4, 64 4x4 stride 2, 64 3x3 stride 1,
    a dense layer of 512, all ReLU), initialized as CleanRL's ppo_atari: orthogonal with gain sqrt(2), biases 0."""

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
            x = nn.relu(conv(x))
        x = x.reshape((x.shape[0], -1))
        return nn.relu(nn.Dense(512, kernel_init=init, dtype=self.dtype)(x))


class MLP(nn.Module):
    """tanh MLP with orthogonal init (PPO paper Sec. 6.1; CleanRL's ppo and ppo_continuous_action) for vector
    observations (classic control, MuJoCo; MiniGrid's views and other dicts flattened before it)."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32)
        for hidden in self.hiddens:
            x = nn.tanh(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


class Agent(nn.Module):
    """Policy logits and value. Images share one CNN torso (--network) between both heads (Espeholt et al. 2018);
    vector observations get separate actor and critic MLPs, as in CleanRL's classic-control PPO: with a
    shared small MLP, large value gradients (returns of ~100s) drown the policy gradient."""

    action_dim: int
    channels: Sequence[int]
    hiddens: Sequence[int]
    obs_layout: str  # cleanrl_utils.envs.obs_layout: "chw" or "hwc" images, or "vector"
    network: str = "impala"  # the image torso: "impala" or "nature"
    compute_dtype: str = "float32"  # the image torso's activations

    @nn.compact
    def __call__(self, obs):
        if self.obs_layout != "vector":
            channel_first, dtype = self.obs_layout == "chw", jnp.dtype(self.compute_dtype)
            if self.network == "nature":
                torso = NatureCNN(channel_first, dtype)
            else:
                torso = ImpalaCNN(self.channels, self.hiddens, channel_first, dtype)
            # the heads and losses in float32
            actor_hidden = critic_hidden = torso(obs).astype(jnp.float32)
        else:
            actor_hidden = MLP(self.hiddens)(obs)
            critic_hidden = MLP(self.hiddens)(obs)
        # small policy init and unit value init: CleanRL / "37 implementation details of PPO" (Huang et al. 2022)
        policy_init = nn.initializers.orthogonal(0.01)
        logits = nn.Dense(self.action_dim, kernel_init=policy_init)(actor_hidden)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic_hidden)
        return logits, value.squeeze(-1)


def make_network(args: Args) -> Agent:
    """The actor-critic of the flags for --env-id's action space (what make_agent trains and make_eval_policy loads)."""
    space = env_spaces(args.env_id, args.env_options)[1]
    layout = obs_layout(args.env_id)
    return Agent(int(space.n), tuple(args.channels), tuple(args.hiddens), layout, args.network, args.compute_dtype)


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, TrainState]:
    """The network for --env-id and its training state (params and optimizer), on the host."""
    obs_space = env_spaces(args.env_id, args.env_options)[0]
    agent = make_network(args)

    def linear_schedule(count):
        # anneal over all optimizer steps: updates x epochs x minibatches (PPO paper, Table 5)
        frac = 1.0 - (count // (args.num_minibatches * args.update_epochs)) / args.num_updates
        return args.learning_rate * frac

    return agent, TrainState.create(
        apply_fn=None,
        params=agent.init(key, np.zeros((1, *obs_space.shape), obs_space.dtype)),
        tx=optax.chain(
            optax.clip_by_global_norm(args.max_grad_norm),
            optax.inject_hyperparams(optax.adam)(
                learning_rate=linear_schedule if args.anneal_lr else args.learning_rate, eps=1e-5
            ),
        ),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1."""

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray  # False for envpool's reset step after an episode end: its action is ignored
    bootstrap_value: np.ndarray  # (1, envs): V(obs after the last step)


class Batch(NamedTuple):
    """The learner's samples: a rollout with advantages and returns, flattened over (time, envs)."""

    obs: jax.Array
    actions: jax.Array
    logprobs: jax.Array
    values: jax.Array
    advantages: jax.Array
    returns: jax.Array
    valid: jax.Array


def compute_gae(*, rewards, values, bootstrap_value, terminations, truncations, gamma, gae_lambda):
    """Generalized advantage estimation (Schulman et al. 2016) on time-major (T, N) arrays. The env returns an
    episode's true last observation with its end flag and resets on the next step, so the value at t+1 is V(last
    observation): a termination stops the bootstrap (its value is 0), a time-limit truncation bootstraps from it, and
    either end stops the lambda-trace (the next step is the reset step, masked out of the loss by `valid`)."""
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    episode_ends = jnp.logical_or(terminations, truncations)
    deltas = rewards + gamma * next_values * (1.0 - terminations) - values

    def backward(next_advantage, step):
        delta, episode_end = step
        advantage = delta + gamma * gae_lambda * (1.0 - episode_end) * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(backward, jnp.zeros_like(bootstrap_value), (deltas, episode_ends), reverse=True)
    return advantages, advantages + values


def prepare_batch(storage: Rollout, *, gamma: float, gae_lambda: float) -> Batch:
    """A learner device's envs of the rollout as samples: advantages and returns, then (time, envs) flattened."""
    flat = lambda x: x.reshape((-1, *x.shape[2:]))
    advantages, returns = compute_gae(
        rewards=storage.rewards,
        values=storage.values,
        bootstrap_value=storage.bootstrap_value[0],
        terminations=storage.terminations,
        truncations=storage.truncations,
        gamma=gamma,
        gae_lambda=gae_lambda,
    )
    fields = storage.obs, storage.actions, storage.logprobs, storage.values, advantages, returns, storage.valid
    return Batch(*map(flat, fields))


def normalize_advantages(advantages, valid, axis_name: str):
    """Advantages standardized with the mean and std of the valid samples of the whole minibatch, the parts of every
    learner device summed over `axis_name`: the same update on any number of learner devices."""
    count = jnp.maximum(jax.lax.psum(valid.sum(), axis_name), 1)
    mean = jax.lax.psum(jnp.where(valid, advantages, 0).sum(), axis_name) / count
    squared_deviations = jnp.where(valid, (advantages - mean) ** 2, 0).sum()
    std = jnp.sqrt(jax.lax.psum(squared_deviations, axis_name) / count)
    return (advantages - mean) / (std + 1e-8)


def ppo_loss_terms(
    *,
    new_logprobs,
    entropy,
    new_values,
    old_logprobs,
    old_values,
    advantages,
    returns,
    valid,
    normalizer,
    clip_coef,
    clip_vloss,
):
    """Clipped-surrogate PPO losses (Schulman et al. 2017), each a sum over valid samples / normalizer.

    Returns (policy_loss, value_loss, entropy, approx_kl). approx_kl is the k3 estimator
    E[(r - 1) - log r] (Schulman 2020), unbiased and non-negative.
    """
    valid = valid.astype(jnp.float32)
    logratio = new_logprobs - old_logprobs
    ratio = jnp.exp(logratio)
    pg_loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - clip_coef, 1 + clip_coef))
    if clip_vloss:
        clipped_values = old_values + jnp.clip(new_values - old_values, -clip_coef, clip_coef)
        v_loss = 0.5 * jnp.maximum((new_values - returns) ** 2, (clipped_values - returns) ** 2)
    else:
        v_loss = 0.5 * (new_values - returns) ** 2
    approx_kl = (ratio - 1) - logratio
    return tuple((x * valid).sum() / normalizer for x in (pg_loss, v_loss, entropy, approx_kl))


def categorical_logprob_entropy(logits, actions):
    log_probs = jax.nn.log_softmax(logits)
    logprob = jnp.take_along_axis(log_probs, actions[..., None], axis=-1).squeeze(-1)
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    return logprob, entropy


def ppo_loss(params, minibatch: Batch, *, agent: Agent, args: Args):
    """A learner device's part of the PPO loss of the global minibatch (each term a sum over its valid samples divided
    by the whole minibatch's count: the parts add up to the loss); inside `shard_map` over the mesh axis "batch".
    Returns (loss, (policy_loss, value_loss, entropy, approx_kl))."""
    logits, new_values = agent.apply(params, minibatch.obs)
    new_logprobs, entropy = categorical_logprob_entropy(logits, minibatch.actions)
    advantages, valid = minibatch.advantages, minibatch.valid
    if args.norm_adv:
        advantages = normalize_advantages(advantages, valid, "batch")
    normalizer = jnp.maximum(jax.lax.psum(valid.sum(), "batch"), 1).astype(jnp.float32)
    pg_loss, v_loss, entropy_loss, approx_kl = ppo_loss_terms(
        new_logprobs=new_logprobs,
        entropy=entropy,
        new_values=new_values,
        old_logprobs=minibatch.logprobs,
        old_values=minibatch.values,
        advantages=advantages,
        returns=minibatch.returns,
        valid=valid,
        normalizer=normalizer,
        clip_coef=args.clip_coef,
        clip_vloss=args.clip_vloss,
    )
    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
    return loss, (pg_loss, v_loss, entropy_loss, approx_kl)


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> V(obs), the bootstrap's; None: the learner values it


def make_actor_fns(agent: Agent) -> ActorFns:
    @jax.jit
    def act(params, obs, key):
        logits, value = agent.apply(params, obs)
        key, subkey = jax.random.split(key)
        action = jax.random.categorical(subkey, logits)  # Gumbel-max sampling on the actor device
        logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
        # one array: one device-to-host copy per env step instead of three (float32 holds action ids exactly)
        return jnp.stack([action.astype(jnp.float32), logprob, value]), key

    @jax.jit
    def value(params, obs):
        return agent.apply(params, obs)[1]

    return ActorFns(act, value)


def actor_params(agent_state: TrainState):
    """What the actors act with."""
    return agent_state.params


def actor_loop(*, args: Args, thread: ActorThread, key, make_envs, actor_fns: ActorFns, params_queue, rollout_queue):
    """An actor thread's life: steps its envpool (`make_envs(seed, num_threads)`), acts on its actor device with
    `key`, ships one rollout per update to the learner."""
    num_envs, num_steps = args.local_num_envs, args.num_steps
    env_seed = thread.env_seed(args.seed, num_envs)
    envs = make_envs(env_seed, num_threads=thread.envpool_threads)
    key, obs_space = thread.key(key), envs.observation_space
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
            logprobs, values, rewards, terminations, truncations = (
                np.empty((num_steps, num_envs), dtype=np.float32) for _ in range(5)
            )
            valid = np.empty((num_steps, num_envs), dtype=bool)
            for step in range(num_steps):
                thread.check_stopped()
                with timer("inference_time"):
                    step_outputs, key = actor_fns.act(params, next_obs, key)
                    action, logprob, value = np.asarray(step_outputs)
                    action = action.astype(np.int32)
                with timer("env_step_time"):
                    step_obs, reward, terminated, truncated, info = envs.step(action)
                with timer("storage_time"):
                    obs[step], actions[step], logprobs[step], values[step] = next_obs, action, logprob, value
                    rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
                    valid[step] = ~previous_episode_end
                    episodes.step(reward, terminated, truncated, info, counted=valid[step])
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs
            with timer("inference_time"):
                bootstrap_value = np.asarray(actor_fns.value(params, next_obs))[None]
        storage = Rollout(obs, actions, logprobs, values, rewards, terminations, truncations, valid, bootstrap_value)
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
    names = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
    loss_fn = partial(ppo_loss, agent=agent, args=args)

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

    batch_of = partial(prepare_batch, gamma=args.gamma, gae_lambda=args.gae_lambda)
    batch_of = shard_map(batch_of, in_specs=(rollout_specs,), out_specs=batch_specs)
    batch_of = jax.jit(batch_of)
    minibatch_specs = (replicated, batch_specs, sharded_steps, replicated)
    minibatch_update = shard_map(minibatch_update, in_specs=minibatch_specs, out_specs=(replicated, replicated))
    minibatch_update = jax.jit(minibatch_update, donate_argnums=(0,))
    # each one's first call stops the run with one line if it cannot fit the devices' free memory
    # (cleanrl_utils/memory.py): the advantage pass holds the whole batch, a minibatch step its minibatch
    batch_of = checked_for_memory(batch_of, "lower --local-num-envs or --num-steps", "the learner's advantage pass")
    lower_memory = "raise --num-minibatches, or lower --local-num-envs or --num-steps"
    minibatch_update = checked_for_memory(minibatch_update, lower_memory)
    shuffle = jax.jit(shard_map(shuffle, in_specs=(replicated,), out_specs=sharded_steps))

    def update(state: LearnerState, storage: Rollout) -> tuple[LearnerState, dict]:
        agent_state, key = state
        batch = batch_of(storage)
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
# (what the evaluator and the tools call in this script: cleanrl_utils/script_contract.py)


def saved_model(state: LearnerState) -> dict:
    """What --save-model writes next to the flags: what `make_eval_policy` reads."""
    return {"params": to_state_dict(local_value(state.agent.params))}


def make_eval_policy(args: Args, model: dict, greedy: bool):
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: greedy takes the most
    likely action, otherwise actions are sampled as in training."""
    agent = make_network(args)
    params = jax.tree.map(jnp.asarray, model["params"])

    @jax.jit
    def act(params, obs, key):
        logits, _ = agent.apply(params, obs)
        key, subkey = jax.random.split(key)
        if greedy:
            return jnp.argmax(logits, axis=-1), key
        return jax.random.categorical(subkey, logits), key

    def policy(obs: np.ndarray, key: jax.Array):
        actions, key = act(params, obs, key)
        return np.asarray(actions), key

    return policy


# ---------------------------------------------------------------- main: the Sebulba protocol


def check_runtime_values(args: Args, layout: DeviceLayout):
    """Checks of what the run derives from the flags and the layout (the batch: cleanrl_utils.flags)."""
    # Adam's steps per update
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
