"""Sebulba MuZero (Schrittwieser et al. 2020, "Mastering Atari, Go, chess and shogi by planning with a learned
model"; Gumbel MuZero: Danihelka et al. 2022, "Policy improvement by planning with Gumbel") for envpool's
discrete-action envs (Atari, classic control, ...), with the tree search on the actor devices and the replay
buffer on the learner devices, sharded along the env axis.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (value transform, n-step
targets, losses, search), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is
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

MuZero: each actor step is one batched tree search (DeepMind's mctx, pure JAX: `gumbel_muzero_policy`, or
`muzero_policy` with `--search muzero`) over all envs of the thread on its actor device, the model one policy
version behind; the rollout stores the search's action weights (the policy target) and root values (the value
bootstrap). The replay (flashbax's trajectory buffer) lives in learner-device memory, sharded along the env axis:
each learner device samples sequences of its own envs, unrolls the model `--unroll-steps` steps and the gradients
are summed with `psum`. `--replay-ratio` fixes the gradient steps per env step, so a seed gives the same run.
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
import mctx
import numpy as np
import optax
import rlax
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
    """with --save-model: evaluate with the search's most weighted action instead of its sampled one"""
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
    Procgen (cleanrl_utils/envs.py); images go into the residual torso, vectors and dicts (flattened) into MLPs"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    search: str = "gumbel"
    """the actors' tree search (mctx): gumbel (Gumbel MuZero, Danihelka et al. 2022) or muzero (PUCT with
    Dirichlet noise at the root, MuZero paper Appendix B)"""
    num_simulations: int = 50
    """simulations of each search (MuZero paper Appendix B and Gumbel MuZero Atari: 50) (in [1, 10000])"""
    max_num_considered_actions: int = 16
    """--search gumbel: actions sampled without replacement at the root (Gumbel MuZero paper and mctx: 16) (positive)"""
    dirichlet_alpha: float = 0.25
    """--search muzero: the root noise's Dirichlet alpha (MuZero paper Appendix C, Atari: 0.25) (positive, finite)"""
    dirichlet_fraction: float = 0.25
    """--search muzero: the root noise's share of the prior (MuZero paper Appendix C: 0.25) (in [0, 1])"""
    temperature: float = 1.0
    """--search muzero: the visit-count temperature of the acted action (MuZero paper Appendix D starts at 1 and
    lowers it to 0.5 and 0.25 later; here it stays fixed) (positive, finite)"""
    unroll_steps: int = 5
    """K: the dynamics' unroll in training (MuZero paper Appendix G: K = 5) (in [1, 100])"""
    td_steps: int = 10
    """n: the steps of the n-step value target (MuZero paper Appendix G, Atari: n = 10) (in [1, 1000])"""
    gamma: float = 0.997
    """the discount factor gamma (MuZero paper Appendix F, Atari: 0.997) (in [0, 1])"""
    support_size: int = 300
    """the value and reward heads' categorical support: 2 x this + 1 bins over [-this, this] after the
    transform h (MuZero paper Appendix F: 601 bins over [-300, 300]) (in [1, 10000])"""
    value_coef: float = 0.25
    """the value loss's weight (MuZero paper Appendix H, Reanalyze: 0.25) (non-negative, finite)"""
    learning_rate: float = 3e-4
    """Adam's learning rate (the paper's Atari runs use SGD with momentum 0.9 and lr 0.05, decayed; Adam is
    what small single-machine runs tolerate) (positive, finite)"""
    weight_decay: float = 1e-4
    """decoupled weight decay (MuZero paper Appendix G: L2 penalty 1e-4) (non-negative, finite)"""
    buffer_size: int = 500_000
    """the replay's capacity in env steps, over all learner devices (Atari frames take 28 kB each: size it to the
    learner devices' memory) (positive)"""
    minibatch_size: int = 1024
    """the sequences of each gradient step, over all learner devices (MuZero paper Appendix G, Atari: 1024) (positive)"""
    replay_ratio: float = 0.0625
    """gradient steps per env step (the paper's Atari runs: about 1 step per 20k frames; this default reuses each
    step (K + 1) x 1024 / 16 times) (positive, finite)"""
    local_num_envs: int = 16
    """the number of parallel game environments of each actor thread: one batched search over all of them (positive)"""
    num_actor_threads: int = 2
    """the number of actor threads on each actor device (positive)"""
    envpool_threads: RunSetting[int] = 0
    """threads stepping each actor thread's envs (0: this process's cores but one, shared by its actor threads; in [0, this machine's cores])"""
    num_steps: int = 32
    """the number of steps of each rollout: 2 threads x 16 envs x 32 steps = 1024 env steps per learner update (positive)"""
    channels: list[int] = field(default_factory=lambda: [128, 256])
    """images: the channels of the torso's two stride-2 convolutions (MuZero paper Appendix G: 128, 256) (positive)"""
    num_blocks: int = 16
    """images: residual blocks of the representation's last stage, of the dynamics and of the prediction
    (MuZero paper Appendix G: 16) (positive)"""
    hiddens: list[int] = field(default_factory=lambda: [256])
    """the hidden layers of the heads, and of every MLP for vector observations (positive)"""
    embedding_size: int = 128
    """vector observations: the hidden state's size (positive)"""

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
    """the updates before the replay holds one whole sequence of each env: the gradient steps start after them"""
    world_size: int = field(init=False, default=1)
    """the number of processes"""
    local_rank: int = field(init=False, default=0)
    """this process's index"""


