"""Block manager: the seeds' numbers, prefix caching, copy-on-write, swap, bad input, properties."""

import re

from absl.testing import absltest
import chex
import hypothesis
from hypothesis import stateful
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np

from paged_jax import KVPool, page_ops
from paged_jax.host import baselines
from paged_jax.host.block_manager import (BlockManager, Growth, SeqStatus, UnknownSequenceError,
                                          page_hash)


def _computed(bm, seq_id, tokens, **kw):
  """Admit and mark the whole prompt computed (what one prefill step does)."""
  adm = bm.admit(seq_id, tokens, **kw)
  bm.mark_computed(seq_id)
  bm.check_invariants()
  return adm


class SeedNumbersTest(absltest.TestCase):

  def test_three_requests_and_growth(self):
    # The seeds' 64-block pool has 64 usable blocks; ours adds NULL_PAGE, so num_pages = 65.
    bm = BlockManager(num_pages=65, page_size=16)
    tables = {}
    for name, n in (("a", 25), ("b", 47), ("c", 12)):
      tables[name] = bm.admit(name, range(n)).block_table
    self.assertEqual([len(tables[n]) for n in "abc"], [2, 3, 1])
    self.assertEqual(bm.stats()["reserved_token_slots"], 96)
    self.assertEqual(bm.stats()["stored_tokens"], 84)
    self.assertEqual(bm.num_free_pages, 58)
    bm.check_invariants()
    # 47 + 10 = 57 tokens: exactly one more page; the first three entries stay where they are.
    growth = bm.append_tokens("b", range(47, 57))
    self.assertLen(growth.new_pages, 1)
    self.assertEqual(bm.block_table("b")[:3], tables["b"])
    self.assertLen(bm.block_table("b"), 4)
    bm.check_invariants()

  def test_growth_by_twenty_needs_two_pages(self):
    bm = BlockManager(num_pages=65, page_size=16)
    first = bm.admit("b", range(47)).block_table
    growth = bm.append_tokens("b", range(47, 67))   # 67 tokens: five pages in all
    self.assertLen(growth.new_pages, 2)
    self.assertEqual(bm.block_table("b")[:3], first)
    self.assertLen(bm.block_table("b"), 5)

  def test_decode_allocates_only_when_last_page_is_full(self):
    bm = BlockManager(num_pages=10, page_size=4)
    bm.admit("s", range(5))
    # Tokens 6..13: pages hold 8 after the prompt, so the 9th and 13th token open new pages.
    new = [len(bm.append_tokens("s", [9]).new_pages) for _ in range(8)]
    self.assertEqual(new, [0, 0, 0, 1, 0, 0, 0, 1])
    bm.free("s")
    self.assertEqual(bm.num_free_pages, 9)
    bm.check_invariants()

  def test_seed_cow_case(self):
    # A and B share P0 (16 tokens) and P1 (8 tokens); B writes next: P1 is copied, A keeps it.
    bm = BlockManager(num_pages=8, page_size=16)
    p0, p1 = _computed(bm, "A", range(24)).block_table
    bm.fork("A", "B")
    self.assertEqual((bm.refcount(p0), bm.refcount(p1)), (2, 2))
    growth = bm.append_tokens("B", [99])
    (src, dst), = growth.copies
    self.assertEqual(src, p1)
    self.assertEqual(bm.block_table("B"), (p0, dst))
    self.assertEqual(bm.block_table("A"), (p0, p1))
    self.assertEqual((bm.refcount(p0), bm.refcount(p1), bm.refcount(dst)), (2, 1, 1))
    # A now owns P1 alone and writes in place; the full shared P0 is never copied.
    self.assertEqual(bm.append_tokens("A", [7]).copies, ())
    bm.check_invariants()

  def test_full_shared_page_is_not_copied(self):
    bm = BlockManager(num_pages=8, page_size=16)
    _computed(bm, "A", range(32))   # two full pages
    bm.fork("A", "B")
    growth = bm.append_tokens("B", [1])
    self.assertEqual(growth.copies, ())
    self.assertLen(growth.new_pages, 1)
    bm.check_invariants()

  def test_reserve_copies_only_the_page_the_new_tokens_write(self):
    # Regression (engine issue, 6a): a fork after a k-token reservation shares pages that hold
    # no tokens yet; appending one token must copy only the page that token goes into.
    bm = BlockManager(5, 8)
    bm.admit("a", [1])
    bm.mark_computed("a")
    bm.reserve("a", 16)                      # pages 1, 2, 3; only page 1 holds a token
    bm.fork("a", "b")
    growth = bm.append_tokens("b", [5])      # one free page (4) is enough for the one copy
    self.assertIsNotNone(growth)
    self.assertEqual(growth.copies, ((1, 4),))
    self.assertEqual(bm.block_table("b"), (4, 2, 3))
    self.assertEqual(bm.block_table("a"), (1, 2, 3))
    # Once a is gone, b owns pages 2 and 3 alone and writes into them in place.
    bm.free("a")
    growth = bm.append_tokens("b", range(7))  # positions 2..8 reach page 2
    self.assertEqual(growth, type(growth)((), ()))
    self.assertEqual(bm.block_table("b"), (4, 2, 3))
    bm.check_invariants()

  def test_parallel_sampling_1000_token_prompt_4_completions(self):
    page_size = 16
    bm = BlockManager(num_pages=400, page_size=page_size, enable_prefix_caching=False)
    _computed(bm, 0, range(1000))
    for child in (1, 2, 3):
      bm.fork(0, child)
    copies = 0
    for step in range(200):
      for s in range(4):
        copies += len(bm.append_tokens(s, [step]).copies)
    bm.check_invariants()
    used = bm.stats()["pages_in_use"]
    # Exact: 62 full shared prompt pages + 4 x 13 private tail pages (three of the four copied the
    # shared partial page 62; the last writer kept it). The seeds' estimate 63 + 52 + 4 = 119 is
    # an upper bound on the same count.
    self.assertEqual(copies, 3)
    self.assertEqual(used, 62 + 4 * 13)
    self.assertLessEqual(used, 119)
    # Without sharing each sequence would own every page its table lists: 4 x 75.
    unshared = sum(len(bm.block_table(s)) for s in range(4))
    self.assertEqual(unshared, 300)
    self.assertGreater(1 - used / unshared, 0.6)   # the seeds' "saving ~60%"


