"""MuZero with the search on the actor devices and a replay sharded over the learner devices: the math against
independent references (value transform, n-step targets, unroll targets, losses, search), data parallelism, and
runs of the script (layouts, determinism, two processes, SIGTERM + resume, learning on CartPole-v1)."""

import re
from functools import partial

import jax
import jax.numpy as jnp
import mctx
import numpy as np
import pytest
from conftest import (
    MUZERO_SCRIPT,
    assert_resumes_on_other_layouts,
    assert_same_seed_same_run,
    finish_processes,
    finish_script,
    load_script,
    resumes_on_other_layouts,
    run_script,
    same_seed_and_resumed_runs,
    start_processes,
    start_script,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

muzero = load_script(MUZERO_SCRIPT)

DIGESTS = re.compile(r"params sha256=(\w+) optimizer sha256=(\w+) replay sha256=(\w+)")
# tiny CartPole settings: 1 actor thread x 4 envs x 8 steps = 32 env steps per update, 16-unit MLPs, 4 simulations
TINY = (
    "--env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 --hiddens 16 "
    "--embedding-size 8 --support-size 5 --num-simulations 4 --unroll-steps 3 --td-steps 3 "
    "--minibatch-size 8 --buffer-size 512 --replay-ratio 0.125 --actor-device-ids 0 "
    "--learner-device-ids 1 --log-frequency 1"
).split()
# tiny Breakout: 4-channel torso, one residual block per function, 4 simulations
TINY_BREAKOUT = (
    "--env-id Breakout-v5 --local-num-envs 2 --num-steps 8 --channels 4 4 --num-blocks 1 --hiddens 16 "
    "--support-size 5 --num-simulations 4 --max-num-considered-actions 4 --unroll-steps 2 --td-steps 2 "
    "--minibatch-size 4 --buffer-size 256 --replay-ratio 0.0625 --log-frequency 1"
).split()


def args_for(num_learner_devices: int, **flags) -> "muzero.Args":
    args = muzero.Args(
        **{
            "env_id": "CartPole-v1",
            "local_num_envs": 4,
            "num_actor_threads": 1,
            "num_steps": 8,
            "hiddens": [16],
            "embedding_size": 8,
            "support_size": 5,
            "unroll_steps": 2,
            "td_steps": 2,
            "minibatch_size": 8,
            "buffer_size": 64,
            "learner_device_ids": list(range(num_learner_devices)),
            **flags,
        }
    )
    args.batch_size = args.local_num_envs * args.num_steps  # what set_runtime_values derives for one process
    args.global_num_envs = args.local_num_envs
    args.global_num_envs = args.local_num_envs
    args.gradient_steps = 2
    return args


# ---------------------------------------------------------------- the math


def test_value_transform_and_two_hot_round_trip():
    x = np.concatenate([np.linspace(-400, 400, 801), [-0.37, 0.0, 0.5, 1e-3, 123.456]]).astype(np.float32)
    # h (MuZero paper Appendix F) in float64 NumPy, and the closed-form inverse of h
    h = np.sign(x) * (np.sqrt(np.abs(x.astype(np.float64)) + 1) - 1) + 1e-3 * x
    two_hot = np.asarray(muzero.scalar_to_two_hot(jnp.asarray(x), 30))
    assert two_hot.shape == (len(x), 61)
    np.testing.assert_allclose(two_hot.sum(-1), 1, atol=1e-6)
    assert ((two_hot > 1e-6).sum(-1) <= 2).all()  # at most two neighbouring bins
    np.testing.assert_allclose(two_hot @ np.arange(-30, 31), h, rtol=1e-5, atol=1e-4)  # the mean is h(x)
    # logits that put exactly these probabilities on the support give x back
    back = np.asarray(muzero.logits_to_scalar(jnp.log(jnp.asarray(two_hot) + 1e-30), 30))
    np.testing.assert_allclose(back, x, rtol=1e-4, atol=2e-3)
    # beyond the support (h(x) > 30: |x| > about 960) the projection clips to the edge
    edge = np.asarray(muzero.scalar_to_two_hot(jnp.float32(5000.0), 30))
    assert edge[-1] == pytest.approx(1.0)


def n_step_reference(rewards, root_values, terminations, truncations, gamma, n):
    """The definition, one target at a time: sum rewards until n steps, a termination (no bootstrap) or a
    truncation (bootstrap from the next row's root value, the true last observation)."""
    targets = np.zeros(len(rewards) - n)
    for t in range(len(rewards) - n):
        total, bootstrap = 0.0, root_values[t + n] * gamma**n
        for i in range(n):
            total += gamma**i * rewards[t + i]
            if terminations[t + i]:
                bootstrap = 0.0
                break
            if truncations[t + i]:
                bootstrap = gamma ** (i + 1) * root_values[t + i + 1]
                break
        targets[t] = total + bootstrap
    return targets


def test_n_step_value_targets_match_a_plain_loop_with_terminations_and_truncations():
    rng = np.random.default_rng(0)
    T, B = 40, 6
    rewards, root_values = rng.normal(size=(B, T)), rng.normal(size=(B, T)) * 10
    terminations = (rng.random((B, T)) < 0.1).astype(np.float32)
    truncations = ((rng.random((B, T)) < 0.1) & (terminations == 0)).astype(np.float32)
    for n in [1, 3, 10]:
        targets = muzero.n_step_value_targets(
            rewards=jnp.asarray(rewards),
            root_values=jnp.asarray(root_values),
            terminations=jnp.asarray(terminations),
            truncations=jnp.asarray(truncations),
            gamma=0.9,
            td_steps=n,
        )
        expected = [n_step_reference(*rows, 0.9, n) for rows in zip(rewards, root_values, terminations, truncations)]
        np.testing.assert_allclose(targets, expected, rtol=1e-5, atol=1e-5)
    assert terminations.sum() > 5 and truncations.sum() > 5


def sequence(terminations, truncations, valid=(True, True, False, True, True)):
    return muzero.Rollout(
        obs=jnp.zeros((1, 5, 4)),
        actions=jnp.zeros((1, 5), jnp.int32),
        action_weights=jnp.tile(jnp.array([0.25, 0.75]), (1, 5, 1)),
        root_values=jnp.array([[10.0, 20, 30, 40, 50]]),
        rewards=jnp.array([[1.0, 2, 3, 4, 5]]),
        terminations=jnp.array([terminations], jnp.float32),
        truncations=jnp.array([truncations], jnp.float32),
        valid=jnp.array([valid]),
    )


def test_unroll_targets_on_hand_checked_sequences():
    """K = 3, n = 1, gamma 0.5; the episode ends at row 1 (row 2 is envpool's reset row)."""
    # a termination: the model is absorbed after it (value and reward targets 0), its policy is not trained
    t = muzero.unroll_targets(sequence([0, 1, 0, 0, 0], [0] * 5), unroll_steps=3, td_steps=1, gamma=0.5)
    np.testing.assert_allclose(t.values, [[1 + 0.5 * 20, 2, 0, 0]])
    np.testing.assert_allclose(t.value_weights, [[1, 1, 1, 1]])
    np.testing.assert_allclose(t.rewards, [[0, 1, 2, 0]])
    np.testing.assert_allclose(t.reward_weights, [[0, 1, 1, 1]])
    np.testing.assert_allclose(t.policy_weights, [[1, 1, 0, 0]])
    # a truncation: row 1 bootstraps from row 2 (the true last observation's search value); nothing after it
    t = muzero.unroll_targets(sequence([0] * 5, [0, 1, 0, 0, 0]), unroll_steps=3, td_steps=1, gamma=0.5)
    np.testing.assert_allclose(t.values, [[11, 2 + 0.5 * 30, 0, 0]])
    np.testing.assert_allclose(t.value_weights, [[1, 1, 0, 0]])
    np.testing.assert_allclose(t.reward_weights, [[0, 1, 1, 0]])
    # a root on envpool's reset row trains nothing
    t = muzero.unroll_targets(
        sequence([0] * 5, [0] * 5, valid=(False, True, True, True, True)), unroll_steps=3, td_steps=1, gamma=0.5
    )
    assert float(t.value_weights.sum() + t.reward_weights.sum() + t.policy_weights.sum()) == 0


def test_loss_on_a_hand_checked_batch():
    """K = 2 (positions 1 and 2 scaled by 1/2), 2 actions, support [-1, 1] (3 bins), all value and reward targets 0
    (h(0) = 0: the middle bin); zero logits give cross-entropies log 2 (policy) and log 3 (value, reward)."""
    targets = muzero.Targets(
        values=jnp.zeros((1, 3)),
        value_weights=jnp.array([[1.0, 1, 0]]),
        rewards=jnp.zeros((1, 3)),
        reward_weights=jnp.array([[1.0, 1, 1]]),
        policies=jnp.array([[[1.0, 0], [0.5, 0.5], [0, 1]]]),
        policy_weights=jnp.array([[1.0, 1, 0]]),
    )
    reward_logits = jnp.zeros((1, 3, 3)).at[0, 1, 2].set(jnp.log(2.0))  # softmax [1/4, 1/4, 1/2]: CE log 4
    policy, value, reward = muzero.muzero_loss_terms(
        policy_logits=jnp.zeros((1, 3, 2)),
        value_logits=jnp.zeros((1, 3, 3)),
        reward_logits=reward_logits,
        targets=targets,
        support_size=1,
        normalizer=2.0,
    )
    np.testing.assert_allclose(policy, (np.log(2) + 0.5 * np.log(2)) / 2, rtol=1e-6)
    np.testing.assert_allclose(value, (np.log(3) + 0.5 * np.log(3)) / 2, rtol=1e-6)
    np.testing.assert_allclose(reward, (0.5 * np.log(4) + 0.5 * np.log(3)) / 2, rtol=1e-6)  # position 0 has none


@pytest.mark.parametrize("search", ["gumbel", "muzero"])
def test_search_finds_the_best_action_of_a_toy_model(search):
    """A one-step toy model with 4 actions and uniform priors: action 2 gives reward 1, the others 0, every value 0.
    The search must put its largest weight on action 2 and act with it; the root value is the search's estimate
    of the root's return: above the prior value 0 (the searches found the reward), at most 1."""
    batch = 16
    root = mctx.RootFnOutput(prior_logits=jnp.zeros((batch, 4)), value=jnp.zeros(batch), embedding=jnp.zeros(batch))

    def recurrent_fn(params, key, action, embedding):
        return mctx.RecurrentFnOutput(
            reward=(action == 2).astype(jnp.float32),
            discount=jnp.zeros(batch),
            prior_logits=jnp.zeros((batch, 4)),
            value=jnp.zeros(batch),
        ), embedding

    config = muzero.Args(
        search=search,
        num_simulations=32,
        max_num_considered_actions=4,
        dirichlet_alpha=0.25,
        dirichlet_fraction=0.25,
        temperature=0.25,
    )
    action, weights, root_value = muzero.run_search(None, jax.random.key(0), root, recurrent_fn, config)
    np.testing.assert_array_equal(np.argmax(weights, axis=-1), 2)
    np.testing.assert_array_equal(action, 2)
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-5)
    assert (np.asarray(root_value) > 0.3).all() and (np.asarray(root_value) <= 1 + 1e-6).all(), root_value


