"""Running normalization of observations and rewards with statistics that are learned state (mean, variance and
count per feature, mergeable shard by shard): what the continuous-control on-policy scripts normalize with."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RunningMeanStd(NamedTuple):
    """Mean, variance and count of a stream of samples (per feature); mergeable, shard by shard."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array


def merge_running_stats(a: RunningMeanStd, b: RunningMeanStd) -> RunningMeanStd:
    """The statistics of the union of two samples, from theirs (Chan, Golub and LeVeque 1979)."""
    count, delta = a.count + b.count, b.mean - a.mean
    mean = a.mean + delta * b.count / count
    sum_of_squares = a.var * a.count + b.var * b.count + delta**2 * a.count * b.count / count
    return RunningMeanStd(mean, sum_of_squares / count, count)


def batch_running_stats(x, weights, axis_name: str | None = None) -> RunningMeanStd:
    """Statistics of the samples x (first axis) with 0/1 weights; with axis_name (inside shard_map), of the samples
    of all devices: counts and sums are psum-ed, so every device gets those of the whole batch."""
    psum = (lambda v: jax.lax.psum(v, axis_name)) if axis_name else (lambda v: v)
    count = psum(weights.sum(dtype=jnp.float32))
    weights = weights.reshape(weights.shape + (1,) * (x.ndim - 1)).astype(jnp.float32)
    mean = psum((weights * x).sum(0)) / jnp.maximum(count, 1)
    var = psum((weights * (x - mean) ** 2).sum(0)) / jnp.maximum(count, 1)  # two passes: no cancellation
    return RunningMeanStd(mean, var, count)


def normalize_obs(obs_rms: RunningMeanStd, obs):
    # standardized and clipped to [-10, 10] as in baselines' VecNormalize; Andrychowicz et al. 2021 ("What matters
    # in on-policy RL") recommend always normalizing observations
    return jnp.clip((obs - obs_rms.mean) / jnp.sqrt(obs_rms.var + 1e-8), -10.0, 10.0)


def scale_rewards(return_rms: RunningMeanStd, rewards):
    # divided by the std of the discounted return, clipped to [-10, 10]: baselines' VecNormalize, the "reward
    # scaling" of Engstrom et al. 2020 ("Implementation matters in deep policy gradients")
    return jnp.clip(rewards / jnp.sqrt(return_rms.var + 1e-8), -10.0, 10.0)
