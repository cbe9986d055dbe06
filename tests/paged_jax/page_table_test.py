"""The on-device PageTable (issue 12): unit cases, and a hypothesis state machine that drives the
same operations through it and the host BlockManager (prefix caching off) and checks after every
step that they agree: which sequences hold pages, how many tokens, which entries share a page,
refcounts, free counts, and which allocations fail. Page ids may differ (the device reuses
freed pages last-in first-out, the host first-in first-out), so tables are compared through a
page-id mapping that must stay one-to-one."""

from absl.testing import absltest
import chex
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import page_table as ptm
from paged_jax.host.block_manager import BlockManager
from paged_jax.state import NULL_PAGE

NUM_PAGES, PAGE_SIZE, MAX_SEQS, WIDTH = 12, 2, 5, 8
_grow = jax.jit(ptm.grow)
_admit = jax.jit(ptm.admit)
_fork = jax.jit(ptm.fork)
_free = jax.jit(ptm.free)


def one_hot(i):
  return jnp.arange(MAX_SEQS) == i


def per_seq(i, n):
  return jnp.where(one_hot(i), n, 0).astype(jnp.int32)


class PageTableTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.pt = ptm.PageTable.create(NUM_PAGES, PAGE_SIZE, MAX_SEQS, WIDTH)

  def test_admit_grow_cow_free(self):
    pt = _admit(self.pt, one_hot(0), per_seq(0, 3))   # 3 tokens: pages 1, 2 (2 partial)
    np.testing.assert_array_equal(pt.block_tables[0, :3], [1, 2, NULL_PAGE])
    pt = _fork(pt, jnp.array([0]), jnp.array([1]), jnp.array([True]))
    self.assertEqual(int(pt.refcounts[2]), 2)
    pt, src, dst = _grow(pt, per_seq(1, 1))           # writes into shared page 2: copy it
    self.assertEqual((int(src[1]), int(dst[1])), (2, 3))
    np.testing.assert_array_equal(pt.block_tables[1, :2], [1, 3])
    np.testing.assert_array_equal(pt.refcounts[:4], [0, 2, 1, 1])
    pt, src, dst = _grow(pt, per_seq(0, 2))           # 3 -> 5 tokens: page 2 is private now
    self.assertTrue((np.asarray(src) == NULL_PAGE).all())
    np.testing.assert_array_equal(pt.block_tables[0, :3], [1, 2, 4])
    pt = _free(pt, one_hot(0))
    np.testing.assert_array_equal(pt.refcounts[:5], [0, 1, 0, 1, 0])
    ptm.check_invariants(pt)
    self.assertEqual(int(pt.num_free), NUM_PAGES - 1 - 2)
    # The last page freed is reused first (a stack).
    pt = _admit(pt, one_hot(2), per_seq(2, 1))
    self.assertEqual(int(pt.block_tables[2, 0]), 4)

  def test_of_three_sharers_two_copy(self):
    pt = _admit(self.pt, one_hot(0), per_seq(0, 3))   # page 2 partial
    pt = _fork(pt, jnp.array([0, 0]), jnp.array([1, 2]), jnp.array([True, True]))
    self.assertEqual(int(pt.refcounts[2]), 3)
    pt, src, dst = _grow(pt, jnp.array([1, 1, 1, 0, 0], jnp.int32))
    np.testing.assert_array_equal(src, [2, 2, NULL_PAGE, NULL_PAGE, NULL_PAGE])
    self.assertEqual(int(pt.refcounts[2]), 1)         # the last sharer keeps it
    np.testing.assert_array_equal(pt.block_tables[:3, 1], [dst[0], dst[1], 2])
    ptm.check_invariants(pt)

  def test_overflow_changes_nothing(self):
    pt = _admit(self.pt, one_hot(0), per_seq(0, 16))   # 8 of the 11 pages
    before = jax.tree_util.tree_leaves(pt)
    pt2, src, dst = _grow(pt, per_seq(0, 8))           # 4 more pages, 3 free: refused
    self.assertTrue(bool(pt2.overflow[0]))
    for a, b in zip(before, jax.tree_util.tree_leaves(pt2.replace(overflow=pt.overflow))):
      np.testing.assert_array_equal(a, b)
    # Another sequence that fits still gets its pages (first fit, slot order).
    pt3 = _admit(pt2, one_hot(1) | one_hot(2), jnp.array([0, 7, 5, 0, 0], jnp.int32))
    self.assertFalse(bool(pt3.active[1]))   # 4 pages: does not fit
    self.assertTrue(bool(pt3.overflow[1]))
    self.assertTrue(bool(pt3.active[2]))    # 3 pages: fits after 1 failed
    ptm.check_invariants(pt3)
    self.assertNotIn(NULL_PAGE, np.asarray(pt3.block_tables[2, :3]))

  def test_a_table_row_never_overflows_into_another(self):
    pt = _admit(self.pt, one_hot(0), per_seq(0, 2 * WIDTH))   # fills its row exactly
    pt, _, _ = _grow(pt, per_seq(0, 1))
    self.assertTrue(bool(pt.overflow[0]))
    self.assertEqual(int(pt.seq_lens[0]), 2 * WIDTH)
    ptm.check_invariants(pt)

  def test_jit_traces_once(self):
    grow = jax.jit(chex.assert_max_traces(ptm.grow, n=1))
    pt = _admit(self.pt, one_hot(0), per_seq(0, 1))
    for n in range(1, 6):
      pt, _, _ = grow(pt, per_seq(0, n))
    self.assertEqual(int(pt.seq_lens[0]), 16)


