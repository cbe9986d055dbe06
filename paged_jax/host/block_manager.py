"""The host-side block manager: owns every page of the pool. Python + NumPy only, nothing traced.

It allocates pages as sequences grow, shares them by reference count (fork for parallel sampling
and beam search, prefix-cache hits), copies a shared partially filled page before a write
(copy-on-write), caches full pages under chained hashes, evicts idle cached pages in LRU order,
and preempts by swap (a request's sequences together, sharing kept) or recompute. The device
only ever sees what it returns: block tables, write slots and (src, dst) copy pairs, applied by
`paged_jax.page_ops`.

Every page other than NULL_PAGE is exactly one of:
  free         refcount 0, no hash, in the free list;
  in use       refcount >= 1 (the number of block-table entries that reference it);
  cached-idle  refcount 0, registered under its hash, in the LRU queue; reclaimed only when no
               free page is left, least recently used first.

Token bookkeeping per sequence: the manager does not own token ids (`host.sequence.Sequence`
does); it is told them as they arrive (`admit`, `append_tokens`) and keeps only their count, the
chained hash of every full page, and the ids of the partial last page (what its hash will need).
`num_computed` of the `num_tokens` have their K/V in the pool (or written by the step being
scheduled); capacity is len(block_table) * page_size. Only full, computed pages enter the prefix
cache, so a request can never hit a page whose K/V a chunked prefill has not written yet.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
from typing import Hashable, Iterable, Sequence

import numpy as np

from paged_jax.host.addressing import pages_needed, slots_for_positions
from paged_jax.state import NULL_PAGE

_ROOT_HASH = hashlib.sha256(b"paged_jax prefix cache root").digest()


def page_hash(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
  """Chained hash of one full page: H(parent hash or a root seed, its token ids, extra keys).

  sha256 over a fixed serialization (token ids as int64 bytes), as vLLM v1 does for collision
  safety. Extra keys are e.g. an adapter id on every page and a cache salt on the first page.
  """
  h = hashlib.sha256(parent if parent is not None else _ROOT_HASH)
  h.update(np.asarray(token_ids, np.int64).tobytes())
  h.update(repr(extra_keys).encode())
  return h.digest()


_MAX_TOKEN_ID = 2 ** 63   # page hashes serialize ids as int64


def check_token_ids(token_ids: Sequence[int], what: str) -> list[int]:
  """The ids as Python ints; ValueError naming the first that is not an int in [0, 2**63)
  (a float is refused, not truncated)."""
  out = []
  for t in token_ids:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
      raise ValueError(f"{what}: token id {t!r} is not an int")
    t = int(t)
    if not 0 <= t < _MAX_TOKEN_ID:
      raise ValueError(f"{what}: token id {t} is outside [0, 2**63)")
    out.append(t)
  return out


class SeqStatus(enum.Enum):
  RUNNING = "running"      # holds pages
  SWAPPED = "swapped"      # pages copied to host memory and freed
  PREEMPTED = "preempted"  # pages freed for recompute; re-admit with `admit(..., resume=True)`


class UnknownSequenceError(KeyError):
  """An operation named a sequence the manager does not hold (or no longer holds)."""


@dataclasses.dataclass
class _Seq:
  num_tokens: int
  block_table: list[int]
  num_computed: int
  adapter_id: Hashable | None
  cache_salt: str | None
  hashes: list[bytes] = dataclasses.field(default_factory=list)   # one per full page of tokens
  tail: list[int] = dataclasses.field(default_factory=list)      # ids after the last full page
  num_registered: int = 0     # leading full computed pages already offered to the prefix cache
  num_swapped_pages: int = 0  # pages its swap group holds in host memory while SWAPPED
  swap_layout: tuple[int, ...] = ()   # while SWAPPED: index into the group's swapped pages per entry
  swap_group: frozenset = frozenset()  # while SWAPPED: the ids swapped out together
  status: SeqStatus = SeqStatus.RUNNING


@dataclasses.dataclass(frozen=True)
class Admission:
  """Result of a successful `admit`: `num_cached_tokens` came from the prefix cache."""
  block_table: tuple[int, ...]
  num_cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Growth:
  """Result of a successful `reserve`/`append_tokens`: copies to apply on device before the step."""
  copies: tuple[tuple[int, int], ...]   # (src, dst) page pairs, copy-on-write
  new_pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SwappedOut:
  """Pages whose contents the engine must copy to host (`page_ops.read_pages`) before reuse."""
  pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SwappedIn:
  """Pages to restore the swapped contents into (`page_ops.write_pages`), in table order."""
  pages: tuple[int, ...]


class BlockManager:
  """Free list, refcounts, prefix cache, copy-on-write, LRU eviction and swap over one pool.

  Args:
    num_pages: pages in the pool, NULL_PAGE included (num_pages - 1 are usable).
    page_size: tokens per page.
    enable_prefix_caching: look up and register full pages by chained hash.
    track_released: remember every page that leaves its owners (to the free list, or evicted
      from the prefix cache for reuse) until `drain_released()`; the engine scrubs them.
  """

  def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True,
               track_released: bool = False):
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is NULL_PAGE)")
    if page_size < 1:
      raise ValueError(f"page_size={page_size} must be >= 1")
    self.num_pages = num_pages
    self.page_size = page_size
    self.enable_prefix_caching = enable_prefix_caching
    self._refs = [0] * num_pages
    self._free: collections.deque[int] = collections.deque(range(1, num_pages))
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
    self._hash_to_page: dict[bytes, int] = {}
    self._page_to_hash: dict[int, bytes] = {}
    self._seqs: dict[Hashable, _Seq] = {}
    self.prefix_queries_tokens = 0
    self.prefix_hits_tokens = 0
    self.track_released = track_released
    self._released: list[int] = []

  # ----------------------------------------------------------------------------- queries

  @property
  def num_free_pages(self) -> int:
    """Pages an allocation can take now: free plus cached-idle (evictable)."""
    return len(self._free) + len(self._idle)

  @property
  def num_cached_idle_pages(self) -> int:
    """Pages no sequence references that the prefix cache keeps (evictable)."""
    return len(self._idle)

  def block_table(self, seq_id) -> tuple[int, ...]:
    return tuple(self._get(seq_id).block_table)

  def num_tokens(self, seq_id) -> int:
    return self._get(seq_id).num_tokens

  def num_computed(self, seq_id) -> int:
    return self._get(seq_id).num_computed

  def status(self, seq_id) -> SeqStatus:
    return self._get(seq_id).status

  def refcount(self, page: int) -> int:
    return self._refs[page]

  def is_cached(self, page: int) -> bool:
    return page in self._page_to_hash

  def cached_idle_pages(self) -> tuple[int, ...]:
    """Cached-idle pages in eviction order (first = next to go)."""
    return tuple(self._idle)

  def __contains__(self, seq_id) -> bool:
    return seq_id in self._seqs

  def slots(self, seq_id, start: int, stop: int) -> np.ndarray:
    """i32[stop - start] write slots of token positions start..stop-1 of a running sequence."""
    seq = self._running(seq_id)
    if not 0 <= start <= stop <= len(seq.block_table) * self.page_size:
      raise ValueError(f"positions {start}..{stop} are outside sequence {seq_id!r}'s capacity of "
                       f"{len(seq.block_table) * self.page_size} tokens")
    return slots_for_positions(seq.block_table, np.arange(start, stop), self.page_size)

  # ----------------------------------------------------------------------------- lifecycle

  def admit(self, seq_id, token_ids: Sequence[int], *, adapter_id: Hashable | None = None,
            cache_salt: str | None = None, resume: bool = False,
            min_uncached: int = 1) -> Admission | None:
    """Allocates ceil(len(token_ids) / page_size) pages, reusing the longest cached prefix.

    At least the last `min_uncached` tokens (default 1: the last prompt token, so its logits
    exist) are always left to compute. All or nothing: returns None, changing nothing, if the
    pages do not fit.

    Args:
      seq_id: a new id, or (with resume=True) a sequence preempted for recompute.
      token_ids: the prompt; with resume=True, every token the sequence has (at least as many as
        when it was preempted; they are recomputed).
      adapter_id, cache_salt: extra hash keys (every page / first page); a resumed sequence
        keeps its own.
    """
    if resume:
      seq = self._get(seq_id)
      if seq.status is not SeqStatus.PREEMPTED:
        raise ValueError(f"sequence {seq_id!r} is {seq.status.value}, not preempted")
      if token_ids is None or len(token_ids) < seq.num_tokens:
        raise ValueError(f"resuming sequence {seq_id!r} needs its {seq.num_tokens} tokens; got "
                         f"{None if token_ids is None else len(token_ids)}")
      adapter_id, cache_salt = seq.adapter_id, seq.cache_salt
    elif seq_id in self._seqs:
      raise ValueError(f"sequence {seq_id!r} is already admitted")
    if isinstance(min_uncached, bool) or not isinstance(min_uncached, int) or min_uncached < 1:
      raise ValueError(f"min_uncached={min_uncached!r} must be an int >= 1")
    token_ids = check_token_ids(token_ids, f"sequence {seq_id!r}")
    if not token_ids:
      raise ValueError(f"sequence {seq_id!r}: a prompt needs at least one token")
    probe = _Seq(0, [], 0, adapter_id, cache_salt)
    self._add_tokens(probe, token_ids)
    hits = self._lookup(probe, min_uncached) if self.enable_prefix_caching else []
    need = pages_needed(probe.num_tokens, self.page_size) - len(hits)
    idle_hits = sum(1 for p in hits if self._refs[p] == 0)
    if need > self.num_free_pages - idle_hits:
      return None
    for p in hits:
      self._ref(p)
    table = hits + self._take(need)
    if self.enable_prefix_caching:
      self.prefix_queries_tokens += len(token_ids)
      self.prefix_hits_tokens += len(hits) * self.page_size
    probe.block_table = table
    probe.num_computed = len(hits) * self.page_size
    probe.num_registered = len(hits)
    self._seqs[seq_id] = probe
    return Admission(tuple(table), probe.num_computed)

  def reserve(self, seq_id, num_tokens: int) -> Growth | None:
    """Capacity for `num_tokens` more tokens (e.g. the next k decode steps), all or nothing.

    A new page is allocated only when the last one is full. A shared page that the new tokens
    write into (positions num_tokens .. num_tokens + n - 1) is first replaced by a private page,
    copied if it already holds tokens (copy-on-write); full shared pages, and shared pages past
    the new tokens, are left alone. Returns None, changing nothing, if the pages do not fit.
    """
    seq = self._running(seq_id)
    if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)):
      # 1.5 used to be accepted (pages_needed(4 + 1.5, 4) = 2 allocated a page), after which a
      # valid reserve(seq_id, 2) allocated nothing.
      raise ValueError(f"num_tokens={num_tokens!r} is not an int")
    num_tokens = int(num_tokens)
    if num_tokens < 0:
      raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    if num_tokens == 0:
      return Growth((), ())
    n, ps, table = seq.num_tokens, self.page_size, seq.block_table
    written = range(n // ps, min((n + num_tokens - 1) // ps + 1, len(table)))
    shared = [j for j in written if self._refs[table[j]] > 1]
    new = max(0, pages_needed(n + num_tokens, ps) - len(table))
    if new + len(shared) > self.num_free_pages:
      return None
    copies = []
    for j in shared:
      src = table[j]
      (dst,) = self._take(1)
      self._unref(src)
      table[j] = dst
      if j * ps < n:   # it holds tokens: copy them
        copies.append((src, dst))
    pages = self._take(new)
    table.extend(pages)
    return Growth(tuple(copies), tuple(pages))

  def append_tokens(self, seq_id, token_ids: Sequence[int]) -> Growth | None:
    """Adds tokens (e.g. the token sampled this step), reserving their slots first.

    Returns the copy-on-write pairs and new pages, or None (nothing changed) if out of pages.
    """
    token_ids = check_token_ids(token_ids, f"sequence {seq_id!r}")
    growth = self.reserve(seq_id, len(token_ids))
    if growth is not None:
      self._add_tokens(self._seqs[seq_id], token_ids)
    return growth

  def mark_computed(self, seq_id, num_computed: int | None = None) -> None:
    """Declares that the first `num_computed` tokens (default: all) have K/V in the pool; full
    pages among them enter the prefix cache."""
    seq = self._running(seq_id)
    n = seq.num_tokens if num_computed is None else num_computed
    if not seq.num_computed <= n <= seq.num_tokens:
      raise ValueError(f"num_computed={n} must lie in [{seq.num_computed}, {seq.num_tokens}] for "
                       f"sequence {seq_id!r}")
    seq.num_computed = n
    if self.enable_prefix_caching:
      for j in range(seq.num_registered, n // self.page_size):
        h, p = seq.hashes[j], seq.block_table[j]
        # A duplicate (same hash already cached under another page) stays unregistered: block
        # tables are append-only, so the sequence keeps its own copy.
        if h not in self._hash_to_page and p not in self._page_to_hash:
          self._hash_to_page[h] = p
          self._page_to_hash[p] = h
      seq.num_registered = max(seq.num_registered, n // self.page_size)

  def fork(self, parent_id, child_id) -> tuple[int, ...]:
    """The child shares every page of the parent (refcounts + 1, no copy). Returns its table."""
    parent = self._running(parent_id)
    if child_id in self._seqs:
      raise ValueError(f"sequence {child_id!r} already exists")
    for p in parent.block_table:
      self._ref(p)
    self._seqs[child_id] = dataclasses.replace(
        parent, block_table=list(parent.block_table), hashes=list(parent.hashes),
        tail=list(parent.tail))
    return tuple(parent.block_table)

  def free(self, seq_id) -> None:
    """Releases a finished (or aborted) sequence: every page's refcount drops by one."""
    seq = self._get(seq_id)
    if seq.status is SeqStatus.RUNNING:
      self._release(seq.block_table)
    del self._seqs[seq_id]

  # ----------------------------------------------------------------------------- preemption

  def preempt_recompute(self, seq_id) -> None:
    """Frees the sequence's pages but keeps its record; full computed pages stay cached, so
    `admit(seq_id, tokens, resume=True)` later hits the prefix cache for them."""
    seq = self._running(seq_id)
    self._release(seq.block_table)
    seq.block_table, seq.num_computed, seq.status = [], 0, SeqStatus.PREEMPTED

  def swap_out(self, seq_ids) -> SwappedOut:
    """Marks the sequence(s) swapped and frees their pages. The caller must copy `pages` to host
    memory (page_ops.read_pages) before anything else writes the pool.

    Args:
      seq_ids: one sequence, or a list of them (a request's samples or beams): a page they share
        is listed once, and `swap_in` of the same list shares it again.
    """
    ids = self._as_ids(seq_ids)
    seqs = [self._running(i) for i in ids]
    pages: list[int] = []
    index: dict[int, int] = {}
    for seq in seqs:
      layout = []
      for p in seq.block_table:
        if p not in index:
          index[p] = len(pages)
          pages.append(p)
        layout.append(index[p])
      seq.swap_layout = tuple(layout)
    for seq in seqs:
      self._release(seq.block_table)
      seq.block_table, seq.status = [], SeqStatus.SWAPPED
      seq.num_swapped_pages, seq.swap_group = len(pages), frozenset(ids)
    return SwappedOut(tuple(pages))

  def swap_in(self, seq_ids) -> SwappedIn | None:
    """Allocates fresh pages for what `swap_out(seq_ids)` freed (None, changing nothing, if they
    do not fit), sharing them again as before. The caller restores the host copy into them
    (page_ops.write_pages), in the order returned."""
    ids = self._as_ids(seq_ids)
    seqs = [self._get(i) for i in ids]
    for i, seq in zip(ids, seqs):
      if seq.status is not SeqStatus.SWAPPED:
        raise ValueError(f"sequence {i!r} is {seq.status.value}, not swapped")
      if seq.swap_group != frozenset(ids):
        raise ValueError(f"sequence {i!r} was swapped out with {sorted(map(repr, seq.swap_group))}; "
                         f"swap them in together")
    n = seqs[0].num_swapped_pages
    if n > self.num_free_pages:
      return None
    new = self._take(n)
    for seq in seqs:
      seq.block_table = [new[j] for j in seq.swap_layout]
      seq.num_registered = 0   # the restored pages are private copies, not cache entries
      seq.status, seq.num_swapped_pages, seq.swap_layout = SeqStatus.RUNNING, 0, ()
      seq.swap_group = frozenset()
    for p in new:
      self._refs[p] = 0
    for seq in seqs:
      for p in seq.block_table:
        self._refs[p] += 1
    return SwappedIn(tuple(new))

  def reset_prefix_cache(self) -> None:
    """Forgets every cached hash. Allowed only when no page is in use."""
    in_use = sum(1 for r in self._refs if r)
    if in_use:
      raise RuntimeError(f"cannot reset the prefix cache while {in_use} pages are in use")
    self._hash_to_page.clear()
    self._page_to_hash.clear()
    self._free.extend(self._idle)
    if self.track_released:
      self._released.extend(self._idle)
    self._idle.clear()

  def drain_released(self) -> list[int]:
    """Pages released since the last call (with track_released): freed, or cached pages
    evicted for reuse. A page may be in use again already; its new owner writes it later."""
    out, self._released = self._released, []
    return out

  # ----------------------------------------------------------------------------- metrics

  def stats(self) -> dict[str, float]:
    """Pages free / in use / cached-idle, KV usage, prefix-cache queries and hits (tokens), stored
    tokens, reserved token slots and internal fragmentation."""
    in_use_pages = {p for s in self._seqs.values() for p in s.block_table}
    stored = {}
    for s in self._seqs.values():
      for j, p in enumerate(s.block_table):
        filled = max(0, min(self.page_size, s.num_tokens - j * self.page_size))
        stored[p] = max(stored.get(p, 0), filled)   # a shared page stores its tokens once
    stored_tokens = sum(stored.values())
    reserved = len(in_use_pages) * self.page_size
    usable = self.num_pages - 1
    return {
        "pages_free": len(self._free), "pages_in_use": len(in_use_pages),
        "pages_cached_idle": len(self._idle),
        "kv_usage": len(in_use_pages) / usable,
        "prefix_queries_tokens": self.prefix_queries_tokens,
        "prefix_hits_tokens": self.prefix_hits_tokens,
        "prefix_hit_rate": self.prefix_hits_tokens / max(1, self.prefix_queries_tokens),
        "stored_tokens": stored_tokens, "reserved_token_slots": reserved,
        "internal_fragmentation": (reserved - stored_tokens) / reserved if reserved else 0.0,
    }

  def page_owners(self) -> dict[int, list]:
    """{page: [sequence ids whose block tables reference it]} for every page in use."""
    owners: dict[int, list] = {}
    for seq_id, s in self._seqs.items():
      for p in s.block_table:
        owners.setdefault(p, []).append(seq_id)
    return owners

  def check_invariants(self) -> None:
    """Raises AssertionError if any invariant of the module docstring is broken."""
    refs = np.asarray(self._refs)
    counted = np.zeros(self.num_pages, np.int64)
    for seq_id, s in self._seqs.items():
      if s.status is SeqStatus.RUNNING:
        np.add.at(counted, np.asarray(s.block_table, np.int64), 1)
        assert len(s.block_table) * self.page_size >= s.num_tokens, f"{seq_id!r} over capacity"
        assert 0 <= s.num_computed <= s.num_tokens, seq_id
      else:
        assert not s.block_table, f"{seq_id!r} is {s.status.value} but holds pages"
    assert counted[NULL_PAGE] == 0, "NULL_PAGE is in a block table"
    assert refs[NULL_PAGE] == 0, "NULL_PAGE has a refcount"
    np.testing.assert_array_equal(refs, counted, err_msg="refcount != block-table references")
    free, idle = set(self._free), set(self._idle)
    assert len(free) == len(self._free), "a page is in the free list twice"
    assert NULL_PAGE not in free and NULL_PAGE not in idle, "NULL_PAGE is allocatable"
    in_use = set(np.flatnonzero(refs).tolist())
    assert not (free & idle) and not (free & in_use) and not (idle & in_use), (
        "a page is in two states")
    assert len(free) + len(idle) + len(in_use) == self.num_pages - 1, "a page is lost or leaked"
    assert all(p in self._page_to_hash for p in idle), "a cached-idle page has no hash"
    assert not any(p in self._page_to_hash for p in free), "a free page still has a hash"
    assert all(self._hash_to_page[h] == p for p, h in self._page_to_hash.items()), "hash maps disagree"
    assert len(self._hash_to_page) == len(self._page_to_hash), "hash maps disagree"

  # ----------------------------------------------------------------------------- internals

  def _get(self, seq_id) -> _Seq:
    try:
      return self._seqs[seq_id]
    except KeyError:
      raise UnknownSequenceError(f"unknown or finished sequence {seq_id!r}") from None

  def _as_ids(self, seq_ids) -> list:
    """One sequence id, or a list of them."""
    try:
      if seq_ids in self._seqs:
        return [seq_ids]
    except TypeError:   # a list is not hashable
      pass
    ids = list(seq_ids) if isinstance(seq_ids, (list, tuple)) else [seq_ids]
    if len(set(ids)) != len(ids):
      raise ValueError(f"sequence ids {ids!r} repeat")
    return ids

  def _running(self, seq_id) -> _Seq:
    seq = self._get(seq_id)
    if seq.status is not SeqStatus.RUNNING:
      raise ValueError(f"sequence {seq_id!r} is {seq.status.value}, not running")
    return seq

  def _add_tokens(self, seq: _Seq, token_ids: Sequence[int]) -> None:
    """Counts new tokens and hashes every page they fill (incrementally: only the partial last
    page's ids are kept). Nothing is hashed when prefix caching is off."""
    seq.num_tokens += len(token_ids)
    if not self.enable_prefix_caching:
      return
    s = self.page_size
    seq.tail.extend(int(t) for t in token_ids)
    while len(seq.tail) >= s:
      j = len(seq.hashes)
      extra = (seq.adapter_id,) + ((seq.cache_salt,) if j == 0 else ())
      seq.hashes.append(page_hash(seq.hashes[-1] if j else None, seq.tail[:s], extra))
      del seq.tail[:s]

  def _lookup(self, seq: _Seq, min_uncached: int) -> list[int]:
    """Pages of the longest cached chain, leaving at least the last `min_uncached` tokens to
    compute."""
    max_hit_pages = max(0, seq.num_tokens - min_uncached) // self.page_size
    hits = []
    for h in seq.hashes[:max_hit_pages]:
      page = self._hash_to_page.get(h)
      if page is None:
        break
      hits.append(page)
    return hits

  def _take(self, n: int) -> list[int]:
    """n pages: free ones first, then evict cached-idle ones in LRU order (they lose their hash)."""
    assert n <= self.num_free_pages
    pages = []
    for _ in range(n):
      if self._free:
        p = self._free.popleft()
      else:
        p, _ = self._idle.popitem(last=False)
        del self._hash_to_page[self._page_to_hash.pop(p)]
        if self.track_released:
          self._released.append(p)
      self._refs[p] = 1
      pages.append(p)
    return pages

  def _ref(self, page: int) -> None:
    if self._refs[page] == 0:
      del self._idle[page]   # a hit on a cached-idle page takes it out of the LRU queue
    self._refs[page] += 1

  def _unref(self, page: int) -> None:
    self._refs[page] -= 1
    if self._refs[page] == 0:
      if page in self._page_to_hash:
        self._idle[page] = None   # most recently used end
      else:
        self._free.append(page)
        if self.track_released:
          self._released.append(page)

  def _release(self, block_table: Iterable[int]) -> None:
    # Last page first: within one sequence the longest prefix (least reusable) is evicted first.
    for p in reversed(list(block_table)):
      self._unref(p)