class PrefixCacheTest(absltest.TestCase):

  def test_two_requests_share_three_full_pages(self):
    bm = BlockManager(num_pages=12, page_size=4)
    prompt = list(range(100, 112))
    a = _computed(bm, "a", prompt + [1, 2])         # 14 tokens: pages 1,2,3 full, 4 partial
    self.assertEqual(a, type(a)((1, 2, 3, 4), 0))
    b = bm.admit("b", prompt + [5, 6, 7])            # shares the three full pages
    self.assertEqual(b.block_table, (1, 2, 3, 5))
    self.assertEqual(b.num_cached_tokens, 12)
    self.assertEqual([bm.refcount(p) for p in (1, 2, 3, 4, 5)], [2, 2, 2, 1, 1])
    stats = bm.stats()
    self.assertEqual((stats["prefix_queries_tokens"], stats["prefix_hits_tokens"]), (29, 12))
    bm.check_invariants()

  def test_eviction_order_after_both_finish(self):
    bm = BlockManager(num_pages=12, page_size=4)
    prompt = list(range(100, 112))
    _computed(bm, "a", prompt + [1, 2, 3, 4])    # pages 1,2,3,4 (4 full)
    _computed(bm, "b", prompt + [5, 6, 7, 8, 9])  # hits 1,2,3; new 5 (full), 6 (partial)
    bm.free("a")   # 1,2,3 still used by b; 4 becomes cached-idle
    bm.free("b")   # b's pages, last first: 6 (partial) -> free list; 5, 3, 2, 1 -> cached-idle
    self.assertEqual(bm.cached_idle_pages(), (4, 5, 3, 2, 1))
    bm.check_invariants()
    # Free pages go first (7..11, then 6), then LRU: 4, 5, 3, ...
    taken = bm.admit("c", range(500, 500 + 4 * 8)).block_table
    self.assertEqual(taken, (7, 8, 9, 10, 11, 6, 4, 5))
    self.assertFalse(bm.is_cached(4) or bm.is_cached(5))   # reclaimed pages lose their hash
    self.assertEqual(bm.cached_idle_pages(), (3, 2, 1))
    bm.check_invariants()

  def test_hit_after_partial_eviction(self):
    bm = BlockManager(num_pages=10, page_size=4)
    prompt = list(range(16))
    _computed(bm, "a", prompt + [99])   # pages 1..4 full, 5 partial
    bm.free("a")                        # idle order: 4, 3, 2, 1 (last page first); 5 -> free
    self.assertEqual(bm.cached_idle_pages(), (4, 3, 2, 1))
    _computed(bm, "x", range(900, 900 + 4 * 6))   # free 6, 7, 8, 9, 5, then evicts page 4 (LRU)
    self.assertEqual(bm.block_table("x"), (6, 7, 8, 9, 5, 4))
    bm.free("x")
    hit = bm.admit("b", prompt + [42])
    # Pages 1..3 survive: the chain matches up to the evicted fourth page; the two new pages come
    # from x's idle pages, least recently used first (x's last page first).
    self.assertEqual(hit.num_cached_tokens, 12)
    self.assertEqual(hit.block_table, (1, 2, 3, 4, 5))
    bm.check_invariants()

  def test_salts_and_adapters_never_share(self):
    bm = BlockManager(num_pages=20, page_size=4)
    prompt = list(range(9))
    _computed(bm, "a", prompt, cache_salt="alice")
    self.assertEqual(bm.admit("b", prompt, cache_salt="bob").num_cached_tokens, 0)
    self.assertEqual(bm.admit("c", prompt, cache_salt="alice").num_cached_tokens, 8)
    self.assertEqual(bm.admit("d", prompt, adapter_id="lora-1", cache_salt="alice")
                     .num_cached_tokens, 0)
    self.assertNotEqual(page_hash(None, [1, 2], ("x",)), page_hash(None, [1, 2], ("y",)))
    self.assertNotEqual(page_hash(page_hash(None, [1]), [2]), page_hash(page_hash(None, [3]), [2]))
    bm.check_invariants()

  def test_last_prompt_token_always_computed(self):
    bm = BlockManager(num_pages=10, page_size=4)
    _computed(bm, "a", range(8))
    again = bm.admit("b", range(8))        # fully cached prompt: its last page is recomputed
    self.assertEqual(again.num_cached_tokens, 4)
    bm.check_invariants()

  def test_min_uncached_leaves_more_tokens_to_compute(self):
    bm = BlockManager(num_pages=20, page_size=4)
    _computed(bm, "a", range(9))
    self.assertEqual(bm.admit("b", range(9)).num_cached_tokens, 8)
    self.assertEqual(bm.admit("c", range(9), min_uncached=2).num_cached_tokens, 4)
    self.assertEqual(bm.admit("d", range(9), min_uncached=9).num_cached_tokens, 0)
    self.assertEqual(bm.admit("e", range(9), min_uncached=20).num_cached_tokens, 0)
    for bad in (0, True, 1.5):
      with self.assertRaisesRegex(ValueError, rf"^min_uncached={bad!r} must be an int >= 1$"):
        bm.admit("f", range(9), min_uncached=bad)
    self.assertNotIn("f", bm)
    bm.check_invariants()
    bm = BlockManager(num_pages=8, page_size=1)   # a one-token prompt is never a hit
    _computed(bm, "a", [5, 6])
    self.assertEqual(bm.admit("b", [5]).num_cached_tokens, 0)
    self.assertEqual(bm.admit("c", [5, 6]).num_cached_tokens, 1)

  def test_uncomputed_pages_are_not_hit(self):
    bm = BlockManager(num_pages=10, page_size=4)
    bm.admit("a", range(9))                # admitted, prefill not run yet
    self.assertEqual(bm.admit("b", range(9)).num_cached_tokens, 0)
    bm.mark_computed("a", 4)               # first chunk done: one page
    self.assertEqual(bm.admit("c", range(9)).num_cached_tokens, 4)

  def test_caching_off_and_reset(self):
    bm = BlockManager(num_pages=10, page_size=4, enable_prefix_caching=False)
    _computed(bm, "a", range(9))
    self.assertEqual(bm.admit("b", range(9)).num_cached_tokens, 0)
    bm = BlockManager(num_pages=10, page_size=4)
    _computed(bm, "a", range(9))
    with self.assertRaisesRegex(RuntimeError, "pages are in use"):
      bm.reset_prefix_cache()
    bm.check_invariants()
    bm.free("a")
    bm.reset_prefix_cache()
    self.assertEqual(bm.cached_idle_pages(), ())
    self.assertEqual(bm.admit("b", range(9)).num_cached_tokens, 0)
    bm.check_invariants()