@settings(max_examples=60, stateful_step_count=30, deadline=None,
          suppress_health_check=list(HealthCheck))
class Differential(RuleBasedStateMachine):
  """The same operations on both allocators (host ids = device slots)."""

  def __init__(self):
    super().__init__()
    self.pt = ptm.PageTable.create(NUM_PAGES, PAGE_SIZE, MAX_SEQS, WIDTH)
    self.bm = BlockManager(NUM_PAGES, PAGE_SIZE, enable_prefix_caching=False)

  def _fits_row(self, n):
    return n <= WIDTH * PAGE_SIZE

  @rule(i=st.integers(0, MAX_SEQS - 1), n=st.integers(1, 9))
  def admit(self, i, n):
    if i in self.bm:
      return
    host = self.bm.admit(i, [1] * n)
    self.pt = _admit(self.pt, one_hot(i), per_seq(i, n))
    assert (host is not None) == bool(self.pt.active[i]), (host, n)
    assert bool(self.pt.overflow[i]) == (host is None)

  @rule(i=st.integers(0, MAX_SEQS - 1), n=st.integers(1, 5))
  def grow(self, i, n):
    if i not in self.bm:
      return
    if not self._fits_row(self.bm.num_tokens(i) + n):
      return   # the host's tables have no width; the device refuses (tested above)
    host = self.bm.append_tokens(i, [1] * n)
    self.pt, src, dst = _grow(self.pt, per_seq(i, n))
    assert (host is not None) == (not bool(self.pt.overflow[i])), (host, n)
    self.pt = self.pt.replace(overflow=self.pt.overflow & False)
    copies = [(int(s), int(d)) for s, d in zip(src, dst) if s != NULL_PAGE]
    assert len(copies) == (len(host.copies) if host else 0), (copies, host)
    if host and copies:
      self._pair(copies[0][0], host.copies[0][0])
      self._pair(copies[0][1], host.copies[0][1])

  @rule(ns=st.lists(st.integers(0, 3), min_size=MAX_SEQS, max_size=MAX_SEQS))
  def grow_all(self, ns):
    # One device call for every sequence; the host in slot order (the device's first fit).
    ns = [n if i in self.bm and self._fits_row(self.bm.num_tokens(i) + n) else 0
          for i, n in enumerate(ns)]
    host = {i: self.bm.append_tokens(i, [1] * n) for i, n in enumerate(ns) if n}
    self.pt, src, dst = _grow(self.pt, jnp.asarray(ns, jnp.int32))
    for i, h in host.items():
      assert (h is not None) == (not bool(self.pt.overflow[i])), (i, h)
      assert (int(src[i]) != NULL_PAGE) == bool(h and h.copies), (i, h, src)
    self.pt = self.pt.replace(overflow=self.pt.overflow & False)

  @rule(p=st.integers(0, MAX_SEQS - 1), c=st.integers(0, MAX_SEQS - 1))
  def fork(self, p, c):
    if p not in self.bm or c in self.bm:
      return
    self.bm.fork(p, c)
    self.pt = _fork(self.pt, jnp.array([p]), jnp.array([c]), jnp.array([True]))

  @rule(i=st.integers(0, MAX_SEQS - 1))
  def free(self, i):
    if i not in self.bm:
      return
    self.bm.free(i)
    self.pt = _free(self.pt, one_hot(i))

  def _pair(self, dev, host):
    self.mapping = getattr(self, "mapping", {})
    self.inverse = getattr(self, "inverse", {})
    assert self.mapping.setdefault(dev, host) == host, ("device page maps to two host pages",
                                                        dev, host, self.mapping[dev])
    assert self.inverse.setdefault(host, dev) == dev, ("host page maps to two device pages",
                                                       host, dev, self.inverse[host])

  @invariant()
  def agree(self):
    ptm.check_invariants(self.pt)
    self.bm.check_invariants()
    assert int(self.pt.num_free) == self.bm.num_free_pages
    tables, lens = np.asarray(self.pt.block_tables), np.asarray(self.pt.seq_lens)
    refs = np.asarray(self.pt.refcounts)
    # The mapping is rebuilt each step: pages are reused, so only the current one-to-one
    # correspondence matters.
    self.mapping, self.inverse = {}, {}
    for i in range(MAX_SEQS):
      assert bool(self.pt.active[i]) == (i in self.bm), i
      if i not in self.bm:
        continue
      assert int(lens[i]) == self.bm.num_tokens(i)
      host_table = self.bm.block_table(i)
      n = len(host_table)
      assert (tables[i, n:] == NULL_PAGE).all()
      for dev, host in zip(tables[i, :n].tolist(), host_table):
        self._pair(dev, host)
        assert refs[dev] == self.bm.refcount(host), (dev, host)


class DifferentialTest(Differential.TestCase):
  pass


if __name__ == "__main__":
  absltest.main()
