"""The PQN script: its Q(lambda) targets against a plain loop, the epsilon schedule, the TD loss, epsilon-greedy acting,
its data-parallel learner (actor's or learner's targets, one or two devices), the learner's memory check, bad input;
and runs of the script: a0-l1,2,3 with two actor threads (tags, lag, the schedule, the saved model evaluated, the Hub
folder), the same seed again stopped by Ctrl-C, its resume stopped by SIGTERM and resumed again (each resume from the
saved state bit for bit, the schedule continuing), two processes (identical params, an evaluated model)."""

import re
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    FINAL,
    PQN_SCRIPT,
    RESUMED,
    SAVED,
    best_window,
    finish_processes,
    finish_script,
    free_port,
    load_script,
    one_error_line,
    page_command_flags,
    read_scalars,
    run_script,
    script_command,
    script_env,
    start_processes,
    wait_for_line,
)
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.memory import OutOfDeviceMemory

pqn = load_script(PQN_SCRIPT)


# ---------------------------------------------------------------- the math


def q_lambda_targets_loop(rewards, q_values, bootstrap_q_value, terminations, truncations, gamma, q_lambda):
    """Q(lambda) returns with plain loops, written as CleanRL's pqn.py writes them (the last step bootstraps from max Q
    alone), with envpool's episode ends: a termination stops the bootstrap, a truncation bootstraps from the value of
    its last observation, and either end cuts the trace."""
    T, N = rewards.shape
    targets = np.zeros((T, N))
    for n in range(N):
        for t in reversed(range(T)):
            next_q = q_values[t + 1, n] if t + 1 < T else bootstrap_q_value[n]
            if terminations[t, n]:
                targets[t, n] = rewards[t, n]
            elif truncations[t, n] or t == T - 1:
                targets[t, n] = rewards[t, n] + gamma * next_q
            else:
                mixed = q_lambda * targets[t + 1, n] + (1 - q_lambda) * next_q
                targets[t, n] = rewards[t, n] + gamma * mixed
    return targets


def targets_of(rollout: dict, gamma: float, q_lambda: float) -> np.ndarray:
    as_jax = {name: jnp.asarray(value) for name, value in rollout.items()}
    return np.asarray(pqn.q_lambda_targets(**as_jax, gamma=gamma, q_lambda=q_lambda))


def random_rollout(rng, T: int, N: int) -> dict:
    """Episodes that end by termination or truncation; no episode ends on envpool's reset step after an end."""
    terminations = rng.random((T, N)) < 0.15
    truncations = (rng.random((T, N)) < 0.15) & ~terminations
    for t in range(1, T):
        reset_step = terminations[t - 1] | truncations[t - 1]
        terminations[t] &= ~reset_step
        truncations[t] &= ~reset_step
    return {
        "rewards": rng.normal(size=(T, N)).astype(np.float32),
        "q_values": rng.normal(size=(T, N)).astype(np.float32),
        "bootstrap_q_value": rng.normal(size=N).astype(np.float32),
        "terminations": terminations.astype(np.float32),
        "truncations": truncations.astype(np.float32),
    }


@pytest.mark.parametrize("q_lambda", [0.0, 0.65, 1.0])
def test_q_lambda_targets_match_a_plain_loop_with_terminations_truncations_and_reset_steps(q_lambda):
    rng = np.random.default_rng(5)
    rollout = random_rollout(rng, T=16, N=6)
    ours = targets_of(rollout, 0.99, q_lambda)
    expected = q_lambda_targets_loop(**rollout, gamma=0.99, q_lambda=q_lambda)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    # the step after an episode end is envpool's reset step: its reward and target never reach the ended episode's
    ended = np.logical_or(rollout["terminations"], rollout["truncations"])[:-1]
    reset_steps = np.concatenate([np.zeros((1, 6), bool), ended])
    changed = {**rollout, "rewards": np.where(reset_steps, 100.0, rollout["rewards"]).astype(np.float32)}
    np.testing.assert_array_equal(targets_of(changed, 0.99, q_lambda)[:-1][ended], ours[:-1][ended])
    assert ended.sum() > 5  # the case occurs


