"""The CPU lowering rules the model's speed rests on, asserted on the compiled program (never by
timing): the matmul dispatcher (`paged_jax.matmul`), RoPE tables computed once, and which jaxlib
converts a bf16 pool on every KV write (`engine.slow_narrow_kv_writes`). Values are checked
against the plain ops."""

import itertools
import re
from unittest import mock

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import config, engine, kv_write, matmul, model, rope, testing
from paged_jax.config import CacheConfig
from paged_jax.sampling import SamplingParams

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


class LibraryCases:
  """What every library backend must do (mixed into one TestCase per backend): products equal to
  float64 NumPy, the same columns on one thread and two, leading axes and empty shapes, and the
  model and engine matching XLA's dot. Skipped where the backend's extra is not installed,
  saying why, except where its PAGED_JAX_REQUIRE_* variable is 1 (.ci/run's jax 0.12 stage)."""
  backend = ""
  require = False

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.reason = matmul.unavailable_reason(cls.backend)

  def setUp(self):
    super().setUp()
    if self.reason and self.require:
      self.fail(f"the {self.backend} matmul is required here but cannot run: {self.reason}")
    if self.reason:
      self.skipTest(self.reason)
    # Every product goes to the library here (oneDNN's routing rules are tested on their own).
    self.enter_context(mock.patch.object(matmul, "ONEDNN_MIN_ROWS", 1))
    self.enter_context(mock.patch.object(matmul, "ONEDNN_TAKES_TRANSPOSED", True))

  def dot(self, x, w, dims=_DIMS, **kw):
    fn = matmul.for_backend(self.backend)
    return jax.jit(lambda x, w: fn(x, w, dims, **kw))(x, w)

  def test_f32_equals_the_float64_product(self):
    # n=333: column blocks that are not a multiple of 16; 1024: split over both threads.
    for rows, n, transpose in itertools.product((1, 3, 17), (8, 333, 1024), (False, True)):
      with self.subTest(rows=rows, n=n, transpose=transpose):
        x, w = _operands(rows, 40, n, jnp.float32, seed=rows * n)
        rhs, dims = (w.T, (((1,), (1,)), ((), ()))) if transpose else (w, _DIMS)
        got = self.dot(x, jnp.asarray(np.asarray(rhs)), dims)
        self.assertEqual((got.dtype, got.shape), (jnp.float32, (rows, n)))
        self.assertIn(_LIBRARY_TARGETS[self.backend],
                      _hlo(lambda x, w: matmul.for_backend(self.backend)(x, w, dims), x,
                           jnp.asarray(np.asarray(rhs))))
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

  def test_one_thread_and_two_give_the_same_product(self):
    x, w = _operands(5, 64, 700, jnp.float32, seed=1)
    two = self.dot(x, w)
    with mock.patch.object(matmul, "MIN_COLUMNS_PER_THREAD", 0):   # 0: the caller alone
      one = self.dot(x, w)
    chex.assert_trees_all_equal(one, two)   # the same columns, each computed once either way

  def test_leading_axes_and_empty_shapes(self):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(8, 5)), jnp.float32)
    got = self.dot(x, w, (((2,), (0,)), ((), ())))
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
    self.assertEqual(self.dot(jnp.zeros((0, 8)), w).shape, (0, 5))
    chex.assert_trees_all_equal(self.dot(jnp.ones((3, 0)), jnp.ones((0, 5))), jnp.zeros((3, 5)))

  def test_what_it_does_not_take_is_xla_s_dot_exactly(self):
    # Batch dims, an explicit output type, integers: dot_general itself, no custom call.
    cases = [(*_operands(3, 16, 8, jnp.float32), _DIMS, dict(preferred_element_type=jnp.float32)),
             (jnp.arange(12, dtype=jnp.int32).reshape(3, 4), jnp.ones((4, 2), jnp.int32), _DIMS,
              {})]
    batched = jnp.ones((2, 3, 4), jnp.float32)
    cases.append((batched, batched.transpose(0, 2, 1), (((2,), (1,)), ((0,), (0,))), {}))
    fn = matmul.for_backend(self.backend)
    for x, w, dims, kw in cases:
      f = lambda x, w: fn(x, w, dims, **kw)   # noqa: E731
      chex.assert_trees_all_equal(jax.jit(f)(x, w), matmul.dot_general(x, w, dims, **kw))
      self.assertNotIn(_LIBRARY_TARGETS[self.backend], _hlo(f, x, w))

  def test_model_and_engine_match_xla(self):
    # The tied head ([n, k]) and every projection through the library: logits within f32
    # summation order of XLA's, and the same greedy tokens through the engine.
    cfg = config.tiny_config(tie_embeddings=True)
    params = testing.random_params(cfg, seed=5)
    tokens = np.arange(1, 12, dtype=np.int32)
    logits, outs = {}, {}
    for backend in ("xla", self.backend):
      c = config.tiny_config(tie_embeddings=True, matmul=backend)
      logits[backend] = testing.dense_logits(params, c, tokens)
      e = engine.Engine(params, c, cache=CacheConfig(page_size=4, num_pages=40))
      got = e.generate([[3, 4, 5], [9, 8, 7, 6, 5, 4]], SamplingParams(max_tokens=6,
                                                                       ignore_eos=True))
      outs[backend] = [o.outputs[0].token_ids for o in got]
    np.testing.assert_allclose(logits[self.backend], logits["xla"], rtol=1e-5, atol=1e-5)
    self.assertEqual(outs[self.backend], outs["xla"])


