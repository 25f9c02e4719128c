"""cleanrl_utils alone: flags and the CLI entry, actor threads and queues, checkpoints, preemption, device layout,
logging, stage timers and episode statistics."""

import dataclasses
import os
import queue
import re
import signal
import tempfile
import threading
import time
import typing
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro
from conftest import IMPALA_SCRIPT, MUJOCO_SCRIPT, PPO_SCRIPT, PQN_SCRIPT, load_script, read_scalars

from cleanrl_utils import summary_writer
from cleanrl_utils.actors import ActorFailed, ActorThread, ActorThreads, RunStopped, queue_get
from cleanrl_utils.checkpoints import CheckpointError, Checkpoints, tree_digest
from cleanrl_utils.cli import run_cli
from cleanrl_utils.devices import device_layout, replicate
from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import (
    RunSetting,
    check_flags,
    computation_flags,
    nearest_that_work,
    settable_flags,
    suggestion,
)
from cleanrl_utils.logger import ACTOR_STAGES, EpisodeStats, RunLogger, StageTimer
from cleanrl_utils.preemption import Preemption

RUNTIME_VALUES = ["local_batch_size", "batch_size", "num_updates", "world_size", "local_rank"]


@dataclass
class TinyArgs:
    """The flags the shared modules read, as a script declares them."""

    seed: int = 1
    hiddens: list[int] = field(default_factory=lambda: [8])
    run_name: str | None = "run"
    resume: RunSetting[bool] = False
    checkpoint_dir: RunSetting[str | None] = None
    checkpoint_keep: RunSetting[int] = 2
    track: RunSetting[bool] = False
    log_frequency: RunSetting[int] = 2
    batch_size: int = field(init=False, default=4)
    num_updates: int = field(init=False, default=3)
    local_batch_size: int = field(init=False, default=4)


@pytest.mark.parametrize(
    "script", [PPO_SCRIPT, IMPALA_SCRIPT, MUJOCO_SCRIPT, PQN_SCRIPT], ids=["ppo", "impala", "mujoco", "pqn"]
)
def test_runtime_values_are_not_flags(script, capsys):
    module = load_script(script)
    with pytest.raises(SystemExit):
        tyro.cli(module.Args, args=["--help"])
    help_text = capsys.readouterr().out
    for name in RUNTIME_VALUES:
        assert f"--{name.replace('_', '-')} " not in help_text, name
        with pytest.raises(SystemExit):  # not settable
            tyro.cli(module.Args, args=[f"--{name.replace('_', '-')}", "3"])
    flags = settable_flags(module.Args())
    assert not set(RUNTIME_VALUES) & flags.keys() and {"seed", "env_id", "learning_rate"} <= flags.keys()
    # where and how a run runs may change on resume; what it computes may not (declared on each flag)
    assert {"track", "learner_device_ids", "checkpoint_dir", "log_frequency"} <= flags.keys() - computation_flags(
        module.Args()
    ).keys()
    assert {"seed", "env_id", "learning_rate", "total_timesteps", "gamma"} <= computation_flags(module.Args()).keys()


def test_check_flags_names_the_flag_and_what_is_allowed():
    @dataclass
    class Flags:
        n: int = 1
        lr: float = 1.0
        gamma: float = 0.5
        ids: list[int] = field(default_factory=lambda: [0])

    cases = [
        ({"n": 0}, "--n must be a positive integer, got 0"),
        ({"lr": float("nan")}, "--lr must be positive and finite"),
        ({"lr": float("inf")}, "--lr must be positive and finite"),
        ({"gamma": 1.5}, "--gamma must be in [0, 1]"),
        ({"ids": [1, 1]}, "--ids must be one or more distinct device ids in [0, 63]"),
    ]
    for values, message in cases:
        with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_flags(
                Flags(**values), positive_ints=["n"], positive=["lr"], unit_interval=["gamma"], device_id_lists=["ids"]
            )
    check_flags(Flags(), positive_ints=["n"], positive=["lr"], unit_interval=["gamma"], device_id_lists=["ids"])