def test_q_lambda_targets_on_a_hand_checked_episode():
    """One env, rewards 1, 2, 3, 4, max Q 10, 20, 30, 40 and 50 after the rollout, gamma 0.5, lambda 0.5: the last
    step bootstraps, G_3 = 4 + 0.5 x 50 = 29; G_2 = 3 + 0.5 (0.5 x 40 + 0.5 x 29) = 20.25; a termination at step 1
    makes G_1 = 2, and G_0 = 1 + 0.5 (0.5 x 20 + 0.5 x 2) = 6.5; a truncation there makes G_1 = 2 + 0.5 x 30 = 17."""
    rollout = {
        "rewards": np.array([[1.0], [2.0], [3.0], [4.0]], np.float32),
        "q_values": np.array([[10.0], [20.0], [30.0], [40.0]], np.float32),
        "bootstrap_q_value": np.array([50.0], np.float32),
        "terminations": np.array([[0.0], [1.0], [0.0], [0.0]], np.float32),
        "truncations": np.zeros((4, 1), np.float32),
    }
    np.testing.assert_allclose(targets_of(rollout, 0.5, 0.5)[:, 0], [6.5, 2.0, 20.25, 29.0])
    truncated = {**rollout, "terminations": rollout["truncations"], "truncations": rollout["terminations"]}
    np.testing.assert_allclose(targets_of(truncated, 0.5, 0.5)[:, 0], [1 + 0.5 * (10 + 8.5), 17.0, 20.25, 29.0])


def test_epsilon_schedule_is_a_function_of_the_global_step():
    """CleanRL's linear_schedule: start_e down to end_e over exploration_fraction of the run, then end_e; each rollout
    step's global step counts every env of every thread and process, so a resumed update gets the epsilons the
    uninterrupted run had there."""
    schedule = dict(start_e=1.0, end_e=0.05, exploration_fraction=0.5, total_timesteps=1000)
    steps = np.array([0, 250, 500, 501, 10**6])
    np.testing.assert_allclose(pqn.epsilon_at(steps, **schedule), [1.0, 0.525, 0.05, 0.05, 0.05])
    rising = pqn.epsilon_at(250, **{**schedule, "start_e": 0.0, "end_e": 1.0})
    assert rising == 0.5  # one schedule, whichever way it goes
    # 2 processes x 3 actor threads x 4 envs = 24 envs, 5 steps: 120 env steps an update
    args = pqn.Args(num_steps=5, start_e=1.0, end_e=0.05, exploration_fraction=0.5, total_timesteps=1000)
    args.global_num_envs, args.batch_size = 24, 120
    whole_run = np.concatenate([pqn.rollout_epsilons(args, update) for update in range(1, 9)])
    np.testing.assert_allclose(whole_run, pqn.epsilon_at(24 * np.arange(1, 41), **schedule), rtol=1e-6)
    assert pqn.rollout_epsilons(args, 3).dtype == np.float32


def test_td_loss_on_a_hand_checked_batch():
    """Valid samples only, over the minibatch's count: (1 - 3)^2 and (2 - 2)^2 of 2 valid samples; the third sample
    (envpool's reset step) counts for nothing."""
    td_loss, q_values = pqn.td_loss_terms(
        q_taken=jnp.array([1.0, 2.0, 7.0]),
        targets=jnp.array([3.0, 2.0, -100.0]),
        valid=jnp.array([True, True, False]),
        normalizer=jnp.float32(2.0),
    )
    assert float(td_loss) == 2.0 and float(q_values) == 1.5


def test_epsilon_greedy_actors_and_the_eval_policy():
    """The actor records max_a Q and acts greedily at epsilon 0, uniformly at 1; the saved model's policy takes the
    greedy action with --eval-greedy, else acts epsilon-greedily with --end-e."""
    agent = pqn.Agent(3, (), (16,), obs_layout="vector")
    obs = np.random.default_rng(0).normal(size=(4096, 5)).astype(np.float32)
    params = agent.init(jax.random.key(0), obs)
    q_values = np.asarray(agent.apply(params, obs))
    greedy_actions = q_values.argmax(-1)
    act = pqn.make_actor_fns(agent).act
    outputs, key = act(params, obs, jax.random.key(1), np.float32(0.0))
    np.testing.assert_array_equal(np.asarray(outputs[0]), greedy_actions)
    np.testing.assert_allclose(np.asarray(outputs[1]), q_values.max(-1), rtol=1e-6, atol=1e-6)
    uniform = np.asarray(act(params, obs, key, np.float32(1.0))[0][0])
    assert np.allclose(np.bincount(uniform.astype(int), minlength=3) / len(obs), 1 / 3, atol=0.03)
    args = pqn.Args(env_id="CartPole-v1", hiddens=[16], end_e=0.3)
    obs = obs[:, :4]
    agent = pqn.make_network(args)
    model = {"params": jax.tree.map(np.asarray, agent.init(jax.random.key(0), obs))}
    greedy_actions = np.asarray(agent.apply(model["params"], obs)).argmax(-1)
    greedy = pqn.make_eval_policy(args, model, greedy=True)(obs, jax.random.key(2))[0]
    np.testing.assert_array_equal(greedy, greedy_actions)
    actions, _ = pqn.make_eval_policy(args, model, greedy=False)(obs, jax.random.key(2))
    assert abs((actions != greedy_actions).mean() - 0.3 / 2) < 0.03  # a random action differs half the time


