"""Anakin PPO (Hessel et al. 2021, "Podracer architectures", Sec. 3) for JAX-native envs: XLand-MiniGrid's MiniGrid
tasks, pgx's MinAtar games and Craftax-Classic, each behind a small adapter (cleanrl_utils/jax_envs.py), so
`--env-id` picks the env.

One file, read top to bottom: `Args`, the env factory, the networks, the pure math (advantage estimation, losses: the
same functions as the Sebulba PPO script's), the rollout, the learner update, the evaluation policy, and `main`: the
Anakin loop itself. What is the same for every algorithm (checkpoints, preemption, device layout, logging) comes from
cleanrl_utils/, one small module each.

System in one paragraph: the envs are written in JAX, so acting, stepping the envs and learning are one
compiled program. On each learner device, a `vmap` over its `--local-num-envs` envs of the policy and the env step is
scanned for `--num-steps`; then GAE, and PPO's epochs and minibatches, all inside one `jax.jit` of a `shard_map` over
the learner devices of every process (the Sebulba scripts' 1-D mesh "batch"), gradients summed with `psum`, so
`--distributed` (jax.distributed) scales it across hosts. The envs' state is part of the learner state, sharded along
the env axis: a checkpoint holds it, and a resumed run continues bit for bit. The actor is the learner's current policy
(lag 0): no threads, no queues, no host-device copies of observations.
"""

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.serialization import to_state_dict
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.checkpoints import tree_digest
from cleanrl_utils.cli import run_cli
from cleanrl_utils.devices import DeviceLayout, local_value, replicate, seed_slice, stack_seeds
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import AnakinArgs, check_flags, check_int32_counts, check_run_flags
from cleanrl_utils.jax_envs import JaxVectorEnvs, check_env_id, make_jax_env, strongly_typed
from cleanrl_utils.memory import checked_for_memory
from cleanrl_utils.run import AnakinRun
from cleanrl_utils.saved_model import check_save_model_flags


@dataclass
class Args(AnakinArgs):  # the run's and Anakin's flags (cleanrl_utils/flags.py), then PPO's
    env_id: str = "MiniGrid-Empty-5x5"
    """an xminigrid MiniGrid task (MiniGrid-Empty-5x5, MiniGrid-DoorKey-8x8, ...: its egocentric 7x7 view, flattened,
    goes into MLPs), a pgx MinAtar game (minatar-breakout, minatar-asterix, minatar-freeway, minatar-seaquest,
    minatar-space_invaders: its 10x10 image into a small CNN, then the MLPs) or Craftax-Classic-Symbolic-v1 (its
    1,345 symbolic features into the MLPs)"""
    total_timesteps: int = 50_000_000
    """total timesteps of the experiments (agent steps, summed over all envs and processes) (in [1, 2**53])"""
    learning_rate: float = 2.5e-4
    """the learning rate of the optimizer (PPO paper, Table 5) (positive, finite)"""
    local_num_envs: int = 128
    """the number of parallel game environments on each learner device (positive)"""
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
    """coefficient of the value function (baselines' PPO2) (non-negative, finite)"""
    max_grad_norm: float = 0.5
    """the maximum norm for the gradient clipping (baselines' PPO2) (positive, finite)"""
    hiddens: list[int] = field(default_factory=lambda: [256])
    """the hidden layers of the actor's and of the critic's MLP (positive)"""


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
    if (args.num_steps * args.local_num_envs) % args.num_minibatches != 0:
        raise UsageError(
            f"--num-minibatches ({args.num_minibatches}) must divide the samples per learner device "
            f"(--num-steps x --local-num-envs = {args.num_steps} x {args.local_num_envs})"
        )
    check_save_model_flags(args, __file__)  # --capture-video, --upload-model, before training


# ---------------------------------------------------------------- environments


def make_env(env_id: str, seed: int, num_envs: int, render_mode: str | None = None):
    """The evaluator's envs (cleanrl_utils.evals): training steps its envs inside the compiled update instead."""
    return JaxVectorEnvs(env_id, seed, num_envs, render_mode)


# ---------------------------------------------------------------- networks


