"""paged_jax: PagedAttention in JAX. Paged KV pool, exact paged attention, host block manager."""

from paged_jax.attention import (contiguous_attention, dense_attention, merge_states,
                                 paged_attention, paged_attention_reference,
                                 validate_attention_inputs)
from paged_jax.kv_write import write_kv
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool, kv_cache_bytes

__all__ = ["NULL_PAGE", "KVPool", "AttentionMetadata", "kv_cache_bytes", "write_kv",
           "dense_attention", "paged_attention", "paged_attention_reference",
           "contiguous_attention", "merge_states", "validate_attention_inputs"]