def sequence_length(args: Args) -> int:
    """Rows of each sampled sequence: K + 1 unroll positions, each with an n-step target looking n rows ahead."""
    return args.unroll_steps + args.td_steps + 1


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    check_flags(args, positive_ints=["local_num_envs", "num_actor_threads", "num_steps", "buffer_size",
                                     "minibatch_size", "max_num_considered_actions", "num_blocks", "embedding_size"],
                positive=["learning_rate", "replay_ratio", "dirichlet_alpha", "temperature"],
                non_negative=["value_coef", "weight_decay"], unit_interval=["gamma", "dirichlet_fraction"],
                positive_int_lists=["channels", "hiddens"],
                ranges={"total_timesteps": (1, 2**53), "num_simulations": (1, 10_000), "unroll_steps": (1, 100),
                        "td_steps": (1, 1000), "support_size": (1, 10_000)})
    if args.search not in ("gumbel", "muzero"):
        raise UsageError(f"--search must be gumbel or muzero, got {args.search!r}")
    if len(args.channels) != 2:
        raise UsageError(f"--channels must be two positive integers (the torso's two stride-2 convolutions), "
                         f"got {args.channels}")
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
    if args.local_num_envs % len(args.learner_device_ids) != 0:
        raise UsageError(f"--local-num-envs ({args.local_num_envs}) must be divisible by the number of "
                         f"--learner-device-ids ({len(args.learner_device_ids)}): each actor thread splits its envs over them")
    check_save_model_flags(args, __file__)  # --capture-video, --upload-model: checked before training


# ---------------------------------------------------------------- environments


def make_env(env_id: str, seed: int, num_envs: int, render_mode: str | None = None, num_threads: int = 0,
             env_options: Sequence[str] = ()):
    """envpool gymnasium envs with the family's cited options, dict observations flattened (cleanrl_utils/envs.py);
    env i is seeded with seed + i; render_mode="rgb_array" makes envs.render() return env 0's frame (videos).
    Atari's rewards are clipped to [-1, 1] there (IMPALA's setup; the MuZero paper does not clip: its transform h
    handles large rewards)."""
    return make_envpool(env_id, seed, num_envs, render_mode=render_mode, num_threads=num_threads,
                        overrides=env_options)


# ---------------------------------------------------------------- networks


def scale_hidden(hidden):
    """Min-max scale each hidden state to [0, 1] (MuZero paper Appendix G: the same range as the action input)."""
    flat = hidden.reshape(hidden.shape[0], -1)
    low, high = flat.min(-1), flat.max(-1)
    shape = (-1,) + (1,) * (hidden.ndim - 1)
    return (hidden - low.reshape(shape)) / jnp.maximum(high - low, 1e-6).reshape(shape)


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


class MLP(nn.Module):
    """ReLU MLP for vector observations and for the heads."""

    hiddens: Sequence[int]

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32)
        for hidden in self.hiddens:
            x = nn.relu(nn.Dense(hidden)(x))
        return x


