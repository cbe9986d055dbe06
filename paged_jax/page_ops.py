"""Pure device functions for what the block manager asks of the pool: copy-on-write, swap, scrub.

`copy_pages` is jitted with the pool donated. Pad `src`/`dst` with NULL_PAGE -> NULL_PAGE pairs
to a few bucket sizes so it compiles once per bucket (a NULL_PAGE self-copy is harmless).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.state import NULL_PAGE, KVPool


@functools.partial(jax.jit, donate_argnames=("pool",))
def copy_pages(pool: KVPool, src: jax.Array, dst: jax.Array) -> KVPool:
  """Copies page src[i] to page dst[i] in every layer, K and V.

  Args:
    pool: KVPool; donated.
    src: i32[num_copies] source pages.
    dst: i32[num_copies] destination pages (distinct, and none of them a source).

  Returns:
    The updated pool.
  """
  if src.shape != dst.shape or src.ndim != 1:
    raise ValueError(f"src {src.shape} and dst {dst.shape} must be equal 1-D shapes")
  return pool.replace(k=pool.k.at[:, dst].set(pool.k[:, src]),
                      v=pool.v.at[:, dst].set(pool.v[:, src]))


def check_copy_batch(src, dst) -> None:
  """Raises AssertionError if a copy batch conflicts: a destination page twice, or a destination
  that is also a source (the order of conflicting scatters is unspecified in XLA). NULL_PAGE ->
  NULL_PAGE padding pairs are ignored. Host side (NumPy)."""
  src, dst = np.asarray(src), np.asarray(dst)
  real = ~((src == NULL_PAGE) & (dst == NULL_PAGE))
  src, dst = src[real], dst[real]
  values, counts = np.unique(dst, return_counts=True)
  if np.any(counts > 1):
    raise AssertionError(f"copy batch writes page(s) {values[counts > 1].tolist()} twice: "
                         f"{list(zip(src.tolist(), dst.tolist()))}")
  both = np.intersect1d(src, dst)
  if both.size:
    raise AssertionError(f"copy batch reads and writes page(s) {both.tolist()}: "
                         f"{list(zip(src.tolist(), dst.tolist()))}")
  if np.any(dst == NULL_PAGE):
    raise AssertionError(f"copy batch writes NULL_PAGE: {list(zip(src.tolist(), dst.tolist()))}")


def _padded(n: int) -> int:
  """Page counts of swaps are padded to a power of two (with NULL_PAGE), so a run meets a few
  compiled programs, not one per distinct count."""
  return 1 << max(0, (n - 1).bit_length())


def read_pages(pool: KVPool, pages) -> tuple[np.ndarray, np.ndarray]:
  """Swap-out: host copies (NumPy) of K and V of `pages`, [num_layers, len(pages), page_size, K, D]."""
  pages = np.asarray(pages, np.int32)
  idx = np.full(_padded(len(pages)), NULL_PAGE, np.int32)
  idx[:len(pages)] = pages
  k, v = _read(pool, jnp.asarray(idx))
  return np.asarray(k)[:, :len(pages)], np.asarray(v)[:, :len(pages)]


@jax.jit
def _read(pool: KVPool, idx: jax.Array):
  return pool.k[:, idx], pool.v[:, idx]


def write_pages(pool: KVPool, pages, k, v) -> KVPool:
  """Swap-in: stores host copies back into (new) pages; inverse of `read_pages`.

  Args:
    pool: KVPool; donated.
    pages: i32[n] destination pages.
    k, v: [num_layers, n, page_size, num_kv_heads, head_dim] (host or device arrays).
  """
  pages = np.asarray(pages, np.int32)
  n = len(pages)
  want = (pool.num_layers, n, pool.page_size, pool.num_kv_heads, pool.head_dim)
  if tuple(k.shape) != want or tuple(v.shape) != want:
    raise ValueError(f"k / v shapes {tuple(k.shape)} / {tuple(v.shape)} do not match {n} pages "
                     f"of a pool of shape {pool.k.shape}: expected "
                     f"{want}")
  m = _padded(n)   # padding writes zeros into NULL_PAGE, the scratch page padding rows use
  idx = np.full(m, NULL_PAGE, np.int32)
  idx[:n] = pages
  pad = [(0, 0), (0, m - n)] + [(0, 0)] * 3
  return _write(pool, jnp.asarray(idx), jnp.pad(jnp.asarray(k), pad), jnp.pad(jnp.asarray(v), pad))


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write(pool: KVPool, pages: jax.Array, k: jax.Array, v: jax.Array) -> KVPool:
  return pool.replace(k=pool.k.at[:, pages].set(k.astype(pool.dtype)),
                      v=pool.v.at[:, pages].set(v.astype(pool.dtype)))


@functools.partial(jax.jit, donate_argnames=("pool",))
def zero_pages(pool: KVPool, pages: jax.Array) -> KVPool:
  """Scrubs pages: K and V of `pages` become zeros in every layer (the engine's
  `scrub_freed_pages`). Pad `pages` with NULL_PAGE (zeroing it is harmless).

  Args:
    pool: KVPool; donated.
    pages: i32[n].
  """
  return pool.replace(k=pool.k.at[:, pages].set(0), v=pool.v.at[:, pages].set(0))
