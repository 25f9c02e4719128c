"""Sebulba PPO (Hessel et al. 2021, "Podracer architectures") with a Gaussian policy for envpool MuJoCo and
DeepMind Control.

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

Continuous control as in CleanRL's ppo_continuous_action (Huang et al. 2022): diagonal Gaussian with a
state-independent log-std, actions clipped to the bounds by the env step only, separate 64x64 tanh MLPs,
observation and reward normalization with running statistics that belong to the training state: they travel
with the params to the actors, the learner updates them from every rollout (merged over all learner devices).
"""

import queue
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, NamedTuple

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
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool, reset_out_of_phase
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import SebulbaArgs, check_envs_split, check_flags, check_int32_counts, check_run_flags
from cleanrl_utils.logger import EpisodeStats, StageTimer
from cleanrl_utils.memory import checked_for_memory
from cleanrl_utils.normalization import (
    RunningMeanStd,
    batch_running_stats,
    merge_running_stats,
    normalize_obs,
    scale_rewards,
)
from cleanrl_utils.run import SebulbaRun
from cleanrl_utils.saved_model import check_save_model_flags

# envpool's Box spaces warn that they cast to float32
warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32")


@dataclass
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then PPO's
    env_id: str = "HalfCheetah-v4"
    """the id of an envpool env with continuous actions: gym MuJoCo (HalfCheetah-v4, Hopper-v4, ...), DeepMind
    Control (CheetahRun-v1, CartpoleBalance-v1, ...: dict observations flattened by make_env) or Pendulum-v1"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    frame_skip=2 or max_episode_steps=500 (KEY: one of envpool's options of the id)"""
    stagger_episodes: Literal["auto", "on", "off"] = "auto"
    """start the envs' episodes out of phase: env g of the run's N first takes g x T / N random steps (T: the episode
    length); auto: where no episode ends early (DeepMind Control), whose envs otherwise stay in lock-step"""
    total_timesteps: int = 1_000_000
    """total agent steps, summed over all envs and processes (PPO paper, Sec. 6.1: 1M) (in [1, 2**53])"""
    learning_rate: float = 3e-4
    """the learning rate of the optimizer (PPO paper, Table 3) (positive, finite)"""
    local_num_envs: int = 4
    """the number of parallel game environments of each actor thread (positive)"""
    num_steps: int = 256
    """the steps of each rollout: 2 threads x 4 envs x 256 steps = the PPO paper's 2048 (Table 3) (positive)"""
    anneal_lr: bool = True
    """toggle linear annealing of the learning rate to 0 (baselines' PPO2 MuJoCo setting, as in CleanRL)"""
    gamma: float = 0.99
    """the discount factor gamma (PPO paper, Table 3) (in [0, 1])"""
    gae_lambda: float = 0.95
    """the lambda for the general advantage estimation (PPO paper, Table 3) (in [0, 1])"""
    num_minibatches: int = 32
    """the number of mini-batches per epoch, on each learner device (PPO paper, Table 3: 2048 / 64) (positive)"""
    update_epochs: int = 10
    """the K epochs to update the policy (PPO paper, Table 3) (positive)"""
    norm_adv: bool = True
    """toggles advantages normalization (with the mean and std of the whole minibatch, over every learner device)"""
    clip_coef: float = 0.2
    """the surrogate clipping coefficient (PPO paper, Table 1 and Sec. 6.1: epsilon = 0.2) (positive, finite)"""
    clip_vloss: bool = True
    """toggles whether or not to use a clipped loss for the value function (as in OpenAI baselines)"""
    ent_coef: float = 0.0
    """coefficient of the entropy (PPO paper, Sec. 6.1: no entropy bonus on MuJoCo) (non-negative, finite)"""
    vf_coef: float = 0.5
    """the value loss's weight (baselines' PPO2: it counts in the gradient clip) (non-negative, finite)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping (baselines' PPO2) (positive, finite)"""
    hiddens: list[int] = field(default_factory=lambda: [64, 64])
    """the hidden layers of the policy and of the value MLP (PPO paper, Sec. 6.1: two tanh layers of 64) (positive)"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(
        args,
        positive_ints=["local_num_envs", "num_steps", "num_minibatches", "update_epochs"],
        positive=["learning_rate", "clip_coef", "max_grad_norm"],
        non_negative=["ent_coef", "vf_coef"],
        unit_interval=["gamma", "gae_lambda"],
        positive_int_lists=["hiddens"],
    )
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=False, env_options=args.env_options)
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
    """Gaussian policy (mean from an MLP, state-independent log-std parameter) and value, with separate
    actor and critic MLPs as in baselines' PPO2 for MuJoCo and CleanRL's ppo_continuous_action."""

    action_dim: int
    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, obs):
        actor_hidden = MLP(self.hiddens)(obs)
        critic_hidden = MLP(self.hiddens)(obs)
        # small policy init and unit value init: CleanRL / "37 implementation details of PPO" (Huang et al. 2022)
        policy_init = nn.initializers.orthogonal(0.01)
        action_mean = nn.Dense(self.action_dim, kernel_init=policy_init)(actor_hidden)
        # std 1 at the start
        action_logstd = self.param("actor_logstd", nn.initializers.zeros, (self.action_dim,))
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic_hidden)
        return action_mean, action_logstd, value.squeeze(-1)


def make_network(args: Args) -> Agent:
    """The actor-critic of the flags for --env-id's action space (what make_agent trains and make_eval_policy loads)."""
    space = env_spaces(args.env_id, args.env_options)[1]
    return Agent(int(np.prod(space.shape)), tuple(args.hiddens))


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, "AgentState"]:
    """The network for --env-id and its training state (params, optimizer, running statistics), on the host."""
    obs_space = env_spaces(args.env_id, args.env_options)[0]
    agent = make_network(args)

    def linear_schedule(count):
        # anneal over all optimizer steps: updates x epochs x minibatches (as CleanRL's ppo_continuous_action)
        frac = 1.0 - (count // (args.num_minibatches * args.update_epochs)) / args.num_updates
        return args.learning_rate * frac

    # a tiny initial count as in baselines' RunningMeanStd: the first rollout replaces the initial mean 0, var 1
    obs_rms = RunningMeanStd(np.zeros(obs_space.shape), np.ones(obs_space.shape), 1e-4)
    return_rms = RunningMeanStd(0.0, 1.0, 1e-4)
    return agent, AgentState.create(
        apply_fn=None,
        params=agent.init(key, np.zeros((1, *obs_space.shape), np.float32)),
        tx=optax.chain(
            optax.clip_by_global_norm(args.max_grad_norm),
            optax.inject_hyperparams(optax.adam)(
                learning_rate=linear_schedule if args.anneal_lr else args.learning_rate, eps=1e-5
            ),
        ),
        obs_rms=jax.tree.map(np.float32, obs_rms),
        return_rms=jax.tree.map(np.float32, return_rms),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1.
    `obs` are the network's inputs, normalized with the statistics of the params version that acted (so the
    learner's probability ratios compare like with like); `raw_obs` and the raw rewards update the statistics."""

    obs: np.ndarray
    raw_obs: np.ndarray
    actions: np.ndarray  # the unclipped Gaussian samples, (time, envs, action_dim)
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    discounted_returns: np.ndarray  # per env, reset at episode ends: their std scales the rewards
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray  # False for envpool's reset step after an episode end: its action is ignored
    bootstrap_value: np.ndarray  # (1, envs): V(obs after the last step)


class Batch(NamedTuple):
    """The learner's samples: a rollout with advantages and returns, flattened over (time, envs)."""

    obs: jax.Array  # normalized, as the actor's network saw them
    actions: jax.Array
    logprobs: jax.Array
    values: jax.Array
    advantages: jax.Array
    returns: jax.Array
    valid: jax.Array


class AgentState(TrainState):
    """Params, optimizer state and the running statistics: all checkpointed, so a resumed run normalizes as before."""

    obs_rms: RunningMeanStd
    return_rms: RunningMeanStd


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


def prepare_batch(agent_state: AgentState, storage: Rollout, *, gamma: float, gae_lambda: float):
    """A learner device's envs of the rollout as samples, inside `shard_map` over the mesh axis "batch": the running
    statistics updated with the rollout of every learner device (the same on each), rewards scaled with them (as
    gym's NormalizeReward), advantages and returns, then (time, envs) flattened. Returns (agent_state, Batch)."""
    flat = lambda x: x.reshape((-1, *x.shape[2:]))
    obs_rms = merge_running_stats(
        agent_state.obs_rms, batch_running_stats(flat(storage.raw_obs), jnp.ones(storage.valid.size), "batch")
    )
    # the envs' reset steps are not steps of an episode: their (zero) returns do not count
    return_rms = merge_running_stats(
        agent_state.return_rms, batch_running_stats(flat(storage.discounted_returns), flat(storage.valid), "batch")
    )
    agent_state = agent_state.replace(obs_rms=obs_rms, return_rms=return_rms)
    advantages, returns = compute_gae(
        rewards=scale_rewards(return_rms, storage.rewards),
        values=storage.values,
        bootstrap_value=storage.bootstrap_value[0],
        terminations=storage.terminations,
        truncations=storage.truncations,
        gamma=gamma,
        gae_lambda=gae_lambda,
    )
    fields = storage.obs, storage.actions, storage.logprobs, storage.values, advantages, returns, storage.valid
    return agent_state, Batch(*map(flat, fields))


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


def gaussian_logprob_entropy(action_mean, action_logstd, actions):
    """Diagonal Gaussian: log-density of `actions` and entropy, summed over the (independent) action dimensions."""
    action_logstd = jnp.broadcast_to(action_logstd, action_mean.shape)
    z = (actions - action_mean) * jnp.exp(-action_logstd)
    logprob = -0.5 * z**2 - action_logstd - 0.5 * jnp.log(2 * jnp.pi)
    entropy = action_logstd + 0.5 * (1.0 + jnp.log(2 * jnp.pi))
    return logprob.sum(-1), entropy.sum(-1)


def ppo_loss(params, minibatch: Batch, *, agent: Agent, args: Args):
    """A learner device's part of the PPO loss of the global minibatch (each term a sum over its valid samples divided
    by the whole minibatch's count: the parts add up to the loss); inside `shard_map` over the mesh axis "batch".
    Returns (loss, (policy_loss, value_loss, entropy, approx_kl))."""
    action_mean, action_logstd, new_values = agent.apply(params, minibatch.obs)
    new_logprobs, entropy = gaussian_logprob_entropy(action_mean, action_logstd, minibatch.actions)
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
        # each params version comes with the observation statistics of its time
        agent_params, obs_rms = params
        obs = normalize_obs(obs_rms, obs)
        action_mean, action_logstd, value = agent.apply(agent_params, obs)
        key, subkey = jax.random.split(key)
        action = action_mean + jnp.exp(action_logstd) * jax.random.normal(subkey, action_mean.shape)
        logprob, _ = gaussian_logprob_entropy(action_mean, action_logstd, action)
        # one array: one device-to-host copy per env step instead of four
        return jnp.concatenate([action, logprob[:, None], value[:, None], obs], axis=1), key

    @jax.jit
    def value(params, obs):
        agent_params, obs_rms = params
        return agent.apply(agent_params, normalize_obs(obs_rms, obs))[2]

    return ActorFns(act, value)


def actor_params(agent_state: AgentState):
    """What the actors act with: the params and the observation statistics of the same version."""
    return agent_state.params, agent_state.obs_rms


def actor_loop(*, args: Args, thread: ActorThread, key, make_envs, actor_fns: ActorFns, params_queue, rollout_queue):
    """An actor thread's life: steps its envpool (`make_envs(seed, num_threads)`), acts on its actor device with
    `key`, ships one rollout per update to the learner."""
    num_envs, num_steps = args.local_num_envs, args.num_steps
    env_seed = thread.env_seed(args.seed, num_envs)
    envs = make_envs(env_seed, num_threads=thread.envpool_threads)
    key, obs_space = thread.key(key), envs.observation_space
    action_space, action_dim = envs.action_space, envs.action_space.shape[0]
    # --stagger-episodes: each env first takes its own number of random steps (cleanrl_utils/envs.py), so that
    # episodes of a fixed length do not all start and end in the same rollout; those first episodes are not counted
    first_env = thread.global_index * num_envs  # among the run's envs
    next_obs, warm_up_steps = reset_out_of_phase(envs, args, first_env=first_env, seed=env_seed)
    next_obs = next_obs.astype(np.float32)  # envpool's MuJoCo observations are float64
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    # of each env so far: its std scales the rewards
    discounted_return = np.zeros(num_envs, dtype=np.float32)
    episodes, timer = EpisodeStats(num_envs, begun_before=warm_up_steps > 0), StageTimer()
    for update in range(thread.start_update + 1, args.num_updates + 1):
        with timer("params_queue_get_time"):
            # skipping the second get makes the actor exactly one policy version behind the learner
            if update != thread.start_update + 2 or not args.concurrency:
                params, actor_policy_version = thread.get(params_queue)
        with timer("rollout_time"):
            obs, raw_obs = (np.empty((num_steps, num_envs, *obs_space.shape), dtype=np.float32) for _ in range(2))
            actions = np.empty((num_steps, num_envs, *action_space.shape), dtype=np.float32)
            logprobs, values, rewards, discounted_returns, terminations, truncations = (
                np.empty((num_steps, num_envs), dtype=np.float32) for _ in range(6)
            )
            valid = np.empty((num_steps, num_envs), dtype=bool)
            for step in range(num_steps):
                thread.check_stopped()
                with timer("inference_time"):
                    step_outputs, key = actor_fns.act(params, next_obs, key)
                    action, logprob, value, normalized_obs = np.split(
                        np.asarray(step_outputs), [action_dim, action_dim + 1, action_dim + 2], axis=1
                    )
                with timer("env_step_time"):
                    # the env gets the action clipped to its bounds; the loss keeps the sample (its log-prob is exact)
                    clipped_action = np.clip(action, action_space.low, action_space.high)
                    step_obs, reward, terminated, truncated, info = envs.step(clipped_action)
                with timer("storage_time"):
                    obs[step], raw_obs[step], actions[step] = normalized_obs, next_obs, action
                    logprobs[step], values[step] = logprob[:, 0], value[:, 0]
                    rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
                    valid[step] = ~previous_episode_end
                    episodes.step(reward, terminated, truncated, info, counted=valid[step])
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs.astype(np.float32)
                    discounted_returns[step] = discounted_return = discounted_return * args.gamma + reward
                    discounted_return *= ~previous_episode_end
            with timer("inference_time"):
                bootstrap_value = np.asarray(actor_fns.value(params, next_obs))[None]
        fields = obs, raw_obs, actions, logprobs, values, rewards, discounted_returns, terminations, truncations
        storage = Rollout(*fields, valid, bootstrap_value)
        # one host-to-device copy per learner device
        storage = split_for_learners(storage, thread.learner_devices)
        with timer("rollout_queue_put_time"):  # logged with the next rollout
            thread.put(rollout_queue, (storage, actor_policy_version, {**timer.read(), **episodes.read()}))


# ---------------------------------------------------------------- learner


class LearnerState(NamedTuple):
    """What the learner carries from update to update, and what a checkpoint holds."""

    agent: AgentState  # params, optimizer state and running statistics, replicated
    key: jax.Array  # the learner's PRNG key (minibatch shuffles), the same in every process


def make_learner_update(args: Args, agent: Agent, mesh: Mesh) -> Callable:
    """The data-parallel learner (`shard_map` over the mesh axis "batch"): epochs x minibatches are a Python loop over
    one compiled minibatch step, as fast on an H100 as one `lax.scan` per update (docs/performance.md#on-a-gpu)."""
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
    batch_of = shard_map(batch_of, in_specs=(replicated, rollout_specs), out_specs=(replicated, batch_specs))
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
        agent_state, batch = batch_of(agent_state, storage)
        metrics = []
        for _ in range(args.update_epochs):
            key, shuffle_key = jax.random.split(key)
            permutation = shuffle(shuffle_key)
            for index in range(args.num_minibatches):
                agent_state, minibatch_metrics = minibatch_update(agent_state, batch, permutation, jnp.int32(index))
                metrics.append(minibatch_metrics)
        metrics = dict(zip(names, jax.tree.map(lambda *x: jnp.stack(x).mean(), *metrics)))
        metrics["charts/learning_rate"] = agent_state.opt_state[1].hyperparams["learning_rate"]
        return LearnerState(agent_state, key), metrics

    return update


# ---------------------------------------------------------------- evaluation: what --save-model saves, and its policy
# (what the evaluator and the tools call in this script: cleanrl_utils/script_contract.py)


def saved_model(state: LearnerState) -> dict:
    """What --save-model writes next to the flags: what `make_eval_policy` reads."""
    return {
        "params": to_state_dict(local_value(state.agent.params)),
        "obs_rms": local_value(state.agent.obs_rms)._asdict(),  # the policy's input normalization
    }


def make_eval_policy(args: Args, model: dict, greedy: bool):
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: the model's frozen observation
    statistics, then the Gaussian mean (greedy) or a sample, clipped to the action bounds."""
    action_space = env_spaces(args.env_id, args.env_options)[1]
    agent = make_network(args)
    obs_rms = RunningMeanStd(*(jnp.asarray(model["obs_rms"][name], jnp.float32) for name in RunningMeanStd._fields))
    params = jax.tree.map(jnp.asarray, model["params"]), obs_rms

    @jax.jit
    def act(params, obs, key):
        agent_params, obs_rms = params
        action_mean, action_logstd, _ = agent.apply(agent_params, normalize_obs(obs_rms, obs))
        key, subkey = jax.random.split(key)
        noise = jnp.exp(action_logstd) * jax.random.normal(subkey, action_mean.shape)
        action = action_mean if greedy else action_mean + noise
        return jnp.clip(action, action_space.low, action_space.high), key

    def policy(obs: np.ndarray, key: jax.Array):
        actions, key = act(params, np.asarray(obs, np.float32), key)
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
    return (
        f"params sha256={tree_digest(state.agent.params)} "
        f"stats sha256={tree_digest((state.agent.obs_rms, state.agent.return_rms))}"
    )


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
