"""Exact attention over the paged KV pool, by blocked softmax merging (seeds, section 11).

For one query, each block of keys yields a summary (m, z, u): its max score, its sum of
exp(s - m), and its exp-weighted sum of values. Summaries merge exactly:

  m = max_b m_b,  z = sum_b exp(m_b - m) z_b,  u = sum_b exp(m_b - m) u_b,  o = u / z.

`merge_summaries` is that rule, and everything here uses it: the XLA paged path (a loop over
groups of pages read through the block table), its contiguous twin (the same loop over dense K/V,
the fair baseline for benchmarks), the Pallas kernel's split merge, and `merge_states` for
(output, log-sum-exp) pairs. `paged_attention` dispatches between the Pallas (Triton) kernel, on
CUDA GPUs of compute capability >= 8.0, and the XLA path everywhere else.

`dense_attention` (the definition every path is tested against) and the merge rule live beside
the Pallas kernel in `pallas_kernels.paged_attention` (which may not import this package), and are
re-exported here.

Einsum letters: B seqs, Q query slots per seq, T kv tokens in a block, K kv heads, G q heads per
kv head, D head_dim.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import kernel_triton
from pallas_kernels.paged_attention.merge import (Summary, block_summary, finalize,
                                                  merge_summaries)
from pallas_kernels.paged_attention.reference import (attention_mask, check_static_args,
                                                      dense_attention, padded_to_ragged,
                                                      paged_attention_reference, ragged_to_padded)
from paged_jax.state import NULL_PAGE

__all__ = ["Summary", "block_summary", "merge_summaries", "finalize", "merge_states",
           "dense_attention", "paged_attention_reference", "paged_attention", "paged_attention_xla",
           "kernel_unavailable_reason", "IMPLS",
           "contiguous_attention", "validate_attention_inputs", "DEFAULT_BLOCK_TOKENS"]

_HIGHEST = jax.lax.Precision.HIGHEST

# Keys per loop iteration of the XLA paths. 64 was fastest for decode on this 2-core CPU
# (experiments/attention_bench.py --block_tokens sweeps it); a block stays in L2 between the
# score and value passes.
DEFAULT_BLOCK_TOKENS = 64


def merge_states(o_a, lse_a, o_b, lse_b) -> tuple[jax.Array, jax.Array]:
  """Merges two partial attention results over disjoint key sets (FlashInfer's merge, base e).

  Args:
    o_a: [..., D] output of part a; lse_a: [...] its natural-log log-sum-exp of scores.
    o_b, lse_b: the same for part b.

  Returns:
    (o, lse) over the union of keys. Two empty parts (lse = -inf) give zeros and -inf, never NaN.
  """
  as_summary = lambda o, lse: Summary(lse.astype(jnp.float32), jnp.where(jnp.isfinite(lse), 1.0, 0.0),
                                      jnp.where(jnp.isfinite(lse)[..., None], o, 0).astype(jnp.float32))
  o, lse = finalize(merge_summaries(as_summary(o_a, lse_a), as_summary(o_b, lse_b)))
  return o.astype(o_a.dtype), lse


def _blocked_attention(fetch: Callable[[jax.Array], tuple[jax.Array, jax.Array]], max_blocks: int,
                       block_tokens: int, num_kv_heads: int, q, seq_lens, cu_q_lens, *, max_q_len,
                       scale, sliding_window, soft_cap, return_lse):
  """Online softmax over key blocks: fetch(j) -> (k, v) dtype[B, block_tokens, K, D].

  The loop runs ceil(max(seq_lens) / block_tokens) times (at most max_blocks): work follows the
  longest sequence in the batch, not the table's capacity.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  max_q_len = num_tokens if max_q_len is None else max_q_len
  scale = head_dim ** -0.5 if scale is None else scale
  num_blocks = jnp.minimum((jnp.max(seq_lens, initial=0) + block_tokens - 1) // block_tokens,
                           max_blocks)
  num_seqs = seq_lens.shape[0]
  group = num_q_heads // num_kv_heads
  q_padded, q_pos, q_valid = ragged_to_padded(q, cu_q_lens, seq_lens, max_q_len)
  qg = (q_padded.astype(jnp.float32) * scale).reshape(
      num_seqs, max_q_len, num_kv_heads, group, head_dim)

  def body(j, acc: Summary) -> Summary:
    k, v = fetch(j)
    kv_pos = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    kv_valid = kv_pos[None, :] < seq_lens[:, None]
    # Mask V, not only the scores: p = 0 times a NaN in a stale slot is still NaN. A NaN in K
    # only reaches a score, which the -inf mask below replaces.
    v = jnp.where(kv_valid[..., None, None], v, 0).astype(jnp.float32)
    s = jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32), precision=_HIGHEST)
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    mask = attention_mask(q_pos, q_valid, kv_pos, seq_lens, sliding_window)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    return merge_summaries(acc, block_summary(s, v, "bkgqt,btkd->bkgqd"))

  lead = (num_seqs, num_kv_heads, group, max_q_len)
  init = Summary(jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32),
                 jnp.zeros(lead + (head_dim,), jnp.float32))
  acc = jax.lax.fori_loop(0, num_blocks, body, init)
  o, lse = finalize(acc)
  o = o.transpose(0, 3, 1, 2, 4).reshape(num_seqs, max_q_len, num_q_heads, head_dim)
  o = padded_to_ragged(o, cu_q_lens, num_tokens).astype(q.dtype)
  if not return_lse:
    return o
  lse = padded_to_ragged(lse.transpose(0, 3, 1, 2).reshape(num_seqs, max_q_len, num_q_heads),
                         cu_q_lens, num_tokens)
  return o, jnp.where(jnp.arange(num_tokens)[:, None] < cu_q_lens[-1], lse, -jnp.inf)


