"""What the Anakin tests share (tests/test_anakin.py, in-process and the README's commands; tests/test_anakin_runs.py,
the scripts run as processes): the two scripts, an env of each family, the tiny runs' flags and the digests' pattern."""

import re

from conftest import ANAKIN_SCRIPT, CONTINUOUS_ANAKIN_SCRIPT, load_script

anakin = load_script(ANAKIN_SCRIPT)
anakin_continuous = load_script(CONTINUOUS_ANAKIN_SCRIPT)

# tiny runs: 8 envs per device x 16 steps = 128 env steps per update, one 16-unit layer
TINY = "--local-num-envs 8 --num-steps 16 --hiddens 16 --num-minibatches 2 --update-epochs 2 --log-frequency 1".split()
# an env of each library jax_envs adapts
FAMILIES = ["MiniGrid-Empty-5x5", "minatar-breakout", "Craftax-Classic-Symbolic-v1", "CartpoleBalance"]
# an env of each script, for what the scripts do alike for every family (data parallelism, several processes): each
# family's own code, its adapter, is checked against its library and by a resume with the envs' state bit for bit
ONE_PER_SCRIPT = ["MiniGrid-Empty-5x5", "CartpoleBalance"]
DIGESTS = re.compile(r"params sha256=([0-9a-f]{64}) envs sha256=([0-9a-f]{64})")


def script_of(env_id: str):
    """The Anakin script for the env's action kind, and its path."""
    if env_id.startswith(("MiniGrid-", "minatar-", "Craftax-")):
        return anakin, ANAKIN_SCRIPT
    return anakin_continuous, CONTINUOUS_ANAKIN_SCRIPT


def final_digests(out: str) -> tuple:
    return DIGESTS.search(out.split("final ")[-1]).groups()
