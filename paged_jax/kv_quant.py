"""Quantized KV pages: the formats, quantize / dequantize, the quantizing write, and the view the
attention paths read through.

A pool in a quantized format stores K and V as int8 or fp8 codes beside f32 scales; a value is
`code * scale`. The scales follow the pages (axis 1 of the pool, like K and V), so every page
operation (copy-on-write, swap, scrub, prefix reuse) carries them along:

  codes:  int8 / float8[num_layers, num_pages, page_size, num_kv_heads, head_dim]
  scales: f32[num_layers, num_pages, S, H]   with (S, H) by granularity:
    "token"   (page_size, num_kv_heads)  one scale per (page, token, KV head): absmax over head_dim
              of the token's K (or V) head / the format's largest code;
    "page"    (1, num_kv_heads)          one per (page, KV head): the running absmax of the tokens
              written into the page so far; a write that raises it requantizes the page's codes
              to the new scale (so a page's tokens always share one scale). A write at a page's
              offset 0 starts the page afresh (a reused page's old scale is dropped);
    "tensor"  (1, 1)                     a static scale per pool (`KVFormat.tensor_scale`, 1.0 by
              default, vLLM's default for fp8 without calibration); codes saturate beyond it.

Rounding is to nearest (int8: round half to even, then clip to [-127, 127]; fp8: the cast's
round-to-nearest-even after clipping to the format's finite range, so nothing becomes inf / NaN).

The attention paths (XLA and the Pallas kernel) read a layer's pages through `QuantizedPages`:
indexing it returns dequantized values in the model dtype, so every path's gather dequantizes as
it reads and the merging is untouched. A step's own keys (a prefill chunk attends to them without
reading the pool) go through the same round trip (`write_layer` returns it), so a step sees
exactly the K/V a later step reads back: quantization error, but no error of the paging's own.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# storage dtype name -> the largest finite code (a scale maps absmax to it)
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
KV_DTYPES = ("auto",) + tuple(QMAX)
GRANULARITIES = ("token", "page", "tensor")
# What each dtype gets when `kv_scales` is not given: int8 per token (its 8 bits need a tight
# scale), fp8 per tensor, static (vLLM's fp8 KV cache without calibration).
DEFAULT_GRANULARITY = {"int8": "token", "float8_e4m3fn": "tensor", "float8_e5m2": "tensor"}


@dataclasses.dataclass(frozen=True)
class KVFormat:
  """How a quantized pool stores K/V (hashable: a static part of the pool pytree).

  Attributes:
    dtype: the codes' dtype name, a key of QMAX.
    granularity: "token", "page" or "tensor" (see the module docstring).
    tensor_scale: the static scale of "tensor" (ignored otherwise).
  """
  dtype: str
  granularity: str
  tensor_scale: float = 1.0

  def __post_init__(self):
    if self.dtype not in QMAX:
      raise ValueError(f"kv_dtype={self.dtype!r} is not one of {KV_DTYPES}")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"kv_scales={self.granularity!r} is not one of {GRANULARITIES}")
    if not (np.isfinite(self.tensor_scale) and self.tensor_scale > 0):
      raise ValueError(f"kv_scale={self.tensor_scale} must be a finite number > 0")

  @property
  def qmax(self) -> float:
    return QMAX[self.dtype]

  @property
  def code_dtype(self):
    return jnp.dtype(self.dtype)

  def scale_shape(self, page_size: int, num_kv_heads: int) -> tuple[int, int]:
    """(S, H): the trailing scale dims of one page."""
    return {"token": (page_size, num_kv_heads), "page": (1, num_kv_heads),
            "tensor": (1, 1)}[self.granularity]

  def bytes_per_page_head(self, page_size: int, head_dim: int, num_kv_heads: int) -> float:
    """Bytes of K (or V) of one page, codes and scales, per KV head."""
    s, h = self.scale_shape(page_size, num_kv_heads)
    return page_size * head_dim * self.code_dtype.itemsize + 4 * s * h / num_kv_heads


def kv_format(kv_dtype: str | None, kv_scales: str | None = None,
              kv_scale: float = 1.0) -> KVFormat | None:
  """The format `CacheConfig(kv_dtype, kv_scales, kv_scale)` names; None for the model dtype
  ("auto" or None). Raises ValueError naming a bad value."""
  if kv_dtype in (None, "auto"):
    if kv_scales is not None:
      raise ValueError(f"kv_scales={kv_scales!r} needs a quantized kv_dtype (one of "
                       f"{tuple(QMAX)}); kv_dtype is {kv_dtype!r}")
    return None
  if kv_dtype not in QMAX:
    raise ValueError(f"kv_dtype={kv_dtype!r} is not one of {KV_DTYPES}")
  return KVFormat(kv_dtype, kv_scales or DEFAULT_GRANULARITY[kv_dtype], float(kv_scale))


def unsupported_reason(fmt: KVFormat | None, *, uses_kernel: bool,
                       device: jax.Device | None = None) -> str | None:
  """Why this JAX (or the kernel on this device) cannot store / read `fmt`, or None if it can.
  The engine refuses such a format at start (never upcasts it silently)."""
  if fmt is None:
    return None
  if not hasattr(jnp, fmt.dtype):
    return f"kv_dtype={fmt.dtype!r}: jax {jax.__version__} has no jnp.{fmt.dtype}"
  if uses_kernel and fmt.dtype.startswith("float8"):
    device = device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and capability is not None:
      major, minor = (int(x) for x in str(capability).split(".")[:2])
      if (major, minor) < (8, 9):
        return (f"kv_dtype={fmt.dtype!r}: the Triton kernel's fp8 loads need compute capability "
                f">= 8.9 (Ada / Hopper); {device.device_kind} has {capability}. Use "
                f"kv_dtype='int8', or impl='xla'")
  return None


def quantize(x: jax.Array, scale: jax.Array, fmt: KVFormat) -> jax.Array:
  """Codes of x f32[..., D] at scale f32[...] (broadcast over D): round to nearest, saturating."""
  y = x.astype(jnp.float32) / jnp.where(scale > 0, scale, 1.0)[..., None]
  y = jnp.clip(y, -fmt.qmax, fmt.qmax)
  if fmt.dtype == "int8":
    y = jnp.round(y)
  return y.astype(fmt.code_dtype)


def dequantize(codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """codes[..., D] * scale[...] in `dtype` (the product in f32)."""
  return (codes.astype(jnp.float32) * scale[..., None]).astype(dtype)


def absmax_scale(x: jax.Array, fmt: KVFormat) -> jax.Array:
  """f32[...] the scale that maps the absmax over x's last axis to the format's largest code."""
  return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / fmt.qmax


def roundtrip(x: jax.Array, fmt: KVFormat, scale: jax.Array | None = None) -> jax.Array:
  """x [T, K, D] quantized and dequantized as a write with scale f32[T, K] (per token and head
  when None) stores it: the reference's K/V."""
  if scale is None:
    scale = absmax_scale(x, fmt)
  return dequantize(quantize(x, scale, fmt), scale, x.dtype)


