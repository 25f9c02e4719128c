"""The math of the PPO script against independent references."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script

ppo = load_script()


def gae_by_forward_sums(rewards, values, bootstrap_value, terminations, truncations, gamma, lam):
    """A_t = sum_k (gamma lam)^k delta_{t+k}, summed forward until an episode end or the rollout end."""
    T, N = rewards.shape
    advantages = np.zeros((T, N))
    for n in range(N):
        for t in range(T):
            total, weight = 0.0, 1.0
            for k in range(t, T):
                next_value = bootstrap_value[n] if k == T - 1 else values[k + 1, n]
                if terminations[k, n]:
                    next_value = 0.0  # a terminal state is worth nothing
                delta = rewards[k, n] + gamma * next_value - values[k, n]
                total += weight * delta
                weight *= gamma * lam
                if terminations[k, n] or truncations[k, n]:
                    break
            advantages[t, n] = total
    return advantages


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_forward_sums_with_terminations_and_truncations(seed):
    rng = np.random.default_rng(seed)
    T, N = 17, 5
    rewards = rng.normal(size=(T, N)).astype(np.float32)
    values = rng.normal(size=(T, N)).astype(np.float32)
    bootstrap_value = rng.normal(size=N).astype(np.float32)
    terminations = (rng.random((T, N)) < 0.15).astype(np.float32)
    truncations = ((rng.random((T, N)) < 0.15) & (terminations == 0)).astype(np.float32)
    truncations[-1, 0] = 1.0  # a truncation on the last step bootstraps from bootstrap_value
    terminations[-1, 1], truncations[-1, 1] = 1.0, 0.0
    advantages, returns = ppo.compute_gae(
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        terminations=terminations,
        truncations=truncations,
        gamma=0.97,
        gae_lambda=0.9,
    )
    expected = gae_by_forward_sums(rewards, values, bootstrap_value, terminations, truncations, 0.97, 0.9)
    np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, expected + values, rtol=1e-5, atol=1e-5)


def test_truncation_bootstraps_from_the_truncated_state_and_termination_does_not():
    # one env, 3 steps; step 0 ends by time limit, step 1 is envpool's reset step, step 2 terminates
    rewards = np.array([[1.0], [0.0], [2.0]], np.float32)
    values = np.array([[0.5], [10.0], [3.0]], np.float32)  # values[1] = V(truncated last observation)
    terminations = np.array([[0.0], [0.0], [1.0]], np.float32)
    truncations = np.array([[1.0], [0.0], [0.0]], np.float32)
    advantages, _ = ppo.compute_gae(
        rewards=rewards,
        values=values,
        bootstrap_value=np.array([7.0], np.float32),
        terminations=terminations,
        truncations=truncations,
        gamma=0.9,
        gae_lambda=0.8,
    )
    assert advantages[0, 0] == pytest.approx(1.0 + 0.9 * 10.0 - 0.5)  # bootstrap, but no trace past the end
    assert advantages[2, 0] == pytest.approx(2.0 - 3.0)  # terminal: no bootstrap from 7.0


def test_ppo_loss_terms_on_a_hand_checked_batch():
    # three samples; the third is envpool's reset step and must not count
    old_logprobs = jnp.log(jnp.array([0.5, 0.5, 0.5]))
    new_logprobs = jnp.log(jnp.array([0.6, 0.3, 0.9]))  # ratios 1.2, 0.6, 1.8
    advantages = jnp.array([1.0, -2.0, 5.0])
    new_values, old_values, returns = jnp.array([1.5, 0.0, 0.0]), jnp.array([1.0, 0.0, 0.0]), jnp.array([2.0, 1.0, 9.0])
    entropy = jnp.array([0.7, 0.5, 100.0])
    valid = jnp.array([True, True, False])
    batch = dict(
        new_logprobs=new_logprobs,
        entropy=entropy,
        new_values=new_values,
        old_logprobs=old_logprobs,
        old_values=old_values,
        advantages=advantages,
        returns=returns,
        valid=valid,
        normalizer=2.0,
        clip_coef=0.1,
    )
    pg, v, ent, kl = ppo.ppo_loss_terms(**batch, clip_vloss=True)
    # sample 0: A=1, r=1.2 -> max(-1.2, -1.1) = -1.1; sample 1: A=-2, r=0.6 -> max(1.2, 1.8) = 1.8
    assert float(pg) == pytest.approx((-1.1 + 1.8) / 2, rel=1e-5)
    # sample 0: unclipped 0.5*(1.5-2)^2 = 0.125, clipped value 1.1 -> 0.5*0.81 = 0.405; sample 1: 0.5*1 both
    assert float(v) == pytest.approx((0.405 + 0.5) / 2, rel=1e-5)
    assert float(ent) == pytest.approx((0.7 + 0.5) / 2, rel=1e-6)
    kl_terms = [(1.2 - 1) - np.log(1.2), (0.6 - 1) - np.log(0.6)]
    assert float(kl) == pytest.approx(sum(kl_terms) / 2, rel=1e-5)
    _, v_unclipped, _, _ = ppo.ppo_loss_terms(**batch, clip_vloss=False)
    assert float(v_unclipped) == pytest.approx((0.125 + 0.5) / 2, rel=1e-5)


def test_categorical_logprob_and_entropy_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 4)).astype(np.float32)
    actions = rng.integers(0, 4, size=6)
    logprob, entropy = ppo.categorical_logprob_entropy(jnp.asarray(logits), jnp.asarray(actions))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(logprob, np.log(probs[np.arange(6), actions]), rtol=1e-5)
    np.testing.assert_allclose(entropy, -(probs * np.log(probs)).sum(-1), rtol=1e-5)


def actor_env_seed(seed: int, start_update: int, global_thread_index: int, local_num_envs: int) -> int:
    from cleanrl_utils.actors import ActorThread

    thread = ActorThread(
        index=0,
        global_index=global_thread_index,
        device=None,
        learner_devices=[],
        start_update=start_update,
        envpool_threads=1,
        stop_event=None,
        queue_timeout=1.0,
    )
    return thread.env_seed(seed, local_num_envs)


def test_env_seed_ranges_are_disjoint_across_processes_and_threads_and_seeds():
    local_num_envs, threads = 64, 4 * 8  # 4 processes with 8 actor threads each
    for seed in [1, 2]:
        starts = [actor_env_seed(seed, 0, g, local_num_envs) for g in range(threads)]
        assert starts == [actor_env_seed(seed, 0, g, local_num_envs) for g in range(threads)]  # reproducible
        ranges = sorted((s, s + local_num_envs) for s in starts)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
        assert ranges[-1][1] < 2**31  # envpool takes an int32 seed
    run1 = {actor_env_seed(1, 0, g, local_num_envs) + i for g in range(threads) for i in range(local_num_envs)}
    run2 = {actor_env_seed(2, 0, g, local_num_envs) + i for g in range(threads) for i in range(local_num_envs)}
    assert not run1 & run2  # seeds 1 and 2 share no environment
    resumed = {actor_env_seed(1, 100, g, local_num_envs) + i for g in range(threads) for i in range(local_num_envs)}
    assert not run1 & resumed  # a run resumed at update 100 does not replay its first episodes


def test_host_devices_are_appended_to_the_users_xla_flags(monkeypatch):
    from cleanrl_utils.devices import ensure_host_devices

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    ensure_host_devices([0], [1, 2], actor_threads=2)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_use_thunk_runtime=true --xla_force_host_platform_device_count=3"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    ensure_host_devices([0], [1, 2], actor_threads=2)  # the user's own count wins
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    monkeypatch.delenv("XLA_FLAGS")
    ensure_host_devices([0], [0], actor_threads=2)
    assert "XLA_FLAGS" not in os.environ


def test_a_learner_on_several_host_devices_gets_threads_for_its_collectives(monkeypatch):
    """XLA's CPU client pool is max(cores, devices) threads by default: a0-l1,2,3 with 2 actor threads gets room for
    a running program and a waiting launch per device and actor thread, twice over (cleanrl_utils/devices.py)."""
    from cleanrl_utils.devices import collective_threads, ensure_host_devices

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    ensure_host_devices([0], [1], actor_threads=2)  # one learner device: no collective, XLA's default
    assert "PJRT_NPROC" not in os.environ
    ensure_host_devices([0], [1, 2, 3], actor_threads=2)
    assert os.environ["PJRT_NPROC"] == str(max(len(os.sched_getaffinity(0)), 12))
    assert collective_threads(4, 2, cores=2) == 12 and collective_threads(4, 2, cores=64) == 64
    monkeypatch.setenv("PJRT_NPROC", "5")
    ensure_host_devices([0], [1, 2, 3], actor_threads=2)  # the user's own count wins
    assert os.environ["PJRT_NPROC"] == "5"


@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_advantages_are_normalized_with_the_whole_minibatch_on_any_number_of_devices(num_devices):
    """--norm-adv: each learner device standardizes its part of the minibatch with the mean and std of the valid
    samples of the whole minibatch (NumPy's, over the concatenated parts); invalid samples count for nothing."""
    from functools import partial

    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(3)
    advantages = rng.normal(2.0, 5.0, size=16).astype(np.float32)
    valid = rng.random(16) < 0.75
    advantages[~valid] = 1e6  # an invalid sample's value must not move the statistics
    expected = (advantages[valid] - advantages[valid].mean()) / (advantages[valid].std() + 1e-8)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
    normalize = jax.shard_map(
        partial(ppo.normalize_advantages, axis_name="batch"),
        mesh=mesh,
        in_specs=(P("batch"),) * 2,
        out_specs=P("batch"),
    )
    np.testing.assert_allclose(np.asarray(jax.jit(normalize)(advantages, valid))[valid], expected, rtol=1e-5, atol=1e-6)


def test_learner_update_is_the_same_on_one_and_on_two_devices(monkeypatch):
    """Data parallelism must not change the math: with the default flags (advantages normalized over the whole
    minibatch, 4 epochs) and one minibatch, the same global batch gives the same params on one and on two devices;
    several minibatches on two devices update the params too, bit for bit the same with --sync-minibatches, which
    waits for each of the epochs x minibatches steps."""
    import optax
    from flax.training.train_state import TrainState
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) >= 2, "conftest arranges 4 host devices"
    T, N, obs_dim = 8, 4, 3
    rng = np.random.default_rng(0)
    storage = ppo.Rollout(
        obs=rng.normal(size=(T, N, obs_dim)).astype(np.float32),
        actions=rng.integers(0, 2, size=(T, N)).astype(np.int32),
        logprobs=np.full((T, N), np.log(0.5), np.float32),
        values=rng.normal(size=(T, N)).astype(np.float32),
        rewards=rng.normal(size=(T, N)).astype(np.float32),
        terminations=(rng.random((T, N)) < 0.2).astype(np.float32),
        truncations=np.zeros((T, N), np.float32),
        valid=rng.random((T, N)) < 0.9,
        bootstrap_value=rng.normal(size=(1, N)).astype(np.float32),
    )
    agent = ppo.Agent(action_dim=2, channels=(4,), hiddens=(8,), obs_layout="vector")
    params = jax.device_get(agent.init(jax.random.key(0), storage.obs[0]))

    def update(num_devices, num_minibatches=1, sync_minibatches=False):
        # the default flags (advantages normalized, 4 epochs) but one minibatch: each learner device shuffles its own
        # samples, so several minibatches hold other samples on other layouts
        args = ppo.Args(
            env_id="CartPole-v1",
            num_steps=T,
            local_num_envs=N,
            num_actor_threads=1,
            learner_device_ids=list(range(num_devices)),
            num_minibatches=num_minibatches,
            sync_minibatches=sync_minibatches,
        )
        mesh = Mesh(np.array(jax.devices()[:num_devices]), ("batch",))
        # the script's optimizer shape (its learning rate is logged from the injected hyperparameters)
        tx = optax.chain(optax.identity(), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
        state = TrainState.create(apply_fn=None, params=params, tx=tx)
        state = jax.device_put(state, NamedSharding(mesh, P()), may_alias=False)  # the update donates it
        global_storage = ppo.Rollout(*[jax.device_put(x, NamedSharding(mesh, P(None, "batch"))) for x in storage])
        state, metrics = ppo.make_learner_update(args, agent, mesh)(
            ppo.LearnerState(state, jax.random.key(1)), global_storage
        )
        assert "losses/policy_loss" in metrics and float(metrics["charts/learning_rate"]) == np.float32(0.1)
        return jax.device_get((state.agent.params, metrics, jax.random.key_data(state.key)))

    same = lambda a, b: jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), a, b)
    one_device = update(1)
    same(one_device, update(2))
    waits = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waits.append(x) or x)
    several = update(2, num_minibatches=2)
    assert waits == []
    synced = update(2, num_minibatches=2, sync_minibatches=True)
    assert len(waits) == 4 * 2  # epochs x minibatches
    jax.tree.map(np.testing.assert_array_equal, synced, several)  # bit for bit
    for updated in (one_device, several):  # it did update
        assert not np.allclose(jax.tree.leaves(updated[0])[0], jax.tree.leaves(params)[0])


