"""The CPU lowering rules the model's speed rests on, asserted on the compiled program (never by
timing): the matmul dispatcher (`paged_jax.matmul`), RoPE tables computed once, and which jaxlib
converts a bf16 pool on every KV write (`engine.slow_narrow_kv_writes`). Values are checked
against the plain ops."""

import re

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import config, engine, kv_write, matmul, model, rope, testing

_DIMS = (((1,), (0,)), ((), ()))


def _operands(m, k, n, dtype, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(m, k)), dtype), jnp.asarray(rng.normal(size=(k, n)), dtype))


def _hlo(fn, *args):
  return jax.jit(fn).lower(*args).compile().as_text()


class DotGeneralTest(parameterized.TestCase):

  def test_f32_is_lax_dot_general(self):
    x, w = _operands(5, 24, 7, jnp.float32)
    chex.assert_trees_all_equal(matmul.dot_general(x, w, _DIMS),
                                jax.lax.dot_general(x, w, _DIMS))

  @parameterized.parameters(1, 2, 6)
  def test_bf16_is_the_f32_product_rounded_once(self, rows):
    x, w = _operands(rows, 96, 40, jnp.bfloat16, seed=rows)
    got = matmul.dot_general(x, w, _DIMS)
    self.assertEqual(got.dtype, jnp.bfloat16)
    self.assertEqual(got.shape, (rows, 40))
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)   # exact products, f32 sums
    # One rounding to bf16 (8 mantissa bits: relative 2^-8), plus f32 summation order.
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2 ** -8, atol=1e-5)

  def test_one_row_equals_that_row_of_a_two_row_product(self):
    x, w = _operands(2, 64, 48, jnp.bfloat16, seed=3)
    chex.assert_trees_all_equal(matmul.dot_general(x[:1], w, _DIMS),
                                matmul.dot_general(x, w, _DIMS)[:1])

  def test_bf16_weights_are_not_converted_and_one_row_is_padded(self):
    # The speed rules themselves. A bf16 -> bf16 dot compiles to converts of both operands to
    # f32 (a copy of the whole weight, every call) and an f32 dot; bf16 -> f32 reads them as
    # they are. And the single row becomes two.
    x, w = _operands(1, 64, 48, jnp.bfloat16)
    hlo = _hlo(lambda x, w: matmul.dot_general(x, w, _DIMS), x, w)
    self.assertNotIn("f32[64,48]", hlo)
    self.assertRegex(hlo, r"f32\[2,48\]\S* (dot|fusion)\(")
    plain = _hlo(lambda x, w: jax.lax.dot_general(x, w, _DIMS), x, w)
    self.assertIn("f32[64,48]", plain)   # the check above can see a converted weight

  def test_explicit_preferred_type_is_passed_through(self):
    x, w = _operands(3, 16, 8, jnp.bfloat16)
    got = matmul.dot_general(x, w, _DIMS, preferred_element_type=jnp.float32)
    self.assertEqual(got.dtype, jnp.float32)

  def test_matmul_keeps_leading_axes(self):
    x = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4)
    w = jnp.ones((4, 5), jnp.float32)
    chex.assert_trees_all_equal(matmul.matmul(x, w), x @ w)


class RopeTablesTest(absltest.TestCase):

  def test_rotate_equals_the_rotate_half_formula(self):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(11, 3, 16)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 500, 11), jnp.int32)
    inv_freq, _ = rope.frequencies(16, 10_000.0, None, 2048)
    emb = np.concatenate([np.asarray(positions)[:, None] * inv_freq] * 2, axis=-1)[:, None]
    x1, x2 = np.split(np.asarray(x), 2, axis=-1)
    ref = np.asarray(x) * np.cos(emb) + np.concatenate([-x2, x1], axis=-1) * np.sin(emb)
    np.testing.assert_allclose(rope.apply(x, positions, inv_freq), ref, rtol=1e-5, atol=1e-5)
    cos, sin = rope.tables(positions, inv_freq, 0.5)
    np.testing.assert_allclose(rope.rotate(x, cos, sin), 0.5 * ref, rtol=1e-5, atol=1e-5)

  def test_decoder_computes_each_rope_table_once(self):
    # 4 layers share one RoPE: one sine and one cosine table per step, not one per layer (XLA
    # fuses unshared producers into every consumer; model.computed_once stops it).
    cfg = config.tiny_config(num_layers=4)
    params = testing.random_params(cfg, seed=0)
    tokens = jnp.arange(7, dtype=jnp.int32)
    kv = model.DenseKV(jnp.zeros((4, 1, 8, cfg.num_kv_heads, cfg.head_dim)),
                       jnp.zeros((4, 1, 8, cfg.num_kv_heads, cfg.head_dim)),
                       jnp.zeros(7, jnp.int32), tokens, jnp.array([7], jnp.int32),
                       jnp.array([0, 7], jnp.int32), max_q_len=7)
    hlo = _hlo(lambda p, t, kv: model.Decoder(cfg).apply({"params": p}, t, t, kv)[0],
               params, tokens, kv)
    # Both branches of the conditional hold the tables: 2 of each, whatever the layer count.
    self.assertEqual(len(re.findall(r" cosine\(", hlo)), 2)
    self.assertEqual(len(re.findall(r" sine\(", hlo)), 2)

  def test_computed_once_is_fn(self):
    chex.assert_trees_all_equal(model.computed_once(lambda a: (a * 2, a + 1), jnp.arange(3)),
                                (jnp.arange(3) * 2, jnp.arange(3) + 1))


class NarrowKVWriteTest(absltest.TestCase):

  def test_the_version_rule_matches_the_compiled_write(self):
    pages = jnp.zeros((37, 4, 2, 8), jnp.bfloat16)
    x = jnp.ones((3, 2, 8), jnp.bfloat16)
    hlo = _hlo(kv_write.write_kv_layer, pages, x, jnp.array([5, 9, 30], jnp.int32))
    converts_pool = "f32[37,4,2,8]" in hlo
    self.assertEqual(engine.slow_narrow_kv_writes(jnp.bfloat16), converts_pool)
    self.assertFalse(engine.slow_narrow_kv_writes(jnp.float32))


if __name__ == "__main__":
  absltest.main()
