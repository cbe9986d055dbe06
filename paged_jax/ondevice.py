"""Generation as one compiled program: prefill, then a `lax.while_loop` of decode steps that
allocates pages on the device (`page_table.PageTable`), with no host round trip inside.

  out = generate_on_device(params, prompts, prompt_lens, cfg=cfg, max_new_tokens=32,
                           num_pages=256, page_size=16, n=2)
  out.tokens[r, :out.lengths[r]]          # row r = prompt r // n, sample r % n

For generation inside a larger JAX program (rollouts in a training loop, evaluation under `jit`),
or where a host sync costs more than a step. What it gives up against the `Engine`: no prefix
cache, no preemption (a sequence the pool cannot grow stops with FINISH_OVERFLOW, its tokens so
far correct), no continuous admission (the batch is fixed), no beam search; every row runs until
the slowest finishes. Sampling is the engine's (`sampling.sample`, row keys from (seed, sample
index, output index)), so greedy and seeded outputs equal the engine's token for token.

Each loop iteration: grow every live sequence by one slot (a new page at a page boundary; a
copy-on-write of a shared partial page, applied with `page_ops.copy_pages`), one decode step
over all rows (finished rows are padding), sample, stop rows at EOS / their max_tokens /
max_position, free their pages.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import page_ops, page_table as ptm
from paged_jax.config import ModelConfig
from paged_jax.sampling import SamplingArrays, sample
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool
from paged_jax.step import Batch, _forward

FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_OVERFLOW = 0, 1, 2, 3
FINISH_REASONS = {FINISH_NONE: None, FINISH_STOP: "stop", FINISH_LENGTH: "length",
                  FINISH_OVERFLOW: "overflow"}


@flax.struct.dataclass
class OnDeviceOutput:
  """What `generate_on_device` returns (R = num_prompts * n rows; row r = prompt r // n).

  Attributes:
    tokens: i32[R, max_new_tokens] generated tokens; past lengths[r] they are 0.
    logprobs: f32[R, max_new_tokens] each token's logprob (raw model distribution).
    lengths: i32[R] tokens generated per row.
    finish_reason: i32[R] FINISH_STOP (EOS or a stop token), FINISH_LENGTH, FINISH_OVERFLOW
      (the pool could not give it a page: its tokens so far are right).
    num_steps: i32[] decode iterations the loop ran.
    page_table: the final PageTable (every page free again).
  """
  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  finish_reason: jax.Array
  num_steps: jax.Array
  page_table: ptm.PageTable


@functools.partial(jax.jit, static_argnames=(
    "cfg", "max_new_tokens", "num_pages", "page_size", "n", "eos_token_ids", "impl",
    "greedy_only", "num_prefill_tokens"))
def generate_on_device(params, prompts: jax.Array, prompt_lens: jax.Array, *, cfg: ModelConfig,
                       max_new_tokens: int, num_pages: int, page_size: int = 16, n: int = 1,
                       max_tokens: jax.Array | None = None, temperature: jax.Array | None = None,
                       top_k: jax.Array | None = None, top_p: jax.Array | None = None,
                       seeds: jax.Array | None = None, eos_token_ids: tuple[int, ...] = (),
                       impl: str = "auto", greedy_only: bool = False,
                       num_prefill_tokens: int | None = None,
                       pool: KVPool | None = None) -> OnDeviceOutput:
  """Generates for a padded batch of prompts in one jitted call.

  Args:
    params, cfg: the model.
    prompts: i32[B, L] prompts padded to L (anything past prompt_lens is ignored).
    prompt_lens: i32[B] lengths (>= 1).
    max_new_tokens: static bound on tokens per row (the output width).
    num_pages, page_size: the pool (NULL_PAGE included in num_pages).
    n: samples per prompt (they share the prompt's pages; copy-on-write when they diverge).
    max_tokens: i32[B] per-prompt limit <= max_new_tokens (default max_new_tokens).
    temperature, top_k, top_p: f32 / i32 / f32 [B] per-prompt sampling (default greedy).
    seeds: u32[B] per-prompt seeds (default 0..B-1).
    eos_token_ids: ids that stop a row (kept in its output).
    impl: attention path.
    greedy_only: static: every prompt is greedy (skips sorting and random numbers).
    num_prefill_tokens: static size of the prefill's flat token buffer, >= sum(prompt_lens)
      (default B * L: always safe; a tighter bound skips the padding's work). Prompts past it
      would be cut: `check_prompts` checks it on the host.
    pool: an initial pool to use (its contents are never read before being written: tests pass
      one full of NaN); default zeros, made inside the call.

  Returns:
    OnDeviceOutput.
  """
  num_prompts, max_len = prompts.shape
  rows = num_prompts * n
  ps = page_size
  width = -(-(max_len + max_new_tokens) // ps)
  max_tokens = (jnp.full(num_prompts, max_new_tokens, jnp.int32) if max_tokens is None
                else jnp.minimum(max_tokens, max_new_tokens).astype(jnp.int32))
  max_tokens = jnp.minimum(max_tokens, cfg.max_position - prompt_lens)
  per_row = lambda x: jnp.repeat(x, n)
  sampling = SamplingArrays(
      temperature=per_row(jnp.zeros(num_prompts, jnp.float32) if temperature is None
                          else temperature.astype(jnp.float32)),
      top_k=per_row(jnp.zeros(num_prompts, jnp.int32) if top_k is None else top_k.astype(jnp.int32)),
      top_p=per_row(jnp.ones(num_prompts, jnp.float32) if top_p is None else top_p.astype(jnp.float32)),
      seed=per_row(jnp.arange(num_prompts, dtype=jnp.uint32) if seeds is None
                   else seeds.astype(jnp.uint32)),
      sample_index=jnp.tile(jnp.arange(n, dtype=jnp.int32), num_prompts),
      output_index=jnp.zeros(rows, jnp.int32))
  if pool is None:
    pool = KVPool.create(num_layers=cfg.num_layers, num_pages=num_pages, page_size=ps,
                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype)
  pt = ptm.PageTable.create(num_pages, ps, rows, width)

  # Prefill: each prompt in its parent row (r = b * n), ragged in one batch.
  parents = jnp.arange(num_prompts) * n
  is_parent = jnp.zeros(rows, bool).at[parents].set(True)
  pt = ptm.admit(pt, is_parent, jnp.zeros(rows, jnp.int32).at[parents].set(prompt_lens))
  admitted = pt.active[parents]
  lens = jnp.where(admitted, prompt_lens, 0).astype(jnp.int32)
  cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lens)]).astype(jnp.int32)
  t = jnp.arange(num_prefill_tokens or num_prompts * max_len, dtype=jnp.int32)
  row = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, num_prompts - 1)
  pos = t - cu[row]
  valid = t < cu[-1]
  tables = pt.block_tables[parents]
  page = tables[row, jnp.clip(pos // ps, 0, width - 1)]
  md = AttentionMetadata(block_tables=tables, seq_lens=lens, cu_q_lens=cu,
                         slots=jnp.where(valid, page * ps + pos % ps, NULL_PAGE * ps).astype(jnp.int32),
                         max_q_len=max_len, num_decode=0)
  batch = Batch(jnp.where(valid, prompts[row, pos], 0).astype(jnp.int32),
                jnp.where(valid, pos, 0).astype(jnp.int32), md,
                jnp.maximum(cu[1:] - 1, 0).astype(jnp.int32))
  logits, pool = _forward(params, pool, batch, cfg, impl)
  # Samples share the prompt's pages.
  children = (parents[:, None] + jnp.arange(1, n)[None, :]).reshape(-1)
  pt = ptm.fork(pt, jnp.repeat(parents, n - 1), children, jnp.repeat(admitted, n - 1))
  first = sample(logits[jnp.arange(rows) // n], sampling, greedy_only=greedy_only)

  eos = jnp.asarray(eos_token_ids if eos_token_ids else (-1,), jnp.int32)
  row_limit = per_row(max_tokens)
  live0 = per_row(admitted)
  out_tokens = jnp.zeros((rows, max_new_tokens), jnp.int32).at[:, 0].set(
      jnp.where(live0, first.tokens, 0))
  out_logprobs = jnp.zeros((rows, max_new_tokens), jnp.float32).at[:, 0].set(
      jnp.where(live0, first.logprob, 0.0))
  lengths = live0.astype(jnp.int32)
  reason = jnp.where(live0, FINISH_NONE, FINISH_OVERFLOW)
  reason = _stop(reason, live0, first.tokens, lengths, row_limit, eos)
  pt = ptm.free(pt, reason != FINISH_NONE)

  def cond(state):
    _, _, _, _, _, reason, step = state
    return jnp.any(reason == FINISH_NONE) & (step < max_new_tokens)

  def body(state):
    pool, pt, out_tokens, out_logprobs, lengths, reason, step = state
    live = reason == FINISH_NONE
    # A slot for the last sampled token: a page at a boundary, a private copy of a shared page.
    pt, src, dst = ptm.grow(pt, live.astype(jnp.int32))
    pool = page_ops.copy_pages(pool, src, dst)
    grew = live & ~pt.overflow
    reason = jnp.where(live & pt.overflow, FINISH_OVERFLOW, reason)
    positions = jnp.where(grew, pt.seq_lens - 1, 0)
    tokens = out_tokens[jnp.arange(rows), jnp.maximum(lengths - 1, 0)]
    md = AttentionMetadata(
        block_tables=jnp.where(grew[:, None], pt.block_tables, NULL_PAGE),
        seq_lens=jnp.where(grew, positions + 1, 1).astype(jnp.int32),   # padding: 1 NULL key
        cu_q_lens=jnp.arange(rows + 1, dtype=jnp.int32),
        slots=jnp.where(grew, pt.slots(positions), NULL_PAGE * ps).astype(jnp.int32),
        max_q_len=1, num_decode=rows)
    logits, pool = _forward(params, pool, Batch(tokens, positions, md, jnp.arange(rows)), cfg, impl)
    out = sample(logits, sampling.replace(output_index=lengths), greedy_only=greedy_only)
    at = (jnp.arange(rows), jnp.minimum(lengths, max_new_tokens - 1))
    out_tokens = out_tokens.at[at].set(jnp.where(grew, out.tokens, out_tokens[at]))
    out_logprobs = out_logprobs.at[at].set(jnp.where(grew, out.logprob, out_logprobs[at]))
    lengths = lengths + grew
    new_reason = _stop(reason, grew, out.tokens, lengths, row_limit, eos)
    pt = ptm.free(pt, (new_reason != FINISH_NONE) & (reason == FINISH_NONE) | (live & ~grew))
    return pool, pt, out_tokens, out_logprobs, lengths, new_reason, step + 1

  state = (pool, pt, out_tokens, out_logprobs, lengths, reason, jnp.asarray(0, jnp.int32))
  _, pt, out_tokens, out_logprobs, lengths, reason, steps = jax.lax.while_loop(cond, body, state)
  return OnDeviceOutput(out_tokens, out_logprobs, lengths, reason, steps, pt)


def check_prompts(prompts, prompt_lens, num_prefill_tokens: int | None = None) -> None:
  """Host-side checks of generate_on_device's inputs (ValueError naming the value)."""
  import numpy as np
  prompts, lens = np.asarray(prompts), np.asarray(prompt_lens)
  if prompts.ndim != 2 or lens.shape != prompts.shape[:1]:
    raise ValueError(f"prompts {prompts.shape} must be [B, L] and prompt_lens [B]; got "
                     f"{lens.shape}")
  if (lens < 1).any() or (lens > prompts.shape[1]).any():
    raise ValueError(f"prompt_lens={lens.tolist()} must lie in [1, L={prompts.shape[1]}]")
  if num_prefill_tokens is not None and lens.sum() > num_prefill_tokens:
    raise ValueError(f"num_prefill_tokens={num_prefill_tokens} < sum(prompt_lens)={lens.sum()}")


def _stop(reason, sampled, tokens, lengths, limit, eos):
  """Rows that just sampled `tokens` stop at EOS (kept) or at their token limit."""
  is_eos = jnp.any(tokens[:, None] == eos[None, :], axis=1)
  reason = jnp.where(sampled & (reason == FINISH_NONE) & is_eos, FINISH_STOP, reason)
  return jnp.where(sampled & (reason == FINISH_NONE) & (lengths >= limit), FINISH_LENGTH, reason)