_LIBRARY_TARGETS = {"mkl": matmul.MKL_TARGET, "onednn": matmul.ONEDNN_TARGET}


class MklTest(LibraryCases, parameterized.TestCase):
  """`matmul.mkl_dot_general`: LibraryCases, and MKL's own routing of bf16 (the `mkl` extra;
  PAGED_JAX_REQUIRE_MKL=1 in .ci/run's jax 0.12 stage)."""
  backend = "mkl"
  require = testing.REQUIRE_MKL

  @mock.patch.object(matmul, "cpu_vendor", return_value="GenuineIntel")
  def test_bf16_one_row_is_the_f32_product_rounded_once(self, _):
    x, w = _operands(1, 96, 300, jnp.bfloat16, seed=4)
    got = self.dot(x, w)
    self.assertEqual(got.dtype, jnp.bfloat16)
    self.assertIn(matmul.MKL_TARGET, _hlo(lambda x, w: matmul.mkl_dot_general(x, w, _DIMS), x, w))
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2 ** -8, atol=1e-5)

  def test_off_intel_bf16_stays_on_xla_and_f32_goes_to_mkl(self):
    # MKL's generic kernels (what it runs on an AMD CPU) were 20x XLA on the one-row bf16 head.
    fn = lambda x, w: matmul.mkl_dot_general(x, w, _DIMS)   # noqa: E731
    xb, wb = _operands(1, 32, 24, jnp.bfloat16)
    xf, wf = _operands(1, 32, 24, jnp.float32)
    with mock.patch.object(matmul, "cpu_vendor", return_value="AuthenticAMD"):
      self.assertNotIn(matmul.MKL_TARGET, _hlo(fn, xb, wb))
      chex.assert_trees_all_equal(jax.jit(fn)(xb, wb), matmul.dot_general(xb, wb, _DIMS))
      self.assertIn(matmul.MKL_TARGET, _hlo(fn, xf, wf))

  @parameterized.parameters(1, 5, 33)
  def test_mkl_matmul_takes_bf16_at_any_rows(self, rows):
    # The raw call (matmul_floor's mkl_bf16 route) has no routing rule: bf16 at many rows too.
    x, w = _operands(rows, 64, 300, jnp.bfloat16, seed=rows)
    got = jax.jit(matmul.mkl_matmul)(x, w)
    self.assertEqual((got.dtype, got.shape), (jnp.float32, (rows, 300)))
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)   # exact products
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)    # f32 summation order

  def test_engine_warns_where_mkl_is_likely_slow(self):
    params = testing.random_params(config.tiny_config(), seed=0)
    cache = CacheConfig(page_size=4, num_pages=8)
    for vendor, warned in (("AuthenticAMD", True), ("GenuineIntel", False)):
      with mock.patch.object(matmul, "cpu_vendor", return_value=vendor), \
           self.assertLogs(level="INFO") as logs:
        engine.Engine(params, config.tiny_config(matmul="mkl"), cache=cache)
      text = "\n".join(logs.output)
      self.assertEqual(f"'{vendor}', not GenuineIntel" in text, warned, text)

  def test_bf16_at_more_rows_is_xla_s_dot_exactly(self):
    # MKL's bf16 product at 2-32 rows was measured no faster than XLA's (YNNPACK).
    x, w = _operands(4, 32, 24, jnp.bfloat16)
    fn = lambda x, w: matmul.mkl_dot_general(x, w, _DIMS)   # noqa: E731
    chex.assert_trees_all_equal(jax.jit(fn)(x, w), matmul.dot_general(x, w, _DIMS))
    self.assertNotIn(matmul.MKL_TARGET, _hlo(fn, x, w))

  def test_decode_round_bench_times_each_backend(self):
    from experiments import decode_round_bench
    r = decode_round_bench.run(decode_round_bench.RoundConfig(
        prompt_tokens=20, steps_per_sync=2, rows=(1,), items_per_chunk=(0,), rounds=1,
        matmul=("xla", "mkl"), impl="cpu"))
    self.assertEqual([x["matmul"] for x in r["rows"]], ["xla", "mkl"])
    self.assertTrue(all(x["ms_per_step"] > 0 for x in r["rows"]))
    self.assertIn("attention impl cpu", decode_round_bench.format_result(r))


