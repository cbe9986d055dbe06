"""Rotary position embeddings: the inverse frequencies of every RoPE type we run exactly, and
their application (Hugging Face's non-interleaved form).

The frequencies are host-side NumPy, computed once per config as transformers'
`modeling_rope_utils` computes them (in float32), so a checkpoint's `rope_scaling` /
`rope_parameters` gives the same rotations here as there:

| type      | inverse frequencies                                          | cos / sin scaled by   |
|-----------|--------------------------------------------------------------|-----------------------|
| default   | theta ** -(2i / d)                                           | 1                     |
| linear    | default / factor                                             | 1                     |
| llama3    | default, low frequencies / factor, a smooth ramp between     | 1                     |
| dynamic   | default: NTK rescaling only starts past max_position, which  | 1                     |
|           | the engine never runs (it refuses longer sequences)          |                       |
| yarn      | a ramp between default and default / factor                  | attention_factor      |
| factors   | default / factors[i] (llama.cpp's `rope_freqs.weight`, which  | 1                     |
|           | Llama 3.1+ GGUF files carry instead of llama3's parameters)  |                       |

`longrope` (Phi-3's `su`) switches between two frequency sets by the batch's longest sequence,
which a paged engine serving many lengths at once cannot reproduce: it is refused, by name.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "factors")
# What each type reads from the scaling dict (besides rope_type); missing ones are an error.
REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                       "original_max_position_embeddings"),
            "yarn": ("factor",), "factors": ("factors",)}
# Keys a scaling dict may carry that do not change the frequencies (read elsewhere or unused).
IGNORED = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def freeze(params: dict[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
  """A scaling dict as a hashable, sorted tuple of items (ModelConfig is a static jit argument);
  None for plain RoPE."""
  if not params:
    return None
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return None
  items = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()
           if k not in IGNORED and v is not None}
  items["rope_type"] = kind
  return tuple(sorted(items.items()))


def check(scaling: tuple[tuple[str, Any], ...] | None) -> None:
  """Raises ValueError naming the field where a scaling cannot run exactly."""
  if scaling is None:
    return
  params = dict(scaling)
  kind = params.get("rope_type")
  if kind not in ROPE_TYPES:
    why = (" (it switches frequency sets by the batch's longest sequence, which a paged batch of "
           "many lengths cannot reproduce)" if kind in ("longrope", "su") else "")
    raise ValueError(f"rope_scaling.rope_type={kind!r} is not supported{why}; supported: "
                     f"{list(ROPE_TYPES)}")
  missing = [k for k in REQUIRED[kind] if k not in params]
  if missing:
    raise ValueError(f"rope_scaling of type {kind!r} lacks {missing}")
  if kind == "factors" and not all(f > 0 for f in params["factors"]):
    raise ValueError(f"rope_scaling: factors must all be > 0")
  if kind == "llama3" and params["high_freq_factor"] == params["low_freq_factor"]:
    raise ValueError(f"rope_scaling: high_freq_factor={params['high_freq_factor']} must differ "
                     f"from low_freq_factor")


def frequencies(head_dim: int, theta: float, scaling: tuple[tuple[str, Any], ...] | None,
                max_position: int) -> tuple[np.ndarray, float]:
  """(f32[head_dim // 2] inverse frequencies, attention_factor) as transformers computes them.

  max_position: the config's max_position_embeddings (yarn's default original length).
  """
  check(scaling)
  arange = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
  inv_freq = (1.0 / (np.float32(theta) ** (arange / np.float32(head_dim)))).astype(np.float32)
  if scaling is None:
    return inv_freq, 1.0
  p = dict(scaling)
  kind = p["rope_type"]
  if kind == "dynamic":
    return inv_freq, 1.0
  if kind == "linear":
    return (inv_freq / np.float32(p["factor"])).astype(np.float32), 1.0
  if kind == "factors":
    factors = np.asarray(p["factors"], np.float32)
    if factors.shape != inv_freq.shape:
      raise ValueError(f"rope_scaling: {factors.size} factors for head_dim={head_dim} (needs "
                       f"{inv_freq.size})")
    return (inv_freq / factors).astype(np.float32), 1.0
  if kind == "llama3":
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  # yarn
  factor = p["factor"]
  original = p.get("original_max_position_embeddings") or max_position
  mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")

  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  attention_factor = p.get("attention_factor")
  if attention_factor is None:
    attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                        if mscale and mscale_all_dim else get_mscale(factor))
  beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

  def correction_dim(rotations):
    return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))
  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if p.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001   # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolation = (1 - ramp).astype(np.float32)
  pos_freqs = np.float32(theta) ** (arange / np.float32(head_dim))
  inv_extra = 1.0 / pos_freqs
  inv_inter = 1.0 / (np.float32(factor) * pos_freqs)
  inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
  return inv_freq.astype(np.float32), float(attention_factor)


def tables(positions, inv_freq: np.ndarray, attention_factor: float = 1.0):
  """cos and sin tables f32[T, D // 2] of positions i32[T] (times the attention factor).

  A step computes them once per distinct (inv_freq, factor) and every layer rotates with them
  (`model.computed_once`): recomputed in every layer, they cost SmolLM2's 4,560-token prefill
  ~200 ms.
  """
  import jax.numpy as jnp   # here: configs (which import this module) stay free of jax
  freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
  cos, sin = jnp.cos(freqs), jnp.sin(freqs)
  if attention_factor != 1.0:
    cos, sin = cos * attention_factor, sin * attention_factor
  return cos, sin


def rotate(x, cos, sin):
  """Rotates x: dtype[T, heads, D] by `tables`' f32[T, D // 2] (Hugging Face's rotate_half
  layout: the first half of D pairs with the second), in f32, cast back to x's dtype."""
  import jax.numpy as jnp
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[:, None, :], sin[:, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def apply(x, positions, inv_freq: np.ndarray, attention_factor: float = 1.0):
  """Rotates x: dtype[T, heads, D] at positions i32[T] by f32[D // 2] inverse frequencies."""
  return rotate(x, *tables(positions, inv_freq, attention_factor))
