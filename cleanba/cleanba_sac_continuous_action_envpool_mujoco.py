"""Sebulba SAC (Haarnoja et al. 2018, "Soft actor-critic algorithms and applications") for envpool continuous control,
with the replay buffer on the learner devices, sharded along the env axis.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (squashed Gaussian, soft
Bellman target, losses), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is
the same for every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) is imported from
cleanrl_utils/, one small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their
own envpool and run jitted inference on their actor device. Each thread hands its rollout to the
learner through its own size-1 `rollout_queue`, already split along the env axis and placed on the
learner devices; the learner answers through a size-1 `params_queue` per thread. Because the actor
skips one `params_queue.get()` (its second rollout), it always acts with the policy one version
behind the learner (`--no-concurrency` removes the skip: lag 0, no overlap). The learner is
data-parallel over the learner devices of every process (`jax.jit` + `shard_map` over a 1-D mesh,
gradients summed with `psum`), so `--distributed` (jax.distributed) scales it across hosts.

Off-policy: the replay buffer (flashbax's flat buffer) lives in learner-device memory, sharded along the env
axis: each learner device appends the rollout of its share of the envs to its own shard, samples its own part of
every minibatch from it, and the gradients are summed with `psum`, so the buffer grows with the learner devices
and hosts. `--replay-ratio` fixes the gradient steps per env step: with the one-version lag a seed gives the
same run whatever the speed of actors and learner. Observations are not normalized (as in the SAC paper).
"""

import os
import queue
import random
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, NamedTuple, Sequence

import flashbax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.serialization import to_state_dict
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.checkpoints import Checkpoints, tree_digest
from cleanrl_utils.devices import (DeviceLayout, check_replay_fits, copies_for_devices, device_layout,
                                   envpool_num_threads, local_value, replicate, shutdown)
from cleanrl_utils.divergence import Diverged, all_finite, copy_state
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool
from cleanrl_utils.evals.evaluate import check_save_model_flags, save_evaluate_upload
from cleanrl_utils.flags import RunSetting, UsageError, check_flags, check_int32_counts, check_run_flags, run_cli
from cleanrl_utils.logger import RunLogger
from cleanrl_utils.preemption import Preemption
from cleanrl_utils.queues import ActorThreads, RunStopped, queue_get, queue_put
from cleanrl_utils.run_folder import RunFolder

warnings.filterwarnings("ignore", message=".*precision lowered by casting to float32")  # envpool's Box spaces


