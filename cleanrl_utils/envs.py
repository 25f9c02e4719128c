"""envpool's env families as the training scripts see them: which ids a script accepts, the options each
family's reference uses (passed explicitly, cited), and dict observations flattened into one vector.

Every script calls `check_env_id` in validate_args (one UsageError line, before any heavy work),
`make_envpool` in make_env, and `env_spaces` where it builds its networks; the torso follows `obs_layout`.
"""

import ast
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import NamedTuple


def _without_envpools_jumanji_package():
    """envpool registers every family it has when it is imported, and the package of its Jumanji envs imports
    matplotlib.pyplot for their renderers: 1.1 s of every run's start, about a sixth of a tiny run. No script here
    takes a Jumanji id (`FAMILIES`), so that package is an empty one in our processes: its ids still register from
    its registration module, and making one of them fails (they are refused with one line before that)."""
    envpool_folders = importlib.util.find_spec("envpool").submodule_search_locations
    jumanji = types.ModuleType("envpool.jumanji", "envpool's Jumanji envs: not loaded (cleanrl_utils.envs)")
    jumanji.__path__ = [os.path.join(folder, "jumanji") for folder in envpool_folders]
    sys.modules.setdefault("envpool.jumanji", jumanji)


_without_envpools_jumanji_package()

import envpool  # noqa: E402 (after the function above)
import gymnasium  # noqa: E402
import numpy as np  # noqa: E402

from cleanrl_utils.errors import UsageError  # noqa: E402


class Family(NamedTuple):
    name: str
    discrete_example: str | None  # an id with Discrete actions (PPO, IMPALA, R2D2, MuZero), None if the family has none
    continuous_example: str | None  # an id with Box actions (MuJoCo PPO, SAC), None if the family has none
    obs_layout: str  # "chw" / "hwc" uint8 images (IMPALA CNN), or "vector" (MLP; dicts are flattened)
    options: dict  # envpool.make keyword arguments, each from the family's reference setup
    fixed_length_episodes: bool = False  # no episode ends early: envs that start together stay in lock-step


