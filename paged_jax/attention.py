"""Exact attention over the paged KV pool, by blocked softmax merging (seeds, section 11).

For one query, each block of keys yields a summary (m, z, u): its max score, its sum of
exp(s - m), and its exp-weighted sum of values. Summaries merge exactly:

  m = max_b m_b,  z = sum_b exp(m_b - m) z_b,  u = sum_b exp(m_b - m) u_b,  o = u / z.

`merge_summaries` is that rule, and everything here uses it: the XLA paged path (a loop over
groups of pages read through the block table), its contiguous twin (the same loop over dense K/V,
the fair baseline for benchmarks), the Pallas kernel's split merge, and `merge_states` for
(output, log-sum-exp) pairs. `paged_attention` dispatches between the Pallas (Triton) kernel, on
CUDA GPUs of compute capability >= 8.0, and the XLA paths everywhere else (`decode_attention_xla`
for one query per row, split by (row, key block) work items; `paged_attention_xla` otherwise).
On the CPU backend, unquantized f32 / bf16 pages run a C++ kernel behind XLA's FFI instead
(`cpu_kernel`: the same summaries, one pass over each row's pages per tile of its queries), where
it builds: a step's decode rows and prefill chunks in one call.

Every path also reads quantized pages (`kv_quant.QuantizedPages`: indexing dequantizes, so the
XLA paths' gathers do; the kernel gets the codes and scales).

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
                                                      dense_attention, empty_result,
                                                      padded_to_ragged,
                                                      paged_attention_reference, ragged_to_padded)
from paged_jax import cpu_kernel, kv_quant
from paged_jax.state import NULL_PAGE

__all__ = ["Summary", "block_summary", "merge_summaries", "finalize", "merge_states",
           "dense_attention", "paged_attention_reference", "paged_attention", "paged_attention_xla",
           "kernel_unavailable_reason", "IMPLS", "causal_ragged_attention", "prefill_attention",
           "step_attention", "DEFAULT_TILE_TOKENS", "DEFAULT_TILES_PER_CHUNK",
           "contiguous_attention", "validate_attention_inputs", "DEFAULT_BLOCK_TOKENS",
           "decode_attention_xla", "DECODE_BLOCK_TOKENS", "DECODE_ITEMS_PER_CHUNK",
           "decode_items_per_chunk", "cpu_kernel_applies", "token_positions",
           "PREFILL_ON_CPU_KERNEL"]

_HIGHEST = jax.lax.Precision.HIGHEST

# Keys per loop iteration of the XLA paths. 64 was fastest for decode on this 2-core CPU
# (experiments/attention_bench.py --block_tokens sweeps it); a block stays in L2 between the
# score and value passes.
DEFAULT_BLOCK_TOKENS = 64

# On the CPU, a step's prefill chunks run on the C++ kernel beside its decode rows, in one call
# (where `cpu_kernel_applies`); False: on the tiled XLA path (`prefill_attention`), the baseline
# `experiments/mixed_step_bench.py` compares against. On SmolLM2's heads (9 / 3 / 64), one layer,
# the kernel took 0.25-0.36x the XLA path's time from 256 to 1,024 fresh tokens and for 8 chunks
# of 128 after 128 keys (`experiments/attention_bench.py --modes=prefill
# --impls=prefill_xla,prefill_cpu`; results page, "2026-12-07: prefill on the C++ kernel").
PREFILL_ON_CPU_KERNEL = True


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
                       scale, sliding_window, soft_cap, return_lse, kv_lens=None):
  """Online softmax over key blocks: fetch(j) -> (k, v) dtype[B, block_tokens, K, D].

  Queries sit at positions seq_len - q_len + i; keys at positions >= kv_lens (default seq_lens)
  are not read. The loop runs ceil(max(kv_lens) / block_tokens) times (at most max_blocks): work
  follows the longest sequence in the batch, not the table's capacity.
  """
  num_tokens, num_q_heads, head_dim = q.shape
  max_q_len = num_tokens if max_q_len is None else max_q_len
  scale = head_dim ** -0.5 if scale is None else scale
  kv_lens = seq_lens if kv_lens is None else kv_lens
  num_blocks = jnp.minimum((jnp.max(kv_lens, initial=0) + block_tokens - 1) // block_tokens,
                           max_blocks)
  num_seqs = seq_lens.shape[0]
  group = num_q_heads // num_kv_heads
  q_padded, q_pos, q_valid = ragged_to_padded(q, cu_q_lens, seq_lens, max_q_len)
  qg = (q_padded.astype(jnp.float32) * scale).reshape(
      num_seqs, max_q_len, num_kv_heads, group, head_dim)

  def body(j, acc: Summary) -> Summary:
    k, v = fetch(j)
    kv_pos = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    kv_valid = kv_pos[None, :] < kv_lens[:, None]
    # Mask V, not only the scores: p = 0 times a NaN in a stale slot is still NaN. A NaN in K
    # only reaches a score, which the -inf mask below replaces.
    v = jnp.where(kv_valid[..., None, None], v, 0).astype(jnp.float32)
    s = jnp.einsum("bqkgd,btkd->bkgqt", qg, k.astype(jnp.float32), precision=_HIGHEST)
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    mask = attention_mask(q_pos, q_valid, kv_pos, kv_lens, sliding_window)
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


# "interpret": the Pallas kernel through Pallas' interpreter (any backend; slow, for tests such
# as the engine's isolation test on the CPU). "cpu": decode rows (and in `step_attention` small
# prefill chunks) through the C++ CPU kernel (`cpu_kernel`), everything else on the XLA paths;
# "xla" keeps them on XLA too.
IMPLS = ("auto", "xla", "pallas", "interpret", "cpu")
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


def cpu_kernel_applies(q, k_pages, impl: str) -> bool:
  """Whether attention runs the C++ CPU kernel (`cpu_kernel`) under `impl`.

  "cpu" and "auto" use it on the CPU backend where it builds, for unquantized pages of q's
  dtype (f32 or bf16) and at most 16 query heads per kv head; quantized pages and other dtypes
  stay on the XLA path. impl="cpu" where the kernel cannot run raises a ValueError saying why;
  "auto" then takes the XLA path.
  """
  if impl not in ("cpu", "auto"):
    return False
  reason = cpu_kernel.unavailable_reason()
  if reason is not None:
    if impl == "cpu":
      raise ValueError(f"impl='cpu' cannot run here: {reason}. Use impl='xla'.")
    return False
  return (not isinstance(k_pages, kv_quant.QuantizedPages)
          and q.shape[1] % k_pages.shape[2] == 0 and cpu_kernel.unsupported(q, k_pages) is None)


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                    max_q_len: int | None = None, scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    return_lse: bool = False, impl: str = "auto",
                    pages_per_block: int | None = None,
                    block_sizes: kernel_triton.BlockSizes | None = None, interpret: bool = False,
                    precision: str = "highest"):
  """Ragged paged attention; dispatches to the Pallas kernel or the XLA path.

  `impl="auto"` runs the Triton kernel on CUDA GPUs of compute capability >= 8.0 (when the shapes
  suit it), the C++ CPU kernel on the CPU (`cpu_kernel_applies`), and the XLA path everywhere
  else; "xla", "pallas" and "cpu" force one. Forcing "pallas" where
  it cannot run compiled raises a ValueError saying why, unless `interpret=True` (Pallas' CPU
  interpreter, for tests); so does "cpu" where the CPU kernel cannot build. Arguments are those
  of `paged_attention_xla` (`k_pages` / `v_pages` may be `kv_quant.QuantizedPages`: every path
  dequantizes as it reads); `pages_per_block` tunes the XLA path, `block_sizes` and `precision`
  the kernel (`kernel_triton.PRECISIONS`; the XLA path always computes at "highest").
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, max_q_len=max_q_len,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  if q.shape[0] == 0:
    return empty_result(q, return_lse)
  if impl == "interpret":
    impl, interpret = "pallas", True
  reason = kernel_unavailable_reason(q.shape[-1], k_pages.shape[1])
  if impl == "pallas" and reason is not None and not interpret:
    raise ValueError(f"impl='pallas' cannot run here: {reason}. Use impl='xla' (or "
                     f"interpret=True to run the kernel through Pallas' interpreter).")
  use_kernel = impl == "pallas" or (impl == "auto" and reason is None)
  kw = dict(max_q_len=max_q_len, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
            return_lse=return_lse)
  if use_kernel:
    quant = {}
    if isinstance(k_pages, kv_quant.QuantizedPages):   # the kernel dequantizes as it reads
      quant = dict(k_scales=k_pages.scales, v_scales=v_pages.scales)
      k_pages, v_pages = k_pages.codes, v_pages.codes
    return kernel_triton.paged_attention(
        q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
        block_sizes=block_sizes or kernel_triton.BlockSizes(), interpret=interpret,
        precision=precision, **kw, **quant)
  if cpu_kernel_applies(q, k_pages, impl):
    kw.pop("max_q_len")
    return cpu_kernel.paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, **kw)
  if max_q_len == 1:   # decode rows: split by key block, not padded to the longest row
    kw.pop("max_q_len")
    return decode_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                                pages_per_block=pages_per_block, **kw)
  return paged_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                             pages_per_block=pages_per_block, **kw)