@dataclass
class Args:
    # RunSetting[...]: where and how the run runs, not what it computes; a resumed run may change these flags
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (in [0, 2**32 - 1])"""
    run_name: str | None = None
    """the run's folder under runs/ (default: {env_id}__{exp_name}__{seed}__{unix time})"""
    track: RunSetting[bool] = False
    """if toggled, this experiment will be tracked with Weights and Biases"""
    wandb_project_name: RunSetting[str] = "cleanba"
    """the wandb's project name"""
    wandb_entity: RunSetting[str | None] = None
    """the entity (team) of wandb's project"""
    save_model: RunSetting[bool] = False
    """whether to save the model (args + params) into runs/{run_name}/{exp_name}.cleanrl_model, then evaluate it"""
    eval_episodes: RunSetting[int] = 10
    """with --save-model: episodes of the evaluation of the saved model (TensorBoard: eval/episodic_return) (positive)"""
    eval_greedy: RunSetting[bool] = False
    """with --save-model: evaluate with the most likely action instead of sampling it"""
    capture_video: RunSetting[bool] = False
    """with --save-model: record the evaluation episodes of env 0 as MP4 files into videos/{run_name}/"""
    upload_model: RunSetting[bool] = False
    """with --save-model: upload the model, its card, this script and a video to the Hugging Face Hub"""
    hf_entity: RunSetting[str | None] = None
    """the Hub user or organization of the repo {hf_entity}/{env_id}-{exp_name}-seed{seed} (default: the token's user)"""
    log_frequency: RunSetting[int] = 10
    """print a console line every this many updates (TensorBoard gets every update) (positive)"""
    checkpoint_frequency: RunSetting[int] = 100
    """save the training state every this many updates (0: only at the end and on SIGTERM/SIGINT; non-negative)"""
    checkpoint_keep: RunSetting[int] = 3
    """how many of the newest checkpoints to keep (positive)"""
    checkpoint_dir: RunSetting[str | None] = None
    """the checkpoints' folder (default: runs/{run_name}/checkpoints); with --distributed, one folder that every
    process sees (a shared file system): checked at start"""
    resume: RunSetting[bool] = False
    """continue --run-name from its newest checkpoint (re-running a --run-name that has checkpoints resumes too)"""

    # Algorithm specific arguments
    env_id: str = "HalfCheetah-v4"
    """the id of an envpool env with continuous actions: gym MuJoCo (HalfCheetah-v4, Hopper-v4, ...), DeepMind
    Control (CheetahRun-v1, WalkerWalk-v1, ...: dict observations flattened by make_env) or Pendulum-v1"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    frame_skip=2 or max_episode_steps=500 (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes; CleanRL: 1M) (positive)"""
    buffer_size: int = 1_000_000
    """the replay buffer's capacity in transitions, over all learner devices (CleanRL's sac_continuous_action: 1e6,
    SAC paper Table 1: 1e6) (positive, at least --minibatch-size)"""
    minibatch_size: int = 256
    """the transitions of each gradient step, over all learner devices (SAC paper Table 1, CleanRL: 256) (positive)"""
    replay_ratio: float = 1.0
    """gradient steps per env step (SAC paper Table 1 and CleanRL: 1 gradient step per env step) (positive, finite)"""
    learning_starts: int = 5000
    """env steps of uniformly random actions before learning starts (CleanRL: 5e3) (non-negative)"""
    policy_lr: float = 3e-4
    """the learning rate of the policy and of the entropy temperature (SAC paper Table 1, CleanRL: 3e-4) (positive, finite)"""
    q_lr: float = 1e-3
    """the learning rate of the Q networks (CleanRL's sac_continuous_action: 1e-3) (positive, finite)"""
    local_num_envs: int = 4
    """the number of parallel game environments of each actor thread (positive)"""
    num_actor_threads: int = 2
    """the number of actor threads on each actor device (positive)"""
    envpool_threads: RunSetting[int] = 0
    """threads stepping each actor thread's envs (0: this process's cores but one, shared by its actor threads; in [0, this machine's cores])"""
    num_steps: int = 32
    """the number of steps of each rollout: 2 threads x 4 envs x 32 steps = 256 env steps per learner update (positive)"""
    gamma: float = 0.99
    """the discount factor gamma (SAC paper Table 1, CleanRL: 0.99) (in [0, 1])"""
    tau: float = 0.005
    """the target networks' Polyak averaging coefficient, every gradient step (SAC paper Table 1, CleanRL: 0.005) (in [0, 1])"""
    autotune: bool = True
    """automatic entropy tuning towards the target entropy -|A| (SAC applications paper Sec. 5; CleanRL: on)"""
    alpha: float = 0.2
    """the entropy temperature without --autotune (CleanRL: 0.2); with it, the start is 1 (log alpha 0, as CleanRL) (non-negative, finite)"""
    hiddens: list[int] = field(default_factory=lambda: [256, 256])
    """the hidden layers of the policy and of each Q MLP (SAC paper Table 1, CleanRL: two ReLU layers of 256;
    positive integers)"""

    # Sebulba: devices, threads, processes
    actor_device_ids: RunSetting[list[int]] = field(default_factory=lambda: [0])
    """the local device ids that actor threads run inference on (distinct, in [0, 63])"""
    learner_device_ids: RunSetting[list[int]] = field(default_factory=lambda: [0])
    """the local device ids the data-parallel learner runs on (in every process) (distinct, in [0, 63])"""
    concurrency: bool = True
    """actor acts one policy version behind while the learner learns; --no-concurrency: lag 0"""
    distributed: RunSetting[bool] = False
    """call jax.distributed.initialize() (SLURM is auto-detected; else use the three flags below)"""
    coordinator_address: RunSetting[str | None] = None
    """with --distributed outside SLURM: host:port of process 0"""
    num_processes: RunSetting[int | None] = None
    """with --distributed outside SLURM: the number of processes (in [1, 65536])"""
    process_id: RunSetting[int | None] = None
    """with --distributed outside SLURM: the id of this process, in [0, num_processes)"""
    heartbeat_timeout: RunSetting[int] = 30
    """with --distributed: seconds without a heartbeat after which a process counts as dead, and the longest
    wait for every process to start (in [1, 86400])"""
    queue_timeout: RunSetting[float] = 1.0
    """seconds between checks for a stopped run while waiting on a queue (in [0.001, 3600])"""

    # derived by main (set_runtime_values), not flags
    local_batch_size: int = field(init=False, default=0)
    """steps per update collected by this process"""
    batch_size: int = field(init=False, default=0)
    """steps per update over all processes"""
    num_updates: int = field(init=False, default=0)
    """the number of learner updates"""
    gradient_steps: int = field(init=False, default=0)
    """gradient steps per learner update: --replay-ratio x batch_size"""
    learning_starts_updates: int = field(init=False, default=0)
    """the updates of random actions: the learner's gradient steps start after them"""
    world_size: int = field(init=False, default=1)
    """the number of processes"""
    local_rank: int = field(init=False, default=0)
    """this process's index"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(args, positive_ints=["local_num_envs", "num_actor_threads", "num_steps", "buffer_size",
                                     "minibatch_size", "total_timesteps"], non_negative_ints=["learning_starts"],
                positive=["policy_lr", "q_lr", "replay_ratio"], non_negative=["alpha"],
                unit_interval=["gamma", "tau"], positive_int_lists=["hiddens"])
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=False, env_options=args.env_options)
    if args.local_num_envs % len(args.learner_device_ids) != 0:
        raise UsageError(f"--local-num-envs ({args.local_num_envs}) must be divisible by the number of "
                         f"--learner-device-ids ({len(args.learner_device_ids)}): each actor thread splits its envs over them")
    if args.buffer_size < args.minibatch_size:
        raise UsageError(f"--buffer-size ({args.buffer_size}) must be at least --minibatch-size ({args.minibatch_size})")
    check_save_model_flags(args, __file__)  # --capture-video, --upload-model: checked before training


# ---------------------------------------------------------------- environments

def make_env(env_id: str, seed: int, num_envs: int, render_mode: str | None = None, num_threads: int = 0,
             env_options: Sequence[str] = ()):
    """envpool's task with its family's cited options, dict observations (dm_control) flattened in a fixed key
    order (cleanrl_utils/envs.py); not normalized (as in the SAC paper)."""
    return make_envpool(env_id, seed, num_envs, render_mode=render_mode, num_threads=num_threads,
                        overrides=env_options)


# ---------------------------------------------------------------- networks


class MLP(nn.Module):
    """ReLU MLP (SAC paper Table 1; CleanRL's sac_continuous_action), flax's default init."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, x):
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden)(x))
        return x


