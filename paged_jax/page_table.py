"""A page table on the device: page allocation inside `jit`, for generation as one compiled loop.

The host `BlockManager` (host/block_manager.py) is the framework's allocator: prefix caching,
LRU eviction, swap, preemption. `PageTable` is its on-device counterpart for programs that must
not leave the device (rollouts in a training loop, evaluation under `jit` / `vmap`): a frozen
pytree with fixed shapes and pure functions on it. It does what a sequence's life needs, and
nothing more: admit (allocate a prompt's pages), grow (a page whenever a sequence crosses a page
boundary; copy-on-write of a shared partial last page), fork (share every page, refcounts + 1)
and free (pages whose refcount reaches 0 return to the free stack). No prefix cache, no
preemption: a sequence that does not fit gets its `overflow` flag instead.

Every operation is all-or-nothing per sequence: a sequence whose pages do not fit (or would
outgrow its block-table row) changes nothing and gets `overflow[i] = True`; other sequences are
untouched. Requests are served in slot order (first fit): a sequence that fails does not consume
pages, so a later, smaller one may still fit. NULL_PAGE is never handed out.

Policy differences from the host manager (the differential test maps page ids instead of
comparing them): the free list here is a stack (the last freed page is reused first; the host
reuses pages FIFO), and sequences are slots 0..max_seqs-1, not ids.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from paged_jax.state import NULL_PAGE


@flax.struct.dataclass
class PageTable:
  """Allocation state of one pool. Shapes are fixed, so every function below jits once.

  Attributes:
    free_stack: i32[num_pages - 1] free page ids in [:num_free] (the top is num_free - 1).
    num_free: i32[] free pages.
    refcounts: i32[num_pages] block-table entries referencing each page (NULL_PAGE: 0).
    block_tables: i32[max_seqs, max_pages_per_seq]; NULL_PAGE past a sequence's pages.
    seq_lens: i32[max_seqs] tokens each sequence has slots for.
    active: bool[max_seqs] the slot holds a sequence.
    overflow: bool[max_seqs] an allocation for it failed (and changed nothing).
    page_size: tokens per page (static).
  """
  free_stack: jax.Array
  num_free: jax.Array
  refcounts: jax.Array
  block_tables: jax.Array
  seq_lens: jax.Array
  active: jax.Array
  overflow: jax.Array
  page_size: int = flax.struct.field(pytree_node=False, default=16)

  @classmethod
  def create(cls, num_pages: int, page_size: int, max_seqs: int,
             max_pages_per_seq: int) -> "PageTable":
    """An empty table over pages 1..num_pages-1 (handed out in increasing order at first)."""
    if num_pages < 2:
      raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is NULL_PAGE)")
    for name, v in (("page_size", page_size), ("max_seqs", max_seqs),
                    ("max_pages_per_seq", max_pages_per_seq)):
      if v < 1:
        raise ValueError(f"{name}={v} must be >= 1")
    return cls(free_stack=jnp.arange(num_pages - 1, 0, -1, dtype=jnp.int32),
               num_free=jnp.asarray(num_pages - 1, jnp.int32),
               refcounts=jnp.zeros(num_pages, jnp.int32),
               block_tables=jnp.full((max_seqs, max_pages_per_seq), NULL_PAGE, jnp.int32),
               seq_lens=jnp.zeros(max_seqs, jnp.int32),
               active=jnp.zeros(max_seqs, bool), overflow=jnp.zeros(max_seqs, bool),
               page_size=page_size)

  @property
  def num_pages(self) -> int:
    return self.refcounts.shape[0]

  @property
  def max_seqs(self) -> int:
    return self.block_tables.shape[0]

  @property
  def max_pages_per_seq(self) -> int:
    return self.block_tables.shape[1]

  def num_pages_of(self) -> jax.Array:
    """i32[max_seqs] pages each sequence holds."""
    return -(-self.seq_lens // self.page_size)

  def slots(self, positions: jax.Array) -> jax.Array:
    """i32[max_seqs] the slot of position positions[i] of sequence i (its page must exist)."""
    col = jnp.clip(positions // self.page_size, 0, self.max_pages_per_seq - 1)
    page = self.block_tables[jnp.arange(self.max_seqs), col]
    return page * self.page_size + positions % self.page_size


def grow(pt: PageTable, num_new: jax.Array) -> tuple[PageTable, jax.Array, jax.Array]:
  """Slots for num_new[i] more tokens of each active sequence.

  A sequence gets a new page whenever its tokens cross into one; if the first new token lands
  in a partial last page that another sequence shares (refcount > 1), that page is replaced by a
  private copy (copy-on-write): the pair (src, dst) is returned and must be applied to the pool
  (`page_ops.copy_pages`) before anything writes it.

  Args:
    num_new: i32[max_seqs] tokens to add (ignored for inactive slots).

  Returns:
    (the table, src i32[max_seqs], dst i32[max_seqs]): copy pairs, NULL_PAGE -> NULL_PAGE where
    none. A sequence that does not fit changes nothing and gets overflow = True.
  """
  ps, num_slots, width = pt.page_size, pt.max_seqs, pt.max_pages_per_seq
  rows = jnp.arange(num_slots)
  lens = pt.seq_lens
  new_lens = lens + num_new
  want = pt.active & (num_new > 0)
  have = -(-lens // ps)
  wanted = -(-new_lens // ps)
  last_col = jnp.clip(lens // ps, 0, width - 1)
  last_page = pt.block_tables[rows, last_col]
  partial = want & (lens % ps != 0)

  # Slot order, one sequence at a time (as the host manager does): a sequence copies its shared
  # partial last page only if it is still shared when its turn comes (of three sharers, two
  # copy and the last keeps the page); it gets its pages only if they fit what is left.
  def first_fit(carry, x):
    free, refs = carry
    want_i, partial_i, page_i, new_pages_i, fits_i = x
    cow_i = partial_i & (refs[page_i] > 1)
    need_i = jnp.where(want_i, new_pages_i + cow_i, 0)
    ok = want_i & fits_i & (need_i <= free)
    refs = refs.at[page_i].add(-(ok & cow_i).astype(jnp.int32))
    return (free - jnp.where(ok, need_i, 0), refs), (ok, cow_i, need_i)

  (_, refcounts), (ok, cow, need) = jax.lax.scan(
      first_fit, (pt.num_free, pt.refcounts), (want, partial, last_page, wanted - have,
                                               wanted <= width))
  take = jnp.where(ok, need, 0)
  offset = jnp.cumsum(take) - take
  j = jnp.arange(width)[None, :]
  valid = j < take[:, None]
  stack_idx = jnp.clip(pt.num_free - 1 - (offset[:, None] + j), 0, pt.free_stack.shape[0] - 1)
  pages = jnp.where(valid, pt.free_stack[stack_idx], NULL_PAGE)
  is_copy = cow[:, None] & (j == 0)
  col = jnp.where(is_copy, last_col[:, None], have[:, None] + j - cow[:, None].astype(jnp.int32))
  col = jnp.where(valid, col, width)                       # out of bounds: dropped
  tables = pt.block_tables.at[rows[:, None], col].set(pages, mode="drop")
  copied = ok & cow
  refcounts = refcounts.at[pages.reshape(-1)].add(valid.reshape(-1).astype(jnp.int32))
  src = jnp.where(copied, last_page, NULL_PAGE).astype(jnp.int32)
  dst = jnp.where(copied, pages[:, 0], NULL_PAGE).astype(jnp.int32)
  pt = pt.replace(num_free=pt.num_free - jnp.sum(take), refcounts=refcounts, block_tables=tables,
                  seq_lens=jnp.where(ok, new_lens, lens), overflow=pt.overflow | (want & ~ok))
  return pt, src, dst


def admit(pt: PageTable, mask: jax.Array, num_tokens: jax.Array) -> PageTable:
  """Starts sequences in the free slots `mask` names, with pages for num_tokens[i] tokens each.
  All or nothing per sequence: one that does not fit stays inactive, with overflow = True.

  Args:
    mask: bool[max_seqs] slots to start (active slots are left alone).
    num_tokens: i32[max_seqs] their prompt lengths (>= 1).
  """
  start = mask & ~pt.active
  pt = pt.replace(active=pt.active | start, seq_lens=jnp.where(start, 0, pt.seq_lens),
                  overflow=jnp.where(start, False, pt.overflow))
  pt, _, _ = grow(pt, jnp.where(start, num_tokens, 0))   # fresh pages: nothing to copy
  failed = start & pt.overflow
  return pt.replace(active=pt.active & ~failed)


def fork(pt: PageTable, parent: jax.Array, child: jax.Array, mask: jax.Array) -> PageTable:
  """Child slots share every page of their parents (refcounts + 1, no copy).

  Args:
    parent, child: i32[F] slot pairs; mask: bool[F] which pairs to apply. A pair whose parent is
      inactive or whose child slot is taken is skipped. Children must be distinct.
  """
  ok = mask & pt.active[parent] & ~pt.active[child]
  width = pt.max_pages_per_seq
  parent_tables = pt.block_tables[parent]
  live = (jnp.arange(width)[None, :] < pt.num_pages_of()[parent][:, None]) & ok[:, None]
  refcounts = pt.refcounts.at[jnp.where(live, parent_tables, NULL_PAGE).reshape(-1)].add(
      live.reshape(-1).astype(jnp.int32))
  target = jnp.where(ok, child, pt.max_seqs)                # out of bounds: dropped
  return pt.replace(
      refcounts=refcounts,
      block_tables=pt.block_tables.at[target].set(parent_tables, mode="drop"),
      seq_lens=pt.seq_lens.at[target].set(pt.seq_lens[parent], mode="drop"),
      active=pt.active.at[target].set(True, mode="drop"),
      overflow=pt.overflow.at[target].set(False, mode="drop"))


def free(pt: PageTable, mask: jax.Array) -> PageTable:
  """Ends the sequences `mask` names: their pages' refcounts drop by one, and pages that reach
  0 go back on the free stack (in increasing id order; the last one pushed is reused first).

  Args:
    mask: bool[max_seqs].
  """
  m = mask & pt.active
  width = pt.max_pages_per_seq
  live = (jnp.arange(width)[None, :] < pt.num_pages_of()[:, None]) & m[:, None]
  entries = jnp.where(live, pt.block_tables, NULL_PAGE).reshape(-1)
  refcounts = pt.refcounts.at[entries].add(-live.reshape(-1).astype(jnp.int32))
  freed = (pt.refcounts > 0) & (refcounts == 0)
  rank = jnp.cumsum(freed) - freed
  where = jnp.where(freed, pt.num_free + rank, pt.free_stack.shape[0])   # out of bounds: dropped
  free_stack = pt.free_stack.at[where].set(jnp.arange(pt.num_pages, dtype=jnp.int32), mode="drop")
  return pt.replace(
      free_stack=free_stack, num_free=pt.num_free + jnp.sum(freed).astype(jnp.int32),
      refcounts=refcounts, block_tables=jnp.where(m[:, None], NULL_PAGE, pt.block_tables),
      seq_lens=jnp.where(m, 0, pt.seq_lens), active=pt.active & ~m)


def check_invariants(pt: PageTable) -> None:
  """Host-side (NumPy) check: refcounts equal block-table references, the free stack holds
  exactly the pages with refcount 0 (each once), NULL_PAGE is neither referenced nor free."""
  import numpy as np
  refs = np.asarray(pt.refcounts)
  tables, lens = np.asarray(pt.block_tables), np.asarray(pt.seq_lens)
  active = np.asarray(pt.active)
  counted = np.zeros_like(refs)
  for i in np.flatnonzero(active):
    n = -(-int(lens[i]) // pt.page_size)
    assert (tables[i, :n] != NULL_PAGE).all(), f"sequence {i}: NULL_PAGE inside its pages"
    assert (tables[i, n:] == NULL_PAGE).all(), f"sequence {i}: pages past its length"
    np.add.at(counted, tables[i, :n], 1)
  assert (tables[~active] == NULL_PAGE).all(), "an inactive slot holds pages"
  np.testing.assert_array_equal(refs, counted, err_msg="refcount != block-table references")
  free = np.asarray(pt.free_stack)[:int(pt.num_free)]
  assert len(set(free.tolist())) == free.size, "a page is on the free stack twice"
  assert NULL_PAGE not in free, "NULL_PAGE is free"
  assert set(free.tolist()) == set(np.flatnonzero(refs == 0).tolist()) - {NULL_PAGE}, (
      "free stack != pages with refcount 0")
