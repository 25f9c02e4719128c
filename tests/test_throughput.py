"""benchmark/throughput.py: every stage is measured on the script's own functions and the table adds up; the
environment ceiling and benchmark/gpu.sh's sections, on the CPU with tiny settings."""

import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import IMPALA_SCRIPT, PPO_SCRIPT, REPO, RESUMED, SAVED, TINY_BREAKOUT, read_scalars, script_env

from cleanrl_utils.errors import UsageError

TINY_CARTPOLE = (
    "--env-id CartPole-v1 --local-num-envs 4 --num-steps 16 --hiddens 8 --num-actor-threads 1 "
    "--num-minibatches 2 --actor-device-ids 0 --learner-device-ids 1"
).split()


def throughput(harness_flags: list[str], script_flags: list[str], workdir) -> subprocess.CompletedProcess:
    """benchmark/throughput.py as a user runs it, from `workdir`."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "throughput.py"), *harness_flags, "--", *script_flags],
        cwd=workdir,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("script", [PPO_SCRIPT, IMPALA_SCRIPT], ids=["ppo", "impala"])
def test_stage_table_and_json(script, workdir):
    """Every stage and the full run of a CartPole config; then the learner alone (--stages learner) of the Nature CNN
    in bfloat16 on Breakout, and the markdown table of both with the learner's microseconds per sample."""
    results_file = workdir / "results.jsonl"
    # the script as a relative path, as users give it (the full runs start in a temporary folder)
    harness = ["--script", os.path.relpath(script, workdir), "--repeats", "2", "--stage-rollouts", "1"]
    full = ["--full-repeats", "1", "--full-updates", "12", "--warmup-updates", "2", "--json", str(results_file)]
    completed = throughput([*harness, *full], TINY_CARTPOLE, workdir)
    assert completed.returncode == 0, completed.stderr
    for row in [
        "env (random actions)",
        "inference (actor device)",
        "learner (one update)",
        "actor thread alone",
        "serial ceiling",
        "full script (steady state)",
        "overlapped ceiling",
        "peak RSS",
    ]:
        assert row in completed.stdout
    results = json.loads(results_file.read_text())
    rates = {stage: results[stage]["median"] for stage in ["env", "inference", "learner", "actor", "full"]}
    assert all(rate > 0 for rate in rates.values()), rates
    for stage in ["env", "inference", "learner", "actor"]:
        assert results[stage]["n"] == 2 and results[stage]["min"] <= rates[stage] <= results[stage]["max"]
    # the serial ceiling is the harmonic combination of the three stages, below each of them
    assert results["serial_ceiling"] == pytest.approx(1 / sum(1 / rates[s] for s in ["env", "inference", "learner"]))
    assert results["serial_ceiling"] < min(rates["env"], rates["inference"], rates["learner"])
    assert results["overlapped_ceiling"] == min(rates["env"], rates["inference"], rates["learner"])
    assert results["fraction_of_serial_ceiling"] == pytest.approx(rates["full"] / results["serial_ceiling"])
    assert 0 < results["full"]["peak_rss_mib_update_10"] <= results["full"]["peak_rss_mib_last"]

    learner_alone = throughput(
        [*harness, "--stages", "learner", "--json", str(results_file)],
        [*TINY_BREAKOUT, "--network", "nature", "--compute-dtype", "bfloat16", "--num-actor-threads", "1"],
        workdir,
    )
    assert learner_alone.returncode == 0, learner_alone.stderr
    assert "learner (one update)" in learner_alone.stdout and "env (random actions)" not in learner_alone.stdout
    learner = json.loads(results_file.read_text().splitlines()[1])
    assert learner.keys() == {"script", "args", "learner"} and learner["learner"]["n"] == 2
    table = throughput(["--summarize", str(results_file)], [], workdir)
    assert table.returncode == 0, table.stderr
    header, _, *rows = table.stdout.splitlines()
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    cartpole, breakout = (dict(zip(columns, (cell.strip() for cell in row.strip("|").split("|")))) for row in rows)
    assert cartpole["learner us/sample"] == f"{1e6 / results['learner']['median']:,.1f}"
    assert cartpole["full"] == f"{results['full']['median']:,.0f}"
    assert breakout["learner us/sample"] == f"{1e6 / learner['learner']['median']:,.1f}"
    assert "--network nature --compute-dtype bfloat16" in breakout["config"]
    assert {breakout[column] for column in ["env", "inference", "full", "peak RSS (MiB)"]} == {"-"}