def test_an_error_suggests_the_nearest_multiples_that_work():
    assert nearest_that_work(64, 3) == [63, 66]
    assert nearest_that_work(2, 3) == [3]  # no positive multiple below
    assert nearest_that_work(64, 3, lambda envs: envs % 32 == 0) == [96]  # R2D2's whole gradient steps on 3 devices
    assert nearest_that_work(64, 3, lambda envs: False) == [] and suggestion([]) == ""
    assert suggestion([63, 66]) == " (the nearest that work with the other flags: 63 or 66)"


def test_run_cli_turns_a_usage_error_into_one_line_and_exit_code_2(capsys):
    def main(args):
        raise UsageError("--hiddens must be one or more positive integers, got []")

    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, TinyArgs, [])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --hiddens must be one or more positive integers, got []\n"
    assert run_cli(lambda args: args.seed, TinyArgs, ["--seed", "5"]) == 5


@dataclass
class ChoiceArgs:
    core: typing.Literal["lstm", "gru"] = "lstm"
    """the recurrent core"""
    n: int = 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--core", "rnn"], "invalid choice 'rnn' for argument '--core'. Expected one of ('lstm', 'gru')."),
        (["--n", "x"], "Error parsing --n: invalid literal for int() with base 10: 'x'"),
        (["--no-such-flag", "3"], "Unrecognized options: --no-such-flag, 3"),
    ],
    ids=["choice", "value", "unknown flag"],
)
def test_a_parse_error_is_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda args: 0, ChoiceArgs, argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: {message} (see --help)\n"
    assert run_cli(lambda args: args.core, ChoiceArgs, ["--core", "gru"]) == "gru"


def test_queue_wait_ends_when_the_run_stops():
    stop_event = threading.Event()
    threading.Timer(0.2, stop_event.set).start()
    start = time.time()
    with pytest.raises(RunStopped):
        queue_get(queue.Queue(), stop_event, timeout=0.05)
    assert time.time() - start < 2


def test_actor_failure_stops_the_run_and_is_raised_with_its_cause():
    stop_event = threading.Event()
    actors = ActorThreads(stop_event)

    def failing(message):
        raise ValueError(message)

    def waiting(q):
        queue_get(q, stop_event, timeout=0.05)  # ends with RunStopped once the other thread fails

    actors.start(waiting, name="actor-0", q=queue.Queue())
    actors.start(failing, name="actor-1", message="env exploded")
    assert stop_event.wait(5)
    with pytest.raises(ActorFailed) as error_info:
        actors.check()
    assert isinstance(error_info.value.__cause__, ValueError) and "env exploded" in str(error_info.value)
    assert actors.stop() == []  # both threads ended


def test_a_thread_that_never_stops_is_named():
    release = threading.Event()
    actors = ActorThreads(threading.Event(), join_timeout=0.2)
    actors.start(release.wait, name="actor-stuck")  # ignores the stop event, like a thread stuck in C++
    try:
        assert actors.stop() == ["actor-stuck"]
    finally:
        release.set()


def checkpoints_of(args) -> Checkpoints:
    """What cleanrl_utils.run makes of the flags (tests/test_checkpoint.py uses it too)."""
    return Checkpoints(
        args.checkpoint_dir or f"runs/{args.run_name}/checkpoints", keep=args.checkpoint_keep, world_size=1
    )


def save_values(args, update: int = 1) -> dict:
    return {"global_step": args.batch_size * update, "flags": settable_flags(args)}


def restore_values(args) -> dict:
    return {"batch_size": args.batch_size, "flags": computation_flags(args), "resume": args.resume}


def make_state(seed: int):
    return {"params": {"w": jnp.arange(6.0).reshape(2, 3) * seed}, "key": jax.random.key(seed)}


