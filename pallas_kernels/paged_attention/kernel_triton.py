"""Ragged paged attention as a Pallas kernel for the Triton backend (Ampere and newer GPUs).

One launch serves a ragged batch that mixes decode rows (q_len 1) and prefill chunks (q_len > 1,
causal at positions kv_len - q_len + i). The grid is (seq, kv head, row block x kv split):

  - a program takes `block_q` consecutive queries of one sequence times all `q_per_kv` query heads
    of one KV head, so each K/V page is read once per KV head (GQA / MQA);
  - long contexts are split across `num_splits` programs (flash-decoding); the number of splits
    follows the work size (seqs x KV heads x row blocks against the pages to read), not a constant;
  - each program walks its keys `block_tokens` at a time (several whole pages, or a slice of one
    page when pages are larger than a step), reading page ids from the block table inside the
    kernel, with an online softmax in f32; it writes its partial state (m, l, u)
    in f32, and the splits are merged exactly outside the kernel by the seeds' section-11 rule
    (`merge.merge_along`).

NaN-safe: scores of invisible keys become -inf and V rows past a sequence's length are zeroed
before the value product, so a NaN in a stale slot, a free page or NULL_PAGE never reaches an
output; a row with no visible key gets zeros. Head dims that are not powers of two (80, 96) are
handled as a sum of power-of-two chunks (64 + 16, 64 + 32): Triton loads need power-of-two shapes,
and this needs no copy of the pool.

f32 dots run at the `precision` the caller picks (see `PRECISIONS`): "highest" (IEEE f32 on FMA
units, the default and what the exactness tests use), "tf32x3" (three TF32 tensor-core passes,
near-f32 accuracy) or "default" (one TF32 pass). bf16 inputs always take the bf16 tensor-core dot
with f32 accumulation. In interpret mode (where XLA's CPU dot is always exact f32) the two TF32
settings are emulated by rounding the operands to TF32 with `lax.reduce_precision`, so their error
can be measured without a GPU (experiments/kernel_ptx.py --errors).

Tiles (rows per program, keys per inner step, warps) are chosen per dtype, precision and head_dim
in `plan` so that every configuration compiles without register spills for sm_80 and sm_90;
experiments/kernel_ptx.py checks that with pip Triton's compiler and ptxas (CI runs it).

Quantized pages (`k_scales` / `v_scales`: int8 or fp8 codes with f32 scales per token, per page or
per tensor, paged_jax.kv_quant's layout) are dequantized as each tile is loaded (code x scale in
f32, cast to the query's dtype), then the same dots and merge run.

Runs compiled on a GPU, or on a CPU with `interpret=True` (Pallas' HLO interpreter).
Never imports paged_jax.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from pallas_kernels.paged_attention.merge import Summary, finalize, merge_along
from pallas_kernels.paged_attention.reference import (check_static_args, empty_result,
                                                      padded_to_ragged, ragged_to_padded)

NULL_PAGE = 0   # same convention as paged_jax.state (this package may not import it)
_HIGHEST = jax.lax.Precision.HIGHEST
# precision name -> what the f32 dots run on a GPU, and the max abs error of the output it
# promises against exact attention for unit-normal inputs (tests/pallas_kernels PrecisionTest;
# measured by `python -m experiments.kernel_ptx --errors`, TF32 emulated in interpret mode).
PRECISIONS = {
    "highest": "IEEE f32 (FMA units); error <= 1e-5",
    "tf32x3": "3 TF32 passes (hi*hi + hi*lo + lo*hi, tensor cores); error <= 1e-5",
    "default": "1 TF32 pass (10-bit mantissa operands, tensor cores); error <= 5e-3",
}
_TF32_BITS = dict(exponent_bits=8, mantissa_bits=10)
_MIN_DOT = 16   # Triton's smallest dot dimension
# Code dtypes the kernel dequantizes as it reads (`k_scales` / `v_scales`).
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _dot(a, b, dims, precision: str, interpret: bool):
  """f32 dot_general of two tiles at `precision` (a PRECISIONS key); bf16 tiles ignore it."""
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=(dims, ((), ())),
                          preferred_element_type=jnp.float32)
  if a.dtype != jnp.float32 or precision == "highest":
    return dot(a, b, precision=_HIGHEST)
  if not interpret:   # the GPU's tensor cores do the TF32 rounding
    return dot(a, b, precision=(jax.lax.Precision.DEFAULT if precision == "default" else
                                jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3))
  # Interpret mode: XLA's CPU dot is exact f32, so round the operands as the tensor cores would
  # (round-to-nearest here; hardware TF32 may truncate, within the promised bound).
  hi = lambda x: jax.lax.reduce_precision(x, **_TF32_BITS)
  a_hi, b_hi = hi(a), hi(b)
  out = dot(a_hi, b_hi, precision=_HIGHEST)
  if precision == "tf32x3":
    out = out + dot(a_hi, hi(b - b_hi), precision=_HIGHEST) + dot(hi(a - a_hi), b_hi,
                                                                  precision=_HIGHEST)
  return out


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes; hashable, so it can be a static jit argument. None = chosen by `plan` from the
  shapes, the dtype and the precision (the choices that compile without spills).

  Attributes:
    block_q: queries per program (its rows = block_q x q_per_kv, padded to a power of two >= 16).
    pages_per_block: pages per inner iteration (block_tokens = pages x page_size, a power of two
      >= 16).
    block_tokens: keys per inner iteration instead (a power of two >= 16); below page_size a step
      reads a slice of one page. At most one of pages_per_block and block_tokens.
    num_splits: KV splits per (seq, kv head, row block); None follows the work size.
    target_programs: programs to aim for when choosing num_splits (about 2 per SM of an H100/H200).
    num_warps, num_stages: Triton compiler parameters.
    max_chunk: widest head_dim slice per dot (a power of two >= 16); narrower dots keep fewer
      operand registers live, which the FMA (IEEE f32) dots need.
  """
  block_q: int | None = None
  pages_per_block: int | None = None
  block_tokens: int | None = None
  num_splits: int | None = None
  target_programs: int = 264
  num_warps: int | None = None
  num_stages: int | None = None
  max_chunk: int | None = None

  def __post_init__(self):
    for name in ("block_q", "pages_per_block", "num_splits", "num_warps", "num_stages",
                 "max_chunk"):
      value = getattr(self, name)
      if value is not None and value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    for name in ("pages_per_block", "block_tokens", "max_chunk"):
      value = getattr(self, name)
      if value is not None and value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")
    if self.block_tokens is not None and self.block_tokens < _MIN_DOT:
      raise ValueError(f"block_tokens={self.block_tokens} must be >= {_MIN_DOT}")
    if self.pages_per_block is not None and self.block_tokens is not None:
      raise ValueError(f"give pages_per_block={self.pages_per_block} or "
                       f"block_tokens={self.block_tokens}, not both")


