"""The Pallas (Triton) ragged paged-attention kernel: compiled on a GPU, interpreted on CPU CI.

Shapes are tiny because interpret mode is slow. Every case poisons NULL_PAGE, free pages and every
slot past a sequence's length with NaN, and shuffles the block tables.
"""

import functools
import itertools
import re

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, testing
from pallas_kernels.paged_attention import kernel_triton, triton_ir
from pallas_kernels.paged_attention.reference import paged_attention_reference

TOL = {  # the foundation's tolerances
    jnp.float32: dict(atol=1e-5, rtol=1e-5),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

_reference = jax.jit(paged_attention_reference,
                     static_argnames=("scale", "sliding_window", "soft_cap", "max_q_len"))

_CASES = [
    # decode: MHA, GQA, MQA; page sizes 1, 4, 16; lengths 0, 1, page-1, page, page+1, long.
    dict(page_size=4, heads=(4, 4), dtype=jnp.float32, head_dim=16),
    dict(page_size=4, heads=(8, 2), dtype=jnp.bfloat16, head_dim=16),
    dict(page_size=16, heads=(4, 1), dtype=jnp.float32, head_dim=64),
    dict(page_size=1, heads=(4, 2), dtype=jnp.float32, head_dim=16),
    # head dims that are not powers of two: power-of-two chunks.
    dict(page_size=4, heads=(4, 2), dtype=jnp.float32, head_dim=80),
    dict(page_size=4, heads=(4, 1), dtype=jnp.bfloat16, head_dim=96),
]


class _CompiledOrInterpreted(parameterized.TestCase):
  """`interpret` False: the kernel compiled by Triton, on a CUDA GPU >= 8.0 only (skipped,
  saying why, elsewhere); True: Pallas' interpreter, on any device (CPU CI)."""
  interpret = False

  def setUp(self):
    super().setUp()
    if not self.interpret and attention.kernel_unavailable_reason() is not None:
      self.skipTest(f"compiled kernel: {attention.kernel_unavailable_reason()}; "
                    "the interpret-mode class covers this on CPU")


class PagedAttentionKernelTest(_CompiledOrInterpreted):

  def _kernel(self, *args, **kw):
    return kernel_triton.paged_attention(*args, interpret=self.interpret, **kw)

  @parameterized.parameters(*_CASES)
  def test_decode_matches_dense_and_xla(self, page_size, heads, dtype, head_dim):
    num_q_heads, num_kv_heads = heads
    lens = sorted({0, 1, max(page_size - 1, 1), page_size, page_size + 1, 3 * page_size + 2})
    inp = testing.random_paged_inputs(
        head_dim, lens, q_lens=[min(1, n) for n in lens], page_size=page_size,
        num_kv_heads=num_kv_heads, q_per_kv=num_q_heads // num_kv_heads, head_dim=head_dim,
        dtype=dtype, pad_tokens=1)
    out = self._kernel(*inp, max_q_len=1)
    self.assertFalse(np.isnan(np.asarray(out, np.float32)).any())
    chex.assert_trees_all_close(out.astype(jnp.float32), _reference(*inp).astype(jnp.float32),
                                **TOL[dtype])
    xla = attention.paged_attention_xla(*inp, max_q_len=1)
    chex.assert_trees_all_close(out.astype(jnp.float32), xla.astype(jnp.float32), **TOL[dtype])

  @parameterized.parameters(
      dict(dtype=jnp.float32, window=None, cap=None, block_sizes=kernel_triton.BlockSizes()),
      dict(dtype=jnp.float32, window=5, cap=2.5,
           block_sizes=kernel_triton.BlockSizes(block_q=2, pages_per_block=4, num_splits=3)),
      dict(dtype=jnp.bfloat16, window=7, cap=None,
           block_sizes=kernel_triton.BlockSizes(num_splits=2)),
  )
  def test_mixed_prefill_and_decode_in_one_launch(self, dtype, window, cap, block_sizes):
    # Full prefill, decode, a chunk after a cached prefix, a zero-length padding row.
    seq_lens, q_lens = [5, 1, 14, 9, 0], [5, 1, 6, 1, 0]
    inp = testing.random_paged_inputs(3, seq_lens, q_lens=q_lens, page_size=4, num_kv_heads=2,
                                      q_per_kv=2, head_dim=16, dtype=dtype, pad_tokens=2)
    kw = dict(sliding_window=window, soft_cap=cap, scale=0.4, max_q_len=6)
    out = self._kernel(*inp, block_sizes=block_sizes, **kw)
    chex.assert_trees_all_close(out.astype(jnp.float32), _reference(*inp, **kw).astype(jnp.float32),
                                **TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out[-2:], np.float32), 0)   # padding tokens

  def test_splits_merge_exactly_and_lse(self):
    inp = testing.random_paged_inputs(5, [37, 64, 3], page_size=4, num_kv_heads=1, q_per_kv=4,
                                      head_dim=16)
    one, lse_one = self._kernel(*inp, max_q_len=1, return_lse=True,
                                block_sizes=kernel_triton.BlockSizes(num_splits=1))
    many, lse_many = self._kernel(*inp, max_q_len=1, return_lse=True,
                                  block_sizes=kernel_triton.BlockSizes(num_splits=4,
                                                                       pages_per_block=4))
    chex.assert_trees_all_close(one, many, **TOL[jnp.float32])
    _, lse_xla = attention.paged_attention_xla(*inp, max_q_len=1, return_lse=True)
    chex.assert_trees_all_close(lse_many, lse_xla, **TOL[jnp.float32])
    chex.assert_trees_all_close(lse_one, lse_xla, **TOL[jnp.float32])

  def test_nan_in_stale_slot_of_last_page(self):
    # JAX's own GPU kernel turns this NaN into a NaN output; ours must not.
    inp = testing.random_paged_inputs(9, [6, 3], page_size=4, head_dim=16, poison=False)
    last = int(inp.block_tables[0, 1])
    v_pages = inp.v_pages.at[last, 2:].set(jnp.nan)
    out = self._kernel(inp.q, inp.k_pages, v_pages, *inp[3:], max_q_len=1)
    chex.assert_trees_all_close(out, _reference(*inp), **TOL[jnp.float32])

  def test_zero_length_row_gives_zeros(self):
    inp = testing.random_paged_inputs(1, [0, 5], q_lens=[0, 1], page_size=4, head_dim=16,
                                      pad_tokens=1)
    out = self._kernel(*inp, max_q_len=1)
    np.testing.assert_array_equal(np.asarray(out[1:]), 0)
    self.assertFalse(np.isnan(np.asarray(out)).any())


