"""Evaluation, videos and Hub upload of saved models.

One tiny CartPole run with --save-model --capture-video --upload-model, against a Hub that cannot be
reached (a closed local port), is shared by the tests that check what a user gets at the end of a run;
the evaluator and the model card are also checked in-process.
"""

import json
import os
from dataclasses import replace
from pathlib import Path

import flax
import imageio_ffmpeg
import jax
import numpy as np
import pytest
import yaml
from conftest import IMPALA_SCRIPT, PPO_SCRIPT, free_port, load_script, read_scalars, run_script

from cleanrl_utils import huggingface
from cleanrl_utils.errors import UsageError
from cleanrl_utils.evals import evaluate as evaluate_module
from cleanrl_utils.evals.evaluate import evaluate, run_episodes

TINY_CARTPOLE = (
    "--env-id CartPole-v1 --local-num-envs 4 --num-steps 32 --num-actor-threads 1 --hiddens 8 "
    "--total-timesteps 256 --checkpoint-frequency 0 --exp-name tiny"
).split()
SCRIPT_STEM = PPO_SCRIPT.stem


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A user's run that trains, saves, evaluates 3 episodes with a video, then fails to upload."""
    workdir = tmp_path_factory.mktemp("evals")
    run = run_script(
        [
            *TINY_CARTPOLE,
            "--save-model",
            "--eval-episodes",
            "3",
            "--capture-video",
            "--upload-model",
            "--hf-entity",
            "someone",
        ],
        workdir,
        run_name="saved",
        env={"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_TOKEN": "hf_not_a_real_token"},
    )
    run.model_path = run.run_dir / "tiny.cleanrl_model"
    run.video_dir = workdir / "videos" / "saved"
    run.eval_returns = [value for _, value in read_scalars(run.run_dir).get("eval/episodic_return", [])]
    return run


@pytest.mark.slow
def test_saved_model_is_evaluated_and_logged(saved_run):
    assert saved_run.returncode == 1, saved_run.stderr  # only the upload failed
    model = flax.serialization.msgpack_restore(saved_run.model_path.read_bytes())
    assert model["script"] == SCRIPT_STEM and json.loads(model["args"])["hiddens"] == [8]
    assert len(saved_run.eval_returns) == 3 and min(saved_run.eval_returns) >= 8  # CartPole: return = length
    assert "evaluated runs/saved/tiny.cleanrl_model (sampled actions): 3 episodes" in saved_run.stdout


