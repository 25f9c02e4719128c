"""Sebulba IMPALA (Espeholt et al. 2018, V-trace) for envpool's discrete-action envs (Atari,
classic control, Football, VizDoom, MiniGrid, Procgen).

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (V-trace targets and
losses), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is the same for
every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) is imported from
cleanrl_utils/, one small module each. The rest is the PPO script's (cleanba_ppo_envpool_impala_atari_wrapper.py):
`diff` the two to see what is IMPALA.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their
own envpool and run jitted inference on their actor device. Each thread hands its rollout to the
learner through its own size-1 `rollout_queue`, already split along the env axis and placed on the
learner devices; the learner answers through a size-1 `params_queue` per thread. Because the actor
skips one `params_queue.get()` (its second rollout), it always acts with the policy one version
behind the learner (`--no-concurrency` removes the skip: lag 0, no overlap). The learner is
data-parallel over the learner devices of every process (`jax.jit` + `shard_map` over a 1-D mesh,
gradients summed with `psum`), so `--distributed` (jax.distributed) scales it across hosts.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.checkpoints import Checkpoints, tree_digest
from cleanrl_utils.devices import (DeviceLayout, copies_for_devices, device_layout, envpool_num_threads, learner_loop,
                                   local_value, replicate, shutdown)
from cleanrl_utils.divergence import Diverged, all_finite, copy_state
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool, obs_layout
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
    env_id: str = "Breakout-v5"
    """the id of an envpool env with discrete actions: Atari, classic control, Football, VizDoom, MiniGrid,
    Procgen (cleanrl_utils/envs.py); images go into the IMPALA CNN, vectors and dicts (flattened) into MLPs"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 50_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    learning_rate: float = 6e-4
    """the learning rate of the optimizer (IMPALA paper, Table G.1) (positive, finite)"""
    local_num_envs: int = 64
    """the number of parallel game environments of each actor thread (positive)"""
    num_actor_threads: int = 2
    """the number of actor threads on each actor device (positive)"""
    envpool_threads: RunSetting[int] = 0
    """threads stepping each actor thread's envs (0: this process's cores but one, shared by its actor threads; in [0, this machine's cores])"""
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
    """V-trace's clipping of the importance weights rho, also used for the policy gradient (IMPALA paper, Sec. 4) (positive, finite)"""
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
    """RMSProp's epsilon, added outside the square root as in the paper's TensorFlow RMSProp (Table G.1) (positive, finite)"""
    channels: list[int] = field(default_factory=lambda: [16, 32, 32])
    """the channels of the IMPALA CNN's residual stacks (Espeholt et al. 2018, Fig. 3) (positive)"""
    hiddens: list[int] = field(default_factory=lambda: [256])
    """the hidden layers after the CNN (IMPALA: one of 256), or of the MLP for vector observations (positive)"""

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
    learner_loop: RunSetting[str] = "auto"
    """the learner's loop over epochs and minibatches: scan (one compiled program per update), python (a compiled
    minibatch step called from Python) or auto (python on CPU, where XLA compiles conv gradients inside scan
    into a slow loop; scan on GPU/TPU). Both give the same update"""
    queue_timeout: RunSetting[float] = 1.0
    """seconds between checks for a stopped run while waiting on a queue (in [0.001, 3600])"""

    # derived by main (set_runtime_values), not flags
    local_batch_size: int = field(init=False, default=0)
    """steps per update collected by this process"""
    batch_size: int = field(init=False, default=0)
    """steps per update over all processes"""
    num_updates: int = field(init=False, default=0)
    """the number of learner updates"""
    world_size: int = field(init=False, default=1)
    """the number of processes"""
    local_rank: int = field(init=False, default=0)
    """this process's index"""


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(args, positive_ints=["local_num_envs", "num_actor_threads", "num_steps", "num_minibatches",
                                     "total_timesteps"],
                positive=["learning_rate", "vtrace_rho_bar", "max_grad_norm", "rmsprop_eps"],
                non_negative=["ent_coef", "vf_coef"], unit_interval=["gamma", "rmsprop_decay"],
                positive_int_lists=["channels", "hiddens"])
    if not 0 < args.vtrace_c_bar <= 1:
        raise UsageError(f"--vtrace-c-bar must be in (0, 1] (V-trace's c never exceeds 1 in rlax), got "
                         f"{args.vtrace_c_bar}")
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
    if args.local_num_envs % len(args.learner_device_ids) != 0:
        raise UsageError(f"--local-num-envs ({args.local_num_envs}) must be divisible by the number of "
                         f"--learner-device-ids ({len(args.learner_device_ids)}): each actor thread splits its envs over them")
    envs_per_learner_device = (len(args.actor_device_ids) * args.num_actor_threads * args.local_num_envs
                               // len(args.learner_device_ids))
    if envs_per_learner_device % args.num_minibatches != 0:
        raise UsageError(f"--num-minibatches ({args.num_minibatches}) must divide the trajectories (envs) per learner "
                         f"device ({envs_per_learner_device})")
    check_save_model_flags(args, __file__)  # --capture-video, --upload-model: checked before training


# ---------------------------------------------------------------- environments


def make_env(env_id: str, seed: int, num_envs: int, render_mode: str | None = None, num_threads: int = 0,
             env_options: Sequence[str] = ()):
    """envpool gymnasium envs with the family's cited options, dict observations flattened (cleanrl_utils/envs.py);
    env i is seeded with seed + i; render_mode="rgb_array" makes envs.render() return env 0's frame (videos)."""
    return make_envpool(env_id, seed, num_envs, render_mode=render_mode, num_threads=num_threads,
                        overrides=env_options)


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
    channel_first: bool  # Atari, VizDoom, Procgen: (N, C, H, W); Football's mini map: (N, H, W, C)

    @nn.compact
    def __call__(self, x):
        x = (jnp.transpose(x, (0, 2, 3, 1)) if self.channel_first else x).astype(jnp.float32) / 255.0
        for channels in self.channels:
            x = ConvSequence(channels)(x)
        x = nn.relu(x)
        x = x.reshape((x.shape[0], -1))
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden)(x))
        return x


