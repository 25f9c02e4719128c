"""The configurable on-policy script (vpg, ppo, vtrace, awr, vmpo; GAE or V-trace advantages): each loss's math
against plain NumPy on hand-checked batches, the update on one and on two learner devices, same seed same run,
SIGTERM then resume, bad input, and a learning test per loss against the random policy (InvertedPendulum-v4)."""

import re
from functools import partial

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import (
    ONPOLICY_SCRIPT,
    REPO,
    assert_same_seed_same_run,
    best_window,
    load_script,
    one_error_line,
    page_command_flags,
    run_script,
    same_seed_and_resumed_runs,
    start_script,
    untrained_gaussian_return,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cleanrl_utils.cli import parse_flags

onpolicy = load_script(ONPOLICY_SCRIPT)
LOSSES = ["vpg", "ppo", "vtrace", "awr", "vmpo"]
MODEL = "cleanba_onpolicy_continuous_action_envpool_mujoco.cleanrl_model"
DIGESTS = re.compile(r"params sha256=(\w{64}) stats sha256=(\w{64})")


def on_devices(fn, num_devices: int = 1):
    """`fn` of sharded inputs (first axis) inside shard_map over axis "batch", as the learner runs it; outputs
    replicated."""
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("batch"), out_specs=P()))


# ---------------------------------------------------------------- math


def test_policy_gradient_weights_of_vpg_vtrace_and_awr():
    advantages = np.array([-2.0, -0.5, 0.0, 0.5, 2.0, 50.0], np.float32)
    logratio = np.log(np.array([0.5, 1.0, 2.0, 0.8, 1.5, 1.0], np.float32))
    weights = partial(
        onpolicy.policy_gradient_weights, advantages=advantages, logratio=logratio, rho_bar=1.0, awr_max_weight=20.0
    )
    np.testing.assert_allclose(weights(policy_loss="vpg", awr_beta=1.0), advantages)
    # V-trace: the ratios truncated at rho_bar = 1: 0.5, 1, 1, 0.8, 1, 1
    np.testing.assert_allclose(weights(policy_loss="vtrace", awr_beta=1.0), [-1.0, -0.5, 0.0, 0.4, 2.0, 50.0])
    # AWR, beta 0.5: exp(2 A) = e^-4, e^-1, 1, e, e^4 = 54.6 -> clipped at 20, e^100 -> 20 (finite: no overflow)
    expected = np.minimum(np.exp(advantages.astype(np.float64) / 0.5), 20.0)
    np.testing.assert_allclose(weights(policy_loss="awr", awr_beta=0.5), expected, rtol=1e-6)
    assert np.isfinite(weights(policy_loss="awr", awr_beta=1e-3)).all()


def vtrace_reference(*, rewards, values, bootstrap_value, rhos, terminations, truncations, gamma, lam, rho_bar, c_bar):
    """V-trace with lambda (Espeholt et al. 2018, Eq. 1 and Remark 3) as a plain backward loop over each env, with
    envpool's episode ends: a termination has no bootstrap; any end cuts the trace. Returns (advantages, targets):
    the advantage is delta_t + gamma lambda c-corrected later corrections, without rho_t (SEED RL's estimator)."""
    T, N = rewards.shape
    targets, advantages = np.zeros((T, N)), np.zeros((T, N))
    for n in range(N):
        correction_after = 0.0  # v_{t+1} - V(x_{t+1})
        for t in reversed(range(T)):
            next_value = values[t + 1, n] if t + 1 < T else bootstrap_value[n]
            discount = 0.0 if terminations[t, n] else gamma
            cut = terminations[t, n] or truncations[t, n]
            later = 0.0 if cut else correction_after
            delta = rewards[t, n] + discount * next_value - values[t, n]
            rho, c = min(rho_bar, rhos[t, n]), lam * min(c_bar, rhos[t, n])
            correction = rho * delta + discount * c * later
            advantages[t, n] = delta + discount * lam * later
            targets[t, n] = values[t, n] + correction
            correction_after = correction
    return advantages, targets


def estimator_batch(rng, T=7, N=3):
    return dict(
        rewards=rng.normal(size=(T, N)).astype(np.float32),
        values=rng.normal(size=(T, N)).astype(np.float32),
        bootstrap_value=rng.normal(size=N).astype(np.float32),
        terminations=np.array(
            [[0, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]], np.float32
        ),
        truncations=np.array([[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]], np.float32),
    )


