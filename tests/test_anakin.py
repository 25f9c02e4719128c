"""The Anakin PPO scripts (cleanba_ppo_anakin.py, discrete actions; cleanba_ppo_continuous_action_anakin.py): their
env adapters, the layout-independence of their one compiled update, their rollouts' bookkeeping against a plain loop,
bad input, for an env of each family; learning MiniGrid-Empty-5x5 and CartpoleBalance against the random policy (the
scripts' runs as processes, exact resume and two processes: tests/test_anakin_runs.py)."""

import re
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from anakin_families import FAMILIES, ONE_PER_SCRIPT, TINY, anakin, anakin_continuous, script_of
from conftest import (
    ANAKIN_SCRIPT,
    CONTINUOUS_ANAKIN_SCRIPT,
    page_command_flags,
    run_script,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.cli import parse_flags
from cleanrl_utils.devices import stack_seeds
from cleanrl_utils.errors import UsageError
from cleanrl_utils.evals.evaluate import run_episodes
from cleanrl_utils.jax_envs import strongly_typed

# the README's CPU command: the Sebulba PPO MiniGrid test's settings (1,024 env steps per update) in one program
README_FLAGS = (
    "--env-id MiniGrid-Empty-5x5 --local-num-envs 32 --num-steps 32 --num-minibatches 4 --update-epochs 4 "
    "--learning-rate 1e-3 --hiddens 64 64 --total-timesteps 61440"
).split()


def in_process(env_ids: list[str], quick: tuple[str, ...] = tuple(FAMILIES[:2])) -> list:
    """MJX's physics and Craftax's world generation take tens of seconds to compile on a CPU: their in-process tests
    are in the slow tier, and so are the families not in `quick`."""
    return [env_id if env_id in quick else pytest.param(env_id, marks=pytest.mark.slow) for env_id in env_ids]


def test_the_env_factory_gives_minigrid_spaces_and_envpools_auto_reset():
    env = anakin.make_jax_env("MiniGrid-Empty-5x5")
    assert env.num_actions == 6 and env.observation_shape == (7, 7, 2) and env.observation_kind == "symbolic"
    envs = anakin.make_env("MiniGrid-Empty-5x5", seed=3, num_envs=2, render_mode="rgb_array")
    obs, _ = envs.reset()
    assert obs.shape == (2, 7, 7, 2) and obs.dtype == np.uint8
    frame = envs.render()
    assert frame.ndim == 4 and frame.shape[0] == 1 and frame.shape[-1] == 3 and frame.dtype == np.uint8
    # Empty-5x5: the agent starts at (1, 1) facing right, the goal is at (3, 3): forward, forward, right, forward,
    # forward (actions 0 forward, 1 right) reaches it in 5 steps, paid 1 - 0.9 x 5 / 100 (MiniGrid's reward)
    rewards, ends = [], []
    for action in [0, 0, 1, 0, 0]:
        obs, reward, terminated, truncated, _ = envs.step(np.full(2, action))
        rewards.append(reward[0]), ends.append((terminated[0], truncated[0]))
    assert ends == [(False, False)] * 4 + [(True, False)]
    np.testing.assert_allclose(rewards, [0, 0, 0, 0, 1 - 0.9 * 5 / 100], rtol=1e-6)
    # envpool's auto-reset: the next step resets the env (its action is ignored) and pays nothing
    reset_obs, reward, terminated, truncated, _ = envs.step(np.full(2, 0))
    np.testing.assert_array_equal(reset_obs, envs.reset()[0])
    assert reward[0] == 0 and not terminated[0] and not truncated[0]


def test_minatar_adapter_steps_as_pgx_and_resets_the_step_after_an_episode_end():
    """pgx's MinAtar Breakout behind the adapter, against pgx's own `init` and `step` in a plain loop: the same states
    while the episode runs, then envpool's auto-reset: the step after the end is `init` with that step's reset key
    (its action ignored), paying nothing and ending nothing."""
    import pgx

    env, game = anakin.make_jax_env("minatar-breakout"), pgx.make("minatar-breakout")
    assert env.num_actions == 3 and env.observation_shape == (10, 10, 4) and env.observation_kind == "image"
    step, pgx_step, pgx_init = jax.jit(env.step), jax.jit(game.step), jax.jit(game.init)
    init_key, key = jax.random.split(jax.random.key(0))  # the adapter's state carries the env's own key
    state, expected = env.reset(jax.random.key(0)), pgx_init(init_key)
    jax.tree.map(np.testing.assert_array_equal, state.game, expected)
    rng = np.random.default_rng(0)
    for _ in range(1000):
        action = np.int32(rng.integers(3))
        ended = bool(env.terminated(state) | env.truncated(state))
        state = step(state, action)
        key, reset_key, step_key = jax.random.split(key, 3)
        expected = pgx_init(reset_key) if ended else pgx_step(expected, action, step_key)
        jax.tree.map(np.testing.assert_array_equal, state.game, expected)
        if ended:
            assert float(env.reward(state)) == 0 and not bool(env.terminated(state)) and not bool(env.truncated(state))
            break
    else:
        pytest.fail("random play ends a Breakout episode within 1000 steps")
    # the evaluator's envs (videos: each cell 8x8 pixels)
    envs = anakin.make_env("minatar-breakout", seed=3, num_envs=2, render_mode="rgb_array")
    obs, _ = envs.reset()
    assert obs.shape == (2, 10, 10, 4) and obs.dtype == bool
    assert envs.step(np.zeros(2, int))[0].shape == (2, 10, 10, 4)
    frame = envs.render()
    assert frame.shape == (1, 80, 80, 3) and frame.dtype == np.uint8 and frame.any()


@pytest.mark.slow
def test_craftax_adapter_steps_as_craftax_tells_the_time_limit_from_death_and_resets_the_step_after():
    """Craftax-Classic behind the adapter, against Craftax's own `reset_env` and `step_env` in a plain loop: the same
    observations and rewards while the episode runs; an episode that reaches the 10,000-step limit alive is a
    truncation, one that ends by death a termination (Craftax's `done` says neither); the step after an end resets
    the env with that step's reset key, ignoring its action, and pays nothing. A batch of envs (`step_envs`, which
    generates a world for the ended envs only) steps each env as its own `step` does."""
    from craftax.craftax_env import make_craftax_env_from_name

    env_id = "Craftax-Classic-Symbolic-v1"
    env, craftax = anakin.make_jax_env(env_id), make_craftax_env_from_name(env_id, auto_reset=False)
    assert env.num_actions == 17 and env.observation_shape == (1345,) and env.observation_kind == "symbolic"
    params = env.env_params
    # the same numbers, but the light level (a cosine) may round differently in another compiled program
    same_obs = partial(np.testing.assert_allclose, rtol=1e-6, atol=0)
    step, craftax_step, craftax_reset = jax.jit(env.step), jax.jit(craftax.step_env), jax.jit(craftax.reset_env)
    reset_key, key = jax.random.split(jax.random.key(0))  # the adapter's state carries the env's own key
    state, (obs, expected) = jax.jit(env.reset)(jax.random.key(0)), craftax_reset(reset_key, params)
    expected = strongly_typed(expected)  # as the adapter's reset: else the reference step compiles twice (10 s here)
    same_obs(state.obs, obs)
    rng = np.random.default_rng(0)
    for _ in range(50):
        action = np.int32(rng.integers(17))
        state = step(state, action)
        key, reset_key, step_key = jax.random.split(key, 3)
        obs, expected, reward, done, _ = craftax_step(step_key, expected, action, params)
        same_obs(state.obs, obs)
        assert float(env.reward(state)) == float(reward) and not done and not bool(state.done)

    def ended(state, **fields):
        """One step from `state` with `fields` of Craftax's state set, and the step after it."""
        end = step(state._replace(env=state.env.replace(**fields)), np.int32(0))
        after = step(end, np.int32(5))
        _, reset_key, _ = jax.random.split(end.key, 3)
        same_obs(after.obs, craftax_reset(jax.random.split(reset_key)[0], params)[0])
        assert float(env.reward(after)) == 0 and not bool(after.done) and int(after.env.timestep) == 0
        return end

    limit, death = ended(state, timestep=np.int32(params.max_timesteps - 1)), ended(state, player_health=np.int32(0))
    assert (bool(env.terminated(limit)), bool(env.truncated(limit))) == (False, True)  # the limit, alive
    assert (bool(env.terminated(death)), bool(env.truncated(death))) == (True, False)
    # a batch of a running env and two ended ones, against each env's own step in a plain loop
    envs, actions = [state, limit, death], np.int32([3, 5, 7])
    stepped = jax.jit(env.step_envs)(jax.tree.map(lambda *leaves: jnp.stack(leaves), *envs), actions)
    for i, (one, action) in enumerate(zip(envs, actions)):
        expected, batched = step(one, action), jax.tree.map(lambda leaf, i=i: leaf[i], stepped)
        assert jax.tree.structure(batched) == jax.tree.structure(expected)
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(expected)):
            if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
                got, want = jax.random.key_data(got), jax.random.key_data(want)
            np.testing.assert_allclose(np.asarray(got, float), np.asarray(want, float), rtol=1e-6, atol=0)
    frame = env.render(state)  # a video's frame (the evaluator's envs render env 0's state): Craftax's own pixels
    assert frame.ndim == 3 and frame.shape[-1] == 3 and frame.dtype == np.uint8 and frame.std() > 0


