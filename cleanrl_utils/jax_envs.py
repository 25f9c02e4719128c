"""JAX-native env libraries as the Anakin script sees them: one small adapter per library, so that a run changes
`--env-id`, not the script. (The Sebulba scripts' envpool families are cleanrl_utils/envs.py.)

An adapter is functional, for `vmap` and `lax.scan` inside the compiled update: `reset(key)` gives one env's state and
`step(state, action)` the next, with envpool's auto-reset: the step after an episode's end resets the env and ignores
its action (so the Sebulba scripts' GAE and losses apply unchanged); `step_envs(states, actions)` steps a batch of
envs as `jax.vmap(step)` does. The state carries the env's own randomness (its reset and sticky-action keys) and the
last transition: `observation`, `reward`, `terminated` and `truncated` read it. Families:

- XLand-MiniGrid's MiniGrid tasks (`MiniGrid-Empty-5x5`, ...; Nikulin et al. 2024): the egocentric 7x7 view of tile
  and color ids, no time limit beyond the task's own (a truncation);
- pgx's MinAtar games (`minatar-breakout`, `minatar-asterix`, `minatar-freeway`, `minatar-seaquest`,
  `minatar-space_invaders`; Young & Tian 2019, as pgx implements them: sticky actions with probability 0.1, the
  minimal action set): 10x10 images of binary channels;
- Craftax-Classic (`Craftax-Classic-Symbolic-v1`; Matthews et al. 2024, after Hafner's Crafter): the symbolic
  observation (the 9x7 local map's one-hot blocks and mobs, inventory, intrinsics: 1,345 numbers), 17 actions; an
  episode ends by death (a termination) or at Craftax's 10,000-step limit (a truncation);
- MuJoCo Playground's DeepMind Control Suite (`CartpoleBalance`, `CheetahRun`, ...; Zakka et al. 2025), continuous
  actions in [-1, 1], on MJX's JAX implementation (`impl="jax"`: Playground's default, Warp, is a GPU engine), with
  the Control Suite's time limit of 1,000 steps as a truncation (as envpool's `CartpoleBalance-v1`, ...).

Importing any of them starts JAX's backend (their constants are arrays), so the ids are checked in
check_runtime_values, after jax.distributed has started.
"""

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cleanrl_utils.errors import UsageError

MINATAR_GAMES = ["asterix", "breakout", "freeway", "seaquest", "space_invaders"]
# Craftax-Classic's symbolic observation (its pixel one needs a CNN; the full Craftax is a larger game: not offered)
CRAFTAX_IDS = ["Craftax-Classic-Symbolic-v1"]


class JaxEnv:
    """What the adapters share: a batch of envs steps as each env does, vmapped. Under `vmap` the reset branch of
    `step` runs for every env at every step, as a select: cheap where a reset is (Craftax's is not: its own)."""

    def step_envs(self, states, actions):
        return jax.vmap(self.step)(states, actions)


class XMiniGridEnv(JaxEnv):
    """An xminigrid MiniGrid task; its TimeStep is the state (DmEnvAutoResetWrapper resets the step after the end)."""

    observation_kind = "symbolic"  # tile and color ids: an MLP on the flattened view
    action_dtype = jnp.int32

    def __init__(self, env_id: str):
        import xminigrid
        from xminigrid.wrappers import DmEnvAutoResetWrapper

        env, self.env_params = xminigrid.make(env_id)
        self.env = DmEnvAutoResetWrapper(env)
        self.num_actions = int(self.env.num_actions(self.env_params))
        self.observation_shape = tuple(self.env.observation_shape(self.env_params))

    def reset(self, key: jax.Array) -> Any:
        return self.env.reset(self.env_params, key)

    def sample_action(self, key: jax.Array) -> jax.Array:
        return jax.random.randint(key, (), 0, self.num_actions)

    def step(self, state, action: jax.Array) -> Any:
        return self.env.step(self.env_params, state, action)  # its reset keys live in the TimeStep

    def observation(self, state) -> jax.Array:
        return state.observation

    def reward(self, state) -> jax.Array:
        return state.reward

    def terminated(self, state) -> jax.Array:
        return state.last() & (state.discount == 0)

    def truncated(self, state) -> jax.Array:
        return state.last() & (state.discount > 0)

    def render(self, state) -> np.ndarray:
        return np.asarray(self.env.render(self.env_params, state))


