"""Bad input: a one-line error naming the flag and what is allowed, exit code 2, before any heavy work."""

import functools
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from conftest import (
    IMPALA_SCRIPT,
    MUJOCO_SCRIPT,
    MUZERO_SCRIPT,
    ONPOLICY_SCRIPT,
    PPO_SCRIPT,
    PQN_SCRIPT,
    R2D2_SCRIPT,
    REPO,
    SAC_SCRIPT,
    load_script,
    one_error_line,
    run_script,
)

from cleanrl_utils import envs
from cleanrl_utils.cli import parse_flags
from cleanrl_utils.envs import env_spaces
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import INT32_MAX, check_int32_counts, derive_batch_values
from cleanrl_utils.replay_sizing import check_replay_fits, host_memory_bytes
from cleanrl_utils.run import SebulbaRun

# tiny CartPole PPO: 1 thread x 4 envs x 32 steps = 128 env steps per update, 4 epochs x 4 minibatches
TINY_CARTPOLE = (
    "--env-id CartPole-v1 --local-num-envs 4 --num-steps 32 --num-actor-threads 1 --hiddens 8 --checkpoint-frequency 0"
).split()

CASES = {
    "zero envs": (["--local-num-envs", "0"], "--local-num-envs must be a positive integer"),
    "negative steps": (["--num-steps", "-5"], "--num-steps must be a positive integer"),
    "zero threads": (["--num-actor-threads", "0"], "--num-actor-threads must be a positive integer"),
    "minibatches do not divide": (
        ["--local-num-envs", "3", "--num-steps", "5", "--num-minibatches", "4"],
        "--num-minibatches (4) must divide",
    ),
    "envs do not split over learners": (
        ["--learner-device-ids", *"0 1 2 3 4 5 6".split()],  # 7 devices: the default 60 envs do not split
        "--local-num-envs (60) must be divisible by the number of --learner-device-ids (7): each actor thread splits "
        "its envs over them (the nearest that work with the other flags: 56 or 63)",
    ),
    "negative device id": (
        ["--actor-device-ids", "-1"],
        "--actor-device-ids must be one or more distinct device ids in [0, 63]",
    ),
    "duplicate device ids": (
        ["--learner-device-ids", "1", "1"],
        "--learner-device-ids must be one or more distinct device ids in [0, 63]",
    ),
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
    "unknown network": (["--network", "resnet"], "invalid choice 'resnet' for argument '--network'"),
    "half precision": (["--compute-dtype", "float16"], "invalid choice 'float16' for argument '--compute-dtype'"),
    "video without a saved model": (
        ["--capture-video"],
        "--capture-video works on the model saved at the end of training: add --save-model",
    ),
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
    "unresolvable coordinator": (
        ("--distributed --coordinator-address no-such-host.invalid:1234 --num-processes 2 --process-id 0").split(),
        "--coordinator-address no-such-host.invalid:1234: cannot resolve 'no-such-host.invalid'",
    ),
    "process id out of range": (
        ["--distributed", "--coordinator-address", "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"],
        "--process-id must be in [0, 2)",
    ),
    # the learning-rate schedule counts optimizer steps in int32: 10**15 steps were an OverflowError traceback
    "optimizer steps beyond int32": (
        [*TINY_CARTPOLE, "--total-timesteps", str(10**15)],
        "--total-timesteps (1000000000000000) must be at most 17179869183 with 128 env "
        "steps per update: optimizer steps (--update-epochs x --num-minibatches = 16 per "
        "update) are counted in int32, at most 2147483647 in a run",
    ),
    "one update's optimizer steps beyond int32": (
        [*TINY_CARTPOLE, "--update-epochs", str(2**31)],
        "--update-epochs x --num-minibatches (optimizer steps per "
        "update) must be at most 2147483647: they are counted in int32, got 8589934592",
    ),
}


# as users meet them, in a subprocess: one case per place the checks run (before JAX starts, on the devices,
# on the batch size) and an env count the learner devices do not split; the other cases call the script's main() in
# this process (a subprocess costs ~6 s each)
SUBPROCESS_CASES = [
    "zero envs",
    "envs do not split over learners",
    "device id out of range",
    "fewer steps than a batch",
]
IN_PROCESS_CASES = [name for name in CASES if name not in SUBPROCESS_CASES]