class PagedAttentionKernelInterpretTest(PagedAttentionKernelTest):
  interpret = True


def _edge_cases():
  """A generated matrix (page size 4): every window kind (1, page - 1, page, page + 1, longer
  than any sequence) with 1, 2, 3 and 4 splits, GQA groups 1, 4 and 8 and soft cap on and off
  cycling through it, in mixed launches; plus pure decode and pure prefill launches per group.
  The decode rows' lengths 61-64 put a window's first key on every offset of a page (its last
  slot included), and 64+ keys make 4-5 blocks of 16, so every split holds keys."""
  cases = []
  groups = (1, 4, 8)
  windows = (1, 3, 4, 5, 200)
  for i, window in enumerate(windows):
    for splits in (1, 2, 3, 4):
      j = 4 * i + splits
      cases.append(dict(testcase_name=f"window{window}_splits{splits}", mode="mixed",
                        window=window, splits=splits, group=groups[j % 3],
                        cap=2.5 if j % 2 else None))
  for group in groups:
    for mode in ("decode", "prefill"):
      cases.append(dict(testcase_name=f"{mode}_group{group}", mode=mode, window=5, splits=3,
                        group=group, cap=2.5))
  # Pages larger than a step (page 32, 16 keys per step): each page is read as two sub-pages;
  # windows that end on, before and after a sub-page boundary.
  for window in (1, 15, 16, 17, 200):
    for splits in (1, 3):
      cases.append(dict(testcase_name=f"subpage_window{window}_splits{splits}", mode="subpage",
                        window=window, splits=splits, group=4, cap=None if splits == 1 else 2.5))
  return cases