class Representation(nn.Module):
    """Observation -> hidden state. Images: the MuZero paper's Atari torso (Appendix G: stride-2 conv, blocks,
    stride-2 conv, blocks, two stride-2 average poolings with blocks: 84 x 84 -> 6 x 6), one residual block
    between the downsamplings instead of 2, 3, 3 (they run at the highest resolutions), then --num-blocks blocks;
    no batch norm (it would tie the search's batch together). Vectors: an MLP."""

    channels: Sequence[int]
    num_blocks: int
    hiddens: Sequence[int]
    embedding_size: int
    obs_layout: str  # cleanrl_utils.envs.obs_layout: "chw" or "hwc" images, or "vector"

    @nn.compact
    def __call__(self, obs):
        if self.obs_layout == "vector":
            return scale_hidden(nn.Dense(self.embedding_size)(MLP(self.hiddens)(obs)))
        x = (jnp.transpose(obs, (0, 2, 3, 1)) if self.obs_layout == "chw" else obs).astype(jnp.float32) / 255.0
        x = ResidualBlock(self.channels[0])(nn.Conv(self.channels[0], (3, 3), strides=(2, 2))(x))
        x = ResidualBlock(self.channels[1])(nn.Conv(self.channels[1], (3, 3), strides=(2, 2))(x))
        x = ResidualBlock(self.channels[1])(nn.avg_pool(x, (3, 3), strides=(2, 2), padding="SAME"))
        x = nn.avg_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for _ in range(self.num_blocks):
            x = ResidualBlock(self.channels[1])(x)
        return scale_hidden(x)


class Dynamics(nn.Module):
    """(hidden state, action) -> (next hidden state, reward logits). Images: the action as one-hot planes
    concatenated to the hidden state (as the paper's board games), a conv, --num-blocks blocks."""

    action_dim: int
    num_blocks: int
    hiddens: Sequence[int]
    num_bins: int

    @nn.compact
    def __call__(self, hidden, action):
        one_hot = jax.nn.one_hot(action, self.action_dim)
        if hidden.ndim == 2:
            x = MLP(self.hiddens)(jnp.concatenate([hidden, one_hot], axis=-1))
            next_hidden = nn.Dense(hidden.shape[-1])(x)
        else:
            planes = jnp.broadcast_to(one_hot[:, None, None, :], (*hidden.shape[:3], self.action_dim))
            x = nn.Conv(hidden.shape[-1], (3, 3))(jnp.concatenate([hidden, planes], axis=-1))
            for _ in range(self.num_blocks):
                x = ResidualBlock(hidden.shape[-1])(x)
            next_hidden = x
            x = x.reshape((x.shape[0], -1))
        # zero-initialized heads: the first predictions are the support's middle (0), not noise
        reward_logits = nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)(MLP(self.hiddens)(x))
        return scale_hidden(next_hidden), reward_logits


class Prediction(nn.Module):
    """Hidden state -> (policy logits, value logits)."""

    action_dim: int
    num_blocks: int
    hiddens: Sequence[int]
    num_bins: int

    @nn.compact
    def __call__(self, hidden):
        x = hidden
        if hidden.ndim == 4:
            for _ in range(self.num_blocks):
                x = ResidualBlock(hidden.shape[-1])(x)
            x = nn.relu(x).reshape((x.shape[0], -1))
        x = MLP(self.hiddens)(x)
        return (nn.Dense(self.action_dim, kernel_init=nn.initializers.zeros)(x),
                nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)(x))


class MuZeroNet(nn.Module):
    """The three functions of the MuZero paper (Sec. 3): h (represent), g (dynamics), f (predict)."""

    action_dim: int
    channels: Sequence[int]
    num_blocks: int
    hiddens: Sequence[int]
    embedding_size: int
    num_bins: int
    obs_layout: str

    def setup(self):
        self.representation = Representation(self.channels, self.num_blocks, self.hiddens, self.embedding_size,
                                             self.obs_layout)
        self.dynamics_net = Dynamics(self.action_dim, self.num_blocks, self.hiddens, self.num_bins)
        self.prediction = Prediction(self.action_dim, self.num_blocks, self.hiddens, self.num_bins)

    def __call__(self, obs, action):  # for init: touches every parameter
        hidden = self.represent(obs)
        return self.predict(self.dynamics(hidden, action)[0])

    def represent(self, obs):
        return self.representation(obs)

    def dynamics(self, hidden, action):
        return self.dynamics_net(hidden, action)

    def predict(self, hidden):
        return self.prediction(hidden)