# log-std bounds of CleanRL's sac_continuous_action (from SpinningUp / the SAC reference code): squashed with tanh
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class Actor(nn.Module):
    """The Gaussian policy before the tanh: mean and log-std of each action dimension."""

    action_dim: int
    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, obs):
        hidden = MLP(self.hiddens)(obs)
        mean = nn.Dense(self.action_dim)(hidden)
        log_std = jnp.tanh(nn.Dense(self.action_dim)(hidden))
        return mean, LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (log_std + 1)


class TwinQ(nn.Module):
    """Two independent Q networks on (obs, action in [-1, 1]) (clipped double Q, Fujimoto et al. 2018, as in SAC)."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, obs, action):
        x = jnp.concatenate([obs, action], axis=-1)
        return tuple(nn.Dense(1)(MLP(self.hiddens)(x)).squeeze(-1) for _ in range(2))


class Agent(NamedTuple):
    actor: Actor
    critic: TwinQ


class AgentState(struct.PyTreeNode):
    """Everything the learner trains: policy, twin Q and its target copy, and the log entropy temperature."""

    actor: TrainState
    critic: TrainState
    target_critic_params: dict
    log_alpha: TrainState


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, AgentState]:
    """The networks for --env-id and their training state (params, Adam states, targets), on the host."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    action_dim = int(np.prod(action_space.shape))
    agent = Agent(Actor(action_dim, tuple(args.hiddens)), TwinQ(tuple(args.hiddens)))
    obs, action = np.zeros((1, *obs_space.shape), np.float32), np.zeros((1, action_dim), np.float32)
    actor_key, critic_key = jax.random.split(key)
    critic_params = agent.critic.init(critic_key, obs, action)
    return agent, AgentState(
        actor=TrainState.create(apply_fn=None, params=agent.actor.init(actor_key, obs), tx=optax.adam(args.policy_lr)),
        critic=TrainState.create(apply_fn=None, params=critic_params, tx=optax.adam(args.q_lr)),
        target_critic_params=jax.tree.map(np.copy, critic_params),
        log_alpha=TrainState.create(apply_fn=None, params={"log_alpha": jnp.log(jnp.float32(1.0 if args.autotune else args.alpha))},
                                    tx=optax.adam(args.policy_lr)),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1.
    Row t holds the observation the action was taken in; the next observation is row t+1's (the replay pairs
    consecutive rows). envpool returns an episode's true last observation with its end flag and resets on the next
    step: that reset step's row is not `valid` (its transition, last observation -> first, is never learned)."""

    obs: np.ndarray
    actions: np.ndarray  # in [-1, 1] (the tanh output); the env got them scaled to its bounds
    rewards: np.ndarray
    terminations: np.ndarray
    valid: np.ndarray


def squashed_gaussian_sample(mean, log_std, noise):
    """a = tanh(u), u = mean + std * noise, and log pi(a) by the change of variables (SAC paper Appendix C):
    log N(u) - sum log(1 - tanh(u)^2), with log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)): exact, no epsilon."""
    u = mean + jnp.exp(log_std) * noise
    gaussian_logprob = -0.5 * noise**2 - log_std - 0.5 * jnp.log(2 * jnp.pi)
    log_det_jacobian = 2.0 * (jnp.log(2.0) - u - jax.nn.softplus(-2.0 * u))
    return jnp.tanh(u), (gaussian_logprob - log_det_jacobian).sum(-1)


def scale_actions(actions, low, high):
    """From the policy's [-1, 1] to the env's bounds."""
    return low + 0.5 * (actions + 1.0) * (high - low)


def soft_bellman_target(*, rewards, terminations, next_q1, next_q2, next_logprobs, alpha, gamma):
    """y = r + gamma (1 - termination) (min(Q1', Q2') - alpha log pi(a'|s')) (SAC paper Eqs. 2-3, clipped double Q).
    A truncation is not a termination: the stored next observation is the true last one, so it bootstraps."""
    soft_value = jnp.minimum(next_q1, next_q2) - alpha * next_logprobs
    return rewards + gamma * (1.0 - terminations) * soft_value


def masked_mean(x, weights, normalizer):
    return (x * weights).sum() / normalizer


