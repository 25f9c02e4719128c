"""--save-model at the end of a training run: the model file, its evaluation (TensorBoard's eval/episodic_return),
videos and the Hub upload; and the check of those flags before training starts."""

import dataclasses
import json
import os
import time
from pathlib import Path

from cleanrl_utils.errors import UsageError
from cleanrl_utils.evals.evaluate import check_capture_video, evaluate
from cleanrl_utils.run_folder import atomic_write


def check_save_model_flags(args, script: str | os.PathLike):
    """A training script's --capture-video and --upload-model act on the model saved at the end: check now, not
    after training (UsageError), that --save-model is on, a Hub token exists and env 0 can be rendered."""
    from cleanrl_utils.huggingface import check_token

    for name in ["capture_video", "upload_model"]:
        if getattr(args, name) and not args.save_model:
            raise UsageError(
                f"--{name.replace('_', '-')} works on the model saved at the end of training: add --save-model"
            )
    if args.upload_model:
        check_token()
    if args.capture_video:
        check_capture_video(script, args.env_id)


def save_model(args, script: str | os.PathLike, contents: dict) -> str:
    """--save-model: runs/{run_name}/{exp_name}.cleanrl_model, msgpack of the script's name (the evaluator imports
    it), its flags and `contents` (params, and whatever else its make_eval_policy reads)."""
    import flax.serialization

    model_path = f"runs/{args.run_name}/{args.exp_name}.cleanrl_model"
    atomic_write(
        model_path,
        flax.serialization.msgpack_serialize(  # whole or absent, never half a model
            {"script": Path(script).stem, "args": json.dumps(dataclasses.asdict(args)), **contents}
        ),
    )
    print(f"model saved to {model_path}", flush=True)
    return model_path


def save_evaluate_upload(args, script: str | os.PathLike, contents: dict) -> bool:
    """--save-model at the end of a training script: save the model, evaluate it as `python -m
    cleanrl_utils.evals.evaluate` does, log eval/episodic_return, record videos, upload. False if the upload failed
    (the files stay on disk)."""
    from cleanrl_utils.huggingface import push_to_hub

    model_path = save_model(args, script, contents)
    video_folder = f"videos/{args.run_name}"
    episodic_returns = evaluate(
        model_path, args.eval_episodes, args.eval_greedy, args.capture_video, video_folder, script=script
    )
    log_eval_returns(f"runs/{args.run_name}", episodic_returns, use_wandb=args.track)
    return not args.upload_model or push_to_hub(
        args, episodic_returns, model_path, script, video_folder, greedy=args.eval_greedy
    )


def log_eval_returns(run_dir: str | os.PathLike, returns: list[float], use_wandb: bool = False):
    """eval/episodic_return of each evaluation episode (step = episode index, as in CleanRL), in a new
    TensorBoard event file of the run, and in W&B if the run is tracked."""
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(run_dir))
    for index, episodic_return in enumerate(returns):
        value = summary_pb2.Summary.Value(tag="eval/episodic_return", simple_value=float(episodic_return))
        writer.add_event(event_pb2.Event(wall_time=time.time(), step=index, summary=summary_pb2.Summary(value=[value])))
    writer.close()
    if use_wandb:
        import wandb

        wandb.define_metric("eval/episode")
        wandb.define_metric("eval/episodic_return", step_metric="eval/episode")
        for index, episodic_return in enumerate(returns):
            wandb.log({"eval/episode": index, "eval/episodic_return": episodic_return})