@pytest.mark.parametrize("rho_bar,c_bar", [(1.0, 1.0), (2.0, 0.5)])
def test_vtrace_estimator_matches_a_plain_loop(rho_bar, c_bar):
    rng = np.random.default_rng(0)
    batch = estimator_batch(rng)
    rhos = np.exp(rng.normal(0, 0.7, size=batch["rewards"].shape)).astype(np.float32)  # from ~0.2 to ~4
    advantages, targets = onpolicy.compute_vtrace(
        **batch, rhos=rhos, gamma=0.9, gae_lambda=0.8, rho_bar=rho_bar, c_bar=c_bar
    )
    expected = vtrace_reference(**batch, rhos=rhos, gamma=0.9, lam=0.8, rho_bar=rho_bar, c_bar=c_bar)
    np.testing.assert_allclose(advantages, expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(targets, expected[1], rtol=1e-5, atol=1e-5)


def test_vtrace_estimator_on_policy_is_gae():
    batch = estimator_batch(np.random.default_rng(1))
    gae = onpolicy.compute_gae(**batch, gamma=0.99, gae_lambda=0.95)
    vtrace = onpolicy.compute_vtrace(
        **batch, rhos=np.ones_like(batch["rewards"]), gamma=0.99, gae_lambda=0.95, rho_bar=1.0, c_bar=1.0
    )
    for a, b in zip(gae, vtrace):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def gaussian_kl(mean0, std0, mean1, std1):
    """KL(N(mean0, std0^2) || N(mean1, std1^2)) of diagonal Gaussians, summed over dimensions (closed form)."""
    return (np.log(std1 / std0) + (std0**2 + (mean0 - mean1) ** 2) / (2 * std1**2) - 0.5).sum(-1)


def test_decoupled_kls_are_the_kls_of_moving_the_mean_alone_and_the_std_alone():
    rng = np.random.default_rng(2)
    start_mean, mean = rng.normal(size=(2, 5, 3))
    start_logstd, logstd = rng.normal(0, 0.5, size=(2, 5, 3))
    kl_mean, kl_std = onpolicy.gaussian_kl_of_mean_and_std(
        start_mean=start_mean, start_logstd=start_logstd, mean=mean, logstd=logstd
    )
    start_std, std = np.exp(start_logstd), np.exp(logstd)
    np.testing.assert_allclose(kl_mean, gaussian_kl(start_mean, start_std, mean, start_std), rtol=1e-5)
    np.testing.assert_allclose(kl_std, gaussian_kl(start_mean, start_std, start_mean, std), rtol=1e-5)
    assert np.all(kl_mean > 0) and np.all(kl_std > 0)


# a hand-checked V-MPO batch: 8 samples, one invalid (an envpool reset step) with the largest advantage
VMPO_ADVANTAGES = np.array([0.3, -1.0, 2.0, 0.1, 1.5, -0.2, 0.8, 9.0], np.float32)
VMPO_VALID = np.array([1, 1, 1, 1, 1, 1, 1, 0], bool)
# rlax keeps k = half of all 8 samples, the k largest valid ones: 2.0, 1.5, 0.8 and 0.3 (not the invalid 9.0)
VMPO_TOP_HALF = np.array([1, 0, 1, 0, 1, 0, 1, 0], bool)


def vmpo_terms(multipliers, num_devices: int = 1, kl_mean=0.02, kl_std=1e-4):
    """The script's V-MPO terms and their gradient with respect to the multipliers, on VMPO_ADVANTAGES."""
    logprobs = np.linspace(-2, -1, 8).astype(np.float32)
    kls = np.full(8, kl_mean, np.float32), np.full(8, kl_std, np.float32)

    def terms(multipliers, logprobs, advantages, valid, kl_mean, kl_std):
        normalizer = jax.lax.psum(valid.sum(), "batch").astype(jnp.float32)
        losses = onpolicy.vmpo_loss_terms(
            new_logprobs=logprobs,
            kl_mean=kl_mean,
            kl_std=kl_std,
            advantages=advantages,
            valid=valid,
            normalizer=normalizer,
            multipliers=multipliers,
            bounds=(0.1, 0.01, 5e-5),
            axis_name="batch",
        )
        return jax.lax.psum(jnp.stack(losses), "batch")

    def terms_and_gradient(multipliers, *batch):
        # as the learner does: each device's gradient of its own loss (pcast), summed over devices (psum)
        local = jax.lax.pcast(multipliers, "batch", to="varying")
        gradient = jax.grad(lambda m: terms(m, *batch).sum())(local)
        return terms(multipliers, *batch), jax.lax.psum(gradient, "batch")

    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
    fn = jax.shard_map(
        terms_and_gradient,
        mesh=mesh,
        in_specs=(P(), *[P("batch")] * 5),
        out_specs=P(),
    )
    return jax.device_get(jax.jit(fn)(multipliers, logprobs, VMPO_ADVANTAGES, VMPO_VALID, *kls)), logprobs


@pytest.mark.parametrize("num_devices", [1, 2])
def test_vmpo_e_step_temperature_and_kl_terms_match_numpy(num_devices):
    eta = 0.7
    multipliers = onpolicy.LagrangeMultipliers(*np.array([eta, 2.0, 3.0], np.float32))
    (losses, grads), logprobs = vmpo_terms(multipliers, num_devices)
    policy_loss, temperature_loss, kl_loss, multiplier_loss = losses
    # E-step: the top half, weights softmax(A / eta) over it
    top = VMPO_ADVANTAGES[VMPO_TOP_HALF].astype(np.float64)
    weights = np.exp(top / eta) / np.exp(top / eta).sum()
    np.testing.assert_allclose(policy_loss, -(weights * logprobs[VMPO_TOP_HALF]).sum(), rtol=1e-5)
    # the temperature's dual (V-MPO Eq. 4): eta eps_eta + eta log mean exp(A / eta), and its derivative
    log_mean = np.log(np.mean(np.exp(top / eta)))
    np.testing.assert_allclose(temperature_loss, eta * (0.1 + log_mean), rtol=1e-5)
    np.testing.assert_allclose(grads.temperature, 0.1 + log_mean - (weights * top).sum() / eta, rtol=1e-4)
    # the M-step's KL penalties, sg(alpha) KL, and the multipliers' losses, alpha (eps - sg(KL))
    np.testing.assert_allclose(kl_loss, 2.0 * 0.02 + 3.0 * 1e-4, rtol=1e-5)
    np.testing.assert_allclose(multiplier_loss, 2.0 * (0.01 - 0.02) + 3.0 * (5e-5 - 1e-4), rtol=1e-4)


@pytest.mark.parametrize(
    "kl,alpha_grows", [(0.002, False), (0.05, True)], ids=["KL below its bound", "KL above its bound"]
)
def test_kl_multipliers_grow_above_their_bound_and_shrink_below(kl, alpha_grows):
    multipliers = onpolicy.LagrangeMultipliers(*np.ones(3, np.float32))
    (_, grads), _ = vmpo_terms(multipliers, kl_mean=kl, kl_std=kl / 100)  # bounds 0.01 and 5e-5
    # gradient descent moves a multiplier against its gradient: negative gradient, the multiplier grows
    assert (grads.alpha_mean < 0) == alpha_grows and (grads.alpha_std < 0) == alpha_grows
    np.testing.assert_allclose(grads.alpha_mean, 0.01 - kl, rtol=1e-4)
    # and the projection keeps every multiplier positive
    params = onpolicy.Params(network={}, multipliers=onpolicy.LagrangeMultipliers(*np.array([-1.0, 0.0, 2.0])))
    assert tuple(onpolicy.project_multipliers(params).multipliers) == (1e-8, 1e-8, 2.0)


def test_temperature_grows_when_the_e_step_is_too_sharp_and_shrinks_when_too_flat():
    """d(dual)/d(eta) = eps_eta - KL(E-step weights || uniform over the top half): a small eta concentrates the weights
    (KL above eps_eta: eta grows), a large one spreads them (KL below: eta shrinks)."""
    for eta, grows in [(0.05, True), (100.0, False)]:
        (_, grads), _ = vmpo_terms(onpolicy.LagrangeMultipliers(*np.array([eta, 1.0, 1.0], np.float32)))
        assert (grads.temperature < 0) == grows, (eta, grads.temperature)


# ---------------------------------------------------------------- the learner update


def random_rollout(rng, T=8, N=4, obs_dim=3, action_dim=2):
    raw_obs = rng.normal(2.0, 3.0, size=(T, N, obs_dim)).astype(np.float32)
    return onpolicy.Rollout(
        obs=np.clip((raw_obs - 1) / 2, -10, 10),
        raw_obs=raw_obs,
        actions=rng.normal(size=(T, N, action_dim)).astype(np.float32),
        logprobs=rng.normal(-2.5, 0.3, size=(T, N)).astype(np.float32),
        values=rng.normal(size=(T, N)).astype(np.float32),
        rewards=rng.normal(size=(T, N)).astype(np.float32),
        discounted_returns=rng.normal(5.0, 2.0, size=(T, N)).astype(np.float32),
        terminations=(rng.random((T, N)) < 0.2).astype(np.float32),
        truncations=(rng.random((T, N)) < 0.05).astype(np.float32),
        valid=rng.random((T, N)) < 0.9,
        bootstrap_value=rng.normal(size=(1, N)).astype(np.float32),
    )


@pytest.mark.parametrize("advantage_estimator", ["gae", "vtrace"])
@pytest.mark.parametrize("policy_loss", LOSSES)
def test_every_loss_updates_the_same_on_one_and_on_two_learner_devices(policy_loss, advantage_estimator):
    """Each loss with its default flags but one minibatch (each learner device shuffles its own samples): advantages
    normalized over the whole minibatch (V-trace's with the learner's own policy in the ratios); V-MPO's top half is
    that of the whole minibatch, gathered from both devices."""
    storage = random_rollout(np.random.default_rng(0))
    agent = onpolicy.Agent(action_dim=2, hiddens=(8,))
    network = jax.device_get(agent.init(jax.random.key(0), storage.obs[0]))
    params = onpolicy.Params(network, onpolicy.LagrangeMultipliers(*np.ones(3, np.float32)))

    def update(num_devices):
        args = onpolicy.with_loss_defaults(
            onpolicy.Args(
                num_steps=8,
                local_num_envs=4,
                num_actor_threads=1,
                num_minibatches=1,
                learner_device_ids=list(range(num_devices)),
                policy_loss=policy_loss,
                advantage_estimator=advantage_estimator,
            )
        )
        mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
        state = onpolicy.AgentState.create(
            apply_fn=None,
            params=params,
            tx=optax.chain(optax.identity(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)),
            obs_rms=jax.tree.map(np.float32, onpolicy.RunningMeanStd(np.zeros(3), np.ones(3), 1e-4)),
            return_rms=jax.tree.map(np.float32, onpolicy.RunningMeanStd(0.0, 1.0, 1e-4)),
        )
        state = jax.device_put(state, NamedSharding(mesh, P()), may_alias=False)  # the update donates it
        global_storage = onpolicy.Rollout(*[jax.device_put(x, NamedSharding(mesh, P(None, "batch"))) for x in storage])
        state, metrics = onpolicy.make_learner_update(args, agent, mesh)(
            onpolicy.LearnerState(state, jax.random.key(1)), global_storage
        )
        return jax.device_get((state.agent.params, metrics))

    (params_one, metrics_one), (params_two, metrics_two) = update(1), update(2)
    # the two devices' sums add in another order: on an AMD EPYC the params near 0 differ by up to 7e-6 (awr, vtrace)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-5), params_one, params_two)
    assert metrics_one.keys() == metrics_two.keys()
    for name in metrics_one:
        np.testing.assert_allclose(metrics_one[name], metrics_two[name], rtol=2e-5, atol=1e-6, err_msg=name)
    assert not np.allclose(jax.tree.leaves(params_one.network)[0], jax.tree.leaves(network)[0])  # it did update
    moved = [float(m) != 1.0 for m in params_one.multipliers]
    assert moved == ([True, True, True] if policy_loss == "vmpo" else [False, False, False])
    if policy_loss == "vmpo":
        assert {"charts/temperature", "charts/alpha_mean", "losses/temperature_loss"} <= metrics_one.keys()


# ---------------------------------------------------------------- runs of the script

TINY_HOPPER = (
    "--env-id Hopper-v4 --num-actor-threads 1 --local-num-envs 4 --num-steps 16 --hiddens 8 --num-minibatches 2 "
    "--update-epochs 2 --log-frequency 1 --actor-device-ids 0 --learner-device-ids 1 2 --seed 3"
).split()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """V-MPO with V-trace advantages on two learner devices (the E-step gathers both): a run, a second run of its seed
    stopped by SIGTERM after update 4, and two resumes of its checkpoint; 10 updates of 64 env steps."""
    flags = [*TINY_HOPPER, "--policy-loss", "vmpo", "--advantage-estimator", "vtrace", "--total-timesteps", "640"]
    flags += ["--save-model", "--eval-episodes", "2"]  # the saved policy is evaluated at the end
    return same_seed_and_resumed_runs(
        tmp_path_factory, "onpolicy", partial(start_script, script=ONPOLICY_SCRIPT), flags
    )


@pytest.mark.slow
def test_same_seed_same_run(runs):
    steps = assert_same_seed_same_run(
        runs, DIGESTS, ["losses/policy_loss", "losses/temperature_loss", "charts/temperature", "losses/kl_mean"]
    )
    assert steps == list(range(64, 641, 64))
    first = runs["first"]
    assert "evaluated runs/first/" in first.stdout and "episodic_return=" in first.stdout, first.stdout[-2000:]
    model = flax.serialization.msgpack_restore((first.run_dir / MODEL).read_bytes())
    # the policy's network alone (not V-MPO's multipliers): what make_eval_policy runs
    network = onpolicy.Agent(action_dim=3, hiddens=(8,)).init(jax.random.key(0), np.zeros((1, 11), np.float32))
    assert jax.tree.structure(model["params"]) == jax.tree.structure(jax.device_get(network))


@pytest.mark.slow
def test_sigterm_then_resume_restores_the_state_and_the_multipliers(runs):
    returncode, out, err = runs["stopped"]
    assert returncode == 143, err[-3000:]
    saved = DIGESTS.search(re.search(r"checkpoint saved: update=(\d+).*", out).group(0)).groups()
    finals = []
    for name in ["resumed", "resumed_again"]:
        run = runs[name]
        assert run.returncode == 0, run.stderr[-3000:]
        assert DIGESTS.search(re.search(r"resumed from checkpoint: .*", run.stdout).group(0)).groups() == saved
        finals.append(DIGESTS.search(run.stdout.split("final ")[-1]).groups())
        # the run folder's scalars: the stopped run's, then the resumed run's from the next update on, each step once
        assert [step for step, _ in run.scalars()["charts/temperature"]] == list(range(64, 641, 64))
    assert finals[0] == finals[1]  # the same checkpoint resumed twice ends in the same state


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--policy-loss", "trpo"],
            "invalid choice 'trpo' for argument '--policy-loss'. Expected one of ('vpg', 'ppo',",
        ),
        (["--advantage-estimator", "nstep"], "invalid choice 'nstep' for argument '--advantage-estimator'"),
        (["--awr-beta", "0"], "--awr-beta must be positive and finite, got 0"),
        (["--awr-max-weight", "-1"], "--awr-max-weight must be positive and finite, got -1"),
        (["--vmpo-eps-eta", "0"], "--vmpo-eps-eta must be positive and finite, got 0"),
        (["--vmpo-eps-alpha-std", "inf"], "--vmpo-eps-alpha-std must be positive and finite, got inf"),
        (["--vtrace-c-bar", "1.5"], "--vtrace-c-bar must be in (0, 1]"),
        (["--policy-loss", "vpg", "--update-epochs", "0"], "--update-epochs must be a positive integer"),
    ],
    ids="unknown-loss unknown-estimator beta max-weight eps-eta eps-std c-bar epochs".split(),
)
def test_bad_input_is_one_clear_line(flags, message, workdir, monkeypatch, capsys):
    line = one_error_line(flags, ONPOLICY_SCRIPT, workdir, monkeypatch, capsys)
    assert line.startswith(f"error: {message}"), line