@pytest.mark.slow
def test_upload_failure_keeps_model_card_script_and_video(saved_run):
    errors = [line for line in saved_run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in saved_run.stderr, saved_run.stderr
    assert errors[0].startswith(
        "error: --upload-model: uploading to someone/CartPole-v1-tiny-seed1 failed (ConnectError"
    )
    hub = saved_run.run_dir / "hub"
    assert f"kept in {Path('runs/saved/hub')}/" in errors[0] and "hf upload someone/CartPole-v1-tiny-seed1" in errors[0]
    assert sorted(p.name for p in hub.iterdir()) == sorted(
        ["README.md", "tiny.cleanrl_model", f"{SCRIPT_STEM}.py", "replay.mp4"]
    )
    assert (hub / "tiny.cleanrl_model").read_bytes() == saved_run.model_path.read_bytes()
    assert (hub / f"{SCRIPT_STEM}.py").read_text() == PPO_SCRIPT.read_text()
    assert (hub / "replay.mp4").read_bytes() == (saved_run.video_dir / "eval-episode-0.mp4").read_bytes()


def read_video(path: Path) -> tuple[dict, list[np.ndarray]]:
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    return meta, [np.frombuffer(frame, np.uint8).reshape(height, width, 3) for frame in reader]


@pytest.mark.slow
def test_video_is_an_h264_mp4_of_env_0s_first_episode(saved_run):
    assert sorted(p.name for p in saved_run.video_dir.iterdir()) == ["eval-episode-0.mp4"]  # 3 episodes, 3 envs
    meta, frames = read_video(saved_run.video_dir / "eval-episode-0.mp4")
    assert meta["codec"] == "h264" and meta["size"] == (600, 400)  # CartPole's own frame size
    # the reset frame, then one per step: episode 0 is env 0's first (CartPole: return = number of steps)
    assert len(frames) == saved_run.eval_returns[0] + 1
    assert all(frame.std() > 10 for frame in frames)  # a drawn cart and pole, not blank frames


def test_hub_repo_names_are_one_path_part():
    from cleanrl_utils.huggingface import repo_name

    assert repo_name("CartPole-v1", "ppo", 1) == "CartPole-v1-ppo-seed1"
    assert (
        repo_name("gfootball/academy_empty_goal_close-v1", "ppo", 1)
        == "gfootball-academy_empty_goal_close-v1-ppo-seed1"
    )


@pytest.mark.slow
def test_model_card(saved_run):
    card = (saved_run.run_dir / "hub" / "README.md").read_text()
    _, front_matter, body = card.split("---\n", 2)
    metadata = yaml.safe_load(front_matter)
    assert "CartPole-v1" in metadata["tags"] and metadata["library_name"] == "cleanrl"
    mean, std = np.mean(saved_run.eval_returns), np.std(saved_run.eval_returns)
    assert metadata["model-index"][0]["results"][0]["metrics"][0]["value"] == f"{mean:.2f} +/- {std:.2f}"
    assert f"3 episodes with sampled actions: episodic return\n**{mean:.2f} +/- {std:.2f}**" in body
    assert "Episodic returns: " + ", ".join(f"{r:.2f}" for r in saved_run.eval_returns) in body
    assert '<video src="replay.mp4"' in body
    command = body.split("## Command used to train\n\n```bash\n")[1].split("\n```")[0]
    assert command.startswith("python ") and PPO_SCRIPT.name in command and "--upload-model" in command
    hyperparameters = json.loads(body.split("## Hyperparameters\n\n```python\n")[1].split("\n```")[0])
    assert hyperparameters["hiddens"] == [8] and hyperparameters["env_id"] == "CartPole-v1"
    assert f"--script CartPole-v1-tiny-seed1/{SCRIPT_STEM}.py" in body


def test_model_card_without_video_and_greedy():
    card = huggingface.model_card(
        "me/x",
        {"env_id": "Pong-v5"},
        "s",
        "summary",
        "python s.py",
        [1.0, 3.0],
        greedy=True,
        model_file="m.cleanrl_model",
        has_video=False,
    )
    assert "<video" not in card and "2 episodes with greedy actions: episodic return\n**2.00 +/- 1.00**" in card


@pytest.mark.slow
def test_upload_calls_the_hub_with_the_folder(saved_run, tmp_path, monkeypatch):
    calls = []

    class FakeHfApi:  # the boundary to the network: record what would be sent
        def whoami(self):
            return {"name": "alice"}

        def create_repo(self, repo_id, exist_ok):
            calls.append(("create_repo", repo_id, exist_ok))
            return f"hub/{repo_id}"

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls.append(("upload_folder", repo_id, Path(folder_path), sorted(os.listdir(folder_path))))

    monkeypatch.setattr("huggingface_hub.HfApi", FakeHfApi)
    model_path = tmp_path / "run" / "tiny.cleanrl_model"
    model_path.parent.mkdir()
    model_path.write_bytes(saved_run.model_path.read_bytes())
    args = evaluate_module.saved_args(
        load_script(PPO_SCRIPT), flax.serialization.msgpack_restore(model_path.read_bytes())
    )
    assert huggingface.push_to_hub(
        replace(args, hf_entity=None), [9.0, 11.0], model_path, PPO_SCRIPT, saved_run.video_dir
    )
    repo_id = "alice/CartPole-v1-tiny-seed1"
    assert calls == [
        ("create_repo", repo_id, True),
        (
            "upload_folder",
            repo_id,
            tmp_path / "run" / "hub",
            sorted(["README.md", "tiny.cleanrl_model", f"{SCRIPT_STEM}.py", "replay.mp4"]),
        ),
    ]
    assert f"hf download {repo_id}" in (tmp_path / "run" / "hub" / "README.md").read_text()


@pytest.mark.slow
def test_evaluator_reproduces_the_runs_evaluation(saved_run):
    # the same defaults as the run's own evaluation: the model's seed, min(8, episodes) envs, sampled actions
    assert evaluate(saved_run.model_path, 3, verbose=False) == saved_run.eval_returns
    greedy = evaluate(saved_run.model_path, 5, greedy=True, num_envs=2, verbose=False)
    assert len(greedy) == 5 and greedy == evaluate(saved_run.model_path, 5, greedy=True, num_envs=2, verbose=False)


@pytest.mark.parametrize("script", [PPO_SCRIPT, IMPALA_SCRIPT], ids=["ppo", "impala"])
def test_eval_policy_greedy_takes_argmax_sampled_draws(script):
    module = load_script(script)
    args = module.Args(env_id="CartPole-v1", hiddens=[16])
    agent = module.Agent(2, (), (16,), obs_layout="vector")
    obs = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    params = agent.init(jax.random.key(0), obs)
    model = {"params": flax.serialization.to_state_dict(jax.tree.map(np.asarray, params))}
    expected = np.argmax(np.asarray(agent.apply(params, obs)[0]), axis=-1)
    greedy = module.make_eval_policy(args, model, greedy=True)
    for seed in [1, 2]:
        actions, _ = greedy(obs, jax.random.key(seed))
        assert isinstance(actions, np.ndarray) and np.array_equal(actions, expected)
    sampled = module.make_eval_policy(args, model, greedy=False)
    actions_1, key = sampled(obs, jax.random.key(1))
    actions_2, _ = sampled(obs, key)  # the policy returns the next key
    assert not np.array_equal(actions_1, expected) and not np.array_equal(actions_1, actions_2)
    assert 0.3 < actions_1.mean() < 0.7  # a fresh policy is near uniform over CartPole's 2 actions


class ScriptedEnvs:
    """Envs whose episodes have known lengths and rewards: env i's k-th episode lasts lengths[i][k] steps
    with reward i + 1 per step. Next-step autoreset, as envpool: the step after an episode end is a reset."""

    def __init__(self, lengths: list[list[int]], atari_info: bool = False):
        self.lengths, self.atari_info = lengths, atari_info
        self.episode, self.t = [0] * len(lengths), [0] * len(lengths)

    def reset(self):
        return np.zeros((len(self.lengths), 1)), {}

    def step(self, actions):
        n = len(self.lengths)
        reward, done = np.zeros(n), np.zeros(n, dtype=bool)
        for i in range(n):
            if self.t[i] == self.lengths[i][self.episode[i]]:  # reset step
                self.t[i], self.episode[i] = 0, self.episode[i] + 1
                continue
            self.t[i] += 1
            reward[i] = i + 1
            done[i] = self.t[i] == self.lengths[i][self.episode[i]]
        if self.atari_info:  # lives: terminated every step, game over only at done; clipped reward 0
            return (
                np.zeros((n, 1)),
                np.zeros(n),
                np.ones(n, bool),
                np.zeros(n, bool),
                {"reward": reward, "terminated": done},
            )
        return np.zeros((n, 1)), reward, done, np.zeros(n, dtype=bool), {}


@pytest.mark.parametrize("atari_info", [False, True], ids=["terminated", "atari-info"])
def test_run_episodes_gives_each_env_its_share_in_episode_order(atari_info):
    # env 0 has long episodes: counting the first 5 to finish would take env 1's short ones instead
    envs = ScriptedEnvs([[50, 50, 50], [2, 3] + [1] * 200], atari_info)
    policy = lambda obs, key: (np.zeros(len(obs), dtype=np.int32), key)
    returns = run_episodes(envs, policy, 5, key=None)
    assert returns == [50.0, 2 * 2, 50.0, 2 * 3, 50.0]  # env 0: 3 episodes, env 1: 2; in episode order


def test_render_probe_fails_before_training_with_one_line(tmp_path, capsys):
    script = tmp_path / "no_opengl.py"
    script.write_text(
        "import os\nArgs = make_eval_policy = None\n"
        "def make_env(env_id, seed, num_envs, render_mode=None):\n"
        "    print('an OpenGL platform library has not been loaded', file=__import__('sys').stderr)\n"
        "    os.abort()\n"
    )
    with pytest.raises(UsageError) as error_info:  # a library raises; the script's run_cli prints it in one line
        evaluate_module.check_capture_video(script, "HalfCheetah-v4")
    error = str(error_info.value)
    assert len(error.splitlines()) == 1 and error.startswith(
        "--capture-video: HalfCheetah-v4 cannot be rendered here (an OpenGL platform library has not been loaded)"
    )
    assert error.endswith("run without --capture-video (envpool's MuJoCo envs need an OpenGL context to render)")


def test_upload_without_a_token_fails_before_training(workdir):
    run = run_script(
        [*TINY_CARTPOLE, "--save-model", "--upload-model"],
        workdir,
        env={"HF_TOKEN": "", "HF_HOME": str(workdir / "hf_home")},
    )
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "error: --upload-model needs a Hugging Face token: run `hf auth login` or set HF_TOKEN"
    )
    assert not (workdir / "runs").exists()