def test_bad_script_flags_fail_with_the_scripts_message(workdir):
    completed = throughput([], [*TINY_CARTPOLE, "--num-minibatches", "3"], workdir)
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines()[-1].startswith("error: --num-minibatches")


def test_env_ceiling_steps_every_pool_and_writes_json(workdir):
    results_file = workdir / "ceiling.jsonl"
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmark" / "env_ceiling.py"),
            "--env-id",
            "CartPole-v1",
            "--num-envs",
            "4",
            "--pools",
            "2",
            "--steps",
            "200",
            "--json",
            str(results_file),
        ],
        cwd=workdir,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    result = json.loads(results_file.read_text())
    assert (result["env_id"], result["pools"], result["num_envs"], result["steps"]) == ("CartPole-v1", 2, 4, 200)
    assert result["sps"] > 0 and result["envpool_threads"] >= 1
    assert f"{result['sps']:,.0f} env steps/s" in completed.stdout


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--pools", "2", "0"], "error: --pools must be positive (got [2, 0])"),
        (["--envpool-threads", "-1"], "error: --envpool-threads must be non-negative (got [-1])"),
        (["--seconds", "-1"], "error: --seconds must be non-negative and finite (got -1.0)"),
    ],
)
def test_env_ceiling_refuses_a_bad_flag_in_one_line(flags, error, workdir):
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "env_ceiling.py"), *flags],
        cwd=workdir,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (completed.returncode, completed.stderr.strip()) == (2, error)


