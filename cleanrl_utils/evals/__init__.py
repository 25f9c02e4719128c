"""Evaluation of saved models of the cleanba/ scripts: `python -m cleanrl_utils.evals.evaluate --help`."""

from cleanrl_utils.evals.evaluate import check_capture_video, evaluate, log_eval_returns

__all__ = ["check_capture_video", "evaluate", "log_eval_returns"]