def make_agent(args: Args, key: jax.Array) -> tuple[MuZeroNet, TrainState]:
    """The network for --env-id and its training state (params and optimizer), on the host."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    agent = MuZeroNet(int(action_space.n), tuple(args.channels), args.num_blocks, tuple(args.hiddens),
                      args.embedding_size, 2 * args.support_size + 1, obs_layout(args.env_id))
    params = agent.init(key, np.zeros((1, *obs_space.shape), obs_space.dtype), np.zeros(1, np.int32))
    return agent, TrainState.create(apply_fn=None, params=params,
                                    tx=optax.adamw(args.learning_rate, weight_decay=args.weight_decay))


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One actor thread's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1.
    Row t holds the observation the search ran on. envpool returns an episode's true last observation with its end
    flag and resets on the next step: that reset step's row holds the last observation (its search value is the
    bootstrap of a truncation) and is not `valid` (its action is ignored, it is never a sequence's root)."""

    obs: np.ndarray
    actions: np.ndarray
    action_weights: np.ndarray  # the search's improved policy: the policy target
    root_values: np.ndarray  # the search's value of the root: the n-step targets' bootstrap
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray


def scalar_to_two_hot(x, support_size: int):
    """The invertible transform h(x) = sign(x)(sqrt(|x| + 1) - 1) + 0.001 x (MuZero paper Appendix F, from Pohlen
    et al. 2018), then two-hot over the integers in [-support_size, support_size] (rlax)."""
    return rlax.transform_to_2hot(rlax.signed_hyperbolic(x, 1e-3), -support_size, support_size, 2 * support_size + 1)


def logits_to_scalar(logits, support_size: int):
    """The expected value over the support, then h^-1 (rlax.signed_parabolic)."""
    return rlax.signed_parabolic(rlax.transform_from_2hot(jax.nn.softmax(logits), -support_size, support_size,
                                                          2 * support_size + 1), 1e-3)


def n_step_value_targets(*, rewards, root_values, terminations, truncations, gamma, td_steps):
    """z_t = r_t + ... + gamma^(n-1) r_(t+n-1) + gamma^n v_(t+n) (MuZero paper Eq. 4 / Appendix G) on (..., T) rows,
    for the first T - n rows. A termination ends the sum (no bootstrap); a time-limit truncation at row j
    bootstraps from row j+1's root value (envpool's reset row holds the true last observation).

    Bootstrap: the root values the actors' searches stored, as in the MuZero paper (the search value of the
    position n steps later); a target network (MuZero Reanalyze) would need one more model pass over every
    sampled sequence per gradient step, the costliest part on CPU. The price: stored values are as old as the
    replay (the paper's staleness too)."""
    num_targets = rewards.shape[-1] - td_steps
    rows = lambda x, i: x[..., i : i + num_targets]
    targets = jnp.zeros(rewards.shape[:-1] + (num_targets,))
    alive = jnp.ones_like(targets)  # no episode end among the rows summed so far
    for i in range(td_steps):
        targets += alive * gamma**i * rows(rewards, i)
        truncated = alive * rows(truncations, i) * (1.0 - rows(terminations, i))
        targets += truncated * gamma ** (i + 1) * rows(root_values, i + 1)
        alive = alive * (1.0 - rows(terminations, i)) * (1.0 - rows(truncations, i))
    return targets + alive * gamma**td_steps * rows(root_values, td_steps)


class Targets(NamedTuple):
    """The unroll's targets of a sequence batch, (batch, K + 1, ...); index 0 of the reward fields is unused."""

    values: jax.Array
    value_weights: jax.Array
    rewards: jax.Array
    reward_weights: jax.Array
    policies: jax.Array
    policy_weights: jax.Array