def test_checkpoint_round_trip_with_keys_and_digests(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = TinyArgs()
    checkpoints = Checkpoints("runs/run/checkpoints", keep=2, world_size=1)
    mesh = device_layout(dataclasses.replace(_layout_args(), learner_device_ids=[0])).mesh
    state = {"params": replicate(make_state(2)["params"], mesh), "key": jax.random.key(2)}
    checkpoints.save(3, state, **save_values(args, 3), summary=f"params sha256={tree_digest(state['params'])}")
    assert (tmp_path / "runs/run/checkpoints/3").is_dir()
    template = {"params": replicate(make_state(0)["params"], mesh), "key": jax.random.key(0)}
    restored, update = checkpoints_of(args).restore(template, **restore_values(args), summary=lambda s: "ok")
    assert update == 3 and tree_digest(restored["params"]) == tree_digest(state["params"])
    assert jax.random.key_data(restored["key"]).tolist() == jax.random.key_data(state["key"]).tolist()
    out = capsys.readouterr().out
    assert "checkpoint saved: update=3 global_step=12 params sha256=" in out
    assert "resumed from checkpoint: update=3 global_step=12 ok" in out

    # a computation flag that differs is refused; a RunSetting flag may change
    with pytest.raises(CheckpointError, match=r"was made with --hiddens \[8\], this run has \[16\]"):
        checkpoints_of(args).restore(template, **restore_values(dataclasses.replace(args, hiddens=[16])), summary=str)
    checkpoints_of(args).restore(
        template, **restore_values(dataclasses.replace(args, track=True, log_frequency=7)), summary=str
    )
    other_batch = dataclasses.replace(args)
    other_batch.batch_size = 8
    with pytest.raises(CheckpointError, match="was made with 4 steps per update, this run has 8"):
        checkpoints_of(args).restore(template, **restore_values(other_batch), summary=str)


def test_a_checkpoint_round_trips_arrays_of_zero_size(tmp_path, monkeypatch):
    """MJX's state (the continuous Anakin script's envs) has fields of zero size, which orbax refuses: they are saved as
    placeholders and restored from the template, with the shapes and the digest of the state as saved."""
    monkeypatch.chdir(tmp_path)
    args = TinyArgs()
    checkpoints = Checkpoints("runs/run/checkpoints", keep=2, world_size=1)
    state = {"act": np.zeros((8, 0), np.float32), "qpos": np.arange(16, dtype=np.float32).reshape(8, 2)}
    checkpoints.save(3, state, **save_values(args, 3), summary="")
    template = {"act": np.zeros((8, 0), np.float32), "qpos": np.zeros((8, 2), np.float32)}
    restored, update = checkpoints_of(args).restore(template, **restore_values(args), summary=lambda s: "ok")
    assert update == 3 and restored["act"].shape == (8, 0) and restored["act"].dtype == np.float32
    np.testing.assert_array_equal(restored["qpos"], state["qpos"])


def test_resume_without_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state, update = checkpoints_of(TinyArgs()).restore({"x": np.zeros(2)}, **restore_values(TinyArgs()), summary=str)
    assert update == 0 and state["x"].tolist() == [0, 0]
    with pytest.raises(UsageError, match="^--resume: runs/run/checkpoints has no complete checkpoint$"):
        checkpoints_of(TinyArgs()).restore(
            {"x": np.zeros(2)}, **restore_values(dataclasses.replace(TinyArgs(), resume=True)), summary=str
        )


def test_a_flag_added_later_keeps_old_checkpoints_usable(tmp_path, monkeypatch):
    """Flags are declared once: a new RunSetting flag does not make older checkpoints refuse to resume."""
    monkeypatch.chdir(tmp_path)
    checkpoints_of(TinyArgs()).save(1, {"x": np.ones(2)}, **save_values(TinyArgs()), summary="")

    @dataclass
    class NewerArgs(TinyArgs):
        new_logging_option: RunSetting[int] = 5

    state, update = checkpoints_of(NewerArgs()).restore({"x": np.zeros(2)}, **restore_values(NewerArgs()), summary=str)
    assert update == 1 and state["x"].tolist() == [1, 1]


def test_preemption_alone_stops_now_and_exits_with_the_shells_code():
    """Slurm sends SIGTERM, SIGCONT and SIGTERM within milliseconds (srun uv run forwards one more): every SIGTERM
    keeps the stop graceful, so the stop checkpoint is written; a person's second Ctrl-C interrupts at once."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop_event = threading.Event()
        preemption = Preemption(1, stop_event)
        assert not preemption.requested() and preemption.exit_code == 0 and preemption.stop_signal is None
        for sig in [signal.SIGTERM, signal.SIGCONT, signal.SIGTERM, signal.SIGTERM]:
            signal.raise_signal(sig)  # the process survives each of them
        assert stop_event.is_set() and preemption.requested()
        assert preemption.stop_signal == signal.SIGTERM and preemption.exit_code == 143
        assert signal.getsignal(signal.SIGTERM) == preemption._on_signal
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        assert preemption.stop_signal == signal.SIGTERM  # the first signal names the stop
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class KeyValueStore:
    """A stand-in for JAX's coordination service client: its key-value store, filled by every process."""

    def __init__(self, entries: dict[str, str]):
        self.entries = dict(entries)

    def key_value_set(self, key: str, value: str):
        self.entries[key] = value

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        return self.entries[key]


@pytest.mark.parametrize(
    "peer, own, error",
    [
        ("node1 10.0.0.11", "127.0.1.1", "host node2's own name resolves to 127.0.1.1, a loopback address"),
        ("node1 10.0.0.11", None, "host node2's own name does not resolve"),
        ("node1 ::1", "10.0.0.12", "host node1's own name resolves to ::1, a loopback address"),
        ("node1 10.0.0.11", "10.0.0.12", None),
        ("node2 127.0.1.1", "127.0.1.1", None),  # one host: its processes reach each other on loopback
    ],
)
def test_a_host_whose_own_name_resolves_to_loopback_is_one_line_naming_it(peer, own, error, monkeypatch):
    """Process 1 on node2 reads process 0's entry (host, address) and writes its own (`own`): with two hosts, one
    that resolves its own name to a loopback address or to nothing is a UsageError naming the host and the fix."""
    from jax._src import distributed

    from cleanrl_utils import processes

    store = KeyValueStore({"cleanba/address/0": peer})
    monkeypatch.setattr(distributed.global_state, "client", store)
    monkeypatch.setattr(distributed.global_state, "process_id", 1)
    monkeypatch.setattr(distributed.global_state, "num_processes", 2)
    monkeypatch.setattr(processes.socket, "gethostname", lambda: "node2")
    monkeypatch.setattr(processes, "own_address", lambda host: own)
    if error is None:
        processes.check_own_addresses(timeout=1)
        return
    with pytest.raises(UsageError) as raised:
        processes.check_own_addresses(timeout=1)
    host = re.search(r"host (\w+)", error).group(1)
    assert str(raised.value).startswith(f"--distributed: {error}") and f"Map {host} to its network address" in str(
        raised.value
    )
    assert store.entries["cleanba/address/1"] == f"node2 {own}"


@pytest.mark.parametrize("user_ids", [None, "0"], ids=["flags", "JAX_LOCAL_DEVICE_IDS"])
def test_under_slurm_each_process_sees_every_gpu_its_device_flags_name(user_ids, monkeypatch):
    """srun's task 3 of 4 (the second on its node): JAX alone would make GPU SLURM_LOCALID = 1 its only device
    (one process per GPU), so the docs' a0-l1,2,3 layout could not start; the arguments start_distributed gives
    jax.distributed.initialize keep GPUs 0-3 of the task, and JAX's own Slurm detection fills in the rest."""
    from jax._src.clusters import ClusterEnv

    from cleanrl_utils import processes

    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_NODES": "2",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS", raising=False)
    if user_ids is not None:
        monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", user_ids)
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(processes, "mark_distributed", lambda started: None)
    monkeypatch.setattr(processes, "check_own_addresses", lambda timeout: None)
    args = dataclasses.replace(_layout_args(), learner_device_ids=[1, 2, 3])
    args.coordinator_address, args.num_processes, args.process_id, args.heartbeat_timeout = None, None, None, 30
    processes.start_distributed(args)
    ((positional, keywords),) = calls
    ids = keywords["local_device_ids"]
    if user_ids is not None:
        assert ids is None  # the user's JAX_LOCAL_DEVICE_IDS, read by jax.distributed.initialize itself
        return
    assert ids == [0, 1, 2, 3]
    # what jax.distributed.initialize does with them under these variables, and without them
    detected = ClusterEnv.auto_detect_unset_distributed_params(*positional, ids, None, None)
    port = 4242 % 4096 + 65535 - 4096 + 1  # JAX's default; cleanba.slurm_template sets JAX_COORDINATOR_PORT
    assert detected == (f"gpu07:{port}", 4, 3, [0, 1, 2, 3])
    assert ClusterEnv.auto_detect_unset_distributed_params(*positional, None, None, None)[3] == [1]
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "40123")
    assert ClusterEnv.auto_detect_unset_distributed_params(*positional, ids, None, None)[0] == "gpu07:40123"


