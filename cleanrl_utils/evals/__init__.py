"""Evaluation of saved models of the cleanba/ scripts: `python -m cleanrl_utils.evals.evaluate --help`."""
