"""Evaluate a saved model (`--save-model`) of any cleanba/ script for N episodes; optionally record MP4 videos.

    uv run python -m cleanrl_utils.evals.evaluate --model-path runs/RUN/EXP.cleanrl_model --eval-episodes 10 \\
        [--greedy] [--capture-video]

The model file names the script that made it ("script"); the evaluator imports that script from cleanba/
(or from --script) and uses its `make_env(env_id, seed, num_envs, render_mode[, env_options])` and
`make_eval_policy(args, model, greedy)`, so it needs no code of its own for any algorithm. The policy is called
as `policy(obs, key) -> (actions, key)`; a policy with memory (a recurrent agent) is a `RecurrentPolicy`: it is
also told after every step which envs' episodes ended. Returns are
the real game's: unclipped rewards (info["reward"] if present) summed until game over (info["terminated"]
if present, else terminated) or truncation.
"""

import os

if __name__ == "__main__":  # a VizDoom model: before numpy loads OpenBLAS (see cleanrl_utils.envs.FORK_SAFE_ENV)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from cleanrl_utils.errors import UsageError
from cleanrl_utils.flags import MAX_SEED, check_flags
from cleanrl_utils.script_contract import CONTRACT, missing_names

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Args:
    model_path: str
    """the .cleanrl_model file written by a cleanba/ script's --save-model"""
    eval_episodes: int = 10
    """the number of episodes to evaluate"""
    greedy: bool = False
    """take the most likely action (Gaussian mean for continuous actions) instead of sampling from the policy"""
    capture_video: bool = False
    """record env 0's episodes as MP4 files into --video-folder"""
    video_folder: str | None = None
    """where the videos go (default: videos/{run_name}/ of the model's run)"""
    num_envs: int = 8
    """the number of environments stepped together (at most --eval-episodes)"""
    seed: int | None = None
    """seed of the environments and of the action sampling (default: the model's training seed) (in [0, 2**32 - 1])"""
    script: str | None = None
    """the script that trained the model (default: cleanba/{the model's "script"}.py of this repository);
    needed when you trained with a copy of a script kept elsewhere"""


@runtime_checkable
class RecurrentPolicy(Protocol):
    """An evaluation policy with memory (e.g. an LSTM's state per env). After each step `episodes_ended(ended)` gets
    the envs whose episode ended at that step (terminated or truncated): envpool resets them on their next step,
    after which the policy starts those envs' memory afresh."""

    def __call__(self, obs, key): ...

    def episodes_ended(self, ended: np.ndarray) -> None: ...


class EvalError(UsageError):
    """Bad input: the CLI prints its message as one `error:` line and exits with code 2."""


def load_model(model_path: str | os.PathLike) -> dict:
    import flax.serialization

    path = Path(model_path)
    if not path.is_file():
        raise EvalError(f"--model-path {str(path)!r} is not a file")
    try:
        model = flax.serialization.msgpack_restore(path.read_bytes())
    except Exception as error:  # msgpack raises several types for foreign bytes
        raise EvalError(f"--model-path {str(path)!r} is not a saved model ({type(error).__name__})") from None
    if not isinstance(model, dict) or not {"script", "args", "params"} <= model.keys():
        raise EvalError(
            f"--model-path {str(path)!r} is not a saved model of a cleanba/ script "
            "(it needs the keys script, args and params)"
        )
    return model


def script_path(model: dict, script: str | os.PathLike | None = None) -> Path:
    """The training script of a model: --script if given, else cleanba/{model["script"]}.py."""
    if script is not None:
        path = Path(script)
        if not path.is_file():
            raise EvalError(f"--script {str(path)!r} is not a file")
        return path
    name = model["script"]
    path = REPO / "cleanba" / f"{name}.py"
    if not (isinstance(name, str) and name.isidentifier() and path.is_file()):
        raise EvalError(
            f"the model was made by script {name!r}, which is not in {REPO / 'cleanba'}: "
            "pass the script's file with --script"
        )
    return path