def _layout_args():
    @dataclass
    class LayoutArgs:
        actor_device_ids: list[int] = field(default_factory=lambda: [0])
        learner_device_ids: list[int] = field(default_factory=lambda: [1, 2])
        distributed: bool = False

    return LayoutArgs()


def test_device_layout_and_out_of_range_ids():
    layout = device_layout(_layout_args())  # conftest arranges 4 host devices
    assert layout.world_size == 1 and layout.is_main_process
    assert [d.id for d in layout.learner_devices] == [1, 2] == [d.id for d in layout.global_learner_devices]
    assert layout.mesh.shape == {"batch": 2}
    with pytest.raises(UsageError, match=r"--learner-device-ids \[0, 7\] out of range: this process has 4 cpu device"):
        device_layout(dataclasses.replace(_layout_args(), learner_device_ids=[0, 7]))


def test_stage_timer_sums_each_stage_since_the_last_read(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 11.25, 12.0, 14.0])
    monkeypatch.setattr(time, "time", lambda: next(clock))
    timer = StageTimer()
    with timer("rollout_time"):  # 10.0 .. 14.0, around the two below
        with timer("inference_time"):  # 10.5 .. 11.0
            pass
        with timer("inference_time"):  # 11.25 .. 12.0
            pass
    assert timer.read() == {**dict.fromkeys(ACTOR_STAGES, 0.0), "rollout_time": 4.0, "inference_time": 1.25}
    assert timer.read() == dict.fromkeys(ACTOR_STAGES, 0.0)  # read starts again from 0
    with pytest.raises(KeyError):  # a stage the logger does not know is an error at once
        timer("inference")


