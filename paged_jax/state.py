"""Device-side state: the paged KV pool and one step's attention metadata.

Both are frozen `flax.struct` pytrees; transitions return new values. This module fixes the pool
layout once for the whole project:

  k, v: dtype[num_layers, num_pages, page_size, num_kv_heads, head_dim]

Layer `l`'s page `p` is also page `l * num_pages + p` of the flat view
[num_layers * num_pages, page_size, num_kv_heads, head_dim] (a free reshape): a step writes a
layer's K/V and reads its pages through that view with its block tables and slots offset by
`layer_offset(layer)` pages, never slicing the layer out. A slice of an array just updated is
materialised by XLA as a copy of the whole layer, every layer of every step (decode cost would
grow with the pool's size, not with what it reads); the offset also works for a traced layer
index, so the layers can run as a `lax.scan` (`model.scanned_forward`).

A quantized pool (`paged_jax.kv_quant`: int8 / fp8 codes with f32 scales) holds its scales beside
the pages, f32[num_layers, num_pages, S, H] (S, H by granularity), so everything that indexes
pages on axis 1 carries them along: page operations go through `page_arrays` / `with_page_arrays`.

Page `NULL_PAGE` (0) is never allocated. Padding rows of a block table, and write slots of padding
tokens, point into it (into each layer's page 0 once offset); its contents are garbage on purpose,
and every reader masks by `seq_lens`.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import kv_quant

NULL_PAGE = 0


@flax.struct.dataclass
class KVPool:
  """Paged K/V for every layer.

  Attributes:
    k: dtype[num_layers, num_pages, page_size, num_kv_heads, head_dim]; int8 / float8 codes when
      the pool is quantized.
    v: same shape and dtype as `k`.
    k_scale: f32[num_layers, num_pages, S, H] scales of a quantized pool (None otherwise).
    v_scale: same as `k_scale`.
    fmt: the quantized format (`kv_quant.KVFormat`), None for the model dtype. Static.
    compute_dtype: the model dtype K/V are read back in (name; static). For an unquantized pool,
      the pool's own dtype.
  """
  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  fmt: kv_quant.KVFormat | None = flax.struct.field(pytree_node=False, default=None)
  compute_dtype: str | None = flax.struct.field(pytree_node=False, default=None)

  @classmethod
  def create(cls, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
             head_dim: int, dtype=jnp.float32, kv_format: kv_quant.KVFormat | None = None
             ) -> "KVPool":
    """A zero-filled pool. `num_pages` counts NULL_PAGE, so `num_pages - 1` are usable.
    `dtype` is the model dtype; `kv_format` (None: store that dtype) quantizes the pages."""
    for name, value in (("num_layers", num_layers), ("num_pages", num_pages),
                        ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
      if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is NULL_PAGE)")
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    if kv_format is None:
      return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
    scale_shape = (num_layers, num_pages) + kv_format.scale_shape(page_size, num_kv_heads)
    return cls(k=jnp.zeros(shape, kv_format.code_dtype), v=jnp.zeros(shape, kv_format.code_dtype),
               k_scale=jnp.zeros(scale_shape, jnp.float32),
               v_scale=jnp.zeros(scale_shape, jnp.float32), fmt=kv_format,
               compute_dtype=jnp.dtype(dtype).name)

  @classmethod
  def from_stacked(cls, k, v) -> "KVPool":
    """From [num_layers, num_pages, page_size, num_kv_heads, head_dim] arrays."""
    return cls(k=jnp.asarray(k), v=jnp.asarray(v))

  def stacked(self) -> tuple[jax.Array, jax.Array]:
    """(k, v) [num_layers, num_pages, page_size, num_kv_heads, head_dim] (the pool's own)."""
    return self.k, self.v

  @property
  def quantized(self) -> bool:
    return self.fmt is not None

  def page_arrays(self) -> tuple[jax.Array, ...]:
    """Every array indexed by page on axis 1: (k, v), and (k_scale, v_scale) when quantized.
    Page operations (copy, swap, scrub) act on all of them alike."""
    return (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ())

  def with_page_arrays(self, arrays) -> "KVPool":
    """The pool holding `arrays` (as `page_arrays` returns them, updated)."""
    arrays = tuple(arrays)
    if len(arrays) != len(self.page_arrays()):
      raise ValueError(f"{len(arrays)} page arrays for a pool of {len(self.page_arrays())}")
    if not self.quantized:
      return self.replace(k=arrays[0], v=arrays[1])
    return self.replace(k=arrays[0], v=arrays[1], k_scale=arrays[2], v_scale=arrays[3])

  def flat(self) -> tuple[jax.Array, jax.Array]:
    """(k, v) as [num_layers * num_pages, page_size, num_kv_heads, head_dim] views: layer l's
    page p is page `layer_offset(l) + p`."""
    shape = (self.num_layers * self.num_pages,) + self.k.shape[2:]
    return self.k.reshape(shape), self.v.reshape(shape)

  def flat_scales(self) -> tuple[jax.Array, jax.Array]:
    """(k_scale, v_scale) as [num_layers * num_pages, S, H] views (quantized pools)."""
    shape = (self.num_layers * self.num_pages,) + self.k_scale.shape[2:]
    return self.k_scale.reshape(shape), self.v_scale.reshape(shape)

  def from_flat(self, k: jax.Array, v: jax.Array, k_scale=None, v_scale=None) -> "KVPool":
    """The pool holding flat views `k`, `v` (as `flat` returns them, updated), and the flat
    scales of a quantized pool."""
    pool = self.replace(k=k.reshape(self.k.shape), v=v.reshape(self.v.shape))
    if self.quantized:
      pool = pool.replace(k_scale=k_scale.reshape(self.k_scale.shape),
                          v_scale=v_scale.reshape(self.v_scale.shape))
    return pool

  def layer_offset(self, layer):
    """Pages before layer `layer` in the flat view (an int, or a traced i32 scalar)."""
    return layer * self.num_pages

  # Derived from the shapes, never stored twice.
  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k.shape[1]

  @property
  def page_size(self) -> int:
    return self.k.shape[2]

  @property
  def num_kv_heads(self) -> int:
    return self.k.shape[3]

  @property
  def head_dim(self) -> int:
    return self.k.shape[4]

  @property
  def dtype(self):
    """The stored dtype (the codes' of a quantized pool; `compute_dtype` is what reads return)."""
    return self.k.dtype

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in self.page_arrays())

  @property
  def bytes_per_token(self) -> float:
    """K and V bytes one token takes across all layers (the seeds' 2 x L x Hkv x D x b), the
    scales included (a page's share per token) when quantized."""
    if not self.quantized:
      return kv_cache_bytes(num_layers=self.num_layers, num_tokens=1,
                            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                            bytes_per_element=jnp.dtype(self.dtype).itemsize)
    return self.nbytes / (self.num_pages * self.page_size)