# ---------------------------------------------------------------- the learner on the learner devices


def test_gradient_step_is_the_same_on_one_and_on_two_devices():
    """The same global minibatch of sequences (with invalid roots, terminations, truncations) gives the same params,
    optimizer state and metrics on one device and split over two."""
    rng = np.random.default_rng(0)
    n, length = 8, 2 + 2 + 1
    weights = rng.random((n, length, 2)).astype(np.float32)
    sequences = muzero.Rollout(
        obs=rng.normal(size=(n, length, 4)).astype(np.float32),
        actions=rng.integers(0, 2, (n, length)).astype(np.int32),
        action_weights=weights / weights.sum(-1, keepdims=True),
        root_values=rng.normal(size=(n, length)).astype(np.float32) * 5,
        rewards=rng.normal(size=(n, length)).astype(np.float32),
        terminations=(rng.random((n, length)) < 0.2).astype(np.float32),
        truncations=(rng.random((n, length)) < 0.1).astype(np.float32),
        valid=rng.random((n, length)) < 0.8,
    )
    results = []
    for num_devices in [1, 2]:
        args = args_for(num_devices, learning_rate=1e-2)
        mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
        agent, state = muzero.make_agent(args, jax.random.key(0))
        learner = muzero.make_learner_fns(args, agent, mesh)
        state = muzero.replicate(state, mesh)
        global_sequences = jax.device_put(sequences, NamedSharding(mesh, P("batch")))
        for _ in range(2):
            state, metrics = learner.gradient_step(state, global_sequences)
        results.append(jax.device_get((state.params, state.opt_state, metrics)))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    initial = jax.device_get(muzero.make_agent(args, jax.random.key(0))[1].params)
    change = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(results[0][0]), jax.tree.leaves(initial)))
    assert change > 1e-3 and results[0][2]["losses/value_loss"] > 0


