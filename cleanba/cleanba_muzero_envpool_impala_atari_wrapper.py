"""Sebulba MuZero (Schrittwieser et al. 2020, "Mastering Atari, Go, chess and shogi by planning with a learned
model"; Gumbel MuZero: Danihelka et al. 2022, "Policy improvement by planning with Gumbel") for envpool's
discrete-action envs (Atari, classic control, ...), with the tree search on the actor devices and the replay
buffer on the learner devices, sharded along the env axis.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (value transform, n-step targets,
losses, search), the actor thread, the learner update, and `main`: the Sebulba protocol itself. What is the same for
every algorithm (checkpoints, preemption, device layout, logging, stop-aware queues) comes from cleanrl_utils/, one
small module each.

System in one paragraph: `--num-actor-threads` threads on each of `--actor-device-ids` step their own envpool and run
jitted inference on their actor device. Each thread hands its rollout to the learner through its own size-1
`rollout_queue`, already split along the env axis and placed on the learner devices (cleanrl_utils/data_path.py); the
learner answers through a size-1 `params_queue` per thread. Because the actor skips one `params_queue.get()` (its second
rollout), from update 2 on it acts with the policy one version behind the learner's (update 1's: the initial params,
lag 0; `--no-concurrency`: no skip, lag 0, no overlap). The learner is data-parallel over every process's learner
devices (`jax.jit` + `shard_map` over a 1-D mesh, gradients summed with `psum`), so `--distributed` scales it.

MuZero: each actor step is one batched tree search (DeepMind's mctx: `gumbel_muzero_policy`, or `muzero_policy`
with `--search muzero`) over the thread's envs, the model one policy version behind; the rollout stores its action
weights (the policy target) and root values (the value bootstrap). Each learner device samples sequences of its own
envs from its replay shard (flashbax's trajectory buffer) and unrolls the model `--unroll-steps` steps.
`--replay-ratio` fixes the gradient steps per env step, so a seed gives the same run.
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
import mctx
import numpy as np
import optax
import rlax
from flax.serialization import to_state_dict
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.actors import ActorThread
from cleanrl_utils.checkpoints import tree_digest
from cleanrl_utils.cli import run_cli
from cleanrl_utils.data_path import assemble_global_rollout, split_for_learners
from cleanrl_utils.devices import DeviceLayout, local_value, replicate
from cleanrl_utils.envs import check_env_id, env_spaces, make_envpool, obs_layout
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import SebulbaArgs, check_flags, check_int32_counts, check_run_flags
from cleanrl_utils.jax_envs import strongly_typed
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
class Args(SebulbaArgs):  # the run's and Sebulba's flags (cleanrl_utils/flags.py), then MuZero's
    env_id: str = "Breakout-v5"
    """the id of an envpool env with discrete actions: Atari, classic control, Football, VizDoom, MiniGrid,
    Procgen (cleanrl_utils/envs.py); images go into the residual torso, vectors and dicts (flattened) into MLPs"""
    env_options: list[str] = field(default_factory=list)
    """envpool options of --env-id as KEY=VALUE, over its family's cited ones (cleanrl_utils/envs.py), e.g.
    img_height=42 img_width=42 stack_num=1 for cheaper VizDoom frames (KEY: one of envpool's options of the id)"""
    total_timesteps: int = 10_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    search: Literal["gumbel", "muzero"] = "gumbel"
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
    """the sequences of each gradient step, over all learner devices (MuZero paper Appendix G, Atari: 1024)
    (positive)"""
    replay_ratio: float = 0.0625
    """gradient steps per env step (the paper's Atari runs: about 1 step per 20k frames; this default reuses each
    step (K + 1) x 1024 / 16 times) (positive, finite)"""
    local_num_envs: int = 16
    """the number of parallel game environments of each actor thread: one batched search over all of them (positive)"""
    num_steps: int = 32
    """the number of steps of each rollout: 2 threads x 16 envs x 32 steps = 1024 env steps per learner update
    (positive)"""
    channels: list[int] = field(default_factory=lambda: [128, 256])
    """images: the channels of the torso's two stride-2 convolutions (MuZero paper Appendix G: 128, 256) (positive)"""
    num_blocks: int = 16
    """images: residual blocks of the representation's last stage, of the dynamics and of the prediction
    (MuZero paper Appendix G: 16) (positive)"""
    hiddens: list[int] = field(default_factory=lambda: [256])
    """the hidden layers of the heads, and of every MLP for vector observations (positive)"""
    embedding_size: int = 128
    """vector observations: the hidden state's size (positive)"""

    # derived when the run starts (set_runtime_values), not flags
    gradient_steps: int = field(init=False, default=0)
    """gradient steps per learner update: --replay-ratio x batch_size"""
    learning_starts_updates: int = field(init=False, default=0)
    """the updates before the replay holds one whole sequence of each env: the gradient steps start after them"""


def sequence_length(args: Args) -> int:
    """Rows of each sampled sequence: K + 1 unroll positions, each with an n-step target looking n rows ahead."""
    return args.unroll_steps + args.td_steps + 1


def validate_args(args: Args):
    """Checks that need no device: run before JAX starts any backend (a UsageError names the flag)."""
    check_run_flags(args)
    ranges = dict(num_simulations=(1, 10_000), unroll_steps=(1, 100), td_steps=(1, 1000), support_size=(1, 10_000))
    check_flags(
        args,
        positive_ints=[
            "local_num_envs",
            "num_steps",
            "buffer_size",
            "minibatch_size",
            "max_num_considered_actions",
            "num_blocks",
            "embedding_size",
        ],
        positive=["learning_rate", "replay_ratio", "dirichlet_alpha", "temperature"],
        non_negative=["value_coef", "weight_decay"],
        unit_interval=["gamma", "dirichlet_fraction"],
        positive_int_lists=["channels", "hiddens"],
        ranges=ranges,
    )
    if len(args.channels) != 2:
        raise UsageError(
            f"--channels must be two positive integers (the torso's two stride-2 convolutions), got {args.channels}"
        )
    # one line if the family is not ours, an option is not its own, or it cannot start here
    check_env_id(args.env_id, discrete=True, env_options=args.env_options)
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
    env i is seeded with seed + i; render_mode="rgb_array" makes envs.render() return env 0's frame (videos).
    Atari's rewards are clipped to [-1, 1] there (IMPALA's setup; the MuZero paper does not clip: its transform h
    handles large rewards)."""
    return make_envpool(env_id, seed, num_envs, render_mode=render_mode, num_threads=num_threads, overrides=env_options)


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
    """ReLU MLP with flax's default init, on float32 inputs."""

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
        if self.obs_layout == "chw":
            obs = jnp.transpose(obs, (0, 2, 3, 1))
        x = obs.astype(jnp.float32) / 255.0
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
            next_hidden, x = x, x.reshape((x.shape[0], -1))
        # zero-initialized heads: the first predictions are the support's middle (0), not noise
        reward_hidden = MLP(self.hiddens)(x)
        reward_logits = nn.Dense(self.num_bins, kernel_init=nn.initializers.zeros)(reward_hidden)
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
        head = lambda size: nn.Dense(size, kernel_init=nn.initializers.zeros)(x)
        return head(self.action_dim), head(self.num_bins)


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
        self.representation = Representation(
            self.channels, self.num_blocks, self.hiddens, self.embedding_size, self.obs_layout
        )
        self.dynamics_net = Dynamics(self.action_dim, self.num_blocks, self.hiddens, self.num_bins)
        self.prediction = Prediction(self.action_dim, self.num_blocks, self.hiddens, self.num_bins)

    def __call__(self, obs, action):  # for init: touches every parameter
        return self.predict(self.dynamics(self.represent(obs), action)[0])

    def represent(self, obs):
        return self.representation(obs)

    def dynamics(self, hidden, action):
        return self.dynamics_net(hidden, action)

    def predict(self, hidden):
        return self.prediction(hidden)


