"""Pure device functions for what the block manager asks of the pool: copy-on-write, swap, scrub.

Each acts on every array the pool indexes by page (`KVPool.page_arrays`: K and V, and a quantized
pool's scales), so the scales follow the pages. `copy_pages` is jitted with the pool donated.
Pad `src`/`dst` with NULL_PAGE -> NULL_PAGE pairs to a few bucket sizes so it compiles once per
bucket (a NULL_PAGE self-copy is harmless).
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
  return pool.with_page_arrays(x.at[:, dst].set(x[:, src]) for x in pool.page_arrays())


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


def read_pages(pool: KVPool, pages) -> tuple[np.ndarray, ...]:
  """Swap-out: host copies (NumPy) of `pages` of every page array (`KVPool.page_arrays`): K and
  V [num_layers, len(pages), page_size, K, D], then a quantized pool's K and V scales
  [num_layers, len(pages), S, H]."""
  pages = np.asarray(pages, np.int32)
  idx = np.full(_padded(len(pages)), NULL_PAGE, np.int32)
  idx[:len(pages)] = pages
  return tuple(np.asarray(x)[:, :len(pages)] for x in _read(pool, jnp.asarray(idx)))


@jax.jit
def _read(pool: KVPool, idx: jax.Array):
  return tuple(x[:, idx] for x in pool.page_arrays())


def write_pages(pool: KVPool, pages, *arrays) -> KVPool:
  """Swap-in: stores host copies back into (new) pages; inverse of `read_pages`.

  Args:
    pool: KVPool; donated.
    pages: i32[n] destination pages.
    *arrays: what `read_pages` returned for n pages (host or device arrays): k, v
      [num_layers, n, page_size, num_kv_heads, head_dim], then k_scale, v_scale of a quantized
      pool.
  """
  pages = np.asarray(pages, np.int32)
  n = len(pages)
  names = ("k", "v", "k_scale", "v_scale")
  if len(arrays) != len(pool.page_arrays()):
    raise ValueError(f"{len(arrays)} arrays for a pool of {len(pool.page_arrays())} page arrays "
                     f"({', '.join(names[:len(pool.page_arrays())])})")
  for name, x, ref in zip(names, arrays, pool.page_arrays()):
    want = (ref.shape[0], n) + ref.shape[2:]
    if tuple(x.shape) != want:
      raise ValueError(f"{name} shape {tuple(x.shape)} does not match {n} pages of a pool of "
                       f"shape {ref.shape}: expected {want}")
  m = _padded(n)   # padding writes zeros into NULL_PAGE, the scratch page padding rows use
  idx = np.full(m, NULL_PAGE, np.int32)
  idx[:n] = pages
  padded = tuple(jnp.pad(jnp.asarray(x), [(0, 0), (0, m - n)] + [(0, 0)] * (x.ndim - 2))
                 for x in arrays)
  return _write(pool, jnp.asarray(idx), padded)


@functools.partial(jax.jit, donate_argnames=("pool",))
def _write(pool: KVPool, pages: jax.Array, arrays) -> KVPool:
  return pool.with_page_arrays(x.at[:, pages].set(a.astype(x.dtype))
                               for x, a in zip(pool.page_arrays(), arrays))


@functools.partial(jax.jit, donate_argnames=("pool",))
def zero_pages(pool: KVPool, pages: jax.Array) -> KVPool:
  """Scrubs pages: K and V of `pages` (and their scales) become zeros in every layer (the
  engine's `scrub_freed_pages`). Pad `pages` with NULL_PAGE (zeroing it is harmless).

  Args:
    pool: KVPool; donated.
    pages: i32[n].
  """
  return pool.with_page_arrays(x.at[:, pages].set(0) for x in pool.page_arrays())