@functools.partial(jax.jit, static_argnames=("max_q_len", "scale", "sliding_window", "soft_cap",
                                             "pages_per_block", "return_lse"))
def paged_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                        max_q_len: int | None = None, scale: float | None = None,
                        sliding_window: int | None = None, soft_cap: float | None = None,
                        pages_per_block: int | None = None, return_lse: bool = False,
                        kv_lens: jax.Array | None = None):
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
    kv_lens: i32[num_seqs] optional: read only keys at positions < kv_lens (default seq_lens),
      e.g. a prefill chunk over its cached prefix alone (`prefill_attention`). Query positions
      still come from seq_lens.

  Returns:
    dtype[num_tokens, num_q_heads, head_dim] (and lse if asked). Values are validated only by
    `validate_attention_inputs`; this jitted path checks shapes and dtypes alone.
  """
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, max_q_len=max_q_len,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  if q.shape[0] == 0:
    return empty_result(q, return_lse)
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
      return_lse=return_lse, kv_lens=kv_lens)


# Keys per work item of `decode_attention_xla`, and work items per loop iteration, chosen in
# scratch sweeps on the large serve benchmark's decode shapes (32 rows of 48-288 keys, 16 q / 4
# kv heads, head_dim 64, page 16): 32 / 64 beat 32 / 32, 64 / 32, 32 / 128 and 16 / 256 there.
# The committed comparison with `paged_attention_xla` (attention_bench --min_seq_len) is on
# experiments/results/README.md, "Against vLLM's CPU build".
DECODE_BLOCK_TOKENS = 32
DECODE_ITEMS_PER_CHUNK = 64
# ... but at most this many items per row of the batch: a chunk is gathered whole, so one that is
# larger than the batch's work reads empty items (one user at 221 keys has 7 items; a 64-item
# chunk gathers 57 empty ones per layer). SmolLM2-135M f32, one row, jax 0.12: 24.7 -> 18.4 ms
# per decode step in a scratch timing of the decode round (the same measurement is now
# `python -m experiments.decode_round_bench`, not yet re-run). 8 rows and more keep 64.
DECODE_ITEMS_PER_ROW = 8


def decode_items_per_chunk(num_seqs: int) -> int:
  """The default work items per loop iteration of `decode_attention_xla` for num_seqs rows."""
  return max(1, min(DECODE_ITEMS_PER_CHUNK, DECODE_ITEMS_PER_ROW * num_seqs))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "soft_cap",
                                             "pages_per_block", "items_per_chunk", "return_lse"))
def decode_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                         scale: float | None = None, sliding_window: int | None = None,
                         soft_cap: float | None = None, pages_per_block: int | None = None,
                         items_per_chunk: int | None = None, return_lse: bool = False):
  """Paged attention of one query per row (decode) on the XLA path, split by key block.

  `paged_attention_xla` runs every row for as many blocks as the longest row has; here each
  (row, key block) pair that holds a visible key is one work item, items_per_chunk items run per
  loop iteration, and each row's item summaries merge exactly into it (the seeds' section 11
  rule, as a scatter: flash-decoding's split-K). Work follows the sum of the rows' lengths, not
  rows x the longest; a sliding window skips the blocks before it.

  Args:
    q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens: as in `paged_attention_xla`, with
      at most one query per row (its query at position seq_len - 1).
    pages_per_block: pages per work item; default DECODE_BLOCK_TOKENS // page_size.
    items_per_chunk: work items per loop iteration (static); default
      `decode_items_per_chunk(num_seqs)`.
    return_lse: also return f32[num_tokens, num_q_heads] log-sum-exp.

  Returns:
    dtype[num_tokens, num_q_heads, head_dim] (and lse if asked); a row with no query or no
    visible key gets zeros (lse -inf).
  """
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, max_q_len=1,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  if q.shape[0] == 0:
    return empty_result(q, return_lse)
  num_tokens, num_q_heads, head_dim = q.shape
  num_seqs, max_pages_per_seq = block_tables.shape
  page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
  group = num_q_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  if pages_per_block is None:
    pages_per_block = max(1, DECODE_BLOCK_TOKENS // page_size)
  pages_per_block = min(pages_per_block, max_pages_per_seq)
  if items_per_chunk is None:
    items_per_chunk = decode_items_per_chunk(num_seqs)
  max_blocks = -(-max_pages_per_seq // pages_per_block)
  block_tokens = pages_per_block * page_size
  tables = jnp.pad(block_tables, ((0, 0), (0, max_blocks * pages_per_block - max_pages_per_seq)),
                   constant_values=NULL_PAGE).reshape(num_seqs, max_blocks, pages_per_block)

  q_padded, _, q_valid = ragged_to_padded(q, cu_q_lens, seq_lens, 1)
  qg = (q_padded[:, 0].astype(jnp.float32) * scale).reshape(num_seqs, num_kv_heads, group, head_dim)
  # Each row's visible keys are [first, seq_len): blocks first_block .. end_block - 1.
  lens = jnp.where(q_valid[:, 0], jnp.minimum(seq_lens, max_blocks * block_tokens), 0)
  first = jnp.zeros_like(lens) if sliding_window is None else jnp.maximum(lens - sliding_window, 0)
  first_block = first // block_tokens
  num_items = jnp.where(lens > 0, (lens + block_tokens - 1) // block_tokens - first_block, 0)
  ends = jnp.cumsum(num_items)
  total = ends[-1]

  def body(c, acc: Summary) -> Summary:
    item = c * items_per_chunk + jnp.arange(items_per_chunk, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(ends, item, side="right"), 0, num_seqs - 1).astype(jnp.int32)
    block = jnp.clip(first_block[row] + item - (ends[row] - num_items[row]), 0, max_blocks - 1)
    pages = tables[row, block]                                    # [C, pages_per_block]
    shape = (items_per_chunk, block_tokens, num_kv_heads, head_dim)
    k, v = k_pages[pages].reshape(shape), v_pages[pages].reshape(shape)
    kv_pos = block[:, None] * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
    valid = ((item < total)[:, None] & (kv_pos < lens[row][:, None])
             & (kv_pos >= first[row][:, None]))                     # [C, T]
    v = jnp.where(valid[..., None, None], v, 0).astype(jnp.float32)  # NaN-safe, as in _blocked
    s = jnp.einsum("ckgd,ctkd->ckgt", qg[row], k.astype(jnp.float32), precision=_HIGHEST)
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    part = block_summary(s, v, "ckgt,ctkd->ckgd")
    # Merge the chunk's items into their rows (items past `total` are empty: m = -inf).
    m = acc.m.at[row].max(part.m)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w_acc = jnp.exp(acc.m - m_safe)
    w_part = jnp.exp(part.m - m_safe[row])
    return Summary(m, (w_acc * acc.z).at[row].add(w_part * part.z),
                   (w_acc[..., None] * acc.u).at[row].add(w_part[..., None] * part.u))

  lead = (num_seqs, num_kv_heads, group)
  init = Summary(jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32),
                 jnp.zeros(lead + (head_dim,), jnp.float32))
  acc = jax.lax.fori_loop(0, (total + items_per_chunk - 1) // items_per_chunk, body, init)
  o, lse = finalize(acc)
  o = padded_to_ragged(o.reshape(num_seqs, 1, num_q_heads, head_dim), cu_q_lens, num_tokens)
  if not return_lse:
    return o.astype(q.dtype)
  lse = padded_to_ragged(lse.reshape(num_seqs, 1, num_q_heads), cu_q_lens, num_tokens)
  return o.astype(q.dtype), jnp.where(jnp.arange(num_tokens)[:, None] < cu_q_lens[-1], lse, -jnp.inf)


# Tokens per tile of `causal_ragged_attention`, and query tiles per chunk of its loop (a chunk's
# scores, 4 x 64 x 64 per head, stay in cache). Measured on the serve benchmark's prefill
# (experiments/serve_bench.py): 64 / 4 beat 32 / 8, 32 / 16 and 128 / 2.
DEFAULT_TILE_TOKENS = 64
DEFAULT_TILES_PER_CHUNK = 4


def causal_ragged_attention(q, k, v, cu_q_lens, *, max_q_len: int, scale: float | None = None,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            tile_tokens: int = DEFAULT_TILE_TOKENS,
                            tiles_per_chunk: int = DEFAULT_TILES_PER_CHUNK):
  """Causal attention of ragged rows over their own keys only (a prompt with no cached prefix).

  Row b's tokens cu_q_lens[b]:cu_q_lens[b+1] are both its queries and its keys. Block-sparse:
  each row is laid out from a tile boundary (`tile_tokens` per tile), so a query tile belongs
  to one row and needs exactly the key tiles of that row up to itself (j <= i within the row:
  row length n costs ceil(n / tile) * (ceil(n / tile) + 1) / 2 tile pairs, not a fixed
  lookback for every tile). Query tiles are sorted by how far back they look and processed in
  chunks of `tiles_per_chunk`; a chunk's loop runs only as far back as its own tiles need.
  Tile pairs merge by the (m, z, u) rule. No K/V is read back from the pool.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged; tokens past cu_q_lens[-1] are padding.
    k: dtype[num_tokens, num_kv_heads, head_dim] this step's keys, same layout; v the same.
    cu_q_lens: i32[num_seqs + 1].
    max_q_len: static bound on any row's length (bounds how far back a tile may look).
    scale, sliding_window, soft_cap: as in `paged_attention_xla`.
    tile_tokens, tiles_per_chunk: static tiling.

  Returns:
    (o dtype[num_tokens, num_q_heads, head_dim], lse f32[num_tokens, num_q_heads]); padding
    tokens get zeros and -inf.
  """
  check_static_args(q, k, v, None, cu_q_lens[1:], cu_q_lens, max_q_len=max_q_len,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  if q.shape[0] == 0:
    return empty_result(q, return_lse=True)
  num_tokens, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[1]
  num_seqs = cu_q_lens.shape[0] - 1
  group = num_q_heads // num_kv_heads
  scale = head_dim ** -0.5 if scale is None else scale
  tile = max(1, min(tile_tokens, max(max_q_len, 1)))
  chunk = max(1, tiles_per_chunk)
  # Aligned layout: row b owns tiles first[b] .. first[b] + row_tiles[b] - 1.
  lens = cu_q_lens[1:] - cu_q_lens[:-1]
  row_tiles = (lens + tile - 1) // tile
  ends = jnp.cumsum(row_tiles)
  first = ends - row_tiles
  bound = -(-num_tokens // tile) + num_seqs          # static: every row adds <= 1 partial tile
  num_chunks = -(-bound // chunk)
  num_slots = num_chunks * chunk
  a = jnp.arange(num_slots, dtype=jnp.int32)
  row = jnp.clip(jnp.searchsorted(ends, a, side="right"), 0, num_seqs - 1)
  in_row = a - first[row]                            # tile index within its row
  live = a < ends[-1]
  lookback = jnp.where(live, in_row, -1)
  # Queries sorted by lookback, longest first: a chunk's first tile bounds its loop.
  order = jnp.argsort(-lookback, stable=True)
  pos = in_row[:, None] * tile + jnp.arange(tile, dtype=jnp.int32)[None, :]   # [slots, tile]
  valid = live[:, None] & (pos < lens[row][:, None])
  token = jnp.where(valid, cu_q_lens[row][:, None] + pos, num_tokens)         # num_tokens = none

  def gather(x):   # [num_tokens, heads, D] -> [slots, heads, tile, D], zeros where not valid
    x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[token]
    return x.transpose(0, 2, 1, 3)

  k_t = gather(k).astype(jnp.float32)
  v_t = gather(v).astype(jnp.float32)
  q_t = gather(q.astype(jnp.float32) * scale)[order]                          # sorted
  q_t = q_t.reshape(num_slots, num_kv_heads, group, tile, head_dim)
  q_pos, q_valid = pos[order], valid[order]
  sorted_tile, sorted_lookback = order, lookback[order]

  def chunk_body(_, c):
    s0 = c * chunk
    qc = jax.lax.dynamic_slice_in_dim(q_t, s0, chunk)
    qp = jax.lax.dynamic_slice_in_dim(q_pos, s0, chunk)
    qv = jax.lax.dynamic_slice_in_dim(q_valid, s0, chunk)
    tiles_c = jax.lax.dynamic_slice_in_dim(sorted_tile, s0, chunk)
    back_c = jax.lax.dynamic_slice_in_dim(sorted_lookback, s0, chunk)

    def offset_body(o, acc: Summary) -> Summary:
      kt = jnp.clip(tiles_c - o, 0, num_slots - 1)   # the same row, o tiles earlier
      kp = qp[:, :1] - o * tile + jnp.arange(tile, dtype=jnp.int32)[None, :]   # key positions
      mask = (qv[:, :, None] & (o <= back_c)[:, None, None]
              & (kp[:, None, :] <= qp[:, :, None]))
      if sliding_window is not None:
        mask &= qp[:, :, None] - kp[:, None, :] < sliding_window
      s = jnp.einsum("ckgqd,cktd->ckgqt", qc, k_t[kt], precision=_HIGHEST)
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      s = jnp.where(mask[:, None, None], s, -jnp.inf)
      return merge_summaries(acc, block_summary(s, v_t[kt], "ckgqt,cktd->ckgqd"))

    lead = (chunk, num_kv_heads, group, tile)
    init = Summary(jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32),
                   jnp.zeros(lead + (head_dim,), jnp.float32))
    return None, finalize(jax.lax.fori_loop(0, back_c[0] + 1, offset_body, init))

  _, (o_t, lse_t) = jax.lax.scan(chunk_body, None, jnp.arange(num_chunks, dtype=jnp.int32))
  o_t = o_t.reshape((num_slots,) + o_t.shape[2:])
  lse_t = lse_t.reshape((num_slots,) + lse_t.shape[2:])
  # Back to the ragged token layout; slots of no token scatter out of bounds and are dropped.
  dest = token[order].reshape(-1)
  o_t = o_t.transpose(0, 3, 1, 2, 4).reshape(num_slots * tile, num_q_heads, head_dim)
  lse_t = lse_t.transpose(0, 3, 1, 2).reshape(num_slots * tile, num_q_heads)
  o = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32).at[dest].set(o_t, mode="drop")
  lse = jnp.full((num_tokens, num_q_heads), -jnp.inf, jnp.float32).at[dest].set(lse_t,
                                                                                 mode="drop")
  return o.astype(q.dtype), lse


def token_positions(seq_lens, cu_q_lens, tokens):
  """Each token's row and position in its sequence.

  Args:
    seq_lens: i32[num_seqs] keys per row after this step; cu_q_lens: i32[num_seqs + 1].
    tokens: i32[n] token indices into the step's ragged layout.

  Returns:
    (row i32[n], position i32[n]): the row whose queries cu_q_lens[row]:cu_q_lens[row + 1] hold
    the token (rows of no query are skipped; tokens past cu_q_lens[-1] get the last row), and
    its position seq_lens[row] - q_len[row] + (token - cu_q_lens[row]).
  """
  num_rows = seq_lens.shape[0]
  row = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tokens, side="right"), 0, num_rows - 1)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  return row, seq_lens[row] - q_lens[row] + tokens - cu_q_lens[row]


def prefill_attention(q, k, v, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                      max_q_len: int, scale: float | None = None,
                      sliding_window: int | None = None, soft_cap: float | None = None,
                      pages_per_block: int | None = None,
                      tile_tokens: int = DEFAULT_TILE_TOKENS):
  """Prefill chunks on the XLA path: own keys from this step, cached prefix from the pages.

  A chunk of q_len tokens of a sequence with seq_len keys attends causally to its own q_len new
  keys (`causal_ragged_attention`, on this step's k/v) and to all seq_len - q_len keys of its
  prefix (read through the block table; skipped when no row has a prefix); the two partial
  results merge exactly (`merge_states`, the seeds' rule). Same result as
  `paged_attention_xla` over the whole sequence, without padding each row to max_q_len.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged by cu_q_lens.
    k, v: dtype[num_tokens, num_kv_heads, head_dim] this step's keys / values (also written in
      the pages; they are used from here).
    k_pages, v_pages, block_tables, seq_lens, cu_q_lens: as in `paged_attention_xla`.
    max_q_len: static bound on any q_len.

  Returns:
    dtype[num_tokens, num_q_heads, head_dim].
  """
  if q.shape[0] == 0:
    return empty_result(q)
  kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
  o_new, lse_new = causal_ragged_attention(q, k, v, cu_q_lens, max_q_len=max_q_len,
                                           tile_tokens=tile_tokens, **kw)
  prefix_lens = seq_lens - (cu_q_lens[1:] - cu_q_lens[:-1])

  def with_prefix(_):
    o_pre, lse_pre = paged_attention_xla(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                                         max_q_len=max_q_len, pages_per_block=pages_per_block,
                                         return_lse=True, kv_lens=prefix_lens, **kw)
    return merge_states(o_new, lse_new, o_pre, lse_pre)[0]

  # A step of fresh prompts (the common case) pays nothing for the prefix path.
  return jax.lax.cond(jnp.max(prefix_lens, initial=0) > 0, with_prefix, lambda _: o_new, None)


def step_attention(q, k, v, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                   num_decode: int, max_q_len: int, scale: float | None = None,
                   sliding_window: int | None = None, soft_cap: float | None = None,
                   impl: str = "auto"):
  """Attention for one model step whose K/V are already written into the pages.

  Rows 0..num_decode-1 are decode rows, one query each at tokens 0..num_decode-1; the rows after
  them are prefill chunks (ragged). The Pallas kernel takes the whole batch in one launch, and so
  does the C++ CPU kernel where it applies (`cpu_kernel_applies`; prefill chunks too while
  PREFILL_ON_CPU_KERNEL). The XLA path runs decode rows with max_q_len=1 through
  `decode_attention_xla` and prefill rows through `prefill_attention`, so no decode row is
  padded to a prefill chunk's length.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim]; k, v: dtype[num_tokens, num_kv_heads, head_dim].
    k_pages, v_pages, block_tables, seq_lens, cu_q_lens: as in `paged_attention` (all rows).
    num_decode: static count of leading decode rows (cu_q_lens[:num_decode + 1] == 0..num_decode).
    max_q_len: static bound on the prefill rows' q_len (1 when there are none).

  Returns:
    dtype[num_tokens, num_q_heads, head_dim].
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
  if q.shape[0] == 0:
    return empty_result(q)
  reason = kernel_unavailable_reason(q.shape[-1], k_pages.shape[1])
  kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
  if impl in ("pallas", "interpret") or (impl == "auto" and reason is None):
    return paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                           max_q_len=max(max_q_len, 1), impl=impl, **kw)
  d = num_decode
  on_cpu = cpu_kernel_applies(q, k_pages, impl)
  if on_cpu and (PREFILL_ON_CPU_KERNEL or q.shape[0] == d):
    return cpu_kernel.paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                                      **kw)
  parts = []
  if d:
    decode = cpu_kernel.paged_attention if on_cpu else decode_attention_xla
    parts.append(decode(q[:d], k_pages, v_pages, block_tables[:d], seq_lens[:d],
                        jnp.arange(d + 1, dtype=jnp.int32), **kw))
  if q.shape[0] > d:
    parts.append(prefill_attention(q[d:], k[d:], v[d:], k_pages, v_pages, block_tables[d:],
                                   seq_lens[d:], cu_q_lens[d:] - d, max_q_len=max_q_len, **kw))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


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
  check_static_args(q, k, v, None, seq_lens, cu_q_lens, max_q_len=max_q_len,
                    sliding_window=sliding_window, soft_cap=soft_cap)
  if q.shape[0] == 0:
    return empty_result(q, return_lse)
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


def validate_attention_inputs(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                              max_q_len: int | None = None) -> None:
  """Value checks for one step's inputs, on the host (NumPy). Tests and the host batcher call it;
  the jitted paths do not, so a decode step never pays for it.

  Raises:
    ValueError naming the offending values: shapes/dtypes (as in the jitted paths), negative or
    non-monotone query offsets, a q_len larger than its kv_len or than max_q_len, lengths beyond the table's
    capacity, page ids outside [0, num_pages), or NULL_PAGE inside a sequence's live pages.
  """
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, max_q_len=max_q_len)
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