class OnednnTest(LibraryCases, parameterized.TestCase):
  """`matmul.onednn_dot_general`: LibraryCases, and bf16 at any row count (the `onednn` extra;
  PAGED_JAX_REQUIRE_ONEDNN=1 in .ci/run's jax 0.12 stage)."""
  backend = "onednn"
  require = testing.REQUIRE_ONEDNN

  @parameterized.parameters(1, 5, 33)
  def test_bf16_is_the_f32_product_rounded_once(self, rows):
    x, w = _operands(rows, 96, 300, jnp.bfloat16, seed=rows)
    got = self.dot(x, w)
    self.assertEqual((got.dtype, got.shape), (jnp.bfloat16, (rows, 300)))
    self.assertIn(matmul.ONEDNN_TARGET,
                  _hlo(lambda x, w: matmul.onednn_dot_general(x, w, _DIMS), x, w))
    ref = np.asarray(x, np.float32) @ np.asarray(w, np.float32)   # exact products
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2 ** -8, atol=1e-4)

  def test_fewer_rows_than_the_minimum_stay_on_xla_s_dot(self):
    fn = lambda x, w: matmul.onednn_dot_general(x, w, _DIMS)   # noqa: E731
    with mock.patch.object(matmul, "ONEDNN_MIN_ROWS", 16):
      for rows, dtype in itertools.product((1, 15, 16, 40), (jnp.float32, jnp.bfloat16)):
        x, w = _operands(rows, 32, 24, dtype, seed=rows)
        self.assertEqual(matmul.ONEDNN_TARGET in _hlo(fn, x, w), rows >= 16, (rows, dtype))
        if rows < 16:
          chex.assert_trees_all_equal(jax.jit(fn)(x, w), matmul.dot_general(x, w, _DIMS))

  def test_the_transposed_head_stays_on_xla_s_dot(self):
    dims = (((1,), (1,)), ((), ()))
    head = lambda x, w: matmul.onednn_dot_general(x, w, dims)   # noqa: E731
    plain = lambda x, w: matmul.onednn_dot_general(x, w, _DIMS)   # noqa: E731
    with mock.patch.object(matmul, "ONEDNN_TAKES_TRANSPOSED", False):
      for dtype in (jnp.float32, jnp.bfloat16):
        x, w = _operands(32, 24, 40, dtype, seed=3)
        self.assertNotIn(matmul.ONEDNN_TARGET, _hlo(head, x, w.T))
        chex.assert_trees_all_equal(jax.jit(head)(x, w.T), matmul.dot_general(x, w.T, dims))
        self.assertIn(matmul.ONEDNN_TARGET, _hlo(plain, x, w))   # the same product, [k, n]


