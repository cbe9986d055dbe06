"""The C++ CPU attention kernel (`paged_jax.cpu_kernel`): exactness against the float64 oracle and
the XLA paths (decode rows and prefill chunks), its dtypes, threads and clamps, the dispatcher's
choice, its build, the engine."""

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
    out, lse = cpu_kernel.paged_attention(*inp, return_lse=True, min_units_per_thread=threads,
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
    # Decode rows, then prefill chunks: one past a tile (16 queries where the group is odd, 8
    # where even) after a prefix, a fresh prompt of several tiles and key chunks (32 keys).
    q_heads, kv_heads = heads
    inp = testing.random_paged_inputs(5, [1, page_size, 3 * page_size + 1, 70, 30, 75],
                                      q_lens=[1, 1, 1, 1, 17, 75], page_size=page_size,
                                      num_kv_heads=kv_heads, q_per_kv=q_heads // kv_heads,
                                      head_dim=head_dim)
    for threads in (0, 1):
      out = cpu_kernel.paged_attention(*inp, min_units_per_thread=threads)
      np.testing.assert_allclose(np.asarray(out, np.float64), testing.naive_paged_attention(*inp),
                                 **F32)

  @parameterized.product(dtype=(jnp.float32, jnp.bfloat16), window=(None, 300))
  def test_one_long_decode_row_matches_the_oracle(self, dtype, window):
    # One user's decode row past the keys at which a second thread takes some of its 3 units
    # (cpu_kernel.cc's kMinKeyRowsPerThread) at the default min_units_per_thread, on pages in
    # any order; its keys come in many chunks, each asked for one chunk ahead.
    inp = testing.random_paged_inputs(7, [1000], q_lens=[1], page_size=16, num_kv_heads=3,
                                      q_per_kv=3, head_dim=64, dtype=dtype)
    out, lse = cpu_kernel.paged_attention(*inp, return_lse=True, sliding_window=window)
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               testing.naive_paged_attention(*inp, sliding_window=window),
                               **(F32 if dtype == jnp.float32 else BF16))
    if dtype == jnp.float32:
      _, lse_xla = attention.decode_attention_xla(*inp, return_lse=True, sliding_window=window)
      np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_xla), **F32)

  @parameterized.product(window=(None, 1, 3, 6, 40), dtype=(jnp.float32, jnp.bfloat16),
                         threads=(0, 1))
  def test_prefill_chunks_match_the_oracle(self, window, dtype, threads):
    # Chunks after prefixes (one key, a page and a bit, 40 keys), fresh prompts (one token, two
    # pages, 37 tokens: three tiles of 16), a row with no query, one-token chunks, two padding
    # tokens; SmolLM2's group of 3 (key-major scores) and a group of 2.
    seq_lens = [6, 9, 1, 5, 8, 3, 60, 37]
    q_lens = [5, 4, 1, 0, 8, 1, 20, 37]
    for q_per_kv in (3, 2):
      inp = testing.random_paged_inputs(21, seq_lens, q_lens=q_lens, page_size=4, num_kv_heads=2,
                                        q_per_kv=q_per_kv, pad_tokens=2, dtype=dtype)
      kw = dict(sliding_window=window, soft_cap=2.5 if window in (3, None) else None, scale=0.3)
      out, lse = cpu_kernel.paged_attention(*inp, return_lse=True, min_units_per_thread=threads,
                                            **kw)
      self.assertEqual(out.dtype, dtype)
      np.testing.assert_allclose(np.asarray(out, np.float64),
                                 testing.naive_paged_attention(*inp, **kw),
                                 **(F32 if dtype == jnp.float32 else BF16))
      np.testing.assert_array_equal(np.asarray(out[-2:], np.float32), 0)   # padding tokens
      self.assertTrue(np.all(np.isneginf(np.asarray(lse[-2:]))))
      if dtype == jnp.float32:   # the same log-sum-exp as the XLA path
        _, lse_xla = attention.paged_attention_xla(*inp, max_q_len=37, return_lse=True, **kw)
        np.testing.assert_allclose(np.asarray(lse[:-2]), np.asarray(lse_xla[:-2]), **F32)

  def test_bf16_reads_bf16_and_returns_bf16(self):
    inp = testing.random_paged_inputs(3, [5, 40, 17], page_size=4, dtype=jnp.bfloat16,
                                      pad_tokens=1)
    out, lse = cpu_kernel.paged_attention(*inp, return_lse=True)
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
    out = cpu_kernel.paged_attention(*inp, sliding_window=5)
    self.assertFalse(np.isnan(np.asarray(out)).any())

  def test_bad_page_ids_and_lengths_are_clamped_like_the_gather(self):
    # Out-of-range page ids read the nearest page and lengths past the table read the whole
    # table (what the XLA path's clamped gather does); nothing outside the buffers is touched.
    inp = testing.random_paged_inputs(4, [9, 12], page_size=4, poison=False)
    num_pages = inp.k_pages.shape[0]
    bad = inp.block_tables.at[0, 0].set(num_pages + 50).at[1, 1].set(-7)
    clamped = jnp.clip(bad, 0, num_pages - 1)
    lens = inp.seq_lens.at[1].set(10_000)
    got = cpu_kernel.paged_attention(inp.q, inp.k_pages, inp.v_pages, bad, lens, inp.cu_q_lens)
    width = inp.block_tables.shape[1] * 4
    want = testing.naive_paged_attention(inp.q, inp.k_pages, inp.v_pages, clamped,
                                         jnp.minimum(lens, width), inp.cu_q_lens)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **F32)

  def test_under_jit_and_inside_a_larger_program(self):
    inp = testing.random_paged_inputs(2, [6, 19], page_size=4)

    @jax.jit
    def f(q, k, v):
      return 2.0 * cpu_kernel.paged_attention(q * 1.0, k, v, *inp[3:]) + 1.0

    np.testing.assert_allclose(np.asarray(f(*inp[:3]), np.float64),
                               2.0 * testing.naive_paged_attention(*inp) + 1.0, **F32)

  def test_refusals_name_the_value(self):
    inp = testing.random_paged_inputs(1, [5], page_size=4)
    with self.assertRaisesRegex(ValueError, "f32 or bf16 q and pages of one dtype; got q float16"):
      cpu_kernel.paged_attention(inp.q.astype(jnp.float16), *inp[1:])
    with self.assertRaisesRegex(ValueError, "k_pages bfloat16"):
      cpu_kernel.paged_attention(inp.q, inp.k_pages.astype(jnp.bfloat16), *inp[2:])
    many = testing.random_paged_inputs(1, [5], page_size=4, num_kv_heads=1, q_per_kv=17)
    with self.assertRaisesRegex(ValueError, "num_q_heads=17 over num_kv_heads=1: at most 16"):
      cpu_kernel.paged_attention(*many)
    # What every path checks (`check_static_args`), before anything reaches the C++ side.
    with self.assertRaisesRegex(ValueError, "k and v shapes differ"):
      cpu_kernel.paged_attention(inp.q, inp.k_pages, inp.v_pages[:-1], *inp[3:])
    with self.assertRaisesRegex(ValueError, "block_tables must be int32; got int16"):
      cpu_kernel.paged_attention(*inp[:3], inp.block_tables.astype(jnp.int16), *inp[4:])
    with self.assertRaisesRegex(ValueError, "sliding_window=0 must be >= 1"):
      cpu_kernel.paged_attention(*inp, sliding_window=0)
    o, lse = cpu_kernel.paged_attention(inp.q[:0], *inp[1:5], jnp.zeros(2, jnp.int32),
                                         return_lse=True)
    self.assertEqual((o.shape, lse.shape), ((0, 4, 16), (0, 4)))