def write_model(path: Path, model) -> Path:
    path.write_bytes(flax.serialization.msgpack_serialize(model))
    return path


def test_evaluator_bad_input_is_one_clear_line(tmp_path, capsys):
    args_json = json.dumps({"env_id": "CartPole-v1"})
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    other_script = tmp_path / "other.py"
    other_script.write_text("x = 1\n")
    cases = [
        (["--model-path", str(tmp_path / "missing.cleanrl_model")], "is not a file"),
        (["--model-path", str(not_a_model)], "is not a saved model"),
        (
            ["--model-path", str(write_model(tmp_path / "a.cleanrl_model", {"params": {}}))],
            "is not a saved model of a cleanba/ script (it needs the keys script, args and params)",
        ),
        (
            [
                "--model-path",
                str(write_model(tmp_path / "b.cleanrl_model", {"script": "nope", "args": args_json, "params": {}})),
            ],
            "the model was made by script 'nope', which is not in",
        ),
        (
            ["--model-path", str(tmp_path / "b.cleanrl_model"), "--script", str(tmp_path / "nope.py")],
            f"--script '{tmp_path / 'nope.py'}' is not a file",
        ),
        (["--model-path", str(tmp_path / "b.cleanrl_model"), "--script", str(not_a_model)], "is not a Python file"),
        (
            ["--model-path", str(tmp_path / "b.cleanrl_model"), "--script", str(other_script)],
            "has no Args: it does not follow the evaluation contract",
        ),
        (
            ["--model-path", str(tmp_path / "b.cleanrl_model"), "--eval-episodes", "0"],
            "--eval-episodes and --num-envs must be positive integers",
        ),
        # a training seed's range, checked before the model is read
        (
            ["--model-path", str(tmp_path / "missing.cleanrl_model"), "--seed", str(2**32)],
            "--seed must be in [0, 4294967295], got 4294967296",
        ),
        (
            ["--model-path", str(tmp_path / "missing.cleanrl_model"), "--seed", "-1"],
            "--seed must be in [0, 4294967295], got -1",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            evaluate_module.main(argv)
        error = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and len(error.splitlines()) == 1, (argv, error)
        assert error.startswith("error: ") and message in error, (argv, error)


def test_envpool_seed_is_the_seed_where_envpool_takes_it():
    assert evaluate_module.envpool_seed(1, 8) == 1 and evaluate_module.envpool_seed(2**31 - 8, 8) == 2**31 - 8
    for seed in [2**31 - 7, 2**31, 2**32 - 1]:  # the pool's seeds, seed + i, must be int32
        assert 0 <= evaluate_module.envpool_seed(seed, 8) <= 2**31 - 8


@pytest.mark.slow
def test_largest_seed_trains_saves_and_evaluates(workdir):
    """envpool takes an int32 seed: a run with a seed of the documented range above it trained and saved, then its
    evaluation stopped with an AssertionError traceback (the model was saved, the run's evaluation lost)."""
    run = run_script(
        [*TINY_CARTPOLE, "--seed", str(2**32 - 1), "--save-model", "--eval-episodes", "2"], workdir, run_name="largest"
    )
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "evaluated runs/largest/tiny.cleanrl_model (sampled actions): 2 episodes" in run.stdout
    logged = [value for _, value in read_scalars(run.run_dir)["eval/episodic_return"]]
    # the evaluator, with the model's seed as it does by default, reproduces the run's own evaluation
    assert evaluate(run.run_dir / "tiny.cleanrl_model", 2, verbose=False) == logged
