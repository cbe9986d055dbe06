"""Jit-compiled steps that thread the functional state: (params, pool, batch) -> (outputs, pool).

`prefill_step` and `decode_step` run the model on a ragged batch (prefill chunks that may start
after a cached prefix; one token per row for decode) and return the logits of each row's last query.
`multi_step_decode` runs k decode steps in one `lax.scan`, sampling included, after the host has
reserved the pages for those k tokens, so the host is consulted once per k tokens. The pool is
donated everywhere: do not reuse the pool you passed in. Each distinct padded shape compiles once;
the host pads batches to a few buckets (`paged_jax.generate`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.config import ModelConfig
from paged_jax.model import Decoder, PagedKV
from paged_jax.sampling import SamplingConfig, sample
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool


@flax.struct.dataclass
class Batch:
  """One step's inputs, padded to a bucket.

  Attributes:
    tokens: i32[num_tokens] ragged by md.cu_q_lens; padding tokens after cu_q_lens[-1].
    positions: i32[num_tokens] position of each token in its sequence.
    md: AttentionMetadata (block_tables, seq_lens, cu_q_lens, slots, static max_q_len).
    logits_indices: i32[num_seqs] the token whose logits each row returns (its last query).
  """
  tokens: jax.Array
  positions: jax.Array
  md: AttentionMetadata
  logits_indices: jax.Array


def _forward(params, pool: KVPool, batch: Batch, cfg: ModelConfig, impl: str):
  logits, kv = Decoder(cfg).apply({"params": params}, batch.tokens, batch.positions,
                                  PagedKV(pool, batch.md, impl), batch.logits_indices)
  return logits, kv.pool


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("pool",))
def prefill_step(params, pool: KVPool, batch: Batch, *, cfg: ModelConfig, impl: str = "auto"):
  """Ragged, chunked prefill (rows may start after a cached prefix).

  Returns:
    logits: f32[num_seqs, vocab_size] at each row's last query.
    pool: the updated pool (the input pool is donated).
  """
  return _forward(params, pool, batch, cfg, impl)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("pool",))
def decode_step(params, pool: KVPool, batch: Batch, *, cfg: ModelConfig, impl: str = "auto"):
  """One token per row (batch.md.max_q_len == 1). Returns (f32[num_seqs, vocab_size], pool)."""
  if batch.md.max_q_len != 1:
    raise ValueError(f"decode_step needs max_q_len=1, got {batch.md.max_q_len}")
  return _forward(params, pool, batch, cfg, impl)


@flax.struct.dataclass
class DecodeState:
  """What k decode steps need, for rows 0..num_active-1 (padding rows after them).

  Attributes:
    tokens: i32[num_seqs] each row's last token (its K/V is written by the first step).
    positions: i32[num_seqs] that token's position.
    block_tables: i32[num_seqs, max_pages_per_seq], with pages reserved for the next k tokens.
    active: bool[num_seqs]; padding rows are False and come last.
  """
  tokens: jax.Array
  positions: jax.Array
  block_tables: jax.Array
  active: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps", "sampling", "impl"),
                   donate_argnames=("pool",))
def multi_step_decode(params, pool: KVPool, state: DecodeState, key: jax.Array, *,
                      cfg: ModelConfig, num_steps: int, sampling: SamplingConfig = SamplingConfig(),
                      impl: str = "auto"):
  """k decode steps in one lax.scan; slots come from the reserved block tables on device.

  Returns:
    tokens: i32[num_steps, num_seqs] sampled tokens (garbage in padding rows).
    pool: the updated pool (donated).
  """
  num_seqs = state.tokens.shape[0]
  page_size = pool.page_size
  active = state.active.astype(jnp.int32)
  cu_q_lens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(active)]).astype(jnp.int32)
  rows = jnp.arange(num_seqs)

  def body(carry, step_key):
    pool, tokens, positions = carry
    page = state.block_tables[rows, jnp.clip(positions // page_size, 0,
                                             state.block_tables.shape[1] - 1)]
    slots = jnp.where(state.active, page * page_size + positions % page_size, NULL_PAGE)
    md = AttentionMetadata(block_tables=state.block_tables,
                           seq_lens=jnp.where(state.active, positions + 1, 0).astype(jnp.int32),
                           cu_q_lens=cu_q_lens, slots=slots.astype(jnp.int32), max_q_len=1)
    logits, pool = _forward(params, pool, Batch(tokens, positions, md, rows), cfg, impl)
    nxt = sample(logits, step_key, sampling)
    return (pool, nxt, positions + 1), nxt

  (pool, _, _), tokens = jax.lax.scan(body, (pool, state.tokens, state.positions),
                                      jax.random.split(key, num_steps))
  return tokens, pool