@pytest.mark.slow
def test_playground_adapter_steps_as_playground_truncates_at_the_time_limit_and_resets_the_step_after():
    """CartpoleBalance against MuJoCo Playground's own step in a plain loop (MJX's JAX implementation): the same
    observations and rewards, actions clipped to [-1, 1]; the 1,000th step is a truncation (the Control Suite's time
    limit, as envpool's CartpoleBalance-v1), never a termination; the step after it resets the env with the next key
    of the env's own stream, ignoring its action, and pays nothing."""
    env = anakin_continuous.make_jax_env("CartpoleBalance")
    assert env.action_dim == 1 and env.observation_shape == (5,) and env.episode_length == 1000
    actions = jax.random.uniform(jax.random.key(4), (1001, 1), minval=-2.0, maxval=2.0)  # beyond the bounds too

    def step(state, action):
        state = env.step(state, action)
        return state, (env.observation(state), env.reward(state), env.terminated(state), env.truncated(state))

    start = env.reset(jax.random.key(3))
    _, (obs, rewards, terminated, truncated) = jax.device_get(jax.jit(lambda s: jax.lax.scan(step, s, actions))(start))
    playground_step, state = jax.jit(env.env.step), start.env
    for t in range(20):
        state = playground_step(state, np.clip(actions[t], -1, 1))
        np.testing.assert_allclose(obs[t], state.obs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rewards[t], state.reward, rtol=1e-5, atol=1e-6)
    assert not terminated.any()
    np.testing.assert_array_equal(np.flatnonzero(truncated), [999])
    key = start.key
    for _ in range(1001):
        key, reset_key = jax.random.split(key)
    np.testing.assert_allclose(obs[1000], env.env.reset(reset_key).obs, rtol=1e-6)
    assert rewards[1000] == 0
    # a video's frame: Playground's own render of the same state, with one renderer kept for every frame
    frame = env.render(start)
    assert frame.shape == (240, 320, 3) and frame.dtype == np.uint8 and frame.std() > 0
    np.testing.assert_array_equal(frame, env.env.render([start.env], height=240, width=320)[0])


