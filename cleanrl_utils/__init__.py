"""What is not the algorithm: benchmark sweeps, evaluation, hub upload."""

import os

# `python -m cleanrl_utils.evals.evaluate` on a VizDoom model: set before numpy loads OpenBLAS (see envs.FORK_SAFE_ENV)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