def test_episode_stats_against_a_plain_loop():
    """Unclipped returns of whole games (info["terminated"], info["reward"]), envpool's reset step not counted."""
    rng = np.random.default_rng(0)
    num_envs, steps = 3, 200
    stats = EpisodeStats(num_envs)
    expected_returns, expected_lengths = [np.nan] * num_envs, [np.nan] * num_envs
    running_return, running_length = [0.0] * num_envs, [0] * num_envs
    for _ in range(steps):
        clipped, unclipped = rng.choice([-1.0, 1.0], num_envs), rng.normal(size=num_envs) * 10
        life_lost, game_over, truncated = rng.random((3, num_envs)) < [[0.1], [0.05], [0.02]]
        counted = rng.random(num_envs) < 0.9
        stats.step(
            clipped, life_lost | game_over, truncated, {"reward": unclipped, "terminated": game_over}, counted=counted
        )
        for env in range(num_envs):
            running_return[env] += unclipped[env]
            running_length[env] += int(counted[env])
            if game_over[env] or truncated[env]:
                expected_returns[env], expected_lengths[env] = running_return[env], running_length[env]
                running_return[env], running_length[env] = 0.0, 0
    read = stats.read()
    np.testing.assert_allclose(read["returned_episode_returns"], expected_returns)
    np.testing.assert_array_equal(read["returned_episode_lengths"], expected_lengths)
    # without Atari's info keys: the env's own reward and ends
    plain = EpisodeStats(1)
    plain.step(np.array([2.0]), np.array([False]), np.array([False]), {}, counted=np.array([True]))
    plain.step(np.array([3.0]), np.array([True]), np.array([False]), {}, counted=np.array([True]))
    assert {name: values.tolist() for name, values in plain.read().items()} == {
        "returned_episode_returns": [5.0],
        "returned_episode_lengths": [2.0],
    }
    # env 0's first episode began in the warm-up (cleanrl_utils/envs.py): its end is not a finished episode's
    warmed, ones = EpisodeStats(2, begun_before=np.array([True, False])), np.ones(2, bool)
    warmed.step(np.array([1.0, 1.0]), ones, ~ones, {}, counted=ones)
    np.testing.assert_array_equal(warmed.read()["returned_episode_returns"], [np.nan, 1.0])
    warmed.step(np.array([2.0, 2.0]), ~ones, ~ones, {}, counted=ones)
    warmed.step(np.array([3.0, 3.0]), ones, ~ones, {}, counted=ones)
    np.testing.assert_array_equal(warmed.read()["returned_episode_returns"], [5.0, 5.0])