class KernelEdgeMatrixTest(_CompiledOrInterpreted):
  """The kernel in interpret mode against `testing.naive_paged_attention`, the independent
  float64 oracle (no helper shared with the reference or the XLA path); compiled on a GPU
  by KernelEdgeMatrixCompiledTest."""
  interpret = True

  @parameterized.named_parameters(*_edge_cases())
  def test_against_the_independent_oracle(self, mode, window, splits, group, cap):
    if mode == "decode":
      seq_lens, q_lens = [61, 62, 63, 64, 9], [1] * 5
    elif mode == "prefill":
      seq_lens, q_lens = [9, 70, 33], [9, 6, 33]
    else:   # decode rows whose windows start on every page offset, a chunk, a full prompt
      seq_lens, q_lens = [61, 62, 63, 64, 70, 9, 0], [1, 1, 1, 1, 6, 9, 0]
    page_size, steps = 4, dict(pages_per_block=4)
    if mode == "subpage":
      seq_lens, q_lens = [48, 63, 64, 65, 130, 9, 0], [1, 1, 1, 1, 6, 9, 0]
      page_size, steps = 32, dict(block_tokens=16)
    num_kv_heads = 1 if group == 8 else 2
    inp = testing.random_paged_inputs(window + splits, seq_lens, q_lens=q_lens,
                                      page_size=page_size, num_kv_heads=num_kv_heads,
                                      q_per_kv=group, head_dim=16, pad_tokens=1)
    kw = dict(sliding_window=window, soft_cap=cap, scale=0.3)
    out = kernel_triton.paged_attention(
        *inp, max_q_len=max(q_lens), interpret=self.interpret,
        block_sizes=kernel_triton.BlockSizes(num_splits=splits, **steps), **kw)
    oracle = testing.naive_paged_attention(*inp, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, **TOL[jnp.float32])

  @parameterized.parameters(2, 9, 40)
  def test_one_token_pages_with_a_window(self, window):
    # Page size 1: a page is a key, so the first page a window needs is its first key; windows
    # that start inside the sequence (2), and that reach key 0 (9 for the 9-token rows, 40).
    seq_lens, q_lens = [9, 9, 12, 3], [9, 1, 4, 3]
    inp = testing.random_paged_inputs(window, seq_lens, q_lens=q_lens, page_size=1,
                                      num_kv_heads=1, q_per_kv=2, head_dim=16, pad_tokens=1)
    kw = dict(sliding_window=window, scale=0.3)
    out = kernel_triton.paged_attention(*inp, max_q_len=9, interpret=self.interpret, **kw)
    oracle = testing.naive_paged_attention(*inp, **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, **TOL[jnp.float32])


class KernelEdgeMatrixCompiledTest(KernelEdgeMatrixTest):
  interpret = False