def test_minatar_torsos_patch_layer_is_pgxs_2x2_same_convolution():
    """The torso's Dense layer on 2x2 patches against `nn.Conv(32, (2, 2), padding="SAME")` (haiku's default in pgx's
    example) with the same weights, on random MinAtar-shaped images."""
    torso = anakin.MinAtarTorso()
    images = np.random.default_rng(0).random((5, 10, 10, 4)) > 0.7
    params = torso.init(jax.random.key(0), images)["params"]
    patch_layer = params["Dense_0"]
    features = torso.apply({"params": params}, images, capture_intermediates=True)[1]["intermediates"]
    conv = flax.linen.Conv(32, (2, 2), padding="SAME")
    conv_params = {"kernel": patch_layer["kernel"].reshape(2, 2, 4, 32), "bias": patch_layer["bias"]}
    expected = conv.apply({"params": conv_params}, images.astype(np.float32))
    np.testing.assert_allclose(features["Dense_0"]["__call__"][0], expected, rtol=1e-5, atol=1e-5)


def test_minatar_torso_pools_as_haikus_avg_pool_with_pgxs_window():
    """pgx's example pools with `hk.avg_pool(x, window_shape=(2, 2), strides=(2, 2), padding="VALID")`: haiku pads a
    window shorter than the input's rank with ones in front, so on (batch, 10, 10, 32) the window is (1, 1, 2, 2):
    pairs of columns and of channels, every row kept. The torso's features against that window, with lax."""
    torso = anakin.MinAtarTorso()
    images = np.random.default_rng(1).random((3, 10, 10, 4)) > 0.7
    params = torso.init(jax.random.key(0), images)["params"]
    features = torso.apply({"params": params}, images, capture_intermediates=True)[1]["intermediates"]
    convolved = flax.linen.relu(features["Dense_0"]["__call__"][0])
    window = (1, 1, 2, 2)
    pooled = jax.lax.reduce_window(convolved, 0.0, jax.lax.add, window, window, "VALID") / 4
    assert pooled.shape == (3, 10, 5, 16)
    dense = params["Dense_1"]
    expected = flax.linen.relu(pooled.reshape(3, -1) @ dense["kernel"] + dense["bias"])
    np.testing.assert_allclose(torso.apply({"params": params}, images), expected, rtol=1e-5, atol=1e-5)