class StatsTest(absltest.TestCase):

  def test_stats_of_a_known_pool(self):
    bm = BlockManager(num_pages=11, page_size=4)   # 10 usable pages
    self.assertEqual(bm.stats()["internal_fragmentation"], 0.0)   # nothing reserved yet
    _computed(bm, "a", range(10))         # pages hold 4, 4, 2 tokens
    bm.fork("a", "b")                     # b shares all three: stored once
    _computed(bm, "c", range(10))         # hits a's two full pages, a new page for 2 tokens
    self.assertIsNotNone(bm.reserve("c", 4))   # 2 more slots in its page + one empty page
    self.assertEqual(bm.stats(), {
        "pages_free": 5, "pages_in_use": 5, "pages_cached_idle": 0, "kv_usage": 5 / 10,
        "prefix_queries_tokens": 20, "prefix_hits_tokens": 8, "prefix_hit_rate": 8 / 20,
        "stored_tokens": 4 + 4 + 2 + 2 + 0, "reserved_token_slots": 20,
        "internal_fragmentation": (20 - 12) / 20})
    for seq_id in ("a", "b", "c"):
      bm.free(seq_id)
    stats = bm.stats()
    self.assertEqual((stats["pages_in_use"], stats["pages_cached_idle"], stats["pages_free"]),
                     (0, 2, 8))
    self.assertEqual((stats["reserved_token_slots"], stats["internal_fragmentation"]), (0, 0.0))

  def test_reset_names_the_pages_in_use_and_reports_released_pages(self):
    bm = BlockManager(num_pages=10, page_size=4, track_released=True)
    _computed(bm, "a", range(9))          # 3 pages, 2 of them full (cached)
    with self.assertRaisesRegex(RuntimeError, "while 3 pages are in use"):
      bm.reset_prefix_cache()
    bm.free("a")
    idle = set(bm.cached_idle_pages())
    self.assertLen(idle, 2)
    bm.drain_released()
    bm.reset_prefix_cache()
    self.assertEqual(set(bm.drain_released()), idle)   # forgotten cache pages are released
    self.assertEqual(bm.num_free_pages, 9)

  def test_slots_page_owners_and_released_pages(self):
    bm = BlockManager(num_pages=12, page_size=4, track_released=True)
    _computed(bm, "a", range(6))
    bm.fork("a", "b")
    table = bm.block_table("a")
    np.testing.assert_array_equal(bm.slots("a", 2, 7), [table[0] * 4 + 2, table[0] * 4 + 3,
                                                        table[1] * 4, table[1] * 4 + 1,
                                                        table[1] * 4 + 2])
    np.testing.assert_array_equal(bm.slots("a", 0, 1), [table[0] * 4])
    self.assertEqual(bm.slots("a", 8, 8).shape, (0,))
    self.assertEqual(bm.slots("a", 3, 4).dtype, np.int32)
    for start, stop in ((-1, 2), (3, 2), (0, 9)):
      with self.assertRaisesRegex(ValueError, f"positions {start}..{stop} are outside sequence "
                                              "'a''s capacity of 8 tokens"):
        bm.slots("a", start, stop)
    self.assertEqual(bm.page_owners(), {table[0]: ["a", "b"], table[1]: ["a", "b"]})
    self.assertEqual(bm.drain_released(), [])
    bm.free("a")
    self.assertEqual(bm.drain_released(), [])        # b still holds both pages
    bm.free("b")
    self.assertEqual(bm.drain_released(), [table[1]])   # page 0 stays cached (idle)
    self.assertEqual(bm.drain_released(), [])
    self.assertEqual(bm.page_owners(), {})

  def test_a_fork_extends_the_parents_hash_chain(self):
    bm = BlockManager(num_pages=12, page_size=4)
    _computed(bm, "a", range(6))          # page 0 full (cached), page 1 holds 2 tokens
    bm.fork("a", "b")
    # Both grow after the fork: each keeps its own hash chain and partial-page tail (no list
    # shared between them).
    bm.append_tokens("b", [10, 11, 12, 13, 14, 15])   # b: 12 tokens, pages 1-2 its own
    bm.append_tokens("a", [20, 21, 22, 23, 24, 25])
    bm.mark_computed("b")
    bm.mark_computed("a")
    bm.free("a")
    bm.free("b")
    # b's page 1 (tokens 4, 5, 10, 11) hashes on page 0's hash and the 2-token tail it forked
    # with; a request with b's (or a's) tokens finds both full pages (its last page is left to
    # compute).
    for seq_id, extra in (("c", [10, 11, 12, 13, 14, 15]), ("d", [20, 21, 22, 23, 24, 25])):
      adm = bm.admit(seq_id, list(range(6)) + extra)
      self.assertEqual(adm.num_cached_tokens, 8, seq_id)
    bm.check_invariants()


