"""The exact merge rule for partial softmax states (seeds, section 11), in f32, natural log base.

For one query, a block of keys yields a summary (m, z, u): its max score, its sum of exp(s - m),
and its exp-weighted sum of values. Summaries merge exactly:

  m = max_b m_b,  z = sum_b exp(m_b - m) z_b,  u = sum_b exp(m_b - m) u_b,  o = u / z.

Every attention path uses these functions: the XLA paged path (one merge per group of pages), the
Pallas kernel's split merge, and `paged_jax.attention.merge_states`. An empty summary (m = -inf,
z = 0, u = 0) is the identity; merging empties gives an empty, never NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


class Summary(NamedTuple):
  """Softmax state of a set of keys for each query, in f32 (natural log base).

  m: [...] max score (-inf when no key is visible).
  z: [...] sum of exp(s - m).
  u: [..., D] sum of exp(s - m) * v.
  """
  m: jax.Array
  z: jax.Array
  u: jax.Array


def block_summary(s, v, contract: str = "...t,...td->...d") -> Summary:
  """Summary of one block: s f32[..., T] masked scores (-inf = not visible), v f32[..., T, D].

  `contract` is the einsum from (probabilities, values) to the weighted value sum, for callers
  whose axes are laid out differently.
  """
  m = jnp.max(s, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)   # a block with no visible key: p = 0, not NaN
  p = jnp.exp(s - m_safe[..., None])
  return Summary(m, jnp.sum(p, axis=-1), jnp.einsum(contract, p, v, precision=_HIGHEST))


def merge_summaries(a: Summary, b: Summary) -> Summary:
  """The exact merge rule of the seeds' section 11. Merging two empty summaries gives an empty one."""
  m = jnp.maximum(a.m, b.m)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  wa, wb = jnp.exp(a.m - m_safe), jnp.exp(b.m - m_safe)   # exp(-inf) = 0 for empty sides
  return Summary(m, wa * a.z + wb * b.z, wa[..., None] * a.u + wb[..., None] * b.u)


def merge_along(s: Summary, axis: int = 0) -> Summary:
  """Merges summaries stacked along `axis` of m and z (and the same axis of u) in one pass."""
  m = jnp.max(s.m, axis=axis)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(s.m - jnp.expand_dims(m_safe, axis))
  return Summary(m, jnp.sum(w * s.z, axis=axis), jnp.sum(w[..., None] * s.u, axis=axis))


def finalize(s: Summary) -> tuple[jax.Array, jax.Array]:
  """(o, lse) from a summary: o = u / z (zeros when z == 0), lse = m + log z (-inf when empty)."""
  nonempty = s.z > 0
  o = s.u / jnp.where(nonempty, s.z, 1.0)[..., None]
  lse = jnp.where(nonempty, s.m + jnp.log(jnp.where(nonempty, s.z, 1.0)), -jnp.inf)
  return o, lse