def tiny_args(**flags):
    """The default flags but small: one minibatch (each learner device shuffles its own samples)."""
    args = script_of(flags["env_id"])[0].Args(hiddens=[16], num_steps=8, num_minibatches=1, update_epochs=2, **flags)
    args.num_updates = 10
    return args


def run_updates(env_id: str, num_devices: int, total_envs: int, updates: int = 2, seeds=(1,)):
    """`updates` Anakin updates of `total_envs` envs spread over `num_devices` devices, for each of `seeds` (a
    leading seed axis), as main makes them."""
    script = script_of(env_id)[0]
    args = tiny_args(
        env_id=env_id,
        local_num_envs=total_envs // num_devices,
        learner_device_ids=list(range(num_devices)),
        num_seeds=len(seeds),
    )
    args.global_num_envs = total_envs
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
    env = script.make_jax_env(args.env_id)
    state = stack_seeds(lambda seed: script.init_state(args, env, seed, mesh), list(seeds), mesh)
    update = script.make_learner_update(args, script.make_network(args), env, mesh)
    initial_types = jax.tree.leaves(jax.tree.map(jax.typeof, state))
    for _ in range(updates):
        state, metrics = update(state)
    # the update returns the types it takes, so it compiles once (a reset leaving fields weakly typed where the step
    # does not would compile it twice in every run)
    assert jax.tree.leaves(jax.tree.map(jax.typeof, state)) == initial_types
    assert np.all(np.isfinite(metrics["losses/loss"])) and "charts/learning_rate" in metrics
    return jax.device_get(state.agent.params), jax.device_get(state.envs), jax.device_get(metrics)