class MinAtarTorso(nn.Module):
    """pgx's MinAtar PPO example's torso: a 2x2 convolution of 32 channels (SAME padding), ReLU, its average pooling,
    a ReLU layer of 64 (after the MinAtar paper's one-conv network, Young & Tian 2019, Sec. 4). The convolution is a
    Dense layer on each cell's 2x2 patch, the same function as `nn.Conv` (a test checks it): on a CPU, XLA computes
    a convolution's weight gradient inside `lax.scan` about 19x slower (docs/studies/minatar_pgx.md)."""

    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32)
        batch, height, width, _ = x.shape
        # SAME for a 2x2 kernel: a row and a column after
        padded = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        patches = jnp.concatenate([padded[:, i : i + height, j : j + width] for i in (0, 1) for j in (0, 1)], -1)
        x = nn.relu(nn.Dense(32, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(patches))
        # pgx's `hk.avg_pool(x, window_shape=(2, 2), strides=(2, 2))`: haiku reads a window shorter than the input's
        # rank as one over its last axes, so it averages pairs of columns and pairs of channels and keeps every row
        x = x.reshape(batch, height, width // 2, 2, -1, 2).mean((3, 5))
        x = nn.Dense(64, kernel_init=nn.initializers.orthogonal(np.sqrt(2)))(x.reshape((batch, -1)))
        return nn.relu(x)


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
    """Policy logits and value, from separate actor and critic MLPs (as in CleanRL's classic-control PPO); on images,
    both MLPs read one shared CNN torso (as pgx's MinAtar PPO example)."""

    action_dim: int
    hiddens: Sequence[int]
    # "symbolic" (xminigrid's views: the MLPs read them flattened) or "image" (MinAtar)
    observation_kind: str

    @nn.compact
    def __call__(self, obs):
        if self.observation_kind == "image":
            x = MinAtarTorso()(obs)
        else:  # xminigrid's views, flattened
            x = obs.reshape((obs.shape[0], -1))
        actor_hidden, critic_hidden = MLP(self.hiddens)(x), MLP(self.hiddens)(x)
        # small policy init and unit value init: CleanRL / "37 implementation details of PPO" (Huang et al. 2022)
        policy_init = nn.initializers.orthogonal(0.01)
        logits = nn.Dense(self.action_dim, kernel_init=policy_init)(actor_hidden)
        value = nn.Dense(1, kernel_init=nn.initializers.orthogonal(1.0))(critic_hidden)
        return logits, value.squeeze(-1)


def make_network(args: Args) -> Agent:
    """The actor-critic of the flags for --env-id's action space (what make_agent trains and make_eval_policy loads)."""
    env = make_jax_env(args.env_id)
    return Agent(env.num_actions, tuple(args.hiddens), env.observation_kind)


def make_agent(args: Args, key: jax.Array) -> tuple[Agent, TrainState]:
    """The network for --env-id and its training state (params and optimizer), on the host."""
    env = make_jax_env(args.env_id)
    agent = make_network(args)

    def linear_schedule(count):
        # anneal over all optimizer steps: updates x epochs x minibatches (PPO paper, Table 5)
        frac = 1.0 - (count // (args.num_minibatches * args.update_epochs)) / args.num_updates
        return args.learning_rate * frac

    return agent, TrainState.create(
        apply_fn=None,
        params=agent.init(key, np.zeros((1, *env.observation_shape), np.float32)),
        tx=optax.chain(
            optax.clip_by_global_norm(args.max_grad_norm),
            optax.inject_hyperparams(optax.adam)(
                learning_rate=linear_schedule if args.anneal_lr else args.learning_rate, eps=1e-5
            ),
        ),
    )


# ---------------------------------------------------------------- math


class Rollout(NamedTuple):
    """One learner device's rollout: every field is time-major, (time, envs, ...), so the env axis is always 1."""

    obs: jax.Array
    actions: jax.Array
    logprobs: jax.Array
    values: jax.Array
    rewards: jax.Array
    terminations: jax.Array
    truncations: jax.Array
    valid: jax.Array  # False for the auto-reset step after an episode end: its action is ignored
    bootstrap_value: jax.Array  # (1, envs): V(obs after the last step)


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


# ---------------------------------------------------------------- actor: the envs, stepped on the learner devices


class EnvState(NamedTuple):
    """The envs and what the logger reads of them; every field has the env axis first (sharded over the devices)."""

    # the env library's state of each env (cleanrl_utils.jax_envs), its last transition included
    state: object
    action_keys: jax.Array  # each env's own key for its actions: one stream on any layout
    episode_returns: jax.Array  # of the episode under way
    episode_lengths: jax.Array
    # of each env's last finished episode (NaN before its first), as logged
    returned_episode_returns: jax.Array
    returned_episode_lengths: jax.Array


def reset_envs(env, key: jax.Array, num_envs: int, sharding: NamedSharding) -> EnvState:
    """`num_envs` envs (all processes'), env i reset with key i of `key`'s split, laid out along the mesh."""

    def reset(key):
        reset_keys, action_keys = jax.random.split(key, (2, num_envs))
        nan = jnp.full(num_envs, jnp.nan, jnp.float32)
        state = jax.vmap(env.reset)(reset_keys)
        return EnvState(state, action_keys, jnp.zeros(num_envs), jnp.zeros(num_envs, jnp.int32), nan, nan)

    return jax.jit(reset, out_shardings=sharding)(key)


def rollout(*, agent: Agent, env, params, envs: EnvState, num_steps: int) -> tuple[EnvState, Rollout]:
    """One device's envs stepped `num_steps` times with the current policy: a `vmap` over envs, scanned over time."""
    episode_ended = jax.vmap(lambda state: env.terminated(state) | env.truncated(state))

    def step(envs: EnvState, _):
        keys = jax.vmap(jax.random.split)(envs.action_keys)
        obs = jax.vmap(env.observation)(envs.state)
        valid = ~episode_ended(envs.state)  # after an end: the reset step
        logits, value = agent.apply(params, obs)
        action = jax.vmap(jax.random.categorical)(keys[:, 1], logits)
        logprob = jax.nn.log_softmax(logits)[jnp.arange(action.shape[0]), action]
        state = env.step_envs(envs.state, action)
        reward, terminated, truncated = (jax.vmap(f)(state) for f in (env.reward, env.terminated, env.truncated))
        episode_end = terminated | truncated
        # each env's last finished episode (the Sebulba scripts' cleanrl_utils.logger.EpisodeStats, in JAX)
        episode_returns = envs.episode_returns + reward
        episode_lengths = envs.episode_lengths + valid
        envs = EnvState(
            state,
            keys[:, 0],
            jnp.where(episode_end, 0.0, episode_returns),
            jnp.where(episode_end, 0, episode_lengths),
            jnp.where(episode_end, episode_returns, envs.returned_episode_returns),
            jnp.where(episode_end, episode_lengths, envs.returned_episode_lengths),
        )
        return envs, (obs, action, logprob, value, reward, terminated, truncated, valid)

    envs, (obs, actions, logprobs, values, rewards, terminations, truncations, valid) = jax.lax.scan(
        step, envs, length=num_steps
    )
    bootstrap_value = agent.apply(params, jax.vmap(env.observation)(envs.state))[1][None]
    float32 = lambda x: x.astype(jnp.float32)
    storage = Rollout(
        obs,
        actions,
        logprobs,
        values,
        rewards,
        float32(terminations),
        float32(truncations),
        valid,
        bootstrap_value,
    )
    return envs, storage


def episode_stats(envs: EnvState) -> dict:
    """This process's envs' last finished episodes, a row per seed, for the logger (as `EpisodeStats.read()`)."""
    local = lambda x: np.concatenate([np.asarray(shard.data) for shard in x.addressable_shards], axis=1)
    return {
        "returned_episode_returns": local(envs.returned_episode_returns),
        "returned_episode_lengths": local(envs.returned_episode_lengths),
    }


# ---------------------------------------------------------------- learner: one compiled program per update


def seeded(update: Callable, num_seeds: int) -> Callable:
    """`update` of one seed's state as the update of every seed's (a leading seed axis): a `vmap`, whose batched
    kernels round differently from one seed's (a seed's params then differ from its run alone in the last bits after
    an update); one seed runs its program as it is, bit for bit the run of its --seed."""
    if num_seeds > 1:
        return jax.vmap(update)

    def one_seed(state):
        state, metrics = update(jax.tree.map(lambda x: x[0], state))
        return jax.tree.map(lambda x: x[None], (state, metrics))

    return one_seed


class LearnerState(NamedTuple):
    """What the learner carries from update to update, and what a checkpoint holds."""

    agent: TrainState  # params and optimizer state, replicated over the learner devices
    key: jax.Array  # the learner's PRNG key (minibatch shuffles), the same in every process
    envs: EnvState  # the envs, sharded along the env axis over the learner devices


def make_learner_update(args: Args, agent: Agent, env, mesh: Mesh) -> Callable:
    """The Anakin update of each seed (`seeded`): on every learner device (`shard_map` over the mesh axis "batch"), a
    rollout of its envs, advantages, then epochs x minibatches of PPO (`lax.scan`), gradients summed with `psum`."""
    replicated, sharded_envs = P(), P(None, "batch")
    state_specs = LearnerState(replicated, replicated, sharded_envs)
    minibatch_size = args.num_steps * args.local_num_envs // args.num_minibatches
    names = ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/approx_kl"]
    loss_fn = partial(ppo_loss, agent=agent, args=args)

    def minibatch_update(agent_state: TrainState, batch: Batch, permutation, minibatch_index):
        indices = jax.lax.dynamic_slice_in_dim(permutation, minibatch_index * minibatch_size, minibatch_size)
        minibatch = jax.tree.map(lambda x: jnp.take(x, indices, axis=0), batch)
        # this device's gradient (without shard_map's replication checks, see below), summed over the devices
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(agent_state.params, minibatch)
        grads, loss, metrics = jax.lax.psum((grads, loss, metrics), "batch")
        agent_state = agent_state.apply_gradients(grads=grads)
        return agent_state, (loss, *metrics)

    def shuffle(key):
        """Each learner device permutes its own samples with its own key."""
        key = jax.random.fold_in(key, jax.lax.axis_index("batch"))
        return jax.random.permutation(key, minibatch_size * args.num_minibatches)

    batch_of = partial(prepare_batch, gamma=args.gamma, gae_lambda=args.gae_lambda)

    def learn(batch: Batch, agent_state: TrainState, key):
        def epoch(carry, _):
            agent_state, key = carry
            key, shuffle_key = jax.random.split(key)
            permutation = shuffle(shuffle_key)
            agent_state, metrics = jax.lax.scan(
                lambda agent_state, index: minibatch_update(agent_state, batch, permutation, index),
                agent_state,
                jnp.arange(args.num_minibatches),
            )
            return (agent_state, key), metrics

        (agent_state, key), metrics = jax.lax.scan(epoch, (agent_state, key), length=args.update_epochs)
        return agent_state, key, metrics

    def update(state: LearnerState) -> tuple[LearnerState, dict]:
        agent_state, key, envs = state
        envs, storage = rollout(agent=agent, env=env, params=agent_state.params, envs=envs, num_steps=args.num_steps)
        agent_state, key, metrics = learn(batch_of(storage), agent_state, key)
        metrics = dict(zip(names, jax.tree.map(jnp.mean, metrics)))
        metrics["charts/learning_rate"] = agent_state.opt_state[1].hyperparams["learning_rate"]
        # strongly typed, as a fresh state (stack_seeds) and a restored one: fresh or resumed, one program
        return strongly_typed(LearnerState(agent_state, key, envs)), metrics

    # check_vma=False: xminigrid's and pgx's env steps have `lax.cond`s with a constant branch, which shard_map's
    # replication checks refuse for per-device data; so the gradient is each device's own and the psum above sums it
    update = seeded(update, args.num_seeds)
    update = jax.shard_map(
        update, mesh=mesh, in_specs=(state_specs,), out_specs=(state_specs, replicated), check_vma=False
    )
    # its first call stops the run with one line if it cannot fit the devices' free memory (cleanrl_utils/memory.py)
    lower_memory = "raise --num-minibatches, or lower --local-num-envs or --num-steps"
    return checked_for_memory(jax.jit(update, donate_argnums=(0,)), lower_memory)


# ---------------------------------------------------------------- evaluation: what --save-model saves, and its policy
# (what the evaluator and the tools call in this script: cleanrl_utils/script_contract.py)


def saved_model(state: LearnerState) -> list[dict]:
    """What --save-model writes next to the flags, one for each seed: what `make_eval_policy` reads."""
    params = local_value(state.agent.params)
    return [{"params": to_state_dict(seed_slice(params, i))} for i in range(len(state.key))]


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


# ---------------------------------------------------------------- main: the Anakin loop


def check_runtime_values(args: Args, layout: DeviceLayout):
    """Checks of what the run derives from the flags and the layout (the batch: cleanrl_utils.flags), and of --env-id:
    importing the JAX env libraries (xminigrid, pgx, Craftax) starts JAX's backend (their constants are arrays), so
    the ids are checked once the devices and jax.distributed have started, in every process."""
    check_env_id(args.env_id, discrete=True)
    # Adam's steps per update
    schedule = ("--update-epochs x --num-minibatches", args.update_epochs * args.num_minibatches)
    check_int32_counts(args, {"optimizer steps": schedule})


def init_state(args: Args, env, seed: int, mesh: Mesh) -> LearnerState:
    """The learner state that `--seed seed` starts from: every key is the same in every process, and each env's keys
    are its own slice of the envs key's split."""
    agent_key, learner_key, envs_key = jax.random.split(jax.random.key(seed), 3)
    _, agent_state = make_agent(args, agent_key)
    envs = reset_envs(env, envs_key, args.global_num_envs, NamedSharding(mesh, P("batch")))
    return LearnerState(replicate(agent_state, mesh), replicate(learner_key, mesh), envs)


def state_summary(state: LearnerState, seeds: Sequence[int]) -> str:
    """Digests of the learner's state for the console, each seed's: equal digests, bitwise equal states."""
    digests = [
        f"params sha256={tree_digest(seed_slice(state.agent.params, i))} "
        f"envs sha256={tree_digest(seed_slice(state.envs, i))}"
        for i in range(len(seeds))
    ]
    if len(seeds) == 1:
        return digests[0]
    return "; ".join(f"seed {seed}: {digest}" for seed, digest in zip(seeds, digests))


def main(args: Args) -> int:
    validate_args(args)  # bad flags stop here, before JAX starts a backend
    # devices, run folder, checkpoints, signals; `run.args`: a copy of the flags with the sizes the layout gives them
    # (the batch, the global env count, the updates: cleanrl_utils/flags.py) and the run's name
    run = AnakinRun(args, __file__, check_runtime_values)
    args = run.args
    env = make_jax_env(args.env_id)
    # one independent run for each of the --num-seeds seeds, each started as its --seed alone: the learner state's
    # leaves gain a leading seed axis, laid out as the update returns them (the second update does not compile anew)
    state = stack_seeds(lambda seed: init_state(args, env, seed, run.mesh), run.seeds, run.mesh)
    # data-parallel over run.mesh, every process's learner devices; the first call of each of its programs stops the
    # run with one line if the program cannot fit the devices' free memory (cleanrl_utils/memory.py)
    learner_update = make_learner_update(args, make_network(args), env, run.mesh)
    # the newest checkpoint of the run (the envs too), or this fresh state
    state = run.start(state, partial(state_summary, seeds=run.seeds))

    # Anakin: each update acts, steps the envs and learns in one compiled program on every learner device
    # SIGTERM or Ctrl-C (cleanrl_utils/preemption.py): the update in flight is finished and logged (with several
    # processes, up to the update boundary they agree on), the loop ends, `run.finish` checkpoints that update and the
    # run exits 143 (130 for Ctrl-C): the same command resumes it.
    with run.supervise():
        for update in run.updates():
            # the update donates its input: a copy is kept in case it diverges
            before = run.copy_learner_state(state)
            state, metrics = learner_update(state)
            # NaN or inf: checkpoints `before` and stops the run
            metrics = run.wait_for_finite(update, state, metrics, before)
            # log (with this process's envs' episodes); checkpoint every --checkpoint-frequency
            run.end_update(update, state, metrics, episode_stats(state.envs))
    return run.finish(state, saved_model)  # final checkpoint and digests, --save-model, exit code


if __name__ == "__main__":
    sys.exit(run_cli(main, Args))
