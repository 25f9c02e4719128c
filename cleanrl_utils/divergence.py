"""Divergence: a non-finite loss or learner state stops the run (one line), never a silently wrong result.

Each update the learner keeps a copy of the state it starts from (the update donates its input buffers); if the
update's loss terms or its new state hold a NaN or an infinity, the run (cleanrl_utils.run) checkpoints that copy,
the last finite state, and raises `Diverged`: one `error:` line naming the update and the loss terms, exit code 1,
no saved model.
"""

import numpy as np

from cleanrl_utils.errors import RunError

_all_finite = {}


def numbers(value) -> str:
    """A loss term for a line: one number, or one per seed (an Anakin run's --num-seeds)."""
    values = np.ravel(value)
    return f"{values[0]:.4g}" if values.size == 1 else "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


class Diverged(RunError):
    def __init__(self, update: int, metrics: dict):
        terms = ", ".join(
            f"{name.split('/')[-1]}={numbers(value)}" for name, value in metrics.items() if name.startswith("losses/")
        )
        super().__init__(
            f"update {update} diverged (a loss term or the learner's state is NaN or infinite): {terms}; "
            f"the last finite state is checkpoint {update - 1}; try lower learning rates (or a "
            "gradient clip, where the script has one)"
        )


def copy_state(tree):
    """A copy that survives the update's buffer donation (replicated arrays stay replicated)."""
    import jax

    return jax.tree.map(lambda x: x.copy(), tree)


def all_finite(metrics: dict, state) -> bool:
    """Whether every loss term (host values) and every leaf of `state` (arrays on the learner mesh) is finite."""
    import jax
    import jax.numpy as jnp

    from cleanrl_utils.devices import local_value

    if not all(np.all(np.isfinite(value)) for value in metrics.values()):  # per seed, in an Anakin run of several
        return False
    if "fn" not in _all_finite:
        _all_finite["fn"] = jax.jit(
            lambda tree: jnp.all(
                jnp.stack(
                    [
                        jnp.isfinite(leaf).all()
                        for leaf in jax.tree.leaves(tree)
                        if jnp.issubdtype(leaf.dtype, jnp.inexact)
                    ]
                )
            )
        )
    return bool(local_value(_all_finite["fn"](state)))
