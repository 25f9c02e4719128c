"""benchmark/throughput.py: every stage is measured on the script's own functions and the table adds up."""

import json
import os
import subprocess
import sys

import pytest
from conftest import IMPALA_SCRIPT, PPO_SCRIPT, REPO, TINY_BREAKOUT, script_env

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


def test_gpu_benchmark_rejects_an_unknown_section_in_one_line(workdir):
    completed = subprocess.run(
        ["bash", str(REPO / "benchmark" / "gpu.sh"), str(workdir), "curves"],
        cwd=REPO,
        env={**script_env(), "PY": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 2
    assert completed.stderr.strip() == (
        "error: unknown section 'curves' (allowed: ceiling throughput curve minatar jax-ceiling pgx-check)"
    )


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