FAMILIES = {  # envpool's registry name of the family -> how the scripts train on it
    "envpool.atari": Family(
        "Atari",
        "Breakout-v5",
        None,
        "chw",
        dict(
            # IMPALA's Atari setup (Espeholt et al. 2018, Appendix G); envpool's defaults differ
            episodic_life=True,  # a lost life ends the episode for learning (scores still count whole games)
            reward_clip=True,  # rewards clipped to [-1, 1]
            noop_max=30,  # up to 30 no-op actions at the start of each episode
            full_action_space=False,  # the minimal, game-specific action set
            max_episode_steps=108_000 // 4,  # 108k frames (30 minutes of play) = 27k steps at frame-skip 4
            repeat_action_probability=0.0,
        ),
    ),  # no sticky actions, as in the IMPALA paper
    "envpool.gfootball": Family(
        "Google Research Football",
        "gfootball/academy_empty_goal_close-v1",
        None,
        "hwc",
        # SEED RL's football/env.py: the Super Mini Map (SMM, 72 x 96 x 4 planes), "scoring" rewards, action
        # repeat 1. envpool has exactly these and no frame stacking (SEED stacks 4 SMM frames): one frame here.
        dict(physics_steps_per_frame=10),
    ),  # gfootball's own default, as SEED RL uses it
    "envpool.vizdoom": Family(
        "VizDoom",
        "Basic-v1",
        None,
        "chw",
        dict(
            use_combined_action=True,  # Discrete over button combinations instead of a Box of buttons
            frame_skip=4,  # Sample Factory's --env_frameskip default for Doom (Petrenko et al. 2020, Sec. 4)
            stack_num=4,  # 4 stacked RGB frames (12 x 84 x 84): our torsos are feed-forward (no RNN)
            img_height=84,
            img_width=84,
            episodic_life=False,
        ),
    ),
    "envpool.minigrid": Family(
        "MiniGrid",
        "MiniGrid-Empty-5x5-v0",
        None,
        "vector",
        # MiniGrid's own per-task settings (Chevalier-Boisvert et al. 2023: 7x7 egocentric view, max_steps
        # per task) are envpool's per-id defaults, so nothing is overridden
        {},
    ),
    "envpool.procgen": Family(
        "Procgen",
        "BigfishEasy-v0",
        None,
        "chw",
        dict(
            # the distribution mode is the id's Easy/Hard; Cobbe et al. 2020 train on the unrestricted level
            # distribution for sample efficiency (num_levels=0) with all backgrounds, as the paper's benchmark
            num_levels=0,
            start_level=0,
            use_backgrounds=True,
            channel_first=True,
        ),
    ),
    "envpool.mujoco.gym": Family("MuJoCo (gym)", None, "HalfCheetah-v4", "vector", {}),
    "envpool.mujoco.dmc": Family(
        "DeepMind Control",
        None,
        "CheetahRun-v1",
        "vector",
        dict(
            # Tassa et al. 2018 (DeepMind Control Suite, Sec. 2): 1000-step episodes, rewards in [0, 1]. envpool's
            # frame_skip here is dm_control's physics steps per control step, and its per-task defaults are the
            # suite's control timesteps (Walker 10, Hopper 4, Cheetah 1): never override it (frame_skip=1 made
            # WalkerWalk's 1000 steps 2.5 s of simulated time instead of 25 s, issue #56)
            max_episode_steps=1000,
        ),
        fixed_length_episodes=True,  # no task of the suite ends an episode early (Tassa et al. 2018, Sec. 2)
    ),
    # CartPole-v1, Acrobot-v1, ... (Discrete) and Pendulum-v1 (Box): the id's action space says which scripts take it
    "envpool.classic_control": Family("classic control", "CartPole-v1", "Pendulum-v1", "vector", {}),
}
# envpool's VizDoom starts one game process per env with fork() from several of envpool's threads at once. OpenBLAS
# (loaded with numpy) runs a fork handler that joins its worker threads, and two forks at once can join the same
# thread twice and wait forever (seen here: 6 of 8 tiny runs hung). With one OpenBLAS thread there is nothing to
# join; the discrete scripts set OPENBLAS_NUM_THREADS=1 before numpy loads, unless the user set it.
FORK_SAFE_ENV = {"envpool.vizdoom": {"OPENBLAS_NUM_THREADS": "1"}}
CANNOT_START_HINTS = {"envpool.procgen": "install the Qt 5 runtime first: apt-get install libqt5gui5 (Debian/Ubuntu)"}
# envpool options --env-options may not set: make_envpool sets the first ones, and the torsos assume the layout the
# rest give (Procgen's channel order, VizDoom's discrete combined actions)
FIXED_OPTIONS = {
    "num_envs",
    "batch_size",
    "num_threads",
    "seed",
    "env_seed",
    "max_num_players",
    "base_path",
    "thread_affinity_offset",
    "gym_reset_return_info",
    "channel_first",
    "use_combined_action",
}
DICT_OBS_SKIPPED = {"mission"}  # MiniGrid's instruction as bytes: constant per MiniGrid-* id, needs a text encoder


def env_family(env_id: str) -> str:
    return envpool.registration.registry.specs.get(env_id, ("",))[0]