class DispatchTest(absltest.TestCase):

  def test_auto_and_cpu_take_the_kernel(self):
    inp = testing.random_paged_inputs(6, [9, 4], q_lens=[3, 1], page_size=4)
    calls = []
    real = cpu_kernel.paged_attention

    def spy(*a, **k):
      calls.append(a[0].shape)
      return real(*a, **k)

    with mock.patch.object(cpu_kernel, "paged_attention", spy):
      for impl in ("auto", "cpu"):
        attention.paged_attention(*inp, max_q_len=3, impl=impl)
      attention.paged_attention(*inp, max_q_len=3, impl="xla")
      attention.paged_attention(*inp, impl="cpu")          # no max_q_len needed
    self.assertEqual(calls, [(4, 4, 16)] * 3)

  def test_step_attention_runs_the_step_in_one_kernel_call(self):
    # Two decode rows, then prefill chunks of 5 (after a 3-token prefix) and 2 (a fresh prompt)
    # and a padding token: one kernel call for every row while PREFILL_ON_CPU_KERNEL; without
    # it, decode rows on the kernel and the chunks on the tiled XLA path. Every route: the
    # oracle's numbers; "xla" never takes the kernel.
    inp = testing.random_paged_inputs(8, [9, 4, 8, 2], q_lens=[1, 1, 5, 2], page_size=4,
                                      pad_tokens=1)
    k, v = testing.step_kv(inp)
    kw = dict(num_decode=2, max_q_len=5, sliding_window=6, soft_cap=2.5)
    expected = testing.naive_paged_attention(*inp, sliding_window=6, soft_cap=2.5)
    step = lambda impl="cpu": attention.step_attention(inp.q, k, v, *inp[1:], impl=impl, **kw)
    kernel, tiled = cpu_kernel.paged_attention, attention.prefill_attention
    for on_kernel, routes in ((True, [("kernel", 10)]), (False, [("kernel", 2), ("tiled", 8)])):
      traced = []
      with mock.patch.object(attention, "PREFILL_ON_CPU_KERNEL", on_kernel), \
           mock.patch.object(cpu_kernel, "paged_attention",
                             lambda q, *a, **k: (traced.append(("kernel", q.shape[0])),
                                                 kernel(q, *a, **k))[1]), \
           mock.patch.object(attention, "prefill_attention",
                             lambda q, *a, **k: (traced.append(("tiled", q.shape[0])),
                                                 tiled(q, *a, **k))[1]):
        np.testing.assert_allclose(np.asarray(step(), np.float64), expected, **F32)
        self.assertEqual(traced, routes, on_kernel)
        traced.clear()
        np.testing.assert_allclose(np.asarray(step("xla"), np.float64), expected, **F32)
        self.assertEqual(traced, [("tiled", 8)])

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
