"""Sebulba SAC (Haarnoja et al. 2018, "Soft actor-critic algorithms and applications") for envpool continuous control,
with the replay buffer on the learner devices, sharded along the env axis.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (squashed Gaussian, soft Bellman
target, losses), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is the same for
every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) comes from cleanrl_utils/, one
small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their own envpool and run
jitted inference on their actor device. Each thread hands its rollout to the learner through its own size-1
`rollout_queue`, already split along the env axis and placed on the learner devices (cleanrl_utils/data_path.py); the
learner answers through a size-1 `params_queue` per thread. Because the actor skips one `params_queue.get()` (its second
rollout), from update 2 on it acts with the policy one version behind the learner's (update 1's: the initial params,
lag 0; `--no-concurrency`: no skip, lag 0, no overlap). The learner is data-parallel over every process's learner
devices (`jax.jit` + `shard_map` over a 1-D mesh, gradients summed with `psum`), so `--distributed` scales it.

Off-policy: the replay buffer (flashbax's flat buffer) lives in learner-device memory, sharded along the env
axis: each learner device appends the rollout of its share of the envs to its own shard, samples its own part of
every minibatch from it, and the gradients are summed with `psum`, so the buffer grows with the learner devices
and hosts. `--replay-ratio` fixes the gradient steps per env step: with the one-version lag a seed gives the
same run whatever the speed of actors and learner. Observations are not normalized (as in the SAC paper).
"""

import queue
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

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

