"""KVPool, write_kv, the KV-bytes formula."""

import warnings

from absl.testing import absltest
import chex
import jax.numpy as jnp
import numpy as np

from paged_jax import KVPool, NULL_PAGE, kv_cache_bytes, page_ops, write_kv
from paged_jax.host import addressing


class KVPoolTest(absltest.TestCase):

  def test_seed_kv_bytes_formula(self):
    # 32 layers, 4,096 tokens, 8 KV heads, 128 dims, 2-byte numbers: 512 MiB.
    self.assertEqual(kv_cache_bytes(num_layers=32, num_tokens=4096, num_kv_heads=8, head_dim=128,
                                    bytes_per_element=2), 536_870_912)
    pool = KVPool.create(num_layers=32, num_pages=2, page_size=1, num_kv_heads=8, head_dim=128,
                         dtype=jnp.bfloat16)
    self.assertEqual(pool.bytes_per_token * 4096, 536_870_912)

  def test_pool_is_frozen_and_shape_derived(self):
    pool = KVPool.create(num_layers=2, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8)
    self.assertEqual((pool.num_layers, pool.num_pages, pool.page_size, pool.num_kv_heads,
                      pool.head_dim), (2, 5, 4, 2, 8))
    with self.assertRaises(Exception):
      pool.k = pool.v

  def test_create_rejects_bad_sizes(self):
    with self.assertRaisesRegex(ValueError, "num_pages=1 must be >= 2"):
      KVPool.create(num_layers=1, num_pages=1, page_size=4, num_kv_heads=1, head_dim=8)
    with self.assertRaisesRegex(ValueError, "page_size=0"):
      KVPool.create(num_layers=1, num_pages=4, page_size=0, num_kv_heads=1, head_dim=8)

  def test_write_kv_scatters_by_slot_into_one_layer(self):
    pool = KVPool.create(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    table = [3, 1]
    positions = [0, 4, 5]
    slots = addressing.slots_for_positions(table, positions, page_size=4)
    np.testing.assert_array_equal(slots, [12, 4, 5])
    k = jnp.arange(6.0).reshape(3, 1, 2)
    pool = write_kv(pool, 1, k, -k, jnp.asarray(slots))
    expected = np.zeros((2, 4, 4, 1, 2), np.float32)
    expected[1, 3, 0] = k[0]
    expected[1, 1, 0] = k[1]
    expected[1, 1, 1] = k[2]
    chex.assert_trees_all_equal(pool.stacked(), (jnp.asarray(expected), -jnp.asarray(expected)))

  def test_write_kv_casts_to_the_pool_dtype(self):
    # f32 K/V into a bf16 pool: cast explicitly (JAX warns, and will refuse, on a scatter that
    # narrows implicitly), rounded as bf16 rounds.
    pool = KVPool.create(num_layers=1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=1,
                         dtype=jnp.bfloat16)
    k = jnp.full((1, 1, 1), 1.0 + 2.0 ** -9, jnp.float32)   # not representable in bf16
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      pool = write_kv(pool, 0, k, -k, jnp.array([2], jnp.int32))
    kp, vp = pool.stacked()
    rounded = float(k.astype(jnp.bfloat16)[0, 0, 0])
    self.assertEqual((kp.dtype, vp.dtype), (jnp.bfloat16, jnp.bfloat16))
    self.assertEqual((float(kp[0, 1, 0, 0, 0]), float(vp[0, 1, 0, 0, 0])), (rounded, -rounded))
    self.assertNotEqual(rounded, float(k[0, 0, 0]))

  def test_write_kv_rejects_bad_layer_and_shapes(self):
    pool = KVPool.create(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    k = jnp.zeros((2, 1, 2))
    with self.assertRaisesRegex(ValueError, "layer=1 is outside"):
      write_kv(pool, 1, k, k, jnp.zeros(2, jnp.int32))
    pool = KVPool.create(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=2)
    with self.assertRaises(AssertionError):
      write_kv(pool, 0, k, k, jnp.zeros(3, jnp.int32))


class SwapPagesTest(absltest.TestCase):

  def test_read_write_round_trip_pads_counts_to_a_power_of_two(self):
    pool = KVPool.create(num_layers=2, num_pages=9, page_size=2, num_kv_heads=1, head_dim=3)
    rng = np.random.default_rng(0)
    pool = pool.replace(k=jnp.asarray(rng.normal(size=pool.k.shape), pool.dtype),
                        v=jnp.asarray(rng.normal(size=pool.v.shape), pool.dtype))
    before = [np.asarray(x) for x in (*pool.k, *pool.v)]
    k, v = page_ops.read_pages(pool, [5, 2, 7])
    self.assertEqual(k.shape, (2, 3, 2, 1, 3))
    np.testing.assert_array_equal(k[1, 0], before[1][5])
    np.testing.assert_array_equal(v[0, 2], before[2][7])
    pool = page_ops.write_pages(pool, [1, 3, 4], k, v)        # 3 pages: padded to 4
    after = [np.asarray(x) for x in (*pool.k, *pool.v)]
    for i in range(4):
      np.testing.assert_array_equal(after[i][[1, 3, 4]], before[i][[5, 2, 7]])
      np.testing.assert_array_equal(after[i][[2, 5, 6, 7, 8]], before[i][[2, 5, 6, 7, 8]])
    compiled = page_ops._write._cache_size()
    k4, v4 = page_ops.read_pages(pool, [1, 2, 3, 4])
    pool = page_ops.write_pages(pool, [5, 6, 7, 8], k4, v4)   # 4 pages: the same program
    self.assertEqual(page_ops._write._cache_size(), compiled)
    with self.assertRaisesRegex(ValueError, r"does not match 2 pages"):
      page_ops.write_pages(pool, [1, 2], k, v)


def _random_pool(seed=0, **kw):
  """A pool whose every element is distinct random data (so a copy to the wrong page shows)."""
  pool = KVPool.create(**kw)
  rng = np.random.default_rng(seed)
  return pool.replace(k=jnp.asarray(rng.normal(size=pool.k.shape), pool.dtype),
                      v=jnp.asarray(rng.normal(size=pool.v.shape), pool.dtype))


class PageOpsTest(absltest.TestCase):
  """copy_pages (copy-on-write), check_copy_batch, zero_pages (scrub), the swap padding."""

  def test_copy_pages_copies_every_layer_k_and_v_and_nothing_else(self):
    pool = _random_pool(num_layers=2, num_pages=6, page_size=2, num_kv_heads=1, head_dim=3)
    before = [np.asarray(x) for x in (*pool.k, *pool.v)]
    pool = page_ops.copy_pages(pool, jnp.array([4, 1], jnp.int32), jnp.array([2, 5], jnp.int32))
    after = [np.asarray(x) for x in (*pool.k, *pool.v)]
    for b, a in zip(before, after):
      np.testing.assert_array_equal(a[[2, 5]], b[[4, 1]])
      np.testing.assert_array_equal(a[[0, 1, 3, 4]], b[[0, 1, 3, 4]])

  def test_copy_pages_rejects_mismatched_shapes(self):
    pool = KVPool.create(num_layers=1, num_pages=4, page_size=2, num_kv_heads=1, head_dim=1)
    with self.assertRaisesRegex(ValueError, r"src \(2,\) and dst \(1,\) must be equal 1-D"):
      page_ops.copy_pages(pool, jnp.array([1, 2]), jnp.array([3]))
    with self.assertRaisesRegex(ValueError, r"src \(1, 1\) and dst \(1, 1\)"):
      page_ops.copy_pages(pool, jnp.array([[1]]), jnp.array([[3]]))

  def test_check_copy_batch(self):
    page_ops.check_copy_batch([1, 2, 0, 0], [3, 4, 0, 0])   # NULL_PAGE -> NULL_PAGE padding: fine
    page_ops.check_copy_batch([1, 1], [3, 4])                # one source, two copies: fine
    page_ops.check_copy_batch([], [])
    with self.assertRaisesRegex(AssertionError,
                                r"writes page\(s\) \[3\] twice: \[\(1, 3\), \(2, 3\)\]"):
      page_ops.check_copy_batch([1, 2], [3, 3])
    with self.assertRaisesRegex(AssertionError, r"^copy batch writes page\(s\) \[3\] twice: "):
      page_ops.check_copy_batch([1, 5, 2], [3, 4, 3])   # only the page written twice is named
    with self.assertRaisesRegex(AssertionError, r"reads and writes page\(s\) \[3\]: "
                                r"\[\(1, 3\), \(3, 4\)\]"):
      page_ops.check_copy_batch([1, 3], [3, 4])
    with self.assertRaisesRegex(AssertionError, r"writes NULL_PAGE: \[\(2, 0\)\]"):
      page_ops.check_copy_batch([2], [NULL_PAGE])
    with self.assertRaisesRegex(AssertionError, r"reads and writes page\(s\) \[0\]"):
      page_ops.check_copy_batch([0, 2], [3, 0])   # NULL_PAGE is ignored only as a padding pair

  def test_zero_pages_scrubs_only_those_pages(self):
    pool = _random_pool(num_layers=2, num_pages=5, page_size=2, num_kv_heads=2, head_dim=2)
    before = [np.asarray(x) for x in (*pool.k, *pool.v)]
    pool = page_ops.zero_pages(pool, jnp.array([3, 1], jnp.int32))
    for b, a in zip(before, [np.asarray(x) for x in (*pool.k, *pool.v)]):
      np.testing.assert_array_equal(a[[1, 3]], 0.0)
      np.testing.assert_array_equal(a[[0, 2, 4]], b[[0, 2, 4]])

  def test_swap_counts_pad_to_a_power_of_two(self):
    self.assertEqual([page_ops._padded(n) for n in (1, 2, 3, 4, 5, 8, 9)],
                     [1, 2, 4, 4, 8, 8, 16])

  def test_write_pages_casts_and_pads_with_zeros_into_null_page(self):
    pool = _random_pool(num_layers=1, num_pages=4, page_size=1, num_kv_heads=1, head_dim=1,
                        dtype=jnp.bfloat16)
    k = np.full((1, 3, 1, 1, 1), 1.0 + 2.0 ** -9, np.float32)   # not representable in bf16
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      pool = page_ops.write_pages(pool, [1, 2, 3], k, -k)     # 3 pages: one padding row
    rounded = float(jnp.asarray(k).astype(jnp.bfloat16)[0, 0, 0, 0, 0])
    self.assertNotEqual(rounded, float(k[0, 0, 0, 0, 0]))
    kp, vp = pool.stacked()
    self.assertEqual(kp.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(kp[0, 1:], np.float32), rounded)
    np.testing.assert_array_equal(np.asarray(vp[0, 1:], np.float32), -rounded)
    np.testing.assert_array_equal(np.asarray(kp[0, NULL_PAGE], np.float32), 0.0)   # the padding
    with self.assertRaisesRegex(ValueError, r"v shape \(1, 2, 1, 1, 1\) does not match 3 pages "
                                r"of a pool of shape \(1, 4, 1, 1, 1\): "
                                r"expected \(1, 3, 1, 1, 1\)"):
      page_ops.write_pages(pool, [1, 2, 3], k, k[:, :2])


class AddressingTest(absltest.TestCase):

  def test_seed_token_37(self):
    # 16-token pages: token 37 is logical page 2, offset 5; table [0, 5, 9] sends it to page 9.
    self.assertEqual(addressing.locate([0, 5, 9], 37, page_size=16), (9, 5))
    self.assertEqual(addressing.slots_for_positions([0, 5, 9], [37], 16).tolist(), [9 * 16 + 5])

  def test_seed_toy_table(self):
    # Four tokens per page, table [9, 2, 14]: token 6 is logical page 1, slot 2, physical page 2.
    self.assertEqual(addressing.locate([9, 2, 14], 6, page_size=4), (2, 2))
    self.assertEqual(addressing.locate([9, 2, 14], 9, page_size=4), (14, 1))

  def test_os_paging_example(self):
    # 4,096-byte pages: address 5,000 is page 1 offset 904; frame 9 gives 37,768.
    self.assertEqual(addressing.slots_for_positions([0, 9], [5000], 4096).tolist(), [37_768])

  def test_pages_needed(self):
    self.assertEqual([addressing.pages_needed(n, 16) for n in (25, 47, 12, 0, 16, 17)],
                     [2, 3, 1, 0, 1, 2])

  def test_out_of_range(self):
    with self.assertRaisesRegex(ValueError, "position=48 is past"):
      addressing.locate([1, 2, 3], 48, page_size=16)
    with self.assertRaisesRegex(ValueError, "outside the block table's capacity of 48"):
      addressing.slots_for_positions([1, 2, 3], [3, 48], page_size=16)
    self.assertEqual(NULL_PAGE, 0)


if __name__ == "__main__":
  absltest.main()
