"""Jit-compiled steps that thread the functional state: (params, pool, batch) -> (outputs, pool).

`prefill_step` and `decode_step` run the model on a ragged batch (prefill chunks that may start
after a cached prefix; one token per row for decode) and return the logits of each row's last
query. `sample_step` is the engine's step: decode rows and prefill chunks in one batch, then a token
per sample row (per-row sampling settings). `multi_step_decode` runs k decode steps in one
`lax.scan`, sampling included, after the host has reserved the pages for those k tokens, so the
host is consulted once per k tokens. The pool is donated everywhere: do not reuse the pool you
passed in. Each distinct padded shape compiles once; the host pads batches to a few buckets
(`paged_jax.host.batching`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import model
from paged_jax.config import ModelConfig
from paged_jax.model import PagedKV
from paged_jax.sampling import SamplingArrays, sample
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
  logits, kv = model.apply(params, cfg, batch.tokens, batch.positions,
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


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "greedy_only", "num_logprobs"),
                   donate_argnames=("pool",))
def sample_step(params, pool: KVPool, batch: Batch, sampling: SamplingArrays, *, cfg: ModelConfig,
                impl: str = "auto", greedy_only: bool = False, num_logprobs: int = 0):
  """One model step (decode rows and prefill chunks mixed) and a token for each sample row.

  `batch.logits_indices` names the token whose logits each sample row samples from (a prompt
  sampled n times lists its last token n times).

  Returns:
    SampleOutput [num_samples], and the updated pool (donated).
  """
  logits, pool = _forward(params, pool, batch, cfg, impl)
  with jax.named_scope("sampling"):
    out = sample(logits, sampling, greedy_only=greedy_only, num_logprobs=num_logprobs)
  return out, pool


@flax.struct.dataclass
class DecodeState:
  """What k decode steps need, one row per sequence.

  Attributes:
    tokens: i32[num_seqs] each row's last token (its K/V is written by the first step).
    positions: i32[num_seqs] that token's position.
    block_tables: i32[num_seqs, max_pages_per_seq], with pages reserved for the next tokens.
    write_limit: i32[num_seqs] positions < write_limit get their K/V written; later steps of the
      row write into NULL_PAGE and their tokens are discarded by the host (a row that reaches
      max_tokens inside the k steps). 0 marks a padding row.
  """
  tokens: jax.Array
  positions: jax.Array
  block_tables: jax.Array
  write_limit: jax.Array


@functools.partial(jax.jit, static_argnames=("cfg", "num_steps", "impl", "greedy_only",
                                             "num_logprobs"),
                   donate_argnames=("pool",))
def multi_step_decode(params, pool: KVPool, state: DecodeState, sampling: SamplingArrays, *,
                      cfg: ModelConfig, num_steps: int, impl: str = "auto",
                      greedy_only: bool = False, num_logprobs: int = 0):
  """k decode steps in one lax.scan; slots come from the reserved block tables on device.

  Row i samples its step-s token with `sampling` at output_index + s, so a seeded request draws
  the same stream whether it runs k steps at a time or one.

  Returns:
    SampleOutput with leading shape [num_steps, num_seqs] (garbage in padding rows), and the
    updated pool (donated).
  """
  return _decode_steps(params, pool, state, sampling, cfg, num_steps, impl, greedy_only,
                       num_logprobs)


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "greedy_only", "num_logprobs"),
                   donate_argnames=("pool",))
def decode_link(params, pool: KVPool, state: DecodeState, sampling: SamplingArrays, *,
                cfg: ModelConfig, impl: str = "auto", greedy_only: bool = False,
                num_logprobs: int = 0):
  """One step of a decode round that also returns the next step's inputs, so the engine can
  chain a round's k steps as k dispatches (a stoppable round: `Engine(stoppable_rounds=True)`)
  and stop between two of them. Chaining k links samples exactly what `multi_step_decode`'s
  k-step scan samples (the same body; output_index advances by one per link).

  Returns:
    (SampleOutput [1, num_seqs], the updated pool (donated), the next DecodeState: tokens the
    samples, positions + 1, the same tables and write limits; the next SamplingArrays:
    output_index + 1).
  """
  out, pool = _decode_steps(params, pool, state, sampling, cfg, 1, impl, greedy_only,
                            num_logprobs)
  state = state.replace(tokens=out.tokens[0], positions=state.positions + 1)
  return out, pool, state, sampling.replace(output_index=sampling.output_index + 1)


def _decode_steps(params, pool: KVPool, state: DecodeState, sampling: SamplingArrays,
                  cfg: ModelConfig, num_steps: int, impl: str, greedy_only: bool,
                  num_logprobs: int):
  """`multi_step_decode`'s body (traced inside a jit)."""
  num_seqs = state.tokens.shape[0]
  page_size = pool.page_size
  rows = jnp.arange(num_seqs, dtype=jnp.int32)
  cu_q_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
  live = state.write_limit > 0

  def body(carry, s):
    pool, tokens, positions = carry
    page = state.block_tables[rows, jnp.clip(positions // page_size, 0,
                                             state.block_tables.shape[1] - 1)]
    slots = jnp.where(positions < state.write_limit, page * page_size + positions % page_size,
                      NULL_PAGE * page_size)
    # A padding row reads one key, its own write into NULL_PAGE: finite, and discarded.
    md = AttentionMetadata(block_tables=state.block_tables,
                           seq_lens=jnp.where(live, positions + 1, 1).astype(jnp.int32),
                           cu_q_lens=cu_q_lens, slots=slots.astype(jnp.int32), max_q_len=1,
                           num_decode=num_seqs)
    logits, pool = _forward(params, pool, Batch(tokens, positions, md, rows), cfg, impl)
    with jax.named_scope("sampling"):
      out = sample(logits, sampling.replace(output_index=sampling.output_index + s),
                   greedy_only=greedy_only, num_logprobs=num_logprobs)
    return (pool, out.tokens, positions + 1), out

  (pool, _, _), out = jax.lax.scan(body, (pool, state.tokens, state.positions),
                                   jnp.arange(num_steps, dtype=jnp.int32))
  return out, pool
