"""Sampling: a request's settings (`SamplingParams`, host side) and the per-row device sampler.

Every sample row of a step carries its own temperature, top-k, top-p and random stream, so requests
with different settings share one batch. A row's key is derived on device from (seed, sample
index, output index) alone, so the same seed and prompt give the same tokens whatever else is in
the batch (`row_keys`). Logprobs are those of the model's raw distribution (log-softmax of the
logits, before temperature and truncation), as vLLM reports them by default.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request is decoded. Validated on construction (a ValueError names the bad value).

  Attributes:
    max_tokens: most tokens to generate.
    temperature: 0 = greedy; otherwise logits / temperature.
    top_k: keep the k most likely tokens (0 = all).
    top_p: keep the smallest set of most likely tokens whose mass reaches p (1 = all).
    seed: per-request seed; None = drawn from the engine's generator at add_request.
    n: completions returned. With beam search: the n best of the beam_width beams; otherwise n
      independent samples that share the prompt's pages (fork, copy-on-write at divergence).
    beam_width: > 1 turns on beam search (deterministic: needs temperature 0).
    length_penalty: beam score = cumulative logprob / (output length ** length_penalty).
    stop_token_ids: tokens that end a completion (kept in the output), besides EOS.
    ignore_eos: do not stop at the model's EOS ids.
    logprobs: return the top-N logprobs of every generated token (0 = none; the sampled token's
      own logprob is always returned).
  """
  max_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int | None = None
  n: int = 1
  beam_width: int = 1
  length_penalty: float = 1.0
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  logprobs: int = 0

  def __post_init__(self):
    for name in ("max_tokens", "top_k", "n", "beam_width", "logprobs"):
      value = getattr(self, name)
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int")
    for name in ("temperature", "top_p", "length_penalty"):
      value = getattr(self, name)
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                        np.floating)):
        raise ValueError(f"{name}={value!r} must be a number")
    if self.seed is not None and (isinstance(self.seed, (bool, np.bool_))
                                  or not isinstance(self.seed, (int, np.integer))):
      raise ValueError(f"seed={self.seed!r} must be an int or None")
    if not isinstance(self.ignore_eos, (bool, np.bool_)):
      raise ValueError(f"ignore_eos={self.ignore_eos!r} must be a bool")
    try:
      stop = tuple(self.stop_token_ids)
    except TypeError:
      raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of token "
                       f"ids") from None
    bad = [t for t in stop if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
    if bad:
      raise ValueError(f"stop_token_ids={stop} must be token ids (ints); got {bad[:3]}")
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
    checks = [
        (self.max_tokens >= 1, f"max_tokens={self.max_tokens} must be >= 1"),
        (np.isfinite(self.temperature) and self.temperature >= 0,
         f"temperature={self.temperature} must be a finite number >= 0"),
        (self.top_k >= 0, f"top_k={self.top_k} must be >= 0 (0 = off)"),
        (0 < self.top_p <= 1, f"top_p={self.top_p} must be in (0, 1]"),
        (np.isfinite(self.length_penalty),
         f"length_penalty={self.length_penalty} must be finite"),
        (self.n >= 1, f"n={self.n} must be >= 1"),
        (self.beam_width >= 1, f"beam_width={self.beam_width} must be >= 1"),
        (self.logprobs >= 0, f"logprobs={self.logprobs} must be >= 0"),
        (all(t >= 0 for t in self.stop_token_ids),
         f"stop_token_ids={self.stop_token_ids} must be token ids >= 0"),
        (self.seed is None or 0 <= self.seed < 2 ** 32, f"seed={self.seed} must be in [0, 2**32)"),
    ]
    if self.beam_width > 1:
      checks += [(self.temperature == 0, f"beam search is deterministic: temperature="
                                         f"{self.temperature} must be 0"),
                 (self.n <= self.beam_width, f"n={self.n} must be <= beam_width={self.beam_width}")]
    for ok, message in checks:
      if not ok:
        raise ValueError(message)

  @property
  def use_beam_search(self) -> bool:
    return self.beam_width > 1

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


@flax.struct.dataclass
class SamplingArrays:
  """Per-row sampling settings of one step (S sample rows).

  Attributes:
    temperature: f32[S]; 0 = greedy.
    top_k: i32[S]; 0 = off.
    top_p: f32[S]; 1 = off.
    seed: u32[S] the request's seed.
    sample_index: i32[S] which of the request's samples this row is (its own stream).
    output_index: i32[S] the number of the token being sampled (0 = first output token).
  """
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  sample_index: jax.Array
  output_index: jax.Array

  @classmethod
  def from_rows(cls, rows: Sequence[tuple[SamplingParams, int, int, int]], num_rows: int):
    """Host-side builder: rows of (params, seed, sample_index, output_index), padded to num_rows
    with greedy rows."""
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    seed = np.zeros(num_rows, np.uint32)
    sample_index = np.zeros(num_rows, np.int32)
    output_index = np.zeros(num_rows, np.int32)
    for i, (p, s, j, t) in enumerate(rows):
      temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
      seed[i], sample_index[i], output_index[i] = s, j, t
    return cls(temperature, top_k, top_p, seed, sample_index, output_index)


@flax.struct.dataclass
class SampleOutput:
  """tokens i32[..., S]; logprob f32[..., S] of each sampled token; top_ids i32[..., S, N] and
  top_logprobs f32[..., S, N] the N most likely tokens (N = num_logprobs, may be 0)."""
  tokens: jax.Array
  logprob: jax.Array
  top_ids: jax.Array
  top_logprobs: jax.Array


def row_keys(arrays: SamplingArrays) -> jax.Array:
  """One PRNG key per row from (seed, sample_index, output_index) only."""
  def key(seed, j, t):
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), j), t)
  return jax.vmap(key)(arrays.seed, arrays.sample_index, arrays.output_index)


