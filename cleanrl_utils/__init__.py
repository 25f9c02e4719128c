"""What every cleanba/ script shares and is not its algorithm: the run (run.py) and the modules under it (devices,
the data path from the actors to the learner devices, jax.distributed's processes, checkpoints, preemption, actor
threads, logging, the run folder, flags, errors, the CLI entry, divergence and memory checks), replay sizing
(replay_sizing.py), running normalization (normalization.py), the env families (envpool's: envs.py; JAX's:
jax_envs.py), saving, evaluating and uploading a model (saved_model.py, evals/, huggingface.py), and benchmark sweeps
(benchmark.py)."""