def sac_losses(actor_params, critic_params, log_alpha, *, agent: Agent, batch: Rollout, next_obs, target_critic_params,
               noise, next_noise, weights, normalizer, gamma, target_entropy, autotune):
    """The three SAC losses of one minibatch, each a weighted sum / normalizer (the global count of valid samples):
    (critic, actor, temperature). Each loss sees the other parameters as constants (stop_gradient)."""
    sg = jax.lax.stop_gradient
    alpha = jnp.exp(sg(log_alpha))
    next_actions, next_logprobs = squashed_gaussian_sample(*agent.actor.apply(sg(actor_params), next_obs), next_noise)
    next_q1, next_q2 = agent.critic.apply(target_critic_params, next_obs, next_actions)
    targets = sg(soft_bellman_target(rewards=batch.rewards, terminations=batch.terminations, next_q1=next_q1,
                                     next_q2=next_q2, next_logprobs=next_logprobs, alpha=alpha, gamma=gamma))
    q1, q2 = agent.critic.apply(critic_params, batch.obs, batch.actions)
    critic_loss = masked_mean((q1 - targets) ** 2 + (q2 - targets) ** 2, weights, normalizer)  # as CleanRL
    actions, logprobs = squashed_gaussian_sample(*agent.actor.apply(actor_params, batch.obs), noise)
    pi_q1, pi_q2 = agent.critic.apply(sg(critic_params), batch.obs, actions)
    actor_loss = masked_mean(alpha * logprobs - jnp.minimum(pi_q1, pi_q2), weights, normalizer)  # paper Eq. 7
    # paper Eq. 18: J(alpha) = E[-alpha (log pi + target entropy)]: alpha grows while the entropy is below target
    alpha_loss = masked_mean(-jnp.exp(log_alpha) * (sg(logprobs) + target_entropy), weights, normalizer) * autotune
    metrics = {"losses/qf_loss": critic_loss, "losses/actor_loss": actor_loss, "losses/alpha_loss": alpha_loss,
               "losses/qf1_values": masked_mean(q1, weights, normalizer),
               "losses/entropy": masked_mean(-sg(logprobs), weights, normalizer)}
    return critic_loss + actor_loss + alpha_loss, metrics


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> V(obs) for the rollout's bootstrap; None where the learner values it


def make_actor_fns(agent: Agent) -> ActorFns:
    @partial(jax.jit, static_argnames="explore")
    def act(params, obs, key, explore: bool = False):
        """A policy sample in [-1, 1]; with `explore` (the first --learning-starts steps) a uniform one."""
        key, subkey = jax.random.split(key)
        mean, log_std = agent.actor.apply(params, obs)
        if explore:
            return jax.random.uniform(subkey, mean.shape, minval=-1.0, maxval=1.0), key
        return squashed_gaussian_sample(mean, log_std, jax.random.normal(subkey, mean.shape))[0], key

    return ActorFns(act, None)


def actor_params(agent_state: AgentState):
    """What the actors act with: the policy's params."""
    return agent_state.actor.params


def actor_env_seed(seed: int, start_update: int, global_thread_index: int, local_num_envs: int) -> int:
    """envpool seeds env i of a pool with env_seed + i: give every actor thread of every process its own
    range, starting from a base hashed from --seed (so runs with seeds 1 and 2 do not share envs) and from
    the update the run starts at (a resumed run starts new episodes, not the first ones again)."""
    base = int(np.random.SeedSequence([seed, start_update]).generate_state(1)[0]) % 2**30
    return base + global_thread_index * local_num_envs