def load_script(path: Path, parts: tuple[str, ...] = ("evaluation",)):
    """Import a training script as a module (its `if __name__ == "__main__"` part does not run), with the names of
    `parts` of the script contract (cleanrl_utils/script_contract.py): the evaluator's by default."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_for_eval", path)
    if spec is None or path.suffix != ".py":
        raise EvalError(f"script {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered, so that tools reading its source (tyro's help) find it
    spec.loader.exec_module(module)
    for part, name in missing_names(module, parts):
        raise EvalError(
            f"script {str(path)!r} has no {name}: it does not follow the {part} contract ({CONTRACT[part][name].call}; "
            "cleanrl_utils/script_contract.py)"
        )
    return module


def saved_args(module, model: dict):
    """The script's Args as saved; flags unknown to this version of the script are ignored."""
    known = {field.name for field in dataclasses.fields(module.Args) if field.init}  # flags, not runtime values
    return module.Args(**{name: value for name, value in json.loads(model["args"]).items() if name in known})


class VideoRecorder:
    """One H.264 MP4 per episode (imageio-ffmpeg's bundled ffmpeg): {folder}/eval-episode-{k}.mp4."""

    def __init__(self, folder: str | os.PathLike, fps: int = 30):
        self.folder, self.fps = Path(folder), fps
        self.writer, self.episode, self.paths = None, 0, []

    def add_frame(self, frame: np.ndarray):
        import imageio_ffmpeg

        if self.writer is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.paths.append(self.folder / f"eval-episode-{self.episode}.mp4")
            height, width = frame.shape[:2]
            # macro_block_size=2: keep the frame's own size (yuv420p only needs even sides)
            self.writer = imageio_ffmpeg.write_frames(
                str(self.paths[-1]), (width, height), fps=self.fps, codec="libx264", macro_block_size=2
            )
            with warnings.catch_warnings():
                # JAX warns at every fork; this one is subprocess's fork+exec of ffmpeg, which is safe
                warnings.filterwarnings("ignore", message="os.fork", category=RuntimeWarning)
                self.writer.send(None)  # starts ffmpeg
        self.writer.send(np.ascontiguousarray(frame))

    def end_episode(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self.episode += 1


ENVPOOL_SEEDS = 2**31  # envpool takes an int32 seed and seeds env i of a pool with seed + i


def envpool_seed(seed: int, num_envs: int) -> int:
    """envpool's seed for an evaluation seed in [0, 2**32 - 1] (a training seed): the seed itself wherever the pool's
    seeds (seed + i) fit int32; a larger seed wraps around into that range (deterministic: a model's evaluation is
    reproducible for every seed; the action sampling's key is made from the whole seed)."""
    return seed % max(ENVPOOL_SEEDS - num_envs + 1, 1)


def run_episodes(envs, policy, num_episodes: int, key, recorder: VideoRecorder | None = None) -> list[float]:
    """Step `envs` with `policy` until each env has finished its share of `num_episodes`.

    Env i plays episodes i, i + num_envs, i + 2 num_envs, ... and its later episodes are not counted:
    counting the first N to finish would favour short episodes. The returned list is in episode
    order, so a run is reproducible for a given seed and number of envs. `recorder` gets env 0's frames.
    """
    obs, _ = envs.reset()
    num_envs = len(next(iter(obs.values())) if isinstance(obs, dict) else obs)  # dm_control: a dict of arrays
    quota = [num_episodes // num_envs + (i < num_episodes % num_envs) for i in range(num_envs)]
    returns: list[list[float]] = [[] for _ in range(num_envs)]
    episode_returns = np.zeros(num_envs, dtype=np.float64)
    if recorder is not None:
        recorder.add_frame(envs.render()[0])
    while any(len(returns[i]) < quota[i] for i in range(num_envs)):
        actions, key = policy(obs, key)
        obs, reward, terminated, truncated, info = envs.step(np.asarray(actions))
        if isinstance(policy, RecurrentPolicy):
            policy.episodes_ended(np.logical_or(terminated, truncated))
        episode_returns += info.get("reward", reward)  # Atari: the unclipped score
        game_over = np.logical_or(info["terminated"] if "terminated" in info else terminated, truncated)
        if recorder is not None and len(returns[0]) < quota[0]:
            recorder.add_frame(envs.render()[0])
        for i in np.flatnonzero(game_over):
            if len(returns[i]) < quota[i]:
                returns[i].append(float(episode_returns[i]))
                if i == 0 and recorder is not None:
                    recorder.end_episode()
        episode_returns[game_over] = 0.0
    return [returns[i][k] for k in range(max(quota)) for i in range(num_envs) if k < quota[i]]


def evaluate(
    model_path: str | os.PathLike,
    eval_episodes: int = 10,
    greedy: bool = False,
    capture_video: bool = False,
    video_folder: str | os.PathLike | None = None,
    num_envs: int = 8,
    seed: int | None = None,
    script: str | os.PathLike | None = None,
    verbose: bool = True,
) -> list[float]:
    """Episodic returns of a saved model, in episode order (see run_episodes)."""
    import jax

    if eval_episodes <= 0 or num_envs <= 0:
        raise EvalError(f"--eval-episodes and --num-envs must be positive integers, got {eval_episodes}, {num_envs}")
    model = load_model(model_path)
    module = load_script(script_path(model, script))
    args = saved_args(module, model)
    seed = args.seed if seed is None else seed
    if video_folder is None:
        video_folder = f"videos/{args.run_name}"
    # a script copied from before --env-options has a make_env without them
    options = {"env_options": args.env_options} if getattr(args, "env_options", None) else {}
    num_envs = min(num_envs, eval_episodes)
    envs = module.make_env(
        args.env_id,
        envpool_seed(seed, num_envs),
        num_envs,
        render_mode="rgb_array" if capture_video else None,
        **options,
    )
    policy = module.make_eval_policy(args, model, greedy)
    recorder = VideoRecorder(video_folder) if capture_video else None
    start = time.time()
    returns = run_episodes(envs, policy, eval_episodes, jax.random.key(seed), recorder)
    if verbose:
        for index, episodic_return in enumerate(returns):
            print(f"eval_episode={index} episodic_return={episodic_return:.2f}")
        print(
            f"evaluated {model_path} ({'greedy' if greedy else 'sampled'} actions): {len(returns)} episodes, "
            f"episodic_return={np.mean(returns):.2f} +- {np.std(returns):.2f} in {time.time() - start:.1f}s",
            flush=True,
        )
        if recorder is not None:
            print(f"videos of env 0's episodes: {', '.join(map(str, recorder.paths))}", flush=True)
    return returns


# run in a child process: rendering without a usable OpenGL context (MuJoCo with MUJOCO_GL unset) kills the
# process, so the probe must not be the training process itself
_RENDER_PROBE = """
import sys
from cleanrl_utils.evals.evaluate import load_script
from pathlib import Path
envs = load_script(Path(sys.argv[1])).make_env(sys.argv[2], 0, 1, render_mode="rgb_array")
envs.reset()
frame = envs.render()
assert frame.ndim == 4 and frame.shape[-1] == 3 and frame.dtype.name == "uint8", (frame.shape, frame.dtype)
"""


def check_capture_video(script: str | os.PathLike, env_id: str):
    """Fail now (UsageError) if env 0 of `env_id` cannot be rendered here, rather than after training."""
    probe = subprocess.run([sys.executable, "-c", _RENDER_PROBE, str(script), env_id], capture_output=True, text=True)
    if probe.returncode != 0:
        from cleanrl_utils.envs import env_family  # envpool's families: imported only here (an Anakin run has none)

        lines = [line.strip() for line in probe.stderr.splitlines() if line.strip()]
        reason = lines[-1][:200] if lines else f"exit code {probe.returncode}"
        why = (
            " (envpool's MuJoCo envs need an OpenGL context to render)"
            if env_family(env_id).startswith("envpool.mujoco")
            else ""
        )  # other families that fail (Football) have no renderer in envpool at all
        raise UsageError(
            f"--capture-video: {env_id} cannot be rendered here ({reason}); run without --capture-video{why}"
        )


def evaluate_saved_model(args: Args) -> list[float]:
    check_flags(args, ranges={"seed": (0, MAX_SEED)})  # a training seed's range: envpool's is derived from it
    if args.capture_video:
        model = load_model(args.model_path)
        check_capture_video(script_path(model, args.script), json.loads(model["args"])["env_id"])
    return evaluate(
        args.model_path,
        args.eval_episodes,
        args.greedy,
        args.capture_video,
        args.video_folder,
        args.num_envs,
        args.seed,
        args.script,
    )


def main(argv: list[str] | None = None) -> list[float]:
    from cleanrl_utils.cli import run_cli

    return run_cli(evaluate_saved_model, Args, argv)


if __name__ == "__main__":
    main()
