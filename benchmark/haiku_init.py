"""Run a script with haiku's default initializers in place of flax's orthogonal ones (a measurement, not a flag):

    python benchmark/haiku_init.py cleanba/cleanba_ppo_anakin.py --env-id minatar-breakout ...

pgx's MinAtar PPO example builds its network in haiku, whose Linear and Conv layers start from a truncated normal of
stddev 1/sqrt(fan_in) cut at two stddevs (the policy and value heads too); the Anakin script's layers start
orthogonal (CleanRL's). flax's `variance_scaling` rescales its truncated normal to the scale asked for, so a scale
of 0.87962566**2 (the cut normal's variance) gives haiku's numbers. The scripts build their initializers inside
`__call__`, so replacing `nn.initializers.orthogonal` before the script runs reaches every layer."""

import runpy
import sys

import flax.linen as nn
from tool_helpers import python_script

from cleanrl_utils.cli import fail, run_main

HAIKU_TRUNCATED_NORMAL_VARIANCE = 0.87962566**2


def use_haiku_initializers():
    nn.initializers.orthogonal = lambda scale=1.0, **kwargs: nn.initializers.variance_scaling(
        HAIKU_TRUNCATED_NORMAL_VARIANCE, "fan_in", "truncated_normal"
    )


def script_of(argv: list[str]) -> str:
    """The script to run, the first argument (its flags follow): checked here, before it runs, so that a missing or
    binary one is one line, not runpy's traceback."""
    if not argv:
        fail("script: missing; usage: python benchmark/haiku_init.py SCRIPT.py [the script's flags]")
    return str(python_script(argv[0], "script"))


if __name__ == "__main__":
    script = run_main(script_of, sys.argv[1:])
    use_haiku_initializers()
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