def test_each_loss_gets_its_own_learning_rate_epochs_and_minibatches_unless_a_flag_sets_them():
    for policy_loss, defaults in onpolicy.LOSS_DEFAULTS.items():
        args = onpolicy.Args(policy_loss=policy_loss)
        resolved = onpolicy.with_loss_defaults(args)
        assert {name: getattr(resolved, name) for name in defaults} == defaults, policy_loss
        assert args.learning_rate is None and args.update_epochs is None  # the flags as given are not changed
        flags = ["--policy-loss", policy_loss, "--update-epochs", "4"]
        given = onpolicy.with_loss_defaults(parse_flags(onpolicy.Args, flags))
        assert given.update_epochs == 4 and given.learning_rate == defaults["learning_rate"]
        flags = ["--policy-loss", policy_loss, "--squash-mean", str(not defaults["squash_mean"])]
        assert onpolicy.with_loss_defaults(parse_flags(onpolicy.Args, flags)).squash_mean is not defaults["squash_mean"]
    assert set(onpolicy.LOSS_DEFAULTS) == set(LOSSES)


def test_squashed_mean_is_tanh_into_each_dimensions_bounds():
    """--squash-mean: center + half-width x tanh(the unsquashed mean), per action dimension (NumPy reference), so even
    a mean head driven far outside stays within the bounds; the log-std and the value are untouched."""
    low, high = (-3.0, -1.0), (3.0, 0.5)
    squashed, unsquashed = (onpolicy.Agent(2, (8,), bounds) for bounds in ((low, high), None))
    params = unsquashed.init(jax.random.key(0), np.zeros((1, 4), np.float32))
    params = jax.tree_util.tree_map_with_path(  # the mean head's kernel x 1000: raw means far outside
        lambda path, x: x * 1000 if "Dense_0" in jax.tree_util.keystr(path) else x, params
    )
    obs = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    raw_mean, raw_logstd, raw_value = map(np.asarray, unsquashed.apply(params, obs))
    mean, logstd, value = map(np.asarray, squashed.apply(params, obs))
    low, high = np.array(low), np.array(high)
    np.testing.assert_allclose(mean, (high + low) / 2 + (high - low) / 2 * np.tanh(raw_mean), rtol=1e-5, atol=1e-6)
    assert np.abs(raw_mean).max() > 10 and ((mean >= low) & (mean <= high)).all()
    np.testing.assert_array_equal(logstd, raw_logstd)
    np.testing.assert_array_equal(value, raw_value)


