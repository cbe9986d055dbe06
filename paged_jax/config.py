"""Model configuration: frozen and hashable, so it is a static argument of every jitted step."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import numpy as np

from paged_jax import kv_quant, rope


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder: RMSNorm, RoPE, gated MLP, GQA, and the switches that make it Qwen2 / 3,
  Mistral, Gemma 2 / 3 or Phi-3 (`paged_jax.checkpoint.FAMILIES` says which family sets which).

  Attributes:
    vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
    num_q_heads, num_kv_heads, head_dim: attention heads (num_q_heads % num_kv_heads == 0).
    rope_theta: rotary base.
    rms_norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reuses the token embedding.
    attention_bias: q/k/v projections have biases (Qwen2).
    sliding_window: Mistral-style window (keys t - W + 1 .. t), or None.
    layer_types: per layer "full_attention" or "sliding_attention" (transformers' name), or None:
      then every layer uses `sliding_window` (Mistral). Qwen2 windows only some layers.
    hidden_act: the MLP's gate activation, one of HIDDEN_ACTS (transformers' names).
    max_position: longest sequence the model supports.
    dtype: parameter and activation dtype name ("float32" or "bfloat16").
    rope_scaling: the RoPE type and its parameters as sorted (key, value) items (hashable), or
      None for plain RoPE: `paged_jax.rope` says which types run and how.
    local_rope_theta: the rotary base of sliding-window layers where it differs (Gemma 3), or
      None (every layer uses rope_theta and rope_scaling).
    qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3).
    unit_offset_norms: RMSNorms scale by (1 + weight), in f32 before the cast (Gemma).
    scale_embeddings: token embeddings are multiplied by sqrt(hidden_size) (Gemma).
    sandwich_norms: attention and MLP outputs are normed before their residual add, and the MLP
      input by `pre_feedforward_layernorm` (Gemma 2 / 3).
    query_scale: softmax scale, or None for head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5).
    attn_soft_cap: attention scores become cap * tanh(scores / cap) (Gemma 2), or None.
    final_soft_cap: the same on the output logits (Gemma 2), or None.
    matmul: how projections, MLPs and the LM head multiply (`paged_jax.matmul.BACKENDS`): "xla"
      (`jax.lax.dot_general`, the default), "mkl" (Intel MKL on a CPU) or "onednn" (oneDNN on
      a CPU); each library is an optional extra.
      Not a property of the checkpoint: runners set it (`serve --matmul`).
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10_000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  attention_bias: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  hidden_act: str = "silu"
  max_position: int = 2048
  dtype: str = "float32"
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  local_rope_theta: float | None = None
  qk_norm: bool = False
  unit_offset_norms: bool = False
  scale_embeddings: bool = False
  sandwich_norms: bool = False
  query_scale: float | None = None
  attn_soft_cap: float | None = None
  final_soft_cap: float | None = None
  matmul: str = "xla"

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_q_heads",
                 "num_kv_heads", "head_dim", "max_position"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.num_q_heads % self.num_kv_heads:
      raise ValueError(f"num_q_heads={self.num_q_heads} must be divisible by "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings)")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
    if self.matmul not in ("xla", "mkl", "onednn"):   # paged_jax.matmul.BACKENDS (not imported)
      raise ValueError(f"matmul={self.matmul!r} must be 'xla', 'mkl' or 'onednn'")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window={self.sliding_window} must be >= 1 (or None: no window)")
    if self.hidden_act not in HIDDEN_ACTS:
      raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: "
                       f"{sorted(HIDDEN_ACTS)}")
    if self.layer_types is not None:
      if not isinstance(self.layer_types, tuple):   # keep the config hashable
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                         f"num_layers={self.num_layers}")
      bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
      if bad:
        raise ValueError(f"layer_types: {bad} not in {LAYER_TYPES}")
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", rope.freeze(self.rope_scaling))
    rope.check(self.rope_scaling)
    for name in ("query_scale", "attn_soft_cap", "final_soft_cap", "local_rope_theta"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"{name}={value} must be > 0 (or None)")

  def layer_rope(self, layer: int) -> tuple[np.ndarray, float]:
    """(f32[head_dim // 2] inverse frequencies, attention_factor) of one layer's RoPE."""
    if self.local_rope_theta is not None and self.layer_window(layer) is not None:
      return _frequencies(self.head_dim, self.local_rope_theta, None, self.max_position)
    return _frequencies(self.head_dim, self.rope_theta, self.rope_scaling, self.max_position)

  def layer_window(self, layer: int) -> int | None:
    """The sliding window of one layer (None: full causal attention)."""
    if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
      return None
    return self.sliding_window

  def stored_kv_heads(self, model_parallel: int = 1) -> int:
    """KV heads the pool stores across `model_parallel` devices (tensor parallel over heads):
    num_kv_heads when they divide across the devices, else (fewer KV heads than devices) each
    KV head replicated on model_parallel / num_kv_heads devices, one head per device, as vLLM
    does. Raises where neither works (`paged_jax.sharding.check_tensor_parallel`)."""
    if model_parallel < 1:
      raise ValueError(f"model_parallel={model_parallel} must be >= 1")
    if self.num_kv_heads >= model_parallel:
      if self.num_kv_heads % model_parallel:
        raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide across "
                         f"model_parallel={model_parallel} devices")
      return self.num_kv_heads
    if model_parallel % self.num_kv_heads:
      raise ValueError(f"num_kv_heads={self.num_kv_heads} cannot be replicated evenly over "
                       f"model_parallel={model_parallel} devices (it must divide it)")
    return model_parallel


@functools.lru_cache(maxsize=64)
def _frequencies(head_dim, theta, scaling, max_position):
  inv_freq, factor = rope.frequencies(head_dim, theta, scaling, max_position)
  inv_freq.setflags(write=False)   # shared between callers through the cache
  return inv_freq, factor


# The MLP gate activations we implement (transformers' names; Llama / Qwen2 / Mistral use silu).
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new")
LAYER_TYPES = ("full_attention", "sliding_attention")


def tiny_config(**overrides) -> ModelConfig:
  """A few-thousand-parameter config for tests (GQA: 4 query heads over 2 KV heads)."""
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_q_heads=4,
              num_kv_heads=2, head_dim=8, max_position=256)
  return ModelConfig(**{**base, **overrides})


