"""Smoke runs of the PPO script on Breakout-v5 with a tiny network, in the device layouts users run."""

import json

import flax
import numpy as np
import pytest
from conftest import IMPALA_SCRIPT, MUJOCO_SCRIPT, PPO_SCRIPT, TINY_BREAKOUT, TINY_BREAKOUT_PPO, load_script, run_script

TAGS = (
    "charts/SPS charts/avg_episodic_return charts/avg_episodic_length charts/learning_rate "
    "losses/policy_loss losses/value_loss losses/entropy losses/approx_kl losses/loss "
    "stats/params_queue_get_time stats/rollout_time stats/inference_time stats/env_step_time "
    "stats/storage_time stats/rollout_queue_put_time stats/rollout_queue_get_time stats/training_time "
    "stats/actor_policy_version stats/learner_policy_version stats/peak_rss_mib"
).split()


def versions(scalars):
    actor = [v for _, v in scalars["stats/actor_policy_version"]]
    learner = [v for _, v in scalars["stats/learner_policy_version"]]
    return actor, learner


# the actor's device shared with the learner, and apart from a learner of two devices (a0-l1, the usual CPU layout, is
# that of most other runs of the suite)
LAYOUTS = [
    ("ppo", ["0"], ["0"]),
    ("ppo", ["0"], ["1", "2"]),
    ("impala", ["0"], ["0"]),
    ("impala", ["0"], ["1", "2"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm,actor_ids,learner_ids", LAYOUTS, ids=[f"{a}-a{','.join(x)}-l{','.join(y)}" for a, x, y in LAYOUTS]
)
def test_layouts_log_every_tag_and_act_one_version_behind(workdir, algorithm, actor_ids, learner_ids):
    script, tiny = (PPO_SCRIPT, TINY_BREAKOUT_PPO) if algorithm == "ppo" else (IMPALA_SCRIPT, TINY_BREAKOUT)
    # 4 envs x 8 steps x 2 threads = 64 steps per update; 6 updates
    run = run_script(
        [
            *tiny,
            "--num-actor-threads",
            "2",
            "--actor-device-ids",
            *actor_ids,
            "--learner-device-ids",
            *learner_ids,
            "--total-timesteps",
            "384",
        ],
        workdir,
        script=script,
    )
    assert run.returncode == 0, run.stderr
    scalars = run.scalars()
    missing = [
        tag
        for tag in TAGS
        if tag not in scalars and tag != "charts/avg_episodic_return" and tag != "charts/avg_episodic_length"
    ]
    assert not missing, f"missing tags {missing}"
    steps = [step for step, _ in scalars["charts/SPS"]]
    assert steps == [64 * i for i in range(1, 7)]
    actor, learner = versions(scalars)
    assert learner == [0, 1, 2, 3, 4, 5]
    assert actor == [0, 0, 1, 2, 3, 4]  # the first rollout, then exactly one version behind
    for name in ["rollout_time", "inference_time", "env_step_time", "training_time"]:
        assert all(v > 0 for _, v in scalars[f"stats/{name}"]), name
    losses = [v for _, v in scalars["losses/loss"]]
    assert np.all(np.isfinite(losses)) and len(set(losses)) > 1
    assert "update=6/6" in run.stdout and "actor_policy_version=4 learner_policy_version=5" in run.stdout


@pytest.mark.slow
def test_no_concurrency_acts_with_the_latest_policy(workdir):
    run = run_script(
        [
            *TINY_BREAKOUT_PPO,
            "--num-actor-threads",
            "2",
            "--learner-device-ids",
            "1",
            "--no-concurrency",
            "--total-timesteps",
            "320",
        ],
        workdir,
    )
    assert run.returncode == 0, run.stderr
    actor, learner = versions(run.scalars())
    assert actor == learner == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_episode_statistics_count_whole_games_with_unclipped_scores(workdir):
    # CartPole episodes are short, so the returns are checked against their definition: return == length
    run = run_script(
        (
            "--env-id CartPole-v1 --local-num-envs 4 --num-steps 64 --num-actor-threads 1 "
            "--total-timesteps 1024 --hiddens 8"
        ).split(),
        workdir,
    )
    assert run.returncode == 0, run.stderr
    scalars = run.scalars()
    returns = [v for _, v in scalars["charts/avg_episodic_return"]]
    lengths = [v for _, v in scalars["charts/avg_episodic_length"]]
    assert returns == pytest.approx(lengths) and min(returns) >= 8


@pytest.mark.slow
def test_save_model_and_track_offline(workdir):
    """A run that saves its model, evaluates it and tracks to W&B offline; with the Nature CNN in bfloat16, whose
    saved flags the evaluation reads to rebuild the network. One evaluation game (Breakout: whole games, all lives)
    keeps the test short."""
    run = run_script(
        [
            *TINY_BREAKOUT_PPO,
            "--network",
            "nature",
            "--compute-dtype",
            "bfloat16",
            "--num-actor-threads",
            "1",
            "--total-timesteps",
            "64",
            "--save-model",
            "--track",
            "--exp-name",
            "tiny",
            "--eval-episodes",
            "1",
        ],
        workdir,
    )
    assert run.returncode == 0, run.stderr
    model = flax.serialization.msgpack_restore((run.run_dir / "tiny.cleanrl_model").read_bytes())
    saved_args = json.loads(model["args"])
    assert saved_args["env_id"] == "Breakout-v5"
    assert (saved_args["network"], saved_args["compute_dtype"]) == ("nature", "bfloat16")
    kernels = [np.asarray(leaf) for leaf in flax.traverse_util.flatten_dict(model["params"]).values()]
    assert (8, 8, 4, 32) in [k.shape for k in kernels]  # the Nature CNN's first convolution on 4 stacked frames
    assert all(k.dtype == np.float32 and np.all(np.isfinite(k)) for k in kernels)
    losses = [value for _, value in run.scalars()["losses/loss"]]
    assert len(losses) == 2 and np.all(np.isfinite(losses))  # it trained: 2 updates of 4 envs x 8 steps
    assert list((workdir / "wandb").glob("offline-run-*")), "no offline W&B run written"
    assert model["script"] == "cleanba_ppo_envpool_impala_atari_wrapper"
    assert len(run.scalars()["eval/episodic_return"]) == 1


def test_envpool_threads_default_leaves_a_core_and_shares_the_rest(monkeypatch):
    from cleanrl_utils import devices

    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: set(range(9)), raising=False)
    assert devices.envpool_num_threads(0, actor_threads_per_process=4) == 2  # (9 cores - 1) // 4 actor threads
    monkeypatch.setattr(devices.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert devices.envpool_num_threads(0, actor_threads_per_process=4) == 1  # never 0
    assert devices.envpool_num_threads(3, actor_threads_per_process=4) == 3  # --envpool-threads


@pytest.mark.parametrize("script", [PPO_SCRIPT, IMPALA_SCRIPT, MUJOCO_SCRIPT], ids=["ppo", "impala", "mujoco"])
def test_make_env_passes_the_envpool_threads(script):
    module = load_script(script)
    envs = module.make_env("Hopper-v4" if script == MUJOCO_SCRIPT else "CartPole-v1", 0, 2, num_threads=1)
    assert dict(zip(envs.spec._config_keys, envs.spec._config_values))["num_threads"] == 1
