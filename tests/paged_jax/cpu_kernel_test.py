"""The C++ CPU decode kernel (`paged_jax.cpu_kernel`): exactness against the float64 oracle and the
XLA decode path, its dtypes, threads and clamps, the dispatcher's choice, its build, the engine."""

import os
import tempfile
import unittest
from unittest import mock

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, cpu_kernel, kv_quant, testing

F32 = dict(atol=1e-5, rtol=1e-5)
BF16 = dict(atol=2e-2, rtol=2e-2)


def setUpModule():
  reason = cpu_kernel.unavailable_reason()
  if jax.devices()[0].platform != "cpu":
    raise unittest.SkipTest(f"the C++ CPU kernel: {reason}")
  if reason is not None:   # on a CPU it must build (CI's machines have g++): a real failure
    raise AssertionError(f"the CPU kernel does not build here: {reason}")


class ExactnessTest(parameterized.TestCase):

  @parameterized.product(window=(None, 1, 3, 4, 5, 100), threads=(0, 1))
  def test_matches_the_oracle(self, window, threads):
    # The rows of decode_attention_xla's own test: long, a padding row (0 keys), one key, a row
    # with keys but no query, lengths around the page edges; two query tokens past the last row.
    # threads=1: every (row, kv head) unit may go to another pool thread.
    seq_lens = [3 * 12 + 2, 0, 1, 6, 4, 5, 2 * 12 - 1, 12]
    q_lens = [1, 0, 1, 0, 1, 1, 1, 1]
    inp = testing.random_paged_inputs(13, seq_lens, q_lens=q_lens, page_size=4, num_kv_heads=2,
                                      q_per_kv=2, pad_tokens=2)
    kw = dict(sliding_window=window, soft_cap=2.5 if window in (3, 100) else None, scale=0.3)
    out, lse = cpu_kernel.decode_attention(*inp, return_lse=True, min_units_per_thread=threads,
                                           **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), testing.naive_paged_attention(*inp, **kw),
                               **F32)
    _, lse_xla = attention.decode_attention_xla(*inp, return_lse=True, **kw)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_xla), **F32)
    # Padding tokens and rows without a query: zeros, lse -inf.
    np.testing.assert_array_equal(np.asarray(out[-2:]), 0)
    self.assertTrue(np.all(np.isneginf(np.asarray(lse[-2:]))))

  @parameterized.parameters(
      dict(head_dim=64, heads=(9, 3), page_size=16),     # SmolLM2's layout (the D=64 path)
      dict(head_dim=128, heads=(8, 2), page_size=32),    # the D=128 path
      dict(head_dim=48, heads=(4, 4), page_size=8),      # any other head_dim (runtime D)
      dict(head_dim=16, heads=(16, 1), page_size=1),     # the largest group, one-token pages
  )
  def test_head_layouts(self, head_dim, heads, page_size):
    q_heads, kv_heads = heads
    inp = testing.random_paged_inputs(5, [1, page_size, 3 * page_size + 1, 70], page_size=page_size,
                                      num_kv_heads=kv_heads, q_per_kv=q_heads // kv_heads,
                                      head_dim=head_dim)
    for threads in (0, 1):
      out = cpu_kernel.decode_attention(*inp, min_units_per_thread=threads)
      np.testing.assert_allclose(np.asarray(out, np.float64), testing.naive_paged_attention(*inp),
                                 **F32)

  @parameterized.product(window=(None, 1, 3, 6), dtype=(jnp.float32, jnp.bfloat16))
  def test_prefill_chunks_as_token_rows_match_the_oracle(self, window, dtype):
    # Chunks after prefixes (one key, a page and a bit), fresh prompts (one token, two pages),
    # a row with no query, a one-token chunk, two padding tokens.
    seq_lens = [6, 9, 1, 5, 8, 3]
    q_lens = [5, 4, 1, 0, 8, 1]
    inp = testing.random_paged_inputs(21, seq_lens, q_lens=q_lens, page_size=4, num_kv_heads=2,
                                      q_per_kv=3, pad_tokens=2, dtype=dtype)
    kw = dict(sliding_window=window, soft_cap=2.5 if window in (3, None) else None, scale=0.3)
    out = attention.prefill_attention_cpu(*inp, **kw)
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_allclose(np.asarray(out, np.float64), testing.naive_paged_attention(*inp, **kw),
                               **(F32 if dtype == jnp.float32 else BF16))
    np.testing.assert_array_equal(np.asarray(out[-2:], np.float32), 0)   # padding tokens

  def test_token_row_keys(self):
    # Rows of 2 queries after 3 keys, none, 3 fresh: (3 + 1) + (4 + 1) and 1 + 2 + 3 keys.
    self.assertEqual(float(attention.token_row_keys(jnp.asarray([5, 4, 3]),
                                                    jnp.asarray([0, 2, 2, 5]))), 15)

  def test_bf16_reads_bf16_and_returns_bf16(self):
    inp = testing.random_paged_inputs(3, [5, 40, 17], page_size=4, dtype=jnp.bfloat16,
                                      pad_tokens=1)
    out, lse = cpu_kernel.decode_attention(*inp, return_lse=True)
    self.assertEqual((out.dtype, lse.dtype), (jnp.bfloat16, jnp.float32))
    xla = attention.decode_attention_xla(*inp)
    chex.assert_trees_all_close(out.astype(jnp.float32), xla.astype(jnp.float32), **BF16)
    # The f32 sums are rounded once to bf16 (nearest even), as the XLA path's cast does: almost
    # every element equal, the rest one bf16 step apart (summation orders differ).
    same = np.mean(np.asarray(out, np.float32) == np.asarray(xla, np.float32))
    self.assertGreater(same, 0.9)

  def test_stale_slots_and_free_pages_are_never_read(self):
    # random_paged_inputs poisons NULL_PAGE, free pages and every slot past a row's length with
    # NaN: reading any of them would make the row NaN.
    inp = testing.random_paged_inputs(9, [7, 1, 30], page_size=8, num_free_pages=4)
    out = cpu_kernel.decode_attention(*inp, sliding_window=5)
    self.assertFalse(np.isnan(np.asarray(out)).any())

  def test_bad_page_ids_and_lengths_are_clamped_like_the_gather(self):
    # Out-of-range page ids read the nearest page and lengths past the table read the whole
    # table (what the XLA path's clamped gather does); nothing outside the buffers is touched.
    inp = testing.random_paged_inputs(4, [9, 12], page_size=4, poison=False)
    num_pages = inp.k_pages.shape[0]
    bad = inp.block_tables.at[0, 0].set(num_pages + 50).at[1, 1].set(-7)
    clamped = jnp.clip(bad, 0, num_pages - 1)
    lens = inp.seq_lens.at[1].set(10_000)
    got = cpu_kernel.decode_attention(inp.q, inp.k_pages, inp.v_pages, bad, lens, inp.cu_q_lens)
    width = inp.block_tables.shape[1] * 4
    want = testing.naive_paged_attention(inp.q, inp.k_pages, inp.v_pages, clamped,
                                         jnp.minimum(lens, width), inp.cu_q_lens)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **F32)

  def test_under_jit_and_inside_a_larger_program(self):
    inp = testing.random_paged_inputs(2, [6, 19], page_size=4)

    @jax.jit
    def f(q, k, v):
      return 2.0 * cpu_kernel.decode_attention(q * 1.0, k, v, *inp[3:]) + 1.0

    np.testing.assert_allclose(np.asarray(f(*inp[:3]), np.float64),
                               2.0 * testing.naive_paged_attention(*inp) + 1.0, **F32)

  def test_refusals_name_the_value(self):
    inp = testing.random_paged_inputs(1, [5], page_size=4)
    with self.assertRaisesRegex(ValueError, "f32 or bf16 q and pages of one dtype; got q float16"):
      cpu_kernel.decode_attention(inp.q.astype(jnp.float16), *inp[1:])
    with self.assertRaisesRegex(ValueError, "k_pages bfloat16"):
      cpu_kernel.decode_attention(inp.q, inp.k_pages.astype(jnp.bfloat16), *inp[2:])
    many = testing.random_paged_inputs(1, [5], page_size=4, num_kv_heads=1, q_per_kv=17)
    with self.assertRaisesRegex(ValueError, "num_q_heads=17 over num_kv_heads=1: at most 16"):
      cpu_kernel.decode_attention(*many)
    # What every path checks (`check_static_args`), before anything reaches the C++ side.
    with self.assertRaisesRegex(ValueError, "k and v shapes differ"):
      cpu_kernel.decode_attention(inp.q, inp.k_pages, inp.v_pages[:-1], *inp[3:])
    with self.assertRaisesRegex(ValueError, "block_tables must be int32; got int16"):
      cpu_kernel.decode_attention(*inp[:3], inp.block_tables.astype(jnp.int16), *inp[4:])
    with self.assertRaisesRegex(ValueError, "sliding_window=0 must be >= 1"):
      cpu_kernel.decode_attention(*inp, sliding_window=0)
    o, lse = cpu_kernel.decode_attention(inp.q[:0], *inp[1:5], jnp.zeros(2, jnp.int32),
                                         return_lse=True)
    self.assertEqual((o.shape, lse.shape), ((0, 4, 16), (0, 4)))