def test_actor_thread_seeds_keys_and_splits_for_the_learner_devices():
    devices = jax.devices()[:2]
    thread = ActorThread(
        index=1,
        global_index=5,
        device=devices[0],
        learner_devices=devices,
        start_update=0,
        envpool_threads=1,
        stop_event=threading.Event(),
        queue_timeout=0.05,
    )
    assert thread.env_seed(1, num_envs=4) - ActorThread(**{**thread.__dict__, "global_index": 4}).env_seed(1, 4) == 4
    assert thread.key(jax.random.key(0)).devices() == {devices[0]}
    thread.stop_event.set()
    with pytest.raises(RunStopped):
        thread.get(queue.Queue())
    with pytest.raises(RunStopped):
        thread.check_stopped()


@pytest.mark.parametrize("learner_device_ids", [[1, 3], [3, 1]])
def test_the_data_path_puts_each_env_where_its_docstring_says(learner_device_ids):
    """cleanrl_utils/data_path.py: with T threads of E envs and L learner devices, env e of thread t is at global env
    index ((p L + l) T + t) E/L + e - l E/L (l = e // (E/L), process p = 0), and learner device l holds the global
    envs [l T E/L, (l + 1) T E/L); the mesh takes the learner devices in the order of their ids."""
    from cleanrl_utils.data_path import assemble_global_rollout, layout_lines, learner_mesh, split_for_learners

    mesh, learner_devices = learner_mesh(learner_device_ids)
    assert learner_devices == list(mesh.devices.flat) == [jax.devices()[1], jax.devices()[3]]
    num_threads, num_envs, num_learners = 3, 4, 2
    per_learner = num_envs // num_learners
    # each thread's rollout: (time 2, envs E, 1) holding 100 t + e
    rollouts = [{"env": np.tile((100 * t + np.arange(num_envs))[None, :, None], (2, 1, 1))} for t in range(3)]
    parts = [split_for_learners(rollout, learner_devices) for rollout in rollouts]
    assert [part["env"].devices() for part in parts[0]] == [{device} for device in learner_devices]
    global_rollout = assemble_global_rollout(parts, mesh, num_threads * num_envs)
    expected = np.empty(num_threads * num_envs)
    for t in range(num_threads):
        for e in range(num_envs):
            learner = e // per_learner
            expected[(learner * num_threads + t) * per_learner + e - learner * per_learner] = 100 * t + e
    np.testing.assert_array_equal(np.asarray(global_rollout["env"])[0, :, 0], expected)
    for learner, shard in enumerate(sorted(global_rollout["env"].addressable_shards, key=lambda x: x.index[1].start)):
        assert shard.device == learner_devices[learner]
        np.testing.assert_array_equal(np.asarray(shard.data)[0, :, 0], np.split(expected, num_learners)[learner])
    # the start-up lines say the same: each thread's env slice, its learner device and its global envs
    thread_devices = [jax.devices()[0]] * num_threads
    lines = layout_lines(mesh=mesh, learner_devices=learner_devices, thread_devices=thread_devices, local_num_envs=4)
    assert lines[0] == "learner mesh (axis batch, in order): cpu:1, cpu:3"
    values = np.asarray(global_rollout["env"])[0, :, 0]
    for t, line in enumerate(lines[1:]):
        assert line.startswith(f"process 0 actor thread {t} on cpu:0: ")
        for local, device, first, last in re.findall(r"envs (\d+)-\d+ -> (cpu:\d) \(global (\d+)-(\d+)\)", line):
            np.testing.assert_array_equal(values[int(first) : int(last) + 1], 100 * t + int(local) + np.arange(2))
            assert device == f"cpu:{learner_devices[int(local) // per_learner].id}"


