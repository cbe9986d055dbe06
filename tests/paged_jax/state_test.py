"""KVPool, write_kv, the KV-bytes formula."""

import warnings

from absl.testing import absltest
import chex
import jax.numpy as jnp
import numpy as np

from paged_jax import KVPool, NULL_PAGE, kv_cache_bytes, write_kv
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
    from paged_jax import page_ops
    pool = KVPool.create(num_layers=2, num_pages=9, page_size=2, num_kv_heads=1, head_dim=3)
    rng = np.random.default_rng(0)
    pool = pool.replace(k=tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in pool.k),
                        v=tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in pool.v))
    before = [np.asarray(x) for x in pool.k + pool.v]
    k, v = page_ops.read_pages(pool, [5, 2, 7])
    self.assertEqual(k.shape, (2, 3, 2, 1, 3))
    np.testing.assert_array_equal(k[1, 0], before[1][5])
    np.testing.assert_array_equal(v[0, 2], before[2][7])
    pool = page_ops.write_pages(pool, [1, 3, 4], k, v)        # 3 pages: padded to 4
    after = [np.asarray(x) for x in pool.k + pool.v]
    for i in range(4):
      np.testing.assert_array_equal(after[i][[1, 3, 4]], before[i][[5, 2, 7]])
      np.testing.assert_array_equal(after[i][[2, 5, 6, 7, 8]], before[i][[2, 5, 6, 7, 8]])
    compiled = page_ops._write._cache_size()
    k4, v4 = page_ops.read_pages(pool, [1, 2, 3, 4])
    pool = page_ops.write_pages(pool, [5, 6, 7, 8], k4, v4)   # 4 pages: the same program
    self.assertEqual(page_ops._write._cache_size(), compiled)
    with self.assertRaisesRegex(ValueError, r"do not match 2 pages"):
      page_ops.write_pages(pool, [1, 2], k, v)


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