class MinAtarState(NamedTuple):
    game: Any  # pgx's State
    key: jax.Array  # the env's own key: sticky actions and resets draw from it


class MinAtarEnv(JaxEnv):
    """A pgx MinAtar game, its State and the env's key. pgx resets nothing by itself: `step` does it, envpool's way."""

    observation_kind = "image"  # 10x10 binary channels: pgx's MinAtar PPO example's small CNN
    action_dtype = jnp.int32

    def __init__(self, env_id: str):
        import pgx

        self.env = pgx.make(env_id)
        self.num_actions = int(self.env.num_actions)
        self.observation_shape = tuple(self.env.observation_shape)

    def reset(self, key: jax.Array) -> MinAtarState:
        init_key, key = jax.random.split(key)
        return MinAtarState(self.env.init(init_key), key)

    def sample_action(self, key: jax.Array) -> jax.Array:
        return jax.random.randint(key, (), 0, self.num_actions)

    def step(self, state: MinAtarState, action: jax.Array) -> MinAtarState:
        key, reset_key, step_key = jax.random.split(state.key, 3)
        game = state.game
        # pgx leaves an ended episode's state as it is; under vmap both branches run, as a select per env
        game = jax.lax.cond(
            game.terminated | game.truncated,
            lambda: self.env.init(reset_key),
            lambda: self.env.step(game, action, step_key),
        )
        return MinAtarState(game, key)

    def observation(self, state: MinAtarState) -> jax.Array:
        return state.game.observation

    def reward(self, state: MinAtarState) -> jax.Array:
        return state.game.rewards[..., 0]  # one player

    def terminated(self, state: MinAtarState) -> jax.Array:
        return state.game.terminated

    def truncated(self, state: MinAtarState) -> jax.Array:
        return state.game.truncated

    def render(self, state: MinAtarState) -> np.ndarray:
        """The channels as colors on black, each cell 8x8 pixels (pgx renders SVG only)."""
        colors = np.asarray(_channel_colors(self.observation_shape[-1]))
        channels = np.asarray(state.game.observation, np.float32)
        frame = np.clip(channels @ colors, 0, 255).astype(np.uint8)
        return np.kron(frame, np.ones((8, 8, 1), np.uint8))


def strongly_typed(tree):
    """`tree` with every weakly typed leaf given its dtype for good (the types a step returns)."""
    return jax.tree.map(lambda leaf: jax.lax.convert_element_type(leaf, jnp.asarray(leaf).dtype), tree)


class CraftaxState(NamedTuple):
    env: Any  # Craftax's EnvState (its timestep counts the episode's steps)
    obs: jax.Array  # Craftax returns the observation beside its state: kept here
    reward: jax.Array
    done: jax.Array  # the episode ended at this step (death or the time limit)
    key: jax.Array  # the env's own key: its steps and resets draw from it