def test_gpu_benchmarks_learner_and_sync_sections_give_the_scripts_flags_they_take(workdir):
    """The learner and sync sections' runs (Breakout at the defaults: GPU-sized) as commands only (PY=echo), started
    from a folder outside the repository: each names throughput.py and a script, both found from that folder, whose
    flags parse and pass its checks, every network, dtype and sync setting."""
    from cleanrl_utils.cli import parse_flags
    from cleanrl_utils.evals.evaluate import load_script

    completed = subprocess.run(
        ["bash", str(REPO / "benchmark" / "gpu.sh"), "out", "learner", "sync"],
        cwd=workdir,
        env={**script_env(), "PY": "echo"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    runs = [line.split() for line in completed.stdout.splitlines() if "--script" in line and line[:3] != "== "]
    assert len(runs) == 2 * 4 + 2 * 2  # PPO and IMPALA: 2 networks x 2 dtypes alone, and without and with sync
    settings = set()
    for words in runs:
        assert (workdir / words[0]).resolve() == REPO / "benchmark" / "throughput.py", words  # as opened from workdir
        module = load_script(workdir / words[words.index("--script") + 1])
        args = parse_flags(module.Args, words[words.index("--") + 1 :])
        module.validate_args(args)
        settings.add((module.__name__, args.network, args.compute_dtype, args.sync_minibatches, "learner" in words))
    assert len(settings) == len(runs)


def test_gpu_benchmarks_pgx_check_without_pgxs_example_is_one_line(workdir):
    completed = subprocess.run(
        ["bash", str(REPO / "benchmark" / "gpu.sh"), str(workdir), "pgx-check"],
        cwd=REPO,
        env={**script_env(), "PY": sys.executable, "PGX_TRAIN": str(workdir / "missing.py")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert completed.stderr.strip() == "error: pgx-check needs PGX_TRAIN, pgx's examples/minatar-ppo/train.py"


def gpu_sh(workdir, sections: list[str], env: dict, out: str = "out", timeout: float = 120):
    """`bash benchmark/gpu.sh OUT SECTIONS...` run in `workdir` (its runs/ folder), the interpreter this one."""
    return subprocess.run(
        ["bash", str(REPO / "benchmark" / "gpu.sh"), out, *sections],
        cwd=workdir,
        env={**script_env(), "PY": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- benchmark/upstream_cleanba.py


def upstream_stand_in(folder, without: str = "") -> tuple:
    """(tests/upstream_cleanba_stand_in.py in `folder` with the text each edit of the runner replaces in its ANCHORS,
    as often as upstream has it, but for the edit whose reason starts with `without`; the runner's module)."""
    sys.path.insert(0, str(REPO / "benchmark"))
    import upstream_cleanba

    anchors = "\n".join(
        old * count for old, _, count, reason in upstream_cleanba.EDITS if not without or not reason.startswith(without)
    )
    text = (REPO / "tests" / "upstream_cleanba_stand_in.py").read_text()
    stand_in = folder / "cleanba_ppo.py"
    stand_in.write_text(text.replace('ANCHORS = """"""', f'ANCHORS = """{anchors}"""'))
    return stand_in, upstream_cleanba


def test_upstream_cleanba_times_upstreams_logged_updates_and_stops_a_run_that_hangs(tmp_path, monkeypatch):
    """Upstream's SPS from its console's `global_step=` lines: of a run that ends, of one that hangs after its last
    update (stopped after --timeout, as upstream's actor threads wait forever on a failed learner), and a failed run
    is one error line naming its log."""
    stand_in, upstream_cleanba = upstream_stand_in(tmp_path)
    script = upstream_cleanba.patched(stand_in.read_text(), stand_in)
    sizes = {"local_num_envs": 2, "num_actor_threads": 1, "num_steps": 4, "updates": 6, "warmup_updates": 2}
    args = upstream_cleanba.Args(cleanba_ppo=stand_in, results=tmp_path / "r", logs=tmp_path, timeout=5, **sizes)
    sps, updates, stopped = upstream_cleanba.upstream_sps(args, script, batch_size=8)
    assert (updates, stopped) == (7, False) and sps > 0  # one update more than asked, as upstream's actor
    assert (tmp_path / "upstream.log").read_text().count("global_step=") == 7
    monkeypatch.setenv("UPSTREAM_STAND_IN_HANGS", "1")
    sps, updates, stopped = upstream_cleanba.upstream_sps(args, script, batch_size=8)
    assert (updates, stopped) == (7, True) and sps > 0
    failing = "import sys\nprint('global_step=8,')\nsys.exit(3)\n"
    with pytest.raises(UsageError) as error:
        upstream_cleanba.upstream_sps(args, failing, batch_size=8)
    log = tmp_path / "upstream.log"
    assert str(error.value) == f"upstream's run failed (3) after 1 logged updates: its log is {log}"


def test_upstream_cleanba_tells_a_kill_by_someone_else_from_its_own_timeout(tmp_path, monkeypatch):
    """A run that ends by a SIGKILL the runner did not send (the kernel's out-of-memory killer sends SIGKILL too) after
    all its updates is a failed run, named as a kill, not a run stopped by --timeout."""
    stand_in, upstream_cleanba = upstream_stand_in(tmp_path)
    script = upstream_cleanba.patched(stand_in.read_text(), stand_in)
    sizes = {"local_num_envs": 2, "num_actor_threads": 1, "num_steps": 4, "updates": 6, "warmup_updates": 2}
    args = upstream_cleanba.Args(cleanba_ppo=stand_in, results=tmp_path / "r", logs=tmp_path, timeout=60, **sizes)
    monkeypatch.setenv("UPSTREAM_STAND_IN_KILLED", "1")
    with pytest.raises(UsageError) as error:
        upstream_cleanba.upstream_sps(args, script, batch_size=8)
    assert str(error.value) == (
        "upstream's run was killed by signal 9 (not by --timeout; the kernel's out-of-memory killer sends SIGKILL) "
        f"after 7 logged updates: its log is {tmp_path / 'upstream.log'}"
    )


@pytest.mark.parametrize(
    "env, flags, error",
    [
        ({}, "", "error: cleanba-upstream needs CLEANBA_PPO, upstream Cleanba's cleanba/cleanba_ppo.py"),
        (
            {"CLEANBA_PPO": "without the step edit"},
            "",
            "error: --cleanba-ppo {stand_in}: the edit for 'gymnasium's step returns terminated and truncated apart; "
            "gym's done is either' expects 1 of 'next_obs, next_reward, next_done, info = envs.step(cpu_action)', "
            "found 0",
        ),
        (
            {"CLEANBA_PPO": "with every edit"},
            "--updates 5 --warmup-updates 5",
            "error: --warmup-updates must be in [1, --updates) (got 5, --updates 5)",
        ),
    ],
    ids=["no-path", "edit-gone", "warmup"],
)
def test_gpu_benchmarks_cleanba_upstream_rejects_its_input_in_one_line(workdir, env, flags, error):
    """Before any run: no CLEANBA_PPO, an upstream script where an edit no longer applies, bad flags."""
    if "CLEANBA_PPO" in env:
        stand_in, _ = upstream_stand_in(workdir, without="gymnasium's step" if "without" in env["CLEANBA_PPO"] else "")
        env = {"CLEANBA_PPO": str(stand_in)}
    completed = gpu_sh(workdir, ["cleanba-upstream"], {**env, "UPSTREAM_FLAGS": flags})
    assert completed.returncode == (2 if "needs" in error else 1)  # a failed step: gpu.sh goes on, then exits 1
    assert error.format(stand_in=env.get("CLEANBA_PPO")) in completed.stderr.strip().splitlines()
    assert not (workdir / "out" / "gpu_cleanba_upstream.jsonl").exists()


@pytest.mark.slow  # ours on Breakout-v5 for 7 updates: an end-to-end run of over ~9 s
def test_gpu_benchmarks_cleanba_upstream_runs_both_and_writes_their_ratio(workdir):
    """The section with upstream's stand-in: ours and upstream's at the same flags, their steady SPS and ratio in one
    JSON line, upstream's console in the logs, and no copy of upstream's (patched) script left in the results."""
    stand_in, upstream_cleanba = upstream_stand_in(workdir)
    tiny = "--local-num-envs 4 --num-steps 8 --channels 4 --hiddens 16 --num-minibatches 2 --update-epochs 1"
    settings = {"CLEANBA_PPO": str(stand_in), "UPSTREAM_FLAGS": f"{tiny} --updates 7 --warmup-updates 5"}
    completed = gpu_sh(workdir, ["cleanba-upstream"], settings, timeout=400)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    [record] = [json.loads(line) for line in (workdir / "out" / "gpu_cleanba_upstream.jsonl").read_text().splitlines()]
    assert " ".join(record["flags"]) == (
        "--env-id Breakout-v5 --seed 1 --local-num-envs 4 --num-actor-threads 2 --num-steps 8 --num-minibatches 2 "
        "--update-epochs 1 --channels 4 --hiddens 16 --actor-device-ids 0 --learner-device-ids 0"
    )
    assert record["ours_sps"] > 0 and record["upstream_sps"] > 0
    assert record["ours_over_upstream"] == pytest.approx(
        record["ours_sps"] / record["upstream_sps"], rel=0.01, abs=1e-3
    )
    assert (record["updates"], record["upstream_updates_logged"], record["upstream_stopped_by_timeout"]) == (
        7,
        8,
        False,
    )
    assert record["upstream_sha256"] == hashlib.sha256(stand_in.read_bytes()).hexdigest()
    assert record["upstream_edits"] == [reason for *_, reason in upstream_cleanba.EDITS]
    assert (workdir / "out" / "cleanba_upstream_logs" / "upstream.log").read_text().count("global_step=") == 8
    assert sorted(str(p.relative_to(workdir / "out")) for p in (workdir / "out").rglob("*")) == [
        "cleanba_upstream_logs",
        "cleanba_upstream_logs/upstream.log",
        "gpu_cleanba_upstream.jsonl",
    ]


@pytest.mark.slow
def test_gpu_benchmarks_ceiling_sweep_measures_every_combination(workdir):
    sweep = {"SWEEP_POOLS": "1 2", "SWEEP_ENVS": "4", "SWEEP_THREADS": "0 1", "SWEEP_SECONDS": "0.2"}
    completed = gpu_sh(workdir, ["ceiling-sweep"], {"SWEEP_ENV_ID": "CartPole-v1", **sweep})
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-3000:]
    results = [json.loads(line) for line in (workdir / "out" / "gpu_env_ceiling_sweep.jsonl").read_text().splitlines()]
    cores = os.cpu_count()
    default_threads = {1: max(1, (cores - 1) // 1), 2: max(1, (cores - 1) // 2)}  # the scripts' split of the cores
    expected = [(pools, 4, threads or default_threads[pools]) for pools, threads in itertools.product([1, 2], [0, 1])]
    assert [(r["pools"], r["num_envs"], r["envpool_threads"]) for r in results] == expected
    for result in results:
        assert result["env_id"] == "CartPole-v1" and result["seconds"] >= 0.2 and result["steps"] > 0
        assert result["sps"] == pytest.approx(result["pools"] * 4 * result["steps"] / result["seconds"])
    assert "CPU(s)" in (workdir / "out" / "lscpu.txt").read_text()
    assert (workdir / "out" / "nvidia_smi.txt").read_text()  # the GPU's table, or why there is none


TINY_PARTS_RUN = f"{' '.join(TINY_CARTPOLE)} --total-timesteps 1920 --run-name tiny --checkpoint-frequency 1"


@pytest.mark.parametrize(
    "settings, error",
    [
        ({"PART_SECONDS": "0"}, "error: --seconds must be positive and finite (got 0.0)"),
        ({"PART_SECONDS": "8m"}, "error: argument --seconds: invalid float value: '8m'"),
        (
            {"BREAKOUT10M_FLAGS": " ".join(TINY_CARTPOLE)},
            "error: the script's flags (after --) must give --run-name: the parts continue one run folder",
        ),
    ],
    ids=["zero budget", "not a number", "no run name"],
)
def test_gpu_benchmarks_breakout10m_refuses_bad_settings_in_one_line(settings, error, workdir):
    completed = gpu_sh(workdir, ["breakout10m"], {"BREAKOUT10M_FLAGS": TINY_PARTS_RUN, **settings})
    assert (completed.returncode, completed.stderr.strip()) == (2, error), completed.stdout
    assert not (workdir / "runs").exists()


@pytest.mark.parametrize("run", ["breakout10m", "pqn10m"])
def test_gpu_benchmarks_10m_runs_default_flags_are_their_scripts(run, workdir):
    """Each 10M run's default flags (BREAKOUT10M_FLAGS, PQN10M_FLAGS) parse and pass its script's checks: with one bad
    value planted after them, that value is the one error, before anything starts."""
    completed = gpu_sh(workdir, [run], {"SCRIPT_FLAGS": "--max-grad-norm -1"})
    assert completed.returncode == 2, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert completed.stderr.strip() == "error: --max-grad-norm must be positive and finite, got -1.0"
    assert not (workdir / "runs").exists() and not any((workdir / "out").iterdir())


def test_gpu_benchmarks_one_pack_resumes_one_run(workdir):
    completed = gpu_sh(workdir, ["breakout10m", "pqn10m"], {"PART_IN": "part1.tar.gz"})
    assert (completed.returncode, completed.stderr.strip()) == (
        2,
        "error: PART_IN names one run's pack: give breakout10m or pqn10m, not both, with it",
    )


@pytest.mark.parametrize("pack", ["missing", "not a pack", "no checkpoint"])
def test_gpu_benchmarks_breakout10m_refuses_a_bad_part_in_in_one_line(pack, workdir):
    part_in = workdir / "part1.tar.gz"
    if pack == "not a pack":
        part_in.write_text("not a tar file")
    elif pack == "no checkpoint":  # a part stopped before its first checkpoint: events, no state
        (workdir / "runs" / "tiny").mkdir(parents=True)
        (workdir / "runs" / "tiny" / "events.out.tfevents.1").write_bytes(b"")
        with tarfile.open(part_in, "w:gz") as tar:
            tar.add(workdir / "runs" / "tiny", arcname="runs/tiny")
        shutil.rmtree(workdir / "runs")
    completed = gpu_sh(workdir, ["breakout10m"], {"PART_IN": str(part_in), "BREAKOUT10M_FLAGS": TINY_PARTS_RUN})
    assert completed.returncode == 2, completed.stdout + completed.stderr
    reason = {"missing": "no such file", "not a pack": "not a pack of a part", "no checkpoint": "holds no checkpoint"}
    assert re.fullmatch(rf"error: --part-in {part_in}: {reason[pack]}.*", completed.stderr.strip())
    assert not (workdir / "runs").exists() and not any((workdir / "out").iterdir())  # nothing started


def test_a_large_pack_is_split_into_pieces_that_unpack_as_one(workdir, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmark"))
    from train_in_parts import pack_run, read_pack, unpack

    run_dir = workdir / "runs" / "big"
    for update in [4, 5]:
        (run_dir / "checkpoints" / str(update)).mkdir(parents=True)
        (run_dir / "checkpoints" / str(update) / "state").write_bytes(os.urandom(50_000))  # incompressible
    (run_dir / ".lock").write_text("process 1")
    pieces = pack_run(run_dir, workdir / "big.tar.gz", max_bytes=20_000)
    assert [piece.name for piece in pieces] == ["big.tar.gz.00", "big.tar.gz.01", "big.tar.gz.02"]
    assert all(piece.stat().st_size <= 20_000 for piece in pieces)
    names = read_pack(workdir / "big.tar.gz", "big").getnames()
    # the newest checkpoint only (the next part resumes it), and no lock of a process that has ended
    assert sorted(names) == [
        "runs/big",
        "runs/big/checkpoints",
        "runs/big/checkpoints/5",
        "runs/big/checkpoints/5/state",
    ]
    with pytest.raises(Exception, match="outside runs/other/"):
        read_pack(workdir / "big.tar.gz", "other")
    # the pack's copy replaces the folder whole: the older checkpoint is gone, no staging folder is left beside it
    monkeypatch.chdir(workdir)
    unpack(read_pack(workdir / "big.tar.gz", "big"), Path("runs") / "big")
    assert [path.name for path in (workdir / "runs").iterdir()] == ["big"]
    assert sorted(tree_digests(run_dir)) == ["checkpoints", "checkpoints/5", "checkpoints/5/state"]


def tree_digests(folder) -> dict[str, str | None]:
    """Every file's sha256 and every folder (None) under `folder`, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
        for path in folder.rglob("*")
    }


def damage(pieces: list, kind: str):
    first, middle, last = pieces[0], pieces[1], pieces[-1]
    if kind.startswith("missing"):
        {"missing first": first, "missing middle": middle, "missing last": last}[kind].unlink()
    elif kind == "truncated":
        middle.write_bytes(middle.read_bytes()[:-100])
    elif kind == "flipped byte":
        data = bytearray(middle.read_bytes())
        data[len(data) // 2] ^= 0x01
        middle.write_bytes(bytes(data))
    elif kind == "reordered":  # two pieces' contents swapped, as a wrong `cat` order joins them
        first_data, middle_data = pieces[1].read_bytes(), pieces[2].read_bytes()
        pieces[1].write_bytes(middle_data)
        pieces[2].write_bytes(first_data)


@pytest.mark.parametrize(
    "kind", ["missing first", "missing middle", "missing last", "truncated", "flipped byte", "reordered"]
)
def test_a_damaged_pack_is_one_line_and_leaves_the_run_folder_as_it_was(kind, workdir):
    """A pack whose pieces were damaged in transit is refused in one line before anything on disk changes: the
    existing runs/tiny (an earlier part's) stays byte for byte, no temporary folder is left, nothing is started."""
    sys.path.insert(0, str(REPO / "benchmark"))
    from train_in_parts import pack_run

    run_dir = workdir / "runs" / "tiny"
    (run_dir / "checkpoints" / "5").mkdir(parents=True)
    (run_dir / "checkpoints" / "5" / "state").write_bytes(os.urandom(40_000))  # incompressible: 5 pieces
    pieces = pack_run(run_dir, workdir / "tiny.tar.gz", max_bytes=9_000)
    assert len(pieces) == 5
    (run_dir / "part1.log").write_text("the folder the pack would replace\n")
    damage(pieces, kind)
    before = tree_digests(workdir)
    # the script is never started: a stand-in that would end the part at once
    command = ["--part-in", "tiny.tar.gz", "--", "-c", "pass", "--run-name", "tiny"]
    completed = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "train_in_parts.py"), "--out", "out", "--name", "tiny", *command],
        cwd=workdir,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert re.fullmatch(r"error: --part-in tiny\.tar\.gz: [^\n]+", completed.stderr.strip()), completed.stderr
    assert tree_digests(workdir) == before


@pytest.mark.slow
def test_gpu_benchmarks_breakout10m_trains_in_parts_carried_to_another_folder(tmp_path_factory):
    """Part 1 is stopped by SIGTERM after its budget; its pack, moved to another folder (the GPU machine's next call
    starts from a fresh copy), is resumed there by part 2, which finishes the run. Every checkpoint takes 1 s more
    (tests/fault_injection.py), so part 1 cannot finish its 30 updates within its 30 s on any machine."""
    slow = f"{REPO / 'tests' / 'fault_injection.py'} {PPO_SCRIPT} slow-checkpoint 1"
    env = {"BREAKOUT10M_FLAGS": f"{TINY_PARTS_RUN} --log-frequency 1", "PART_SCRIPT": slow}
    first, second = tmp_path_factory.mktemp("part1"), tmp_path_factory.mktemp("part2")
    part1 = gpu_sh(first, ["breakout10m"], {**env, "PART_SECONDS": "30"}, timeout=300)
    assert part1.returncode == 0, part1.stdout[-3000:] + part1.stderr[-3000:]
    (result1,) = [json.loads(line) for line in (first / "out" / "breakout10m_parts.jsonl").read_text().splitlines()]
    assert result1["pack"] == ["breakout10m_part1.tar.gz"]
    (second / "results").mkdir()
    shutil.move(first / "out" / "breakout10m_part1.tar.gz", second / "results")
    shutil.rmtree(first / "runs")  # nothing of part 1 is left but its pack
    part_in = {"PART_IN": "results/breakout10m_part1.tar.gz", "PART_SECONDS": "300"}
    part2 = gpu_sh(second, ["breakout10m"], {**env, **part_in}, timeout=400)
    assert part2.returncode == 0, part2.stdout[-3000:] + part2.stderr[-3000:]
    (result2,) = [json.loads(line) for line in (second / "out" / "breakout10m_parts.jsonl").read_text().splitlines()]

    stopped_at = result1["end_update"]
    assert (result1["part"], result1["exit_code"], result1["finished"], result1["start_update"]) == (1, 143, False, 0)
    assert 1 <= stopped_at < 30 and result1["end_global_step"] == 64 * stopped_at
    assert (result2["part"], result2["exit_code"], result2["finished"]) == (2, 0, True)
    assert (result2["start_update"], result2["start_global_step"]) == (stopped_at, 64 * stopped_at)
    assert (result2["end_update"], result2["end_global_step"], result2["num_updates"]) == (30, 1920, 30)
    for result in [result1, result2]:
        assert result["wall_seconds"] > 0 and result["sps_wall"] > 0 and result["sps_logged"] > 0
        assert result["peak_gpu_memory_mib"] is None  # no nvidia-smi here
    # part 2 resumed the very state part 1 saved last, bit for bit, read from the moved pack
    part1_log = (first / "out" / "breakout10m_part1.log").read_text()
    saved = {update: state for update, _, state in SAVED.findall(part1_log)}
    assert [(u, s) for u, _, s in RESUMED.findall(part2.stdout)] == [(str(stopped_at), saved[str(stopped_at)])]
    assert result1["end_state"] == saved[str(stopped_at)]
    # the run's history travelled with it: every update's scalars once, both parts' logs and lines
    run_dir = second / "runs" / "tiny"
    assert [step for step, _ in read_scalars(run_dir)["charts/SPS"]] == [64 * u for u in range(1, 31)]
    assert sorted(p.name for p in run_dir.glob("part*.log")) == ["part1.log", "part2.log"]
    assert [json.loads(line)["part"] for line in (run_dir / "parts.jsonl").read_text().splitlines()] == [1, 2]