@pytest.mark.parametrize("name", IN_PROCESS_CASES)
def test_bad_input_is_one_clear_line_in_process(name, workdir, monkeypatch, capsys):
    flags, message = CASES[name]
    assert message in one_error_line(flags, PPO_SCRIPT, workdir, monkeypatch, capsys)


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


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--num-simulations", "0"], "--num-simulations must be in [1, 10000], got 0"),
        (
            ["--unroll-steps", "20", "--td-steps", "20", "--buffer-size", "1024"],
            "--buffer-size (1024) must hold at least max(--num-steps, --unroll-steps + --td-steps + 1) = 41",
        ),
    ],
    ids=["muzero-simulations", "muzero-unroll-longer-than-stored"],
)
def test_muzero_bad_input_is_one_clear_line(workdir, flags, message, monkeypatch, capsys):
    """MuZero's own checks (more cases in tests/test_muzero.py)."""
    assert message in one_error_line(["--env-id", "CartPole-v1", *flags], MUZERO_SCRIPT, workdir, monkeypatch, capsys)


# tiny replay runs (32 env steps per update) of the three scripts with a replay on the learner devices
TINY_REPLAY = {
    "sac": (
        SAC_SCRIPT,
        (
            "--env-id Pendulum-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 --hiddens 16 "
            "--minibatch-size 16 --learning-starts 0 --replay-ratio 0.25 --learner-device-ids 1 "
            "--checkpoint-frequency 0"
        ).split(),
    ),
    "r2d2": (
        R2D2_SCRIPT,
        (
            "--env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 "
            "--sequence-length 8 --burn-in 2 --n-step 2 --lstm-size 8 --hiddens 16 --minibatch-size 4 "
            "--learning-starts 0 --replay-ratio 0.0625 --learner-device-ids 1 --checkpoint-frequency 0"
        ).split(),
    ),
    "muzero": (
        MUZERO_SCRIPT,
        (
            "--env-id CartPole-v1 --local-num-envs 4 --num-actor-threads 1 --num-steps 8 --hiddens 16 "
            "--embedding-size 8 --support-size 5 --num-simulations 4 --unroll-steps 3 --td-steps 3 "
            "--minibatch-size 8 --replay-ratio 0.125 --learner-device-ids 1 --checkpoint-frequency 0"
        ).split(),
    ),
}


@pytest.mark.parametrize("name", TINY_REPLAY)
def test_replay_larger_than_memory_is_one_line_before_allocating(name, workdir, monkeypatch, capsys):
    """A replay that cannot fit was a RESOURCE_EXHAUSTED traceback after the run folder was made; now one line with
    its bytes and the device's memory (on CPU: the host's), before anything is allocated."""
    script, flags = TINY_REPLAY[name]
    error = one_error_line([*flags, "--buffer-size", str(2**50)], script, workdir, monkeypatch, capsys)
    match = re.fullmatch(
        r"error: --buffer-size \(1125899906842624\) needs ([\d,.]+) GiB of replay on each learner "
        r"device; device cpu:1 has ([\d,.]+) GiB \(the host's memory\): lower --buffer-size "
        r"\(about (\d+) fit\)",
        error,
    )
    assert match, error
    need, have = (float(value.replace(",", "")) for value in match.group(1, 2))
    assert need > 1e6 and abs(have - host_memory_bytes() / 2**30) < 0.1
    assert int(match.group(3)) < 2**50 * have / need * 1.01  # the hint scales the size down to the memory


def test_replay_above_the_flag_range_is_one_line(workdir, monkeypatch, capsys):
    script, flags = TINY_REPLAY["r2d2"]  # sizes beyond 2**64 broke flashbax's sum tree (np.log2 of a Python int)
    error = one_error_line([*flags, "--buffer-size", str(10**30)], script, workdir, monkeypatch, capsys)
    assert error == f"error: --buffer-size must be in [1, {2**53}], got {10**30}"


def test_replay_script_int32_counts_are_one_line(workdir, monkeypatch, capsys):
    """R2D2 writes 8 sequences per update into each learner device's replay, counted by flashbax in int32: 2**40 env
    steps (2**35 updates) would wrap it, and the run trained on (the target copies' step count wraps too)."""
    script, flags = TINY_REPLAY["r2d2"]
    error = one_error_line(
        [*flags, "--buffer-size", "256", "--total-timesteps", str(2**40)], script, workdir, monkeypatch, capsys
    )
    assert error == (
        "error: --total-timesteps (1099511627776) must be at most 8589934591 with 32 env steps per "
        "update: sequences written to each learner device's replay (env steps per update / "
        "(--sequence-length / 2) / learner devices = 8 per update) are counted in int32, at most "
        "2147483647 in a run"
    )


