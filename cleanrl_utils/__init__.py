"""What every cleanba/ script shares and is not its algorithm: the run (run.py) and the modules under it (devices,
checkpoints, preemption, actor threads, logging, run folder, flags, errors, the CLI entry), the env families
(envs.py), saving, evaluating and uploading a model (saved_model.py, evals/, huggingface.py), and benchmark sweeps."""
