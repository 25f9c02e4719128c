"""Sebulba R2D2 (Kapturowski et al. 2019, "Recurrent experience replay in distributed reinforcement learning") for
envpool's discrete-action envs (Atari, classic control, Football, VizDoom, MiniGrid, Procgen), with the prioritized
sequence replay on the learner devices, sharded along the env axis.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (value rescaling, n-step double
Q targets, priorities, burn-in), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What
is the same for every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) is imported from
cleanrl_utils/, one small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their
own envpool and run jitted inference on their actor device. Each thread hands its rollout to the
learner through its own size-1 `rollout_queue`, already split along the env axis and placed on the
learner devices; the learner answers through a size-1 `params_queue` per thread. Because the actor
skips one `params_queue.get()` (its second rollout), it always acts with the policy one version
behind the learner (`--no-concurrency` removes the skip: lag 0, no overlap). The learner is
data-parallel over the learner devices of every process (`jax.jit` + `shard_map` over a 1-D mesh,
gradients summed with `psum`), so `--distributed` (jax.distributed) scales it across hosts.

Recurrent and off-policy: the network is a torso (IMPALA CNN or MLP), an LSTM core and a dueling Q head. Each actor
carries the recurrent state of each of its envs (zeroed at episode starts) and acts epsilon-greedily with the Ape-X
epsilons over all envs of all threads and processes. A rollout is cut into sequences of `--sequence-length` steps,
overlapping by half, each stored with the recurrent state at its start (R2D2's "stored state"). The replay
(flashbax's prioritized item buffer, one sequence an item) lives in learner-device memory, sharded along the env
axis: each learner device stores the sequences of its envs, samples its part of every minibatch by priority from its
own shard, and updates their priorities. The first `--burn-in` steps of a sampled sequence only warm the LSTM up;
the rest learn n-step double Q targets under the value rescaling h. `--replay-ratio` fixes the gradient steps per
env step: with the one-version lag a seed gives the same run whatever the speed of actors and learner.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.checkpoints import Checkpoints, tree_digest
from cleanrl_utils.devices import (DeviceLayout, check_replay_fits, copies_for_devices, device_layout,
                                   envpool_num_threads, local_value, replicate, shutdown)
from cleanrl_utils.divergence import Diverged, all_finite, copy_state
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool, obs_layout
from cleanrl_utils.evals.evaluate import check_save_model_flags, save_evaluate_upload
from cleanrl_utils.flags import (INT32_MAX, RunSetting, UsageError, check_choice, check_flags, check_int32_counts,
                                 check_run_flags, run_cli)
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
    Procgen (cleanrl_utils/envs.py); images go into the IMPALA CNN, vectors and dicts (flattened) into an MLP"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 50_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (positive)"""
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
    num_actor_threads: int = 2
    """the number of actor threads on each actor device (positive)"""
    envpool_threads: RunSetting[int] = 0
    """threads stepping each actor thread's envs (0: this process's cores but one, shared by its actor threads; in [0, this machine's cores])"""
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
    """gradient steps between copies of the online network into the target network (R2D2 Table 1: 2500) (in [1, 2**31 - 1])"""
    priority_exponent: float = 0.9
    """alpha: sequences are sampled with probability priority^alpha (R2D2 Table 1: 0.9) (in [0, 1])"""
    importance_exponent: float = 0.6
    """beta of the importance-sampling weights (N P)^-beta (R2D2 Table 1: 0.6) (in [0, 1])"""
    priority_eta: float = 0.9
    """a sequence's priority: eta max|td| + (1 - eta) mean|td| over its learned steps (R2D2 Table 1: 0.9) (in [0, 1])"""
    core: str = "lstm"
    """the recurrent core: lstm (R2D2), or feedforward (a ReLU layer of --lstm-size and no memory: the ablation)"""
    lstm_size: int = 512
    """the units of the LSTM core (R2D2 Sec. 2.3: 512) (positive)"""
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
    """the updates that only fill the replay: the learner's gradient steps start after them"""
    world_size: int = field(init=False, default=1)
    """the number of processes"""
    local_rank: int = field(init=False, default=0)
    """this process's index"""