class DispatchTest(absltest.TestCase):

  def test_auto_and_cpu_take_the_kernel_for_decode_rows_only(self):
    inp = testing.random_paged_inputs(6, [9, 4], page_size=4)
    calls = []
    real = cpu_kernel.decode_attention

    def spy(*a, **k):
      calls.append(a[0].shape)
      return real(*a, **k)

    with mock.patch.object(cpu_kernel, "decode_attention", spy):
      for impl in ("auto", "cpu"):
        attention.paged_attention(*inp, max_q_len=1, impl=impl)
      attention.paged_attention(*inp, max_q_len=1, impl="xla")
      attention.paged_attention(*inp, impl="cpu")          # max_q_len unknown: XLA
    self.assertEqual(calls, [(2, 4, 16), (2, 4, 16)])

  def test_step_attention_runs_small_prefill_chunks_as_kernel_rows(self):
    # Two decode rows, then prefill chunks of 5 (after a 3-token prefix) and 2 (a fresh prompt)
    # and a padding token. 8 prefill tokens x 12 keys (3 table columns of 4) = 96 bound the
    # token rows' reads whatever the rows hold; they read 33. So: at a bound of 96 the chunks
    # are kernel rows, traced alone; below it both routes are traced and the step picks the
    # kernel rows down to 33 keys, the tiled XLA path under that (and at 0, traced alone).
    # Every route: the oracle's numbers.
    inp = testing.random_paged_inputs(8, [9, 4, 8, 2], q_lens=[1, 1, 5, 2], page_size=4,
                                      pad_tokens=1, extra_table_columns=0)
    self.assertEqual(inp.block_tables.shape[1] * inp.k_pages.shape[1], 12)
    self.assertEqual(float(attention.token_row_keys(inp.seq_lens[2:], inp.cu_q_lens[2:] - 2)),
                     33)
    k, v = testing.step_kv(inp)
    kw = dict(num_decode=2, max_q_len=5, sliding_window=6, soft_cap=2.5)
    expected = testing.naive_paged_attention(*inp, sliding_window=6, soft_cap=2.5)
    step = lambda impl="cpu": attention.step_attention(inp.q, k, v, *inp[1:], impl=impl, **kw)
    tiled = attention.prefill_attention
    for bound, routes, kernel_rows in ((96, ["rows"], True), (33, ["rows", "tiled"], True),
                                       (32, ["rows", "tiled"], False), (0, ["tiled"], False)):
      with mock.patch.object(attention, "TOKEN_ROWS_MAX_KEYS", bound):
        np.testing.assert_allclose(np.asarray(step(), np.float64), expected, **F32)
        traced = []
        # Stand-ins: the token rows answer zeros, so the route the step ran shows in its output.
        with mock.patch.object(attention, "prefill_attention_cpu",
                               lambda q, *a, **k: (traced.append("rows"), jnp.zeros_like(q))[1]), \
             mock.patch.object(attention, "prefill_attention",
                               lambda *a, **k: (traced.append("tiled"), tiled(*a, **k))[1]):
          out = np.asarray(step())
          self.assertEqual(traced, routes, bound)
          self.assertEqual(bool(np.all(out[2:9] == 0)), kernel_rows, bound)
          np.testing.assert_allclose(out[:2], expected[:2], **F32)   # decode rows: the kernel
          traced.clear()
          step("xla")
          self.assertEqual(traced, ["tiled"])   # "xla" never takes the kernel

  def test_quantized_pages_stay_on_xla(self):
    inp = testing.random_paged_inputs(6, [9, 4], page_size=4)
    self.assertTrue(attention.cpu_kernel_applies(inp.q, inp.k_pages, "cpu"))
    kq = kv_quant.quantize_pages(inp.k_pages, kv_quant.KVFormat("int8", "token"))
    self.assertFalse(attention.cpu_kernel_applies(inp.q, kq, "cpu"))
    self.assertFalse(attention.cpu_kernel_applies(inp.q, inp.k_pages, "xla"))

  def test_impl_cpu_where_the_kernel_cannot_run_says_why(self):
    inp = testing.random_paged_inputs(6, [9, 4], page_size=4)
    with mock.patch.object(cpu_kernel, "unavailable_reason", return_value="no C++ compiler"):
      with self.assertRaisesRegex(ValueError, "^impl='cpu' cannot run here: no C\\+\\+ compiler"):
        attention.paged_attention(*inp, max_q_len=1, impl="cpu")
      # "auto" quietly takes the XLA path.
      chex.assert_trees_all_close(attention.paged_attention(*inp, max_q_len=1, impl="auto"),
                                  attention.decode_attention_xla(*inp))