def make_agent(args: Args, key: jax.Array) -> tuple[MuZeroNet, TrainState]:
    """The network for --env-id and its training state (params and optimizer), on the host."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    agent = MuZeroNet(
        int(action_space.n),
        tuple(args.channels),
        args.num_blocks,
        tuple(args.hiddens),
        args.embedding_size,
        2 * args.support_size + 1,
        obs_layout(args.env_id),
    )
    params = agent.init(key, np.zeros((1, *obs_space.shape), obs_space.dtype), np.zeros(1, np.int32))
    tx = optax.adamw(args.learning_rate, weight_decay=args.weight_decay)
    # the step an int32 array, as a checkpoint restores it (not a Python 0): fresh or resumed, one update program
    return agent, TrainState.create(apply_fn=None, params=params, tx=tx).replace(step=jnp.int32(0))


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
    mean = rlax.transform_from_2hot(jax.nn.softmax(logits), -support_size, support_size, 2 * support_size + 1)
    return rlax.signed_parabolic(mean, 1e-3)


def n_step_value_targets(*, rewards, root_values, terminations, truncations, gamma, td_steps):
    """z_t = r_t + ... + gamma^(n-1) r_(t+n-1) + gamma^n v_(t+n) (MuZero paper Eq. 4 / Appendix G) on (..., T) rows,
    for the first T - n rows. A termination ends the sum (no bootstrap); a time-limit truncation at row j
    bootstraps from row j+1's root value (envpool's reset row holds the true last observation).

    Bootstrap: the root values the actors' searches stored, as in the MuZero paper; a target network (MuZero
    Reanalyze) would need one more model pass per sampled sequence and gradient step
    (docs/rl-algorithms/muzero.md#implementation-details)."""
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
    rows = {name: getattr(sequences, name) for name in ("rewards", "root_values", "terminations", "truncations")}
    z = n_step_value_targets(**rows, gamma=gamma, td_steps=td_steps)[:, : K + 1]
    ends = jnp.maximum(sequences.terminations, sequences.truncations)[:, :K]
    # alive[k]: no episode end in rows 0..k-1; absorbing[k]: the first end before k was a termination
    alive = jnp.concatenate([jnp.ones_like(ends[:, :1]), jnp.cumprod(1.0 - ends, axis=1)], axis=1)
    absorbing = jnp.concatenate(
        [jnp.zeros_like(ends[:, :1]), jnp.cumsum(alive[:, :K] * sequences.terminations[:, :K], axis=1)], axis=1
    )
    root = sequences.valid[:, :1].astype(jnp.float32)
    # reward of step k (k >= 1): row k-1's, taken alive at k-1
    step_rewards = jnp.concatenate([jnp.zeros_like(ends[:, :1]), sequences.rewards[:, :K]], axis=1)
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :K]], axis=1)
    return Targets(
        values=alive * z,
        value_weights=root * (alive + absorbing),
        rewards=shift(alive) * step_rewards,
        reward_weights=root * (shift(alive) + shift(absorbing)),
        policies=sequences.action_weights[:, : K + 1],
        policy_weights=root * alive,
    )


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
        # paper Appendix G: the gradient into g halved
        hidden = 0.5 * hidden + 0.5 * jax.lax.stop_gradient(hidden)
        hidden, reward_logits = agent.apply(params, hidden, actions[:, k], method=MuZeroNet.dynamics)
        outputs.append((*agent.apply(params, hidden, method=MuZeroNet.predict), reward_logits))
    return tuple(jnp.stack(x, axis=1) for x in zip(*outputs))