IMPLS = ("auto", "xla", "pallas")
_KERNEL_MIN_COMPUTE_CAPABILITY = (8, 0)   # Triton backend's floor (Ampere)


def kernel_unavailable_reason(head_dim: int | None = None, page_size: int | None = None,
                              device: jax.Device | None = None) -> str | None:
  """Why the Pallas (Triton) kernel cannot run compiled here, or None if it can.

  It needs a CUDA GPU of compute capability >= 8.0 (CPU, TPU and older GPUs such as Colab's T4 take
  the XLA path), head_dim a multiple of 16 and a power-of-two page_size.
  """
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return f"the Triton kernel needs a CUDA GPU; this device is {device.platform}"
  capability = getattr(device, "compute_capability", None)
  if capability is None:
    return f"{device.device_kind} reports no CUDA compute capability (not a CUDA GPU?)"
  major, minor = (int(x) for x in str(capability).split(".")[:2])
  if (major, minor) < _KERNEL_MIN_COMPUTE_CAPABILITY:
    return (f"{device.device_kind} has compute capability {capability}; the Triton backend "
            f"needs >= 8.0")
  if head_dim is not None and head_dim % 16:
    return f"head_dim={head_dim} is not a multiple of 16"
  if page_size is not None and page_size & (page_size - 1):
    return f"page_size={page_size} is not a power of two"
  return None


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                    max_q_len: int | None = None, scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    return_lse: bool = False, impl: str = "auto",
                    pages_per_block: int | None = None,
                    block_sizes: kernel_triton.BlockSizes | None = None, interpret: bool = False):
  """Ragged paged attention; dispatches to the Pallas kernel or the XLA path.

  `impl="auto"` runs the Triton kernel on CUDA GPUs of compute capability >= 8.0 (when the shapes
  suit it) and the XLA path everywhere else; "xla" and "pallas" force one. Forcing "pallas" where
  it cannot run compiled raises a ValueError saying why, unless `interpret=True` (Pallas' CPU
  interpreter, for tests). Arguments are those of `paged_attention_xla`; `pages_per_block` tunes
  the XLA path, `block_sizes` the kernel.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
  reason = kernel_unavailable_reason(q.shape[-1], k_pages.shape[1])
  if impl == "pallas" and reason is not None and not interpret:
    raise ValueError(f"impl='pallas' cannot run here: {reason}. Use impl='xla' (or "
                     f"interpret=True to run the kernel through Pallas' interpreter).")
  use_kernel = impl == "pallas" or (impl == "auto" and reason is None)
  kw = dict(max_q_len=max_q_len, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
            return_lse=return_lse)
  if use_kernel:
    return kernel_triton.paged_attention(
        q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
        block_sizes=block_sizes or kernel_triton.BlockSizes(), interpret=interpret, **kw)
  return paged_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                             pages_per_block=pages_per_block, **kw)


@functools.partial(jax.jit, static_argnames=("max_q_len", "scale", "sliding_window", "soft_cap",
                                             "pages_per_block", "return_lse"))
def paged_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                        max_q_len: int | None = None, scale: float | None = None,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        pages_per_block: int | None = None, return_lse: bool = False):
  """Ragged paged attention in plain JAX/XLA, by blocked softmax merging over groups of pages.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged by `cu_q_lens` (prefill chunks and decode
      rows may be mixed in one batch).
    k_pages: dtype[num_pages, page_size, num_kv_heads, head_dim] (one layer of `KVPool.k`).
    v_pages: same as `k_pages`.
    block_tables: i32[num_seqs, max_pages_per_seq]; unused entries NULL_PAGE.
    seq_lens: i32[num_seqs] keys per sequence including this step's; 0 marks a padding row.
    cu_q_lens: i32[num_seqs + 1].
    max_q_len: static bound on any q_len (1 for pure decode); default num_tokens.
    scale: softmax scale; default 1 / sqrt(head_dim).
    sliding_window: if set, a query at position t sees keys t - W + 1 .. t.
    soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
    pages_per_block: pages read per loop iteration; default DEFAULT_BLOCK_TOKENS // page_size.
    return_lse: also return f32[num_tokens, num_q_heads] log-sum-exp (natural log).

  Returns:
    dtype[num_tokens, num_q_heads, head_dim] (and lse if asked). Values are validated only by
    `validate_attention_inputs`; this jitted path checks shapes and dtypes alone.
  """
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens)
  num_seqs, max_pages_per_seq = block_tables.shape
  page_size = k_pages.shape[1]
  if pages_per_block is None:
    pages_per_block = max(1, DEFAULT_BLOCK_TOKENS // page_size)
  pages_per_block = min(pages_per_block, max_pages_per_seq)
  max_blocks = -(-max_pages_per_seq // pages_per_block)
  tables = jnp.pad(block_tables, ((0, 0), (0, max_blocks * pages_per_block - max_pages_per_seq)),
                   constant_values=NULL_PAGE)
  block_tokens = pages_per_block * page_size

  def fetch(j):
    pages = jax.lax.dynamic_slice_in_dim(tables, j * pages_per_block, pages_per_block, axis=1)
    shape = (num_seqs, block_tokens) + k_pages.shape[2:]
    return k_pages[pages].reshape(shape), v_pages[pages].reshape(shape)

  return _blocked_attention(
      fetch, max_blocks, block_tokens, k_pages.shape[2], q, seq_lens, cu_q_lens,
      max_q_len=max_q_len, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
      return_lse=return_lse)


@functools.partial(jax.jit, static_argnames=("max_q_len", "scale", "sliding_window", "soft_cap",
                                             "block_tokens", "return_lse"))
def contiguous_attention(q, k, v, seq_lens, cu_q_lens, *, max_q_len: int | None = None,
                         scale: float | None = None, sliding_window: int | None = None,
                         soft_cap: float | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                         return_lse: bool = False):
  """The paged path's loop over contiguous K/V: what paging costs is the difference between the two.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged by `cu_q_lens`.
    k: dtype[num_seqs, max_kv_len, num_kv_heads, head_dim].
    v: same as `k`.
    seq_lens, cu_q_lens, max_q_len, scale, sliding_window, soft_cap, return_lse: as in
      `paged_attention`.
    block_tokens: keys per loop iteration.

  Returns:
    dtype[num_tokens, num_q_heads, head_dim] (and lse if asked).
  """
  check_static_args(q, k, v, None, seq_lens, cu_q_lens)
  max_kv_len = k.shape[1]
  block_tokens = min(block_tokens, max_kv_len)
  max_blocks = -(-max_kv_len // block_tokens)
  pad = ((0, 0), (0, max_blocks * block_tokens - max_kv_len), (0, 0), (0, 0))
  if pad[1][1]:
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)

  def fetch(j):
    return (jax.lax.dynamic_slice_in_dim(k, j * block_tokens, block_tokens, axis=1),
            jax.lax.dynamic_slice_in_dim(v, j * block_tokens, block_tokens, axis=1))

  return _blocked_attention(
      fetch, max_blocks, block_tokens, k.shape[2], q, seq_lens, cu_q_lens,
      max_q_len=max_q_len, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
      return_lse=return_lse)


def validate_attention_inputs(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens) -> None:
  """Value checks for one step's inputs, on the host (NumPy). Tests and the host batcher call it;
  the jitted paths do not, so a decode step never pays for it.

  Raises:
    ValueError naming the offending values: shapes/dtypes (as in the jitted paths), negative or
    non-monotone query offsets, a q_len larger than its kv_len, lengths beyond the table's
    capacity, page ids outside [0, num_pages), or NULL_PAGE inside a sequence's live pages.
  """
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens)
  tables = np.asarray(block_tables)
  lens = np.asarray(seq_lens)
  cu = np.asarray(cu_q_lens)
  num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
  if cu[0] != 0 or np.any(np.diff(cu) < 0):
    raise ValueError(f"cu_q_lens={cu.tolist()} must start at 0 and never decrease")
  if cu[-1] > q.shape[0]:
    raise ValueError(f"cu_q_lens[-1]={cu[-1]} exceeds num_tokens={q.shape[0]}")
  if np.any(lens < 0):
    raise ValueError(f"seq_lens={lens.tolist()} has negative entries")
  q_lens = np.diff(cu)
  bad = np.flatnonzero(q_lens > lens)
  if bad.size:
    b = int(bad[0])
    raise ValueError(f"sequence {b}: q_len={q_lens[b]} is larger than its kv_len={lens[b]}")
  capacity = tables.shape[1] * page_size
  bad = np.flatnonzero(lens > capacity)
  if bad.size:
    b = int(bad[0])
    raise ValueError(f"sequence {b}: seq_len={lens[b]} exceeds the block table's capacity "
                     f"{tables.shape[1]} pages x page_size={page_size} = {capacity}")
  out_of_range = (tables < 0) | (tables >= num_pages)
  if out_of_range.any():
    b, j = map(int, np.argwhere(out_of_range)[0])
    raise ValueError(f"block_tables[{b}, {j}]={tables[b, j]} is outside [0, num_pages={num_pages})")
  live = np.arange(tables.shape[1])[None, :] < -(-lens[:, None] // page_size)
  null_live = live & (tables == NULL_PAGE)
  if null_live.any():
    b, j = map(int, np.argwhere(null_live)[0])
    raise ValueError(f"block_tables[{b}, {j}] is NULL_PAGE but sequence {b} has "
                     f"seq_len={lens[b]} tokens, so page {j} is live")