class PreemptionTest(absltest.TestCase):

  def test_swap_out_and_in_restores_pages_bit_for_bit(self):
    bm = BlockManager(num_pages=10, page_size=4)
    rng = np.random.default_rng(0)
    shape = (2, 10, 4, 2, 3)
    pool = KVPool.from_stacked(rng.standard_normal(shape).astype(np.float32),
                               rng.standard_normal(shape).astype(np.float32))
    _computed(bm, "a", range(10))
    before_k, before_v = page_ops.read_pages(pool, bm.block_table("a"))
    out = bm.swap_out("a")
    host_k, host_v = page_ops.read_pages(pool, out.pages)
    self.assertEqual(bm.status("a"), SeqStatus.SWAPPED)
    bm.check_invariants()
    # Someone else takes (and overwrites) the freed pages.
    _computed(bm, "b", range(100, 130))
    for p in bm.block_table("b"):
      pool = page_ops.write_pages(pool, jnp.array([p], jnp.int32), jnp.zeros((2, 1, 4, 2, 3)),
                                  jnp.zeros((2, 1, 4, 2, 3)))
    self.assertIsNone(bm.swap_in("a"))    # no room: nothing changes
    self.assertEqual(bm.status("a"), SeqStatus.SWAPPED)
    bm.check_invariants()
    bm.free("b")
    restored = bm.swap_in("a")
    pool = page_ops.write_pages(pool, jnp.asarray(restored.pages, jnp.int32), jnp.asarray(host_k),
                                jnp.asarray(host_v))
    after_k, after_v = page_ops.read_pages(pool, bm.block_table("a"))
    np.testing.assert_array_equal(after_k, before_k)
    np.testing.assert_array_equal(after_v, before_v)
    self.assertEqual(bm.num_tokens("a"), 10)
    bm.append_tokens("a", [1, 2, 3])
    bm.check_invariants()

  def test_group_swap_keeps_sharing(self):
    # A parent and two forks share two prompt pages; each then has one page of its own.
    bm = BlockManager(num_pages=12, page_size=4)
    _computed(bm, "p", range(6))
    for child in ("c1", "c2"):
      bm.fork("p", child)
    for s in ("p", "c1", "c2"):
      bm.append_tokens(s, [7, 7, 7])   # positions 6..8: copy of the shared page 1, a new page
    held = {p for s in ("p", "c1", "c2") for p in bm.block_table(s)}
    out = bm.swap_out(["p", "c1", "c2"])
    self.assertEqual(sorted(out.pages), sorted(held))   # the shared first page once
    self.assertLen(out.pages, 1 + 3 + 3)
    bm.check_invariants()
    with self.assertRaisesRegex(ValueError, "swap them in together"):
      bm.swap_in("p")
    back = bm.swap_in(["p", "c1", "c2"])
    self.assertLen(back.pages, 7)
    first = {bm.block_table(s)[0] for s in ("p", "c1", "c2")}
    self.assertLen(first, 1)                            # shared again
    self.assertEqual(bm.refcount(first.pop()), 3)
    # Table entry j of each sequence maps to the same swapped page as before.
    for s in ("p", "c1", "c2"):
      self.assertLen(bm.block_table(s), 3)
    bm.check_invariants()

  def test_recompute_then_readmit_hits_cache(self):
    bm = BlockManager(num_pages=10, page_size=4)
    _computed(bm, "a", range(10))
    bm.append_tokens("a", [7, 8])
    bm.mark_computed("a")
    bm.preempt_recompute("a")
    self.assertEqual(bm.status("a"), SeqStatus.PREEMPTED)
    self.assertEqual((bm.num_computed("a"), bm.block_table("a")), (0, ()))
    bm.check_invariants()
    with self.assertRaisesRegex(ValueError, "needs its 12 tokens; got 10"):
      bm.admit("a", list(range(10)), resume=True)
    adm = bm.admit("a", list(range(10)) + [7, 8], resume=True)
    self.assertEqual(adm.num_cached_tokens, 8)   # pages 0-1 full; 12 tokens -> page 2 recomputed
    self.assertEqual(bm.num_tokens("a"), 12)
    bm.check_invariants()

  def test_copy_pages_applies_cow_pairs_in_every_layer(self):
    shape = (3, 6, 2, 1, 2)   # layers, pages, page_size, kv heads, head_dim
    pool = KVPool.from_stacked(np.arange(np.prod(shape), dtype=np.float32).reshape(shape),
                               -np.arange(np.prod(shape), dtype=np.float32).reshape(shape))
    k0, v0 = map(np.asarray, pool.stacked())
    pool = page_ops.copy_pages(pool, jnp.array([1, 2, 0], jnp.int32), jnp.array([4, 5, 0], jnp.int32))
    expected_k, expected_v = k0.copy(), v0.copy()
    expected_k[:, [4, 5]] = k0[:, [1, 2]]
    expected_v[:, [4, 5]] = v0[:, [1, 2]]
    chex.assert_trees_all_equal(pool.stacked(), (jnp.asarray(expected_k), jnp.asarray(expected_v)))


class BadInputTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.bm = BlockManager(num_pages=6, page_size=4)
    _computed(self.bm, "a", range(6))

  def tearDown(self):
    self.bm.check_invariants()   # every rejected call left the manager consistent
    super().tearDown()

  def test_unknown_and_finished(self):
    with self.assertRaisesRegex(UnknownSequenceError, "'zz'"):
      self.bm.append_tokens("zz", [1])
    self.bm.free("a")
    with self.assertRaisesRegex(UnknownSequenceError, "unknown or finished sequence 'a'"):
      self.bm.append_tokens("a", [1])
    with self.assertRaises(UnknownSequenceError):
      self.bm.free("a")   # double free

  def test_fork_missing_or_existing(self):
    with self.assertRaises(UnknownSequenceError):
      self.bm.fork("missing", "b")
    with self.assertRaisesRegex(ValueError, "'a' already exists"):
      self.bm.fork("a", "a")

  def test_admit_twice_and_empty(self):
    with self.assertRaisesRegex(ValueError, "already admitted"):
      self.bm.admit("a", [1])
    with self.assertRaisesRegex(ValueError, "at least one token"):
      self.bm.admit("b", [])

  def test_out_of_pages_is_all_or_nothing(self):
    free = self.bm.num_free_pages
    self.assertIsNone(self.bm.admit("big", range(1000, 1000 + 4 * (free + 1))))
    self.assertNotIn("big", self.bm)
    self.assertEqual(self.bm.num_free_pages, free)
    self.assertIsNone(self.bm.append_tokens("a", range(4 * (free + 1))))
    self.assertEqual(self.bm.num_tokens("a"), 6)

  def test_swap_in_of_running_and_resume_of_running(self):
    with self.assertRaisesRegex(ValueError, "'a' is running, not swapped"):
      self.bm.swap_in("a")
    with self.assertRaisesRegex(ValueError, "not preempted"):
      self.bm.admit("a", [1], resume=True)

  def test_mark_computed_out_of_range(self):
    with self.assertRaisesRegex(ValueError, r"num_computed=9 must lie in \[6, 6\]"):
      self.bm.mark_computed("a", 9)