def run_search(params, key, root: mctx.RootFnOutput, recurrent_fn: Callable, config: Args):
    """One batched mctx search (`config`: --search, --num-simulations and that search's options): (action, action
    weights, root value) of each batch row."""
    if config.search == "gumbel":
        policy = mctx.gumbel_muzero_policy
        options = {"max_num_considered_actions": config.max_num_considered_actions}
    else:
        policy = mctx.muzero_policy
        options = {name: getattr(config, name) for name in ("dirichlet_alpha", "dirichlet_fraction", "temperature")}
    output = policy(params, key, root, recurrent_fn, config.num_simulations, **options)
    return output.action, output.action_weights, output.search_tree.summary().value


def model_search(params, obs, key, *, agent: MuZeroNet, args: Args):
    """The search of --search on the learned model: root from h and f, every simulation's step from g and f. The
    model has no episode end: the search discounts every step by gamma (as in the paper)."""
    to_scalar = partial(logits_to_scalar, support_size=args.support_size)
    hidden = agent.apply(params, obs, method=MuZeroNet.represent)
    prior_logits, value_logits = agent.apply(params, hidden, method=MuZeroNet.predict)
    root = mctx.RootFnOutput(prior_logits=prior_logits, value=to_scalar(value_logits), embedding=hidden)

    def recurrent_fn(params, key, action, hidden):
        next_hidden, reward_logits = agent.apply(params, hidden, action, method=MuZeroNet.dynamics)
        prior_logits, value_logits = agent.apply(params, next_hidden, method=MuZeroNet.predict)
        return mctx.RecurrentFnOutput(
            reward=to_scalar(reward_logits),
            discount=jnp.full(action.shape, args.gamma, jnp.float32),
            prior_logits=prior_logits,
            value=to_scalar(value_logits),
        ), next_hidden

    return run_search(params, key, root, recurrent_fn, args)