@pytest.mark.parametrize("learner_device_ids", [[1, 3], [3, 1]])
def test_the_anakin_layout_lines_say_where_the_envs_array_puts_each_env(learner_device_ids):
    """An Anakin run's start-up lines: the mesh in order, then each learner device's envs at the global indices where
    the envs array, env axis sharded over the mesh as the scripts' reset_envs lays it out, holds them."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cleanrl_utils.data_path import anakin_layout_lines, learner_mesh

    mesh, _ = learner_mesh(learner_device_ids)
    envs = jax.device_put(np.arange(3 * mesh.size), NamedSharding(mesh, P("batch")))
    lines = anakin_layout_lines(mesh=mesh, local_num_envs=3)
    assert lines == [
        "learner mesh (axis batch, in order): cpu:1, cpu:3",
        "process 0 learner device cpu:1: envs 0-2 (global 0-2)",
        "process 0 learner device cpu:3: envs 0-2 (global 3-5)",
    ]
    for line in lines[1:]:
        device, first, last = re.search(r"device (cpu:\d): envs 0-2 \(global (\d+)-(\d+)\)", line).groups()
        shard = next(shard for shard in envs.addressable_shards if f"cpu:{shard.device.id}" == device)
        np.testing.assert_array_equal(np.asarray(shard.data), np.arange(int(first), int(last) + 1))


def test_logger_writes_every_update_and_prints_every_log_frequency(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    logger = RunLogger(
        "run",
        config=dataclasses.asdict(TinyArgs()),
        batch_size=4,
        local_batch_size=4,
        num_updates=3,
        log_frequency=2,
        wandb_project=None,
        wandb_entity=None,
        is_main_process=True,
        world_size=1,
        start_update=0,
    )
    stats = {
        "returned_episode_returns": np.array([1.0, np.nan]),
        "returned_episode_lengths": np.array([3.0, np.nan]),
        **{
            name: 0.25
            for name in (
                "params_queue_get_time rollout_time inference_time env_step_time storage_time rollout_queue_put_time"
            ).split()
        },
    }
    for update in [1, 2, 3]:
        logger.log_update(
            update,
            {
                "losses/loss": float(update),
                "stats/actor_policy_version": update - 1,
                "stats/learner_policy_version": update - 1,
            },
            [stats],
        )
    logger.flush()  # on disk before a checkpoint would count
    scalars = read_scalars(tmp_path / "runs" / "run")
    assert [step for step, _ in scalars["losses/loss"]] == [4, 8, 12]  # global steps of updates 1..3
    assert [v for _, v in scalars["charts/avg_episodic_return"]] == [1.0] * 3
    assert scalars["stats/rollout_time"][0][1] == 0.25 and scalars["stats/peak_rss_mib"][0][1] > 0
    logger.finish()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["update=2/3", "update=3/3"]  # every 2nd update and the last
    assert "avg_episodic_return=1.00 actor_policy_version=1 learner_policy_version=1" in lines[0]


def event_file(path, steps: dict[int, dict]):
    """An event file named `path`, written by the project's writer: at each step, its scalars."""
    with tempfile.TemporaryDirectory() as scratch:
        writer = summary_writer.SummaryWriter(scratch, use_wandb=False, resume_step=0)
        for step, scalars in steps.items():
            writer.add_scalars(scalars, step)
        writer.close()
        os.replace(writer.path, path)


# a second writer's event file, by where its name sorts among the run's own (events.out.tfevents.1000000100...)
SECOND_WRITER = {
    "sorts first": "events.out.tfevents.0000000001.tool",
    "sorts between": "events.out.tfevents.1000000150.tool",
    "sorts last": "events.out.tfevents.9999999999.tool",  # after the next run's own file too
    "named like the rewrite": "events.out.tfevents.1000000100.host.1.0.rewrite1",
}


