"""Model configuration: frozen and hashable, so it is a static argument of every jitted step."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder (Llama, Qwen2, Mistral): RMSNorm, RoPE, SwiGLU MLP, GQA.

  Attributes:
    vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
    num_q_heads, num_kv_heads, head_dim: attention heads (num_q_heads % num_kv_heads == 0).
    rope_theta: rotary base.
    rms_norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reuses the token embedding.
    attention_bias: q/k/v projections have biases (Qwen2).
    sliding_window: Mistral-style window (keys t - W + 1 .. t), or None.
    max_position: longest sequence the model supports.
    dtype: parameter and activation dtype name ("float32" or "bfloat16").
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
  max_position: int = 2048
  dtype: str = "float32"

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


def tiny_config(**overrides) -> ModelConfig:
  """A few-thousand-parameter config for tests (GQA: 4 query heads over 2 KV heads)."""
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_q_heads=4,
              num_kv_heads=2, head_dim=8, max_position=256)
  return ModelConfig(**{**base, **overrides})
