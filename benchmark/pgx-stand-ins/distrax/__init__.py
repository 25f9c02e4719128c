"""Measurement-only stand-in for distrax.Categorical (TFP does not import on current JAX)."""

import jax
import jax.numpy as jnp


class Categorical:
    def __init__(self, logits):
        self.logits = logits
        self.log_probs = jax.nn.log_softmax(logits, axis=-1)

    def sample(self, seed):
        return jax.random.categorical(seed, self.logits, axis=-1)

    def log_prob(self, value):
        return jnp.take_along_axis(self.log_probs, value[..., None].astype(jnp.int32), axis=-1)[..., 0]

    def entropy(self):
        return -jnp.sum(jnp.exp(self.log_probs) * self.log_probs, axis=-1)

    def mode(self):
        return jnp.argmax(self.logits, axis=-1)