def head_dim_chunks(head_dim: int, max_chunk: int | None = None) -> tuple[tuple[int, int], ...]:
  """(offset, size) power-of-two chunks >= 16 (and <= max_chunk) that tile head_dim:
  80 -> ((0, 64), (64, 16)); 128 with max_chunk 32 -> four chunks of 32."""
  if head_dim % _MIN_DOT:
    raise ValueError(f"head_dim={head_dim} must be a multiple of {_MIN_DOT} for the Triton kernel")
  if max_chunk is not None and (max_chunk < _MIN_DOT or max_chunk & (max_chunk - 1)):
    raise ValueError(f"max_chunk={max_chunk} must be a power of two >= {_MIN_DOT}")
  chunks, offset = [], 0
  while offset < head_dim:
    size = 1 << ((head_dim - offset).bit_length() - 1)
    size = size if max_chunk is None else min(size, max_chunk)
    chunks.append((offset, size))
    offset += size
  return tuple(chunks)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static tiling of one call."""
  block_q: int
  block_rows: int
  num_row_blocks: int
  pages_per_block: int   # 1 when a step is a slice of one page
  block_tokens: int      # keys per inner step
  num_splits: int
  pages_per_split: int
  table_width: int
  num_warps: int
  num_stages: int
  chunks: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Default tile limits for one (dtype, precision, head_dim, group): see `default_tiles`."""
  max_rows: int       # rows (query x head of the group) per program, a power of two >= 16
  block_tokens: int   # keys per inner step, a power of two >= 16
  num_warps: int
  num_stages: int
  max_chunk: int | None = None   # widest head_dim slice per dot (None: whole power-of-two parts)