def tiny_rollout(agent, params, T: int, N: int, rng) -> "pqn.Rollout":
    """A rollout whose recorded max Q values are `params`' own (what an actor without lag records)."""
    obs = rng.normal(size=(T, N, 4)).astype(np.float32)
    bootstrap_obs = rng.normal(size=(1, N, 4)).astype(np.float32)
    terminations = (rng.random((T, N)) < 0.2).astype(np.float32)
    max_q = lambda x: np.asarray(agent.apply(params, x.reshape(-1, 4))).max(-1).reshape(x.shape[:2])
    return pqn.Rollout(
        obs=obs,
        actions=rng.integers(0, 2, size=(T, N)).astype(np.int32),
        q_values=max_q(obs),
        rewards=rng.normal(size=(T, N)).astype(np.float32),
        terminations=terminations,
        truncations=((rng.random((T, N)) < 0.1) & (terminations == 0)).astype(np.float32),
        valid=rng.random((T, N)) < 0.9,
        epsilons=np.repeat(np.linspace(1.0, 0.5, T, dtype=np.float32)[:, None], N, axis=1),
        bootstrap_obs=bootstrap_obs,
        bootstrap_q_value=max_q(bootstrap_obs),
    )


def test_learner_update_on_one_and_two_devices_with_the_actors_or_its_own_targets():
    """The same rollout, one minibatch: the same params on one and on two learner devices; the actor's recorded max Q
    of the learner's own params gives the update the learner's recomputed targets give; the learner's targets ignore
    what the actor recorded, the actor's do not."""
    assert len(jax.devices()) >= 2, "conftest arranges 4 host devices"
    T, N = 8, 4
    agent = pqn.Agent(action_dim=2, channels=(), hiddens=(8,), obs_layout="vector")
    params = jax.device_get(agent.init(jax.random.key(0), np.zeros((1, 4), np.float32)))
    storage = tiny_rollout(agent, params, T, N, np.random.default_rng(0))

    def update(num_devices, targets="learner", storage=storage):
        args = pqn.Args(
            env_id="CartPole-v1",
            num_steps=T,
            local_num_envs=N,
            num_actor_threads=1,
            learner_device_ids=list(range(num_devices)),
            num_minibatches=1,
            update_epochs=2,
            q_lambda_targets=targets,
        )
        mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
        # the script's optimizer shape (its learning rate is logged from the injected hyperparameters)
        tx = optax.chain(optax.identity(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
        state = TrainState.create(apply_fn=None, params=params, tx=tx)
        state = jax.device_put(state, NamedSharding(mesh, P()), may_alias=False)  # the update donates it
        global_storage = pqn.Rollout(*[jax.device_put(x, NamedSharding(mesh, P(None, "batch"))) for x in storage])
        state, metrics = pqn.make_learner_update(args, agent, mesh)(
            pqn.LearnerState(state, jax.random.key(1)), global_storage
        )
        assert metrics.keys() == {"losses/td_loss", "losses/q_values", "charts/epsilon", "charts/learning_rate"}
        assert float(metrics["charts/epsilon"]) == pytest.approx(storage.epsilons.mean(), rel=1e-6)
        return jax.device_get((state.agent.params, metrics))

    same = lambda a, b: jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)
    one_device = update(1)
    same(one_device, update(2))
    same(one_device, update(1, targets="actor"))
    stale = storage._replace(q_values=storage.q_values + 1.0, bootstrap_q_value=storage.bootstrap_q_value + 1.0)
    jax.tree.map(np.testing.assert_array_equal, update(1, storage=stale), one_device)
    assert update(1, "actor", stale)[1]["losses/td_loss"] != one_device[1]["losses/td_loss"]
    change = max(np.abs(a - b).max() for a, b in zip(jax.tree.leaves(one_device[0]), jax.tree.leaves(params)))
    assert change > 1e-3, change  # it did update, by far more than the tolerance


def test_a_targets_pass_larger_than_the_host_stops_before_it_runs():
    """The learner's targets pass holds the whole batch: 16M samples of 16,384 floats, 1 TiB. Its first call stops the
    run with one line naming the flags that lower it, before it runs (the rollout here is only its shapes)."""
    T, N, features = 4096, 4096, 16384
    agent = pqn.Agent(action_dim=2, channels=(), hiddens=(8,), obs_layout="vector")
    params = agent.init(jax.random.key(0), np.zeros((1, features), np.float32))
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    sharded = NamedSharding(mesh, P(None, "batch"))
    shapes = {"obs": (T, N, features), "bootstrap_obs": (1, N, features), "bootstrap_q_value": (1, N)}
    dtypes = {"actions": jnp.int32, "valid": jnp.bool_}
    storage = pqn.Rollout(
        *[
            jax.ShapeDtypeStruct(shapes.get(name, (T, N)), dtypes.get(name, jnp.float32), sharding=sharded)
            for name in pqn.Rollout._fields
        ]
    )
    args = pqn.Args(env_id="CartPole-v1", num_steps=T, local_num_envs=N, num_actor_threads=1)
    state = pqn.LearnerState(TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1)), jax.random.key(1))
    with pytest.raises(OutOfDeviceMemory) as error_info:
        pqn.make_learner_update(args, agent, mesh)(state, storage)
    assert re.fullmatch(
        r"the learner's targets pass needs 1,0\d\d\.\d GiB of memory, more than the [\d,.]+ GiB this host can give "
        r"it \(90% of its available memory\): lower --local-num-envs or --num-steps",
        str(error_info.value),
    ), str(error_info.value)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--start-e", "1.5"], "--start-e must be in [0, 1], got 1.5"),
        (["--end-e", "-0.1"], "--end-e must be in [0, 1], got -0.1"),
        (["--exploration-fraction", "0"], "--exploration-fraction must be in (0, 1], got 0.0"),
        (["--exploration-fraction", "1.5"], "--exploration-fraction must be in (0, 1], got 1.5"),
        (["--q-lambda", "1.2"], "--q-lambda must be in [0, 1], got 1.2"),
        (["--gamma", "-0.5"], "--gamma must be in [0, 1], got -0.5"),
        (["--q-lambda-targets", "target"], "invalid choice 'target' for argument '--q-lambda-targets'"),
        (["--env-id", "Pendulum-v1"], "--env-id 'Pendulum-v1' is not supported (continuous actions)"),
        (["--env-id", "HalfCheetah-v4"], "--env-id 'HalfCheetah-v4' is not supported: use an envpool id of Atari"),
    ],
    ids="start-e end-e fraction-zero fraction-above-one lambda gamma targets pendulum halfcheetah".split(),
)
def test_bad_input_is_one_clear_line(flags, message, workdir, monkeypatch, capsys):
    assert one_error_line(flags, PQN_SCRIPT, workdir, monkeypatch, capsys).startswith(f"error: {message}")