class PrecisionTest(_CompiledOrInterpreted):
  """Each precision's error against the float64 oracle (interpret mode emulates TF32 rounding;
  PrecisionCompiledTest runs the GPU's tensor cores), within what kernel_triton.PRECISIONS
  promises, and the TF32 settings really round."""
  interpret = True

  def _errors(self, dtype=jnp.float32):
    inp = testing.random_paged_inputs(3, [1, 37, 200, 64], q_lens=[1, 5, 1, 16], page_size=16,
                                      num_kv_heads=2, q_per_kv=4, head_dim=64, dtype=dtype,
                                      pad_tokens=1)
    oracle = testing.naive_paged_attention(*inp)
    outs = {prec: np.asarray(kernel_triton.paged_attention(*inp, max_q_len=16, precision=prec,
                                                           interpret=self.interpret), np.float64)
            for prec in kernel_triton.PRECISIONS}
    return {prec: float(np.abs(out - oracle).max()) for prec, out in outs.items()}, outs

  def test_errors_within_the_promise(self):
    err, _ = self._errors()
    self.assertLess(err["highest"], 1e-5)
    self.assertLess(err["tf32x3"], 1e-5)
    self.assertLess(err["default"], 5e-3)
    # One TF32 pass loses ~3 decimal digits; if it did not, the emulation would not be running.
    self.assertGreater(err["default"], 1e-4)
    self.assertLess(err["tf32x3"], err["default"] / 20)

  def test_bf16_ignores_precision(self):
    _, outs = self._errors(jnp.bfloat16)
    chex.assert_trees_all_equal(outs["highest"], outs["tf32x3"], outs["default"])

  def test_bf16_scores_are_accumulated_and_kept_in_f32(self):
    # Every key near one direction, so the scores sit between ~57 and ~64, where bf16's spacing
    # is 0.25: scores rounded to bf16 would move each exp by up to 13% (measured: output errors
    # 0.08-0.27 over seeds 0-3). Kept in f32, only P (cast to bf16 for the P V dot, by design)
    # and the bf16 output round: errors 0.0022-0.0026 against the float64 oracle over the same
    # seeds; hence 0.01.
    q, k_pages, v_pages, tables, lens, cu = testing.random_paged_inputs(
        2, [40, 23], q_lens=[1, 3], page_size=4, num_kv_heads=1, q_per_kv=2, head_dim=16)
    ones = np.ones(16, np.float32)
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
    inp = (bf16(15.5 * ones + 0.4 * np.asarray(q)), bf16(ones + 0.125 * np.asarray(k_pages)),
           bf16(v_pages), tables, lens, cu)
    oracle = testing.naive_paged_attention(*inp)
    live = np.asarray(inp[1], np.float64)[tables[0, :10], :, 0].reshape(40, 16)
    scores = live @ np.asarray(inp[0], np.float64)[0, 0] / 4   # scale 1 / sqrt(16)
    self.assertGreater(scores.min(), 50)        # the premise: scores where bf16 is coarse
    self.assertGreater(scores.max() - scores.min(), 3)
    out = kernel_triton.paged_attention(*inp, max_q_len=3, interpret=self.interpret)
    self.assertEqual(out.dtype, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, atol=0.01, rtol=0)

  def test_each_row_shifts_by_its_own_max(self):
    # Two heads of one KV head share a program's rows: every key leans on dim 0 and the heads
    # point opposite ways, so head 0's scores sit near +75 and head 1's near -75. One max
    # shared by the rows would leave head 1's exp(-150) = 0 in f32 (0 / 0); each row's own max
    # keeps both exact.
    q, k_pages, v_pages, tables, lens, cu = testing.random_paged_inputs(
        6, [37, 5], page_size=4, num_kv_heads=1, q_per_kv=2, head_dim=16)
    lean = np.zeros(16, np.float32)
    lean[0] = 10.0
    q = np.asarray(q) * 0.3
    q[:, 0, 0], q[:, 1, 0] = 30.0, -30.0
    inp = (jnp.asarray(q), jnp.asarray(np.asarray(k_pages) + lean), v_pages, tables, lens, cu)
    out = kernel_triton.paged_attention(*inp, max_q_len=1, interpret=self.interpret)
    np.testing.assert_allclose(np.asarray(out, np.float64), testing.naive_paged_attention(*inp),
                               **TOL[jnp.float32])

  def test_unknown_precision_is_a_clear_error(self):
    inp = testing.random_paged_inputs(0, [5], page_size=4, head_dim=16)
    with self.assertRaisesRegex(ValueError, r"precision='tf32' is not one of \('highest'"):
      kernel_triton.paged_attention(*inp, precision="tf32", interpret=True)
    with self.assertRaisesRegex(ValueError, r"precision='tf32' is not one of"):
      attention.paged_attention(*inp, impl="pallas", interpret=True, precision="tf32")



class PrecisionCompiledTest(PrecisionTest):
  interpret = False

  def test_unknown_precision_is_a_clear_error(self):
    self.skipTest("no device in it: PrecisionTest runs it")

