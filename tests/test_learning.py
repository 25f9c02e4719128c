"""The very script users run for Atari learns on CartPole-v1, and a seed fixes the whole run."""

from conftest import run_script

# CleanRL's classic-control network (two 64-unit tanh layers) and clip 0.2, with a larger learning rate
CARTPOLE = ["--env-id", "CartPole-v1", "--local-num-envs", "8", "--num-steps", "128", "--hiddens", "64", "64",
            "--clip-coef", "0.2", "--learning-rate", "1e-3", "--actor-device-ids", "0", "--learner-device-ids", "1"]


def test_cartpole_reaches_400_within_250k_steps(workdir):
    run = run_script([*CARTPOLE, "--num-actor-threads", "1", "--total-timesteps", "250000", "--log-frequency", "50"],
                     workdir, timeout=400)
    assert run.returncode == 0, run.stderr
    returns = run.scalars()["charts/avg_episodic_return"]
    best_step, best = max(returns, key=lambda step_value: step_value[1])
    assert best >= 400, f"best average return {best:.1f} at step {best_step}"


def test_same_seed_same_run(workdir):
    # two actor threads and two learner devices: thread scheduling must not leak into the results
    flags = [*CARTPOLE[:-1], "1", "2", "--num-actor-threads", "2", "--total-timesteps", "16384", "--seed", "7"]
    first, second = run_script(flags, workdir, "first"), run_script(flags, workdir, "second")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b = first.scalars(), second.scalars()
    for tag in ["losses/loss", "losses/policy_loss", "losses/value_loss", "losses/approx_kl",
                "charts/avg_episodic_return", "charts/avg_episodic_length"]:
        assert a[tag] == b[tag], tag
    other_seed = run_script([*flags[:-1], "8"], workdir, "other")
    assert other_seed.scalars()["losses/loss"] != a["losses/loss"]
