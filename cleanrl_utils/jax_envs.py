"""JAX-native env libraries as the Anakin script sees them: one small adapter per library, so that a run changes
`--env-id`, not the script. (The Sebulba scripts' envpool families are cleanrl_utils/envs.py.)

An adapter is functional, for `vmap` and `lax.scan` inside the compiled update: `reset(key)` gives one env's state and
`step(state, action)` the next, with envpool's auto-reset: the step after an episode's end resets the env and ignores
its action (so the Sebulba scripts' GAE and losses apply unchanged). The state carries the env's own randomness (its
reset and sticky-action keys) and the last transition: `observation`, `reward`, `terminated` and `truncated` read it.
Families:

- XLand-MiniGrid's MiniGrid tasks (`MiniGrid-Empty-5x5`, ...; Nikulin et al. 2024): the egocentric 7x7 view of tile
  and color ids, no time limit beyond the task's own (a truncation);
- pgx's MinAtar games (`minatar-breakout`, `minatar-asterix`, `minatar-freeway`, `minatar-seaquest`,
  `minatar-space_invaders`; Young & Tian 2019, as pgx implements them: sticky actions with probability 0.1, the
  minimal action set): 10x10 images of binary channels.

Importing either library starts JAX's backend (their constants are arrays), so the ids are checked in
check_runtime_values, after jax.distributed has started.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cleanrl_utils.errors import UsageError

MINATAR_GAMES = ["asterix", "breakout", "freeway", "seaquest", "space_invaders"]


class XMiniGridEnv:
    """An xminigrid MiniGrid task; its TimeStep is the state (DmEnvAutoResetWrapper resets the step after the end)."""

    observation_kind = "symbolic"  # tile and color ids: an MLP on the flattened view

    def __init__(self, env_id: str):
        import xminigrid
        from xminigrid.wrappers import DmEnvAutoResetWrapper

        env, self.env_params = xminigrid.make(env_id)
        self.env = DmEnvAutoResetWrapper(env)
        self.num_actions = int(self.env.num_actions(self.env_params))
        self.observation_shape = tuple(self.env.observation_shape(self.env_params))

    def reset(self, key: jax.Array) -> Any:
        return self.env.reset(self.env_params, key)

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


class MinAtarEnv:
    """A pgx MinAtar game, its State and the env's key. pgx resets nothing by itself: `step` does it, envpool's way."""

    observation_kind = "image"  # 10x10 binary channels: pgx's MinAtar PPO example's small CNN

    def __init__(self, env_id: str):
        import pgx

        self.env = pgx.make(env_id)
        self.num_actions = int(self.env.num_actions)
        self.observation_shape = tuple(self.env.observation_shape)

    def reset(self, key: jax.Array) -> MinAtarState:
        init_key, key = jax.random.split(key)
        return MinAtarState(self.env.init(init_key), key)

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


def _channel_colors(num_channels: int) -> np.ndarray:
    hues = np.linspace(0, 1, num_channels, endpoint=False)
    return np.stack([255 * (0.5 + 0.5 * np.cos(2 * np.pi * (hues + shift))) for shift in (0, 1 / 3, 2 / 3)], -1)


def env_ids() -> list[str]:
    """Every id the Anakin script accepts."""
    import xminigrid

    minigrid = [name for name in xminigrid.registered_environments() if name.startswith("MiniGrid-")]
    return minigrid + [f"minatar-{game}" for game in MINATAR_GAMES]


def check_env_id(env_id: str):
    """One UsageError line naming the ids there are, with a hint for a near miss. XLand-MiniGrid's meta-RL envs sample
    their task from a benchmark of rulesets that xminigrid downloads on first use (not part of the package), so they
    are not offered; pgx's board games are two-player, not single-agent RL envs."""
    ids = env_ids()
    if env_id in ids:
        return
    hint = ""
    if env_id.rsplit("-", 1)[-1].startswith("v") and env_id.rsplit("-", 1)[0] in ids:
        hint = f" (these ids have no version: {env_id.rsplit('-', 1)[0]})"
    elif env_id.startswith("XLand-MiniGrid"):
        hint = " (XLand-MiniGrid's meta-RL envs need a ruleset benchmark downloaded by xminigrid: not supported)"
    elif env_id.lower().startswith("minatar") or env_id.lower().startswith("minatar-"):
        hint = " (pgx's MinAtar ids are lowercase: minatar-breakout, ...)"
    raise UsageError(f"--env-id must be one of {', '.join(ids)}, got {env_id!r}{hint}")


def make_jax_env(env_id: str) -> XMiniGridEnv | MinAtarEnv:
    """The adapter for --env-id (checked first: one line if it is not one of ours)."""
    check_env_id(env_id)
    return MinAtarEnv(env_id) if env_id.startswith("minatar-") else XMiniGridEnv(env_id)


class JaxVectorEnvs:
    """`num_envs` envs of an adapter behind the gymnasium vector API that cleanrl_utils.evals steps (reset, step,
    render), with envpool's auto-reset; env i is seeded with `jax.random.key(seed + i)`."""

    def __init__(self, env_id: str, seed: int, num_envs: int, render_mode: str | None = None):
        self.env = make_jax_env(env_id)
        self.keys = jax.vmap(jax.random.key)(seed + np.arange(num_envs, dtype=np.uint32))
        self.render_mode, self.state = render_mode, None
        self._reset = jax.jit(jax.vmap(self.env.reset))
        self._step = jax.jit(jax.vmap(self.env.step))

    def reset(self):
        self.state = self._reset(self.keys)
        return np.asarray(self.env.observation(self.state)), {}

    def step(self, actions):
        self.state = state = self._step(self.state, jnp.asarray(actions, jnp.int32))
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