def rollout(*, args: Args, thread_index: int, start_update: int, key: jax.Array, make_envs: Callable,
            actor_device: jax.Device, learner_devices: list, params_queue: queue.Queue, rollout_queue: queue.Queue,
            stop_event: threading.Event, actor_fns: ActorFns):
    """The actor thread: steps its envpool, acts on `actor_device`, ships rollouts to the learner."""
    global_thread_index = args.local_rank * len(args.actor_device_ids) * args.num_actor_threads + thread_index
    envs = make_envs(actor_env_seed(args.seed, start_update, global_thread_index, args.local_num_envs))
    key = jax.device_put(jax.random.fold_in(jax.random.fold_in(key, start_update), global_thread_index), actor_device)
    num_envs, num_steps = args.local_num_envs, args.num_steps
    action_space = envs.action_space
    next_obs = envs.reset()[0].astype(np.float32)  # envpool's MuJoCo observations are float64
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    episode_returns = np.zeros(num_envs, dtype=np.float64)
    episode_lengths = np.zeros(num_envs, dtype=np.int64)
    returned_episode_returns = np.full(num_envs, np.nan)
    returned_episode_lengths = np.full(num_envs, np.nan)
    envs_per_learner_device = num_envs // len(learner_devices)
    actor_policy_version = 0
    rollout_queue_put_time = 0.0

    for update in range(start_update + 1, args.num_updates + 1):
        params_queue_get_start = time.time()
        # skipping the second get makes the actor exactly one policy version behind the learner
        if update != start_update + 2 or not args.concurrency:
            params, actor_policy_version = queue_get(params_queue, stop_event, args.queue_timeout)
        params_queue_get_time = time.time() - params_queue_get_start

        rollout_start = time.time()
        inference_time = env_step_time = storage_time = 0.0
        obs = np.empty((num_steps, num_envs, next_obs.shape[1]), dtype=np.float32)
        actions = np.empty((num_steps, num_envs, *action_space.shape), dtype=np.float32)
        rewards = np.empty((num_steps, num_envs), dtype=np.float32)
        terminations = np.empty((num_steps, num_envs), dtype=np.float32)
        valid = np.empty((num_steps, num_envs), dtype=bool)
        for step in range(num_steps):
            if stop_event.is_set():  # another thread failed, or Ctrl-C: do not finish a long rollout
                raise RunStopped
            inference_start = time.time()
            action, key = actor_fns.act(params, next_obs, key, explore=update <= args.learning_starts_updates)
            action = np.asarray(action)
            env_step_start = time.time()
            inference_time += env_step_start - inference_start
            step_obs, reward, terminated, truncated, _ = envs.step(scale_actions(action, action_space.low,
                                                                                 action_space.high))
            storage_start = time.time()
            env_step_time += storage_start - env_step_start
            obs[step], actions[step], rewards[step], terminations[step] = next_obs, action, reward, terminated
            valid[step] = ~previous_episode_end
            episode_returns += reward
            episode_lengths += valid[step]  # envpool's reset step is not a step of the game
            game_over = np.logical_or(terminated, truncated)
            returned_episode_returns = np.where(game_over, episode_returns, returned_episode_returns)
            returned_episode_lengths = np.where(game_over, episode_lengths, returned_episode_lengths)
            episode_returns *= ~game_over
            episode_lengths *= ~game_over
            previous_episode_end = game_over
            next_obs = step_obs.astype(np.float32)
            storage_time += time.time() - storage_start
        rollout_time = time.time() - rollout_start

        storage = Rollout(obs=obs, actions=actions, rewards=rewards, terminations=terminations, valid=valid)
        # one host-to-device transfer per rollout: each learner device gets its slice of the envs
        sharded_storage = [
            jax.device_put(jax.tree.map(lambda x: x[:, i * envs_per_learner_device : (i + 1) * envs_per_learner_device],
                                        storage), device)
            for i, device in enumerate(learner_devices)
        ]
        stats = {
            "params_queue_get_time": params_queue_get_time,
            "rollout_time": rollout_time,
            "inference_time": inference_time,
            "env_step_time": env_step_time,
            "storage_time": storage_time,
            "rollout_queue_put_time": rollout_queue_put_time,  # of the previous rollout
            "returned_episode_returns": returned_episode_returns.copy(),
            "returned_episode_lengths": returned_episode_lengths.copy(),
        }
        rollout_queue_put_start = time.time()
        queue_put(rollout_queue, (sharded_storage, actor_policy_version, stats), stop_event, args.queue_timeout)
        rollout_queue_put_time = time.time() - rollout_queue_put_start


def make_eval_policy(args: Args, model: dict, greedy: bool):
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: the squashed mean (greedy) or
    a squashed sample, scaled to the action bounds."""
    action_space = env_spaces(args.env_id, args.env_options)[1]
    actor = Actor(int(np.prod(action_space.shape)), tuple(args.hiddens))
    params = jax.tree.map(jnp.asarray, model["params"])

    @jax.jit
    def act(params, obs, key):
        mean, log_std = actor.apply(params, obs)
        key, subkey = jax.random.split(key)
        actions = jnp.tanh(mean) if greedy else squashed_gaussian_sample(mean, log_std,
                                                                         jax.random.normal(subkey, mean.shape))[0]
        return scale_actions(actions, action_space.low, action_space.high), key

    def policy(obs, key: jax.Array):
        actions, key = act(params, np.asarray(obs, np.float32), key)
        return np.asarray(actions), key

    return policy


# ---------------------------------------------------------------- learner


class Minibatch(NamedTuple):
    """One gradient step's samples (first axis: samples): transitions, next observations, the policy's noise."""

    transitions: Rollout  # row t of the replay: obs, action, reward, termination, valid
    next_obs: jax.Array  # row t+1's observation
    noise: jax.Array  # standard normal, for pi(.|obs)
    next_noise: jax.Array  # standard normal, for pi(.|next_obs)


class LearnerFns(NamedTuple):
    init_replay: Callable  # () -> the empty replay, sharded along the env axis over the mesh
    update: Callable  # (agent_state, replay, rollout, key, train) -> (agent_state, replay, metrics, key)
    gradient_step: Callable  # (agent_state, minibatch) -> (agent_state, metrics): one step on a given global minibatch


def make_replay_buffer(args: Args, num_learner_devices: int, global_envs: int, local: bool):
    """flashbax's flat buffer (pairs of consecutive rows of each env) of one learner device (`local`: the envs of
    its shard, its share of the capacity and of each minibatch) or of the whole mesh (to create it)."""
    envs = global_envs // num_learner_devices if local else global_envs
    return flashbax.make_flat_buffer(
        max_length=args.buffer_size // global_envs * envs, min_length=envs, add_sequences=True, add_batch_size=envs,
        sample_batch_size=args.minibatch_size // num_learner_devices if local else args.minibatch_size)


def replay_item(args: Args) -> Rollout:
    """One row of one env as the replay stores it."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    return Rollout(obs=jnp.zeros(obs_space.shape), actions=jnp.zeros(int(np.prod(action_space.shape))),
                   rewards=jnp.float32(0), terminations=jnp.float32(0), valid=jnp.bool_(False))


