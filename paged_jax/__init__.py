"""paged_jax: PagedAttention in JAX. Paged KV pool, exact paged attention (XLA and Pallas), host
block manager, a Llama-family model with jitted prefill/decode steps, and a generation loop."""

from paged_jax.attention import (contiguous_attention, dense_attention, merge_states,
                                 paged_attention, paged_attention_reference, paged_attention_xla,
                                 validate_attention_inputs)
from paged_jax.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from paged_jax.config import ModelConfig
from paged_jax.generate import Generator
from paged_jax.host.block_manager import BlockManager
from paged_jax.kv_write import write_kv
from paged_jax.sampling import SamplingConfig
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool, kv_cache_bytes

__all__ = ["NULL_PAGE", "KVPool", "AttentionMetadata", "kv_cache_bytes", "write_kv",
           "dense_attention", "paged_attention", "paged_attention_xla", "paged_attention_reference",
           "contiguous_attention", "merge_states", "validate_attention_inputs", "BlockManager",
           "ModelConfig", "SamplingConfig", "Generator", "load_checkpoint", "save_checkpoint",
           "CheckpointError"]