def unroll_targets(sequences: Rollout, *, unroll_steps, td_steps, gamma) -> Targets:
    """Targets of positions 0..K of sequences (batch, K + n + 1) whose row 0 is the root. After a termination the
    model is in an absorbing state (MuZero paper Appendix G: value and reward targets 0; its policy is not
    trained); after a truncation the game went on unseen: no target. A root on envpool's reset row trains nothing."""
    K = unroll_steps
    z = n_step_value_targets(rewards=sequences.rewards, root_values=sequences.root_values,
                             terminations=sequences.terminations, truncations=sequences.truncations, gamma=gamma,
                             td_steps=td_steps)[:, : K + 1]
    ends = jnp.maximum(sequences.terminations, sequences.truncations)[:, :K]
    # alive[k]: no episode end in rows 0..k-1; absorbing[k]: the first end before k was a termination
    alive = jnp.concatenate([jnp.ones_like(ends[:, :1]), jnp.cumprod(1.0 - ends, axis=1)], axis=1)
    absorbing = jnp.concatenate([jnp.zeros_like(ends[:, :1]),
                                 jnp.cumsum(alive[:, :K] * sequences.terminations[:, :K], axis=1)], axis=1)
    root = sequences.valid[:, :1].astype(jnp.float32)
    # reward of step k (k >= 1): row k-1's, taken alive at k-1
    step_rewards = jnp.concatenate([jnp.zeros_like(ends[:, :1]), sequences.rewards[:, :K]], axis=1)
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :K]], axis=1)
    return Targets(values=alive * z, value_weights=root * (alive + absorbing),
                   rewards=shift(alive) * step_rewards, reward_weights=root * (shift(alive) + shift(absorbing)),
                   policies=sequences.action_weights[:, : K + 1], policy_weights=root * alive)


def muzero_loss_terms(*, policy_logits, value_logits, reward_logits, targets: Targets, support_size, normalizer):
    """Cross-entropies of the unroll's K + 1 positions (MuZero paper Eq. 1): policy to the search weights, value
    and reward to the two-hot of h(target); each term of positions 1..K scaled by 1/K (paper Appendix G), summed
    over the batch / normalizer (the global count of valid roots). Returns (policy, value, reward) losses."""
    K = policy_logits.shape[1] - 1
    position_scale = jnp.concatenate([jnp.ones(1), jnp.full(K, 1.0 / K)])
    cross_entropy = lambda target, logits: -(target * jax.nn.log_softmax(logits)).sum(-1)
    policy = cross_entropy(targets.policies, policy_logits) * targets.policy_weights
    value = cross_entropy(scalar_to_two_hot(targets.values, support_size), value_logits) * targets.value_weights
    reward = cross_entropy(scalar_to_two_hot(targets.rewards, support_size), reward_logits) * targets.reward_weights
    reward = reward.at[:, 0].set(0.0)  # position 0 has no reward (its logits are placeholders)
    return tuple((x * position_scale).sum() / normalizer for x in (policy, value, reward))


def unroll_model(params, *, agent: MuZeroNet, obs, actions):
    """Represent the root, then K dynamics steps with the stored actions; returns the logits of positions 0..K."""
    hidden = agent.apply(params, obs, method=MuZeroNet.represent)
    policy_logits, value_logits = agent.apply(params, hidden, method=MuZeroNet.predict)
    outputs = [(policy_logits, value_logits, jnp.zeros_like(value_logits))]
    for k in range(actions.shape[1]):
        hidden = 0.5 * hidden + 0.5 * jax.lax.stop_gradient(hidden)  # paper Appendix G: gradient into g halved
        hidden, reward_logits = agent.apply(params, hidden, actions[:, k], method=MuZeroNet.dynamics)
        outputs.append((*agent.apply(params, hidden, method=MuZeroNet.predict), reward_logits))
    return tuple(jnp.stack(x, axis=1) for x in zip(*outputs))


class SearchConfig(NamedTuple):
    search: str
    num_simulations: int
    max_num_considered_actions: int
    dirichlet_alpha: float
    dirichlet_fraction: float
    temperature: float


def search_config(args: Args) -> SearchConfig:
    return SearchConfig(args.search, args.num_simulations, args.max_num_considered_actions, args.dirichlet_alpha,
                        args.dirichlet_fraction, args.temperature)


def run_search(params, key, root: mctx.RootFnOutput, recurrent_fn: Callable, config: SearchConfig):
    """One batched mctx search: (action, action weights, root value) of each batch row."""
    if config.search == "gumbel":
        output = mctx.gumbel_muzero_policy(params, key, root, recurrent_fn, config.num_simulations,
                                           max_num_considered_actions=config.max_num_considered_actions)
    else:
        output = mctx.muzero_policy(params, key, root, recurrent_fn, config.num_simulations,
                                    dirichlet_alpha=config.dirichlet_alpha,
                                    dirichlet_fraction=config.dirichlet_fraction, temperature=config.temperature)
    return output.action, output.action_weights, output.search_tree.summary().value


