"""Tiny fixtures for tests, benchmarks and notebooks: random paged inputs with poisoned pages.

Not imported by the library itself.
"""

from __future__ import annotations


import math
import os
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.state import NULL_PAGE


class PagedInputs(NamedTuple):
  """Arguments of `paged_attention` (and its reference), in that order.

  q: dtype[num_tokens, num_q_heads, head_dim]; k_pages, v_pages: dtype[num_pages, page_size,
  num_kv_heads, head_dim]; block_tables: i32[num_seqs, max_pages_per_seq]; seq_lens:
  i32[num_seqs]; cu_q_lens: i32[num_seqs + 1].
  """
  q: jax.Array
  k_pages: jax.Array
  v_pages: jax.Array
  block_tables: jax.Array
  seq_lens: jax.Array
  cu_q_lens: jax.Array


def random_paged_inputs(seed: int, seq_lens: Sequence[int], *, q_lens: Sequence[int] | None = None,
                        page_size: int = 4, num_kv_heads: int = 2, q_per_kv: int = 2,
                        head_dim: int = 16, dtype=jnp.float32, shuffle_pages: bool = True,
                        poison: bool = True, num_free_pages: int = 3,
                        extra_table_columns: int = 1, pad_tokens: int = 0) -> PagedInputs:
  """Random K/V written into pages through random block tables.

  Args:
    seed: NumPy seed.
    seq_lens: keys per sequence (this step's included).
    q_lens: queries per sequence (default 1 each, i.e. decode); q_len <= seq_len.
    shuffle_pages: a random permutation of page ids, so no test can depend on page order.
    poison: NaN in NULL_PAGE, in every free page and in every slot past a sequence's length.
    num_free_pages: pages no sequence uses.
    extra_table_columns: NULL_PAGE columns beyond the longest sequence's pages.
    pad_tokens: padding query tokens appended after the last sequence's queries.
  """
  rng = np.random.default_rng(seed)
  seq_lens = np.asarray(seq_lens, np.int32)
  q_lens = np.ones_like(seq_lens) if q_lens is None else np.asarray(q_lens, np.int32)
  if np.any(q_lens > seq_lens):
    raise ValueError(f"q_lens={q_lens.tolist()} must not exceed seq_lens={seq_lens.tolist()}")
  pages_per_seq = -(-seq_lens // page_size)
  num_live = int(pages_per_seq.sum())
  num_pages = 1 + num_live + num_free_pages
  ids = np.arange(1, num_pages)
  if shuffle_pages:
    ids = np.random.default_rng(seed + 1).permutation(ids)   # own stream: same K/V either way
  max_pages = int(pages_per_seq.max(initial=0)) + extra_table_columns
  tables = np.full((len(seq_lens), max(max_pages, 1)), NULL_PAGE, np.int32)
  shape = (num_pages, page_size, num_kv_heads, head_dim)
  fill = np.nan if poison else 0.0
  k_pages = np.full(shape, fill, np.float32)
  v_pages = np.full(shape, fill, np.float32)
  next_id = 0
  for b, (n, p) in enumerate(zip(seq_lens, pages_per_seq)):
    tables[b, :p] = ids[next_id:next_id + p]
    next_id += p
    for j in range(p):
      used = min(page_size, n - j * page_size)
      page = tables[b, j]
      k_pages[page, :used] = rng.standard_normal((used, num_kv_heads, head_dim))
      v_pages[page, :used] = rng.standard_normal((used, num_kv_heads, head_dim))
      if not poison:
        k_pages[page, used:] = rng.standard_normal((page_size - used, num_kv_heads, head_dim))
        v_pages[page, used:] = rng.standard_normal((page_size - used, num_kv_heads, head_dim))
  num_tokens = int(q_lens.sum()) + pad_tokens
  q = rng.standard_normal((num_tokens, num_kv_heads * q_per_kv, head_dim)).astype(np.float32)
  if poison and pad_tokens:
    q[-pad_tokens:] = np.nan
  cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  return PagedInputs(jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
                     jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(cu_q_lens))


def pages_to_dense(pages, block_tables, seq_lens):
  """Contiguous K (or V) [num_seqs, max_pages_per_seq * page_size, K, D]; slots past a sequence's
  length are zero, so the result can feed any dense attention without NaN."""
  pages = np.asarray(pages)
  tables = np.asarray(block_tables)
  dense = pages[tables].reshape(tables.shape[0], -1, *pages.shape[2:]).copy()
  for b, n in enumerate(np.asarray(seq_lens)):
    dense[b, n:] = 0
  return dense


def step_kv(inp: PagedInputs):
  """This step's K/V (each row's last q_len keys) read back from the pages, as the model writes
  them there before attention: (k, v), each [num_tokens, num_kv_heads, head_dim] in q's dtype;
  padding tokens zero."""
  k = pages_to_dense(inp.k_pages, inp.block_tables, inp.seq_lens)
  v = pages_to_dense(inp.v_pages, inp.block_tables, inp.seq_lens)
  cu, lens = np.asarray(inp.cu_q_lens), np.asarray(inp.seq_lens)
  shape = (inp.q.shape[0],) + k.shape[2:]
  k_new, v_new = np.zeros(shape, k.dtype), np.zeros(shape, v.dtype)
  for b, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
    k_new[a:e] = k[b, lens[b] - (e - a):lens[b]]
    v_new[a:e] = v[b, lens[b] - (e - a):lens[b]]
  return jnp.asarray(k_new, inp.q.dtype), jnp.asarray(v_new, inp.q.dtype)


def naive_paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                          scale: float | None = None, sliding_window: int | None = None,
                          soft_cap: float | None = None) -> np.ndarray:
  """Attention written out the slow way, as an oracle independent of every fast path.

  NumPy float64, explicit loops over sequences, queries, heads and keys; each key is found
  through the block table (page = table[p // page_size], slot p % page_size) and masked by its
  own three conditions (causal, inside seq_len, inside the window). It shares no helper with
  `dense_attention`, `paged_attention_xla` or the kernel (no `attention_mask`, no
  `ragged_to_padded`), so a bug in those cannot hide by being in both sides of a comparison.
  Use it on small shapes: it is O(tokens x heads x keys) Python.

  Args: as `paged_attention` (q [num_tokens, num_q_heads, head_dim], pages [num_pages,
    page_size, num_kv_heads, head_dim], block_tables [num_seqs, width], seq_lens [num_seqs],
    cu_q_lens [num_seqs + 1]).

  Returns:
    f64[num_tokens, num_q_heads, head_dim]; tokens past cu_q_lens[-1] and queries that see no
    key are zeros.
  """
  q = np.asarray(q, np.float64)
  k_pages = np.asarray(k_pages, np.float64)
  v_pages = np.asarray(v_pages, np.float64)
  tables, lens, cu = (np.asarray(x).tolist() for x in (block_tables, seq_lens, cu_q_lens))
  num_tokens, num_q_heads, head_dim = q.shape
  page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
  group = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
  out = np.zeros((num_tokens, num_q_heads, head_dim))
  for b in range(len(lens)):
    first, last = cu[b], cu[b + 1]
    for i in range(first, last):
      position = lens[b] - (last - first) + (i - first)   # this query's position
      for h in range(num_q_heads):
        kv_head = h // group
        scores, values = [], []
        for p in range(lens[b]):
          if p > position:
            continue   # causal
          if sliding_window is not None and position - p >= sliding_window:
            continue   # outside the window
          page, slot = tables[b][p // page_size], p % page_size
          s = float(np.dot(q[i, h], k_pages[page, slot, kv_head])) * scale
          if soft_cap is not None:
            s = soft_cap * math.tanh(s / soft_cap)
          scores.append(s)
          values.append(v_pages[page, slot, kv_head])
        if not scores:
          continue
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        out[i, h] = sum(w * v for w, v in zip(weights, values)) / total
  return out


def paged_from_dense(k, v, seq_lens, page_size: int, *, seed: int = 0, poison: bool = True,
                     num_free_pages: int = 0):
  """Scatters contiguous K/V into shuffled pages (vectorised; for benchmark-sized inputs).

  Args:
    k: [num_seqs, max_kv_len, num_kv_heads, head_dim] NumPy array; v the same.
    seq_lens: keys per sequence.

  Returns:
    (k_pages, v_pages, block_tables) as NumPy arrays; block_tables i32[num_seqs,
    ceil(max_kv_len / page_size)], NULL_PAGE past each sequence's pages; NaN in NULL_PAGE, free
    pages and slots past each length when `poison`.
  """
  k, v = np.asarray(k), np.asarray(v)
  num_seqs, max_kv_len = k.shape[:2]
  seq_lens = np.asarray(seq_lens)
  max_pages = -(-max_kv_len // page_size)
  pad = max_pages * page_size - max_kv_len
  widths = ((0, 0), (0, pad), (0, 0), (0, 0))
  kp = np.pad(k, widths).reshape(num_seqs, max_pages, page_size, *k.shape[2:])
  vp = np.pad(v, widths).reshape(num_seqs, max_pages, page_size, *v.shape[2:])
  if poison:
    stale = np.arange(max_pages * page_size).reshape(max_pages, page_size)[None] >= seq_lens[:, None, None]
    kp = np.where(stale[..., None, None], np.nan, kp).astype(k.dtype)
    vp = np.where(stale[..., None, None], np.nan, vp).astype(v.dtype)
  live = np.arange(max_pages)[None, :] < -(-seq_lens[:, None] // page_size)
  num_pages = 1 + int(live.sum()) + num_free_pages
  ids = np.random.default_rng(seed).permutation(np.arange(1, num_pages))[:int(live.sum())]
  tables = np.full((num_seqs, max_pages), NULL_PAGE, np.int32)
  tables[live] = ids
  fill = np.nan if poison else 0
  k_pages = np.full((num_pages,) + kp.shape[2:], fill, k.dtype)
  v_pages = np.full((num_pages,) + vp.shape[2:], fill, v.dtype)
  k_pages[tables[live]] = kp[live]
  v_pages[tables[live]] = vp[live]
  return k_pages, v_pages, tables


def random_params(cfg, seed: int = 0, scale: float = 0.1):
  """Model parameters with weights ~ normal(scale): varied greedy tokens (the default 0.02 makes a
  tiny model repeat one token, which hides KV-cache bugs)."""
  from paged_jax import model   # local: testing must not make the model a dependency of attention
  params = model.init_params(cfg, seed)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  out = []
  for (path, leaf), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    if "layernorm" in name or "'norm'" in name:
      out.append(leaf)   # norms stay at one
    else:
      out.append((scale * jax.random.normal(key, leaf.shape)).astype(leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


class DenseGreedy:
  """`dense_greedy` for one model, memoized per (prompt, max_new_tokens): tests compare many
  engine runs against the same few references."""

  def __init__(self, params, cfg, kv_format=None):
    self.params, self.cfg, self.kv_format, self._cache = params, cfg, kv_format, {}

  def __call__(self, prompt, max_new_tokens: int) -> list[int]:
    key = (tuple(prompt), max_new_tokens)
    if key not in self._cache:
      self._cache[key] = dense_greedy(self.params, self.cfg, prompt, max_new_tokens,
                                      kv_format=self.kv_format)
    return self._cache[key]


def dense_greedy(params, cfg, prompt, max_new_tokens: int, *, kv_format=None) -> list[int]:
  """Greedy decoding with a dense contiguous cache (model.DenseKV): the reference for the paged
  steps. Prefill in one call, then one token per call. `kv_format` (a `kv_quant.KVFormat` per
  token or per tensor): K/V quantized and dequantized as a quantized pool stores them."""
  from paged_jax import model
  # The cache is padded to a multiple of 64 (keys past seq_lens are masked) so that every
  # decode call of every prompt shares one compiled program per config (`_dense_apply`).
  max_len = -(-(len(prompt) + max_new_tokens) // 64) * 64
  shape = (cfg.num_layers, 1, max_len, cfg.num_kv_heads, cfg.head_dim)
  cache_k = jnp.zeros(shape, cfg.dtype)
  cache_v = jnp.zeros(shape, cfg.dtype)
  apply = _dense_apply(cfg)
  tokens = list(prompt)
  out = []
  start = 0
  while len(out) < max_new_tokens:
    new = jnp.asarray(tokens[start:], jnp.int32)
    n = new.shape[0]
    kv = model.DenseKV(cache_k, cache_v, seq_ids=jnp.zeros(n, jnp.int32),
                       positions=jnp.arange(start, start + n, dtype=jnp.int32),
                       seq_lens=jnp.array([start + n], jnp.int32),
                       cu_q_lens=jnp.array([0, n], jnp.int32), max_q_len=n, fmt=kv_format)
    logits, kv = apply(params, new, jnp.arange(start, start + n, dtype=jnp.int32), kv,
                       jnp.array([n - 1], jnp.int32))
    cache_k, cache_v = kv.k, kv.v
    start += n
    nxt = int(jnp.argmax(logits[0]))
    out.append(nxt)
    tokens.append(nxt)
  return out


class FakeSteps:
  """Device steps without a model, for scheduler tests: the next token is the last one + 1.

  Request r's prompt is best written 100 * r + (0, 1, ...), so that every token names its
  request (token // 100). Each call is recorded in `events`:
  ("step", [decode rows' requests], [(request, first position, stop) per prefill chunk]) and
  ("decode", [rows' requests], k) for a k-step round (k = 1 for each link of a stoppable
  round).
  """

  def __init__(self):
    self.events = []

  def _out(self, tokens, num_logprobs: int = 0):
    from paged_jax.sampling import SampleOutput
    tokens = jnp.asarray(tokens, jnp.int32)
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    return SampleOutput(tokens, zeros, jnp.zeros(tokens.shape + (0,), jnp.int32),
                        jnp.zeros(tokens.shape + (0,), jnp.float32))

  def sample_step(self, params, pool, batch, sampling, *, cfg, impl, greedy_only, num_logprobs):
    md = batch.md
    d = md.num_decode
    tokens, positions = np.asarray(batch.tokens), np.asarray(batch.positions)
    cu, tables = np.asarray(md.cu_q_lens), np.asarray(md.block_tables)
    decode = [int(tokens[i]) // 100 for i in range(d) if tables[i].any()]   # not padding rows
    prefill = [(int(tokens[a]) // 100, int(positions[a]), int(positions[b - 1]) + 1)
               for a, b in zip(cu[d:-1], cu[d + 1:]) if b > a]
    self.events.append(("step", decode, prefill))
    return self._out(tokens[np.asarray(batch.logits_indices)] + 1, num_logprobs), pool

  def multi_step_decode(self, params, pool, state, sampling, *, cfg, num_steps, impl,
                        greedy_only, num_logprobs):
    live = np.asarray(state.write_limit) > 0
    tokens = np.asarray(state.tokens)
    self.events.append(("decode", [int(t) // 100 for t in tokens[live]], num_steps))
    return self._out(tokens[None, :] + np.arange(1, num_steps + 1)[:, None], num_logprobs), pool

  def decode_link(self, params, pool, state, sampling, *, cfg, impl, greedy_only, num_logprobs):
    out, pool = self.multi_step_decode(params, pool, state, sampling, cfg=cfg, num_steps=1,
                                       impl=impl, greedy_only=greedy_only,
                                       num_logprobs=num_logprobs)
    state = state.replace(tokens=out.tokens[0], positions=state.positions + 1)
    return out, pool, state, sampling.replace(output_index=sampling.output_index + 1)

  def functions(self):
    from paged_jax.engine import StepFunctions
    return StepFunctions(self.sample_step, self.multi_step_decode, self.decode_link)


class RandomSteps(FakeSteps):
  """Device steps without a model that sample from random logits (N(0, `scale`) over `vocab_size`
  tokens, fresh per row and step): greedy tokens with their log-softmax logprobs and top-N, so
  beam search and parallel sampling run their real host-side logic (forks, frees, copy-on-write)
  at any length, e.g. to measure page sharing on a workload. Events are recorded as in FakeSteps.
  """

  def __init__(self, vocab_size: int, seed: int = 0, scale: float = 2.0):
    super().__init__()
    self.vocab_size, self.scale = vocab_size, scale
    self.rng = np.random.default_rng(seed)

  def _out(self, tokens, num_logprobs: int = 0):
    from paged_jax.sampling import SampleOutput
    logits = self.rng.normal(0.0, self.scale, np.shape(tokens) + (self.vocab_size,))
    logprobs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    order = np.argsort(-logprobs, axis=-1)[..., :max(1, num_logprobs)]
    top = np.take_along_axis(logprobs, order, -1)
    return SampleOutput(jnp.asarray(order[..., 0], jnp.int32), jnp.asarray(top[..., 0], jnp.float32),
                        jnp.asarray(order[..., :num_logprobs], jnp.int32),
                        jnp.asarray(top[..., :num_logprobs], jnp.float32))


def dense_logprobs(params, cfg, tokens) -> np.ndarray:
  """f32[vocab_size] log-softmax of the next token after `tokens`, from a dense forward over the
  whole sequence (no cache at all): the slowest, plainest reference."""
  from paged_jax import model
  n = len(tokens)
  shape = (cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim)
  kv = model.DenseKV(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype),
                     jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                     jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32), max_q_len=n)
  logits, _ = _dense_apply(cfg)(params, jnp.asarray(tokens, jnp.int32),
                                jnp.arange(n, dtype=jnp.int32), kv, jnp.array([n - 1], jnp.int32))
  return np.asarray(jax.nn.log_softmax(logits[0]))


def dense_forward(params, cfg, tokens) -> jax.Array:
  """f32[len(tokens), vocab_size] logits of every position from one dense forward over the
  sequence, on either parameter layout (`model.apply`: per-layer or stacked); traceable."""
  from paged_jax import model
  n = len(tokens)
  shape = (cfg.num_layers, 1, n, cfg.num_kv_heads, cfg.head_dim)
  kv = model.DenseKV(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype),
                     jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32),
                     jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32), max_q_len=n)
  logits, _ = model.apply(params, cfg, jnp.asarray(tokens, jnp.int32),
                          jnp.arange(n, dtype=jnp.int32), kv)
  return logits


def dense_logits(params, cfg, tokens) -> np.ndarray:
  """`dense_forward` run eagerly (no compile per length), as a NumPy array: the form
  transformers' `model(ids).logits` has."""
  return np.asarray(dense_forward(params, cfg, tokens))


# `.ci/run` sets PAGED_JAX_REQUIRE_TORCH=1: there a missing torch fails the cross-checks against
# transformers instead of skipping them, so CI cannot pass without them having run.
REQUIRE_TORCH = os.environ.get("PAGED_JAX_REQUIRE_TORCH") == "1"
# And PAGED_JAX_REQUIRE_MKL=1 where it installs the `mkl` extra: there the MKL matmul's tests
# fail, not skip, when it cannot run (tests/paged_jax/matmul_test.py).
REQUIRE_MKL = os.environ.get("PAGED_JAX_REQUIRE_MKL") == "1"
# The same for the `onednn` extra (PAGED_JAX_REQUIRE_ONEDNN=1).
REQUIRE_ONEDNN = os.environ.get("PAGED_JAX_REQUIRE_ONEDNN") == "1"

_DENSE_APPLY = {}


def _dense_apply(cfg):
  from paged_jax import model
  if cfg not in _DENSE_APPLY:
    _DENSE_APPLY[cfg] = jax.jit(lambda p, t, pos, kv, idx: model.Decoder(cfg).apply(
        {"params": p}, t, pos, kv, idx))
  return _DENSE_APPLY[cfg]


def dense_beam_search(params, cfg, prompt, *, beam_width: int, max_tokens: int,
                      length_penalty: float = 1.0, eos_ids=(), n: int = 1) -> list[list[int]]:
  """Plain beam search on a dense model, written out without the engine: every beam proposes its
  2W best tokens; the W best by cumulative logprob continue; a top-W candidate ending in EOS
  becomes a hypothesis scored logprob / length ** length_penalty (the W best are kept); stop at
  max_tokens, or when W hypotheses exist and no live beam scores better than the worst.
  Returns the n best completions (output tokens)."""
  eos = set(eos_ids)
  beams = [([], 0.0)]                       # (output tokens, cumulative logprob)
  done = []                                 # (score, output tokens)
  score = lambda lp, length: lp / max(length, 1) ** length_penalty
  while beams:
    cands = []
    for rank, (out, lp) in enumerate(beams):
      logprobs = dense_logprobs(params, cfg, list(prompt) + out)
      best = np.argsort(-logprobs, kind="stable")[:2 * beam_width]
      cands += [(-(lp + float(logprobs[t])), rank, int(t), out, lp + float(logprobs[t]))
                for t in best]
    cands.sort(key=lambda c: c[:3])
    nxt = []
    for i, (_, _, t, out, lp) in enumerate(cands):
      if len(nxt) == beam_width:
        break
      if t in eos:
        if i < beam_width:
          done.append((score(lp, len(out) + 1), out + [t]))
        continue
      nxt.append((out + [t], lp))
    done = sorted(done, key=lambda d: -d[0])[:beam_width]
    beams = sorted(nxt, key=lambda b: -b[1])
    if beams and len(beams[0][0]) >= max_tokens:
      done = sorted(done + [(score(lp, len(o)), o) for o, lp in beams], key=lambda d: -d[0])
      done = done[:beam_width]
      break
    if beams and len(done) == beam_width and done[-1][0] >= score(beams[0][1], len(beams[0][0])):
      break
  return [out for _, out in done[:n]]
