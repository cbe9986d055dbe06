"""paged_jax: PagedAttention in JAX. Paged KV pool, exact paged attention (XLA and Pallas), host
block manager and scheduler, a Llama-family model with jitted steps, and a serving engine."""

from paged_jax.attention import (contiguous_attention, dense_attention, merge_states,
                                 paged_attention, paged_attention_reference, paged_attention_xla,
                                 validate_attention_inputs)
from paged_jax.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.data_parallel import DataParallelEngine, make_engine
from paged_jax.engine import Engine
from paged_jax.generate import Generator
from paged_jax.host.block_manager import BlockManager
from paged_jax.kv_write import write_kv
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.host.sequence import RequestOutput
from paged_jax.sampling import SamplingParams
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool, kv_cache_bytes

__all__ = ["NULL_PAGE", "KVPool", "AttentionMetadata", "kv_cache_bytes", "write_kv",
           "dense_attention", "paged_attention", "paged_attention_xla", "paged_attention_reference",
           "contiguous_attention", "merge_states", "validate_attention_inputs", "BlockManager",
           "ModelConfig", "CacheConfig", "SchedulerConfig", "SamplingParams", "Engine",
           "RequestOutput", "Generator", "DataParallelEngine", "make_engine", "load_checkpoint", "save_checkpoint", "CheckpointError"]