# once per script (anakin_families.ONE_PER_SCRIPT); the quick tier keeps MiniGrid's (MJX's physics: tens of s)
@pytest.mark.parametrize("env_id", in_process(ONE_PER_SCRIPT, quick=("MiniGrid-Empty-5x5",)))
def test_one_and_two_devices_step_the_same_envs_and_make_the_same_update(env_id):
    """Data parallelism must not change the run: each env's keys are its own, so the envs' trajectories are the same
    on one and on two devices (bitwise with discrete actions; continuous actions carry the params' float sums into
    the physics), and the params equal up to float sums (the default flags, advantages normalized over the whole
    minibatch, with one minibatch: the same samples)."""
    one_params, one_envs, one_metrics = run_updates(env_id, 1, 8)
    two_params, two_envs, two_metrics = run_updates(env_id, 2, 8)
    if script_of(env_id)[0] is anakin:
        assert anakin.tree_digest(one_envs) == anakin.tree_digest(two_envs)
    else:
        close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
        jax.tree.map(close, jax.random.key_data(one_envs.action_keys), jax.random.key_data(two_envs.action_keys))
        jax.tree.map(close, one_envs.state.env.obs, two_envs.state.env.obs)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), one_params, two_params)
    for name in ["losses/policy_loss", "losses/value_loss", "losses/entropy"]:
        np.testing.assert_allclose(one_metrics[name], two_metrics[name], rtol=1e-5, atol=1e-6)
    initial_args = tiny_args(env_id=env_id, local_num_envs=8)
    initial = jax.device_get(script_of(env_id)[0].make_agent(initial_args, jax.random.split(jax.random.key(1), 3)[0]))
    assert not np.allclose(jax.tree.leaves(one_params)[0][0], jax.tree.leaves(initial[1].params)[0])  # it did update


def test_seeds_in_one_program_are_each_the_run_of_its_seed_alone_on_one_and_two_devices():
    """--num-seeds: seeds 1, 2, 3 in one program (a `vmap` over the seed axis) against seed 2 alone. The envs step the
    same trajectories, bit for bit; the params agree up to float rounding: the vmap's batched kernels round
    differently from one seed's, in the last bits (measured: at most 1.5e-8 apart after 2 updates). One seed runs its
    program unbatched, bit for bit the run of its --seed (`seeded`). On two devices, each seed as on one."""
    seeds_params, seeds_envs, seeds_metrics = run_updates("MiniGrid-Empty-5x5", 1, 8, seeds=(1, 2, 3))
    alone_params, alone_envs, alone_metrics = run_updates("MiniGrid-Empty-5x5", 1, 8, seeds=(2,))
    second = lambda tree: jax.tree.map(lambda x: x[1], tree)  # noqa: E731
    alone = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
    assert anakin.tree_digest(second(seeds_envs)) == anakin.tree_digest(alone(alone_envs))
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # noqa: E731
    jax.tree.map(close, second(seeds_params), alone(alone_params))
    for name in ["losses/policy_loss", "losses/value_loss", "losses/entropy"]:
        np.testing.assert_allclose(seeds_metrics[name][1], alone_metrics[name][0], rtol=1e-5, atol=1e-6)
    first_two = lambda x: x[:2]  # noqa: E731
    assert not np.allclose(*first_two(jax.tree.leaves(seeds_params)[0]))  # seeds 1 and 2 are runs of their own
    two_params, two_envs, _ = run_updates("MiniGrid-Empty-5x5", 2, 8, seeds=(1, 2, 3))
    assert anakin.tree_digest(two_envs) == anakin.tree_digest(seeds_envs)
    jax.tree.map(close, two_params, seeds_params)


