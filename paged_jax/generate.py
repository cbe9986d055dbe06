"""Host-side generation loop over the paged pool: block manager -> padded batch -> jitted step.

`Generator.generate(prompts, ...)` admits requests while pages allow (continuous batching: a
finished sequence frees its pages and a waiting request takes them), runs ragged prefill (chunked
by a token budget, reusing prefix-cached pages), forks n-1 children for parallel sampling (pages
shared, copy-on-write on divergence), and decodes k tokens per host sync with `multi_step_decode`
after reserving their pages. Out of pages, it preempts the newest sequence by recompute.

Batches are padded to a few buckets (powers of two) so every step compiles a handful of programs.
Only small int arrays go to the device; only sampled tokens come back.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import page_ops, step
from paged_jax.config import ModelConfig
from paged_jax.host.block_manager import BlockManager
from paged_jax.sampling import SamplingConfig, sample
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool


def bucket(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return 1 << max(0, (max(n, minimum) - 1).bit_length())


@dataclasses.dataclass
class _Request:
  rid: int
  prompt: list[int]
  max_new_tokens: int
  out: list[int] = dataclasses.field(default_factory=list)
  parent: int | None = None   # forked children share their parent's prompt pages


@dataclasses.dataclass
class GenerationStats:
  prefill_steps: int = 0
  decode_rounds: int = 0
  prefill_tokens: int = 0
  cached_prompt_tokens: int = 0
  decode_tokens: int = 0
  preemptions: int = 0
  cow_copies: int = 0
  max_pages_in_use: int = 0
  prefill_s: float = 0.0       # wall time of prefill steps (host batch building + device)
  decode_device_s: float = 0.0  # wall time from launching multi_step_decode to its tokens on host
  decode_host_s: float = 0.0    # block manager + batch building around those launches


_sample = jax.jit(sample, static_argnames=("cfg",))


class Generator:
  """Generation over a paged pool.

  Args:
    params, cfg: the model.
    num_pages, page_size: the pool (num_pages counts NULL_PAGE).
    steps_per_sync: decode steps per host sync (k of `multi_step_decode`).
    max_prefill_tokens: prefill token budget per step (chunked prefill); None = whole prompts.
    max_batch: most sequences decoded at once.
    impl: attention path ("auto", "xla", "pallas").
  """

  def __init__(self, params, cfg: ModelConfig, *, num_pages: int, page_size: int,
               steps_per_sync: int = 4, max_prefill_tokens: int | None = None,
               max_batch: int = 64, enable_prefix_caching: bool = True,
               sampling: SamplingConfig = SamplingConfig(), impl: str = "auto", seed: int = 0):
    if steps_per_sync < 1:
      raise ValueError(f"steps_per_sync={steps_per_sync} must be >= 1")
    self.params, self.cfg = params, cfg
    self.page_size = page_size
    self.max_pages_per_seq = -(-cfg.max_position // page_size)
    self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
    self.pool = KVPool.create(num_layers=cfg.num_layers, num_pages=num_pages, page_size=page_size,
                              num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              dtype=cfg.dtype)
    self.k = steps_per_sync
    self.max_prefill_tokens = max_prefill_tokens
    self.max_batch = max_batch
    self.sampling = sampling
    self.impl = impl
    self.key = jax.random.key(seed)
    self.stats = GenerationStats()
    self._last_logits: dict[int, jax.Array] = {}   # rid -> logits of its prompt's last token
    self._copies: list[tuple[int, int]] = []        # copy-on-write pairs not yet applied
    self._next_rid = 0                              # sequence ids are never reused

  # ------------------------------------------------------------------------------ public

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
               eos_id: int | None = None) -> list[list[int]]:
    """Completions for every prompt (n per prompt, prompt-major). Tokens after eos_id are cut."""
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f"prompt {i} is empty")
      if len(p) + max_new_tokens > self.cfg.max_position:
        raise ValueError(f"prompt {i}: {len(p)} + max_new_tokens={max_new_tokens} exceeds "
                         f"max_position={self.cfg.max_position}")
      bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
      if bad:
        raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size}): {bad[:5]}")
    self.eos_id = eos_id
    base, self._next_rid = self._next_rid, self._next_rid + len(prompts) * n
    reqs = [_Request(base + i * n, list(map(int, p)), max_new_tokens) for i, p in enumerate(prompts)]
    self.n = n
    self._children = {r.rid: [r.rid + j for j in range(1, n)] for r in reqs}
    self._all: dict[int, _Request] = {}
    for r in reqs:
      self._all[r.rid] = r
      for c in self._children[r.rid]:
        self._all[c] = _Request(c, r.prompt, max_new_tokens, parent=r.rid)
    self._waiting = waiting = collections.deque(reqs)
    prefilling: list[int] = []                 # admitted, prompt not fully computed
    self._decoding = decoding = []             # prompt computed, generating (oldest first)
    while waiting or prefilling or decoding:
      while waiting and len(prefilling) + len(decoding) + self.n <= self.max_batch:
        r = waiting[0]
        tokens = r.prompt + r.out   # a preempted request recomputes what it had
        adm = self.bm.admit(r.rid, tokens)
        if adm is None:
          break
        waiting.popleft()
        self.stats.cached_prompt_tokens += adm.num_cached_tokens
        prefilling.append(r.rid)
      if not (prefilling or decoding):
        raise RuntimeError(f"request {waiting[0].rid} needs more pages than the pool has "
                           f"({self.bm.num_free_pages} free)")
      if prefilling:
        finished = self._prefill(prefilling)
        for rid in finished:
          prefilling.remove(rid)
          self._start_decoding(rid)
      else:
        self._decode()
      self.stats.max_pages_in_use = max(self.stats.max_pages_in_use,
                                        self.bm.stats()["pages_in_use"])
    return [self._all[rid].out for r in reqs for rid in [r.rid] + self._children[r.rid]]

  # ------------------------------------------------------------------------------ prefill

  def _prefill(self, rids: list[int]) -> list[int]:
    """One prefill step over the uncomputed prompt tokens of `rids` (within the token budget).
    Returns the rids whose prompt is now fully computed."""
    t0 = time.perf_counter()
    budget = self.max_prefill_tokens or sum(self.bm.num_tokens(r) for r in rids)
    rows = []
    for rid in rids:
      start = self.bm.num_computed(rid)
      stop = min(self.bm.num_tokens(rid), start + budget)
      if stop > start:
        rows.append((rid, start, stop))
        budget -= stop - start
      if budget <= 0:
        break
    tokens = np.concatenate([np.asarray(self.bm.tokens(rid)[a:b], np.int32) for rid, a, b in rows])
    positions = np.concatenate([np.arange(a, b, dtype=np.int32) for _, a, b in rows])
    slots = np.concatenate([self.bm.slots(rid, a, b) for rid, a, b in rows])
    q_lens = [b - a for _, a, b in rows]
    batch = self._batch(rows, tokens, positions, slots, q_lens, [b for _, _, b in rows],
                        max_q_len=bucket(max(q_lens)))
    logits, self.pool = step.prefill_step(self.params, self.pool, batch, cfg=self.cfg,
                                          impl=self.impl)
    self.stats.prefill_steps += 1
    self.stats.prefill_tokens += int(sum(q_lens))
    finished = []
    for i, (rid, _, stop) in enumerate(rows):
      self.bm.mark_computed(rid, stop)
      if stop == self.bm.num_tokens(rid):
        finished.append(rid)
        self._last_logits[rid] = logits[i]
    jax.block_until_ready(logits)
    self.stats.prefill_s += time.perf_counter() - t0
    return finished

  def _start_decoding(self, rid: int) -> list[int]:
    """After a prompt is computed: fork the children, sample each one's first token."""
    family = [rid]
    if self._all[rid].parent is None and not self._all[rid].out:
      for child in self._children[rid]:
        self.bm.fork(rid, child)
        family.append(child)
    logits = self._last_logits.pop(rid)
    self.key, key = jax.random.split(self.key)
    first = np.asarray(_sample(jnp.broadcast_to(logits, (len(family),) + logits.shape), key,
                               self.sampling))
    for member, tok in zip(family, first):
      self._decoding.append(member)
      self._accept(member, [int(tok)], protect=family)

  # ------------------------------------------------------------------------------ decode

  def _preempt_newest(self, protect) -> bool:
    """Frees the newest decoding sequence not in `protect` (recompute: it goes back to the front
    of the queue with the tokens it has, and hits the prefix cache for its full pages)."""
    victim = next((v for v in reversed(self._decoding) if v not in protect), None)
    if victim is None:
      return False
    self._decoding.remove(victim)
    self.bm.free(victim)
    self._waiting.appendleft(self._all[victim])
    self.stats.preemptions += 1
    return True

  def _grow(self, rid: int, op, protect) -> None:
    """Runs a block-manager growth op, preempting newer sequences until it fits."""
    while (growth := op()) is None:
      if not self._preempt_newest(set(protect) | {rid}):
        raise RuntimeError(f"sequence {rid} cannot grow even alone: the pool is too small")
    self._copies.extend(growth.copies)

  def _accept(self, rid: int, new_tokens: list[int], protect=()) -> None:
    """Appends sampled tokens (cut at EOS / max_new_tokens); frees a finished sequence."""
    r = self._all[rid]
    take = []
    for t in new_tokens:
      take.append(t)
      if t == self.eos_id or len(r.out) + len(take) == r.max_new_tokens:
        r.out.extend(take)
        self.bm.free(rid)
        self._decoding.remove(rid)
        return
    self._grow(rid, lambda: self.bm.append_tokens(rid, take), protect)
    r.out.extend(take)

  def _decode(self) -> None:
    """Reserves k slots per decoding sequence, runs k decode steps, accepts the tokens."""
    t0 = time.perf_counter()
    for rid in list(self._decoding):
      if rid in self._decoding:   # an earlier reservation may have preempted it
        self._grow(rid, lambda: self.bm.reserve(rid, self.k), ())
    live = list(self._decoding)
    if not live:
      return
    self._apply_copies()
    num_rows = bucket(len(live))
    width = bucket(max(len(self.bm.block_table(r)) for r in live))
    tables = np.full((num_rows, width), NULL_PAGE, np.int32)
    tokens = np.zeros(num_rows, np.int32)
    positions = np.zeros(num_rows, np.int32)
    for i, rid in enumerate(live):
      table = self.bm.block_table(rid)
      tables[i, :len(table)] = table
      tokens[i] = self.bm.tokens(rid)[-1]
      positions[i] = self.bm.num_tokens(rid) - 1
    state = step.DecodeState(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(tables),
                             jnp.asarray(np.arange(num_rows) < len(live)))
    self.key, key = jax.random.split(self.key)
    t1 = time.perf_counter()
    out, self.pool = step.multi_step_decode(self.params, self.pool, state, key, cfg=self.cfg,
                                            num_steps=self.k, sampling=self.sampling,
                                            impl=self.impl)
    out = np.asarray(out)   # the one host sync per k tokens
    t2 = time.perf_counter()
    self.stats.decode_rounds += 1
    for i, rid in enumerate(live):
      self.bm.mark_computed(rid, self.bm.num_tokens(rid))   # the pending token is now written
      self.stats.decode_tokens += self.k
      self._accept(rid, out[:, i].tolist())   # within the reserved slots: never allocates
      if rid in self._decoding:
        self.bm.mark_computed(rid, self.bm.num_tokens(rid) - 1)   # all but the new last token
    self.stats.decode_device_s += t2 - t1
    self.stats.decode_host_s += (t1 - t0) + (time.perf_counter() - t2)

  def _apply_copies(self) -> None:
    if not self._copies:
      return
    n = bucket(len(self._copies))
    src = np.zeros(n, np.int32)
    dst = np.zeros(n, np.int32)   # padding: NULL_PAGE -> NULL_PAGE, harmless
    src[:len(self._copies)], dst[:len(self._copies)] = zip(*self._copies)
    self.pool = page_ops.copy_pages(self.pool, jnp.asarray(src), jnp.asarray(dst))
    self.stats.cow_copies += len(self._copies)
    self._copies.clear()

  # ------------------------------------------------------------------------------ batching

  def _batch(self, rows, tokens, positions, slots, q_lens, seq_lens, *, max_q_len) -> step.Batch:
    """Pads a ragged batch to buckets: tokens to a power of two >= 16, rows to a power of two."""
    self._apply_copies()
    num_rows = bucket(len(rows))
    num_tokens = bucket(len(tokens), 16)
    width = bucket(max(len(self.bm.block_table(rid)) for rid, _, _ in rows))
    tables = np.full((num_rows, width), NULL_PAGE, np.int32)
    for i, (rid, _, _) in enumerate(rows):
      table = self.bm.block_table(rid)
      tables[i, :len(table)] = table
    pad = num_tokens - len(tokens)
    cu = np.zeros(num_rows + 1, np.int32)
    cu[1:len(rows) + 1] = np.cumsum(q_lens)
    cu[len(rows) + 1:] = cu[len(rows)]
    lens = np.zeros(num_rows, np.int32)
    lens[:len(rows)] = seq_lens
    logits_indices = np.zeros(num_rows, np.int32)
    logits_indices[:len(rows)] = cu[1:len(rows) + 1] - 1
    md = AttentionMetadata(block_tables=jnp.asarray(tables), seq_lens=jnp.asarray(lens),
                           cu_q_lens=jnp.asarray(cu),
                           slots=jnp.asarray(np.pad(slots, (0, pad))),   # padding -> slot 0
                           max_q_len=max_q_len)
    return step.Batch(jnp.asarray(np.pad(tokens, (0, pad))), jnp.asarray(np.pad(positions, (0, pad))),
                      md, jnp.asarray(logits_indices))