class KernelLoweringTest(parameterized.TestCase):
  """Lowers the kernel for CUDA on a CPU, so Triton lowering errors surface without a GPU."""

  @parameterized.parameters(
      dict(max_q_len=1, page_size=16, heads=(32, 8), head_dim=128, dtype=jnp.bfloat16, kw={}),
      dict(max_q_len=1, page_size=16, heads=(8, 2), head_dim=64, dtype=jnp.float32, kw={}),
      dict(max_q_len=8, page_size=4, heads=(4, 2), head_dim=80, dtype=jnp.float32,
           kw=dict(sliding_window=16, soft_cap=30.0)),
      dict(max_q_len=4, page_size=1, heads=(4, 1), head_dim=96, dtype=jnp.bfloat16, kw={}),
  )
  def test_lowers_to_triton(self, max_q_len, page_size, heads, head_dim, dtype, kw):
    num_q_heads, num_kv_heads = heads
    num_seqs = 4
    shape = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
    args = (shape(num_seqs * max_q_len, num_q_heads, head_dim),
            shape(64, page_size, num_kv_heads, head_dim), shape(64, page_size, num_kv_heads, head_dim),
            shape(num_seqs, 16, d=jnp.int32), shape(num_seqs, d=jnp.int32),
            shape(num_seqs + 1, d=jnp.int32))
    f = functools.partial(kernel_triton.paged_attention, max_q_len=max_q_len, **kw)
    text = triton_ir.lower_for_cuda(f, *args).as_text()
    self.assertIn("ragged_paged_attention", text)
    self.assertIn("triton", text.lower())

  _DOT = re.compile(r"tt\.dot [^:]*?(?:, inputPrecision = (\w+))? : tensor<(\d+)x(\d+)x(\w+)> \* "
                    r"tensor<(\d+)x(\d+)x(\w+)> -> tensor<(\d+)x(\d+)xf32>")

  @parameterized.parameters(
      # dtype, precision, head_dim, max_q_len, group -> tt.dot's inputPrecision (None: IEEE f32,
      # or bf16 operands). The GPU branch of _dot: interpret mode never reaches it.
      (jnp.float32, "highest", 64, 1, 1, None),
      (jnp.float32, "default", 80, 16, 4, "tf32"),
      (jnp.float32, "tf32x3", 128, 1, 8, "tf32x3"),
      (jnp.bfloat16, "default", 96, 16, 1, None),
      (jnp.bfloat16, "tf32x3", 256, 1, 4, None),
  )
  def test_each_precision_lowers_to_its_dots_on_the_planned_tiles(
      self, dtype, precision, head_dim, max_q_len, group, input_precision):
    num_seqs, num_kv_heads, page_size, pages_per_seq = 4, 2, 16, 16
    shape = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
    pages = shape(64, page_size, num_kv_heads, head_dim)
    args = (shape(num_seqs * max_q_len, num_kv_heads * group, head_dim), pages, pages,
            shape(num_seqs, pages_per_seq, d=jnp.int32), shape(num_seqs, d=jnp.int32),
            shape(num_seqs + 1, d=jnp.int32))
    f = functools.partial(kernel_triton.paged_attention, max_q_len=max_q_len, precision=precision)
    [kernel] = triton_ir.triton_kernels(triton_ir.lower_for_cuda(f, *args))
    p = kernel_triton.plan(num_seqs, num_kv_heads, group, max_q_len, pages_per_seq, page_size,
                           kernel_triton.BlockSizes(), head_dim=head_dim, dtype=dtype,
                           precision=precision)
    self.assertEqual((kernel.num_warps, kernel.num_stages), (p.num_warps, p.num_stages))
    self.assertEqual(kernel.grid, (num_seqs, num_kv_heads, p.num_row_blocks * p.num_splits))
    dots = self._DOT.findall(kernel.ttir)
    self.assertEqual(len(dots), kernel.ttir.count("tt.dot "))   # the pattern read every dot
    operand = "bf16" if dtype == jnp.bfloat16 else "f32"
    rows, keys = p.block_rows, p.block_tokens
    # Q K^T per head_dim chunk ([rows, size] x [size, keys]), then P V per chunk ([rows, keys] x
    # [keys, size]): the chunks tile head_dim, every dot at the one precision.
    expected = ([(input_precision or "", str(rows), str(size), operand, str(size), str(keys),
                  operand, str(rows), str(keys)) for _, size in p.chunks] +
                [(input_precision or "", str(rows), str(keys), operand, str(keys), str(size),
                  operand, str(rows), str(size)) for _, size in p.chunks])
    self.assertCountEqual(dots, expected)
    self.assertEqual(sum(size for _, size in p.chunks), head_dim)