def model_search(params, obs, key, *, agent: MuZeroNet, config: SearchConfig, gamma, support_size):
    """The search on the learned model: root from h and f, every simulation's step from g and f. The model has no
    episode end: the search discounts every step by gamma (as in the paper)."""
    hidden = agent.apply(params, obs, method=MuZeroNet.represent)
    prior_logits, value_logits = agent.apply(params, hidden, method=MuZeroNet.predict)
    root = mctx.RootFnOutput(prior_logits=prior_logits, value=logits_to_scalar(value_logits, support_size),
                             embedding=hidden)

    def recurrent_fn(params, key, action, hidden):
        next_hidden, reward_logits = agent.apply(params, hidden, action, method=MuZeroNet.dynamics)
        prior_logits, value_logits = agent.apply(params, next_hidden, method=MuZeroNet.predict)
        return mctx.RecurrentFnOutput(reward=logits_to_scalar(reward_logits, support_size),
                                      discount=jnp.full(action.shape, gamma, jnp.float32), prior_logits=prior_logits,
                                      value=logits_to_scalar(value_logits, support_size)), next_hidden

    return run_search(params, key, root, recurrent_fn, config)


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> V(obs) for the rollout's bootstrap; None where the learner values it


def make_actor_fns(agent: MuZeroNet, args: Args) -> ActorFns:
    @jax.jit
    def act(params, obs, key):
        """One search over all the thread's envs on the actor device."""
        key, subkey = jax.random.split(key)
        action, action_weights, root_value = model_search(params, obs, subkey, agent=agent, config=search_config(args),
                                                          gamma=args.gamma, support_size=args.support_size)
        # one array: one device-to-host copy per env step (float32 holds action ids exactly)
        return jnp.concatenate([action[:, None].astype(jnp.float32), root_value[:, None], action_weights], axis=1), key

    return ActorFns(act, None)


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
    """The actor thread: steps its envpool, searches on `actor_device`, ships rollouts to the learner."""
    global_thread_index = args.local_rank * len(args.actor_device_ids) * args.num_actor_threads + thread_index
    envs = make_envs(actor_env_seed(args.seed, start_update, global_thread_index, args.local_num_envs))
    key = jax.device_put(jax.random.fold_in(jax.random.fold_in(key, start_update), global_thread_index), actor_device)
    num_envs, num_steps = args.local_num_envs, args.num_steps
    obs_space, action_dim = envs.observation_space, int(envs.action_space.n)
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
        action_weights = np.empty((num_steps, num_envs, action_dim), dtype=np.float32)
        root_values = np.empty((num_steps, num_envs), dtype=np.float32)
        rewards = np.empty((num_steps, num_envs), dtype=np.float32)
        terminations = np.empty((num_steps, num_envs), dtype=np.float32)
        truncations = np.empty((num_steps, num_envs), dtype=np.float32)
        valid = np.empty((num_steps, num_envs), dtype=bool)
        for step in range(num_steps):
            if stop_event.is_set():  # another thread failed, or Ctrl-C: do not finish a long rollout
                raise RunStopped
            inference_start = time.time()
            search_output, key = actor_fns.act(params, next_obs, key)
            search_output = np.asarray(search_output)
            action = search_output[:, 0].astype(np.int32)
            env_step_start = time.time()
            inference_time += env_step_start - inference_start
            step_obs, reward, terminated, truncated, info = envs.step(action)
            storage_start = time.time()
            env_step_time += storage_start - env_step_start
            obs[step], actions[step], root_values[step], action_weights[step] = (next_obs, action, search_output[:, 1],
                                                                                 search_output[:, 2:])
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

        storage = Rollout(obs=obs, actions=actions, action_weights=action_weights, root_values=root_values,
                          rewards=rewards, terminations=terminations, truncations=truncations, valid=valid)
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
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: the same search as in
    training; greedy takes the action of the largest search weight, otherwise the search's own (sampled) action."""
    agent, _ = make_agent(args, jax.random.key(0))
    params = jax.tree.map(jnp.asarray, model["params"])

    @jax.jit
    def act(params, obs, key):
        key, subkey = jax.random.split(key)
        action, action_weights, _ = model_search(params, obs, subkey, agent=agent, config=search_config(args),
                                                 gamma=args.gamma, support_size=args.support_size)
        return (jnp.argmax(action_weights, axis=-1) if greedy else action), key

    def policy(obs: np.ndarray, key: jax.Array):
        actions, key = act(params, obs, key)
        return np.asarray(actions), key

    return policy