def truncate(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks (to -inf) what top-k and then top-p drop, per row; logits f32[S, V] (already divided
  by the temperature). Ties at the cut are kept."""
  vocab = logits.shape[-1]
  order = jnp.sort(logits, axis=-1)[:, ::-1]                         # descending
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  rank = jnp.arange(vocab)[None, :]
  order = jnp.where(rank < k[:, None], order, -jnp.inf)
  probs = jax.nn.softmax(order, axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs                         # mass of better tokens
  # top_p = 1 keeps every token explicitly: in f32 the mass before the last few tokens can round
  # to 1 or above, and `before < 1` would drop them.
  within_p = (before < top_p[:, None]) | (top_p[:, None] >= 1)
  keep = within_p & (rank < k[:, None])                               # the top token always stays
  cutoff = jnp.min(jnp.where(keep, order, jnp.inf), axis=-1)
  return jnp.where(logits >= cutoff[:, None], logits, -jnp.inf)


def argmax(x: jax.Array) -> jax.Array:
  """i32[...] index of the largest entry along the last axis of x f32[..., V]; the first on ties,
  and the first NaN if any (jnp.argmax's result).

  Two plain reductions (max, then min index equal to it): XLA's CPU argmax is one variadic
  (value, index) reduce that does not vectorize: 2.37 ms for f32[32, 32000] against 0.74 ms for
  this (`python -m experiments.cpu_parts_bench`; the large serve benchmark's decode step).
  """
  top = jnp.max(x, axis=-1, keepdims=True)
  hit = (x == top) | jnp.isnan(x)
  index = jnp.arange(x.shape[-1], dtype=jnp.int32)
  return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def sample(logits: jax.Array, arrays: SamplingArrays, *, greedy_only: bool = False,
           num_logprobs: int = 0) -> SampleOutput:
  """Samples one token per row.

  Args:
    logits: f32[S, vocab_size].
    arrays: the rows' settings.
    greedy_only: static: every row is greedy (argmax only: no sort, no random numbers). Off,
      the sort and the draws still run only when some row has temperature > 0 (a `lax.cond`),
      so one program serves greedy and sampled batches at a greedy batch's cost (the engine
      compiles one sampling variant, not two).
    num_logprobs: static N of the top-N logprobs returned.

  Returns:
    SampleOutput with leading shape [S].
  """
  logits = logits.astype(jnp.float32)
  greedy = argmax(logits)
  if greedy_only:
    tokens = greedy
  else:
    t = arrays.temperature

    def draw(_):
      scaled = logits / jnp.where(t > 0, t, 1.0)[:, None]
      scaled = truncate(scaled, arrays.top_k, arrays.top_p)
      gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:]))(row_keys(arrays))
      drawn = argmax(scaled + gumbel)   # Gumbel-max = categorical
      return jnp.where(t > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(t > 0), draw, lambda _: greedy, None)
  # log_softmax at the chosen token alone (the full f32[S, V] log_softmax only when top-N asked).
  lse = jax.nn.logsumexp(logits, axis=-1)
  chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse
  if num_logprobs:
    top_logprobs, top_ids = jax.lax.top_k(logits - lse[:, None], num_logprobs)
  else:
    top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
    top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
  return SampleOutput(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