# ---------------------------------------------------------------- runs of the script

# 2 actor threads x 6 envs x 8 steps = 96 env steps an update, 12 updates, on a0-l1,2,3 (2 envs of each thread per
# learner device); epsilon from 1 to 0.05 over the first 576 steps (6 updates); a checkpoint after every update
TINY = (
    "--env-id CartPole-v1 --num-actor-threads 2 --local-num-envs 6 --num-steps 8 --hiddens 16 --num-minibatches 2 "
    "--update-epochs 2 --end-e 0.05 --exploration-fraction 0.5 --total-timesteps 1152 --seed 3 "
    "--checkpoint-frequency 1 --log-frequency 1 --actor-device-ids 0 --learner-device-ids 1 2 3"
).split()
# the first run also saves, evaluates and uploads its model, to a Hub that cannot be reached (a closed port)
SAVE_MODEL = "--save-model --eval-episodes 2 --upload-model --hf-entity someone".split()
# 2 processes x 1 thread x 4 envs x 16 steps = 128 env steps an update, 10 updates
TWO = (
    "--env-id CartPole-v1 --num-actor-threads 1 --local-num-envs 4 --num-steps 16 --hiddens 16 --total-timesteps "
    "1280 --checkpoint-frequency 0 --log-frequency 1 --save-model --eval-episodes 2 --actor-device-ids 0 "
    "--learner-device-ids 1"
).split()