# ---------------------------------------------------------------- learner


class LearnerFns(NamedTuple):
    init_replay: Callable  # () -> the empty replay, sharded along the env axis over the mesh
    update: Callable  # (agent_state, replay, rollout, key, train) -> (agent_state, replay, metrics, key)
    gradient_step: Callable  # (agent_state, sequences) -> (agent_state, metrics): one step on a given global minibatch


def make_replay_buffer(args: Args, num_learner_devices: int, global_envs: int, local: bool):
    """flashbax's trajectory buffer (sequences of K + n + 1 consecutive rows of one env, never across the write
    position) of one learner device (`local`: the envs of its shard, its share of each minibatch) or of the whole
    mesh (to create it). Each env keeps its newest --buffer-size / envs rows."""
    envs = global_envs // num_learner_devices if local else global_envs
    return flashbax.make_trajectory_buffer(
        add_batch_size=envs, sample_batch_size=args.minibatch_size // num_learner_devices if local else args.minibatch_size,
        sample_sequence_length=sequence_length(args), period=1, min_length_time_axis=sequence_length(args),
        max_length_time_axis=args.buffer_size // global_envs)


def replay_item(args: Args) -> Rollout:
    """One row of one env as the replay stores it."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    return Rollout(obs=jnp.zeros(obs_space.shape, obs_space.dtype), actions=jnp.int32(0),
                   action_weights=jnp.zeros(int(action_space.n)), root_values=jnp.float32(0), rewards=jnp.float32(0),
                   terminations=jnp.float32(0), truncations=jnp.float32(0), valid=jnp.bool_(False))


def make_learner_fns(args: Args, agent: MuZeroNet, mesh: Mesh) -> LearnerFns:
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices; each device keeps
    the replay shard of its envs, samples its part of every minibatch, and the gradients are summed with `psum`."""
    replicated, sharded_envs, sharded_samples = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    sequence_specs = Rollout(*([sharded_samples] * len(Rollout._fields)))
    replay_specs = flashbax.buffers.trajectory_buffer.TrajectoryBufferState(
        experience=sequence_specs, current_index=replicated, is_full=replicated)
    num_devices, global_envs = mesh.devices.size, args.batch_size // args.num_steps
    local_buffer = make_replay_buffer(args, num_devices, global_envs, local=True)
    names = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/reward_loss"]

    def init_replay():
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), replay_specs)
        return jax.jit(make_replay_buffer(args, num_devices, global_envs, local=False).init,
                       out_shardings=shardings)(replay_item(args))

    def loss_fn(params, sequences: Rollout, normalizer):
        targets = unroll_targets(sequences, unroll_steps=args.unroll_steps, td_steps=args.td_steps, gamma=args.gamma)
        policy_logits, value_logits, reward_logits = unroll_model(params, agent=agent, obs=sequences.obs[:, 0],
                                                                  actions=sequences.actions[:, : args.unroll_steps])
        policy_loss, value_loss, reward_loss = muzero_loss_terms(
            policy_logits=policy_logits, value_logits=value_logits, reward_logits=reward_logits, targets=targets,
            support_size=args.support_size, normalizer=normalizer)
        loss = policy_loss + args.value_coef * value_loss + reward_loss
        return loss, (loss, policy_loss, value_loss, reward_loss)

    def local_gradient_step(agent_state: TrainState, sequences: Rollout):
        """One MuZero step (paper Appendix G) on this device's sequences; the loss is the global mean over roots."""
        normalizer = jnp.maximum(jax.lax.psum(sequences.valid[:, 0].sum(), "batch"), 1).astype(jnp.float32)
        # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
        # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
        local_params = jax.lax.pcast(agent_state.params, "batch", to="varying")
        grads, metrics = jax.grad(loss_fn, has_aux=True)(local_params, sequences, normalizer)
        grads, metrics = jax.lax.psum((grads, metrics), "batch")
        return agent_state.apply_gradients(grads=grads), dict(zip(names, metrics))

    def local_update(agent_state: TrainState, replay, storage: Rollout, key, train: bool):
        """Per device: append its envs' rollout to its replay shard, then --replay-ratio x batch gradient steps."""
        replay = local_buffer.add(replay, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), storage))  # (envs, T, ...)
        if not train:
            return agent_state, replay, {}

        def step(agent_state, step_key):
            sample_key = jax.random.fold_in(step_key, jax.lax.axis_index("batch"))
            return local_gradient_step(agent_state, local_buffer.sample(replay, sample_key).experience)

        agent_state, metrics = jax.lax.scan(step, agent_state, jax.random.split(key, args.gradient_steps))
        return agent_state, replay, jax.tree.map(jnp.mean, metrics)

    @partial(jax.jit, static_argnames="train", donate_argnums=(0, 1))
    def update_step(agent_state: TrainState, replay, storage: Rollout, key, train: bool):
        return jax.shard_map(partial(local_update, train=train), mesh=mesh,
                             in_specs=(replicated, replay_specs, rollout_specs, replicated),
                             out_specs=(replicated, replay_specs, replicated))(agent_state, replay, storage, key)

    def update(agent_state: TrainState, replay, storage: Rollout, key, train: bool):
        key, update_key = jax.random.split(key)
        return *update_step(agent_state, replay, storage, update_key, train=train), key

    gradient_step = jax.jit(jax.shard_map(local_gradient_step, mesh=mesh, in_specs=(replicated, sequence_specs),
                                          out_specs=(replicated, replicated)))
    return LearnerFns(init_replay, update, gradient_step)


