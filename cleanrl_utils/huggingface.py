"""Upload a saved model to the Hugging Face Hub: the model, a model card, the training script and a video.

The repo is {hf_entity}/{env_id}-{exp_name}-seed{seed}, as in CleanRL. Everything is first written to
runs/{run_name}/hub/ and stays there: if the upload fails (no network, no token, no rights) the run still
ends with all of it on disk, and `hf upload REPO_ID runs/{run_name}/hub` uploads it later.
"""

import ast
import json
import sys
from pathlib import Path

import numpy as np

from cleanrl_utils.errors import UsageError
from cleanrl_utils.run_folder import atomic_write


def repo_name(env_id: str, exp_name: str, seed: int) -> str:
    """The Hub repo's name (without its owner): one path part, so Football's "gfootball/..." ids get "-" there."""
    return f"{env_id.replace('/', '-')}-{exp_name}-seed{seed}"


def script_summary(script_path: str | Path) -> str:
    """The first line of the script's docstring, e.g. 'Sebulba PPO (...) for envpool Atari and classic control.'"""
    docstring = ast.get_docstring(ast.parse(Path(script_path).read_text())) or ""
    return docstring.splitlines()[0] if docstring else ""


def card_metadata(env_id: str, script_name: str, mean: float, std: float) -> str:
    """The model card's YAML header: the Hub's tags and the evaluation's mean reward."""
    from huggingface_hub import EvalResult, ModelCardData

    return ModelCardData(
        library_name="cleanrl",
        tags=[env_id, "deep-reinforcement-learning", "reinforcement-learning", "custom-implementation", "cleanba"],
        model_name=script_name,
        eval_results=[
            EvalResult(
                task_type="reinforcement-learning",
                task_name="reinforcement-learning",
                dataset_type=env_id,
                dataset_name=env_id,
                metric_type="mean_reward",
                metric_name="mean_reward",
                metric_value=f"{mean:.2f} +/- {std:.2f}",
            )
        ],
    ).to_yaml()


def model_card(
    repo_id: str,
    args: dict,
    script_name: str,
    summary: str,
    command: str,
    episodic_returns: list[float],
    greedy: bool,
    model_file: str,
    has_video: bool,
) -> str:
    """The README.md of the Hub repo (a pure function of its inputs)."""
    mean, std = float(np.mean(episodic_returns)), float(np.std(episodic_returns))
    env_id = args["env_id"]
    video = '<video src="replay.mp4" controls autoplay loop></video>\n\n' if has_video else ""
    returns = ", ".join(f"{r:.2f}" for r in episodic_returns)
    return f"""---
{card_metadata(env_id, script_name, mean, std)}
---

# Cleanba `{script_name}` playing {env_id}

{summary}

This agent was trained with Cleanba's `{script_name}.py`, a single-file, CleanRL-style implementation of the
Sebulba architecture (Hessel et al. 2021) in JAX. The script is in this repo.

{video}## Evaluation

{len(episodic_returns)} episodes with {"greedy" if greedy else "sampled"} actions: episodic return
**{mean:.2f} +/- {std:.2f}** (mean +/- standard deviation).

Episodic returns: {returns}

## Use the model

```bash
hf download {repo_id} --local-dir {repo_id.split("/")[-1]}
uv run python -m cleanrl_utils.evals.evaluate --model-path {repo_id.split("/")[-1]}/{model_file} \\
    --script {repo_id.split("/")[-1]}/{script_name}.py --eval-episodes 10
```

## Command used to train

```bash
{command}
```

## Hyperparameters

```python
{json.dumps(args, indent=4)}
```
"""


def prepare_upload_folder(
    folder: str | Path, model_path: str | Path, script_path: str | Path, card: str, video_path: str | Path | None
) -> Path:
    """The folder that is uploaded: README.md, the model, the script and replay.mp4 (if there is a video)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(str(folder / "README.md"), card.encode())  # each file whole or absent, also when rewritten
    atomic_write(str(folder / Path(model_path).name), Path(model_path).read_bytes())
    atomic_write(str(folder / Path(script_path).name), Path(script_path).read_bytes())
    if video_path is not None:
        atomic_write(str(folder / "replay.mp4"), Path(video_path).read_bytes())
    return folder


def check_token():
    """--upload-model: fail before training (UsageError) if no Hugging Face token is configured."""
    from huggingface_hub import get_token

    if not get_token():
        raise UsageError("--upload-model needs a Hugging Face token: run `hf auth login` or set HF_TOKEN")


def push_to_hub(
    args,
    episodic_returns: list[float],
    model_path: str | Path,
    script_path: str | Path,
    video_folder: str | Path | None = None,
    greedy: bool = False,
) -> bool:
    """Write runs/{run_name}/hub/ and upload it. `args` is the script's Args (env_id, exp_name, seed,
    hf_entity). On failure, print one `error:` line saying where the files are and return False."""
    from dataclasses import asdict

    from huggingface_hub import HfApi

    args_dict = asdict(args)
    name = repo_name(args.env_id, args.exp_name, args.seed)
    videos = sorted(Path(video_folder).glob("eval-episode-*.mp4")) if video_folder is not None else []
    folder = Path(model_path).parent / "hub"
    repo_id = f"{args.hf_entity}/{name}" if args.hf_entity else f"<your-user>/{name}"
    script_name = Path(script_path).stem

    def card(repo_id: str) -> str:
        return model_card(
            repo_id,
            args_dict,
            script_name,
            script_summary(script_path),
            " ".join(["python", *sys.argv]),
            episodic_returns,
            greedy,
            Path(model_path).name,
            has_video=bool(videos),
        )

    prepare_upload_folder(folder, model_path, script_path, card(repo_id), videos[0] if videos else None)
    try:
        api = HfApi()
        if not args.hf_entity:
            repo_id = f"{api.whoami()['name']}/{name}"
            atomic_write(str(folder / "README.md"), card(repo_id).encode())
        repo_url = api.create_repo(repo_id, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=f"Cleanba {script_name}: {args.run_name}")
    except Exception as error:  # network, authentication, permissions: report, keep the files
        print(
            f"error: --upload-model: uploading to {repo_id} failed ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200] if str(error) else ''}); the model, its card, the script and the "
            f"video are kept in {folder}/: upload them later with `hf upload {repo_id} {folder} .`",
            file=sys.stderr,
        )
        return False
    print(f"model uploaded to {repo_url}", flush=True)
    return True