def make_learner_fns(args: Args, agent: Agent, mesh: Mesh) -> LearnerFns:
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices; each device keeps
    the replay shard of its envs, samples its part of every minibatch, and the gradients are summed with `psum`."""
    replicated, sharded_envs, sharded_samples = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    replay_specs = flashbax.buffers.trajectory_buffer.TrajectoryBufferState(
        experience=Rollout(*([sharded_samples] * len(Rollout._fields))), current_index=replicated, is_full=replicated)
    minibatch_specs = Minibatch(Rollout(*([sharded_samples] * len(Rollout._fields))), *([sharded_samples] * 3))
    num_devices, global_envs = mesh.devices.size, args.batch_size // args.num_steps
    local_buffer = make_replay_buffer(args, num_devices, global_envs, local=True)
    action_dim = agent.actor.action_dim

    def init_replay():
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), replay_specs)
        return jax.jit(make_replay_buffer(args, num_devices, global_envs, local=False).init,
                       out_shardings=shardings)(replay_item(args))

    def local_gradient_step(agent_state: AgentState, minibatch: Minibatch):
        """One SAC step (paper Algorithm 1: the three losses on one minibatch, then the Polyak target update)."""
        weights = minibatch.transitions.valid.astype(jnp.float32)  # never learn envpool's reset step
        normalizer = jnp.maximum(jax.lax.psum(weights.sum(), "batch"), 1.0)
        # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
        # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
        local_params = jax.lax.pcast((agent_state.actor.params, agent_state.critic.params,
                                      agent_state.log_alpha.params["log_alpha"]), "batch", to="varying")
        (_, metrics), grads = jax.value_and_grad(sac_losses, argnums=(0, 1, 2), has_aux=True)(
            *local_params, agent=agent, batch=minibatch.transitions, next_obs=minibatch.next_obs,
            target_critic_params=agent_state.target_critic_params, noise=minibatch.noise,
            next_noise=minibatch.next_noise, weights=weights, normalizer=normalizer, gamma=args.gamma,
            target_entropy=-float(action_dim), autotune=args.autotune)  # target entropy -|A|: paper Sec. 5
        (actor_grads, critic_grads, alpha_grads), metrics = jax.lax.psum((grads, metrics), "batch")
        critic = agent_state.critic.apply_gradients(grads=critic_grads)
        agent_state = agent_state.replace(
            actor=agent_state.actor.apply_gradients(grads=actor_grads), critic=critic,
            target_critic_params=optax.incremental_update(critic.params, agent_state.target_critic_params, args.tau),
            log_alpha=agent_state.log_alpha.apply_gradients(grads={"log_alpha": alpha_grads}))
        return agent_state, {**metrics, "losses/alpha": jnp.exp(agent_state.log_alpha.params["log_alpha"])}

    def local_update(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        """Per device: append its envs' rollout to its replay shard, then --replay-ratio x batch gradient steps."""
        replay = local_buffer.add(replay, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), storage))  # (envs, T, ...)
        if not train:
            return agent_state, replay, {}

        def step(agent_state, step_key):
            sample_key, noise_key, next_noise_key = jax.random.split(
                jax.random.fold_in(step_key, jax.lax.axis_index("batch")), 3)
            pairs = local_buffer.sample(replay, sample_key).experience
            shape = pairs.first.actions.shape
            minibatch = Minibatch(pairs.first, pairs.second.obs, jax.random.normal(noise_key, shape),
                                  jax.random.normal(next_noise_key, shape))
            return local_gradient_step(agent_state, minibatch)

        agent_state, metrics = jax.lax.scan(step, agent_state, jax.random.split(key, args.gradient_steps))
        return agent_state, replay, jax.tree.map(jnp.mean, metrics)

    @partial(jax.jit, static_argnames="train", donate_argnums=(0, 1))
    def update_step(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        return jax.shard_map(partial(local_update, train=train), mesh=mesh,
                             in_specs=(replicated, replay_specs, rollout_specs, replicated),
                             out_specs=(replicated, replay_specs, replicated))(agent_state, replay, storage, key)

    def update(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        key, update_key = jax.random.split(key)
        return *update_step(agent_state, replay, storage, update_key, train=train), key

    gradient_step = jax.jit(jax.shard_map(local_gradient_step, mesh=mesh, in_specs=(replicated, minibatch_specs),
                                          out_specs=(replicated, replicated)))
    return LearnerFns(init_replay, update, gradient_step)


@jax.jit
def end_stored_episodes(replay):
    """After a resume the actors start new episodes: the newest stored row of each env has no next observation in
    the replay (the next row will be a new episode's first), so its transition must not be learned."""
    newest = (replay.current_index - 1) % replay.experience.valid.shape[1]
    return replay.replace(experience=replay.experience._replace(valid=replay.experience.valid.at[:, newest].set(False)))


def assemble_global_rollout(per_thread_storages: list, mesh: Mesh, global_envs: int) -> Rollout:
    """Concatenate the actor threads' slices on each local learner device, then view them as one
    global array over the learner devices of all processes (env axis sharded, device-major)."""
    per_device = [  # per_thread_storages[thread][device] -> one Rollout per local learner device
        jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *storages)
        for storages in zip(*per_thread_storages)
    ]

    def to_global(*shards):
        shape = (shards[0].shape[0], global_envs, *shards[0].shape[2:])
        return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P(None, "batch")), list(shards))

    return jax.tree.map(to_global, *per_device)