def muzero_loss(params, sequences: Rollout, normalizer, *, agent: MuZeroNet, args: Args):
    """MuZero's loss of sampled sequences (a learner device's part of the global minibatch: sums over its roots
    divided by the whole minibatch's count `normalizer`): (loss, (loss, policy_loss, value_loss, reward_loss))."""
    targets = unroll_targets(sequences, unroll_steps=args.unroll_steps, td_steps=args.td_steps, gamma=args.gamma)
    policy_logits, value_logits, reward_logits = unroll_model(
        params, agent=agent, obs=sequences.obs[:, 0], actions=sequences.actions[:, : args.unroll_steps]
    )
    policy_loss, value_loss, reward_loss = muzero_loss_terms(
        policy_logits=policy_logits,
        value_logits=value_logits,
        reward_logits=reward_logits,
        targets=targets,
        support_size=args.support_size,
        normalizer=normalizer,
    )
    loss = policy_loss + args.value_coef * value_loss + reward_loss
    return loss, (loss, policy_loss, value_loss, reward_loss)


# ---------------------------------------------------------------- actor


class ActorFns(NamedTuple):
    """The actor's jitted inference, run on the device its inputs live on (the same fields in every script)."""

    act: Callable  # (params, obs, key) -> (one stacked array of the step's outputs, key)
    value: Callable | None  # (params, obs) -> V(obs), the bootstrap's; None: the learner values it


def make_actor_fns(agent: MuZeroNet, args: Args) -> ActorFns:
    @jax.jit
    def act(params, obs, key):
        key, subkey = jax.random.split(key)
        action, action_weights, root_value = model_search(params, obs, subkey, agent=agent, args=args)
        # one array: one device-to-host copy per env step (float32 holds action ids exactly)
        return jnp.concatenate([action[:, None].astype(jnp.float32), root_value[:, None], action_weights], axis=1), key

    return ActorFns(act, None)


def actor_params(agent_state: TrainState):
    """What the actors act with."""
    return agent_state.params


