"""Writes this step's keys and values into the paged pool. Pure; the caller donates the pool."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from paged_jax import kv_quant
from paged_jax.state import KVPool


@functools.partial(jax.jit, static_argnames=("layer",), donate_argnames=("pool",))
def write_kv(pool: KVPool, layer: int, k: jax.Array, v: jax.Array, slots: jax.Array) -> KVPool:
  """Scatters K/V of `num_tokens` tokens into layer `layer` of the pool.

  Args:
    pool: KVPool; donated, do not reuse it.
    layer: static layer index.
    k: [num_tokens, num_kv_heads, head_dim], cast to the pool's dtype (quantized by
      `kv_quant.write_layer` when the pool is).
    v: same as `k`.
    slots: i32[num_tokens] flat slot `page * page_size + offset` per token. Padding tokens point
      into NULL_PAGE; never use -1 (JAX wraps it to the last slot of the pool).

  Returns:
    The updated pool.
  """
  chex.assert_equal_shape([k, v])
  chex.assert_shape(k, (slots.shape[0], pool.num_kv_heads, pool.head_dim))
  if not 0 <= layer < pool.num_layers:
    raise ValueError(f"layer={layer} is outside [0, num_layers={pool.num_layers})")
  slots = slots + pool.layer_offset(layer) * pool.page_size   # into the flat view
  pages_k, pages_v = pool.flat()
  if pool.quantized:
    scales_k, scales_v = pool.flat_scales()
    pages_k, scales_k, _ = kv_quant.write_layer(pages_k, scales_k, k, slots, pool.fmt)
    pages_v, scales_v, _ = kv_quant.write_layer(pages_v, scales_v, v, slots, pool.fmt)
    return pool.from_flat(pages_k, pages_v, scales_k, scales_v)
  return pool.from_flat(write_kv_layer(pages_k, k, slots), write_kv_layer(pages_v, v, slots))


def write_kv_layer(pages: jax.Array, x: jax.Array, slots: jax.Array) -> jax.Array:
  """`pages` [num_pages, page_size, K, D] (one layer, or the pool's flat view with offset slots)
  with x[t] stored at slot slots[t]."""
  page_size = pages.shape[1]
  if slots.shape[0] == 1:
    # One token (a single user's decode): written twice to the same slot, so that XLA keeps a
    # scatter. A one-index scatter becomes a dynamic-update-slice, which XLA:CPU fuses with the
    # step's reads of the same pages and then copies the whole pool around, every layer of every
    # step (SmolLM2-135M's pool: ~0.1 s per token).
    slots, x = jnp.concatenate([slots, slots]), jnp.concatenate([x, x])
  return pages.at[slots // page_size, slots % page_size].set(x.astype(pages.dtype))