def test_gradient_steps_of_one_update_beyond_int32_are_one_line(workdir, monkeypatch, capsys):
    script, flags = TINY_REPLAY["sac"]  # 1e12 x 32 env steps: a scan of 3.2e13 gradient steps
    error = one_error_line([*flags, "--replay-ratio", "1e12"], script, workdir, monkeypatch, capsys)
    assert error == (
        "error: --replay-ratio x env steps per update (gradient steps per update) must be at most "
        "2147483647: they are counted in int32, got 32000000000000"
    )


def test_int32_counts_allow_exactly_the_named_largest_value():
    counts = {"optimizer steps": ("--update-epochs x --num-minibatches", 16)}
    largest = 17179869183  # with 128 env steps per update: 134217727 updates x 16 <= 2**31 - 1
    check_int32_counts(SimpleNamespace(total_timesteps=largest, num_updates=largest // 128, batch_size=128), counts)
    assert (largest // 128) * 16 <= INT32_MAX < (largest // 128 + 1) * 16
    with pytest.raises(UsageError, match=f"must be at most {largest} with 128 env steps per update"):
        check_int32_counts(
            SimpleNamespace(total_timesteps=largest + 1, num_updates=(largest + 1) // 128, batch_size=128), counts
        )


class FakeAccelerator:
    """A GPU as JAX shows one: its allocator's limit in memory_stats()."""

    platform = "gpu"

    def __init__(self, bytes_limit: int):
        self.bytes_limit = bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit}

    def __str__(self):
        return "cuda:0"


def replay_init(rows: int, floats: int = 3):
    """A flashbax-like init: 2 envs x `rows` rows of `floats` float32s (only its shapes are ever computed)."""
    return lambda item: {"obs": jnp.zeros((2, rows, floats), jnp.float32), "current_index": jnp.int32(0)}


def test_replay_check_on_an_accelerator_and_on_shared_host_memory():
    gib = 2**30
    with pytest.raises(UsageError) as error_info:  # 2 x 2**28 rows x 3 float32s = 6 GiB on a 4 GiB device
        check_replay_fits(1000, replay_init(2**28), None, [FakeAccelerator(4 * gib)], new_rows=8)
    assert str(error_info.value) == (
        "--buffer-size (1000) needs 6.0 GiB of replay on each learner device; device "
        "cuda:0 has 4.0 GiB (XLA's memory limit on it): lower --buffer-size (about 666 "
        "fit) or use more learner devices"
    )
    check_replay_fits(1000, replay_init(2**28), None, [FakeAccelerator(8 * gib)], new_rows=8)  # fits
    # enough memory, but 2**31 rows: flashbax's int32 write index would overflow
    with pytest.raises(UsageError) as error_info:
        check_replay_fits(2**32, replay_init(2**31, floats=1), None, [FakeAccelerator(2**40)], new_rows=8)
    assert str(error_info.value) == (
        "--buffer-size (4294967296) makes replay arrays of 2147483648 rows on each "
        "learner device (+ 8 written per update); their indices are int32, at most "
        "2147483647: lower --buffer-size (about 4294967278 fit)"
    )
    # the CPU learner devices of a process share the host's memory: 2 shards of 3/4 of it do not fit
    cpus = jax.devices("cpu")[:2]
    rows = int(0.75 * host_memory_bytes() / (2 * 256 * 4))  # rows of 2 envs x 256 float32s
    with pytest.raises(
        UsageError,
        match=r"device cpu:0 has [\d,.]+ GiB \(the host's memory, [\d,.]+ GiB, shared by "
        r"this process's 2 CPU learner devices\): lower --buffer-size \(about \d+ "
        r"fit\)$",
    ):
        check_replay_fits(rows * 2, replay_init(rows, floats=256), None, cpus, new_rows=8)
    check_replay_fits(rows * 2, replay_init(rows, floats=256), None, cpus[:1], new_rows=8)  # one device: fits


# the layouts of Cleanba's README and ours (a0-l1): learner devices per process, processes
# (docs/usage.md#device-layouts)
LAYOUTS = {
    "a0-l0": ([0], 1),
    "a0-l1": ([1], 1),
    "a0-l0,1": ([0, 1], 1),
    "a0-l1,2": ([1, 2], 1),
    "a0-l1,2,3": ([1, 2, 3], 1),
    "a0-l1,2,3,4": ([1, 2, 3, 4], 1),
    "a0-l1,2,3,4,5,6": ([1, 2, 3, 4, 5, 6], 1),
    "a0-l1,2,3-d2": ([1, 2, 3], 2),
}
SEBULBA_SCRIPTS = [
    PPO_SCRIPT,
    IMPALA_SCRIPT,
    R2D2_SCRIPT,
    MUZERO_SCRIPT,
    MUJOCO_SCRIPT,
    ONPOLICY_SCRIPT,
    SAC_SCRIPT,
    PQN_SCRIPT,
]
# the scripts whose defaults every layout splits; the others keep a published batch or minibatch that no multiple of
# 3 learner devices splits, and the errors there name the values that work
STARTS_WITH_THE_DEFAULTS = {PPO_SCRIPT}
SUGGESTION = re.compile(
    r"error: (--[\w-]+) \(\d+\) must be divisible .* \(the nearest that work with the other flags: (\d+)"
)


@functools.cache
def spaces_of(env_id: str, overrides: tuple[str, ...]):
    return env_spaces(env_id, overrides)  # the function itself, before the test replaces it


def checks_before_training(script, flags: list[str], learner_device_ids: list[int], processes: int, monkeypatch):
    """What a run of `script` with `flags` checks before training, in one of `processes` processes whose learner
    devices are GPUs of 80 GiB (an H100's): the flags, the batch, the script's runtime values."""
    module = load_script(script)
    for reader in [envs, module]:  # each env id's spaces read once (envpool's spec of an Atari game takes ~0.5 s)
        monkeypatch.setattr(reader, "env_spaces", lambda env_id, overrides=(): spaces_of(env_id, tuple(overrides)))
    flags = [*flags, "--actor-device-ids", "0", "--learner-device-ids", *map(str, learner_device_ids)]
    args = getattr(module, "with_loss_defaults", lambda args: args)(parse_flags(module.Args, flags))
    module.validate_args(args)
    gpu = FakeAccelerator(80 * 2**30)
    layout = SimpleNamespace(
        actor_devices=[gpu],
        learner_devices=[gpu] * len(learner_device_ids),
        global_learner_devices=[gpu] * len(learner_device_ids) * processes,
    )
    derive_batch_values(args, world_size=processes, local_rank=0, **SebulbaRun.env_copies(args, layout))
    getattr(module, "check_runtime_values", getattr(module, "set_runtime_values", None))(args, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "script", SEBULBA_SCRIPTS, ids=lambda script: script.stem[len("cleanba_") :].split("_envpool")[0]
)
def test_each_readme_layout_starts_with_the_defaults_or_with_the_values_the_errors_name(script, layout, monkeypatch):
    """Cleanba's README layouts, with each Sebulba script's default flags: they pass the checks a run makes before
    training, or (a published batch that 3 devices cannot split) each error names the flag and values that pass it,
    and with those values they pass."""
    learner_device_ids, processes = LAYOUTS[layout]
    flags, errors = [], []
    for _ in range(3):
        try:
            checks_before_training(script, flags, learner_device_ids, processes, monkeypatch)
            break
        except UsageError as error:
            errors.append(f"error: {error}")
            match = SUGGESTION.match(errors[-1])
            assert match, errors[-1]  # a divisibility error that names values that work
            flags += [match.group(1), match.group(2)]
    else:
        pytest.fail(f"still refused after the errors' values: {errors}")
    assert bool(errors) == (script not in STARTS_WITH_THE_DEFAULTS and len(learner_device_ids) % 3 == 0), errors


def test_the_readme_names_the_scripts_whose_defaults_start_on_every_layout():
    """The README's Devices paragraph says whose defaults start on every layout: the scripts the test above finds."""
    devices = (REPO / "README.md").read_text().split("## Devices")[1]
    named = re.findall(r"`(cleanba_\w+\.py)`'s defaults start on every\s+layout", devices)
    assert sorted(named) == sorted(script.name for script in STARTS_WITH_THE_DEFAULTS)