class DispatchTest(absltest.TestCase):

  def test_auto_uses_xla_where_the_kernel_cannot_run(self):
    inp = testing.random_paged_inputs(0, [5, 9], page_size=4, head_dim=16)
    if attention.kernel_unavailable_reason() is None:
      self.skipTest("a CUDA GPU >= 8.0 is present: auto picks the kernel")
    self.assertIn("cpu", attention.kernel_unavailable_reason())
    # On a CPU "auto" runs the C++ kernel where it builds (`attention.cpu_kernel_applies`), else
    # the XLA path; both agree with the XLA path to f32 rounding.
    on_cpu = attention.cpu_kernel_applies(inp.q, inp.k_pages, "auto")
    want = (attention.cpu_kernel.paged_attention(*inp) if on_cpu
            else attention.paged_attention_xla(*inp))
    chex.assert_trees_all_equal(attention.paged_attention(*inp), want)
    chex.assert_trees_all_close(attention.paged_attention(*inp),
                                attention.paged_attention_xla(*inp), atol=1e-5, rtol=1e-5)

  def test_forcing_the_kernel_where_it_cannot_run_is_a_clear_error(self):
    inp = testing.random_paged_inputs(0, [5], page_size=4, head_dim=16)
    if attention.kernel_unavailable_reason() is None:
      self.skipTest("a CUDA GPU >= 8.0 is present")
    with self.assertRaisesRegex(ValueError, r"impl='pallas' cannot run here: .*Use impl='xla'"):
      attention.paged_attention(*inp, impl="pallas")
    out = attention.paged_attention(*inp, impl="pallas", interpret=True)
    chex.assert_trees_all_close(out, _reference(*inp), **TOL[jnp.float32])

  def test_unknown_impl_and_unsupported_shapes(self):
    inp = testing.random_paged_inputs(0, [5], page_size=4, head_dim=8)
    with self.assertRaisesRegex(ValueError, "impl='cuda' is not one of"):
      attention.paged_attention(*inp, impl="cuda")
    with self.assertRaisesRegex(ValueError, "head_dim=8 must be a multiple of 16"):
      kernel_triton.paged_attention(*inp, interpret=True)
    inp = testing.random_paged_inputs(0, [5], page_size=3, head_dim=16)
    with self.assertRaisesRegex(ValueError, "page_size=3 must be a power of two"):
      kernel_triton.paged_attention(*inp, interpret=True)

  def test_block_sizes_validation_and_head_dim_chunks(self):
    with self.assertRaisesRegex(ValueError, "pages_per_block=3 must be a power of two"):
      kernel_triton.BlockSizes(pages_per_block=3)
    with self.assertRaisesRegex(ValueError, "num_splits=0"):
      kernel_triton.BlockSizes(num_splits=0)
    self.assertEqual(kernel_triton.head_dim_chunks(80), ((0, 64), (64, 16)))
    self.assertEqual(kernel_triton.head_dim_chunks(96), ((0, 64), (64, 32)))
    self.assertEqual(kernel_triton.head_dim_chunks(128), ((0, 128),))
    self.assertEqual(kernel_triton.head_dim_chunks(80, 32), ((0, 32), (32, 32), (64, 16)))
    with self.assertRaisesRegex(ValueError, "max_chunk=24 must be a power of two"):
      kernel_triton.head_dim_chunks(96, 24)
    with self.assertRaisesRegex(ValueError, "block_tokens=8 must be >= 16"):
      kernel_triton.BlockSizes(block_tokens=8)
    with self.assertRaisesRegex(ValueError, "give pages_per_block=2 or block_tokens=32, not both"):
      kernel_triton.BlockSizes(pages_per_block=2, block_tokens=32)
    with self.assertRaisesRegex(ValueError, "max_chunk=48 must be a power of two"):
      kernel_triton.BlockSizes(max_chunk=48)
    # The smallest values accepted: 1 page per step (2^0), one split, 16-wide slices.
    one_page = kernel_triton.BlockSizes(pages_per_block=1, num_splits=1, max_chunk=16)
    p = kernel_triton.plan(1, 1, 1, 1, 4, 16, one_page, head_dim=64, dtype=jnp.float32)
    self.assertEqual((p.pages_per_block, p.block_tokens, p.num_splits, p.chunks),
                     (1, 16, 1, ((0, 16), (16, 16), (32, 16), (48, 16))))
    # A given max_chunk wins over the tiles' (bf16's 64).
    p = kernel_triton.plan(1, 1, 1, 1, 4, 16, kernel_triton.BlockSizes(max_chunk=32),
                           head_dim=128, dtype=jnp.bfloat16)
    self.assertEqual(p.chunks, ((0, 32), (32, 32), (64, 32), (96, 32)))

  def test_default_tiles_are_valid_and_planned(self):
    for dtype in (jnp.bfloat16, jnp.float32):
      for precision in kernel_triton.PRECISIONS:
        for head_dim, group in itertools.product((64, 80, 96, 128, 256), (1, 4, 8)):
          tiles = kernel_triton.default_tiles(jnp.dtype(dtype), precision, head_dim, group)
          for value in (tiles.max_rows, tiles.block_tokens):
            self.assertGreaterEqual(value, 16)
            self.assertEqual(value & (value - 1), 0)
          p = kernel_triton.plan(4, 2, group, 256, 64, 64, kernel_triton.BlockSizes(),
                                 head_dim=head_dim, dtype=dtype, precision=precision)
          self.assertLessEqual(p.block_rows, tiles.max_rows)
          self.assertEqual((p.block_tokens, p.num_warps, p.num_stages),
                           (tiles.block_tokens, tiles.num_warps, tiles.num_stages))
          self.assertEqual(sum(size for _, size in p.chunks), head_dim)

  def test_rows_per_program_and_defaults_of_plan(self):
    # A program's rows: block_q queries x the group, padded to a power of two >= 16 (17, 33:
    # one past a power of two, where a next-power-of-two slip shows).
    for block_q, group, rows in ((1, 1, 16), (4, 4, 16), (17, 1, 32), (5, 4, 32), (33, 1, 64),
                                 (16, 4, 64)):
      p = kernel_triton.plan(2, 1, group, 40, 8, 16, kernel_triton.BlockSizes(block_q=block_q),
                             head_dim=64, dtype=jnp.float32)
      self.assertEqual((p.block_q, p.block_rows, p.num_row_blocks),
                       (block_q, rows, -(-40 // block_q)), (block_q, group))
    # Queries per program when not given: 1 for decode, else max_q_len's next power of two,
    # capped by the tiles' rows over the group (f32 "highest": 16 rows), never below 1.
    for max_q_len, group, block_q in ((1, 1, 1), (1, 8, 1), (2, 1, 2), (3, 1, 4), (9, 1, 16),
                                      (40, 1, 16), (40, 4, 4), (40, 16, 1)):
      p = kernel_triton.plan(2, 1, group, max_q_len, 8, 16, kernel_triton.BlockSizes(),
                             head_dim=64, dtype=jnp.float32)
      self.assertEqual((p.block_q, p.block_rows), (block_q, max(16, block_q * group)),
                       (max_q_len, group))
    # Keys per step: pages_per_block x page_size (at least 16), or the tiles' block_tokens; a
    # step's pages, the splits' pages and the padded table width follow from it.
    for ppb, page_size, max_pages, tokens, step_pages in ((4, 16, 8, 64, 4), (2, 4, 8, 16, 4),
                                                          (None, 16, 8, 16, 1),
                                                          (None, 4, 8, 16, 4)):
      p = kernel_triton.plan(1, 1, 1, 1, max_pages, page_size,
                             kernel_triton.BlockSizes(pages_per_block=ppb, num_splits=2),
                             head_dim=64, dtype=jnp.float32)
      blocks = -(-max_pages // step_pages)
      self.assertEqual((p.block_tokens, p.pages_per_block, p.num_splits, p.pages_per_split,
                        p.table_width),
                       (tokens, step_pages, 2, -(-blocks // 2) * step_pages,
                        2 * (-(-blocks // 2) * step_pages) + step_pages), (ppb, page_size))
    # A one-page sequence has one block of keys: one split, however many programs are wanted.
    one = kernel_triton.plan(1, 1, 1, 1, 1, 16, kernel_triton.BlockSizes(), head_dim=64,
                             dtype=jnp.float32)
    self.assertEqual((one.num_splits, one.pages_per_split), (1, 1))
    # Splits fill ~target_programs programs: seqs x KV heads x row blocks of them before splits.
    p = kernel_triton.plan(2, 2, 1, 40, 64, 16, kernel_triton.BlockSizes(target_programs=24),
                           head_dim=64, dtype=jnp.float32)
    self.assertEqual((p.num_row_blocks, p.num_splits), (3, 2))    # 2 x 2 x 3 = 12 programs
    # Left out, precision is "highest" (it matters for f32 only) and head_dim 128.
    plan = functools.partial(kernel_triton.plan, 2, 1, 4, 40, 8, 16, kernel_triton.BlockSizes())
    self.assertEqual(plan(dtype=jnp.float32), plan(dtype=jnp.float32, precision="highest"))
    self.assertNotEqual(plan(dtype=jnp.float32), plan(dtype=jnp.float32, precision="tf32x3"))
    self.assertEqual(plan(), plan(dtype=jnp.bfloat16, head_dim=128))

  def test_odd_block_q_runs_exactly(self):
    # 17 queries per program (rows padded to 32), over a 40-token prompt and a decode row.
    inp = testing.random_paged_inputs(4, [40, 12], q_lens=[40, 1], page_size=4, num_kv_heads=1,
                                      q_per_kv=1, head_dim=16)
    out = kernel_triton.paged_attention(*inp, max_q_len=40, interpret=True,
                                        block_sizes=kernel_triton.BlockSizes(block_q=17))
    np.testing.assert_allclose(np.asarray(out, np.float64), testing.naive_paged_attention(*inp),
                               **TOL[jnp.float32])

  def test_splits_follow_the_work_size(self):
    plan = functools.partial(kernel_triton.plan, num_kv_heads=8, group=4, max_q_len=1,
                             page_size=16, block_sizes=kernel_triton.BlockSizes())
    few_long = plan(num_seqs=1, max_pages_per_seq=2048)      # 32k tokens, one sequence
    many_short = plan(num_seqs=128, max_pages_per_seq=32)    # 512 tokens, 128 sequences
    self.assertGreater(few_long.num_splits, 16)
    self.assertEqual(many_short.num_splits, 1)

  def test_bf16_decode_reads_64_keys_over_3_stages(self):
    # The GPU-measured decode tiles (kernel_triton.DECODE_BF16_*): bf16, one query per row,
    # power-of-two heads up to 128; everything else keeps default_tiles.
    plan = functools.partial(kernel_triton.plan, 8, 8, 4, page_size=16, max_pages_per_seq=2048,
                             block_sizes=kernel_triton.BlockSizes())
    for head_dim in (64, 128):
      p = plan(max_q_len=1, head_dim=head_dim, dtype=jnp.bfloat16)
      self.assertEqual((p.block_tokens, p.num_stages, p.block_rows), (64, 3, 16))
    tiles = kernel_triton.default_tiles(jnp.dtype(jnp.bfloat16), "highest", 128, 4)
    for kw in (dict(max_q_len=2, head_dim=128, dtype=jnp.bfloat16),     # not decode
               dict(max_q_len=1, head_dim=96, dtype=jnp.bfloat16),      # not a power of two
               dict(max_q_len=1, head_dim=256, dtype=jnp.bfloat16),
               dict(max_q_len=1, head_dim=128, dtype=jnp.bfloat16, quantized=True),
               dict(max_q_len=1, head_dim=128, dtype=jnp.float32)):
      p = plan(**kw)
      mine = kernel_triton.default_tiles(jnp.dtype(kw["dtype"]), "highest", kw["head_dim"], 4)
      self.assertEqual((p.block_tokens, p.num_stages), (mine.block_tokens, mine.num_stages), kw)
    self.assertEqual((tiles.block_tokens, tiles.num_stages), (32, 2))
    # An explicit BlockSizes still wins.
    p = plan(max_q_len=1, head_dim=128, dtype=jnp.bfloat16,
             block_sizes=kernel_triton.BlockSizes(block_tokens=32, num_stages=2))
    self.assertEqual((p.block_tokens, p.num_stages), (32, 2))


if __name__ == "__main__":
  absltest.main()