def test_one_seed_runs_its_update_unbatched_and_several_a_vmap_over_the_seed_axis():
    """`seeded`: one seed's state goes through the update as it is (the leading axis dropped, then put back), so the
    default run computes what it always did; several, through a vmap."""
    calls = []

    def update(state):
        calls.append(jax.tree.map(np.shape, state))
        return state * 2, {"loss": state.sum()}

    state, metrics = anakin.seeded(update, 1)(np.arange(3.0)[None])
    assert calls == [(3,)] and state.shape == (1, 3) and metrics["loss"].shape == (1,)
    state, metrics = anakin.seeded(update, 2)(np.ones((2, 3)))
    np.testing.assert_array_equal(state, np.full((2, 3), 2.0))
    np.testing.assert_array_equal(metrics["loss"], [3.0, 3.0])


# Craftax's episodes outlast 150 steps of random play: its ends and resets are the adapter test's
@pytest.mark.parametrize("env_id", in_process([env_id for env_id in FAMILIES if not env_id.startswith("Craftax-")]))
def test_the_rollout_keeps_envpools_bookkeeping_and_the_episode_statistics_of_a_plain_loop(env_id):
    """Against a plain loop over the rollout's own arrays: `valid` is False exactly after an episode end (the reset
    step), terminations and truncations are the env's, and the returned episode statistics sum the rewards and count
    the valid steps of each env's last finished episode (NaN before its first)."""
    script = script_of(env_id)[0]
    env = script.make_jax_env(env_id)
    agent, agent_state = script.make_agent(tiny_args(env_id=env_id, local_num_envs=6), jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    envs = script.reset_envs(env, jax.random.key(5), 6, NamedSharding(mesh, P("batch")))
    num_steps = 1010 if script is anakin_continuous else 150  # the Control Suite's episodes last 1,000 steps
    if script is anakin:
        rollout = partial(anakin.rollout, params=agent_state.params)
    else:
        rollout = partial(anakin_continuous.rollout, agent_state=agent_state, gamma=0.99)
    envs, storage = jax.jit(lambda envs: rollout(agent=agent, env=env, envs=envs, num_steps=num_steps))(envs)
    storage, envs = jax.device_get((storage, envs))
    valid, terminations, truncations, rewards = (
        storage.valid,
        storage.terminations,
        storage.truncations,
        storage.rewards,
    )
    # 150 steps of random play: MiniGrid's episodes end at the goal (terminations) and at the 100-step limit
    # (truncations); Breakout's when the ball is lost (MinAtar has no time limit); CartpoleBalance's at 1,000 steps
    assert terminations.any() or env_id == "CartpoleBalance"
    assert truncations.any() or env_id.startswith("minatar-")
    episode_return, episode_length = np.zeros(6), np.zeros(6)
    last_return, last_length = np.full(6, np.nan), np.full(6, np.nan)
    for t in range(num_steps):
        for i in range(6):
            ended_before = t > 0 and (terminations[t - 1, i] or truncations[t - 1, i])
            assert valid[t, i] == (not ended_before)
            if not valid[t, i]:
                assert rewards[t, i] == 0 and not terminations[t, i]
            episode_return[i] += rewards[t, i]
            episode_length[i] += valid[t, i]
            if terminations[t, i] or truncations[t, i]:
                assert not (terminations[t, i] and truncations[t, i])
                last_return[i], last_length[i] = episode_return[i], episode_length[i]
                episode_return[i], episode_length[i] = 0, 0
    np.testing.assert_allclose(envs.returned_episode_returns, last_return, rtol=1e-5)  # float32 sums of 1,000
    np.testing.assert_array_equal(envs.returned_episode_lengths, last_length)
    if env_id.startswith("MiniGrid-"):
        assert np.all(last_length[~np.isnan(last_length)] <= 100)  # the time limit counts the valid steps
    if env_id == "CartpoleBalance":
        np.testing.assert_array_equal(last_length, 1000)  # every env's first episode, truncated at the limit


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "MiniGrid-Empty-5x5-v0"], "(these ids have no version: MiniGrid-Empty-5x5)"),
        (["--env-id", "XLand-MiniGrid-R1-9x9"], "XLand-MiniGrid's meta-RL envs need a ruleset benchmark"),
        (["--env-id", "MinAtar-Breakout"], "(pgx's MinAtar ids are lowercase: minatar-breakout, ...)"),
        (["--env-id", "Breakout-v5"], "--env-id must be one of MiniGrid-"),
        (["--env-id", "CartpoleBalance"], "(CartpoleBalance has continuous actions: the other Anakin PPO script's)"),
        (["--env-id", "Craftax-Symbolic-v1"], "(Craftax-Classic's symbolic observation only: its pixels need a CNN"),
        (["--num-minibatches", "3"], "--num-minibatches (3) must divide the samples per learner device (--num-steps"),
        (["--learning-rate", "-1"], "--learning-rate must be positive and finite, got -1.0"),
        (["--gae-lambda", "2"], "--gae-lambda must be in [0, 1], got 2.0"),
        (["--hiddens", "0"], "--hiddens must be one or more positive integers, got [0]"),
        (["--learner-device-ids", "0", "0"], "--learner-device-ids must be one or more distinct device ids"),
        (["--capture-video"], "--capture-video works on the model saved at the end of training: add --save-model"),
        (["--num-seeds", "0"], "--num-seeds must be a positive integer with --seed + --num-seeds - 1 at most"),
        (["--seed", "4294967295", "--num-seeds", "2"], "got 2 (--seed 4294967295)"),
    ],
)
def test_bad_flags_are_one_usage_error_naming_the_flag(flags, message):
    """The checks before any device (`validate_args`), then --env-id's, which imports xminigrid and pgx, starting JAX's
    backend: made once the devices (and jax.distributed) have started, in every process (`check_runtime_values`)."""
    args = parse_flags(anakin.Args, [*TINY, *flags])
    with pytest.raises(UsageError) as error:
        anakin.validate_args(args)
        anakin.check_env_id(args.env_id, discrete=True)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--env-id", "CartpoleBalance-v1"], "(these ids have no version: CartpoleBalance)"),
        (
            ["--env-id", "MiniGrid-Empty-5x5"],
            "(MiniGrid-Empty-5x5 has discrete actions: the other Anakin PPO script's)",
        ),
        (["--env-id", "Go1JoystickFlatTerrain"], "--env-id must be one of AcrobotSwingup, "),
        (["--num-minibatches", "3"], "--num-minibatches (3) must divide the samples per learner device (--num-steps"),
    ],
)
def test_the_continuous_scripts_bad_flags_are_one_usage_error_naming_the_flag(flags, message):
    args = parse_flags(anakin_continuous.Args, [*TINY, *flags])
    with pytest.raises(UsageError) as error:
        anakin_continuous.validate_args(args)
        anakin_continuous.check_env_id(args.env_id, discrete=False)
    assert message in str(error.value)