@flax.struct.dataclass
class AttentionMetadata:
  """One step's metadata for a ragged batch that may mix prefill chunks and decode rows.

  Queries of all sequences are concatenated along one token axis; sequence `b` owns query tokens
  `cu_q_lens[b]:cu_q_lens[b+1]`, and its query `i` sits at position
  `seq_lens[b] - q_len[b] + i` (causal). Decode rows have `q_len == 1`.

  Attributes:
    block_tables: i32[num_seqs, max_pages_per_seq]; unused entries are NULL_PAGE.
    seq_lens: i32[num_seqs] tokens in cache *including* this step's; 0 marks a padding row.
    cu_q_lens: i32[num_seqs + 1] cumulative query lengths, `cu_q_lens[0] == 0`.
    slots: i32[num_tokens] flat write slot (`page * page_size + offset`) of each query token;
      padding tokens point into NULL_PAGE.
    max_q_len: static upper bound on any sequence's q_len (1 for pure decode); fixes shapes.
    num_decode: static count of leading decode rows: rows 0..num_decode-1 have one query each, at
      tokens 0..num_decode-1, so the XLA path can run them apart from the prefill rows after them
      (`attention.step_attention`). 0 = no such promise (every row is treated as a chunk).
  """
  block_tables: jax.Array
  seq_lens: jax.Array
  cu_q_lens: jax.Array
  slots: jax.Array
  max_q_len: int = flax.struct.field(pytree_node=False, default=1)
  num_decode: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def num_seqs(self) -> int:
    return self.block_tables.shape[0]

  @property
  def num_tokens(self) -> int:
    return self.slots.shape[0]


def kv_cache_bytes(*, num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int,
                   bytes_per_element: int) -> int:
  """KV bytes ~= 2 x L x T x Hkv x D x b (keys plus values; no padding or metadata)."""
  return 2 * num_layers * num_tokens * num_kv_heads * head_dim * bytes_per_element
