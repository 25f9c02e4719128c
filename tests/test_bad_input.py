"""Bad input: a one-line error naming the flag and what is allowed, exit code 2, before any heavy work."""

import pytest

from cleanrl_utils.flags import run_cli
from conftest import MUZERO_SCRIPT, load_script, run_script

CASES = {
    "zero envs": (["--local-num-envs", "0"], "--local-num-envs must be a positive integer"),
    "negative steps": (["--num-steps", "-5"], "--num-steps must be a positive integer"),
    "zero threads": (["--num-actor-threads", "0"], "--num-actor-threads must be a positive integer"),
    "minibatches do not divide": (["--local-num-envs", "3", "--num-steps", "5", "--num-minibatches", "4"],
                                  "--num-minibatches (4) must divide"),
    "envs do not split over learners": (["--local-num-envs", "3", "--learner-device-ids", "0", "1"],
                                        "--local-num-envs (3) must be divisible by the number of --learner-device-ids"),
    "negative device id": (["--actor-device-ids", "-1"], "--actor-device-ids must be one or more distinct device ids in [0, 63]"),
    "duplicate device ids": (["--learner-device-ids", "1", "1"], "--learner-device-ids must be one or more distinct device ids in [0, 63]"),
    "negative envpool threads": (["--envpool-threads", "-1"], "--envpool-threads must be in [0, "),
    "device id out of range": (["--learner-device-ids", "0", "3"], "--learner-device-ids [0, 3] out of range"),
    "unknown env": (["--env-id", "Breakout-v99"], "--env-id 'Breakout-v99' is not supported"),
    "continuous env": (["--env-id", "Pendulum-v1"], "--env-id 'Pendulum-v1' is not supported"),
    "fewer steps than a batch": (["--total-timesteps", "100"], "--total-timesteps (100) is smaller than one batch"),
    "zero learning rate": (["--learning-rate", "0"], "--learning-rate must be positive"),
    "infinite learning rate": (["--learning-rate", "inf"], "--learning-rate must be positive and finite, got inf"),
    "negative gradient clip": (["--max-grad-norm", "-1"], "--max-grad-norm must be positive and finite"),
    "negative clip coefficient": (["--clip-coef", "-5"], "--clip-coef must be positive and finite"),
    "negative entropy coefficient": (["--ent-coef", "-0.1"], "--ent-coef must be non-negative and finite"),
    "gamma above one": (["--gamma", "1.5"], "--gamma must be in [0, 1]"),
    "zero channels": (["--channels", "16", "0"], "--channels must be one or more positive integers"),
    "unknown learner loop": (["--learner-loop", "jit"], "--learner-loop must be one of auto, scan, python, got 'jit'"),
    "video without a saved model": (["--capture-video"], "--capture-video works on the model saved at the end of "
                                                         "training: add --save-model"),
    "absurd device id": (["--learner-device-ids", "10000"], "--learner-device-ids must be one or more distinct device"),
    "absurd envpool threads": (["--envpool-threads", "100000"], "--envpool-threads must be in [0, "),
    "negative seed": (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    "huge seed": (["--seed", str(2**40)], "--seed must be in [0, 4294967295]"),
    "huge timesteps": (["--total-timesteps", str(2**60)], "--total-timesteps must be in [1, 9007199254740992]"),
    "infinite queue timeout": (["--queue-timeout", "inf"], "--queue-timeout must be in [0.001, 3600], got inf"),
    "zero heartbeat timeout": (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be in [1, 86400], got 0"),
    "run name with a path": (["--run-name", "../../victim"], "--run-name must be one folder name of letters, digits"),
    "empty run name": (["--run-name", ""], "--run-name must be one folder name"),
    "dot run name": (["--run-name", ".."], "--run-name must be one folder name"),
    "exp name with a slash": (["--exp-name", "a/b", "--save-model"], "--exp-name must be one folder name"),
    "process id without distributed": (["--process-id", "1"], "--process-id needs --distributed"),
    "unresolvable coordinator": (["--distributed", "--coordinator-address", "no-such-host.invalid:1234",
                                  "--num-processes", "2", "--process-id", "0"],
                                 "--coordinator-address no-such-host.invalid:1234: cannot resolve 'no-such-host.invalid'"),
    "process id out of range": (["--distributed", "--coordinator-address", "127.0.0.1:1", "--num-processes", "2",
                                 "--process-id", "2"], "--process-id must be in [0, 2)"),
}


# as users meet them, in a subprocess: one case per place the checks run (before JAX starts, on the devices,
# on the batch size); the other cases call the script's main() in this process (a subprocess costs ~6 s each)
SUBPROCESS_CASES = ["zero envs", "device id out of range", "fewer steps than a batch"]
IN_PROCESS_CASES = [name for name in CASES if name not in SUBPROCESS_CASES]


@pytest.fixture(scope="module")
def ppo():
    return load_script()


@pytest.mark.parametrize("name", IN_PROCESS_CASES)
def test_bad_input_is_one_clear_line_in_process(ppo, name, workdir, monkeypatch, capsys):
    flags, message = CASES[name]
    monkeypatch.chdir(workdir)
    with pytest.raises(SystemExit) as exit_info:
        run_cli(ppo.main, ppo.Args, flags)  # what `python script.py FLAGS` runs
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], error_lines
    assert not (workdir / "runs").exists()  # nothing was started


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_is_one_clear_line(workdir, name):
    flags, message = CASES[name]
    # two host devices exist (set by the user), so id 3 is out of range
    run = run_script(flags, workdir, timeout=60, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert run.returncode == 2, (run.stdout, run.stderr)
    error_lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], run.stderr
    assert "Traceback" not in run.stderr
    assert not (workdir / "runs").exists()  # nothing was started


@pytest.mark.parametrize("flags,message", [
    (["--num-simulations", "0"], "--num-simulations must be in [1, 10000], got 0"),
    (["--unroll-steps", "20", "--td-steps", "20", "--buffer-size", "1024"],
     "--buffer-size (1024) must hold at least max(--num-steps, --unroll-steps + --td-steps + 1) = 41"),
], ids=["muzero-simulations", "muzero-unroll-longer-than-stored"])
def test_muzero_bad_input_is_one_clear_line(workdir, flags, message):
    """MuZero's own checks as a user meets them (more cases in tests/test_muzero.py)."""
    run = run_script(["--env-id", "CartPole-v1", *flags], workdir, timeout=180, script=MUZERO_SCRIPT)
    assert run.returncode == 2, (run.stdout, run.stderr)
    error_lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and message in error_lines[0], run.stderr
    assert "Traceback" not in run.stderr and not (workdir / "runs").exists()
