"""Pure-jnp references for ragged (paged) attention: short, f32, obviously correct.

`dense_attention` is the project's definition of attention; every fast path (the XLA paged path in
`paged_jax.attention`, the Pallas kernel here) is tested against it. `paged_attention_reference`
gathers pages into dense K/V and calls it, with the same signature as the kernel.

Ragged layout: queries of all sequences are concatenated, `q: [num_tokens, num_q_heads, head_dim]`,
and sequence b owns tokens `cu_q_lens[b]:cu_q_lens[b+1]`. Its query i sits at position
`kv_lens[b] - q_len[b] + i` and sees keys at positions p with p <= that position (causal),
p < kv_lens[b], and, with a sliding window W, position - p < W. Tokens past `cu_q_lens[-1]`
are padding and get zeros.

Einsum letters: B seqs, Q query slots per seq, T kv tokens, K kv heads, G q heads per kv head,
D head_dim.

This module never imports paged_jax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


def check_static_args(q, k, v, block_tables_or_none, kv_lens, cu_q_lens, *,
                      max_q_len: int | None = None, sliding_window: int | None = None,
                      soft_cap: float | None = None) -> None:
  """Shape, dtype and option checks that cost nothing under jit (they read static values only).

  Where `cu_q_lens` is a concrete array (an eager call, not a trace), it also checks that no
  row's q_len exceeds `max_q_len` (queries past the bound would be dropped silently).

  Raises:
    ValueError naming the offending values.
  """
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"sliding_window={sliding_window} must be >= 1 (None: no window)")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap={soft_cap} must be > 0 (None: no capping)")
  if max_q_len is not None and max_q_len < 1:
    raise ValueError(f"max_q_len={max_q_len} must be >= 1")
  if q.ndim != 3:
    raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim]; got shape {q.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
  if k.dtype != v.dtype or q.dtype != k.dtype:
    raise ValueError(f"dtypes differ: q={q.dtype}, k={k.dtype}, v={v.dtype}")
  num_q_heads, head_dim = q.shape[1], q.shape[2]
  num_kv_heads, kv_head_dim = k.shape[-2], k.shape[-1]
  if kv_head_dim != head_dim:
    raise ValueError(f"head dims differ: q head_dim={head_dim}, kv head_dim={kv_head_dim}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"num_q_heads={num_q_heads} must be divisible by num_kv_heads={num_kv_heads}")
  named = [("kv_lens", kv_lens), ("cu_q_lens", cu_q_lens)]
  if block_tables_or_none is not None:
    named.append(("block_tables", block_tables_or_none))
  for name, arr in named:
    if arr.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32; got {arr.dtype}")
  num_seqs = kv_lens.shape[0]
  if cu_q_lens.shape != (num_seqs + 1,):
    raise ValueError(f"cu_q_lens shape {cu_q_lens.shape} must be (num_seqs + 1,) = ({num_seqs + 1},)")
  if block_tables_or_none is not None and block_tables_or_none.shape[0] != num_seqs:
    raise ValueError(f"block_tables has {block_tables_or_none.shape[0]} rows but kv_lens has "
                     f"{num_seqs}")
  if max_q_len is not None and not isinstance(cu_q_lens, jax.core.Tracer):
    check_max_q_len(np.asarray(cu_q_lens), max_q_len)


def check_max_q_len(cu_q_lens: np.ndarray, max_q_len: int) -> None:
  """Raises ValueError if a row of the (host) offsets is longer than the static bound."""
  q_lens = np.diff(cu_q_lens)
  if q_lens.size and q_lens.max() > max_q_len:
    b = int(np.argmax(q_lens))
    raise ValueError(f"sequence {b}: q_len={int(q_lens[b])} exceeds max_q_len={max_q_len} "
                     f"(its queries past the bound would be dropped)")


def empty_result(q, return_lse: bool = False):
  """The output of attention over zero query tokens: [0, num_q_heads, head_dim] (and lse)."""
  o = jnp.zeros(q.shape, q.dtype)
  return (o, jnp.zeros(q.shape[:2], jnp.float32)) if return_lse else o


def ragged_to_padded(q, cu_q_lens, kv_lens, max_q_len: int):
  """Gathers ragged queries into per-sequence rows.

  Args:
    q: [num_tokens, num_q_heads, head_dim].
    cu_q_lens: i32[num_seqs + 1].
    kv_lens: i32[num_seqs].
    max_q_len: static bound on q_len.

  Returns:
    q_padded: [num_seqs, max_q_len, num_q_heads, head_dim] (garbage where not `q_valid`).
    q_pos: i32[num_seqs, max_q_len] position of each query in its sequence.
    q_valid: bool[num_seqs, max_q_len].
  """
  num_tokens = q.shape[0]
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  i = jnp.arange(max_q_len, dtype=jnp.int32)
  token = cu_q_lens[:-1, None] + i[None, :]
  q_valid = i[None, :] < q_lens[:, None]
  q_padded = q[jnp.clip(token, 0, max(num_tokens - 1, 0))]
  q_pos = kv_lens[:, None] - q_lens[:, None] + i[None, :]
  return q_padded, q_pos, q_valid


def padded_to_ragged(o_padded, cu_q_lens, num_tokens: int):
  """Inverse of `ragged_to_padded`: [num_seqs, max_q_len, ...] -> [num_tokens, ...]; padding -> 0."""
  num_seqs, max_q_len = o_padded.shape[:2]
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, num_seqs - 1)
  i = t - cu_q_lens[seq]
  valid = (t < cu_q_lens[-1]) & (i < max_q_len)
  out = o_padded[seq, jnp.clip(i, 0, max_q_len - 1)]
  return jnp.where(valid.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0).astype(o_padded.dtype)


def attention_mask(q_pos, q_valid, kv_pos, kv_lens, sliding_window):
  """bool[num_seqs, max_q_len, kv_tokens]: which keys each query may see (causal, length, window)."""
  mask = (q_valid[:, :, None]
          & (kv_pos[None, None, :] < kv_lens[:, None, None])
          & (kv_pos[None, None, :] <= q_pos[:, :, None]))
  if sliding_window is not None:
    mask &= q_pos[:, :, None] - kv_pos[None, None, :] < sliding_window
  return mask


def dense_attention(q, k, v, cu_q_lens, kv_lens, *, scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    max_q_len: int | None = None):
  """Masked softmax attention over contiguous K/V, accumulated in f32.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged (see module docstring).
    k: dtype[num_seqs, max_kv_len, num_kv_heads, head_dim]; rows past kv_lens may hold anything.
    v: same as `k`.
    cu_q_lens: i32[num_seqs + 1].
    kv_lens: i32[num_seqs] keys per sequence, this step's included; 0 marks a padding row.
    scale: softmax scale; default 1 / sqrt(head_dim).
    sliding_window: if set, a query at position t sees keys at t - W + 1 .. t.
    soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap) (after scaling).
    max_q_len: static bound on any q_len; default num_tokens (always safe).

  Returns:
    dtype[num_tokens, num_q_heads, head_dim]; a query that sees no key gets zeros.
  """
  check_static_args(q, k, v, None, kv_lens, cu_q_lens, max_q_len=max_q_len,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  if q.shape[0] == 0:
    return empty_result(q)
  num_tokens, num_q_heads, head_dim = q.shape
  num_seqs, max_kv_len, num_kv_heads, _ = k.shape
  group = num_q_heads // num_kv_heads
  max_q_len = num_tokens if max_q_len is None else max_q_len
  scale = head_dim ** -0.5 if scale is None else scale

  q_padded, q_pos, q_valid = ragged_to_padded(q, cu_q_lens, kv_lens, max_q_len)
  qg = q_padded.astype(jnp.float32).reshape(num_seqs, max_q_len, num_kv_heads, group, head_dim)
  kv_pos = jnp.arange(max_kv_len, dtype=jnp.int32)
  kv_valid = (kv_pos[None, :] < kv_lens[:, None])[..., None, None]
  # jnp.where, not multiplication: 0 * NaN is NaN, and unused slots may hold NaN.
  kf = jnp.where(kv_valid, k, 0).astype(jnp.float32)
  vf = jnp.where(kv_valid, v, 0).astype(jnp.float32)

  s = jnp.einsum("bqkgd,btkd->bkgqt", qg, kf, precision=_HIGHEST) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  mask = attention_mask(q_pos, q_valid, kv_pos, kv_lens, sliding_window)
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m)
  z = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bkgqt,btkd->bkgqd", p, vf, precision=_HIGHEST) / jnp.where(z > 0, z, 1.0)
  o = o.transpose(0, 3, 1, 2, 4).reshape(num_seqs, max_q_len, num_q_heads, head_dim)
  return padded_to_ragged(o, cu_q_lens, num_tokens).astype(q.dtype)


def gather_pages(pages, block_tables):
  """[num_pages, page_size, K, D] through i32[num_seqs, max_pages_per_seq] -> [num_seqs, T, K, D]."""
  num_seqs = block_tables.shape[0]
  return pages[block_tables].reshape(num_seqs, -1, *pages.shape[2:])


def paged_attention_reference(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                              scale: float | None = None, sliding_window: int | None = None,
                              soft_cap: float | None = None, max_q_len: int | None = None):
  """Gathers K/V through the block table, then `dense_attention`. Same signature as the kernel.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim].
    k_pages: dtype[num_pages, page_size, num_kv_heads, head_dim] (one layer of the pool).
    v_pages: same as `k_pages`.
    block_tables: i32[num_seqs, max_pages_per_seq].
    seq_lens: i32[num_seqs].
    cu_q_lens: i32[num_seqs + 1].

  Returns:
    dtype[num_tokens, num_q_heads, head_dim].
  """
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, max_q_len=max_q_len,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  return dense_attention(q, gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables),
                         cu_q_lens, seq_lens, scale=scale, sliding_window=sliding_window,
                         soft_cap=soft_cap, max_q_len=max_q_len)