from cleanrl_utils.actors import ActorThread
from cleanrl_utils.checkpoints import tree_digest
from cleanrl_utils.cli import run_cli
from cleanrl_utils.data_path import assemble_global_rollout, split_for_learners
from cleanrl_utils.devices import DeviceLayout, local_value, replicate
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import SebulbaArgs, check_flags, check_int32_counts, check_run_flags
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
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then SAC's
    env_id: str = "HalfCheetah-v4"
    """the id of an envpool env with continuous actions: gym MuJoCo (HalfCheetah-v4, Hopper-v4, ...), DeepMind
    Control (CheetahRun-v1, WalkerWalk-v1, ...: dict observations flattened by make_env) or Pendulum-v1"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    frame_skip=2 or max_episode_steps=500 (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 1_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes; CleanRL: 1M)
    (in [1, 2**53])"""
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
    """the learning rate of the policy and of the entropy temperature (SAC paper Table 1, CleanRL: 3e-4)
    (positive, finite)"""
    q_lr: float = 1e-3
    """the learning rate of the Q networks (CleanRL's sac_continuous_action: 1e-3) (positive, finite)"""
    local_num_envs: int = 4
    """the number of parallel game environments of each actor thread (positive)"""
    num_steps: int = 32
    """the number of steps of each rollout: 2 threads x 4 envs x 32 steps = 256 env steps per learner update
    (positive)"""
    gamma: float = 0.99
    """the discount factor gamma (SAC paper Table 1, CleanRL: 0.99) (in [0, 1])"""
    tau: float = 0.005
    """the target networks' Polyak averaging coefficient, every gradient step (SAC paper Table 1, CleanRL: 0.005)
    (in [0, 1])"""
    autotune: bool = True
    """automatic entropy tuning towards the target entropy -|A| (SAC applications paper Sec. 5; CleanRL: on)"""
    alpha: float = 0.2
    """the entropy temperature without --autotune (CleanRL: 0.2); with it, the start is 1 (log alpha 0, as CleanRL)
    (non-negative, finite)"""
    hiddens: list[int] = field(default_factory=lambda: [256, 256])
    """the hidden layers of the policy and of each Q MLP (SAC paper Table 1, CleanRL: two ReLU layers of 256;
    positive integers)"""

    # derived when the run starts (set_runtime_values), not flags
    gradient_steps: int = field(init=False, default=0)
    """gradient steps per learner update: --replay-ratio x batch_size"""
    learning_starts_updates: int = field(init=False, default=0)
    """the updates of random actions: the learner's gradient steps start after them"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(
        args,
        positive_ints=["local_num_envs", "num_steps", "buffer_size", "minibatch_size"],
        non_negative_ints=["learning_starts"],
        positive=["policy_lr", "q_lr", "replay_ratio"],
        non_negative=["alpha"],
        unit_interval=["gamma", "tau"],
        positive_int_lists=["hiddens"],
    )
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=False, env_options=args.env_options)
    check_replay_envs_split(args)  # each actor thread splits its envs over the learner devices
    if args.buffer_size < args.minibatch_size:
        raise UsageError(
            f"--buffer-size ({args.buffer_size}) must be at least --minibatch-size ({args.minibatch_size})"
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
    """envpool's task with its family's cited options, dict observations (dm_control) flattened in a fixed key
    order (cleanrl_utils/envs.py); not normalized (as in the SAC paper)."""
    return make_envpool(env_id, seed, num_envs, render_mode=render_mode, num_threads=num_threads, overrides=env_options)


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
        log_alpha=TrainState.create(
            apply_fn=None,
            params={"log_alpha": jnp.log(jnp.float32(1.0 if args.autotune else args.alpha))},
            tx=optax.adam(args.policy_lr),
        ),
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


def sac_losses(
    actor_params,
    critic_params,
    log_alpha,
    *,
    agent: Agent,
    batch: Rollout,
    next_obs,
    target_critic_params,
    noise,
    next_noise,
    weights,
    normalizer,
    gamma,
    target_entropy,
    autotune,
):
    """The three SAC losses of one minibatch, each a weighted sum / normalizer (the global count of valid samples):
    (critic, actor, temperature). Each loss sees the other parameters as constants (stop_gradient)."""
    sg = jax.lax.stop_gradient
    alpha = jnp.exp(sg(log_alpha))
    next_mean, next_log_std = agent.actor.apply(sg(actor_params), next_obs)
    next_actions, next_logprobs = squashed_gaussian_sample(next_mean, next_log_std, next_noise)
    next_q1, next_q2 = agent.critic.apply(target_critic_params, next_obs, next_actions)
    targets = sg(
        soft_bellman_target(
            rewards=batch.rewards,
            terminations=batch.terminations,
            next_q1=next_q1,
            next_q2=next_q2,
            next_logprobs=next_logprobs,
            alpha=alpha,
            gamma=gamma,
        )
    )
    q1, q2 = agent.critic.apply(critic_params, batch.obs, batch.actions)
    # as CleanRL's: the two critics' squared errors summed
    critic_loss = masked_mean((q1 - targets) ** 2 + (q2 - targets) ** 2, weights, normalizer)
    mean, log_std = agent.actor.apply(actor_params, batch.obs)
    actions, logprobs = squashed_gaussian_sample(mean, log_std, noise)
    pi_q1, pi_q2 = agent.critic.apply(sg(critic_params), batch.obs, actions)
    # paper Eq. 7
    actor_loss = masked_mean(alpha * logprobs - jnp.minimum(pi_q1, pi_q2), weights, normalizer)
    # paper Eq. 18: J(alpha) = E[-alpha (log pi + target entropy)]: alpha grows while the entropy is below target
    alpha_loss = masked_mean(-jnp.exp(log_alpha) * (sg(logprobs) + target_entropy), weights, normalizer) * autotune
    metrics = {
        "losses/qf_loss": critic_loss,
        "losses/actor_loss": actor_loss,
        "losses/alpha_loss": alpha_loss,
        "losses/qf1_values": masked_mean(q1, weights, normalizer),
        "losses/entropy": masked_mean(-sg(logprobs), weights, normalizer),
    }
    return critic_loss + actor_loss + alpha_loss, metrics


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> V(obs), the bootstrap's; None: the learner values it


def make_actor_fns(agent: Agent) -> ActorFns:
    @partial(jax.jit, static_argnames="explore")
    def act(params, obs, key, explore: bool = False):
        """A policy sample in [-1, 1]; with `explore` (the first --learning-starts steps) a uniform one."""
        key, subkey = jax.random.split(key)
        mean, log_std = agent.actor.apply(params, obs)
        if explore:
            return jax.random.uniform(subkey, mean.shape, minval=-1.0, maxval=1.0), key
        action, _ = squashed_gaussian_sample(mean, log_std, jax.random.normal(subkey, mean.shape))
        return action, key

    return ActorFns(act, None)


def actor_params(agent_state: AgentState):
    """What the actors act with: the policy's params."""
    return agent_state.actor.params