@pytest.mark.parametrize("generation", [1, 2])
@pytest.mark.parametrize("second_writer", SECOND_WRITER)
def test_a_kill_at_any_point_of_the_event_rewrite_keeps_every_files_steps_once(
    tmp_path, monkeypatch, second_writer, generation
):
    """A resumed run rewrites its folder's event files (its own and a second writer's, which logged another tag at
    the same steps) and is killed at each file operation of the rewrite in turn, then at none; the next start
    (a new writer) keeps every file's values up to the checkpoint's step, each step of each tag once."""

    class Killed(BaseException):
        pass

    for kill_at in range(1, 100):
        folder = tmp_path / str(kill_at)
        folder.mkdir()
        event_file(
            folder / "events.out.tfevents.1000000100.host.1.0",  # updates 1..7, checkpoint 6
            {step: {"losses/loss": step} for step in range(1, 8)},
        )
        event_file(
            folder / SECOND_WRITER[second_writer],  # steps 1..3, and losses/loss at step 2 again
            {1: {"eval/return": 1}, 2: {"eval/return": 2, "losses/loss": 200}, 3: {"eval/return": 3}},
        )
        resume_step = 6
        if generation == 2:  # resumed at 6 (the files rewritten once), updates 7..9, checkpoint 8
            summary_writer.rewrite_events(str(folder), resume_step)
            event_file(
                folder / "events.out.tfevents.1000000200.host.2.0",
                {step: {"losses/loss": step} for step in range(7, 10)},
            )
            resume_step = 8
        operations = [0]

        def killing(operation, operations=operations, kill_at=kill_at):
            def killed_at_the_kth_call(*args, **kwargs):
                operations[0] += 1
                if operations[0] == kill_at:
                    raise Killed
                return operation(*args, **kwargs)

            return killed_at_the_kth_call

        with monkeypatch.context() as patch:
            for name in ["fsync", "replace", "remove"]:
                patch.setattr(os, name, killing(getattr(os, name)))
            try:
                summary_writer.rewrite_events(str(folder), resume_step)  # the resumed run's start
                killed = False
            except Killed:
                killed = True
        writer = summary_writer.SummaryWriter(str(folder), use_wandb=False, resume_step=resume_step)  # the next start
        writer.add_scalars({"losses/loss": resume_step + 1}, resume_step + 1)
        writer.close()
        # at step 2 the newest file's losses/loss (by name: TensorBoard's order too)
        newest_at_2 = 2 if second_writer == "sorts first" else 200
        assert read_scalars(folder) == {
            "losses/loss": [(step, newest_at_2 if step == 2 else step) for step in range(1, resume_step + 2)],
            "eval/return": [(1, 1), (2, 2), (3, 3)],
        }, (kill_at, sorted(p.name for p in folder.iterdir()))
        if not killed:
            break
    assert kill_at > 6  # the temporary file, the journal, the rename and each removal were crash points


def test_library_modules_import_no_cycle_exit_in_one_place_and_change_nothing_at_import():
    import ast
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "cleanrl_utils"
    modules = {path: ".".join(path.relative_to(package.parent).with_suffix("").parts) for path in package.rglob("*.py")}
    imports = {}  # module -> the package's modules it imports, at module level or inside a function
    for path, name in modules.items():
        tree = ast.parse(path.read_text())
        imports[name] = {
            node.module if node.module != "cleanrl_utils" else f"cleanrl_utils.{alias.name}"  # from the package
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cleanrl_utils")
            for alias in node.names
        } | {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("cleanrl_utils")
        }
        exits = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "_exit"]
        # processes.exit_process ends a distributed process (the cli's error path and a start-up watchdog call it)
        assert not exits or name == "cleanrl_utils.processes", f"{name} calls os._exit at lines {exits}"

    def visit(name, path):
        assert name not in path, f"import cycle: {' -> '.join([*path, name])}"
        for imported in imports.get(name, ()):
            visit(imported, [*path, name])

    for name in imports:
        visit(name, [])
    # importing every module changes no environment variable (the third-party libraries they import are loaded
    # first: envpool sets a few of its own) and starts no JAX backend
    code = (
        "import os, envpool, gymnasium, numpy, tyro; before = dict(os.environ); import "
        + ", ".join(sorted(modules.values()))
        + "; assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items());"
        " import jax._src.xla_bridge as xb; assert not xb._backends, xb._backends"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr


@pytest.mark.parametrize(
    "variables,job_id",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "41"}, "41"),
        ({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "42", "SLURM_ARRAY_TASK_ID": "1"}, "42_1"),
        ({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "42"}, "43"),  # no task id: the job itself, never 42_None
    ],
)
def test_the_slurm_job_id_is_what_scontrol_requeue_takes(variables, job_id, monkeypatch):
    """One Slurm job id for every line that names it (the preemption line, a silent peer's line)."""
    from cleanrl_utils.processes import slurm_job_id

    for name in ["SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert slurm_job_id() == job_id