def default_tiles(dtype, precision: str, head_dim: int, group: int = 1) -> Tiles:
  """The tiles that compile without register spills for sm_80 and sm_90, for page sizes 1-64+,
  decode / mixed / prefill, GQA groups 1-8, with and without window and soft cap (checked by
  `python -m experiments.kernel_ptx`; the table is in WORKSPACE.md, "Kernel resources").

  What drives them (measured there): a tensor-core dot (bf16, or f32 at "tf32x3" / "default")
  keeps its operands in shared memory, so 64 rows x 32 keys fit; the IEEE f32 dot ("highest") runs
  on FMA units and holds each thread's operand rows and columns in registers, so it needs the
  smallest tiles (16 rows, 16 keys, 16-wide head_dim slices) over 8 warps. Larger heads and f32
  operands (twice bf16's bytes) take more warps and narrower slices. `group` (query heads per
  KV head) matters only for f32 "tf32x3" at head_dim 256, where no one tile set was clean for
  every group (see below).
  """
  f32 = jnp.dtype(dtype) == jnp.float32
  pow2 = head_dim & (head_dim - 1) == 0
  if not f32:                                     # bf16 tensor-core dots
    if pow2 and head_dim <= 128:
      return Tiles(max_rows=64, block_tokens=32, num_warps=4, num_stages=2, max_chunk=64)
    if head_dim <= 128:                           # 80, 96: power-of-two chunks
      return Tiles(max_rows=64, block_tokens=32, num_warps=8, num_stages=2, max_chunk=64)
    return Tiles(max_rows=32, block_tokens=32, num_warps=8, num_stages=2, max_chunk=64)
  if precision == "highest":                      # IEEE f32: FMA units, operands in registers
    return Tiles(max_rows=16, block_tokens=16, num_warps=8, num_stages=2,
                 max_chunk=32 if head_dim == 80 else 16)   # 80 spilled with 16-wide slices
  if precision == "default":                      # one TF32 pass
    if head_dim <= 64:
      return Tiles(max_rows=32, block_tokens=32, num_warps=4, num_stages=2, max_chunk=64)
    if not pow2:
      return Tiles(max_rows=16, block_tokens=16, num_warps=8, num_stages=2, max_chunk=32)
    if head_dim <= 128:
      return Tiles(max_rows=32, block_tokens=32, num_warps=8, num_stages=2, max_chunk=32)
    return Tiles(max_rows=16, block_tokens=32, num_warps=8, num_stages=2, max_chunk=32)
  # tf32x3: three TF32 dots per product, hi / lo operand splits live at once
  if head_dim <= 96:
    return Tiles(max_rows=32, block_tokens=16, num_warps=8, num_stages=2, max_chunk=32)
  if head_dim <= 128:
    return Tiles(max_rows=16, block_tokens=16, num_warps=4, num_stages=3, max_chunk=32)
  # head_dim 256. With 32 keys per step, group 1's prefill with window and soft cap on 64-token
  # pages spilled 20 B on sm_90; with 16, group 8's mixed batches spilled 12 B; each was clean
  # where the other spilled (WORKSPACE.md, "Kernel resources").
  return Tiles(max_rows=16, block_tokens=32 if group >= 8 else 16, num_warps=4, num_stages=2,
               max_chunk=32)


# bf16 decode launches (one query per row: 16-row tiles) of power-of-two heads up to 128 read 64
# keys per step over 3 pipeline stages instead of `default_tiles`' 32 over 2. Measured on an
# H200 (jax 0.11.2; bf16, 32 query / 8 KV heads, head_dim 128, page 16; `python -m
# experiments.attention_bench --preset=gpu --modes=decode --seq_lens=4096,32768
# --tiles=bt64-s3,...`): at 8-128 sequences x 32k tokens K/V read at 2.3-3.4 TB/s where 32 keys
# / 2 stages read 1.8-2.6, and the kernel went from 0.91-1.15x to 1.16-1.43x JAX's
# paged_attention (1.46-2.78x at 8-128 x 4k); one sequence changed by under 2% or gained (8 shapes,
# experiments/results/gpu_h200/attention_tiles_gpu.jsonl). The same tiles compile without
# spills for sm_80 / sm_90 at head_dim 64 and 128 (experiments/kernel_ptx.py's matrix); head_dim
# 64 was not timed. Prefill and mixed launches, f32 and quantized pages keep `default_tiles`.
DECODE_BF16_BLOCK_TOKENS, DECODE_BF16_STAGES = 64, 3