def actor_loop(*, args: Args, thread: ActorThread, key, make_envs, actor_fns: ActorFns, params_queue, rollout_queue):
    """An actor thread's life: steps its envpool (`make_envs(seed, num_threads)`), acts on its actor device with
    `key`, ships one rollout per update to the learner."""
    num_envs, num_steps = args.local_num_envs, args.num_steps
    env_seed = thread.env_seed(args.seed, num_envs)
    envs = make_envs(env_seed, num_threads=thread.envpool_threads)
    key, action_space = thread.key(key), envs.action_space
    next_obs = envs.reset()[0].astype(np.float32)  # envpool's MuJoCo observations are float64
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    episodes, timer = EpisodeStats(num_envs), StageTimer()
    for update in range(thread.start_update + 1, args.num_updates + 1):
        with timer("params_queue_get_time"):
            # skipping the second get makes the actor exactly one policy version behind the learner
            if update != thread.start_update + 2 or not args.concurrency:
                params, actor_policy_version = thread.get(params_queue)
        with timer("rollout_time"):
            obs = np.empty((num_steps, num_envs, next_obs.shape[1]), dtype=np.float32)
            actions = np.empty((num_steps, num_envs, *action_space.shape), dtype=np.float32)
            rewards, terminations = (np.empty((num_steps, num_envs), dtype=np.float32) for _ in range(2))
            valid = np.empty((num_steps, num_envs), dtype=bool)
            # uniformly random actions until learning starts
            explore = update <= args.learning_starts_updates
            for step in range(num_steps):
                thread.check_stopped()
                with timer("inference_time"):
                    action, key = actor_fns.act(params, next_obs, key, explore=explore)
                    action = np.asarray(action)
                with timer("env_step_time"):
                    step_obs, reward, terminated, truncated, info = envs.step(
                        scale_actions(action, action_space.low, action_space.high)
                    )
                with timer("storage_time"):
                    obs[step], actions[step], rewards[step], terminations[step] = next_obs, action, reward, terminated
                    valid[step] = ~previous_episode_end
                    episodes.step(reward, terminated, truncated, info, counted=valid[step])
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs.astype(np.float32)
        storage = Rollout(obs, actions, rewards, terminations, valid)
        # one host-to-device copy per learner device
        storage = split_for_learners(storage, thread.learner_devices)
        with timer("rollout_queue_put_time"):  # logged with the next rollout
            thread.put(rollout_queue, (storage, actor_policy_version, {**timer.read(), **episodes.read()}))


# ---------------------------------------------------------------- learner


class LearnerState(NamedTuple):
    """What the learner carries from update to update, and what a checkpoint holds."""

    agent: AgentState  # params, targets and optimizer states, replicated over the learner devices
    key: jax.Array  # the learner's PRNG key (minibatches, policy noise), the same in every process
    replay: flashbax.buffers.trajectory_buffer.TrajectoryBufferState  # sharded along the env axis


class Minibatch(NamedTuple):
    """One gradient step's samples (first axis: samples): transitions, next observations, the policy's noise."""

    transitions: Rollout  # row t of the replay: obs, action, reward, termination, valid
    next_obs: jax.Array  # row t+1's observation
    noise: jax.Array  # standard normal, for pi(.|obs)
    next_noise: jax.Array  # standard normal, for pi(.|next_obs)


class LearnerFns(NamedTuple):
    init_replay: Callable  # () -> the empty replay, sharded along the env axis over the mesh
    update: Callable  # (state: LearnerState, rollout, train) -> (state, metrics)
    # (agent_state, minibatch) -> (agent_state, metrics): one step on a given global minibatch
    gradient_step: Callable


def sac_gradient_step(agent_state: AgentState, minibatch: Minibatch, *, agent: Agent, args: Args):
    """One SAC step on a learner device's part of the global minibatch, inside `shard_map` over the mesh axis "batch"
    (paper Algorithm 1: the three losses, gradients summed over the devices, then the Polyak target update)."""
    weights = minibatch.transitions.valid.astype(jnp.float32)  # never learn envpool's reset step
    normalizer = jnp.maximum(jax.lax.psum(weights.sum(), "batch"), 1.0)
    # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
    # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
    local_params = jax.lax.pcast(
        (agent_state.actor.params, agent_state.critic.params, agent_state.log_alpha.params["log_alpha"]),
        "batch",
        to="varying",
    )
    (_, metrics), grads = jax.value_and_grad(sac_losses, argnums=(0, 1, 2), has_aux=True)(
        *local_params,
        agent=agent,
        batch=minibatch.transitions,
        next_obs=minibatch.next_obs,
        target_critic_params=agent_state.target_critic_params,
        noise=minibatch.noise,
        next_noise=minibatch.next_noise,
        weights=weights,
        normalizer=normalizer,
        gamma=args.gamma,
        target_entropy=-float(agent.actor.action_dim),
        autotune=args.autotune,
    )  # target entropy -|A|: paper Sec. 5
    (actor_grads, critic_grads, alpha_grads), metrics = jax.lax.psum((grads, metrics), "batch")
    critic = agent_state.critic.apply_gradients(grads=critic_grads)
    agent_state = agent_state.replace(
        actor=agent_state.actor.apply_gradients(grads=actor_grads),
        critic=critic,
        target_critic_params=optax.incremental_update(critic.params, agent_state.target_critic_params, args.tau),
        log_alpha=agent_state.log_alpha.apply_gradients(grads={"log_alpha": alpha_grads}),
    )
    return agent_state, {**metrics, "losses/alpha": jnp.exp(agent_state.log_alpha.params["log_alpha"])}


