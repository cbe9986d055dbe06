"""Token sampling on device: greedy, or temperature with optional top-k / top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 = greedy. Hashable: a static argument of the jitted steps."""
  temperature: float = 0.0
  top_k: int | None = None
  top_p: float | None = None

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature} must be >= 0")
    if self.top_k is not None and self.top_k < 1:
      raise ValueError(f"top_k={self.top_k} must be >= 1")
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def sample(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
  """logits f32[num_seqs, vocab_size] -> i32[num_seqs]."""
  if cfg.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / cfg.temperature
  if cfg.top_k is not None:
    kth = jax.lax.top_k(logits, cfg.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if cfg.top_p is not None:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    keep_sorted = jnp.cumsum(probs, axis=-1) - probs < cfg.top_p   # always keeps the top token
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