# ---------------------------------------------------------------- main: the Sebulba protocol


def set_runtime_values(args: Args, layout: DeviceLayout):
    """What main derives from the flags and the device layout (not flags: `--help` does not offer them)."""
    args.world_size, args.local_rank = layout.world_size, layout.local_rank
    args.local_batch_size = args.local_num_envs * args.num_steps * args.num_actor_threads * len(layout.actor_devices)
    args.batch_size = args.local_batch_size * args.world_size
    args.num_updates = args.total_timesteps // args.batch_size
    if args.num_updates < 1:
        raise UsageError(f"--total-timesteps ({args.total_timesteps}) is smaller than one batch ({args.batch_size} = "
                         "--local-num-envs x --num-steps x --num-actor-threads x actor devices x processes)")
    gradient_steps = args.replay_ratio * args.batch_size
    if round(gradient_steps) < 1 or abs(gradient_steps - round(gradient_steps)) > 1e-6:
        raise UsageError(f"--replay-ratio ({args.replay_ratio}) x env steps per update ({args.batch_size}) must be a "
                         "positive whole number of gradient steps")
    args.gradient_steps = round(gradient_steps)
    # the first update's rollout is all a replay holds after it: with one step per rollout, it has no pair yet
    args.learning_starts_updates = max(-(-args.learning_starts // args.batch_size), int(args.num_steps == 1))
    global_envs, num_learner_devices = args.batch_size // args.num_steps, len(layout.global_learner_devices)
    if args.minibatch_size % num_learner_devices != 0:
        raise UsageError(f"--minibatch-size ({args.minibatch_size}) must be divisible by the number of learner devices "
                         f"of all processes ({num_learner_devices}): each samples its share")
    if args.buffer_size // global_envs < max(args.num_steps, 2):
        raise UsageError(f"--buffer-size ({args.buffer_size}) must hold at least --num-steps ({args.num_steps}) "
                         f"steps of each of the {global_envs} envs")
    check_int32_counts(args, {"gradient steps": ("--replay-ratio x env steps per update", args.gradient_steps)})
    check_replay_fits(args.buffer_size, make_replay_buffer(args, num_learner_devices, global_envs, local=True).init,
                      replay_item(args), layout.learner_devices, new_rows=args.num_steps)  # before it is allocated


def state_summary(agent_state: AgentState, replay=None) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states. The replay's digest is
    of the whole replay, whatever its layout, the same in every process (each computes the part it holds)."""
    params = (agent_state.actor.params, agent_state.critic.params, agent_state.target_critic_params,
              agent_state.log_alpha.params)
    optimizer = (agent_state.actor.opt_state, agent_state.critic.opt_state, agent_state.log_alpha.opt_state)
    replay_digest = "" if replay is None else " replay sha256=" + tree_digest(replay)
    return f"params sha256={tree_digest(params)} optimizer sha256={tree_digest(optimizer)}{replay_digest}"


def main(args: Args) -> int:
    validate_args(args)  # bad flags stop here, before JAX starts a backend
    layout = device_layout(args)  # jax.distributed, host devices, the learner mesh over every process
    set_runtime_values(args, layout)
    run_folder = RunFolder(args, is_main_process=layout.is_main_process,  # locked: one live run per folder
                           default_name=f"{args.env_id}__{args.exp_name}__{args.seed}")
    # the agent and learner keys are the same in every process; each actor thread folds its global index into
    # actor_key, so no two threads (or processes) sample with the same key
    random.seed(args.seed)
    np.random.seed(args.seed)
    agent_key, learner_key, actor_key = jax.random.split(jax.random.key(args.seed), 3)
    agent, agent_state = make_agent(args, agent_key)
    learner = make_learner_fns(args, agent, layout.mesh)
    checkpoints = Checkpoints(args, layout.world_size)  # one folder for every process: checked now
    (agent_state, replay, learner_key), start_update = checkpoints.restore(
        (replicate(agent_state, layout.mesh), learner.init_replay(), learner_key), args,
        summary=lambda state: state_summary(*state[:2]))
    replay = end_stored_episodes(replay) if start_update else replay
    logger = RunLogger(args, is_main_process=layout.is_main_process, world_size=layout.world_size,
                       start_update=start_update)

    # Sebulba: each actor thread has a size-1 params queue from the learner and a size-1 rollout queue to it
    stop_event = threading.Event()  # set by whoever stops the run; every queue wait sees it
    preemption = Preemption(layout.world_size, stop_event)  # SIGTERM / Ctrl-C: stop after an update, checkpoint
    actors, actor_fns = ActorThreads(stop_event), make_actor_fns(agent)
    num_envpool_threads = envpool_num_threads(args.envpool_threads, args.num_actor_threads * len(layout.actor_devices))
    params_queues, rollout_queues, queue_devices = [], [], []
    for thread_index in range(len(layout.actor_devices) * args.num_actor_threads):
        actor_device = layout.actor_devices[thread_index // args.num_actor_threads]
        params_queues.append(queue.Queue(maxsize=1))
        rollout_queues.append(queue.Queue(maxsize=1))
        queue_devices.append(actor_device)
        actors.start(rollout, name=f"actor-{thread_index}", args=args, thread_index=thread_index,
                     start_update=start_update, key=actor_key, actor_device=actor_device,
                     make_envs=lambda seed: make_env(args.env_id, seed, args.local_num_envs,
                                                     num_threads=num_envpool_threads, env_options=args.env_options),
                     learner_devices=layout.learner_devices, params_queue=params_queues[-1],
                     rollout_queue=rollout_queues[-1], stop_event=stop_event, actor_fns=actor_fns)

    def broadcast_params(agent_state: AgentState, version: int):
        params_per_device = copies_for_devices(actor_params(agent_state), layout.actor_devices)
        for params_queue, device in zip(params_queues, queue_devices):
            queue_put(params_queue, (params_per_device[device], version), stop_event, args.queue_timeout)

    broadcast_params(agent_state, start_update)
    learner_policy_version = start_update
    with preemption.guard(actors, close=logger.close):
        for update_index in range(start_update + 1, args.num_updates + 1):
            if preemption.requested():
                break
            rollout_queue_get_start = time.time()
            # (storages, actor_policy_version, stats) of every thread; the actor skipped one params get
            per_thread_storages, actor_versions, actor_stats = zip(
                *(queue_get(q, stop_event, args.queue_timeout) for q in rollout_queues))
            assert len(set(actor_versions)) == 1, f"actor threads out of step: versions {actor_versions}"
            rollout_queue_get_time = time.time() - rollout_queue_get_start

            training_start = time.time()
            storage = assemble_global_rollout(per_thread_storages, layout.mesh, args.batch_size // args.num_steps)
            train = update_index > args.learning_starts_updates  # random actions' data only, so far
            last_finite = (copy_state(agent_state), learner_key)  # checkpointed if this update diverges
            agent_state, replay, metrics, learner_key = learner.update(agent_state, replay, storage, learner_key, train)
            metrics = jax.device_get(metrics)  # waits for the update
            training_time = time.time() - training_start
            if not all_finite(metrics, agent_state):  # NaN or inf: stop, never train on or save a wrong model
                # with the replay as it is now (env data, finite: it holds this update's rollout too)
                checkpoints.save(update_index - 1, (last_finite[0], replay, last_finite[1]), args,
                                 state_summary(last_finite[0], replay))
                raise Diverged(update_index, metrics)
            learner_policy_version += 1
            actors.check()
            if update_index < args.num_updates:
                broadcast_params(agent_state, learner_policy_version)

            logger.log_update(update_index, {
                **metrics, "stats/gradient_steps": args.gradient_steps * train,
                "stats/gradient_steps_per_second": args.gradient_steps * train / training_time,
                "stats/actor_policy_version": actor_versions[0],
                "stats/learner_policy_version": learner_policy_version - 1,  # the version the gradient was taken at
                "stats/rollout_queue_get_time": rollout_queue_get_time, "stats/training_time": training_time,
            }, actor_stats)
            if args.checkpoint_frequency and update_index % args.checkpoint_frequency == 0:
                checkpoints.save(update_index, (agent_state, replay, learner_key), args,
                                 state_summary(agent_state, replay))

    preemption.requested()  # once more: a signal that reached any process in the last update counts everywhere
    checkpoints.save(learner_policy_version, (agent_state, replay, learner_key), args, state_summary(agent_state, replay))
    checkpoints.close()
    # every process prints this: equal digests show that all learner replicas hold the same params and statistics
    print(f"process {layout.local_rank}: final {state_summary(agent_state, replay)}", flush=True)
    preemption.report(learner_policy_version, args.run_name)
    upload_succeeded = True
    if args.save_model and layout.is_main_process and not preemption.stop_signal:  # a final, complete model only
        upload_succeeded = save_evaluate_upload(args, __file__, {
            "params": to_state_dict(local_value(agent_state.actor.params)),  # the policy: what evaluation needs
        })
    logger.finish()
    run_folder.release()
    shutdown()  # jax.distributed
    # 143 SIGTERM, 130 Ctrl-C; 1: the model, card and video are on disk (see the error above), the upload is missing
    return preemption.exit_code or (0 if upload_succeeded else 1)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