class CraftaxEnv(JaxEnv):
    """Craftax-Classic without Craftax's own auto-reset (which resets within the ending step and hides the last
    observation): envpool's, the step after the end resets. The time limit is told apart from the game's end."""

    observation_kind = "symbolic"  # one-hot map and inventory numbers: an MLP
    action_dtype = jnp.int32

    def __init__(self, env_id: str):
        from craftax.craftax_env import make_craftax_env_from_name

        self.env = make_craftax_env_from_name(env_id, auto_reset=False)
        self.env_params = self.env.default_params
        self.num_actions = int(self.env.action_space(self.env_params).n)
        self.observation_shape = tuple(self.env.observation_space(self.env_params).shape)
        self._render = None  # Craftax's pixel renderer, made on the first frame (videos only)

    def reset(self, key: jax.Array) -> CraftaxState:
        reset_key, key = jax.random.split(key)
        obs, env = self.env.reset_env(reset_key, self.env_params)
        # Craftax's reset leaves half its fields weakly typed, its step does not: without this the update, given
        # the reset envs and then its own, would compile twice
        return CraftaxState(strongly_typed(env), obs, jnp.float32(0), jnp.bool_(False), key)

    def sample_action(self, key: jax.Array) -> jax.Array:
        return jax.random.randint(key, (), 0, self.num_actions)

    def step(self, state: CraftaxState, action: jax.Array) -> CraftaxState:
        key, reset_key, step_key = jax.random.split(state.key, 3)
        return jax.lax.cond(
            state.done,
            lambda: self.reset(reset_key)._replace(key=key),
            lambda: self._step_without_reset(state, action, step_key, key),
        )

    def _step_without_reset(self, state: CraftaxState, action, step_key, key) -> CraftaxState:
        obs, env, reward, done, _ = self.env.step_env(step_key, state.env, action, self.env_params)
        return CraftaxState(env, obs, reward.astype(jnp.float32), done, key)

    def step_envs(self, states: CraftaxState, actions: jax.Array) -> CraftaxState:
        """`jax.vmap(step)`'s envs and keys (tested), but the envs whose episode ended are reset one at a time, after
        the vmapped step: under `vmap` the reset branch would generate a world for every env at every step (on a
        2-core CPU a world 1.2-5 ms an env, a step 0.1-0.25 ms: docs/studies/anakin_vs_sebulba.md#craftax-classic)."""
        key, reset_key, step_key = jnp.moveaxis(jax.vmap(lambda key: jax.random.split(key, 3))(states.key), 1, 0)
        stepped = jax.vmap(self._step_without_reset)(states, actions, step_key, key)
        ended = jnp.nonzero(states.done, size=states.done.shape[0])[0]  # the ended envs' indices first

        def reset(i, stepped):
            env = ended[i]
            fresh = self.reset(reset_key[env])._replace(key=key[env])
            return jax.tree.map(lambda batch, one: batch.at[env].set(one), stepped, fresh)

        return jax.lax.fori_loop(0, states.done.sum(), reset, stepped)

    def observation(self, state: CraftaxState) -> jax.Array:
        return state.obs

    def reward(self, state: CraftaxState) -> jax.Array:
        return state.reward

    def terminated(self, state: CraftaxState) -> jax.Array:
        return state.done & ~self.truncated(state)

    def truncated(self, state: CraftaxState) -> jax.Array:
        # the limit reached with the player alive (Craftax's own `done` does not say which)
        return state.done & (state.env.timestep >= self.env_params.max_timesteps) & (state.env.player_health > 0)

    def render(self, state: CraftaxState) -> np.ndarray:
        """Craftax's own pixels of the player's view and inventory (16 pixels a block)."""
        if self._render is None:
            from craftax.craftax_classic.constants import BLOCK_PIXEL_SIZE_IMG
            from craftax.craftax_classic.renderer import make_craftax_pixel_renderer

            self._render = jax.jit(make_craftax_pixel_renderer(BLOCK_PIXEL_SIZE_IMG))
        return np.clip(np.asarray(self._render(state.env)), 0, 255).astype(np.uint8)


def _channel_colors(num_channels: int) -> np.ndarray:
    hues = np.linspace(0, 1, num_channels, endpoint=False)
    return np.stack([255 * (0.5 + 0.5 * np.cos(2 * np.pi * (hues + shift))) for shift in (0, 1 / 3, 2 / 3)], -1)