CORES = ("lstm", "feedforward")


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(args, positive_ints=["local_num_envs", "num_actor_threads", "num_steps", "buffer_size",
                                     "minibatch_size", "n_step", "sequence_length", "target_update_period",
                                     "lstm_size"],
                non_negative_ints=["learning_starts", "burn_in"],
                positive=["learning_rate", "adam_eps", "replay_ratio"],
                unit_interval=["gamma", "priority_exponent", "importance_exponent", "priority_eta"],
                positive_int_lists=["channels", "hiddens"],
                ranges={"total_timesteps": (1, 2**53), "target_update_period": (1, INT32_MAX)})  # int32 in jit
    check_choice("core", args.core, CORES)
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
    if args.sequence_length % 2 != 0:
        raise UsageError(f"--sequence-length ({args.sequence_length}) must be even: sequences overlap by half")
    if args.burn_in >= args.sequence_length - 1:
        raise UsageError(f"--burn-in ({args.burn_in}) must be less than --sequence-length - 1 "
                         f"({args.sequence_length - 1}): a sequence learns its steps after the burn-in that have a next step")
    if args.n_step > args.sequence_length - 1 - args.burn_in:  # a return stops at its sequence's end
        raise UsageError(f"--n-step ({args.n_step}) must be at most --sequence-length - 1 - --burn-in "
                         f"({args.sequence_length - 1 - args.burn_in}): no learned step of a sequence has more "
                         "rewards after it, so a longer n would be ignored")
    if args.sequence_length > args.num_steps or args.num_steps % (args.sequence_length // 2) != 0:
        raise UsageError(f"--num-steps ({args.num_steps}) must be a multiple of --sequence-length / 2 "
                         f"({args.sequence_length // 2}) and at least --sequence-length ({args.sequence_length})")
    if args.local_num_envs % len(args.learner_device_ids) != 0:
        raise UsageError(f"--local-num-envs ({args.local_num_envs}) must be divisible by the number of "
                         f"--learner-device-ids ({len(args.learner_device_ids)}): each actor thread splits its envs over them")
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
    channel_first: bool  # Atari, Procgen: (N, C, H, W); Football's mini map: (N, H, W, C)

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
        state, x = scan(self.core, self.lstm_size)(state, (x.reshape((num_steps, num_envs, -1)), episode_starts))
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
    agent = Agent(int(action_space.n), tuple(args.channels), tuple(args.hiddens), obs_layout(args.env_id), args.core,
                  args.lstm_size)
    params = agent.init(key, np.zeros((1, 1, *obs_space.shape), obs_space.dtype), np.ones((1, 1), bool),
                        initial_state(1, args.lstm_size))
    return agent, AgentState(
        online=TrainState.create(apply_fn=None, params=params,
                                 tx=optax.adam(args.learning_rate, eps=args.adam_eps)),  # R2D2 Table 1
        target_params=jax.tree.map(np.copy, params),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1.
    It holds the last --sequence-length / 2 steps of the previous rollout, then --num-steps new ones, so that the
    learner cuts it into sequences overlapping by half. envpool returns an episode's true last observation with its
    end flag and resets on the next step: that reset step's row is not `valid` (never learned); the row after it
    starts the new episode (`episode_starts`: the state is zeroed before it)."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray
    episode_starts: np.ndarray
    start_cells: np.ndarray  # (sequences, envs, --lstm-size): the LSTM state before each sequence's first row
    start_hiddens: np.ndarray


class Sequences(NamedTuple):
    """The replay's items: one sequence each, batch-major (sequences, --sequence-length, ...)."""

    obs: jax.Array
    actions: jax.Array
    rewards: jax.Array
    terminations: jax.Array
    truncations: jax.Array
    valid: jax.Array
    episode_starts: jax.Array
    start_cells: jax.Array  # (sequences, --lstm-size)
    start_hiddens: jax.Array


def cut_sequences(storage: Rollout, sequence_length: int) -> Sequences:
    """The overlapping sequences of a rollout: sequence k covers rows [k L/2, k L/2 + L), of every env;
    items are ordered sequence-major (all envs of sequence 0, then of sequence 1, ...)."""
    period, num_sequences = sequence_length // 2, storage.start_cells.shape[0]

    def cut(x):
        windows = jnp.stack([x[k * period : k * period + sequence_length] for k in range(num_sequences)])
        windows = jnp.swapaxes(windows, 1, 2)  # (sequences, envs, L, ...)
        return windows.reshape((-1, *windows.shape[2:]))

    fields = [cut(getattr(storage, name)) for name in Rollout._fields[:7]]
    states = [x.reshape((-1, x.shape[-1])) for x in (storage.start_cells, storage.start_hiddens)]
    return Sequences(*fields, *states)


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
    return jax.vmap(lambda r, d, v, l: returns(r, d, v, lambda_t=l), in_axes=1, out_axes=1)(
        rewards, discounts, next_values, 1.0 - truncations)


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
    return scaled_probabilities ** -exponent


def unroll(agent: Agent, params, sequences: Sequences, burn_in: int):
    """Q of every row of time-major sequences from their stored start states; the first `burn_in` rows only
    warm the state up: no gradient flows into them (R2D2 Sec. 3, "burn-in")."""
    state = (sequences.start_cells, sequences.start_hiddens)
    if burn_in:
        _, state = agent.apply(params, sequences.obs[:burn_in], sequences.episode_starts[:burn_in], state)
        state = jax.lax.stop_gradient(state)
    q, _ = agent.apply(params, sequences.obs[burn_in:], sequences.episode_starts[burn_in:], state)
    return jnp.concatenate([jnp.zeros((burn_in, *q.shape[1:]), q.dtype), q]) if burn_in else q


def r2d2_loss(params, *, agent: Agent, target_params, sequences: Sequences, weights, normalizer, burn_in, gamma,
              n_step):
    """0.5 x squared TD error, averaged over each sequence's learned steps, weighted by its importance weight,
    summed over the sequences / normalizer (the global minibatch size). Aux: |td| (T - 1, B), the mask, Q."""
    q = unroll(agent, params, sequences, burn_in)
    target_q = unroll(agent, target_params, sequences, burn_in)
    targets = jax.lax.stop_gradient(n_step_double_q_targets(
        rewards=sequences.rewards[:-1], terminations=sequences.terminations[:-1],
        truncations=sequences.truncations[:-1], online_next_q=q[1:], target_next_q=target_q[1:], gamma=gamma,
        n_step=n_step))
    taken_q = jnp.take_along_axis(q[:-1], sequences.actions[:-1, :, None], axis=-1).squeeze(-1)
    td = targets - taken_q
    mask = learned_steps(sequences.valid, burn_in)
    per_sequence = 0.5 * jnp.where(mask, td**2, 0.0).sum(0) / jnp.maximum(mask.sum(0), 1)
    return (weights * per_sequence).sum() / normalizer, (jnp.abs(td), mask, taken_q)


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, episode_starts, state, epsilons, key) -> (actions, state, key)
    value: Callable | None  # (params, obs) -> V(obs) for the rollout's bootstrap; None where the learner values it


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
    num_envs, num_steps, period = args.local_num_envs, args.num_steps, args.sequence_length // 2
    total_envs = num_envs * args.num_actor_threads * len(args.actor_device_ids) * args.world_size
    epsilons = jax.device_put(apex_epsilons(global_thread_index * num_envs + np.arange(num_envs), total_envs),
                              actor_device)
    obs_space = envs.observation_space
    obs_dtype = np.uint8 if obs_space.dtype == np.uint8 else np.float32
    next_obs, _ = envs.reset()
    state = jax.device_put(initial_state(num_envs, args.lstm_size), actor_device)
    next_episode_starts = np.ones(num_envs, dtype=bool)
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    # episode statistics on the real game: unclipped rewards, and whole games despite episodic life
    episode_returns = np.zeros(num_envs, dtype=np.float64)
    episode_lengths = np.zeros(num_envs, dtype=np.int64)
    returned_episode_returns = np.full(num_envs, np.nan)
    returned_episode_lengths = np.full(num_envs, np.nan)
    envs_per_learner_device = num_envs // len(learner_devices)
    actor_policy_version = 0
    rollout_queue_put_time = 0.0
    # the previous rollout's last `period` rows (before the first: invalid rows) and the state before them
    rows = period + num_steps
    obs = np.zeros((rows, num_envs, *obs_space.shape), dtype=obs_dtype)
    actions = np.zeros((rows, num_envs), dtype=np.int32)
    rewards = np.zeros((rows, num_envs), dtype=np.float32)
    terminations = np.zeros((rows, num_envs), dtype=np.float32)
    truncations = np.zeros((rows, num_envs), dtype=np.float32)
    valid = np.zeros((rows, num_envs), dtype=bool)
    episode_starts = np.ones((rows, num_envs), dtype=bool)
    num_sequences = num_steps // period
    start_cells = np.zeros((num_sequences + 1, num_envs, args.lstm_size), dtype=np.float32)
    start_hiddens = np.zeros((num_sequences + 1, num_envs, args.lstm_size), dtype=np.float32)

    for update in range(start_update + 1, args.num_updates + 1):
        params_queue_get_start = time.time()
        # skipping the second get makes the actor exactly one policy version behind the learner
        if update != start_update + 2 or not args.concurrency:
            params, actor_policy_version = queue_get(params_queue, stop_event, args.queue_timeout)
        params_queue_get_time = time.time() - params_queue_get_start

        rollout_start = time.time()
        inference_time = env_step_time = storage_time = 0.0
        # new arrays each rollout (the last ones may still be on their way to the learner); the previous
        # rollout's last rows and the state before them start this one's first sequence
        obs, actions, rewards, terminations, truncations, valid, episode_starts = (
            np.concatenate([x[num_steps:], np.empty_like(x[:num_steps])])
            for x in (obs, actions, rewards, terminations, truncations, valid, episode_starts))
        start_cells, start_hiddens = (np.concatenate([x[num_sequences:], np.empty_like(x[:num_sequences])])
                                      for x in (start_cells, start_hiddens))
        for step in range(num_steps):
            if stop_event.is_set():  # another thread failed, or Ctrl-C: do not finish a long rollout
                raise RunStopped
            if step % period == 0:  # a sequence starts at this row: store the state before it
                start_cells[1 + step // period], start_hiddens[1 + step // period] = jax.device_get(state)
            inference_start = time.time()
            action, state, key = actor_fns.act(params, next_obs, next_episode_starts, state, epsilons, key)
            action = np.asarray(action)
            env_step_start = time.time()
            inference_time += env_step_start - inference_start
            step_obs, reward, terminated, truncated, info = envs.step(action)
            storage_start = time.time()
            env_step_time += storage_start - env_step_start
            row = period + step
            obs[row], actions[row], rewards[row], episode_starts[row] = next_obs, action, reward, next_episode_starts
            terminations[row], truncations[row], valid[row] = terminated, truncated, ~previous_episode_end
            # Atari: info["reward"] is unclipped and info["terminated"] marks game over (not a lost life)
            episode_returns += info.get("reward", reward)
            episode_lengths += valid[row]  # envpool's reset step is not a step of the game
            game_over = np.logical_or(info["terminated"] if "terminated" in info else terminated, truncated)
            returned_episode_returns = np.where(game_over, episode_returns, returned_episode_returns)
            returned_episode_lengths = np.where(game_over, episode_lengths, returned_episode_lengths)
            episode_returns *= ~game_over
            episode_lengths *= ~game_over
            # the row after envpool's reset step starts a new episode (the reset step's row still holds the
            # ended episode's true last observation: its Q, with the old state, is a truncation's bootstrap)
            next_episode_starts = previous_episode_end
            previous_episode_end = np.logical_or(terminated, truncated)
            next_obs = step_obs
            storage_time += time.time() - storage_start
        rollout_time = time.time() - rollout_start

        storage = Rollout(obs=obs, actions=actions, rewards=rewards, terminations=terminations, truncations=truncations,
                          valid=valid, episode_starts=episode_starts, start_cells=start_cells[:num_sequences],
                          start_hiddens=start_hiddens[:num_sequences])
        # one host-to-device transfer per rollout: each learner device gets its slice of the envs (device_put
        # copies the host arrays before this thread overwrites them)
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


# the evaluation's epsilon without --eval-greedy (a choice: small, so that the agent cannot loop forever)
EVAL_EPSILON = 0.01


class EvalPolicy:
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: it carries each env's
    recurrent state, which the evaluator's `end_episodes(ended)` zeroes (after envpool's reset step)."""

    def __init__(self, args: Args, model: dict, greedy: bool):
        obs_space, action_space = env_spaces(args.env_id, args.env_options)
        agent = Agent(int(action_space.n), tuple(args.channels), tuple(args.hiddens), obs_layout(args.env_id),
                      args.core, args.lstm_size)
        self.act, self.params = make_actor_fns(agent).act, jax.tree.map(jnp.asarray, model["params"])
        self.epsilon, self.lstm_size = 0.0 if greedy else EVAL_EPSILON, args.lstm_size
        self.state = self.episode_starts = self.previous_end = None

    def __call__(self, obs: np.ndarray, key: jax.Array):
        if self.state is None:
            self.state = initial_state(len(obs), self.lstm_size)
            self.episode_starts, self.previous_end = np.ones(len(obs), bool), np.zeros(len(obs), bool)
        actions, self.state, key = self.act(self.params, obs, self.episode_starts, self.state,
                                            jnp.full(len(obs), self.epsilon), key)
        self.episode_starts = self.previous_end
        return np.asarray(actions), key

    def end_episodes(self, ended: np.ndarray):
        self.previous_end = np.asarray(ended, bool)


def make_eval_policy(args: Args, model: dict, greedy: bool):
    return EvalPolicy(args, model, greedy)


# ---------------------------------------------------------------- learner


class Minibatch(NamedTuple):
    """One gradient step's samples (first axis: sequences): the sequences and N P(i), the size of the shard they
    were sampled from times their probability there (what the importance weights need)."""

    sequences: Sequences
    scaled_probabilities: jax.Array


class LearnerFns(NamedTuple):
    init_replay: Callable  # () -> the empty replay, sharded along the env axis over the mesh
    update: Callable  # (agent_state, replay, rollout, key, train) -> (agent_state, replay, metrics, key)
    gradient_step: Callable  # (agent_state, minibatch) -> (agent_state, metrics, priorities): one step on a given global minibatch


def replay_capacity(args: Args, num_learner_devices: int) -> int:
    """Sequences per learner device: --buffer-size observations, one new sequence every --sequence-length / 2."""
    return args.buffer_size // (args.sequence_length // 2) // num_learner_devices


def make_replay_buffer(args: Args, num_learner_devices: int):
    """flashbax's prioritized item buffer of one learner device: its share of the capacity and of each minibatch.
    New sequences get the largest priority seen so far (Schaul et al. 2016; R2D2's actors compute it instead)."""
    return flashbax.make_prioritised_item_buffer(
        max_length=replay_capacity(args, num_learner_devices), min_length=1, add_batches=True,
        sample_batch_size=args.minibatch_size // num_learner_devices, priority_exponent=args.priority_exponent,
        device=jax.default_backend() if jax.default_backend() in ("cpu", "gpu", "tpu") else "cpu")


def replay_item(args: Args) -> Sequences:
    """One sequence as the replay stores it: --sequence-length rows and the LSTM state before them."""
    obs_space, _ = env_spaces(args.env_id, args.env_options)
    length, obs_dtype = args.sequence_length, jnp.uint8 if obs_space.dtype == np.uint8 else jnp.float32
    return Sequences(obs=jnp.zeros((length, *obs_space.shape), obs_dtype), actions=jnp.zeros(length, jnp.int32),
                     rewards=jnp.zeros(length), terminations=jnp.zeros(length), truncations=jnp.zeros(length),
                     valid=jnp.zeros(length, bool), episode_starts=jnp.zeros(length, bool),
                     start_cells=jnp.zeros(args.lstm_size), start_hiddens=jnp.zeros(args.lstm_size))


def make_learner_fns(args: Args, agent: Agent, mesh: Mesh) -> LearnerFns:
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices; each device keeps
    the replay shard of its envs, samples its part of every minibatch, and the gradients are summed with `psum`."""
    replicated, sharded_envs, sharded_samples = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    minibatch_specs = Minibatch(Sequences(*([sharded_samples] * len(Sequences._fields))), sharded_samples)
    num_devices, capacity = mesh.devices.size, replay_capacity(args, mesh.devices.size)
    local_buffer = make_replay_buffer(args, num_devices)
    item = replay_item(args)
    # a device's shard: the item buffer's experience is (1, capacity, ...) and its sum tree's nodes are 1-D: those
    # axes are sharded over the devices; the write position and the largest priority are the same on every device
    shard = jax.eval_shape(local_buffer.init, item)
    replay_specs = shard.replace(
        experience=Sequences(*([sharded_envs] * len(Sequences._fields))), current_index=replicated,
        is_full=replicated, running_index=replicated,
        sum_tree_state=shard.sum_tree_state.replace(nodes=sharded_samples, max_recorded_priority=replicated))

    def init_replay():
        return jax.jit(jax.shard_map(lambda: local_buffer.init(item), mesh=mesh, in_specs=(), out_specs=replay_specs))()

    def local_gradient_step(agent_state: AgentState, minibatch: Minibatch):
        """One R2D2 step: the importance-weighted loss on the sampled sequences, Adam, the periodic target copy.
        Returns the new priorities of this device's sequences too."""
        sequences = minibatch.sequences._replace(**{  # time-major, as the network unrolls
            name: jnp.swapaxes(getattr(minibatch.sequences, name), 0, 1) for name in Rollout._fields[:7]})
        # flashbax's float32 sum tree can land on an empty slot (probability 0): such a sample is not learned
        sampled = minibatch.scaled_probabilities > 0
        weights = jnp.where(sampled, importance_weights(jnp.where(sampled, minibatch.scaled_probabilities, 1.0),
                                                        args.importance_exponent), 0.0)
        weights = weights / jax.lax.pmax(weights.max(), "batch")  # the largest weight of the global minibatch is 1
        # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
        # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
        local_params = jax.lax.pcast(agent_state.online.params, "batch", to="varying")
        (loss, (abs_td, mask, taken_q)), grads = jax.value_and_grad(r2d2_loss, has_aux=True)(
            local_params, agent=agent, target_params=agent_state.target_params, sequences=sequences, weights=weights,
            normalizer=float(args.minibatch_size), burn_in=args.burn_in, gamma=args.gamma, n_step=args.n_step)
        priorities = jnp.where(sampled, sequence_priorities(abs_td, mask, args.priority_eta), 0.0)
        count = jnp.maximum(jax.lax.psum(mask.sum(), "batch"), 1)
        metrics = {"losses/td_loss": loss, "losses/q_values": jnp.where(mask, taken_q, 0.0).sum() / count,
                   "losses/abs_td": jnp.where(mask, abs_td, 0.0).sum() / count,
                   "losses/priority": priorities.sum() / args.minibatch_size,
                   "losses/importance_weight": weights.sum() / args.minibatch_size}
        grads, metrics = jax.lax.psum((grads, metrics), "batch")
        online = agent_state.online.apply_gradients(grads=grads)
        target_params = optax.periodic_update(online.params, agent_state.target_params, online.step,
                                              args.target_update_period)
        return agent_state.replace(online=online, target_params=target_params), metrics, priorities

    def local_update(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        """Per device: append the sequences of its envs to its replay shard, then --replay-ratio x batch gradient
        steps, each sampling by priority from this shard and writing back the new priorities."""
        replay = local_buffer.add(replay, cut_sequences(storage, args.sequence_length))
        if not train:
            return agent_state, replay, {}

        def step(carry, step_key):
            agent_state, replay = carry
            sample = local_buffer.sample(replay, jax.random.fold_in(step_key, jax.lax.axis_index("batch")))
            stored = jnp.where(replay.is_full, capacity, replay.current_index)
            minibatch = Minibatch(sample.experience, stored * sample.probabilities)
            agent_state, metrics, priorities = local_gradient_step(agent_state, minibatch)
            replay = local_buffer.set_priorities(replay, sample.indices, priorities)
            # new sequences get the largest priority of all shards: the same on every device
            tree = replay.sum_tree_state
            replay = replay.replace(sum_tree_state=tree.replace(
                max_recorded_priority=jax.lax.pmax(tree.max_recorded_priority, "batch")))
            return (agent_state, replay), metrics

        (agent_state, replay), metrics = jax.lax.scan(step, (agent_state, replay),
                                                      jax.random.split(key, args.gradient_steps))
        return agent_state, replay, jax.tree.map(jnp.mean, metrics)

    # check_vma=False: flashbax's sum tree mixes per-device and replicated values in its loops, which shard_map's
    # type check refuses; the psums above are explicit (no implicit sum of the gradients either way)
    @partial(jax.jit, static_argnames="train", donate_argnums=(0, 1))
    def update_step(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        return jax.shard_map(partial(local_update, train=train), mesh=mesh, check_vma=False,
                             in_specs=(replicated, replay_specs, rollout_specs, replicated),
                             out_specs=(replicated, replay_specs, replicated))(agent_state, replay, storage, key)

    def update(agent_state: AgentState, replay, storage: Rollout, key, train: bool):
        key, update_key = jax.random.split(key)
        return *update_step(agent_state, replay, storage, update_key, train=train), key

    gradient_step = jax.jit(jax.shard_map(local_gradient_step, mesh=mesh, in_specs=(replicated, minibatch_specs),
                                          out_specs=(replicated, replicated, sharded_samples), check_vma=False))
    return LearnerFns(init_replay, update, gradient_step)


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
    # the first update's sequences are in the replay before its gradient steps sample it
    args.learning_starts_updates = args.learning_starts // args.batch_size
    global_envs, num_learner_devices = args.batch_size // args.num_steps, len(layout.global_learner_devices)
    if args.minibatch_size % num_learner_devices != 0:
        raise UsageError(f"--minibatch-size ({args.minibatch_size}) must be divisible by the number of learner devices "
                         f"of all processes ({num_learner_devices}): each samples its share")
    new_sequences = global_envs * args.num_steps // (args.sequence_length // 2) // num_learner_devices
    if replay_capacity(args, num_learner_devices) < max(new_sequences, args.minibatch_size // num_learner_devices):
        raise UsageError(f"--buffer-size ({args.buffer_size}) must hold the sequences of one update and one minibatch "
                         f"on each learner device ({max(new_sequences, args.minibatch_size // num_learner_devices)} "
                         f"sequences of --sequence-length / 2 = {args.sequence_length // 2} new observations)")
    check_int32_counts(args, {  # the online network's step (its copies into the target), flashbax's running index
        "gradient steps": ("--replay-ratio x env steps per update", args.gradient_steps),
        "sequences written to each learner device's replay": ("env steps per update / (--sequence-length / 2) / "
                                                              "learner devices", new_sequences)})
    check_replay_fits(args.buffer_size, make_replay_buffer(args, num_learner_devices).init, replay_item(args),
                      layout.learner_devices, new_rows=new_sequences)  # before it is allocated


def state_summary(agent_state: AgentState, replay=None) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states. The replay's digest is
    of the whole replay, whatever its layout, the same in every process (each computes the part it holds)."""
    params = (agent_state.online.params, agent_state.target_params)
    replay_digest = "" if replay is None else " replay sha256=" + tree_digest(replay)
    return f"params sha256={tree_digest(params)} optimizer sha256={tree_digest(agent_state.online.opt_state)}{replay_digest}"


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
            train = update_index > args.learning_starts_updates  # the replay is still filling up
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
            "params": to_state_dict(local_value(agent_state.online.params)),  # the Q network: what evaluation needs
        })
    logger.finish()
    run_folder.release()
    shutdown()  # jax.distributed
    # 143 SIGTERM, 130 Ctrl-C; 1: the model, card and video are on disk (see the error above), the upload is missing
    return preemption.exit_code or (0 if upload_succeeded else 1)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