class MLP(nn.Module):
    """Torso for vector observations (classic control; MiniGrid and other dicts flattened by make_env)."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32)
        for hidden in self.hiddens:
            x = nn.tanh(nn.Dense(hidden, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x))
        return x


class Agent(nn.Module):
    """Policy logits and value. Atari shares the IMPALA torso between both heads (Espeholt et al. 2018);
    vector observations get separate actor and critic MLPs, as in CleanRL's classic-control PPO: with a
    shared small MLP, large value gradients (returns of ~100s) drown the policy gradient."""

    action_dim: int
    channels: Sequence[int]
    hiddens: Sequence[int]
    obs_layout: str  # cleanrl_utils.envs.obs_layout: "chw" or "hwc" images, or "vector"

    @nn.compact
    def __call__(self, obs):
        if self.obs_layout != "vector":
            actor_hidden = critic_hidden = ImpalaCNN(self.channels, self.hiddens, self.obs_layout == "chw")(obs)
        else:
            actor_hidden, critic_hidden = MLP(self.hiddens)(obs), MLP(self.hiddens)(obs)
        # small policy init and unit value init: CleanRL / "37 implementation details of PPO" (Huang et al. 2022)
        logits = nn.Dense(self.action_dim, kernel_init=nn.initializers.orthogonal(0.01))(actor_hidden)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic_hidden)
        return logits, value.squeeze(-1)


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, TrainState]:
    """The network for --env-id and its training state (params and optimizer), on the host."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    agent = Agent(int(action_space.n), tuple(args.channels), tuple(args.hiddens), obs_layout(args.env_id))

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
                learning_rate=linear_schedule if args.anneal_lr else args.learning_rate, decay=args.rmsprop_decay,
                eps=args.rmsprop_eps, eps_in_sqrt=False),
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


def vtrace_loss_terms(*, logits, values, bootstrap_value, actions, behaviour_logprobs, rewards, terminations,
                      truncations, valid, normalizer, gamma, rho_bar, c_bar):
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
    errors = vtrace(values, next_values, rewards, discounts, rhos, lambdas)  # v_s - V(x_s), targets stopped
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


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> V(obs) for the rollout's bootstrap; None where the learner values it


def make_actor_fns(agent: Agent) -> ActorFns:
    @jax.jit
    def act(params, obs, key):
        logits, _ = agent.apply(params, obs)
        key, subkey = jax.random.split(key)
        action = jax.random.categorical(subkey, logits)  # Gumbel-max sampling on the actor device
        logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
        # one array: one device-to-host copy per env step instead of two (float32 holds action ids exactly)
        return jnp.stack([action.astype(jnp.float32), logprob]), key

    return ActorFns(act, value=None)  # no actor-side value: the learner values the rollout's bootstrap obs


