"""Sebulba IMPALA (Espeholt et al. 2018, V-trace) for envpool's discrete-action envs (Atari, classic
control, Football, VizDoom, MiniGrid, Procgen).

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (V-trace targets and losses), the
actor thread, the learner update, and `main`: the Sebulba protocol itself. What is the same for every algorithm
(checkpoints, preemption, device layout, logging, stop-aware queues) comes from cleanrl_utils/, one small module each.
The rest is the PPO script's (cleanba_ppo_envpool_impala_atari_wrapper.py): `diff` the two to see what is IMPALA.

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
import rlax
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
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then IMPALA's
    env_id: str = "Breakout-v5"
    """the id of an envpool env with discrete actions: Atari, classic control, Football, VizDoom, MiniGrid,
    Procgen (cleanrl_utils/envs.py); images go into a CNN (--network), vectors and dicts (flattened) into MLPs"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 50_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    learning_rate: float = 6e-4
    """the learning rate of the optimizer (IMPALA paper, Table G.1) (positive, finite)"""
    local_num_envs: int = 64
    """the number of parallel game environments of each actor thread (positive)"""
    num_steps: int = 20
    """the number of steps of each rollout (IMPALA paper, Table G.1: unroll length 20) (positive)"""
    anneal_lr: bool = True
    """toggle linear annealing of the learning rate to 0 (IMPALA paper, Table G.1)"""
    gamma: float = 0.99
    """the discount factor gamma (IMPALA paper, Table G.1) (in [0, 1])"""
    num_minibatches: int = 4
    """the number of mini-batches of trajectories per rollout, on each learner device; each is used once
    (with the defaults, 2 threads x 64 envs / 4 = 32 trajectories: the paper's batch size) (positive)"""
    vtrace_rho_bar: float = 1.0
    """V-trace's clipping of the importance weights rho, also used for the policy gradient (IMPALA paper, Sec. 4)
    (positive, finite)"""
    vtrace_c_bar: float = 1.0
    """V-trace's clipping of the trace-cutting weights c, in (0, 1] (IMPALA paper, Sec. 4) (in (0, 1])"""
    ent_coef: float = 0.01
    """coefficient of the entropy (IMPALA paper, Table G.1) (non-negative, finite)"""
    vf_coef: float = 0.5
    """coefficient of the baseline (value) loss (IMPALA paper, Table G.1) (non-negative, finite)"""
    max_grad_norm: float = 40.0
    """the maximum norm for the gradient clipping (IMPALA paper, Table G.1) (positive, finite)"""
    rmsprop_decay: float = 0.99
    """RMSProp's decay (IMPALA paper, Table G.1) (in [0, 1])"""
    rmsprop_eps: float = 0.01
    """RMSProp's epsilon, added outside the square root as in the paper's TensorFlow RMSProp (Table G.1) (positive,
    finite)"""
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
        positive_ints=["local_num_envs", "num_steps", "num_minibatches"],
        positive=["learning_rate", "vtrace_rho_bar", "max_grad_norm", "rmsprop_eps"],
        non_negative=["ent_coef", "vf_coef"],
        unit_interval=["gamma", "rmsprop_decay"],
        positive_int_lists=["channels", "hiddens"],
    )
    if not 0 < args.vtrace_c_bar <= 1:
        raise UsageError(
            f"--vtrace-c-bar must be in (0, 1] (V-trace's c never exceeds 1 in rlax), got {args.vtrace_c_bar}"
        )
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
    threads = len(args.actor_device_ids) * args.num_actor_threads
    learners = len(args.learner_device_ids)
    # the env counts the split's error suggests give whole minibatches too
    check_envs_split(args, lambda envs: threads * envs // learners % args.num_minibatches == 0)
    envs_per_learner_device = threads * args.local_num_envs // learners
    if envs_per_learner_device % args.num_minibatches != 0:
        raise UsageError(
            f"--num-minibatches ({args.num_minibatches}) must divide the trajectories (envs) per learner "
            f"device ({envs_per_learner_device})"
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
        # anneal over all optimizer steps: updates x minibatches (IMPALA paper, Table G.1)
        frac = 1.0 - (count // args.num_minibatches) / args.num_updates
        return args.learning_rate * frac

    return agent, TrainState.create(
        apply_fn=None,
        params=agent.init(key, np.zeros((1, *obs_space.shape), obs_space.dtype)),
        tx=optax.chain(
            optax.clip_by_global_norm(args.max_grad_norm),
            # epsilon outside the square root, like the TensorFlow RMSProp of the IMPALA paper
            optax.inject_hyperparams(optax.rmsprop)(
                learning_rate=linear_schedule if args.anneal_lr else args.learning_rate,
                decay=args.rmsprop_decay,
                eps=args.rmsprop_eps,
                eps_in_sqrt=False,
            ),
        ),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1."""

    obs: np.ndarray
    actions: np.ndarray
    logprobs: np.ndarray  # of the behaviour policy, for V-trace's importance weights
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray  # False for envpool's reset step after an episode end: its action is ignored
    bootstrap_obs: np.ndarray  # (1, envs, ...): the obs after the last step; the learner values it


def vtrace_loss_terms(
    *,
    logits,
    values,
    bootstrap_value,
    actions,
    behaviour_logprobs,
    rewards,
    terminations,
    truncations,
    valid,
    normalizer,
    gamma,
    rho_bar,
    c_bar,
):
    """IMPALA's losses (Espeholt et al. 2018, Sec. 4) on time-major (T, N) arrays, V-trace from rlax.

    envpool returns the true last observation of an episode together with its end flag and resets
    on the *next* step, so values[t+1] is V(last observation). A termination stops the bootstrap; a
    time-limit truncation is not a termination: it bootstraps from the value of the truncated state.
    Either end cuts the trace (lambda_t = 0), since the transition after it is envpool's reset step
    (masked out of the loss by `valid`). rlax's trace weight is c_t = lambda_t min(1, rho_t), so
    lambda_t also lowers the clip from 1 to c_bar.

    Returns (policy_loss, value_loss, entropy, approx_kl), each a sum over valid samples / normalizer.
    approx_kl is the k3 estimator E[(r - 1) - log r] (Schulman 2020), unbiased and non-negative.
    """
    logprobs, entropy = categorical_logprob_entropy(logits, actions)
    logratio = logprobs - behaviour_logprobs
    rhos = jax.lax.stop_gradient(jnp.exp(logratio))
    episode_ends = jnp.logical_or(terminations, truncations)
    discounts = gamma * (1.0 - terminations)
    lambdas = (1.0 - episode_ends) * jnp.where(rhos < c_bar, 1.0, c_bar / jnp.minimum(1.0, rhos))
    next_values = jnp.concatenate([values[1:], bootstrap_value[None]], axis=0)
    vtrace = jax.vmap(partial(rlax.vtrace, clip_rho_threshold=rho_bar), in_axes=1, out_axes=1)
    # v_s - V(x_s); the targets are stopped
    errors = vtrace(values, next_values, rewards, discounts, rhos, lambdas)
    vs = jax.lax.stop_gradient(errors + values)
    # the policy gradient's target: r_s + gamma v_{s+1}, or V(x_{s+1}) where the trace is cut by an episode end
    next_vs = jnp.where(episode_ends, next_values, jnp.concatenate([vs[1:], bootstrap_value[None]], axis=0))
    pg_advantages = jnp.minimum(rho_bar, rhos) * (rewards + discounts * next_vs - values)
    pg_loss = -jax.lax.stop_gradient(pg_advantages) * logprobs
    v_loss = 0.5 * errors**2
    approx_kl = (jnp.exp(logratio) - 1) - logratio
    valid = valid.astype(jnp.float32)
    return tuple((x * valid).sum() / normalizer for x in (pg_loss, v_loss, entropy, approx_kl))


def categorical_logprob_entropy(logits, actions):
    log_probs = jax.nn.log_softmax(logits)
    logprob = jnp.take_along_axis(log_probs, actions[..., None], axis=-1).squeeze(-1)
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1)
    return logprob, entropy


def vtrace_loss(params, minibatch: Rollout, *, agent: Agent, args: Args):
    """A learner device's part of IMPALA's loss of the global minibatch of trajectories (each term a sum over its
    valid samples divided by the whole minibatch's count: the parts add up to the loss); inside `shard_map` over the
    mesh axis "batch". Returns (loss, (policy_loss, value_loss, entropy, approx_kl))."""
    num_steps, num_envs = minibatch.actions.shape
    # one forward pass for all values
    obs = jnp.concatenate([minibatch.obs, minibatch.bootstrap_obs], axis=0)
    logits, values = agent.apply(params, obs.reshape((-1, *obs.shape[2:])))
    logits = logits.reshape((num_steps + 1, num_envs, -1))[:-1]
    values = values.reshape((num_steps + 1, num_envs))
    normalizer = jnp.maximum(jax.lax.psum(minibatch.valid.sum(), "batch"), 1).astype(jnp.float32)
    pg_loss, v_loss, entropy_loss, approx_kl = vtrace_loss_terms(
        logits=logits,
        values=values[:-1],
        bootstrap_value=values[-1],
        actions=minibatch.actions,
        behaviour_logprobs=minibatch.logprobs,
        rewards=minibatch.rewards,
        terminations=minibatch.terminations,
        truncations=minibatch.truncations,
        valid=minibatch.valid,
        normalizer=normalizer,
        gamma=args.gamma,
        rho_bar=args.vtrace_rho_bar,
        c_bar=args.vtrace_c_bar,
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
        logits, _ = agent.apply(params, obs)
        key, subkey = jax.random.split(key)
        action = jax.random.categorical(subkey, logits)  # Gumbel-max sampling on the actor device
        logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
        # one array: one device-to-host copy per env step instead of two (float32 holds action ids exactly)
        return jnp.stack([action.astype(jnp.float32), logprob]), key

    # no actor-side value: the learner values the rollout's bootstrap obs
    return ActorFns(act, value=None)


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
            logprobs, rewards, terminations, truncations = (
                np.empty((num_steps, num_envs), dtype=np.float32) for _ in range(4)
            )
            valid = np.empty((num_steps, num_envs), dtype=bool)
            for step in range(num_steps):
                thread.check_stopped()
                with timer("inference_time"):
                    step_outputs, key = actor_fns.act(params, next_obs, key)
                    action, logprob = np.asarray(step_outputs)
                    action = action.astype(np.int32)
                with timer("env_step_time"):
                    step_obs, reward, terminated, truncated, info = envs.step(action)
                with timer("storage_time"):
                    obs[step], actions[step], logprobs[step] = next_obs, action, logprob
                    rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
                    valid[step] = ~previous_episode_end
                    episodes.step(reward, terminated, truncated, info, counted=valid[step])
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs
        # the obs after the last step: the learner values it (in the same forward pass as the rollout's obs)
        storage = Rollout(obs, actions, logprobs, rewards, terminations, truncations, valid, next_obs[None])
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
    """The data-parallel learner (`shard_map` over the mesh axis "batch"): each rollout is used once, split into
    minibatches of whole trajectories (V-trace runs along time). The minibatches are a Python loop over
    one compiled minibatch step: on CPU, XLA compiles a conv weight-gradient inside `lax.scan` into a very slow loop,
    and on an H100 the loop was as fast as one scanned program (docs/performance.md#on-a-gpu)."""
    replicated, sharded_envs, sharded_steps = P(), P(None, "batch"), P("batch")
    shard_map = partial(jax.shard_map, mesh=mesh)
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    envs_per_learner_device = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    envs_per_learner_device //= len(args.learner_device_ids)
    minibatch_size = envs_per_learner_device // args.num_minibatches  # trajectories
    names = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
    loss_fn = partial(vtrace_loss, agent=agent, args=args)

    def minibatch_update(agent_state: TrainState, storage: Rollout, permutation, minibatch_index):
        indices = jax.lax.dynamic_slice_in_dim(permutation, minibatch_index * minibatch_size, minibatch_size)
        minibatch = jax.tree.map(lambda x: jnp.take(x, indices, axis=1), storage)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(agent_state.params, minibatch)
        grads, loss, metrics = jax.lax.psum((grads, loss, metrics), "batch")
        agent_state = agent_state.apply_gradients(grads=grads)
        return agent_state, (loss, *metrics)

    def shuffle(key):
        """Each learner device permutes its own trajectories with its own key."""
        key = jax.random.fold_in(key, jax.lax.axis_index("batch"))
        return jax.random.permutation(key, envs_per_learner_device)

    # check_vma=False: rlax's V-trace scan starts from a constant carry that shard_map's varying-axis
    # checks reject; without them, each device's gradient is its own and the psum above sums them
    minibatch_specs = (replicated, rollout_specs, sharded_steps, replicated)
    minibatch_update = shard_map(
        minibatch_update, in_specs=minibatch_specs, out_specs=(replicated, replicated), check_vma=False
    )
    minibatch_update = jax.jit(minibatch_update, donate_argnums=(0,))
    # its first call stops the run with one line if it cannot fit the devices' free memory (cleanrl_utils/memory.py)
    lower_memory = "raise --num-minibatches, or lower --local-num-envs or --num-steps"
    minibatch_update = checked_for_memory(minibatch_update, lower_memory)
    shuffle = jax.jit(shard_map(shuffle, in_specs=(replicated,), out_specs=sharded_steps))

    def update(state: LearnerState, storage: Rollout) -> tuple[LearnerState, dict]:
        agent_state, key = state
        key, shuffle_key = jax.random.split(key)
        permutation = shuffle(shuffle_key)
        metrics = []
        for index in range(args.num_minibatches):
            agent_state, minibatch_metrics = minibatch_update(agent_state, storage, permutation, jnp.int32(index))
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
    # the learning rate schedule's count
    check_int32_counts(args, {"optimizer steps": ("--num-minibatches", args.num_minibatches)})


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