def make_replay_buffer(args: Args, num_learner_devices: int, global_envs: int, local: bool):
    """flashbax's flat buffer (pairs of consecutive rows of each env) of one learner device (`local`: the envs of
    its shard, its share of the capacity and of each minibatch) or of the whole mesh (to create it)."""
    envs = global_envs // num_learner_devices if local else global_envs
    sample_batch_size = args.minibatch_size // num_learner_devices if local else args.minibatch_size
    return flashbax.make_flat_buffer(
        max_length=args.buffer_size // global_envs * envs,
        min_length=envs,
        add_sequences=True,
        add_batch_size=envs,
        sample_batch_size=sample_batch_size,
    )


def replay_item(args: Args) -> Rollout:
    """One row of one env as the replay stores it."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    return Rollout(
        obs=jnp.zeros(obs_space.shape),
        actions=jnp.zeros(int(np.prod(action_space.shape))),
        rewards=jnp.float32(0),
        terminations=jnp.float32(0),
        valid=jnp.bool_(False),
    )


def make_learner_fns(args: Args, agent: Agent, mesh: Mesh) -> LearnerFns:
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices; each device keeps
    the replay shard of its envs, samples its part of every minibatch, and the gradients are summed with `psum`."""
    replicated, sharded_envs, sharded_samples = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    sample_specs = Rollout(*([sharded_samples] * len(Rollout._fields)))
    replay_specs = flashbax.buffers.trajectory_buffer.TrajectoryBufferState(
        experience=sample_specs, current_index=replicated, is_full=replicated
    )
    minibatch_specs = Minibatch(sample_specs, *([sharded_samples] * 3))
    num_devices, global_envs = mesh.devices.size, args.global_num_envs
    local_buffer = make_replay_buffer(args, num_devices, global_envs, local=True)
    local_gradient_step = partial(sac_gradient_step, agent=agent, args=args)

    def init_replay():
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), replay_specs)
        global_buffer = make_replay_buffer(args, num_devices, global_envs, local=False)
        return jax.jit(global_buffer.init, out_shardings=shardings)(replay_item(args))

    def local_update(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        """Per device: append its envs' rollout to its replay shard, then --replay-ratio x batch gradient steps."""
        env_major = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), storage)  # (envs, T, ...)
        replay = local_buffer.add(replay, env_major)
        if not train:
            return agent_state, replay, {}

        def step(agent_state, step_key):
            device_key = jax.random.fold_in(step_key, jax.lax.axis_index("batch"))
            sample_key, noise_key, next_noise_key = jax.random.split(device_key, 3)
            pairs = local_buffer.sample(replay, sample_key).experience
            noise = (jax.random.normal(k, pairs.first.actions.shape) for k in (noise_key, next_noise_key))
            return local_gradient_step(agent_state, Minibatch(pairs.first, pairs.second.obs, *noise))

        agent_state, metrics = jax.lax.scan(step, agent_state, jax.random.split(key, args.gradient_steps))
        return agent_state, replay, jax.tree.map(jnp.mean, metrics)

    @partial(jax.jit, static_argnames="train", donate_argnums=(0, 1))
    def update_step(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        return jax.shard_map(
            partial(local_update, train=train),
            mesh=mesh,
            in_specs=(replicated, replay_specs, rollout_specs, replicated),
            out_specs=(replicated, replay_specs, replicated),
        )(agent_state, replay, storage, key)

    # its first call stops the run with one line if it cannot fit the devices' free memory (cleanrl_utils/memory.py)
    update_step = checked_for_memory(update_step, "lower --minibatch-size")

    def update(state: LearnerState, storage: Rollout, train: bool) -> tuple[LearnerState, dict]:
        agent_state, key, replay = state
        key, update_key = jax.random.split(key)
        agent_state, replay, metrics = update_step(agent_state, replay, storage, update_key, train=train)
        metrics["stats/gradient_steps"] = args.gradient_steps * train
        return LearnerState(agent_state, key, replay), metrics

    gradient_step = jax.shard_map(
        local_gradient_step, mesh=mesh, in_specs=(replicated, minibatch_specs), out_specs=(replicated, replicated)
    )
    return LearnerFns(init_replay, update, jax.jit(gradient_step))


@jax.jit
def end_stored_episodes(replay):
    """After a resume the actors start new episodes: the newest stored row of each env has no next observation in
    the replay (the next row will be a new episode's first), so its transition must not be learned."""
    newest = (replay.current_index - 1) % replay.experience.valid.shape[1]
    valid = replay.experience.valid.at[:, newest].set(False)
    return replay.replace(experience=replay.experience._replace(valid=valid))


# ---------------------------------------------------------------- evaluation: what --save-model saves, and its policy
# (what the evaluator and the tools call in this script: cleanrl_utils/script_contract.py)


def saved_model(state: LearnerState) -> dict:
    """What --save-model writes next to the flags: what `make_eval_policy` reads."""
    # the policy: what evaluation needs
    return {"params": to_state_dict(local_value(state.agent.actor.params))}


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
        actions = (
            jnp.tanh(mean)
            if greedy
            else squashed_gaussian_sample(mean, log_std, jax.random.normal(subkey, mean.shape))[0]
        )
        return scale_actions(actions, action_space.low, action_space.high), key

    def policy(obs, key: jax.Array):
        actions, key = act(params, np.asarray(obs, np.float32), key)
        return np.asarray(actions), key

    return policy


# ---------------------------------------------------------------- main: the Sebulba protocol


def set_runtime_values(args: Args, layout: DeviceLayout):
    """What the run derives beyond the batch (cleanrl_utils.flags.derive_batch_values): not flags."""
    args.gradient_steps = gradient_steps_per_update(args.replay_ratio, args.batch_size)
    # the first update's rollout is all a replay holds after it: with one step per rollout, it has no pair yet
    args.learning_starts_updates = max(-(-args.learning_starts // args.batch_size), int(args.num_steps == 1))
    global_envs = args.global_num_envs
    num_learner_devices = len(layout.global_learner_devices)
    check_minibatch_split(args.minibatch_size, num_learner_devices)
    if args.buffer_size // global_envs < max(args.num_steps, 2):
        raise UsageError(
            f"--buffer-size ({args.buffer_size}) must hold at least --num-steps ({args.num_steps}) "
            f"steps of each of the {global_envs} envs"
        )
    check_int32_counts(args, {"gradient steps": ("--replay-ratio x env steps per update", args.gradient_steps)})
    # --buffer-size against the learner devices' memory, before the replay is allocated
    init_shard = make_replay_buffer(args, num_learner_devices, global_envs, local=True).init
    check_replay_fits(args.buffer_size, init_shard, replay_item(args), layout.learner_devices, new_rows=args.num_steps)


def state_summary(state: LearnerState) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states. The replay's digest is
    of the whole replay, whatever its layout, the same in every process (each computes the part it holds)."""
    agent = state.agent
    params = (agent.actor.params, agent.critic.params, agent.target_critic_params, agent.log_alpha.params)
    optimizer = (agent.actor.opt_state, agent.critic.opt_state, agent.log_alpha.opt_state)
    return (
        f"params sha256={tree_digest(params)} optimizer sha256={tree_digest(optimizer)} "
        f"replay sha256={tree_digest(state.replay)}"
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
    # the newest checkpoint of the run, or this fresh state; then the actor threads, seeded for the update it is at
    state = LearnerState(replicate(agent_state, run.mesh), learner_key, learner.init_replay())
    state, actor_threads = run.start(state, state_summary)
    if run.start_update:  # the actors start new episodes: the stored ones have no next observation
        state = state._replace(replay=end_stored_episodes(state.replay))

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
            train = update > args.learning_starts_updates  # random actions' data only, so far
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