class EngineChoiceTest(absltest.TestCase):

  def test_the_engine_names_a_bad_impl_and_a_missing_kernel_at_construction(self):
    from paged_jax import config, testing as t
    from paged_jax.config import CacheConfig
    from paged_jax.engine import Engine
    cfg = config.tiny_config()
    params = t.random_params(cfg, seed=0)
    make = lambda impl: Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=8), impl=impl)
    with self.assertRaisesRegex(ValueError, r"^impl='cuda' is not one of \('auto', "):
      make("cuda")
    self.assertIsNone(make("cpu").cpu_kernel_reason)
    with mock.patch.object(cpu_kernel, "unavailable_reason", return_value="no C++ compiler"):
      with self.assertRaisesRegex(ValueError, "^impl='cpu' cannot run here: no C\\+\\+ compiler"):
        make("cpu")
      with self.assertLogs(level="INFO") as logs:
        self.assertEqual(make("auto").cpu_kernel_reason, "no C++ compiler")
      self.assertTrue(any("the XLA path (CPU kernel: no C++ compiler)" in x for x in logs.output))


class BuildTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.enterContext(mock.patch.dict(os.environ, {"PAGED_JAX_CPU_KERNEL_CACHE": self.dir}))

  def test_builds_once_into_the_cache_keyed_by_source_and_toolchain(self):
    compiler = cpu_kernel.compiler()
    path = cpu_kernel.build(compiler)
    self.assertEqual(os.path.dirname(path), self.dir)
    mtime = os.path.getmtime(path)
    self.assertEqual(cpu_kernel.build(compiler), path)          # cached: not rebuilt
    self.assertEqual(os.path.getmtime(path), mtime)
    self.assertEqual(os.listdir(self.dir), [os.path.basename(path)])   # no temporary left
    with mock.patch.object(cpu_kernel, "_cpu_flags", return_value="flags : other"):
      self.assertNotEqual(cpu_kernel.library_path(compiler), path)

  def test_a_failing_compiler_is_reported_with_its_message(self):
    fake = os.path.join(self.dir, "fake-c++")
    with open(fake, "w") as f:
      f.write("#!/bin/sh\necho 'fake 1.0'\n[ \"$1\" = --version ] || { echo 'no such thing' >&2;"
              " exit 1; }\n")
    os.chmod(fake, 0o755)
    with self.assertRaisesRegex(RuntimeError, "building cpu_kernel.cc failed .*\n.*no such thing"):
      cpu_kernel.build(fake)
    self.assertEqual(os.listdir(self.dir), ["fake-c++"])        # the temporary is removed

  def test_no_compiler_is_named(self):
    with mock.patch.dict(os.environ, {"CXX": "no-such-c++"}):
      self.assertIsNone(cpu_kernel.compiler())
      self.assertEqual(cpu_kernel._load.__wrapped__(),
                       "no C++ compiler ('no-such-c++' is not on PATH; set $CXX)")


if __name__ == "__main__":
  absltest.main()