def env_options(env_id: str, overrides: Sequence[str] = ()) -> dict:
    """The envpool options of `env_id`: its family's cited options, then --env-options' KEY=VALUE pairs (VALUE a
    Python literal: 42, 0.5, True, "text"; anything else is a string). UsageError (one line) for a key envpool
    does not have for this id, one the scripts fix, or a value of another type than envpool's default."""
    options = dict(FAMILIES[env_family(env_id)].options)
    spec = envpool.make_spec(env_id)
    defaults = dict(zip(spec._config_keys, spec._config_values))  # this id's values
    for pair in overrides:
        key, equals, text = pair.partition("=")
        if not equals or key not in defaults or key in FIXED_OPTIONS:
            allowed = ", ".join(sorted(set(defaults) - FIXED_OPTIONS))
            raise UsageError(
                f"--env-options {pair!r} is not KEY=VALUE with a KEY of {env_id}'s envpool options: {allowed}"
            )
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        default = defaults[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        sequences = isinstance(default, (list, tuple)) and isinstance(value, (list, tuple))
        if type(value) is not type(default) and not sequences:
            raise UsageError(
                f"--env-options {pair!r}: {key} takes {type(default).__name__} values (envpool's default for "
                f"{env_id}: {default!r})"
            )
        options[key] = value
    return options


def check_env_id(env_id: str, *, discrete: bool, env_options: Sequence[str] = ()):
    """UsageError (one line naming --env-id or --env-options) unless `env_id` is an envpool id of a family this kind
    of script trains on, `env_options` are options of it, and it can start on this machine."""

    def example(family):
        return family.discrete_example if discrete else family.continuous_example

    allowed = ", ".join(f"{f.name} ({example(f)})" for f in FAMILIES.values() if example(f))
    family = FAMILIES.get(env_family(env_id))
    if family is None or not example(family) or env_id.startswith("BabyAI-"):
        why = " (BabyAI's missions need a text encoder)" if env_id.startswith("BabyAI-") else ""
        raise UsageError(f"--env-id {env_id!r} is not supported{why}: use an envpool id of {allowed}")
    for name, value in FORK_SAFE_ENV.get(env_family(env_id), {}).items():
        if os.environ.get(name) != value:
            raise UsageError(
                f"--env-id {env_id!r} needs {name}={value} in the environment (found "
                f"{os.environ.get(name)!r}): its game processes are forked from several threads at once, "
                f"and OpenBLAS's fork handler can hang then"
            )
    try:
        action_space = env_spaces(env_id, env_options)[1]  # with the family's options (VizDoom's combined actions)
    except ImportError as error:  # envpool imports a family's library on first use
        hint = CANNOT_START_HINTS.get(env_family(env_id), "see envpool's install notes for this family")
        raise UsageError(f"--env-id {env_id!r} cannot start here ({str(error).splitlines()[0]}): {hint}") from None
    if hasattr(action_space, "n") != discrete:
        raise UsageError(
            f"--env-id {env_id!r} is not supported ({'continuous' if discrete else 'discrete'} "
            f"actions): use an envpool id of {allowed}"
        )


def obs_layout(env_id: str) -> str:
    return FAMILIES[env_family(env_id)].obs_layout


def dict_obs_keys(obs_space: gymnasium.spaces.Dict) -> list[str]:
    """The fixed order in which dict observations are concatenated: sorted keys, skipped ones left out."""
    return sorted(key for key in obs_space.spaces if key not in DICT_OBS_SKIPPED)


def flatten_obs(obs: dict, keys: list[str]) -> np.ndarray:
    """(N, ...) arrays under `keys` -> one float32 (N, D) array, concatenated in the order of `keys`."""
    return np.concatenate([np.asarray(obs[key], np.float32).reshape(len(obs[key]), -1) for key in keys], axis=1)


def flat_obs_space(obs_space: gymnasium.spaces.Dict) -> gymnasium.spaces.Box:
    size = sum(int(np.prod(obs_space[key].shape)) for key in dict_obs_keys(obs_space))
    return gymnasium.spaces.Box(-np.inf, np.inf, (size,), np.float32)


def env_spaces(env_id: str, overrides: Sequence[str] = ()) -> tuple[gymnasium.Space, gymnasium.Space]:
    """(observation space as the agent sees it, action space) of `env_id` with its options, without starting envs."""
    spec = envpool.make_spec(env_id, **env_options(env_id, overrides))
    obs_space = spec.observation_space
    if isinstance(obs_space, gymnasium.spaces.Dict):
        obs_space = flat_obs_space(obs_space)
    return obs_space, spec.action_space


class FlatObsEnvs:
    """envpool envs whose dict observations arrive as one float32 vector per env (dict_obs_keys order)."""

    def __init__(self, envs):
        self.envs, self.keys = envs, dict_obs_keys(envs.observation_space)
        self.observation_space = flat_obs_space(envs.observation_space)

    def reset(self, *args, **kwargs):
        obs, info = self.envs.reset(*args, **kwargs)
        return flatten_obs(obs, self.keys), info

    def step(self, *args, **kwargs):
        obs, *rest = self.envs.step(*args, **kwargs)
        return flatten_obs(obs, self.keys), *rest

    def __getattr__(self, name):  # render, close, action_space, spec, ...
        return getattr(self.envs, name)


def make_envpool(
    env_id: str,
    seed: int,
    num_envs: int,
    render_mode: str | None = None,
    num_threads: int = 0,
    overrides: Sequence[str] = (),
):
    """envpool gymnasium envs with the family's options and `overrides` (--env-options); env i of the pool is seeded
    with seed + i; render_mode="rgb_array" makes envs.render() return env 0's frame (videos)."""
    if env_family(env_id) == "envpool.vizdoom":
        # each VizDoom game process creates ./_vizdoom/ when it is missing; several starting at once race on it, the
        # loser exits and envpool then crashes (a segfault in 2 of 8 starts in new folders here): create it first
        os.makedirs("_vizdoom", exist_ok=True)
    envs = envpool.make(
        env_id,
        env_type="gymnasium",
        num_envs=num_envs,
        seed=seed,
        render_mode=render_mode,
        num_threads=num_threads,
        **env_options(env_id, overrides),
    )
    return FlatObsEnvs(envs) if isinstance(envs.observation_space, gymnasium.spaces.Dict) else envs


def random_actions(space: gymnasium.Space, rng: np.random.Generator, num_envs: int) -> np.ndarray:
    """Uniformly random actions of `space` for `num_envs` envs (Discrete: each action; Box: within the bounds)."""
    if hasattr(space, "n"):
        return rng.integers(space.n, size=num_envs)
    return rng.uniform(space.low, space.high, size=(num_envs, *space.shape))


def out_of_phase_steps(
    env_id: str, stagger: str, *, episode_steps: int, first_env: int, num_envs: int, global_num_envs: int
) -> np.ndarray:
    """The steps each env of a pool takes before the first rollout (--stagger-episodes): env g of the run's N envs
    takes g x T // N (T = `episode_steps`), so their episodes end spread evenly over one episode length, as Sample
    Factory's env decorrelation does; "auto" does it only where episodes never end early (`fixed_length_episodes`):
    there envs that start together stay in lock-step for the whole run and every rollout holds the same stretch of
    every episode. Zeros where it is off. `first_env`: the pool's first env among the run's (thread x envs)."""
    family = FAMILIES[env_family(env_id)]
    if stagger == "off" or (stagger == "auto" and not family.fixed_length_episodes):
        return np.zeros(num_envs, dtype=np.int64)
    return np.arange(first_env, first_env + num_envs, dtype=np.int64) * episode_steps // global_num_envs


def reset_out_of_phase(envs, args, *, first_env: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Resets `envs` (a pool of the run's --env-id), then steps env j alone (envpool steps a subset of its envs) as
    many times as `out_of_phase_steps` says for --stagger-episodes, with uniformly random actions (a NumPy generator
    seeded with `seed`: the same steps in every run of the seed). An env whose episode ends on its last warm-up step
    also takes envpool's reset step, so every env starts the first rollout inside an episode or at its start.
    Returns the observations the first rollout starts from and each env's warm-up steps."""
    warm_up_steps = out_of_phase_steps(
        args.env_id,
        args.stagger_episodes,
        episode_steps=envs.config["max_episode_steps"],
        first_env=first_env,
        num_envs=len(envs.all_env_ids),
        global_num_envs=args.global_num_envs,
    )
    obs = envs.reset()[0]
    rng, space = np.random.default_rng(seed), envs.action_space
    remaining = warm_up_steps.copy()
    while remaining.any():
        env_ids = np.flatnonzero(remaining).astype(np.int32)
        actions = random_actions(space, rng, len(env_ids))
        step_obs, _, terminated, truncated, info = envs.step(actions, env_ids)
        stepped = info["env_id"]  # the order envpool answers in
        obs[stepped] = step_obs
        remaining[stepped] -= 1
        # an episode that ended on the last warm-up step: one more step, envpool's reset step
        remaining[stepped[np.logical_or(terminated, truncated) & (remaining[stepped] == 0)]] = 1
    return obs, warm_up_steps


def random_policy_return(env_id: str, episodes: int, seed: int = 123, overrides: Sequence[str] = ()) -> float:
    """The mean return of uniformly random actions over `episodes` whole episodes: the baseline a learning
    result is compared with (tests, benchmark/seed_envs.sh). Each of the 8 envs plays the same number of episodes
    (the first ones it finishes): taking the first `episodes` to finish overall would favour short episodes."""
    envs, rng = make_envpool(env_id, seed=seed, num_envs=8, overrides=overrides), np.random.default_rng(seed)
    per_env = -(-episodes // 8)
    try:
        envs.reset()
        space, returns, episode_return = envs.action_space, [[] for _ in range(8)], np.zeros(8)
        while min(len(r) for r in returns) < per_env:
            actions = random_actions(space, rng, 8)
            _, reward, terminated, truncated, _ = envs.step(actions)
            episode_return += reward
            for i in np.flatnonzero(terminated | truncated):
                returns[i].append(episode_return[i])
                episode_return[i] = 0
    finally:
        envs.close()  # VizDoom's game processes end with it
    return float(np.mean([r[:per_env] for r in returns]))


if __name__ == "__main__":  # python -m cleanrl_utils.envs ENV_ID EPISODES [KEY=VALUE ...]: random play's mean return
    import sys

    mean_return = random_policy_return(sys.argv[1], int(sys.argv[2]), overrides=sys.argv[3:])
    print(f"{sys.argv[1]} random policy: {mean_return:.3f} over {sys.argv[2]} episodes")