def write_layer(codes: jax.Array, scales: jax.Array, x: jax.Array, slots: jax.Array,
                fmt: KVFormat) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Quantizes x[t] into slot slots[t] of `codes`.

  Args:
    codes: [num_pages, page_size, K, D] (one layer, or the pool's flat view with offset slots).
    scales: f32[num_pages, S, H] beside it.
    x: [T, K, D] this step's keys (or values).
    slots: i32[T] flat slots `page * page_size + offset`.

  Returns:
    (codes, scales, x_hat): the updated codes and scales, and x dequantized from what was
    stored, in x's dtype (what a later read of these slots returns).
  """
  page_size = codes.shape[1]
  page, offset = slots // page_size, slots % page_size
  if slots.shape[0] == 1:   # as kv_write.write_kv_layer: keep a scatter, not a dynamic slice
    page, offset, x = (jnp.concatenate([a, a]) for a in (page, offset, x))
  if fmt.granularity == "token":
    s = absmax_scale(x, fmt)                                          # [T, K]
    q = quantize(x, s, fmt)
    return (codes.at[page, offset].set(q), scales.at[page, offset].set(s),
            dequantize(q, s, x.dtype)[:slots.shape[0]])
  if fmt.granularity == "tensor":
    s = jnp.full(x.shape[:2], fmt.tensor_scale, jnp.float32)
    q = quantize(x, s, fmt)
    return (codes.at[page, offset].set(q), scales.at[page, 0].set(fmt.tensor_scale),
            dequantize(q, s, x.dtype)[:slots.shape[0]])
  # "page": a page's scale is the running absmax of what it holds. Cost: each written token
  # gathers and rewrites its whole page (page_size x a token's bytes; a prefill chunk's pages
  # once per token in them), the price of one scale per page. A write at offset 0 starts
  # a fresh page (drop the old scale: the page may have been freed and reused); then raise each
  # touched page's scale to cover the new tokens, requantize the page's existing codes to it
  # (duplicate pages in `page` compute the same values, so the scatter order does not matter),
  # and write the new tokens at the new scale.
  n = scales.shape[0]
  old = scales.at[jnp.where(offset == 0, page, n), 0].set(0.0, mode="drop")
  new = old.at[page, 0].max(absmax_scale(x, fmt))
  old_s, new_s = old[page, 0], new[page, 0]                           # [T, K]
  kept = dequantize(codes[page], old_s[:, None], jnp.float32)         # [T, page_size, K, D]
  codes = codes.at[page].set(quantize(kept, jnp.broadcast_to(new_s[:, None], kept.shape[:3]), fmt))
  q = quantize(x, new_s, fmt)
  return codes.at[page, offset].set(q), new, dequantize(q, new_s, x.dtype)[:slots.shape[0]]


@flax.struct.dataclass
class QuantizedPages:
  """One layer's (or the flat view's) codes and scales, read as dequantized pages.

  `pages[idx]` (an integer array of page ids, any shape) returns dtype[*idx.shape, page_size,
  K, D] dequantized, so the attention paths' gathers dequantize as they read. `shape` and `dtype`
  are those of the dequantized pages (what the paths check against q).

  Attributes:
    codes: int8 / float8[num_pages, page_size, K, D].
    scales: f32[num_pages, S, H] (S in {page_size, 1}, H in {K, 1}).
    dtype: the model dtype values are returned in (static).
  """
  codes: jax.Array
  scales: jax.Array
  dtype: jnp.dtype = flax.struct.field(pytree_node=False, default=jnp.float32)

  @property
  def shape(self):
    return self.codes.shape

  @property
  def ndim(self):
    return self.codes.ndim

  def full_scales(self) -> jax.Array:
    """f32[num_pages, page_size, K]: the scales broadcast to every (token, head)."""
    return jnp.broadcast_to(self.scales, self.codes.shape[:3])

  def __getitem__(self, idx):
    return dequantize(self.codes[idx], jnp.broadcast_to(
        self.scales[idx], self.codes[idx].shape[:-1]), self.dtype)

  def dequantized(self) -> jax.Array:
    """Every page dequantized (tests and references; the paths gather instead)."""
    return dequantize(self.codes, self.full_scales(), self.dtype)


def quantize_pages(pages: jax.Array, fmt: KVFormat) -> QuantizedPages:
  """Whole pages [num_pages, page_size, K, D] stored in `fmt` at once (scales from each
  (page, token, head), (page, head) or the static scale): references, tests and experiments.
  A page written token by token in "page" granularity can hold a larger scale than this (its
  running absmax), never a smaller one."""
  num_pages, page_size, num_kv_heads, _ = pages.shape
  if fmt.granularity == "token":
    scales = absmax_scale(pages, fmt)
  elif fmt.granularity == "page":
    scales = jnp.max(absmax_scale(pages, fmt), axis=1, keepdims=True)
  else:
    scales = jnp.full((num_pages, 1, 1), fmt.tensor_scale, jnp.float32)
  codes = quantize(pages, jnp.broadcast_to(scales, pages.shape[:3]), fmt)
  return QuantizedPages(codes, scales, jnp.dtype(pages.dtype))