def start(flags: list[str], cwd, run_name: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        script_command(flags, run_name, PQN_SCRIPT),
        cwd=cwd,
        env=script_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_after(process: subprocess.Popen, update: int, sig: int) -> tuple[int, str, str]:
    """`sig` once `process` has logged `update`: (exit code, its whole stdout, stderr)."""
    lines = wait_for_line(process, f"update={update}/")
    process.send_signal(sig)
    out, err = process.communicate(timeout=120)
    return process.returncode, "".join(lines) + out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Shared by the tests below, started a few at a time (they are small): "first" (TINY, its model saved, evaluated
    and its upload failing) and "stopped", a second run of its seed stopped by Ctrl-C after update 4, whose checkpoint
    the same command resumes and SIGTERM stops after update 8 ("resumed"), then resumes to the end ("resumed_again");
    then a two-process run ("two")."""
    workdir = tmp_path_factory.mktemp("pqn")
    hub = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_TOKEN": "hf_not_a_real_token"}
    first, result = start([*TINY, *SAVE_MODEL], workdir, "first", env=hub), {}
    try:
        # "stopped" starts once "first" has compiled its programs: it loads them from the session's cache
        first_lines = wait_for_line(first, "update=3/")
        result["stopped"] = stop_after(start(TINY, workdir, "stopped"), 4, signal.SIGINT)
        result["first"] = finish_script(first, workdir, "first")
        result["first"].stdout = "".join(first_lines) + result["first"].stdout
    finally:
        first.kill()
    result["stopped_scalars"] = read_scalars(workdir / "runs" / "stopped")
    result["resumed"] = stop_after(start(TINY, workdir, "stopped"), 8, signal.SIGTERM)
    result["resumed_again"] = finish_script(start(TINY, workdir, "stopped"), workdir, "stopped")
    two = tmp_path_factory.mktemp("pqn_two")
    result["two"] = finish_processes(start_processes(TWO, two, 2, run_name="two", script=PQN_SCRIPT))
    result["two_scalars"] = read_scalars(two / "runs" / "two")
    return result


def schedule_means(start_e: float, end_e: float, steps_until_end: int, num_steps: int, envs: int, updates: int):
    """The mean epsilon of each update's rollout, from the schedule's definition: step s of update u acts at global
    step (u - 1) x num_steps x envs + (s + 1) x envs."""
    steps = np.arange(updates)[:, None] * num_steps * envs + np.arange(1, num_steps + 1)[None] * envs
    return (start_e + (end_e - start_e) * np.minimum(steps / steps_until_end, 1.0)).mean(axis=1)


TAGS = (
    "charts/SPS charts/learning_rate charts/epsilon losses/td_loss losses/q_values stats/params_queue_get_time "
    "stats/rollout_time stats/inference_time stats/env_step_time stats/storage_time stats/rollout_queue_put_time "
    "stats/rollout_queue_get_time stats/training_time stats/actor_policy_version stats/learner_policy_version "
    "stats/peak_rss_mib charts/avg_episodic_return eval/episodic_return"
).split()


@pytest.mark.slow
def test_a0_l1_2_3_logs_every_tag_acts_one_version_behind_and_follows_the_schedule(runs):
    first = runs["first"]
    errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
    assert first.returncode == 1 and len(errors) == 1, first.stderr[-3000:]  # only the upload failed
    assert errors[0].startswith("error: --upload-model: uploading to someone/CartPole-v1-cleanba_pqn_envpool")
    scalars = first.scalars()
    assert not [tag for tag in TAGS if tag not in scalars]
    assert [step for step, _ in scalars["charts/SPS"]] == [96 * i for i in range(1, 13)]
    assert [v for _, v in scalars["stats/learner_policy_version"]] == list(range(12))
    assert [v for _, v in scalars["stats/actor_policy_version"]] == [0, *range(11)]  # exactly one behind
    expected = schedule_means(1.0, 0.05, 576, num_steps=8, envs=12, updates=12)
    np.testing.assert_allclose([v for _, v in scalars["charts/epsilon"]], expected, rtol=1e-6)
    rates = [v for _, v in scalars["charts/learning_rate"]]
    np.testing.assert_allclose(rates, 2.5e-4 * (1 - np.arange(12) / 12), rtol=1e-6)  # annealed per update
    losses = [v for _, v in scalars["losses/td_loss"]]
    assert np.all(np.isfinite(losses)) and len(set(losses)) > 1
    # the saved model, evaluated by the run with --end-e's epsilon, and the Hub folder its upload left behind
    assert len(scalars["eval/episodic_return"]) == 2 and "(sampled actions): 2 episodes" in first.stdout
    folder = first.run_dir / "hub"
    model = "cleanba_pqn_envpool_impala_atari_wrapper.cleanrl_model"
    assert sorted(p.name for p in folder.iterdir()) == sorted(["README.md", model, PQN_SCRIPT.name])
    card = (folder / "README.md").read_text()
    assert "Sebulba PQN (Gallici et al. 2024" in card and '"q_lambda_targets": "learner"' in card


@pytest.mark.slow
def test_the_same_seed_stopped_by_ctrl_c_is_the_same_run_up_to_its_stop(runs):
    first, (returncode, out, err) = runs["first"], runs["stopped"]
    assert returncode == 130, err[-3000:]
    update, _, state = SAVED.findall(out)[-1]
    assert int(update) >= 4 and f"stopped by signal 2 after update {update}" in out
    assert (update, state) in [(u, s) for u, _, s in SAVED.findall(first.stdout)]  # the first run's state there
    logged, stopped = first.scalars(), runs["stopped_scalars"]
    for tag in ["losses/td_loss", "losses/q_values", "charts/epsilon", "charts/avg_episodic_return"]:
        assert stopped[tag] == [(step, value) for step, value in logged[tag] if step <= 96 * int(update)], tag


@pytest.mark.slow
def test_sigterm_and_ctrl_c_resume_bit_for_bit_and_the_schedule_continues(runs):
    """Each resume starts from the state its run saved at the signal; the run's TensorBoard then has every update once,
    with the epsilon and learning rate of the uninterrupted run at every step (its episodes differ after a resume:
    new env seeds, as in every script)."""
    _, stopped_out, _ = runs["stopped"]
    returncode, resumed_out, err = runs["resumed"]
    assert returncode == 143, err[-3000:]
    assert RESUMED.search(resumed_out).groups() == SAVED.findall(stopped_out)[-1]
    again = runs["resumed_again"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert RESUMED.search(again.stdout).groups() == SAVED.findall(resumed_out)[-1]
    assert int(RESUMED.search(again.stdout).group(1)) >= 8
    scalars, first = again.scalars(), runs["first"].scalars()
    assert [step for step, _ in scalars["charts/SPS"]] == [96 * i for i in range(1, 13)]
    assert [v for _, v in scalars["stats/learner_policy_version"]] == list(range(12))
    for tag in ["charts/epsilon", "charts/learning_rate"]:
        assert scalars[tag] == first[tag], tag


@pytest.mark.slow
def test_two_processes_keep_identical_params_and_one_global_schedule(runs):
    (code0, out0, err0), (code1, out1, err1) = runs["two"]
    assert code0 == 0 and code1 == 0, err0[-3000:] + err1[-3000:]
    assert FINAL.search(out0).group(1) == FINAL.search(out1).group(1), "learner replicas diverged"
    assert "evaluated runs/two/" in out0 and "evaluated" not in out1  # process 0 saves and evaluates the model
    scalars = runs["two_scalars"]
    assert [step for step, _ in scalars["charts/SPS"]] == [128 * i for i in range(1, 11)]
    # the epsilons of both processes' samples: the schedule at global steps that count the 8 envs of both
    expected = schedule_means(1.0, 0.01, 128, num_steps=16, envs=8, updates=10)
    np.testing.assert_allclose([v for _, v in scalars["charts/epsilon"]], expected, rtol=1e-6)


# ---------------------------------------------------------------- learning


@pytest.mark.extra_learning
@pytest.mark.slow
def test_the_readme_cartpole_command_reaches_400(workdir):
    """The README's PQN command, read from the README and run as written (seed 1): an average return of at least 400
    over 10k consecutive env steps, the bar benchmark/readme_commands.py measures over ten seeds."""
    run = run_script(page_command_flags("pqn", PQN_SCRIPT), workdir, script=PQN_SCRIPT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    returns = run.scalars()["charts/avg_episodic_return"]
    assert best_window(returns, 10_000) >= 400, returns[::50]