class ExactFitTest(absltest.TestCase):
  """Allocation at the edge of the pool: an all-or-nothing call that fits exactly succeeds, one
  page more fails and changes nothing."""

  def test_admission_that_hits_idle_pages_fits_exactly(self):
    # 3 usable pages. a's two full pages go cached-idle when it finishes; b's prompt hits them
    # and needs one new page: 3 free-or-idle pages, 2 of them the hits, 1 left for the new page.
    bm = BlockManager(num_pages=4, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    self.assertEqual((bm.num_free_pages, len(bm.cached_idle_pages())), (3, 2))
    adm = bm.admit("b", [1, 2, 3, 4, 9])
    self.assertIsNotNone(adm)
    self.assertEqual(adm.num_cached_tokens, 4)
    bm.check_invariants()

  def test_admission_that_hits_pages_in_use_fits_exactly(self):
    # a holds 3 of 4 usable pages; b shares a's two full pages and needs exactly the last one.
    bm = BlockManager(num_pages=5, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    self.assertEqual(bm.num_free_pages, 1)
    adm = bm.admit("b", [1, 2, 3, 4, 9])
    self.assertEqual(adm.block_table[:2], bm.block_table("a")[:2])
    self.assertEqual(bm.num_free_pages, 0)
    self.assertIsNone(bm.admit("c", [1, 2, 3, 4, 7]))   # no page left for c's third page
    bm.check_invariants()

  def test_admission_one_page_short_changes_nothing(self):
    bm = BlockManager(num_pages=4, page_size=2)
    self.assertIsNone(bm.admit("a", range(7)))   # 4 pages > 3
    self.assertEqual(bm.num_free_pages, 3)
    self.assertIsNotNone(bm.admit("a", range(6)))

  def test_hit_tokens_accumulate_over_admissions(self):
    bm = BlockManager(num_pages=12, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    bm.admit("b", [1, 2, 3])        # 1 page hit
    bm.admit("c", [1, 2, 3, 4, 6])  # 2 pages hit
    stats = bm.stats()
    self.assertEqual(stats["prefix_hits_tokens"], 6)
    self.assertEqual(stats["prefix_queries_tokens"], 13)

  def test_reserve_with_copy_on_write_and_a_new_page(self):
    # a (3 tokens of a 4-token page) and its fork share page A; one page is free. Writing 2
    # tokens needs a private copy of A plus a new page: 2 pages > 1, so nothing happens.
    bm = BlockManager(num_pages=3, page_size=4)
    _computed(bm, "a", [1, 2, 3])
    bm.fork("a", "b")
    self.assertEqual(bm.num_free_pages, 1)
    self.assertIsNone(bm.reserve("b", 2))
    self.assertEqual(bm.block_table("b"), bm.block_table("a"))
    self.assertEqual(bm.num_free_pages, 1)
    growth = bm.reserve("b", 1)          # the copy alone fits
    self.assertEqual(growth.copies, ((bm.block_table("a")[0], bm.block_table("b")[0]),))
    bm.check_invariants()

  def test_swap_in_that_fits_exactly(self):
    bm = BlockManager(num_pages=4, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])   # 3 pages: the whole pool
    bm.swap_out("a")
    self.assertIsNotNone(bm.swap_in("a"))
    self.assertEqual(bm.num_free_pages, 0)
    bm.swap_out("a")
    bm.admit("x", [7])                     # takes one of the three
    self.assertIsNone(bm.swap_in("a"))
    self.assertEqual(bm.status("a"), SeqStatus.SWAPPED)
    bm.check_invariants()


class ReserveTest(absltest.TestCase):
  """Which shared pages `reserve` replaces, and which of them it copies."""

  def _forked_with_spare_page(self, prompt_len):
    # Page size 4; a holds `prompt_len` tokens and capacity for 8; b is a fork sharing both pages.
    bm = BlockManager(num_pages=8, page_size=4)
    _computed(bm, "a", list(range(prompt_len)))
    bm.reserve("a", 8 - prompt_len)
    bm.fork("a", "b")
    self.assertLen(bm.block_table("a"), 2)
    return bm

  def test_zero_tokens_is_a_no_op(self):
    bm = self._forked_with_spare_page(3)
    self.assertEqual(bm.reserve("b", 0), Growth((), ()))
    self.assertEqual(bm.block_table("b"), bm.block_table("a"))

  def test_negative_count_is_refused(self):
    bm = self._forked_with_spare_page(3)
    with self.assertRaisesRegex(ValueError, r"num_tokens=-1 must be >= 0"):
      bm.reserve("b", -1)

  def test_non_int_count_is_refused_and_changes_nothing(self):
    bm = BlockManager(num_pages=8, page_size=4)
    bm.admit("a", [1, 2, 3, 4])
    bm.mark_computed("a")
    for bad in (1.5, 2.0, True, "2", None, np.float32(1)):
      with self.assertRaisesRegex(ValueError, rf"num_tokens={re.escape(repr(bad))} is not an int"):
        bm.reserve("a", bad)
      self.assertEqual((bm.block_table("a"), bm.num_free_pages), ((1,), 6))
    growth = bm.reserve("a", np.int64(2))   # positions 4, 5: a new page
    self.assertEqual(len(growth.new_pages), 1)
    bm.check_invariants()

  def test_shared_page_past_the_new_tokens_stays_shared(self):
    bm = self._forked_with_spare_page(3)
    a0, a1 = bm.block_table("a")
    growth = bm.reserve("b", 1)          # writes position 3: page 0 only
    b0, b1 = bm.block_table("b")
    self.assertEqual(growth, Growth(((a0, b0),), ()))
    self.assertEqual(b1, a1)
    self.assertEqual(bm.refcount(a1), 2)
    bm.check_invariants()

  def test_both_written_pages_are_replaced_only_the_filled_one_copied(self):
    bm = self._forked_with_spare_page(3)
    a0, a1 = bm.block_table("a")
    growth = bm.reserve("b", 2)          # positions 3 and 4: pages 0 and 1
    b0, b1 = bm.block_table("b")
    self.assertNotIn(b1, (a0, a1))
    self.assertEqual(growth, Growth(((a0, b0),), ()))   # page 1 holds no token yet: no copy
    bm.check_invariants()

  def test_an_empty_shared_page_at_the_page_boundary_is_not_copied(self):
    bm = self._forked_with_spare_page(4)  # page 0 full, page 1 empty
    a0, a1 = bm.block_table("a")
    growth = bm.reserve("b", 1)           # position 4: page 1
    self.assertEqual(growth, Growth((), ()))
    self.assertEqual(bm.block_table("b")[0], a0)
    self.assertNotEqual(bm.block_table("b")[1], a1)
    bm.check_invariants()


class HashChainTest(absltest.TestCase):

  def test_a_page_hits_only_after_the_same_prefix(self):
    bm = BlockManager(num_pages=12, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    # Same second page, different first page: the chain differs, so nothing is shared.
    self.assertEqual(bm.admit("b", [9, 9, 3, 4, 5]).num_cached_tokens, 0)
    bm.check_invariants()

  def test_manager_hashes_follow_page_hash(self):
    # The salt keys the first page; every page's hash chains to its parent's.
    bm = BlockManager(num_pages=12, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5], adapter_id="lora", cache_salt="s")
    h0 = page_hash(None, [1, 2], ("lora", "s"))
    h1 = page_hash(h0, [3, 4], ("lora",))
    self.assertEqual(bm._seqs["a"].hashes, [h0, h1])

  def test_hash_depends_on_values_not_integer_width(self):
    ids = [1, 2 ** 20]
    self.assertEqual(page_hash(None, np.asarray(ids, np.int32)), page_hash(None, ids))
    self.assertNotEqual(page_hash(None, [1, 2]), page_hash(None, [2, 1]))

  def test_mark_computed_offers_each_page_once(self):
    # a and b compute the same page independently; b's copy stays unregistered (block tables are
    # append-only), and stays so after a's copy is evicted: mark_computed offers only new pages.
    bm = BlockManager(num_pages=6, page_size=2)
    bm.admit("a", [1, 2, 3])
    bm.admit("b", [1, 2, 4])
    bm.mark_computed("a")
    bm.mark_computed("b")
    pa, pb = bm.block_table("a")[0], bm.block_table("b")[0]
    self.assertTrue(bm.is_cached(pa))
    self.assertFalse(bm.is_cached(pb))
    bm.free("a")
    bm.admit("x", range(100, 106))        # 3 pages: the free ones, then evicts pa
    self.assertFalse(bm.is_cached(pa))
    bm.append_tokens("b", [5])
    bm.mark_computed("b")
    self.assertFalse(bm.is_cached(pb))
    bm.check_invariants()

  def test_mark_computed_at_the_current_count_is_allowed(self):
    bm = BlockManager(num_pages=6, page_size=2)
    bm.admit("a", [1, 2, 3])
    bm.mark_computed("a", 2)
    bm.mark_computed("a", 2)
    self.assertEqual(bm.num_computed("a"), 2)

  def test_pages_restored_by_swap_in_re_enter_the_cache(self):
    bm = BlockManager(num_pages=5, page_size=2)
    _computed(bm, "a", [1, 2, 3, 4, 5])
    bm.swap_out("a")                      # its two full pages go cached-idle
    bm.admit("x", range(100, 108))        # takes every page: the cached ones are evicted
    bm.free("x")
    bm.swap_in("a")
    self.assertFalse(any(bm.is_cached(p) for p in bm.block_table("a")))
    bm.mark_computed("a")                 # the restored copies are offered to the cache again
    self.assertEqual([bm.is_cached(p) for p in bm.block_table("a")], [True, True, False])
    self.assertEqual(bm.admit("b", [1, 2, 3, 4, 6]).num_cached_tokens, 4)
    bm.check_invariants()


class ConstructorAndMessagesTest(absltest.TestCase):
  """Boundary arguments are accepted; every refusal names the bad value."""

  def test_smallest_pool_and_page(self):
    bm = BlockManager(num_pages=2, page_size=1)
    self.assertEqual(bm.admit("a", [7]).block_table, (1,))
    with self.assertRaisesRegex(ValueError, r"num_pages=1 must be >= 2 \(page 0 is NULL_PAGE\)"):
      BlockManager(num_pages=1, page_size=1)
    with self.assertRaisesRegex(ValueError, r"page_size=0 must be >= 1"):
      BlockManager(num_pages=2, page_size=0)

  def test_released_pages_are_tracked_only_on_request(self):
    bm = BlockManager(num_pages=4, page_size=2)
    _computed(bm, "a", [1, 2, 3])
    bm.free("a")
    self.assertEqual(bm.drain_released(), [])

  def test_evicted_pages_are_reported_released(self):
    bm = BlockManager(num_pages=3, page_size=2, track_released=True)
    _computed(bm, "a", [1, 2, 3])          # page 1 full (cached), page 2 partial
    bm.free("a")                           # 2 -> free list; 1 -> cached-idle
    self.assertEqual(bm.drain_released(), [2])
    bm.admit("b", range(10, 14))           # takes 2, then evicts 1
    self.assertEqual(bm.drain_released(), [1])

  def test_token_id_errors_name_the_sequence_and_the_id(self):
    bm = BlockManager(num_pages=6, page_size=2)
    with self.assertRaisesRegex(ValueError, r"^sequence 'a': token id 1.5 is not an int$"):
      bm.admit("a", [1, 1.5])
    with self.assertRaisesRegex(ValueError, r"^sequence 'a': token id True is not an int$"):
      bm.admit("a", [True])
    with self.assertRaisesRegex(ValueError,
                                r"^sequence 'a': token id 9223372036854775808 is outside"):
      bm.admit("a", [2 ** 63])
    self.assertEqual(bm.admit("a", [2 ** 63 - 1]).block_table, (1,))
    with self.assertRaisesRegex(ValueError, r"^sequence 'a': token id -1 is outside \[0, 2\*\*63\)"):
      bm.append_tokens("a", [-1])
    self.assertEqual(bm.num_tokens("a"), 1)

  def test_resume_without_tokens(self):
    bm = BlockManager(num_pages=6, page_size=2)
    _computed(bm, "a", [1, 2, 3])
    bm.preempt_recompute("a")
    with self.assertRaisesRegex(ValueError, r"resuming sequence 'a' needs its 3 tokens; got None"):
      bm.admit("a", None, resume=True)
    with self.assertRaisesRegex(ValueError, r"needs its 3 tokens; got 2"):
      bm.admit("a", [1, 2], resume=True)
    with self.assertRaisesRegex(ValueError, r"^sequence 'a' is preempted, not running$"):
      bm.append_tokens("a", [4])

  def test_group_ids(self):
    bm = BlockManager(num_pages=8, page_size=2)
    _computed(bm, ("req", 0), [1, 2, 3])   # a tuple is one sequence id, not a group
    self.assertEqual(bm.swap_out(("req", 0)).pages, (1, 2))
    self.assertEqual(bm.status(("req", 0)), SeqStatus.SWAPPED)
    with self.assertRaises(UnknownSequenceError):
      bm.swap_out(99)
    _computed(bm, "b", [1])
    with self.assertRaisesRegex(ValueError, r"sequence ids \['b', 'b'\] repeat"):
      bm.swap_out(["b", "b"])
    bm.check_invariants()


class CheckInvariantsTest(absltest.TestCase):
  """The checker catches each kind of corrupted state, with the message that names it."""

  def setUp(self):
    super().setUp()
    # a: pages 1 (full, cached) and 2; b shares page 1; c finished: its full page 3 cached-idle.
    self.bm = BlockManager(num_pages=8, page_size=2)
    _computed(self.bm, "a", [1, 2, 3])
    _computed(self.bm, "b", [1, 2, 4])
    _computed(self.bm, "c", [7, 8, 9])
    self.bm.free("c")
    self.bm.check_invariants()
    self.idle = self.bm.cached_idle_pages()[0]
    self.free = self.bm._free[0]

  def assertBroken(self, message):
    with self.assertRaisesRegex(AssertionError, message):
      self.bm.check_invariants()

  def test_null_page_in_a_block_table(self):
    self.bm._seqs["a"].block_table[1] = 0
    self.bm._refs[2] -= 1
    self.bm._free.append(2)
    self.assertBroken("^NULL_PAGE is in a block table$")

  def test_null_page_refcount(self):
    self.bm._refs[0] = 1
    self.assertBroken("^NULL_PAGE has a refcount$")

  def test_refcount_disagrees_with_tables(self):
    self.bm._refs[2] += 1
    self.assertBroken("\nrefcount != block-table references\n")   # NumPy's report, our line

  def test_page_twice_in_the_free_list(self):
    self.bm._free.append(self.free)
    self.assertBroken("^a page is in the free list twice$")

  def test_null_page_allocatable(self):
    self.bm._free.append(0)
    self.assertBroken("^NULL_PAGE is allocatable$")
    self.bm._free.pop()
    self.bm._idle[0] = None
    self.assertBroken("^NULL_PAGE is allocatable$")

  def test_page_in_two_states(self):
    for corrupt, undo in (
        (lambda: self.bm._idle.__setitem__(self.free, None), lambda: self.bm._idle.pop(self.free)),
        (lambda: self.bm._free.append(2), lambda: self.bm._free.pop()),
        (lambda: self.bm._idle.__setitem__(2, None), lambda: self.bm._idle.pop(2))):
      corrupt()
      self.assertBroken("^a page is in two states$")
      undo()
      self.bm.check_invariants()

  def test_page_lost(self):
    self.bm._free.remove(self.free)
    self.assertBroken("^a page is lost or leaked$")

  def test_idle_page_without_hash(self):
    self.bm._free.remove(self.free)
    self.bm._idle[self.free] = None
    self.assertBroken("^a cached-idle page has no hash$")

  def test_free_page_with_hash(self):
    self.bm._page_to_hash[self.free] = b"h"
    self.bm._hash_to_page[b"h"] = self.free
    self.assertBroken("^a free page still has a hash$")

  def test_hash_maps_disagree(self):
    h = self.bm._page_to_hash[self.idle]
    self.bm._hash_to_page[h] = 1
    self.assertBroken("^hash maps disagree$")
    self.bm._hash_to_page[h] = self.idle
    self.bm._hash_to_page[b"stale"] = self.idle
    self.assertBroken("^hash maps disagree$")


class BaselineAllocatorTest(absltest.TestCase):

  def test_reservations(self):
    self.assertEqual([baselines.reservation(p, 300, 2048) for p in baselines.POLICIES],
                     [2048, 512, 300])
    self.assertEqual(baselines.reservation("pow2", 256, 2048), 256)

  def test_seed_contiguous_waste(self):
    # 25, 47, 12 tokens reserving 2,048 each: 6,144 slots for 84 tokens.
    alloc = baselines.ContiguousAllocator(8192, "max", 2048)
    for i, n in enumerate((25, 47, 12)):
      self.assertTrue(alloc.admit(i, n, n))
    self.assertEqual(alloc.stats()["reserved_token_slots"], 6144)
    self.assertEqual(alloc.stats()["stored_tokens"], 84)

  def test_external_fragmentation(self):
    # Free extents of 1,500 and 800 cannot hold one 2,048-slot request (the seeds' example).
    alloc = baselines.ContiguousAllocator(4348, "oracle", 4096)
    for seq_id, n in (("x", 1500), ("live1", 1024), ("y", 800), ("live2", 1024)):
      self.assertTrue(alloc.admit(seq_id, n, n))
    alloc.free("x")
    alloc.free("y")
    self.assertEqual(alloc.stats()["free_token_slots"], 2300)
    self.assertFalse(alloc.admit("big", 2048, 2048))
    bm = BlockManager(num_pages=1 + 2300 // 16, page_size=16)   # paged: any free page will do
    self.assertIsNotNone(bm.admit("big", range(2048)))


class BlockManagerMachine(stateful.RuleBasedStateMachine):
  """Random admit / append / fork / free / preempt / swap-out / swap-in / reset sequences."""

  def __init__(self):
    super().__init__()
    self.bm = BlockManager(num_pages=13, page_size=4)
    self.next_id = 0
    self.tokens = {}   # the manager keeps no token ids; the caller (the Sequence) owns them

  def _ids(self, status):
    return sorted(s for s in list(self.bm._seqs) if self.bm.status(s) is status)

  @stateful.rule(n=st.integers(1, 20), shared=st.booleans())
  def admit(self, n, shared):
    tokens = list(range(n)) if shared else [self.next_id * 1000 + t for t in range(n)]
    if self.bm.admit(self.next_id, tokens) is not None:
      self.bm.mark_computed(self.next_id)
      self.tokens[self.next_id] = tokens
    self.next_id += 1

  @stateful.rule(data=st.data(), n=st.integers(1, 6))
  def append(self, data, n):
    running = self._ids(SeqStatus.RUNNING)
    if running:
      s = data.draw(st.sampled_from(running))
      if self.bm.append_tokens(s, [s] * n) is not None:
        self.bm.mark_computed(s)
        self.tokens[s] = self.tokens[s] + [s] * n

  @stateful.rule(data=st.data(), bad=st.one_of(
      st.floats(allow_nan=True), st.booleans(), st.text(max_size=2), st.none()))
  def reserve_bad_count(self, data, bad):
    running = self._ids(SeqStatus.RUNNING)
    if running:
      s = data.draw(st.sampled_from(running))
      before = (self.bm.block_table(s), self.bm.num_free_pages)
      try:
        self.bm.reserve(s, bad)
      except ValueError:
        pass
      else:
        raise AssertionError(f"reserve({s}, {bad!r}) was accepted")
      assert (self.bm.block_table(s), self.bm.num_free_pages) == before

  @stateful.rule(data=st.data())
  def fork(self, data):
    running = self._ids(SeqStatus.RUNNING)
    if running:
      parent = data.draw(st.sampled_from(running))
      self.bm.fork(parent, self.next_id)
      self.tokens[self.next_id] = list(self.tokens[parent])
      self.next_id += 1

  @stateful.rule(data=st.data())
  def free(self, data):
    ids = sorted(self.bm._seqs)
    if ids:
      self.bm.free(data.draw(st.sampled_from(ids)))

  @stateful.rule(data=st.data())
  def preempt(self, data):
    running = self._ids(SeqStatus.RUNNING)
    if running:
      self.bm.preempt_recompute(data.draw(st.sampled_from(running)))

  @stateful.rule(data=st.data())
  def resume(self, data):
    preempted = self._ids(SeqStatus.PREEMPTED)
    if preempted:
      s = data.draw(st.sampled_from(preempted))
      if self.bm.admit(s, self.tokens[s], resume=True) is not None:
        self.bm.mark_computed(s)

  @stateful.rule(data=st.data())
  def swap_out(self, data):
    running = self._ids(SeqStatus.RUNNING)
    if running:
      self.bm.swap_out(data.draw(st.sampled_from(running)))

  @stateful.rule(data=st.data())
  def swap_in(self, data):
    swapped = self._ids(SeqStatus.SWAPPED)
    if swapped:
      self.bm.swap_in(data.draw(st.sampled_from(swapped)))

  @stateful.rule()
  def reset(self):
    try:
      self.bm.reset_prefix_cache()
    except RuntimeError:
      pass   # pages in use: refused, and nothing may have changed (checked below)

  @stateful.invariant()
  def invariants_hold(self):
    self.bm.check_invariants()
    for s in self.bm._seqs:
      assert self.bm.num_tokens(s) == len(self.tokens[s]), s

  def teardown(self):
    for s in list(self.bm._seqs):
      self.bm.free(s)
    self.bm.check_invariants()
    stats = self.bm.stats()
    assert stats["pages_free"] + stats["pages_cached_idle"] == self.bm.num_pages - 1


BlockManagerMachine.TestCase.settings = hypothesis.settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True)
TestBlockManagerProperties = BlockManagerMachine.TestCase


if __name__ == "__main__":
  absltest.main()