def plan(num_seqs: int, num_kv_heads: int, group: int, max_q_len: int, max_pages_per_seq: int,
         page_size: int, block_sizes: BlockSizes, *, head_dim: int = 128,
         dtype=jnp.bfloat16, precision: str = "highest", quantized: bool = False) -> _Plan:
  """Chooses tiles from static shapes: rows up to `Tiles.max_rows` per program, >= 16 keys per
  inner step, and enough KV splits to give ~target_programs programs; `block_sizes` overrides.
  Quantized pages hold each tile's scales too: IEEE f32 dots over heads wider than 64 with more
  than one query per row run on 4 warps (on 8, int8 per-page scales spilled 8 B on sm_80 at
  head_dim 128 in prefill; on 4, decode spilled on sm_90, so decode keeps 8: experiments/
  kernel_ptx.py's quantized sub-matrix)."""
  tiles = default_tiles(jnp.dtype(dtype), precision, head_dim, group)
  if (max_q_len == 1 and not quantized and jnp.dtype(dtype) == jnp.bfloat16
      and head_dim & (head_dim - 1) == 0 and head_dim <= 128):
    tiles = dataclasses.replace(tiles, block_tokens=DECODE_BF16_BLOCK_TOKENS,
                                num_stages=DECODE_BF16_STAGES)
  if (quantized and jnp.dtype(dtype) == jnp.float32 and precision == "highest"
      and head_dim > 64 and max_q_len > 1):
    tiles = dataclasses.replace(tiles, num_warps=4)
  block_q = block_sizes.block_q or (1 if max_q_len == 1 else
                                    max(1, min(_next_pow2(max_q_len), tiles.max_rows // group)))
  block_rows = max(_MIN_DOT, _next_pow2(block_q * group))
  num_row_blocks = -(-max_q_len // block_q)
  if block_sizes.pages_per_block is not None:
    block_tokens = _next_pow2(max(block_sizes.pages_per_block * page_size, _MIN_DOT))
  else:
    block_tokens = block_sizes.block_tokens or tiles.block_tokens
  ppb = max(1, block_tokens // page_size)
  max_blocks = max(1, -(-max_pages_per_seq // ppb))
  if block_sizes.num_splits is not None:
    num_splits = min(block_sizes.num_splits, max_blocks)
  else:
    programs = num_seqs * num_kv_heads * num_row_blocks
    num_splits = max(1, min(max_blocks, -(-block_sizes.target_programs // programs)))
  pages_per_split = -(-max_blocks // num_splits) * ppb
  return _Plan(block_q, block_rows, num_row_blocks, ppb, block_tokens, num_splits, pages_per_split,
               num_splits * pages_per_split + ppb, block_sizes.num_warps or tiles.num_warps,
               block_sizes.num_stages or tiles.num_stages,
               head_dim_chunks(head_dim, block_sizes.max_chunk or tiles.max_chunk))


def _kernel(meta_ref,      # i32[2]: kv_len, q_len of this sequence
            tables_ref,    # i32[table_width] this sequence's block table, NULL_PAGE padded
            q_ref,         # [block_rows, head_dim] rows = (query, head of the group)
            k_pages_ref,   # [num_pages, page_size, head_dim] one KV head (codes if quantized)
            v_pages_ref,   # [num_pages, page_size, head_dim]
            *refs,         # quantized: k_scales_ref, v_scales_ref f32[num_pages, S] (S: the
                           # page's tokens, or 1 for a scale per page); then:
                           # u_ref f32[block_rows, head_dim] unnormalised output of this split,
                           # m_ref f32[block_rows] running max,
                           # l_ref f32[block_rows] running sum of exp(s - m)
            group: int, block_q: int, num_splits: int, pages_per_split: int,
            block_tokens: int, scale: float, soft_cap: float | None,
            sliding_window: int | None, chunks: tuple[tuple[int, int], ...], precision: str,
            interpret: bool, quantized: bool = False):
  if quantized:
    k_scales_ref, v_scales_ref, u_ref, m_ref, l_ref = refs
  else:
    u_ref, m_ref, l_ref = refs
  j = pl.program_id(2)
  row_block, split = j // num_splits, j % num_splits
  kv_len, q_len = meta_ref[0], meta_ref[1]
  block_rows = q_ref.shape[0]
  page_size = k_pages_ref.shape[1]
  pages_per_block = block_tokens // page_size   # the wrapper makes pages <= block_tokens

  rows = jnp.arange(block_rows, dtype=jnp.int32)
  qi = row_block * block_q + rows // group
  row_valid = (rows < block_q * group) & (qi < q_len)
  q_pos = kv_len - q_len + qi

  # Keys this program may need: its split's pages, cut by causality (the block's last query)
  # and the sliding window (the block's first query).
  first_q = row_block * block_q
  last_q = jnp.minimum(first_q + block_q, q_len) - 1
  hi_tok = jnp.minimum(kv_len, kv_len - q_len + last_q + 1)
  lo_tok = 0
  if sliding_window is not None:
    lo_tok = jnp.maximum(0, kv_len - q_len + first_q - sliding_window + 1)
  lo_page = jnp.maximum(split * pages_per_split, lo_tok // page_size)
  hi_page = jnp.minimum((split + 1) * pages_per_split, (hi_tok + page_size - 1) // page_size)
  num_iters = jnp.maximum(0, (hi_page - lo_page + pages_per_block - 1) // pages_per_block)

  qs = [q_ref[:, pl.ds(off, size)] for off, size in chunks]

  def token_scales(ref, pages):   # f32[block_tokens, 1]: each key's scale
    sc = ref[pages, :]                                        # [pages_per_block, S]
    return jnp.broadcast_to(sc, (pages_per_block, page_size)).reshape(block_tokens, 1)

  def load(ref, scales, pages, off, size):   # [block_tokens, size] in q's dtype
    x = ref[pages, :, pl.ds(off, size)].reshape(block_tokens, size)
    if scales is None:
      return x
    return (x.astype(jnp.float32) * scales).astype(q_ref.dtype)   # dequantize as it is read

  def body(it, carry):
    m, l, us = carry
    first_page = lo_page + it * pages_per_block
    pages = tables_ref[pl.ds(first_page, pages_per_block)]
    tok = first_page * page_size + jnp.arange(block_tokens, dtype=jnp.int32)
    # The last block may run past this program's range (into the next split's pages): mask it.
    kv_valid = (tok < kv_len) & (tok < hi_page * page_size)
    k_sc = token_scales(k_scales_ref, pages) if quantized else None
    v_sc = token_scales(v_scales_ref, pages) if quantized else None
    s = None
    for q, (off, size) in zip(qs, chunks):
      k = load(k_pages_ref, k_sc, pages, off, size)
      part = _dot(q, k, ((1,), (1,)), precision, interpret)
      s = part if s is None else s + part
    s = s * scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    mask = row_valid[:, None] & kv_valid[None, :] & (tok[None, :] <= q_pos[:, None])
    if sliding_window is not None:
      mask &= q_pos[:, None] - tok[None, :] < sliding_window
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # no visible key yet: p = 0, not NaN
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    new_us = []
    for u, (off, size) in zip(us, chunks):
      v = load(v_pages_ref, v_sc, pages, off, size)
      v = jnp.where(kv_valid[:, None], v, 0)   # mask V too: 0 * NaN would be NaN
      pv = _dot(p.astype(v.dtype), v, ((1,), (0,)), precision, interpret)
      new_us.append(alpha[:, None] * u + pv)
    return m_new, l, tuple(new_us)

  init = (jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
          tuple(jnp.zeros((block_rows, size), jnp.float32) for _, size in chunks))
  m, l, us = jax.lax.fori_loop(0, num_iters, body, init)
  for u, (off, size) in zip(us, chunks):
    u_ref[:, pl.ds(off, size)] = u
  m_ref[...] = m
  l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("max_q_len", "scale", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret", "return_lse",
                                             "precision"))
def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                    max_q_len: int | None = None, scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False,
                    return_lse: bool = False, precision: str = "highest",
                    k_scales=None, v_scales=None):
  """Ragged paged attention in one kernel launch. Same arguments as `paged_attention_reference`.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged by `cu_q_lens`.
    k_pages: dtype[num_pages, page_size, num_kv_heads, head_dim]; page_size a power of two.
      With `k_scales`: int8 / float8 codes, dequantized (code * scale, in q's dtype) as they
      are read.
    v_pages: same as `k_pages`.
    k_scales, v_scales: f32[num_pages, S, H] the codes' scales (S page_size or 1, H num_kv_heads
      or 1: per token, per page or per tensor; `paged_jax.kv_quant`), or None for plain pages.
    block_tables: i32[num_seqs, max_pages_per_seq].
    seq_lens: i32[num_seqs] keys including this step's; 0 marks a padding row.
    cu_q_lens: i32[num_seqs + 1].
    max_q_len: static bound on q_len (1 for decode); default num_tokens.
    scale, sliding_window, soft_cap: as in the reference.
    block_sizes: tiling; see BlockSizes.
    interpret: run through Pallas' interpreter (CPU).
    return_lse: also return f32[num_tokens, num_q_heads] natural-log log-sum-exp.
    precision: the f32 dots' precision, a key of PRECISIONS ("highest", "tf32x3", "default");
      ignored for bf16. Errors against exact f32, measured in interpret mode by
      `python -m experiments.kernel_ptx --errors` (experiments/results/README.md):
      "highest" and "tf32x3" agree with f32 to ~1e-6, "default" (one TF32 pass) to ~1e-3.

  Returns:
    dtype[num_tokens, num_q_heads, head_dim] (and lse).
  """
  quantized = k_scales is not None
  if quantized != (v_scales is not None):
    raise ValueError("give both k_scales and v_scales, or neither")
  as_q = lambda x: jax.ShapeDtypeStruct(x.shape, q.dtype) if quantized else x
  check_static_args(q, as_q(k_pages), as_q(v_pages), block_tables, seq_lens, cu_q_lens,
                    max_q_len=max_q_len, sliding_window=sliding_window, soft_cap=soft_cap)
  if precision not in PRECISIONS:
    raise ValueError(f"precision={precision!r} is not one of {tuple(PRECISIONS)}")
  num_tokens, num_q_heads, head_dim = q.shape
  num_pages, page_size, num_kv_heads, _ = k_pages.shape
  if quantized:
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in QUANTIZED_DTYPES:
      raise ValueError(f"quantized pages must be one of {[d.name for d in QUANTIZED_DTYPES]}; "
                       f"got k={k_pages.dtype}, v={v_pages.dtype}")
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
      if (sc.ndim != 3 or sc.shape[0] != num_pages or sc.shape[1] not in (1, page_size)
          or sc.shape[2] not in (1, num_kv_heads)):
        raise ValueError(f"{name} shape {sc.shape} is not [num_pages={num_pages}, 1 or "
                         f"page_size={page_size}, 1 or num_kv_heads={num_kv_heads}]")
  if q.shape[0] == 0:
    return empty_result(q, return_lse)
  num_seqs, max_pages_per_seq = block_tables.shape
  group = num_q_heads // num_kv_heads
  if page_size & (page_size - 1):
    raise ValueError(f"page_size={page_size} must be a power of two for the Triton kernel")
  max_q_len = num_tokens if max_q_len is None else max_q_len
  scale = head_dim ** -0.5 if scale is None else scale
  plan_for = functools.partial(plan, num_seqs, num_kv_heads, group, max_q_len,
                               block_sizes=block_sizes, head_dim=head_dim, dtype=q.dtype,
                               precision=precision, quantized=quantized)
  p = plan_for(max_pages_per_seq, page_size)
  if p.block_tokens < page_size:
    # Pages larger than a step: view each page as page_size / block_tokens consecutive sub-pages
    # (a free reshape of the pool) and expand the block tables to match, so every step reads
    # whole (sub-)pages and the kernel keeps one path.
    subs = page_size // p.block_tokens
    k_pages = k_pages.reshape(num_pages * subs, p.block_tokens, num_kv_heads, head_dim)
    v_pages = v_pages.reshape(num_pages * subs, p.block_tokens, num_kv_heads, head_dim)
    if quantized:   # a sub-page takes its slice of per-token scales, or its page's scale
      sub = lambda sc: (sc.reshape(num_pages * subs, p.block_tokens, sc.shape[2])
                        if sc.shape[1] > 1 else jnp.repeat(sc, subs, axis=0))
      k_scales, v_scales = sub(k_scales), sub(v_scales)
    block_tables = (block_tables[:, :, None] * subs + jnp.arange(subs, dtype=block_tables.dtype)
                    ).reshape(num_seqs, max_pages_per_seq * subs)
    num_pages, max_pages_per_seq = num_pages * subs, max_pages_per_seq * subs
    page_size = p.block_tokens
    p = plan_for(max_pages_per_seq, page_size)

  tables = jnp.pad(block_tables, ((0, 0), (0, p.table_width - max_pages_per_seq)),
                   constant_values=NULL_PAGE)
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  meta = jnp.stack([seq_lens, q_lens], axis=1)
  # Rows of a program: (query, head of the group) pairs of one KV head, padded to block_rows.
  q_padded, _, _ = ragged_to_padded(q, cu_q_lens, seq_lens, max_q_len)
  qr = jnp.pad(q_padded, ((0, 0), (0, p.num_row_blocks * p.block_q - max_q_len), (0, 0), (0, 0)))
  qr = qr.reshape(num_seqs, p.num_row_blocks, p.block_q, num_kv_heads, group, head_dim)
  qr = qr.transpose(0, 3, 1, 2, 4, 5).reshape(num_seqs, num_kv_heads, p.num_row_blocks,
                                              p.block_q * group, head_dim)
  qr = jnp.pad(qr, ((0, 0),) * 3 + ((0, p.block_rows - p.block_q * group), (0, 0)))
  qr = qr.reshape(num_seqs, num_kv_heads, p.num_row_blocks * p.block_rows, head_dim)
  rows_total = p.num_row_blocks * p.block_rows
  ns = p.num_splits

  kernel = functools.partial(
      _kernel, group=group, block_q=p.block_q, num_splits=ns, pages_per_split=p.pages_per_split,
      block_tokens=p.block_tokens, scale=scale, soft_cap=soft_cap,
      sliding_window=sliding_window, chunks=p.chunks, precision=precision, interpret=interpret,
      quantized=quantized)
  scale_specs, scale_args = [], []
  if quantized:
    for sc in (k_scales, v_scales):   # one KV head's column of scales, or the shared one
      per_head = sc.shape[2] > 1
      scale_specs.append(pl.BlockSpec((num_pages, sc.shape[1], None),
                                      lambda b, h, j, per_head=per_head: (0, 0, h if per_head
                                                                          else 0)))
      scale_args.append(sc.astype(jnp.float32))
  u, m, l = pl.pallas_call(
      kernel,
      grid=(num_seqs, num_kv_heads, p.num_row_blocks * ns),
      in_specs=[
          pl.BlockSpec((None, 2), lambda b, h, j: (b, 0)),
          pl.BlockSpec((None, p.table_width), lambda b, h, j: (b, 0)),
          pl.BlockSpec((None, None, p.block_rows, head_dim), lambda b, h, j: (b, h, j // ns, 0)),
          pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h, j: (0, 0, h, 0)),
          pl.BlockSpec((num_pages, page_size, None, head_dim), lambda b, h, j: (0, 0, h, 0)),
      ] + scale_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, p.block_rows, head_dim),
                       lambda b, h, j: (j % ns, b, h, j // ns, 0)),
          pl.BlockSpec((None, None, None, p.block_rows), lambda b, h, j: (j % ns, b, h, j // ns)),
          pl.BlockSpec((None, None, None, p.block_rows), lambda b, h, j: (j % ns, b, h, j // ns)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((ns, num_seqs, num_kv_heads, rows_total, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((ns, num_seqs, num_kv_heads, rows_total), jnp.float32),
          jax.ShapeDtypeStruct((ns, num_seqs, num_kv_heads, rows_total), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=p.num_warps, num_stages=p.num_stages),
      interpret=interpret,
      name="ragged_paged_attention",
  )(meta, tables, qr, k_pages, v_pages, *scale_args)

  o, lse = finalize(merge_along(Summary(m, l, u), axis=0))   # exact merge of the KV splits

  def unrows(x):   # [B, K, rows_total, ...] -> [num_tokens, H, ...]
    tail = x.shape[3:]
    x = x.reshape((num_seqs, num_kv_heads, p.num_row_blocks, p.block_rows) + tail)
    x = x[:, :, :, :p.block_q * group].reshape(
        (num_seqs, num_kv_heads, p.num_row_blocks * p.block_q, group) + tail)
    x = jnp.moveaxis(x, 1, 2)[:, :max_q_len].reshape((num_seqs, max_q_len, num_q_heads) + tail)
    return padded_to_ragged(x, cu_q_lens, num_tokens)

  out = unrows(o).astype(q.dtype)
  if not return_lse:
    return out
  lse = unrows(lse)
  return out, jnp.where(jnp.arange(num_tokens)[:, None] < cu_q_lens[-1], lse, -jnp.inf)