def playground_registry():
    """MuJoCo Playground's registry, imported with headless rendering (EGL) for videos unless MUJOCO_GL says otherwise:
    mujoco reads MUJOCO_GL once, when it is first imported."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    from mujoco_playground import registry

    return registry


class PlaygroundState(NamedTuple):
    env: Any  # Playground's State (MJX data, observation, reward, done)
    steps: jax.Array  # the episode's steps so far: the time limit truncates at the config's episode_length
    key: jax.Array  # the env's own key: its resets draw from it


class PlaygroundEnv(JaxEnv):
    """A MuJoCo Playground DeepMind Control Suite task: its State, the episode's step count and the env's key, with
    envpool's auto-reset and time limit (Playground's own training wrappers do both; the raw env does neither)."""

    observation_kind = "vector"
    action_dtype = jnp.float32

    def __init__(self, env_id: str):
        registry = playground_registry()
        config = registry.get_default_config(env_id)
        config.impl = "jax"
        self.env = registry.load(env_id, config=config)
        # MJX puts the model on jax.devices()[0], another process's device under jax.distributed: on this one's instead
        from mujoco import mjx

        self.env._mjx_model = mjx.put_model(self.env.mj_model, impl="jax", device=jax.local_devices()[0])
        self.episode_length = int(config.episode_length)
        self.action_dim = int(self.env.action_size)
        self.observation_shape = (int(self.env.observation_size),)
        self.action_low, self.action_high = -np.ones(self.action_dim, np.float32), np.ones(self.action_dim, np.float32)
        self._renderer = self._render_data = None  # made on the first frame (videos only)

    def reset(self, key: jax.Array) -> PlaygroundState:
        reset_key, key = jax.random.split(key)
        return PlaygroundState(self.env.reset(reset_key), jnp.int32(0), key)

    def sample_action(self, key: jax.Array) -> jax.Array:
        return jax.random.uniform(key, (self.action_dim,), minval=-1.0, maxval=1.0)

    def step(self, state: PlaygroundState, action: jax.Array) -> PlaygroundState:
        key, reset_key = jax.random.split(state.key)
        action = jnp.clip(action, self.action_low, self.action_high)
        # as pgx's: under vmap both branches run, as a select per env
        return jax.lax.cond(
            self.terminated(state) | self.truncated(state),
            lambda: PlaygroundState(self.env.reset(reset_key), jnp.int32(0), key),
            lambda: PlaygroundState(self.env.step(state.env, action), state.steps + 1, key),
        )

    def observation(self, state: PlaygroundState) -> jax.Array:
        return state.env.obs

    def reward(self, state: PlaygroundState) -> jax.Array:
        return state.env.reward

    def terminated(self, state: PlaygroundState) -> jax.Array:
        return state.env.done > 0  # the Control Suite's tasks end early only on a non-finite state

    def truncated(self, state: PlaygroundState) -> jax.Array:
        return (state.steps >= self.episode_length) & (state.env.done == 0)

    def render(self, state: PlaygroundState) -> np.ndarray:
        """The default camera's frame, as Playground's `render` draws one, with one renderer kept for every frame
        (Playground's makes a renderer, an OpenGL context, per call: 0.4 s a frame here)."""
        import mujoco

        if self._renderer is None:
            self._renderer = mujoco.Renderer(self.env.mj_model, height=240, width=320)
            self._render_data = mujoco.MjData(self.env.mj_model)
        data = self._render_data
        data.qpos, data.qvel = np.asarray(state.env.data.qpos), np.asarray(state.env.data.qvel)
        mujoco.mj_forward(self.env.mj_model, data)
        self._renderer.update_scene(data, camera=-1)
        return self._renderer.render()


def env_ids(*, discrete: bool) -> list[str]:
    """Every id the Anakin script of that action kind accepts."""
    if not discrete:
        return list(playground_registry().dm_control_suite.ALL_ENVS)
    import xminigrid

    minigrid = [name for name in xminigrid.registered_environments() if name.startswith("MiniGrid-")]
    return minigrid + [f"minatar-{game}" for game in MINATAR_GAMES] + CRAFTAX_IDS


def check_env_id(env_id: str, *, discrete: bool, env_options: Sequence[str] = ()):
    """envs.check_env_id's check for the JAX env families: one UsageError line naming the ids there are, with a hint
    for a near miss; these families take no envpool options (`env_options` must be empty). XLand-MiniGrid's meta-RL
    envs sample their task from a benchmark of rulesets that xminigrid downloads on first use (not part of the
    package), so they are not offered; pgx's board games are two-player, not single-agent RL envs; Playground's
    locomotion and manipulation envs need MuJoCo Menagerie's models, which Playground downloads on first use (not
    offered)."""
    if env_options:
        raise UsageError(f"--env-options {' '.join(env_options)!r}: the JAX env families take no options")
    ids = env_ids(discrete=discrete)
    if env_id in ids:
        return
    hint = ""
    if env_id.rsplit("-", 1)[-1].startswith("v") and env_id.rsplit("-", 1)[0] in ids:
        hint = f" (these ids have no version: {env_id.rsplit('-', 1)[0]})"
    elif env_id.startswith("XLand-MiniGrid"):
        hint = " (XLand-MiniGrid's meta-RL envs need a ruleset benchmark downloaded by xminigrid: not supported)"
    elif env_id.lower().startswith("minatar") or env_id.lower().startswith("minatar-"):
        hint = " (pgx's MinAtar ids are lowercase: minatar-breakout, ...)"
    elif env_id.startswith("Craftax"):
        hint = " (Craftax-Classic's symbolic observation only: its pixels need a CNN, the full Craftax is not offered)"
    elif env_id in env_ids(discrete=not discrete):
        hint = f" ({env_id} has {'continuous' if discrete else 'discrete'} actions: the other Anakin PPO script's)"
    raise UsageError(f"--env-id must be one of {', '.join(ids)}, got {env_id!r}{hint}")


def make_jax_env(env_id: str) -> XMiniGridEnv | MinAtarEnv | CraftaxEnv | PlaygroundEnv:
    """The adapter for --env-id, of either action kind (checked first: one line if it is not one of ours)."""
    if env_id.startswith(("MiniGrid-", "minatar-", "Craftax-")):
        check_env_id(env_id, discrete=True)
        if env_id.startswith("Craftax-"):
            return CraftaxEnv(env_id)
        return MinAtarEnv(env_id) if env_id.startswith("minatar-") else XMiniGridEnv(env_id)
    check_env_id(env_id, discrete=False)
    return PlaygroundEnv(env_id)


class JaxVectorEnvs:
    """`num_envs` envs of an adapter behind the gymnasium vector API that cleanrl_utils.evals steps (reset, step,
    render), with envpool's auto-reset; env i is seeded with `jax.random.key(seed + i)`."""

    def __init__(self, env_id: str, seed: int, num_envs: int, render_mode: str | None = None):
        self.env = make_jax_env(env_id)
        self.keys = jax.vmap(jax.random.key)(seed + np.arange(num_envs, dtype=np.uint32))
        self.render_mode, self.state = render_mode, None
        self._reset = jax.jit(jax.vmap(self.env.reset))
        self._step = jax.jit(self.env.step_envs)

    def reset(self):
        self.state = self._reset(self.keys)
        return np.asarray(self.env.observation(self.state)), {}

    def step(self, actions):
        self.state = state = self._step(self.state, jnp.asarray(actions, self.env.action_dtype))
        return (
            np.asarray(self.env.observation(state)),
            np.asarray(self.env.reward(state)),
            np.asarray(self.env.terminated(state)),
            np.asarray(self.env.truncated(state)),
            {},
        )

    def render(self) -> np.ndarray:
        """Env 0's frame as RGB, in a batch of one (as envpool renders env 0)."""
        return self.env.render(jax.tree.map(lambda x: x[0], self.state))[None]