# Default KV budget where the device reports no memory statistics (the CPU).
DEFAULT_CPU_KV_BYTES = 256 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """The paged KV pool: page size, and how many pages (given, or carved from a memory budget).

  Exactly one of num_pages / memory_bytes / memory_fraction may be set; with none, a device that
  reports `memory_stats()` (GPU, TPU) gets memory_fraction=0.9 and the CPU a 256 MiB budget.

  Attributes:
    page_size: tokens per page.
    num_pages: pages in the pool, NULL_PAGE included.
    memory_bytes: KV budget in bytes.
    memory_fraction: share of the device memory left after the weights (needs memory_stats).
    enable_prefix_caching: share full pages between requests by chained hash.
    kv_dtype: how pages store K/V (`paged_jax.kv_quant`): "auto" (the model dtype), "int8",
      "float8_e4m3fn" or "float8_e5m2", each with f32 scales beside the codes.
    kv_scales: the scales' granularity, "token" (per page, token and KV head), "page" (per page
      and KV head) or "tensor" (one static scale, `kv_scale`); None: int8 per token, fp8 per
      tensor.
    kv_scale: the static scale of kv_scales="tensor" (vLLM's default without calibration: 1.0).
  """
  page_size: int = 16
  num_pages: int | None = None
  memory_bytes: int | None = None
  memory_fraction: float | None = None
  enable_prefix_caching: bool = True
  kv_dtype: str = "auto"
  kv_scales: str | None = None
  kv_scale: float = 1.0

  def __post_init__(self):
    if self.page_size < 1:
      raise ValueError(f"page_size={self.page_size} must be >= 1")
    self.kv_format   # raises ValueError naming a bad kv_dtype / kv_scales / kv_scale
    given = [n for n in ("num_pages", "memory_bytes", "memory_fraction")
             if getattr(self, n) is not None]
    if len(given) > 1:
      raise ValueError(f"set one of num_pages / memory_bytes / memory_fraction, not {given}")
    if self.num_pages is not None and self.num_pages < 2:
      raise ValueError(f"num_pages={self.num_pages} must be >= 2 (page 0 is NULL_PAGE)")
    if self.memory_bytes is not None and self.memory_bytes <= 0:
      raise ValueError(f"memory_bytes={self.memory_bytes} must be > 0")
    if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
      raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")

  @property
  def kv_format(self) -> kv_quant.KVFormat | None:
    """The quantized format of the pages, or None for the model dtype."""
    return kv_quant.kv_format(self.kv_dtype, self.kv_scales, self.kv_scale)

  def bytes_per_page(self, model: ModelConfig, model_parallel: int = 1) -> int:
    """K and V of one page across all layers, on one device of `model_parallel` (each holds
    its heads' slice of every page: `ModelConfig.stored_kv_heads`), a quantized pool's scales
    included (a scale per tensor is stored once per page: `kv_quant`)."""
    heads = model.stored_kv_heads(model_parallel) // model_parallel
    fmt = self.kv_format
    if fmt is None:
      itemsize = 2 if model.dtype == "bfloat16" else 4
      return 2 * model.num_layers * self.page_size * heads * model.head_dim * itemsize
    s, h = fmt.scale_shape(self.page_size, heads)
    codes = self.page_size * heads * model.head_dim * fmt.code_dtype.itemsize
    return 2 * model.num_layers * (codes + 4 * s * h)

  def resolve_num_pages(self, model: ModelConfig, memory_stats: dict | None,
                        model_parallel: int = 1) -> int:
    """Pages in the pool (NULL_PAGE included). A byte budget is per device: with tensor
    parallelism each device holds a 1 / model_parallel slice of every page, so the same budget
    holds more pages.

    Args:
      memory_stats: the device's `memory_stats()` taken after the weights were placed (None on
        the CPU): bytes_limit - bytes_in_use is what a fraction applies to.
      model_parallel: devices on the mesh's "model" axis.
    """
    if self.num_pages is not None:
      return self.num_pages
    budget = self.memory_bytes
    fraction = self.memory_fraction
    if budget is None and fraction is None:
      if memory_stats:
        fraction = 0.9
      else:
        budget = DEFAULT_CPU_KV_BYTES
    if budget is None:
      if not memory_stats or "bytes_limit" not in memory_stats:
        raise ValueError(f"memory_fraction={fraction} needs a device that reports memory_stats(); "
                         f"this one does not (the CPU): give memory_bytes instead")
      free = memory_stats["bytes_limit"] - memory_stats.get("bytes_in_use", 0)
      budget = int(fraction * free)
    per_page = self.bytes_per_page(model, model_parallel)
    pages = budget // per_page
    if pages < 2:
      raise ValueError(f"a KV budget of {budget} bytes holds {pages} pages of "
                       f"{per_page} bytes; the pool needs at least 2")
    return int(pages)


DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "xla")


def enable_compilation_cache(directory: str | None = DEFAULT_COMPILATION_CACHE) -> None:
  """Keeps compiled XLA programs on disk, so a second run of a command skips compiling (each
  step shape takes ~1-3 s to compile on a small CPU). None or "" leaves it off."""
  if not directory:
    return
  import jax
  os.makedirs(directory, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