# ---------------------------------------------------------------- learning

# InvertedPendulum-v4, a0-l1: 40 updates of 1 actor thread x 8 envs x 128 steps, 16 minibatches of 64 (PPO paper
# Table 3); every other hyperparameter is the script's default for the loss. This is the docs page's command.
PENDULUM_LEARNING = (
    "--env-id InvertedPendulum-v4 --num-actor-threads 1 --local-num-envs 8 --num-steps 128 --num-minibatches 16 "
    "--actor-device-ids 0 --learner-device-ids 1 --total-timesteps 40960 --log-frequency 5 --checkpoint-frequency 0"
).split()


@pytest.fixture(scope="module")
def random_pendulum_return() -> float:
    """The random policy's average return on InvertedPendulum-v4, measured with the evaluator's episode counting:
    N(0, 1) actions, what the untrained Gaussian policy does (its mean starts near 0, its std at 1)."""
    return untrained_gaussian_return(onpolicy.make_env, "InvertedPendulum-v4")


@pytest.mark.slow
@pytest.mark.parametrize("policy_loss", LOSSES)
def test_every_loss_learns_inverted_pendulum(policy_loss, workdir, random_pendulum_return):
    """The best average return logged reaches 20 times the random policy's (about 8: the pole falls within a few
    steps; +1 per step, 1000 at most). Measured on a 2-core CPU (about 15 s a run), seeds 1-3, best logged: see the
    docs page (rl-algorithms/onpolicy_continuous_action.md)."""
    assert random_pendulum_return < 15
    run = run_script([*PENDULUM_LEARNING, "--policy-loss", policy_loss], workdir, script=ONPOLICY_SCRIPT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    best_step, best = max(run.scalars()["charts/avg_episodic_return"], key=lambda step_value: step_value[1])
    assert best >= 20 * random_pendulum_return, f"{policy_loss}: best {best:.1f} at step {best_step}"


@pytest.mark.extra_learning
@pytest.mark.slow
def test_the_docs_cartpole_balance_command_reaches_800(workdir):
    """The docs page's CartpoleBalance-v1 command (PPO, 307,200 steps), read from the page and run as written (seed 1,
    about 50 s): an average return of at least 800 over 32,768 consecutive env steps, its bar in
    benchmark/readme_commands.py (10 of 10 seeds there), where N(0, 1) actions, measured here, average about 364."""
    page = REPO / "docs" / "rl-algorithms" / "onpolicy_continuous_action.md"
    flags = page_command_flags("onpolicy_continuous_action@CartpoleBalance-v1", ONPOLICY_SCRIPT, page)
    run = run_script(flags, workdir, script=ONPOLICY_SCRIPT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    random = untrained_gaussian_return(onpolicy.make_env, "CartpoleBalance-v1", episodes=16)
    reached = best_window(run.scalars()["charts/avg_episodic_return"], 32_768)
    assert reached >= 800 and random < 500, (reached, random)