def actor_params(agent_state: TrainState):
    """What the actors act with."""
    return agent_state.params


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
    obs_space = envs.observation_space
    next_obs, _ = envs.reset()
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    # episode statistics on the real game: unclipped rewards, and whole games despite episodic life
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
        obs = np.empty((num_steps, num_envs, *obs_space.shape), dtype=obs_space.dtype)
        actions = np.empty((num_steps, num_envs), dtype=np.int32)
        logprobs = np.empty((num_steps, num_envs), dtype=np.float32)
        rewards = np.empty((num_steps, num_envs), dtype=np.float32)
        terminations = np.empty((num_steps, num_envs), dtype=np.float32)
        truncations = np.empty((num_steps, num_envs), dtype=np.float32)
        valid = np.empty((num_steps, num_envs), dtype=bool)
        for step in range(num_steps):
            if stop_event.is_set():  # another thread failed, or Ctrl-C: do not finish a long rollout
                raise RunStopped
            inference_start = time.time()
            action_logprob, key = actor_fns.act(params, next_obs, key)
            action, logprob = np.asarray(action_logprob)
            action = action.astype(np.int32)
            env_step_start = time.time()
            inference_time += env_step_start - inference_start
            step_obs, reward, terminated, truncated, info = envs.step(action)
            storage_start = time.time()
            env_step_time += storage_start - env_step_start
            obs[step], actions[step], logprobs[step] = next_obs, action, logprob
            rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
            valid[step] = ~previous_episode_end
            # Atari: info["reward"] is unclipped and info["terminated"] marks game over (not a lost life)
            episode_returns += info.get("reward", reward)
            episode_lengths += valid[step]  # envpool's reset step is not a step of the game
            game_over = np.logical_or(info["terminated"] if "terminated" in info else terminated, truncated)
            returned_episode_returns = np.where(game_over, episode_returns, returned_episode_returns)
            returned_episode_lengths = np.where(game_over, episode_lengths, returned_episode_lengths)
            episode_returns *= ~game_over
            episode_lengths *= ~game_over
            previous_episode_end = np.logical_or(terminated, truncated)
            next_obs = step_obs
            storage_time += time.time() - storage_start
        rollout_time = time.time() - rollout_start

        storage = Rollout(obs=obs, actions=actions, logprobs=logprobs, rewards=rewards, terminations=terminations,
                          truncations=truncations, valid=valid, bootstrap_obs=next_obs[None])
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
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: greedy takes the most
    likely action, otherwise actions are sampled as in training."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    agent = Agent(int(action_space.n), tuple(args.channels), tuple(args.hiddens), obs_layout(args.env_id))
    params = jax.tree.map(jnp.asarray, model["params"])

    @jax.jit
    def act(params, obs, key):
        logits, _ = agent.apply(params, obs)
        key, subkey = jax.random.split(key)
        return (jnp.argmax(logits, axis=-1) if greedy else jax.random.categorical(subkey, logits)), key

    def policy(obs: np.ndarray, key: jax.Array):
        actions, key = act(params, obs, key)
        return np.asarray(actions), key

    return policy


# ---------------------------------------------------------------- learner