def actor_loop(*, args: Args, thread: ActorThread, key, make_envs, actor_fns: ActorFns, params_queue, rollout_queue):
    """An actor thread's life: steps its envpool (`make_envs(seed, num_threads)`), searches on its actor device with
    `key`, ships one rollout per update to the learner."""
    num_envs, num_steps = args.local_num_envs, args.num_steps
    env_seed = thread.env_seed(args.seed, num_envs)
    envs = make_envs(env_seed, num_threads=thread.envpool_threads)
    key, obs_space = thread.key(key), envs.observation_space
    shape = (num_steps, num_envs)  # every array of the rollout is time-major
    next_obs, _ = envs.reset()
    previous_episode_end = np.zeros(num_envs, dtype=bool)
    episodes, timer = EpisodeStats(num_envs), StageTimer()
    for update in range(thread.start_update + 1, args.num_updates + 1):
        with timer("params_queue_get_time"):
            # skipping the second get makes the actor exactly one policy version behind the learner
            if update != thread.start_update + 2 or not args.concurrency:
                params, actor_policy_version = thread.get(params_queue)
        with timer("rollout_time"):
            obs = np.empty((*shape, *obs_space.shape), obs_space.dtype)
            actions = np.empty(shape, np.int32)
            action_weights = np.empty((*shape, int(envs.action_space.n)), np.float32)
            valid = np.empty(shape, bool)
            root_values, rewards, terminations, truncations = (np.empty(shape, np.float32) for _ in range(4))
            for step in range(num_steps):
                thread.check_stopped()
                with timer("inference_time"):
                    search_output, key = actor_fns.act(params, next_obs, key)
                    search_output = np.asarray(search_output)
                    action = search_output[:, 0].astype(np.int32)
                with timer("env_step_time"):
                    step_obs, reward, terminated, truncated, info = envs.step(action)
                with timer("storage_time"):
                    obs[step], actions[step] = next_obs, action
                    root_values[step], action_weights[step] = search_output[:, 1], search_output[:, 2:]
                    rewards[step], terminations[step], truncations[step] = reward, terminated, truncated
                    valid[step] = ~previous_episode_end
                    episodes.step(reward, terminated, truncated, info, counted=valid[step])
                    previous_episode_end = np.logical_or(terminated, truncated)
                    next_obs = step_obs
        storage = Rollout(obs, actions, action_weights, root_values, rewards, terminations, truncations, valid)
        # one host-to-device copy per learner device
        storage = split_for_learners(storage, thread.learner_devices)
        with timer("rollout_queue_put_time"):  # logged with the next rollout
            thread.put(rollout_queue, (storage, actor_policy_version, {**timer.read(), **episodes.read()}))


# ---------------------------------------------------------------- learner


class LearnerState(NamedTuple):
    """What the learner carries from update to update, and what a checkpoint holds."""

    agent: TrainState  # params and optimizer state, replicated over the learner devices
    key: jax.Array  # the learner's PRNG key (minibatch samples), the same in every process
    replay: flashbax.buffers.trajectory_buffer.TrajectoryBufferState  # sharded along the env axis


def muzero_gradient_step(agent_state: TrainState, sequences: Rollout, *, agent: MuZeroNet, args: Args):
    """One MuZero step (paper Appendix G) on a learner device's part of the global minibatch, inside `shard_map` over
    the mesh axis "batch": the loss is the global mean over roots, gradients summed over the devices."""
    roots = jax.lax.psum(sequences.valid[:, 0].sum(), "batch")
    normalizer = jnp.maximum(roots, 1).astype(jnp.float32)
    # this device's gradient: pcast marks the replicated params as per-device, so that the sum over
    # devices is the explicit psum below (shard_map would otherwise sum it implicitly)
    local_params = jax.lax.pcast(agent_state.params, "batch", to="varying")
    loss_fn = partial(muzero_loss, agent=agent, args=args)
    grads, metrics = jax.grad(loss_fn, has_aux=True)(local_params, sequences, normalizer)
    grads, metrics = jax.lax.psum((grads, metrics), "batch")
    names = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/reward_loss"]
    return agent_state.apply_gradients(grads=grads), dict(zip(names, metrics))


class LearnerFns(NamedTuple):
    init_replay: Callable  # () -> the empty replay, sharded along the env axis over the mesh
    update: Callable  # (state: LearnerState, rollout, train) -> (state, metrics)
    # (agent_state, sequences) -> (agent_state, metrics): one step on a given global minibatch
    gradient_step: Callable


def make_replay_buffer(args: Args, num_learner_devices: int, global_envs: int, local: bool):
    """flashbax's trajectory buffer (sequences of K + n + 1 consecutive rows of one env, never across the write
    position) of one learner device (`local`: the envs of its shard, its share of each minibatch) or of the mesh."""
    envs = global_envs // num_learner_devices if local else global_envs
    sample_batch_size = args.minibatch_size // num_learner_devices if local else args.minibatch_size
    return flashbax.make_trajectory_buffer(
        add_batch_size=envs,
        sample_batch_size=sample_batch_size,
        sample_sequence_length=sequence_length(args),
        period=1,
        min_length_time_axis=sequence_length(args),
        max_length_time_axis=args.buffer_size // global_envs,
    )