def test_resume_marks_the_newest_stored_rows():
    """After a resume the next stored row is a new episode's first: the newest row is never a root and the row before
    it is truncated (its targets bootstrap from the newest row's root value)."""
    args = args_for(1)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    agent, agent_state = muzero.make_agent(args, jax.random.key(0))
    learner = muzero.make_learner_fns(args, agent, mesh)
    state = muzero.LearnerState(muzero.replicate(agent_state, mesh), jax.random.key(0), learner.init_replay())
    T, N = args.num_steps, args.local_num_envs
    rollout = muzero.Rollout(
        obs=np.zeros((T, N, 4), np.float32),
        actions=np.zeros((T, N), np.int32),
        action_weights=np.full((T, N, 2), 0.5, np.float32),
        root_values=np.zeros((T, N), np.float32),
        rewards=np.zeros((T, N), np.float32),
        terminations=np.zeros((T, N), np.float32),
        truncations=np.zeros((T, N), np.float32),
        valid=np.ones((T, N), bool),
    )
    storage = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "batch"))), rollout)
    state, metrics = learner.update(state, storage, False)  # the replay's 4 envs x 16 rows get their first 8
    assert metrics == {"stats/gradient_steps": 0}  # no gradient step before learning starts
    ended = muzero.end_stored_episodes(state.replay)
    valid, truncations = np.asarray(ended.experience.valid), np.asarray(ended.experience.truncations)
    assert valid[:, :7].all() and not valid[:, 7].any() and not valid[:, 8:].any()  # rows 8.. are still empty
    assert truncations[:, 6].all() and truncations.sum() == N