def make_learner_fns(args: Args, agent: Agent, mesh: Mesh):
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices.

    Each rollout is used once, split into minibatches of whole trajectories (V-trace runs along time).
    `--learner-loop` drives the minibatches either as one compiled program per update (`lax.scan`: GPU/TPU) or as
    a Python loop over one compiled minibatch step (CPU: XLA turns a conv weight-gradient inside `lax.scan` into a
    very slow loop). Both run the same per-device functions below, so they give the same update.
    """
    replicated, sharded_envs, sharded_steps = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    envs_per_learner_device = args.local_num_envs * args.num_actor_threads * len(args.actor_device_ids)
    envs_per_learner_device //= len(args.learner_device_ids)
    minibatch_size = envs_per_learner_device // args.num_minibatches  # trajectories
    names = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]

    def loss_fn(params, minibatch: Rollout):
        num_steps, num_envs = minibatch.actions.shape
        obs = jnp.concatenate([minibatch.obs, minibatch.bootstrap_obs], axis=0)  # one forward pass for all values
        logits, values = agent.apply(params, obs.reshape((-1, *obs.shape[2:])))
        logits = logits.reshape((num_steps + 1, num_envs, -1))[:-1]
        values = values.reshape((num_steps + 1, num_envs))
        # normalize by the valid samples of the whole (global) minibatch, then sum gradients: the exact global mean
        normalizer = jnp.maximum(jax.lax.psum(minibatch.valid.sum(), "batch"), 1).astype(jnp.float32)
        pg_loss, v_loss, entropy_loss, approx_kl = vtrace_loss_terms(
            logits=logits, values=values[:-1], bootstrap_value=values[-1], actions=minibatch.actions,
            behaviour_logprobs=minibatch.logprobs, rewards=minibatch.rewards, terminations=minibatch.terminations,
            truncations=minibatch.truncations, valid=minibatch.valid, normalizer=normalizer, gamma=args.gamma,
            rho_bar=args.vtrace_rho_bar, c_bar=args.vtrace_c_bar)
        loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef
        return loss, (pg_loss, v_loss, entropy_loss, approx_kl)

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
    if learner_loop(args.learner_loop, mesh) == "scan":

        @partial(jax.jit, donate_argnums=(0,))
        @partial(jax.shard_map, mesh=mesh, in_specs=(replicated, rollout_specs, replicated), out_specs=replicated,
                 check_vma=False)
        def update(agent_state: TrainState, storage: Rollout, key):
            key, shuffle_key = jax.random.split(key)
            permutation = shuffle(shuffle_key)
            step = lambda agent_state, index: minibatch_update(agent_state, storage, permutation, index)
            agent_state, metrics = jax.lax.scan(step, agent_state, jnp.arange(args.num_minibatches, dtype=jnp.int32))
            return agent_state, dict(zip(names, jax.tree.map(jnp.mean, metrics))), key

        return update

    minibatch_update = jax.jit(jax.shard_map(minibatch_update, mesh=mesh, out_specs=(replicated, replicated),
                                             in_specs=(replicated, rollout_specs, sharded_steps, replicated),
                                             check_vma=False), donate_argnums=(0,))
    shuffle = jax.jit(jax.shard_map(shuffle, mesh=mesh, in_specs=(replicated,), out_specs=sharded_steps))

    def update(agent_state: TrainState, storage: Rollout, key):
        key, shuffle_key = jax.random.split(key)
        permutation = shuffle(shuffle_key)
        metrics = []
        for minibatch_index in range(args.num_minibatches):
            agent_state, minibatch_metrics = minibatch_update(agent_state, storage, permutation,
                                                              jnp.int32(minibatch_index))
            metrics.append(minibatch_metrics)
        metrics = jax.tree.map(lambda *x: jnp.stack(x).mean(), *metrics)
        return agent_state, dict(zip(names, metrics)), key

    return update


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
    check_int32_counts(args, {"optimizer steps": ("--num-minibatches", args.num_minibatches)})  # the schedule's count


def state_summary(agent_state: TrainState) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states."""
    return f"params sha256={tree_digest(agent_state.params)}"


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
    update = make_learner_fns(args, agent, layout.mesh)
    checkpoints = Checkpoints(args, layout.world_size)  # one folder for every process: checked now
    (agent_state, learner_key), start_update = checkpoints.restore(
        (replicate(agent_state, layout.mesh), learner_key), args, summary=lambda state: state_summary(state[0]))
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

    def broadcast_params(agent_state: TrainState, version: int):
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
            last_finite = (copy_state(agent_state), learner_key)  # checkpointed if this update diverges
            agent_state, metrics, learner_key = update(agent_state, storage, learner_key)
            learning_rate = agent_state.opt_state[1].hyperparams["learning_rate"]
            metrics, learning_rate = jax.device_get((metrics, learning_rate))  # waits for the update
            training_time = time.time() - training_start
            if not all_finite(metrics, agent_state):  # NaN or inf: stop, never train on or save a wrong model
                checkpoints.save(update_index - 1, last_finite, args, state_summary(last_finite[0]))
                raise Diverged(update_index, metrics)
            learner_policy_version += 1
            actors.check()
            if update_index < args.num_updates:
                broadcast_params(agent_state, learner_policy_version)

            logger.log_update(update_index, {
                **metrics, "charts/learning_rate": learning_rate, "stats/actor_policy_version": actor_versions[0],
                "stats/learner_policy_version": learner_policy_version - 1,  # the version the gradient was taken at
                "stats/rollout_queue_get_time": rollout_queue_get_time, "stats/training_time": training_time,
            }, actor_stats)
            if args.checkpoint_frequency and update_index % args.checkpoint_frequency == 0:
                checkpoints.save(update_index, (agent_state, learner_key), args, state_summary(agent_state))

    preemption.requested()  # once more: a signal that reached any process in the last update counts everywhere
    checkpoints.save(learner_policy_version, (agent_state, learner_key), args, state_summary(agent_state))
    checkpoints.close()
    # every process prints this: equal digests show that all learner replicas hold the same params
    print(f"process {layout.local_rank}: final {state_summary(agent_state)}", flush=True)
    preemption.report(learner_policy_version, args.run_name)
    upload_succeeded = True
    if args.save_model and layout.is_main_process and not preemption.stop_signal:  # a final, complete model only
        upload_succeeded = save_evaluate_upload(args, __file__, {"params": to_state_dict(local_value(agent_state.params))})
    logger.finish()
    run_folder.release()
    shutdown()  # jax.distributed
    # 143 SIGTERM, 130 Ctrl-C; 1: the model, card and video are on disk (see the error above), the upload is missing
    return preemption.exit_code or (0 if upload_succeeded else 1)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