class OnednnPackedTest(parameterized.TestCase):
  """Packed weights (`matmul.onednn_pack`, `onednn_packed_matmul`, `model.pack_for_onednn`): what
  `matmul="onednn"` engines run. Skipped where the `onednn` extra is not installed, saying why,
  except under PAGED_JAX_REQUIRE_ONEDNN=1."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.reason = matmul.unavailable_reason("onednn")

  def setUp(self):
    super().setUp()
    if self.reason and testing.REQUIRE_ONEDNN:
      self.fail(f"the onednn matmul is required here but cannot run: {self.reason}")
    if self.reason:
      self.skipTest(self.reason)

  def packed(self, x, w, transpose=False):
    n = w.shape[0] if transpose else w.shape[1]
    p = matmul.onednn_pack(w, transpose=transpose)
    return jax.jit(lambda x, p: matmul.onednn_packed_matmul(x, p, n))(x, p)

  def test_products_equal_the_float64_product(self):
    # rows 40: split by rows (2 x MIN_ROWS_PER_THREAD and more); n=333: a partial column block;
    # 1024: split by columns; k=48: a partial block of k (bf16 packs k in 32s).
    for dtype, rows, k, n in itertools.product((jnp.float32, jnp.bfloat16), (1, 3, 17, 40),
                                               (40, 48), (8, 333, 1024)):
      with self.subTest(dtype=dtype.__name__, rows=rows, k=k, n=n):
        x, w = _operands(rows, k, n, dtype, seed=rows * n + k)
        got = self.packed(x, w)
        self.assertEqual((got.dtype, got.shape), (jnp.float32, (rows, n)))
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)   # exact products of bf16
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(got, self.packed(x, w.T, transpose=True))

  def test_one_f32_row_on_xla_s_batched_dot_equals_the_float64_product(self):
    # k=40 / 100: k padded to 48 / 112 in the layout; n=333: a partial column block.
    for k, n in itertools.product((40, 100, 576), (8, 333, 1536)):
      with self.subTest(k=k, n=n):
        x, w = _operands(1, k, n, jnp.float32, seed=k + n)
        got = matmul.packed_row_on_xla(x, matmul.onednn_pack(w), n)
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    self.assertIsNone(matmul.packed_column_blocks(jnp.bfloat16, 576, 1536))   # pairs of rows

  def test_packed_dot_takes_xla_s_batched_dot_for_one_f32_row_only(self):
    call = f'custom_call_target="{matmul.ONEDNN_PACKED_TARGET}"'
    cases = [  # (rows, dtype, n, stacked, whether oneDNN's call runs it)
        (1, jnp.float32, 96, False, False), (2, jnp.float32, 96, False, True),
        (1, jnp.bfloat16, 96, False, True), (1, jnp.float32, 96, True, True),
        (1, jnp.float32, matmul.PACKED_ROW_ON_XLA_MAX_COLUMNS + 64, False, True)]
    for rows, dtype, n, stacked, on_onednn in cases:
      with self.subTest(rows=rows, dtype=dtype.__name__, n=n, stacked=stacked):
        x, w = _operands(rows, 40, n, dtype, seed=rows)
        p = matmul.onednn_pack(w)
        args = (x, jnp.stack([p, p]), 1) if stacked else (x, p, None)
        fn = lambda x, p, layer=args[2]: matmul.onednn_packed_dot(x, p, n, layer)
        self.assertEqual(call in _hlo(fn, *args[:2]), on_onednn)
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(jax.jit(fn)(*args[:2]), np.float64), ref,
                                   rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-1
                                   if dtype == jnp.bfloat16 else 1e-4)   # bf16: the cast out
    with mock.patch.object(matmul, "PACKED_ROW_ON_XLA", False):
      x, w = _operands(1, 40, 96, jnp.float32)
      self.assertIn(call, _hlo(lambda x, p: matmul.onednn_packed_dot(x, p, 96), x,
                               matmul.onednn_pack(w)))

  def test_two_threads_running_one_primitive_at_once_agree(self):
    # Each pool thread passes its own scratchpad: with oneDNN's shared one, bf16 products with a
    # partial block of k split between the threads went wrong (max error ~50) now and then.
    x, w = _operands(300, 48, 200, jnp.bfloat16, seed=7)
    p = matmul.onednn_pack(w)
    fn = jax.jit(lambda x, p: matmul.onednn_packed_matmul(x, p, 200))
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    for _ in range(20):
      np.testing.assert_allclose(fn(x, p), ref, rtol=1e-5, atol=1e-4)

  def test_threads_by_rows_by_columns_or_one_give_the_same_product(self):
    x, w = _operands(64, 96, 700, jnp.float32, seed=1)
    results = {}
    for name, rows, cols in (("one", 0, 0), ("columns", 0, matmul.MIN_COLUMNS_PER_THREAD),
                             ("rows", matmul.MIN_ROWS_PER_THREAD, 0)):
      with mock.patch.object(matmul, "MIN_ROWS_PER_THREAD", rows), \
           mock.patch.object(matmul, "MIN_COLUMNS_PER_THREAD", cols):
        results[name] = self.packed(x, w)
    chex.assert_trees_all_equal(results["one"], results["columns"])
    chex.assert_trees_all_equal(results["one"], results["rows"])

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_a_stack_of_packed_weights_multiplies_by_the_layer_it_is_given(self, dtype):
    ws = [_operands(5, 40, 80, dtype, seed=s)[1] for s in range(3)]
    x = _operands(5, 40, 80, dtype, seed=9)[0]
    stack = jnp.stack([matmul.onednn_pack(w) for w in ws])
    for i, w in enumerate(ws):   # a Python int and a traced scalar, as a scan passes it
      want = matmul.onednn_packed_matmul(x, matmul.onednn_pack(w), 80)
      chex.assert_trees_all_equal(matmul.onednn_packed_matmul(x, stack, 80, layer=i), want)
      traced = jax.jit(lambda x, s, i: matmul.onednn_packed_matmul(x, s, 80, layer=i))
      chex.assert_trees_all_equal(traced(x, stack, jnp.int32(i)), want)

  @parameterized.product(dtype=(jnp.float32, jnp.bfloat16),
                         rows_valid=((64, 52), (64, 17), (64, 0), (64, 99), (160, 148), (4, 3)))
  def test_valid_rows_multiplies_the_real_rows_and_zeros_the_rest(self, dtype, rows_valid):
    # 52 and 148 round up to 56 and 152 rows multiplied (the zeros past 52 are written after).
    m, valid = rows_valid
    x, w = _operands(m, 96, 200, dtype, seed=m + valid)
    stack = jnp.stack([matmul.onednn_pack(w * 2), matmul.onednn_pack(w)])
    want = np.asarray(matmul.onednn_packed_matmul(x, matmul.onednn_pack(w), 200))
    run = jax.jit(lambda x, s, v: matmul.onednn_packed_matmul(x, s, 200, layer=1, valid_rows=v))
    got = np.asarray(run(x, stack, jnp.int32(valid)))
    real = min(valid, m)
    np.testing.assert_array_equal(got[:real], want[:real])
    np.testing.assert_array_equal(got[real:], np.zeros_like(got[real:]))
    with self.assertRaisesRegex(ValueError, "valid_rows=-2 is negative"):
      matmul.onednn_packed_matmul(x, matmul.onednn_pack(w), 200, valid_rows=-2)

  @parameterized.parameters((False, None), (True, None), (False, 8))
  def test_an_engine_s_packed_products_skip_the_bucket_s_padding(self, scan_layers, mlp_chunk):
    # A 9-token prompt step pads to 16 token rows: its products get the real count, and every
    # logprob is the same as with every row multiplied (rows are independent). With MLP chunks
    # of 8 rows, each chunk's products get their share (`matmul.padding_slice`).
    if mlp_chunk:
      self.enter_context(mock.patch.object(model, "MLP_CHUNK_TOKENS", mlp_chunk))
    cfg = config.tiny_config(matmul="onednn")
    params = testing.random_params(cfg, seed=6)
    sp = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=0)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4]]
    outs = {}
    for skip in (False, True):
      jax.clear_caches()   # the steps are module-level jits: trace them again under the switch
      with mock.patch.object(model, "PACKED_SKIPS_PADDING", skip), \
           mock.patch.object(matmul, "onednn_packed_matmul",
                             wraps=matmul.onednn_packed_matmul) as call:
        e = engine.Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=40),
                          scan_layers=scan_layers)
        got = e.generate(prompts, sp)
      outs[skip] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in got]
      counted = [c for c in call.call_args_list if len(c.args) > 4 and c.args[4] is not None]
      if skip:
        # the prompt step's [16, k] products (and [8, k] chunks), given their real count
        self.assertIn(16, {c.args[0].shape[0] for c in counted})
        if mlp_chunk:
          self.assertIn(mlp_chunk, {c.args[0].shape[0] for c in counted})
      else:
        self.assertEmpty(counted)
    self.assertEqual(outs[True], outs[False])

  def test_a_scanned_model_reads_its_packed_stacks_in_place(self):
    """Every packed product inside the scan's body takes the whole stack and the layer index: a
    sliced operand would be a copy of the layer's weights before each call (the old body)."""
    cfg = config.tiny_config(num_layers=3, matmul="onednn")
    params = model.pack_for_onednn(model.stack_layers(testing.random_params(cfg, seed=4), cfg),
                                   cfg)
    tokens = np.arange(1, 9, dtype=np.int32)
    hlo = jax.jit(lambda p: testing.dense_forward(p, cfg, tokens)).lower(params).compile().as_text()
    calls = [line for line in hlo.splitlines()
             if f'custom_call_target="{matmul.ONEDNN_PACKED_TARGET}"' in line]
    in_body = [c for c in calls if "/while/body/" in c]
    self.assertLen(in_body, 7, "\n".join(calls))   # a layer's 7 projections, once
    for call in in_body:   # x, the weight (the [reps, elements] stack itself), layer, rows
      self.assertRegex(call, r"operand_layout_constraints=\{f32\[[\d,]+\]\{1,0\}, "
                             r"f32\[\d+,\d+\]\{1,0\}, s32\[\], s32\[\]\}")
    unrolled = testing.random_params(cfg, seed=4)
    np.testing.assert_allclose(
        testing.dense_logits(params, cfg, tokens),
        testing.dense_logits(model.pack_for_onednn(unrolled, cfg), cfg, tokens),
        rtol=1e-6, atol=1e-6)

  def test_oneDNN_runs_its_own_kernel_not_its_reference_code(self):
    for dtype, rows in itertools.product((jnp.float32, jnp.bfloat16), (1, 16, 4560)):
      self.assertNotIn("ref", matmul.onednn_packed_impl(dtype, rows, 576, 1536), (dtype, rows))

  def test_bad_input_is_refused_by_name(self):
    x, w = _operands(4, 40, 64, jnp.float32)
    p = matmul.onednn_pack(w)
    with self.assertRaisesRegex(ValueError, r"packed has \d+ bytes a layer; .* \[40, 65\]"):
      matmul.onednn_packed_matmul(x, p, 65)
    stack = jnp.stack([p, p])
    with self.assertRaisesRegex(ValueError, "takes a layer"):
      matmul.onednn_packed_matmul(x, stack, 64)
    with self.assertRaisesRegex(ValueError, "takes a layer and a single one does not"):
      matmul.onednn_packed_matmul(x, p, 64, layer=0)
    with self.assertRaisesRegex(ValueError, r"layer=2 is not in \[0, 2\)"):
      matmul.onednn_packed_matmul(x, stack, 64, layer=2)
    # A traced layer outside the stack is refused when the product runs, by the C++ handler.
    run = jax.jit(lambda i: matmul.onednn_packed_matmul(x, stack, 64, layer=i))
    with self.assertRaisesRegex(Exception, r"layer -1 is not in \[0, 2\)"):
      jax.block_until_ready(run(-1))
    chex.assert_trees_all_equal(run(1), matmul.onednn_packed_matmul(x, p, 64))   # still usable
    with self.assertRaisesRegex(ValueError, "of its dtype"):
      matmul.onednn_packed_matmul(x.astype(jnp.bfloat16), p, 64)
    with self.assertRaisesRegex(ValueError, "int32"):
      matmul.onednn_pack(jnp.ones((4, 8), jnp.int32))

  @parameterized.parameters(False, True)
  def test_an_onednn_engine_packs_every_projection_and_the_tied_head(self, scan_layers):
    cfg = config.tiny_config(tie_embeddings=True, matmul="onednn")
    params = testing.random_params(cfg, seed=5)
    e = engine.Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=40),
                      scan_layers=scan_layers)
    paths = ["/".join(str(getattr(k, "key", k)) for k in path)
             for path, _ in jax.tree_util.tree_flatten_with_path(e.params)[0]]
    self.assertTrue(model.is_packed(e.params))
    self.assertEqual([p for p in paths if p.endswith("/kernel")], [])
    self.assertIn("embed_tokens/" + model.PACKED_ATTEND, paths)
    ref = engine.Engine(params, config.tiny_config(tie_embeddings=True),
                        cache=CacheConfig(page_size=4, num_pages=40), scan_layers=scan_layers)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4]]
    self.assertEqual([o.outputs[0].token_ids for o in e.generate(prompts, sp)],
                     [o.outputs[0].token_ids for o in ref.generate(prompts, sp)])
    # One sequence decodes one row: its products on single packed weights take XLA's batched
    # dot on the packed blocks (`matmul.packed_row_on_xla`; a scan's stacks, oneDNN's call).
    with mock.patch.object(matmul, "packed_row_on_xla", wraps=matmul.packed_row_on_xla) as row:
      self.assertEqual(e.generate(prompts[1:], sp)[0].outputs[0].token_ids,
                       ref.generate(prompts[1:], sp)[0].outputs[0].token_ids)
    self.assertGreater(row.call_count, 0)

  def saved_model(self) -> str:
    """A tiny tied-head Llama saved in Hugging Face's format by our own writer (no torch: the
    jax 0.12 stage of .ci/run has none)."""
    import shutil, tempfile
    from paged_jax import checkpoint
    path = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, path)
    cfg = config.tiny_config(tie_embeddings=True)
    checkpoint.save_checkpoint(testing.random_params(cfg, seed=3), cfg, path)
    return path

  def test_the_benches_run_packed_weights(self):
    from experiments import decode_round_bench, profile_step, serve_bench
    with mock.patch.object(model, "pack_for_onednn", wraps=model.pack_for_onednn) as pack:
      r = decode_round_bench.run(decode_round_bench.RoundConfig(
          prompt_tokens=20, steps_per_sync=2, rows=(1,), items_per_chunk=(0,), rounds=1,
          matmul=("xla", "onednn"), impl="cpu"))
    self.assertEqual([x["matmul"] for x in r["rows"]], ["xla", "onednn"])
    self.assertEqual(pack.call_count, 1)
    r = profile_step.run(profile_step.ProfileConfig(serve_bench.BenchConfig(
        preset="tiny", vocab_size=64, num_requests=3, min_prompt=4, max_prompt=20, new_tokens=5,
        page_size=4, steps_per_sync=2), repeats=1, matmul="onednn"), self.saved_model())
    for kind in ("prefill", "decode"):   # the packed products' custom calls, by module
      for part in ("mlp", "q/k/v/o projections", "lm head"):
        self.assertGreater(r[kind].get(part, 0), 0, (kind, part, r[kind]))

  def test_latency_bench_runs_a_packed_engine_beside_xla_s(self):
    from experiments import latency_bench
    r = latency_bench.run(latency_bench.LatencyConfig(
        preset="tiny", users=(2,), engines=("paged_jax", "paged_jax_onednn"), max_position=64,
        results_dir=None), self.saved_model(), progress=lambda *_: None)
    self.assertEqual(r["identical_tokens"], {"2 users": True})
    self.assertGreater(r["tpot_p50_paged_jax_onednn_over_paged_jax"]["2 users"], 0)

  def test_packed_logits_match_xla_s(self):
    cfg = config.tiny_config(tie_embeddings=False, matmul="onednn", attention_bias=True)
    params = testing.random_params(cfg, seed=2)
    tokens = np.arange(1, 12, dtype=np.int32)
    packed = model.pack_for_onednn(params, cfg)
    self.assertIn(model.PACKED_KERNEL, packed["lm_head"])
    got = testing.dense_logits(packed, cfg, tokens)
    want = testing.dense_logits(params, config.tiny_config(tie_embeddings=False,
                                                           attention_bias=True), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


class PaddingRowsTest(absltest.TestCase):
  """`matmul.padding_rows` and its helpers: the count each product of a traced step sees."""

  def test_slices_rebase_the_count_and_other_row_counts_see_none(self):
    value = lambda: matmul._PADDING.__dict__.get("value")   # noqa: E731
    self.assertIsNone(value())
    with matmul.padding_slice(16, 0, 8):   # outside padding_rows: nothing to rebase
      self.assertIsNone(value())
    with matmul.padding_rows(16, jnp.int32(9)):
      self.assertEqual((value()[0], int(value()[1])), (16, 9))
      for (start, stop), want in (((0, 8), 8), ((8, 16), 1), ((4, 12), 5), ((10, 16), 0)):
        with matmul.padding_slice(16, start, stop):
          self.assertEqual((value()[0], int(value()[1])), (stop - start, want))
      with matmul.padding_slice(32, 0, 8):   # a chunk of some other rows: unchanged
        self.assertEqual(value()[0], 16)
      with matmul.every_row():
        self.assertIsNone(value())
        with matmul.padding_slice(16, 0, 8):
          self.assertIsNone(value())
      self.assertEqual(value()[0], 16)
    self.assertIsNone(value())


class LibraryRefusalTest(parameterized.TestCase):
  """What runs without the libraries: bad names, a missing extra, an engine that cannot have
  one."""

  def test_bad_backend_names_are_refused_by_name(self):
    with self.assertRaisesRegex(ValueError, "matmul='blas'"):
      config.tiny_config(matmul="blas")
    with self.assertRaisesRegex(ValueError, "matmul='blas' is not one of"):
      matmul.for_backend("blas")

  def test_a_missing_extra_is_named(self):
    from importlib import metadata
    with mock.patch.object(metadata, "files", side_effect=metadata.PackageNotFoundError("mkl")):
      self.assertEqual(matmul.mkl_build_flags(),
                       "Intel MKL is not installed ('mkl': pip install -e .[mkl])")
    missing = metadata.PackageNotFoundError("onednn-cpu-gomp")
    with mock.patch.object(metadata, "files", side_effect=missing):
      self.assertEqual(matmul.onednn_build_flags(), "oneDNN is not installed "
                       "('onednn-cpu-gomp': pip install -e .[onednn])")
    with mock.patch.object(metadata, "files", return_value=[]):   # installed, but no files
      self.assertRegex(matmul.onednn_build_flags(), r"lack \['libdnnl.so', 'oneapi/dnnl/dnnl.hpp'\]")

  def test_cpu_vendor_is_read_from_proc_cpuinfo(self):
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    with mock.patch("builtins.open", mock.mock_open(read_data=text)):
      self.assertEqual(matmul.cpu_vendor(), "AuthenticAMD")
    with mock.patch("builtins.open", mock.mock_open(read_data="processor\t: 0\n")):
      self.assertEqual(matmul.cpu_vendor(), "")
    with mock.patch("builtins.open", side_effect=OSError("no /proc")):
      self.assertEqual(matmul.cpu_vendor(), "")

  def test_mkl_slow_reason_names_a_maker_other_than_intel(self):
    self.assertIsNone(matmul.mkl_slow_reason("GenuineIntel"))
    self.assertIn("'AuthenticAMD', not GenuineIntel", matmul.mkl_slow_reason("AuthenticAMD"))
    self.assertIn("unknown maker", matmul.mkl_slow_reason(""))

  @parameterized.parameters(("mkl", "MKL"), ("onednn", "oneDNN"))
  def test_engine_refuses_a_library_where_it_cannot_run_and_its_dot_general_too(self, backend,
                                                                                 name):
    cfg = config.tiny_config(matmul=backend)
    params = testing.random_params(config.tiny_config(), seed=0)   # the same parameters
    with mock.patch.object(matmul, "unavailable_reason", return_value="not here"):
      with self.assertRaisesRegex(ValueError, f"matmul='{backend}' cannot run here: not here"):
        engine.Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=8))
      x, w = _operands(16, 8, 4, jnp.float32)   # rows oneDNN takes too
      with self.assertRaisesRegex(ValueError, f"the {name} matmul cannot run here: not here"):
        matmul.for_backend(backend)(x, w, _DIMS)


if __name__ == "__main__":
  absltest.main()