@pytest.mark.slow
def test_bad_input_is_one_line_with_exit_code_2(workdir):
    """The CLI's side of the in-process checks above (the shared flags' lines are tested with the Sebulba scripts)."""
    run = run_script([*TINY, "--env-id", "MiniGrid-Empty-5x5-v0"], workdir, script=ANAKIN_SCRIPT, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().count("\n") == 0, run.stderr[-2000:]
    assert run.stderr.startswith("error: --env-id must be one of MiniGrid-"), run.stderr[-2000:]
    # more seeds than any host's memory holds (and than a list of their numbers would): one line before the second
    # seed's state is made (not a MemoryError, nor the OOM killer)
    flags = ["--env-id", "MiniGrid-Empty-5x5", "--num-seeds", "3000000000"]
    run = run_script([*flags, "--total-timesteps", "100000000"], workdir, script=ANAKIN_SCRIPT, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert re.fullmatch(
        r"error: the learner states of 3000000000 seeds and their stack need [\d,.]+ GiB of memory, more than the "
        r"[\d,.]+ GiB this host can give it \(90% of its available memory\): lower --num-seeds\n",
        run.stderr,
    ), run.stderr[-2000:]


def random_policy_return(env_id: str, episodes: int, num_envs: int = 16) -> float:
    """Uniformly random actions on the script's own evaluation envs (of the actions' kind: one of the discrete
    actions, or uniform in [-1, 1] for each continuous one)."""
    envs = script_of(env_id)[0].make_env(env_id, seed=123, num_envs=num_envs)
    rng = np.random.default_rng(0)
    if envs.env.action_dtype == np.int32:
        policy = lambda obs, key: (rng.integers(0, envs.env.num_actions, size=len(obs)), key)
    else:
        policy = lambda obs, key: (rng.uniform(-1, 1, (len(obs), envs.env.action_dim)).astype(np.float32), key)
    return float(np.mean(run_episodes(envs, policy, episodes, jax.random.key(0))))


def evaluated_return(flags: list[str], workdir, env_id: str, timeout: int) -> float:
    """A run with --save-model: the mean of its saved model's evaluation (sampled actions)."""
    run = run_script(
        [*flags, "--save-model", "--log-frequency", "10"], workdir, script=script_of(env_id)[1], timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-3000:]
    scalars = run.scalars()
    print(f"{env_id}: {scalars['charts/SPS'][-1][1]:.0f} SPS")
    return float(np.mean([v for _, v in scalars["eval/episodic_return"]]))


@pytest.mark.slow
def test_the_readme_command_learns_minigrid_empty_and_saves_an_evaluated_model_with_a_video(workdir):
    # Reaching the goal pays 1 - 0.9 x steps / 100 (MiniGrid), so the best return is ~0.96; the random policy's is
    # measured here on the same envs (about 0.2)
    flags = [*README_FLAGS, "--capture-video", "--eval-episodes", "16"]
    trained = evaluated_return(flags, workdir, "MiniGrid-Empty-5x5", timeout=400)
    random = random_policy_return("MiniGrid-Empty-5x5", episodes=200)
    assert trained > 0.8 and trained > random + 0.5, (trained, random)
    assert list((workdir / "videos" / "test").glob("eval-episode-0.mp4"))


@pytest.mark.slow
def test_the_readme_continuous_command_learns_cartpole_balance_and_saves_an_evaluated_model(workdir):
    """The README's CartpoleBalance command of the continuous script, read from the README and run as written with a
    saved model (the MuJoCo PPO script's defaults, 8 envs x 256 steps, 307,200 steps) against uniformly random
    actions on the same evaluation envs (the Control Suite's balance reward is at most 1 a step over 1,000 steps;
    random actions keep the pole up for a while: about 300-400)."""
    flags = [*page_command_flags("ppo_continuous_action_anakin", CONTINUOUS_ANAKIN_SCRIPT), "--eval-episodes", "4"]
    trained = evaluated_return(flags, workdir, "CartpoleBalance", timeout=500)
    random = random_policy_return("CartpoleBalance", episodes=4, num_envs=4)
    assert trained > 800 and trained > random + 300, (trained, random)


def test_the_jax_families_check_ids_as_envpools_do_and_take_no_options():
    """One check_env_id signature for both kinds of family (cleanrl_utils.envs and cleanrl_utils.jax_envs)."""
    import inspect

    from cleanrl_utils import envs, jax_envs

    assert inspect.signature(jax_envs.check_env_id) == inspect.signature(envs.check_env_id)
    jax_envs.check_env_id("MiniGrid-Empty-5x5", discrete=True, env_options=())
    with pytest.raises(UsageError, match=r"^--env-options 'max_steps=10': the JAX env families take no options$"):
        jax_envs.check_env_id("MiniGrid-Empty-5x5", discrete=True, env_options=["max_steps=10"])
