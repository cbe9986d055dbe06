"""Continuous batching at iteration level: which sequences run in the next step, and how.

`Scheduler.schedule()` returns a `StepPlan` under a per-step token budget:

1. decode rows first (every running sequence whose tokens are all computed but the last), oldest
   request first; growing them may preempt the newest running request (its samples or beams go
   together), by swap (to bounded host memory, sharing kept) or by recompute;
2. then, if nothing was preempted, swapped requests come back (before any new admission);
3. then chunks of prompts being prefilled, with what is left of the budget;
4. then new requests, first come first served, while pages, rows and budget allow.

When no prompt is being prefilled and no request can be admitted, the plan is a multi-step
decode round: the host reserves pages for k tokens per sequence and the device runs k steps.
`update()` applies a step's samples (through the request's policy: parallel sampling or beam
search) and finishes what must stop. Plain Python over the block manager; nothing is traced.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from paged_jax.host import baselines
from paged_jax.host.addressing import pages_needed
from paged_jax.host.block_manager import BlockManager
from paged_jax.host.group_policy import policy_for, samples_from
from paged_jax.host.sequence import FinishReason, Sequence, SequenceGroup, SequenceStatus

PREEMPTION_MODES = ("recompute", "swap")
RESERVATIONS = ("paged",) + baselines.POLICIES


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """Scheduling policy.

  Attributes:
    max_num_seqs: most sequences (batch rows) running at once.
    max_num_batched_tokens: per-step token budget: decode rows (1 token each) plus prefill chunks.
    steps_per_sync: k of a multi-step decode round (decode steps per host sync).
    preemption_mode: "recompute" (free the pages, recompute later; requests with several
      sequences are swapped, as in vLLM v0) or "swap" (every request in decode is swapped).
      A request still prefilling its prompt is always recomputed; a swap that does not fit
      the swap space falls back to recompute.
    swap_space_pages: host memory for swapped pages, in pages; None = as many as the pool.
    watermark: fraction of the pool kept free at admission, so decoding sequences can grow
      without preempting at once (vLLM v0's default 1%).
    reservation: "paged" (pages as tokens arrive: this framework) or a contiguous baseline of
      the PagedAttention paper driving admission: "max", "pow2" or "oracle" (`host.baselines`).
      A baseline admits a request only when a first-fit extent of its reservation (the model's
      maximum length, the next power of two of prompt + max_tokens, or exactly that; n samples
      or beams reserve n times as much) fits in `reservation_tokens` slots, and holds it until
      the request ends. Pages are still what the device reads: give the pool slack (about one
      page per running sequence beyond reservation_tokens / page_size) so the reservation,
      not the pool, is what binds (the throughput-vs-rate experiment does).
    reservation_tokens: the baseline's slot space; None = the pool's slots.
    max_prefill_rows: most prefill chunks (one per prompt) in a step; None = as many as
      max_num_seqs and the token budget allow. 1 keeps every step among the programs of
      `Engine.warmup("one_prompt")`: a server whose clients send two requests at once starts
      the second a step later instead of waiting seconds for a new program to compile.
  """
  max_num_seqs: int = 64
  max_num_batched_tokens: int = 2048
  steps_per_sync: int = 4
  preemption_mode: str = "recompute"
  swap_space_pages: int | None = None
  watermark: float = 0.01
  reservation: str = "paged"
  reservation_tokens: int | None = None
  max_prefill_rows: int | None = None

  def __post_init__(self):
    if self.preemption_mode not in PREEMPTION_MODES:
      raise ValueError(f"preemption_mode={self.preemption_mode!r} is not one of {PREEMPTION_MODES}")
    if self.reservation not in RESERVATIONS:
      raise ValueError(f"reservation={self.reservation!r} is not one of {RESERVATIONS}")
    if self.reservation_tokens is not None and self.reservation_tokens < 1:
      raise ValueError(f"reservation_tokens={self.reservation_tokens} must be >= 1")
    if self.max_prefill_rows is not None and (
        isinstance(self.max_prefill_rows, bool) or not isinstance(self.max_prefill_rows, int)
        or self.max_prefill_rows < 1):
      raise ValueError(f"max_prefill_rows={self.max_prefill_rows!r} must be None or an int >= 1")
    for name in ("max_num_seqs", "max_num_batched_tokens", "steps_per_sync"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.max_num_batched_tokens < self.max_num_seqs:
      raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                       f"max_num_seqs={self.max_num_seqs} (every decode row takes one token)")
    if self.swap_space_pages is not None and self.swap_space_pages < 0:
      raise ValueError(f"swap_space_pages={self.swap_space_pages} must be >= 0")
    if not 0 <= self.watermark < 1:
      raise ValueError(f"watermark={self.watermark} must be in [0, 1)")


@dataclasses.dataclass
class Row:
  """One row of a step: a decode row (start = len - 1, stop = len) or a prefill chunk.

  `num_samples` tokens are sampled from its last query: 0 for a chunk that does not finish the
  sequence's tokens, n for a prompt sampled n times, else 1. In a k-step round a decode row
  writes K/V only at positions < `write_limit` (its request's last useful position).
  """
  group: SequenceGroup
  seq: Sequence
  start: int
  stop: int
  num_samples: int
  is_decode: bool
  write_limit: int = 0


@dataclasses.dataclass
class StepPlan:
  """What one engine step runs (host objects; `host.batching` turns it into device arrays).

  Attributes:
    rows: decode rows first (in `decode_rows`), then prefill chunks.
    num_steps: k > 1 only for a decode-only round (every row then samples once per step).
    copies: copy-on-write (src, dst) pairs in the order they arose.
    swap_out / swap_in: (request id, pages) to copy to / from host memory, in that order.
    preempted: requests preempted this step.
  """
  rows: list[Row] = dataclasses.field(default_factory=list)
  num_steps: int = 1
  copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  swap_out: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
  swap_in: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
  preempted: list[SequenceGroup] = dataclasses.field(default_factory=list)

  @property
  def decode_rows(self) -> list[Row]:
    return [r for r in self.rows if r.is_decode]

  @property
  def prefill_rows(self) -> list[Row]:
    return [r for r in self.rows if not r.is_decode]

  @property
  def num_samples(self) -> int:
    return sum(r.num_samples for r in self.rows)

  def __bool__(self) -> bool:
    return bool(self.rows or self.swap_out or self.swap_in or self.preempted)


@dataclasses.dataclass
class SchedulerStats:
  preemptions: int = 0           # requests preempted (each counts once per preemption)
  swapped_out_pages: int = 0
  swapped_in_pages: int = 0
  recomputed_tokens: int = 0     # tokens prefilled again after a recompute preemption
  cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at admission
  cow_copies: int = 0


class Scheduler:
  """Waiting, running and swapped requests over one block manager.

  Args:
    bm: the block manager (owns the pages).
    config: the policy.
    new_seq_id: returns a fresh sequence id (forks and beams need them).
    max_len: the model's maximum sequence length (the "max" reservation; a baseline needs it).
  """

  def __init__(self, bm: BlockManager, config: SchedulerConfig, new_seq_id: Callable[[], int],
               max_len: int | None = None):
    self.bm = bm
    self.reserved: baselines.ContiguousAllocator | None = None   # a baseline's extents
    if config.reservation != "paged":
      if max_len is None:
        raise ValueError(f"reservation={config.reservation!r} needs the model's max_len")
      slots = config.reservation_tokens or (bm.num_pages - 1) * bm.page_size
      self.reserved = baselines.ContiguousAllocator(slots, config.reservation, max_len)
    self.config = config
    self.new_seq_id = new_seq_id
    self.waiting: collections.deque[SequenceGroup] = collections.deque()
    self.running: list[SequenceGroup] = []     # by admission order, oldest first
    self.swapped: list[SequenceGroup] = []     # by admission order
    self.stats = SchedulerStats()
    self.swap_space_pages = (bm.num_pages - 1 if config.swap_space_pages is None
                             else config.swap_space_pages)
    self.swap_pages_used = 0
    self._swap_pages: dict[str, int] = {}
    self._next_order = 0

  # ----------------------------------------------------------------------------- queries

  def check_swap_accounting(self) -> None:
    """Raises AssertionError unless the swap space in use is exactly what swapped requests hold."""
    held = {g.request_id for g in self.swapped}
    assert set(self._swap_pages) == held, (sorted(self._swap_pages), sorted(held))
    assert self.swap_pages_used == sum(self._swap_pages.values()), (
        self.swap_pages_used, self._swap_pages)

  def has_unfinished(self) -> bool:
    return bool(self.waiting or self.running or self.swapped)

  def num_running_seqs(self) -> int:
    """Batch rows the running requests hold, counting the samples or beams a prompt not yet
    sampled will fork into (see `_seats`)."""
    return sum(self._seats(g) for g in self.running)

  @staticmethod
  def _seats(g: SequenceGroup) -> int:
    """Rows g holds or will hold: until its prompt is first sampled, the max_seqs it forks into
    (n samples or beam_width beams from one sequence); after that, its live sequences."""
    if all(s.num_output_tokens == 0 for s in g.seqs):
      return max(len(g.seqs), g.max_seqs)
    return len(g.seqs)

  def groups(self):
    yield from self.waiting
    yield from self.running
    yield from self.swapped

  @staticmethod
  def _in_prefill(seq: Sequence) -> bool:
    return seq.status is SequenceStatus.PREFILL

  def _samples_when_done(self, group: SequenceGroup, seq: Sequence) -> int:
    """Tokens to sample once `seq`'s last token is computed: n for a fresh prompt sampled n
    times (parallel sampling forks there), else 1."""
    fresh = seq.num_output_tokens == 0 and not group.params.use_beam_search
    return group.params.n if fresh else 1

  # ----------------------------------------------------------------------------- lifecycle

  def add(self, group: SequenceGroup) -> None:
    self.waiting.append(group)

  def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT
            ) -> SequenceGroup | None:
    """Removes a request wherever it is and frees its pages; returns it (None if unknown).
    Its live sequences finish with `reason` (ABORT, or ERROR for a request that keeps failing)."""
    g = self.find(request_id)
    if g is None:
      return None
    self._detach(g)
    for seq in list(g.seqs):
      seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
      g.finished.append(seq)
    g.seqs = []
    g.aborted = reason is FinishReason.ABORT
    return g

  def find(self, request_id: str) -> SequenceGroup | None:
    for g in self.groups():
      if g.request_id == request_id:
        return g
    return None

  def requeue(self, g: SequenceGroup) -> bool:
    """Puts a request back at the head of the waiting queue holding no pages (its tokens kept,
    so it is recomputed): what the engine does with the requests of a step that failed.

    Returns False (changing nothing) if its sequences might not fit again: they are admitted
    each with its own pages (shared pages come back only through the prefix cache), which for
    several long samples or beams may exceed the pool at their longest.
    """
    longest = len(g.prompt) + g.params.max_tokens - 1
    need = len(g.seqs) * pages_needed(longest, self.bm.page_size)   # unshared, at their longest
    if len(g.seqs) > 1 and need > self.bm.num_pages - 1:
      return False
    self._detach(g)
    for s in g.seqs:
      s.status = SequenceStatus.WAITING
    self._to_waiting(g)
    return True

  def _detach(self, g: SequenceGroup) -> None:
    """Takes g out of its queue and frees every page (and swap slot) it holds."""
    for queue in (self.waiting, self.running, self.swapped):
      if g in queue:
        queue.remove(g)
    for seq in g.seqs:
      if seq.seq_id in self.bm:
        self.bm.free(seq.seq_id)
    self.swap_pages_used -= self._swap_pages.pop(g.request_id, 0)
    self._release_extent(g)

  def _final_len(self, g: SequenceGroup) -> int:
    return min(len(g.prompt) + g.params.max_tokens, self.reserved.max_len)

  def _extent_fits(self, g: SequenceGroup) -> bool:
    """True without a baseline, or when g holds its extent or one would fit now."""
    return (self.reserved is None or g.request_id in self.reserved
            or self.reserved.fits(self._final_len(g), g.max_seqs))

  def _release_extent(self, g: SequenceGroup) -> None:
    if self.reserved is not None and g.request_id in self.reserved:
      self.reserved.free(g.request_id)

  def _to_waiting(self, g: SequenceGroup) -> None:
    """Preempted (or requeued) requests wait ahead of fresh ones, by admission order."""
    waiting = sorted([g] + [w for w in self.waiting if w.order is not None], key=lambda w: w.order)
    fresh = [w for w in self.waiting if w.order is None]
    self.waiting = collections.deque(waiting + fresh)

  # ----------------------------------------------------------------------------- schedule

  def schedule(self) -> StepPlan:
    plan = StepPlan()
    cfg = self.config
    budget = cfg.max_num_batched_tokens
    self._pending: list[tuple[int, int, int]] = []   # (seq_id, src, dst) copy-on-write pairs
    # A request in a step that failed runs alone (the oldest such first) until a step of its
    # own succeeds: the others wait, untouched (see Engine.step on faults).
    focus = next((g for g in self.running if g.suspect), None)
    multi = focus is None and self._can_run_multi_step()
    k = cfg.steps_per_sync if multi else 1

    # 1. Decode rows, oldest request first. Growth may preempt the newest request.
    i = 0
    while i < len(self.running):
      g = self.running[i]
      if focus is not None and g is not focus:
        i += 1
        continue
      decoding = [s for s in g.seqs if not self._in_prefill(s)]
      if g.params.use_beam_search and len(decoding) < len(g.seqs):
        decoding = []   # beams advance together: wait until every beam is recomputed
      if decoding and not self._grow(g, decoding, k, plan):
        continue   # g itself was preempted (it was the newest); the list shrank at i
      for s in decoding:
        limit = min(len(s.tokens) + k - 1, len(g.prompt) + g.params.max_tokens - 1)
        plan.rows.append(Row(g, s, len(s.tokens) - 1, len(s.tokens),
                             self._samples_when_done(g, s), True, limit))
        budget -= 1
      i += 1

    if focus is not None:
      if focus in self.running:
        self._prefill_running(plan, budget, only=focus)
    elif not multi:
      if not plan.preempted:
        budget = self._swap_in(plan, budget)
      budget = self._prefill_running(plan, budget)
      if not plan.preempted and not self.swapped:
        self._admit(plan, budget)
    plan.num_steps = k if multi and plan.rows else 1
    plan.copies = [(src, dst) for _, src, dst in self._pending]
    self.stats.cow_copies += len(plan.copies)
    return plan

  def _can_run_multi_step(self) -> bool:
    """A k-step round needs: no prompt being prefilled, no request that could be admitted or
    swapped in, no beam search (it selects every step), no prompt sampled n times."""
    if self.config.steps_per_sync == 1 or self.swapped:
      return False
    for g in self.running:
      if g.params.use_beam_search:
        return False
      for s in g.seqs:
        if self._in_prefill(s) or self._samples_when_done(g, s) > 1:
          return False
    if self.waiting:
      head = self.waiting[0]
      rows_ok = self.num_running_seqs() + head.max_seqs <= self.config.max_num_seqs
      need = sum(pages_needed(len(s.tokens), self.bm.page_size) for s in head.seqs)
      if rows_ok and need <= self.bm.num_free_pages and self._extent_fits(head):
        return False
    return True

  def _grow(self, g: SequenceGroup, seqs: list[Sequence], k: int, plan: StepPlan) -> bool:
    """Tells the block manager the new tokens of g's decoding sequences and reserves slots for a
    k-step round, preempting the newest requests while it does not fit. False if g itself was
    preempted."""
    for s in seqs:
      new = s.tokens[self.bm.num_tokens(s.seq_id):]
      extra = max(0, min(k - 1, len(g.prompt) + g.params.max_tokens - 1 - len(s.tokens)))
      while True:
        if new:
          growth = self.bm.append_tokens(s.seq_id, new)
          if growth is not None:
            self._pending.extend((s.seq_id, a, b) for a, b in growth.copies)
            new = []
        if not new:
          if not extra:
            break
          growth = self.bm.reserve(s.seq_id, extra)
          if growth is not None:
            self._pending.extend((s.seq_id, a, b) for a, b in growth.copies)
            break
        victim = self.running[-1]
        self._preempt(victim, plan)
        if victim is g:
          return False
      self.bm.mark_computed(s.seq_id, len(s.tokens) - 1)
    return True

  def _preempt(self, g: SequenceGroup, plan: StepPlan) -> None:
    """Frees g's pages: swap (a decoding request with several sequences, or any decoding
    request in swap mode, when the swap space allows) or recompute."""
    self.running.remove(g)
    plan.preempted.append(g)
    plan.rows = [r for r in plan.rows if r.group is not g]
    ids = [s.seq_id for s in g.seqs]
    pending = {dst: src for sid, src, dst in self._pending if sid in ids}
    self._pending = [c for c in self._pending if c[0] not in ids]   # its copies must not run
    self.stats.preemptions += 1
    prefilling = any(self._in_prefill(s) for s in g.seqs)
    want_swap = not prefilling and (self.config.preemption_mode == "swap" or len(g.seqs) > 1)
    pages = {p for i in ids for p in self.bm.block_table(i)}
    if want_swap and self.swap_pages_used + len(pages) <= self.swap_space_pages:
      out = self.bm.swap_out(ids)
      # A page whose copy-on-write was cancelled above holds nothing yet: save its source.
      plan.swap_out.append((g.request_id, tuple(pending.get(p, p) for p in out.pages)))
      self.swap_pages_used += len(out.pages)
      self._swap_pages[g.request_id] = len(out.pages)
      self.stats.swapped_out_pages += len(out.pages)
      for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
      self._insert(self.swapped, g)
    else:
      for s in g.seqs:
        self.bm.preempt_recompute(s.seq_id)
        s.status = SequenceStatus.WAITING
      self._to_waiting(g)

  def _swap_in(self, plan: StepPlan, budget: int) -> int:
    while self.swapped:
      g = self.swapped[0]
      n = self._swap_pages[g.request_id]
      rows_ok = self.num_running_seqs() + g.max_seqs <= self.config.max_num_seqs
      # Room for the pages and for one new page per sequence, so it can decode at once; with
      # nothing else running, room for the pages is enough (a request that fills the whole pool
      # at its longest could otherwise never come back: add_request bounds its pages by the
      # pool, so it can always grow alone).
      free = self.bm.num_free_pages
      room = n + len(g.seqs) <= free or (not self.running and n <= free)
      if not rows_ok or len(g.seqs) > budget or not room:
        break
      back = self.bm.swap_in([s.seq_id for s in g.seqs])
      assert back is not None
      self.swapped.pop(0)
      self.swap_pages_used -= self._swap_pages.pop(g.request_id)
      self.stats.swapped_in_pages += len(back.pages)
      plan.swap_in.append((g.request_id, back.pages))
      for s in g.seqs:
        s.status = SequenceStatus.DECODE
      self._insert(self.running, g)
      grown = self._grow(g, g.seqs, 1, plan)
      assert grown, "a swap-in has a page per sequence, or runs alone: growing by one token fits"
      for s in g.seqs:
        plan.rows.append(Row(g, s, len(s.tokens) - 1, len(s.tokens), self._samples_when_done(g, s),
                             True, len(s.tokens)))
        budget -= 1
    return budget

  def _prefill_running(self, plan: StepPlan, budget: int,
                       only: SequenceGroup | None = None) -> int:
    for g in list(self.running):
      if only is not None and g is not only:
        continue
      for s in g.seqs:
        if budget <= 0 or not self._in_prefill(s) or self._prefill_rows_full(plan):
          continue
        budget -= self._add_chunk(plan, g, s, budget)
    return budget

  def _prefill_rows_full(self, plan: StepPlan) -> bool:
    """Whether `plan` holds `max_prefill_rows` prefill chunks already."""
    cap = self.config.max_prefill_rows
    return cap is not None and len(plan.rows) - len(plan.decode_rows) >= cap

  def _add_chunk(self, plan: StepPlan, g: SequenceGroup, s: Sequence, budget: int) -> int:
    """The next prefill chunk of s within the budget; returns its token count."""
    start = self.bm.num_computed(s.seq_id)
    end = len(s.tokens)
    if g.params.use_beam_search and s.num_output_tokens:
      end -= 1   # a recomputed beam stops short: all beams then take one decode step together
    stop = min(end, start + budget)
    if stop <= start:
      return 0
    done = stop == len(s.tokens)
    plan.rows.append(Row(g, s, start, stop, self._samples_when_done(g, s) if done else 0, False))
    return stop - start

  def _admit(self, plan: StepPlan, budget: int) -> None:
    cfg = self.config
    watermark = int(cfg.watermark * (self.bm.num_pages - 1))
    while self.waiting and budget > 0 and not self._prefill_rows_full(plan):
      g = self.waiting[0]
      if g.suspect and self.running:
        break   # a request whose step failed runs alone (see Engine: fault handling)
      if self.num_running_seqs() + g.max_seqs > cfg.max_num_seqs:
        break
      need = sum(pages_needed(len(s.tokens), self.bm.page_size) for s in g.seqs)
      if self.running and self.bm.num_free_pages - need < watermark:
        break
      if not self._extent_fits(g):
        break
      if self.reserved is not None and g.request_id not in self.reserved:
        self.reserved.admit(g.request_id, len(g.prompt), self._final_len(g), g.max_seqs)
      admitted = []
      for s in g.seqs:
        resume = s.seq_id in self.bm
        # A recomputed beam stops its prefill one token short (see _add_chunk), so the prefix
        # cache must leave it two tokens to compute, not one.
        uncached = 2 if g.params.use_beam_search and s.num_output_tokens else 1
        adm = self.bm.admit(s.seq_id, s.tokens, resume=resume, cache_salt=g.cache_salt,
                            min_uncached=uncached)
        if adm is None:
          break
        admitted.append((s, resume, adm))
      if len(admitted) < len(g.seqs):   # all or nothing for the request
        for s, resume, _ in admitted:
          (self.bm.preempt_recompute if resume else self.bm.free)(s.seq_id)
        if g.order is None:
          self._release_extent(g)
        break
      self.waiting.popleft()
      for s, resume, adm in admitted:
        s.status = SequenceStatus.PREFILL
        if resume:
          self.stats.recomputed_tokens += len(s.tokens) - adm.num_cached_tokens
        else:
          self.stats.cached_prompt_tokens += adm.num_cached_tokens
          if g.order is None:
            g.num_cached_tokens += adm.num_cached_tokens
      if g.order is None:
        g.order = self._next_order
        self._next_order += 1
      self._insert(self.running, g)
      for s in g.seqs:   # (a prompt cached but for its last token is a 1-token chunk)
        if budget > 0 and not self._prefill_rows_full(plan):
          budget -= self._add_chunk(plan, g, s, budget)

  @staticmethod
  def _insert(queue: list[SequenceGroup], g: SequenceGroup) -> None:
    queue.append(g)
    queue.sort(key=lambda w: w.order)

  # ----------------------------------------------------------------------------- update

  def update(self, plan: StepPlan, out: dict) -> list[SequenceGroup]:
    """Applies a step's samples. `out` holds host arrays tokens / logprob i32|f32[num_steps, S]
    and top_ids / top_logprobs [num_steps, S, N], sample rows in `plan.rows` order.

    Returns the requests that got tokens or finished (in row order, each once).
    """
    touched: dict[int, tuple[SequenceGroup, list]] = {}
    index = 0
    for row in plan.rows:
      if not row.is_decode:
        self.bm.mark_computed(row.seq.seq_id, row.stop)
        if row.stop >= len(row.seq.tokens) - 1:   # all but (at most) the last token computed
          row.seq.status = SequenceStatus.DECODE
      if not row.num_samples:
        continue
      samples = [samples_from(out, index + j) for j in range(row.num_samples)]
      index += row.num_samples
      touched.setdefault(id(row.group), (row.group, []))[1].append((row.seq, samples))
    for g, rows in touched.values():
      policy_for(g).update(g, rows, self.bm, self.new_seq_id)
      if g.is_finished:
        self.running.remove(g)
        self._release_extent(g)
    return [g for g, _ in touched.values()]