# ---------------------------------------------------------------- runs of the script


start = partial(start_script, script=MUZERO_SCRIPT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Shared by the tests below, started a few at a time (they are small): a CartPole run and a second run of its
    seed stopped by SIGTERM, then two resumes of its checkpoint; then tiny Breakout in two layouts (2 actor
    threads) and a two-process CartPole run with the saved model evaluated."""
    result = same_seed_and_resumed_runs(
        tmp_path_factory, "muzero", start, flags=[*TINY, "--total-timesteps", "384", "--seed", "3"]
    )  # 12 updates
    workdir = tmp_path_factory.mktemp("muzero_more")
    # the actor's device shared with the learner, and apart from a learner of two devices (a0-l1,2)
    layouts = {"a0-l0": ["0"], "a0-l1_2": ["1", "2"]}
    breakout = {
        name: start(
            [
                *TINY_BREAKOUT,
                "--total-timesteps",
                "128",
                "--actor-device-ids",
                "0",
                "--learner-device-ids",
                *learners,
                "--search",
                "muzero" if name == "a0-l0" else "gumbel",
            ],
            workdir,
            name,
        )
        for name, learners in layouts.items()
    }
    result["breakout"] = {name: finish_script(process, workdir, name) for name, process in breakout.items()}
    two = [*TINY, "--total-timesteps", "256", "--save-model", "--eval-episodes", "1", "--checkpoint-frequency", "1"]
    result["two"] = finish_processes(
        start_processes(two, workdir, 2, run_name="two", script=MUZERO_SCRIPT), timeout=400
    )
    result.update(resumes_on_other_layouts(tmp_path_factory, "muzero", MUZERO_SCRIPT, two, workdir / "runs" / "two"))
    return result


def final_digests(out: str) -> tuple:
    return DIGESTS.search(out.split("final ")[-1]).groups()


@pytest.mark.slow
def test_same_seed_gives_identical_runs(runs):
    steps = assert_same_seed_same_run(
        runs, DIGESTS, ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/reward_loss"]
    )
    # sequences of 3 + 3 + 1 rows: the first update's 8 rows already hold one, so all 12 updates learn
    assert len(steps) == 12


@pytest.mark.slow
def test_sigterm_checkpoint_restores_params_optimizer_and_replay_bit_for_bit(runs):
    returncode, out, err = runs["stopped"]
    assert returncode == 143, err[-3000:]
    saved = DIGESTS.search(re.search(r"checkpoint saved: update=(\d+).*", out).group(0)).groups()
    for name in ["resumed", "resumed_again"]:
        run = runs[name]
        assert run.returncode == 0, run.stderr[-3000:]
        restored = DIGESTS.search(re.search(r"resumed from checkpoint: .*", run.stdout).group(0)).groups()
        assert restored == saved  # params, optimizer state and replay
    # a resumed run is reproducible: the same checkpoint resumed twice ends in the same state
    assert final_digests(runs["resumed"].stdout) == final_digests(runs["resumed_again"].stdout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["a0-l0", "a0-l1_2"])
def test_breakout_runs_in_the_usual_layouts(runs, layout):
    """Tiny Breakout, 2 actor threads: every update's tags, the actor one policy version behind the learner."""
    run = runs["breakout"][layout]
    assert run.returncode == 0, run.stderr[-3000:]
    scalars = run.scalars()
    for tag in (
        "losses/policy_loss losses/value_loss losses/reward_loss charts/SPS stats/actor_policy_version "
        "stats/learner_policy_version stats/gradient_steps"
    ).split():
        assert tag in scalars, tag
    actor, learner = dict(scalars["stats/actor_policy_version"]), dict(scalars["stats/learner_policy_version"])
    assert [learner[step] - actor[step] for step in sorted(actor)][1:] == [1] * (len(actor) - 1)
    assert np.isfinite([value for _, value in scalars["losses/loss"]]).all()


@pytest.mark.slow
def test_two_processes_keep_identical_params(runs):
    (code0, out0, err0), (code1, out1, err1) = runs["two"]
    assert code0 == 0 and code1 == 0, err0[-3000:] + err1[-3000:]
    assert "evaluated runs/two/" in out0 and "episodic_return=" in out0  # the saved model searches in evaluation
    params0, optimizer0, replay0 = final_digests(out0)
    params1, optimizer1, replay1 = final_digests(out1)
    assert (params0, optimizer0) == (params1, optimizer1), "learner replicas diverged"
    assert replay0 == replay1  # the digest of the whole replay, whose shards of their own envs the processes hold


@pytest.mark.slow
def test_a_replay_resumes_on_fewer_and_more_devices_and_processes(runs):
    assert_resumes_on_other_layouts(runs, DIGESTS)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-simulations", "0"], "--num-simulations must be in [1, 10000], got 0"),
        (
            ["--unroll-steps", "5", "--td-steps", "10", "--buffer-size", "1024", "--local-num-envs", "64"],
            "--buffer-size (1024) must hold at least max(--num-steps, --unroll-steps + --td-steps + 1) = 32",
        ),
        (["--search", "alphazero"], "invalid choice 'alphazero' for argument '--search'"),
        (
            ["--replay-ratio", "0.0001"],
            "--replay-ratio (0.0001) x env steps per update (1024) must be a positive whole",
        ),
        (["--env-id", "HalfCheetah-v4"], "--env-id"),
        (["--minibatch-size", "255", "--learner-device-ids", "0", "1"], "--minibatch-size (255) must be divisible"),
    ],
    ids=["simulations", "unroll-longer-than-stored", "search", "ratio-fraction", "continuous", "minibatch-devices"],
)
def test_bad_input_is_one_clear_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        muzero.run_cli(muzero.main, muzero.Args, ["--env-id", "CartPole-v1", *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {message}")


# CPU settings for CartPole-v1 (the paper's Atari defaults changed for 2 CPU cores): 64-unit MLPs, a 32-wide hidden
# state, 21 bins (values up to 100 at gamma 0.99: h(100) = 9.1), 8 simulations (both actions considered), 32 envs
# x 8 steps per update, 32 gradient steps of 128 sequences per update, Adam 1e-3, a replay of the newest 256 steps
# of each env (fresh stored root values for the bootstrap)
CARTPOLE_MUZERO = (
    "--env-id CartPole-v1 --local-num-envs 32 --num-actor-threads 1 --num-steps 8 --hiddens 64 "
    "--embedding-size 32 --support-size 10 --gamma 0.99 --num-simulations 8 "
    "--max-num-considered-actions 2 --minibatch-size 128 --buffer-size 8192 --replay-ratio 0.125 "
    "--learning-rate 1e-3 --actor-device-ids 0 --learner-device-ids 1 --checkpoint-frequency 0"
).split()


@pytest.mark.slow
def test_cartpole_reaches_400(workdir):
    """CartPole-v1 from a random policy (about 22 per episode; the first episodes, measured in the same run, are
    below 60) to an average return of at least 400 (the issue's bar) within 163,840 env steps (640 updates,
    the README command's budget; about a minute on a quiet 2-core CPU). The average is the logged one: the latest
    episode of each of the 32 envs."""
    run = run_script(
        [*CARTPOLE_MUZERO, "--total-timesteps", "163840", "--log-frequency", "40"],
        workdir,
        script=MUZERO_SCRIPT,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    returns = run.scalars()["charts/avg_episodic_return"]
    assert returns[0][1] < 60, returns[:3]
    best_step, best = max(returns, key=lambda step_value: step_value[1])
    assert best >= 400, returns[::20]