def replay_item(args: Args) -> Rollout:
    """One row of one env as the replay stores it."""
    obs_space, action_space = env_spaces(args.env_id, args.env_options)
    obs, zero = jnp.zeros(obs_space.shape, obs_space.dtype), jnp.float32(0)
    # obs, actions, action_weights, then root_values, rewards, terminations, truncations (float32) and valid
    action_weights = jnp.zeros(int(action_space.n))
    return Rollout(obs, jnp.int32(0), action_weights, zero, zero, zero, zero, jnp.bool_(False))


def make_learner_fns(args: Args, agent: MuZeroNet, mesh: Mesh) -> LearnerFns:
    """The data-parallel learner: `shard_map` over the mesh axis "batch" of all learner devices; each device keeps
    the replay shard of its envs, samples its part of every minibatch, and the gradients are summed with `psum`."""
    replicated, sharded_envs, sharded_samples = P(), P(None, "batch"), P("batch")
    rollout_specs = Rollout(*([sharded_envs] * len(Rollout._fields)))
    sequence_specs = Rollout(*([sharded_samples] * len(Rollout._fields)))
    replay_specs = flashbax.buffers.trajectory_buffer.TrajectoryBufferState(
        experience=sequence_specs, current_index=replicated, is_full=replicated
    )
    num_devices, global_envs = mesh.devices.size, args.global_num_envs
    local_buffer = make_replay_buffer(args, num_devices, global_envs, local=True)
    local_gradient_step = partial(muzero_gradient_step, agent=agent, args=args)

    def init_replay():
        shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), replay_specs)
        init = make_replay_buffer(args, num_devices, global_envs, local=False).init
        typed_init = jax.jit(lambda item: strongly_typed(init(item)), out_shardings=shardings)
        return typed_init(replay_item(args))

    def local_update(agent_state: TrainState, replay, storage: Rollout, key, train: bool):
        """Per device: append its envs' rollout to its replay shard, then --replay-ratio x batch gradient steps."""
        env_major = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), storage)  # (envs, T, ...)
        replay = local_buffer.add(replay, env_major)
        if not train:
            return agent_state, replay, {}

        def step(agent_state, step_key):
            sample_key = jax.random.fold_in(step_key, jax.lax.axis_index("batch"))
            return local_gradient_step(agent_state, local_buffer.sample(replay, sample_key).experience)

        agent_state, metrics = jax.lax.scan(step, agent_state, jax.random.split(key, args.gradient_steps))
        return agent_state, replay, jax.tree.map(jnp.mean, metrics)

    @partial(jax.jit, static_argnames="train", donate_argnums=(0, 1))
    def update_step(agent_state: TrainState, replay, storage: Rollout, key, train: bool):
        return jax.shard_map(
            partial(local_update, train=train),
            mesh=mesh,
            in_specs=(replicated, replay_specs, rollout_specs, replicated),
            out_specs=(replicated, replay_specs, replicated),
        )(agent_state, replay, storage, key)

    # its first call stops the run with one line if it cannot fit the devices' free memory (cleanrl_utils/memory.py)
    update_step = checked_for_memory(update_step, "lower --minibatch-size or --unroll-steps")

    def update(state: LearnerState, storage: Rollout, train: bool) -> tuple[LearnerState, dict]:
        agent_state, key, replay = state
        key, update_key = jax.random.split(key)
        agent_state, replay, metrics = update_step(agent_state, replay, storage, update_key, train=train)
        metrics["stats/gradient_steps"] = args.gradient_steps * train
        return LearnerState(agent_state, key, replay), metrics

    gradient_step = jax.shard_map(
        local_gradient_step, mesh=mesh, in_specs=(replicated, sequence_specs), out_specs=(replicated, replicated)
    )
    return LearnerFns(init_replay, update, jax.jit(gradient_step))


@jax.jit
def end_stored_episodes(replay):
    """After a resume the actors start new episodes: the newest stored row of each env is followed by a new
    episode's first row. Mark the row before it truncated (its n-step targets bootstrap from the newest row's stored
    root value, the search value of that observation) and the newest row not valid (never a root)."""
    length = replay.experience.valid.shape[1]
    newest = (replay.current_index - 1) % length
    before = (replay.current_index - 2) % length
    experience = replay.experience
    valid = experience.valid.at[:, newest].set(False)
    truncations = experience.truncations.at[:, before].set(1.0)
    return replay.replace(experience=experience._replace(valid=valid, truncations=truncations))