@jax.jit
def end_stored_episodes(replay):
    """After a resume the actors start new episodes: the newest stored row of each env is followed by a new
    episode's first row. Mark the row before it truncated (its n-step targets bootstrap from the newest row's stored
    root value, the search value of that observation) and the newest row not valid (never a root)."""
    length = replay.experience.valid.shape[1]
    newest, before = (replay.current_index - 1) % length, (replay.current_index - 2) % length
    experience = replay.experience
    return replay.replace(experience=experience._replace(
        valid=experience.valid.at[:, newest].set(False), truncations=experience.truncations.at[:, before].set(1.0)))


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
    # learning starts in the first update after which every env's replay rows hold one whole sequence (K + n + 1)
    args.learning_starts_updates = -(-sequence_length(args) // args.num_steps) - 1
    global_envs, num_learner_devices = args.batch_size // args.num_steps, len(layout.global_learner_devices)
    if args.minibatch_size % num_learner_devices != 0:
        raise UsageError(f"--minibatch-size ({args.minibatch_size}) must be divisible by the number of learner devices "
                         f"of all processes ({num_learner_devices}): each samples its share")
    rows = args.buffer_size // global_envs
    if rows < max(args.num_steps, sequence_length(args)):
        raise UsageError(f"--buffer-size ({args.buffer_size}) must hold at least max(--num-steps, --unroll-steps + "
                         f"--td-steps + 1) = {max(args.num_steps, sequence_length(args))} steps of each of the "
                         f"{global_envs} envs: the sampled sequences are longer than the stored ones ({rows} rows)")
    check_int32_counts(args, {"gradient steps": ("--replay-ratio x env steps per update", args.gradient_steps)})
    check_replay_fits(args.buffer_size, make_replay_buffer(args, num_learner_devices, global_envs, local=True).init,
                      replay_item(args), layout.learner_devices, new_rows=max(args.num_steps, sequence_length(args)))


def state_summary(agent_state: TrainState, replay=None) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states. The replay's digest is
    of the whole replay, whatever its layout, the same in every process (each computes the part it holds)."""
    replay_digest = "" if replay is None else " replay sha256=" + tree_digest(replay)
    return (f"params sha256={tree_digest(agent_state.params)} optimizer sha256={tree_digest(agent_state.opt_state)}"
            f"{replay_digest}")


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
    actors, actor_fns = ActorThreads(stop_event), make_actor_fns(agent, args)
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
            train = update_index > args.learning_starts_updates  # no whole sequence in the replay yet
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
            "params": to_state_dict(local_value(agent_state.params)),  # the model: the search needs all of it
        })
    logger.finish()
    run_folder.release()
    shutdown()  # jax.distributed
    # 143 SIGTERM, 130 Ctrl-C; 1: the model, card and video are on disk (see the error above), the upload is missing
    return preemption.exit_code or (0 if upload_succeeded else 1)


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
