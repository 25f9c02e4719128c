"""The very script users run for Atari learns on CartPole-v1, and a seed fixes the whole run."""

import pytest
from conftest import CARTPOLE_PPO, run_script

# a 250k-step learning run and three same-seed runs: the slow tier
pytestmark = pytest.mark.slow


def test_cartpole_reaches_400_within_250k_steps(cartpole_learning_run):
    run = cartpole_learning_run
    assert run.returncode == 0, run.stderr
    returns = run.scalars()["charts/avg_episodic_return"]
    best_step, best = max(returns, key=lambda step_value: step_value[1])
    assert best >= 400, f"best average return {best:.1f} at step {best_step}"


def test_same_seed_same_run(workdir):
    # two actor threads and two learner devices: thread scheduling must not leak into the results
    flags = [
        *CARTPOLE_PPO,
        "--learner-device-ids",
        "1",
        "2",
        "--num-actor-threads",
        "2",
        "--local-num-envs",
        "8",
        "--total-timesteps",
        "8192",
        "--seed",
        "7",
    ]
    first, second = run_script(flags, workdir, "first"), run_script(flags, workdir, "second")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = first.scalars(), second.scalars()
    for tag in (
        "losses/loss losses/policy_loss losses/value_loss losses/approx_kl charts/avg_episodic_return "
        "charts/avg_episodic_length"
    ).split():
        assert a[tag] == b[tag], tag
    other_seed = run_script([*flags[:-1], "8"], workdir, "other")
    assert other_seed.scalars()["losses/loss"] != a["losses/loss"]