# ---------------------------------------------------------------- evaluation: what --save-model saves, and its policy
# (what the evaluator and the tools call in this script: cleanrl_utils/script_contract.py)


def saved_model(state: LearnerState) -> dict:
    """What --save-model writes next to the flags: what `make_eval_policy` reads."""
    # the model: the search needs all of it
    return {"params": to_state_dict(local_value(state.agent.params))}


def make_eval_policy(args: Args, model: dict, greedy: bool):
    """The saved agent as policy(obs, key) -> (actions, key), for cleanrl_utils.evals: the actors' search, as in
    training; greedy takes the action of the largest search weight, otherwise the search's own (sampled) action."""
    agent, _ = make_agent(args, jax.random.key(0))
    params, act = jax.tree.map(jnp.asarray, model["params"]), make_actor_fns(agent, args).act

    def policy(obs: np.ndarray, key: jax.Array):
        search_output, key = act(params, obs, key)
        # as in `rollout`: action, root value, action weights
        search_output = np.asarray(search_output)
        actions = np.argmax(search_output[:, 2:], axis=-1) if greedy else search_output[:, 0]
        return actions.astype(np.int32), key

    return policy


# ---------------------------------------------------------------- main: the Sebulba protocol


def set_runtime_values(args: Args, layout: DeviceLayout):
    """What the run derives beyond the batch (cleanrl_utils.flags.derive_batch_values): not flags."""
    args.gradient_steps = gradient_steps_per_update(args.replay_ratio, args.batch_size)
    # learning starts in the first update after which every env's replay rows hold one whole sequence (K + n + 1)
    args.learning_starts_updates = -(-sequence_length(args) // args.num_steps) - 1
    global_envs = args.global_num_envs
    num_learner_devices = len(layout.global_learner_devices)
    check_minibatch_split(args.minibatch_size, num_learner_devices)
    rows, new_rows = args.buffer_size // global_envs, max(args.num_steps, sequence_length(args))
    if rows < new_rows:
        raise UsageError(
            f"--buffer-size ({args.buffer_size}) must hold at least max(--num-steps, --unroll-steps + --td-steps + 1)"
            f" = {new_rows} steps of each of the {global_envs} envs: the sampled sequences are longer than the stored"
            f" ones ({rows} rows)"
        )
    check_int32_counts(args, {"gradient steps": ("--replay-ratio x env steps per update", args.gradient_steps)})
    init_shard = make_replay_buffer(args, num_learner_devices, global_envs, local=True).init
    check_replay_fits(args.buffer_size, init_shard, replay_item(args), layout.learner_devices, new_rows=new_rows)


def state_summary(state: LearnerState) -> str:
    """Digests of the learner's state for the console: equal digests, bitwise equal states. The replay's digest is
    of the whole replay, whatever its layout, the same in every process (each computes the part it holds)."""
    return (
        f"params sha256={tree_digest(state.agent.params)} optimizer sha256={tree_digest(state.agent.opt_state)} "
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
    # a resumed run's actors start new episodes: the newest stored rows end theirs, in the replay's layout (so that
    # the update is the fresh run's program, from the compilation cache, not compiled anew)
    if run.start_update:
        layout = jax.tree.map(lambda x: x.sharding, state.replay)
        end_episodes = jax.jit(end_stored_episodes, out_shardings=layout)
        state = state._replace(replay=end_episodes(state.replay))

    # Sebulba: each actor thread has a size-1 params queue from the learner and a size-1 rollout queue to it
    params_queues = [queue.Queue(maxsize=1) for _ in actor_threads]
    rollout_queues = [queue.Queue(maxsize=1) for _ in actor_threads]
    make_envs = partial(make_env, args.env_id, num_envs=args.local_num_envs, env_options=args.env_options)
    actor = partial(actor_loop, args=args, key=actor_key, make_envs=make_envs, actor_fns=make_actor_fns(agent, args))
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
            train = update > args.learning_starts_updates  # no whole sequence in the replay yet
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