@pytest.mark.parametrize("script", ["ppo", "impala"])
def test_nature_cnn_is_the_published_network(script):
    """--network nature on Atari's 84x84x4 frames is the Nature DQN torso (Mnih et al. 2015, Methods) with CleanRL's
    init (orthogonal, gain sqrt(2), biases 0): sizes counted by hand from the paper. With --compute-dtype bfloat16
    either torso computes in bfloat16 while params, the heads' outputs and so the losses stay float32."""
    from conftest import IMPALA_SCRIPT

    module = ppo if script == "ppo" else load_script(IMPALA_SCRIPT)
    obs = np.random.default_rng(0).integers(0, 256, size=(2, 4, 84, 84), dtype=np.uint8)
    nature = lambda compute_dtype: module.Agent(4, (16, 32, 32), (256,), "chw", "nature", compute_dtype)
    impala_cnn = lambda compute_dtype: module.Agent(4, (4,), (16,), "chw", "impala", compute_dtype)
    params = nature("bfloat16").init(jax.random.key(0), obs)  # Breakout: 4 actions
    # 84 -> (84 - 8) / 4 + 1 = 20 -> (20 - 4) / 2 + 1 = 9 -> 9 - 3 + 1 = 7: 7 x 7 x 64 = 3136 features into 512
    kernels = [(8, 8, 4, 32), (4, 4, 32, 64), (3, 3, 64, 64), (3136, 512), (512, 4), (512, 1)]
    leaves = jax.tree.leaves(params)
    assert sorted(leaf.shape for leaf in leaves if leaf.ndim > 1) == sorted(kernels)
    by_hand = (8 * 8 * 4 * 32 + 32) + (4 * 4 * 32 * 64 + 64) + (3 * 3 * 64 * 64 + 64) + (3136 * 512 + 512)
    by_hand += (512 * 4 + 4) + (512 + 1)  # the policy and value heads
    assert sum(leaf.size for leaf in leaves) == by_hand == 1_686_693
    torso = params["params"]["NatureCNN_0"]
    for name in ["Conv_0", "Conv_1", "Conv_2", "Dense_0"]:
        kernel = np.asarray(torso[name]["kernel"]).reshape(-1, torso[name]["kernel"].shape[-1])  # (fan in, out)
        np.testing.assert_allclose(kernel.T @ kernel, 2 * np.eye(kernel.shape[1]), atol=1e-4)  # orthogonal x sqrt(2)
        assert not np.any(torso[name]["bias"])
    impala_params = impala_cnn("bfloat16").init(jax.random.key(0), obs)
    for agent, agent_params, torso_name in [
        (nature, params, "NatureCNN_0"),
        (impala_cnn, impala_params, "ImpalaCNN_0"),
    ]:
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(agent_params))
        for compute_dtype in ["float32", "bfloat16"]:
            outputs, captured = agent(compute_dtype).apply(
                agent_params, obs, capture_intermediates=True, mutable=["intermediates"]
            )
            assert [x.shape for x in outputs] == [(2, 4), (2,)]  # logits and value
            assert all(x.dtype == jnp.float32 for x in outputs)
            assert captured["intermediates"][torso_name]["__call__"][0].dtype == jnp.dtype(compute_dtype)
