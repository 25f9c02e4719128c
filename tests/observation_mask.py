"""Run a cleanba script on envs whose observations are partly hidden: the masked entries read 0 in every
observation the agent gets (reset and step), as the "memory matters" tests need (e.g. CartPole-v1 without its
velocities: a feed-forward agent cannot tell which way the pole moves).

usage: python tests/observation_mask.py SCRIPT INDICES [flags...]   (INDICES: comma-separated, e.g. 1,3)
"""

import sys

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from conftest import load_script  # noqa: E402


def masked(envs, indices: list[int]):
    """`envs` with observation entries `indices` zeroed (the envpool object itself, its reset and step wrapped)."""
    reset, step = envs.reset, envs.step

    def hide(obs):
        obs = np.array(obs, copy=True)
        obs[:, indices] = 0
        return obs

    def masked_reset(*args, **kwargs):
        obs, info = reset(*args, **kwargs)
        return hide(obs), info

    def masked_step(action):
        obs, *rest = step(action)
        return hide(obs), *rest

    envs.reset, envs.step = masked_reset, masked_step
    return envs


def main():
    script_path, indices = sys.argv[1], [int(i) for i in sys.argv[2].split(",")]
    sys.argv = [script_path, *sys.argv[3:]]
    from pathlib import Path

    script = load_script(Path(script_path))
    make_env = script.make_env
    script.make_env = lambda *args, **kwargs: masked(make_env(*args, **kwargs), indices)
    from cleanrl_utils.cli import run_cli

    sys.exit(run_cli(script.main, script.Args))


if __name__ == "__main__":
    main()
