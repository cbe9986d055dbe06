"""Exactness of every attention path against `dense_attention`, NaN-poisoned pools, seeds' examples."""

import contextlib
import math
import re
import types
from unittest import mock

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, testing
from paged_jax.attention import Summary
from pallas_kernels.paged_attention import kernel_triton, reference
from pallas_kernels.paged_attention.merge import merge_along, merge_summaries

TOL = {  # tokamax's table; the bounds.
    jnp.float32: dict(atol=1e-5, rtol=1e-5),
    jnp.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


# Jitted once per shape, so the reference does not dispatch op by op (most of a test's time).
_reference = jax.jit(attention.paged_attention_reference,
                     static_argnames=("scale", "sliding_window", "soft_cap", "max_q_len"))

# Every page size and head layout in f32; bf16 on a spread of them (interpret-sized shapes keep the
# suite fast).
_DECODE_CASES = [dict(page_size=p, heads=h, dtype=jnp.float32)
                 for p in (1, 4, 16, 32) for h in ((4, 4), (4, 2), (4, 1))] + [
                     dict(page_size=4, heads=(4, 2), dtype=jnp.bfloat16),
                     dict(page_size=16, heads=(4, 1), dtype=jnp.bfloat16),
                     dict(page_size=1, heads=(4, 4), dtype=jnp.bfloat16)]
_RAGGED_CASES = [dict(page_size=1, dtype=jnp.float32, window_cap=(None, None)),
                 dict(page_size=4, dtype=jnp.float32, window_cap=(5, None)),
                 dict(page_size=4, dtype=jnp.float32, window_cap=(None, 3.0)),
                 dict(page_size=16, dtype=jnp.float32, window_cap=(7, 2.5)),
                 dict(page_size=4, dtype=jnp.bfloat16, window_cap=(7, 2.5))]


def _lens_around(page_size):
  """0, 1, page-1, page, page+1 and a long one (deduplicated, sorted)."""
  return sorted({0, 1, max(page_size - 1, 1), page_size, page_size + 1, 3 * page_size + 2})


class PagedAttentionTest(parameterized.TestCase):

  @parameterized.parameters(*_DECODE_CASES)
  def test_decode_matches_dense(self, page_size, heads, dtype):
    num_q_heads, num_kv_heads = heads
    seq_lens = _lens_around(page_size)
    # A zero-length row has no query either (q_len <= kv_len).
    q_lens = [min(1, n) for n in seq_lens]
    inp = testing.random_paged_inputs(page_size, seq_lens, q_lens=q_lens, page_size=page_size,
                                      num_kv_heads=num_kv_heads,
                                      q_per_kv=num_q_heads // num_kv_heads, dtype=dtype,
                                      pad_tokens=1)
    ref = _reference(*inp)
    # pages_per_block=1 forces one merge per page: the merge rule is what is under test. "cpu":
    # the C++ kernel ("auto" on a CPU), one merge per page by construction.
    for impl, ppb in (("xla", 1), ("xla", None), ("cpu", None)):
      out = attention.paged_attention(*inp, max_q_len=1, pages_per_block=ppb, impl=impl)
      self.assertFalse(np.isnan(np.asarray(out, np.float32)).any())
      chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])

  @parameterized.parameters(*_RAGGED_CASES)
  def test_ragged_prefill_and_decode_mixed(self, page_size, dtype, window_cap):
    window, cap = window_cap
    seq_lens = [page_size + 1, 1, 3 * page_size + 2, 9, 0]
    q_lens = [page_size + 1, 1, 5, 1, 0]   # full prefill, decode, chunk after a prefix, ...
    inp = testing.random_paged_inputs(7, seq_lens, q_lens=q_lens, page_size=page_size,
                                      num_kv_heads=2, q_per_kv=2, dtype=dtype, pad_tokens=3)
    kw = dict(sliding_window=window, soft_cap=cap, scale=0.3)
    ref = _reference(*inp, **kw)
    out = attention.paged_attention(*inp, pages_per_block=2, **kw)
    chex.assert_trees_all_close(out.astype(jnp.float32), ref.astype(jnp.float32), **TOL[dtype])
    self.assertFalse(np.isnan(np.asarray(out, np.float32)).any())
    # Padding tokens (after cu_q_lens[-1]) and the zero-length row get zeros.
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0)

  def test_contiguous_path_matches_dense(self):
    inp = testing.random_paged_inputs(3, [5, 17, 1], q_lens=[5, 2, 1], page_size=4, poison=False)
    k = jnp.asarray(testing.pages_to_dense(inp.k_pages, inp.block_tables, inp.seq_lens))
    v = jnp.asarray(testing.pages_to_dense(inp.v_pages, inp.block_tables, inp.seq_lens))
    ref = attention.dense_attention(inp.q, k, v, inp.cu_q_lens, inp.seq_lens)
    out = attention.contiguous_attention(inp.q, k, v, inp.seq_lens, inp.cu_q_lens, block_tokens=4)
    chex.assert_trees_all_close(out, ref, **TOL[jnp.float32])

  def test_output_does_not_depend_on_page_placement(self):
    a = testing.random_paged_inputs(11, [9, 14], page_size=4, shuffle_pages=False)
    b = testing.random_paged_inputs(11, [9, 14], page_size=4, shuffle_pages=True)
    # Same random draws, different physical pages: the gathered K/V must agree, and so the output.
    np.testing.assert_array_equal(
        testing.pages_to_dense(a.k_pages, a.block_tables, a.seq_lens),
        testing.pages_to_dense(b.k_pages, b.block_tables, b.seq_lens))
    self.assertFalse(np.array_equal(np.asarray(a.block_tables), np.asarray(b.block_tables)))
    chex.assert_trees_all_close(attention.paged_attention(*a, pages_per_block=1),
                                attention.paged_attention(*b, pages_per_block=1), atol=1e-6)

  def test_nan_in_stale_slot_of_last_page_is_not_read(self):
    # The failure JAX's GPU kernel has: NaN in V past the length, inside the last page.
    inp = testing.random_paged_inputs(5, [6], page_size=4, poison=False)
    page = int(inp.block_tables[0, 1])
    v_pages = inp.v_pages.at[page, 2:].set(jnp.nan)
    k_pages = inp.k_pages.at[page, 3].set(jnp.inf)
    out = attention.paged_attention(inp.q, k_pages, v_pages, *inp[3:])
    ref = _reference(*inp)
    chex.assert_trees_all_close(out, ref, **TOL[jnp.float32])

  def test_return_lse_and_merge_states_recombine_a_split(self):
    # Attention over keys [0, 12) equals the merge of attention over [0, 8) and [8, 12).
    inp = testing.random_paged_inputs(2, [12, 12], page_size=4, poison=False)
    q = inp.q
    full = _reference(*inp)
    k = jnp.asarray(testing.pages_to_dense(inp.k_pages, inp.block_tables, inp.seq_lens))
    v = jnp.asarray(testing.pages_to_dense(inp.v_pages, inp.block_tables, inp.seq_lens))
    cu = inp.cu_q_lens
    # The first part is a non-causal view: give it kv_len 8 and pretend the query is at 8.
    o_a, lse_a = attention.contiguous_attention(
        q, k[:, :8], v[:, :8], jnp.array([8, 8], jnp.int32), cu, return_lse=True)
    # The second part sees keys 8..11; shift them to positions 0..3 with kv_len 4.
    o_b, lse_b = attention.contiguous_attention(
        q, k[:, 8:], v[:, 8:], jnp.array([4, 4], jnp.int32), cu, return_lse=True)
    o, lse = attention.merge_states(o_a, lse_a, o_b, lse_b)
    chex.assert_trees_all_close(o, full, **TOL[jnp.float32])
    _, lse_full = attention.paged_attention(*inp, return_lse=True)
    chex.assert_trees_all_close(lse, lse_full, **TOL[jnp.float32])

  def test_merge_states_of_empty_states_is_zero_not_nan(self):
    o = jnp.full((3, 4), 7.0)
    lse = jnp.full((3,), -jnp.inf)
    merged, merged_lse = attention.merge_states(o, lse, o, lse)
    np.testing.assert_array_equal(np.asarray(merged), 0)
    self.assertTrue(np.all(np.isneginf(np.asarray(merged_lse))))
    # One empty side leaves the other unchanged.
    o_b, lse_b = jnp.arange(12.0).reshape(3, 4), jnp.array([0.5, -1.0, 2.0])
    merged, merged_lse = attention.merge_states(o, lse, o_b, lse_b)
    chex.assert_trees_all_close(merged, o_b, atol=1e-6)
    chex.assert_trees_all_close(merged_lse, lse_b, atol=1e-6)


class PrefillAttentionTest(parameterized.TestCase):
  """The engine's XLA split: prefill chunks over own K/V + cached prefix, decode rows apart."""

  @parameterized.product(tile=(1, 4, 64), window_cap=((None, None), (5, None), (6, 2.5)))
  def test_causal_ragged_attention_matches_dense(self, tile, window_cap):
    window, cap = window_cap
    lens = [7, 1, 13, 4, 0, 9]   # rows straddle tiles; one empty row
    inp = testing.random_paged_inputs(3, lens, q_lens=lens, page_size=4, pad_tokens=2)
    k, v = testing.step_kv(inp)
    kw = dict(sliding_window=window, soft_cap=cap, scale=0.4)
    o, lse = attention.causal_ragged_attention(inp.q, k, v, inp.cu_q_lens, max_q_len=16,
                                               tile_tokens=tile, **kw)
    chex.assert_trees_all_close(o, _reference(*inp, **kw), **TOL[jnp.float32])
    _, lse_ref = attention.paged_attention(*inp, return_lse=True, impl="xla", **kw)
    chex.assert_trees_all_close(lse, lse_ref, **TOL[jnp.float32])
    np.testing.assert_array_equal(np.asarray(o[-2:]), 0)   # padding tokens
    self.assertTrue(np.all(np.isneginf(np.asarray(lse[-2:]))))

  def test_kv_lens_reads_only_the_prefix(self):
    # Keys [0, kv_len) with queries where they really are (after the prefix): the prefix alone.
    inp = testing.random_paged_inputs(4, [9, 6], q_lens=[3, 2], page_size=4, poison=False)
    prefix = jnp.array([6, 4], jnp.int32)
    o, _ = attention.paged_attention_xla(*inp, max_q_len=4, kv_lens=prefix, return_lse=True)
    k = jnp.asarray(testing.pages_to_dense(inp.k_pages, inp.block_tables, prefix))
    v = jnp.asarray(testing.pages_to_dense(inp.v_pages, inp.block_tables, prefix))
    # Every prefix key precedes every query: a non-causal view with kv_len = prefix and each
    # query placed at the end (q_len 1 rows, one per query token).
    rows = np.repeat(np.arange(2), [3, 2])
    ref = attention.dense_attention(inp.q, k[rows], v[rows], jnp.arange(6, dtype=jnp.int32),
                                    prefix[rows])
    chex.assert_trees_all_close(o, ref, **TOL[jnp.float32])

  @parameterized.parameters(jnp.float32, jnp.bfloat16)
  def test_prefill_attention_with_and_without_prefix(self, dtype):
    seq_lens = [5, 13, 9, 4]
    q_lens = [5, 6, 1, 4]      # fresh, after a 7-token prefix, one token after 8, fresh
    inp = testing.random_paged_inputs(6, seq_lens, q_lens=q_lens, page_size=4, dtype=dtype,
                                      pad_tokens=3)
    k, v = testing.step_kv(inp)
    kw = dict(sliding_window=6, scale=0.3)
    out = attention.prefill_attention(inp.q, k, v, *inp[1:], max_q_len=8, tile_tokens=4, **kw)
    chex.assert_trees_all_close(out.astype(jnp.float32),
                                _reference(*inp, **kw).astype(jnp.float32), **TOL[dtype])
    self.assertFalse(np.isnan(np.asarray(out, np.float32)).any())   # NaN-poisoned pool

  @parameterized.parameters(0, 2, 3)
  def test_step_attention_decode_rows_then_chunks(self, num_decode):
    seq_lens = [9, 1, 17][:num_decode] + [6, 11, 0]
    q_lens = [1, 1, 1][:num_decode] + [6, 3, 0]
    inp = testing.random_paged_inputs(8, seq_lens, q_lens=q_lens, page_size=4, pad_tokens=1)
    k, v = testing.step_kv(inp)
    out = attention.step_attention(inp.q, k, v, *inp[1:], num_decode=num_decode, max_q_len=8,
                                   impl="xla", soft_cap=3.0)
    chex.assert_trees_all_close(out, _reference(*inp, soft_cap=3.0), **TOL[jnp.float32])


class TokenPositionsTest(absltest.TestCase):

  def test_rows_and_positions(self):
    # Rows of 2 (after 3 keys), 0 and 3 (fresh) queries, then a padding token.
    row, position = attention.token_positions(jnp.asarray([5, 4, 3]), jnp.asarray([0, 2, 2, 5]),
                                              jnp.arange(6))
    np.testing.assert_array_equal(row, [0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(position[:5], [3, 4, 0, 1, 2])


class PrefillEdgeTest(parameterized.TestCase):
  """The XLA split's edges: empty and one-token batches, a prefix of one key, more decode rows
  than heads, and the options `causal_ragged_attention` checks itself."""

  def test_empty_batches(self):
    inp = testing.random_paged_inputs(1, [5, 9], q_lens=[2, 1], page_size=4, dtype=jnp.bfloat16)
    inp = inp._replace(q=inp.q[:0], cu_q_lens=jnp.zeros(3, jnp.int32))
    k = jnp.zeros((0, 2, 16), jnp.bfloat16)
    o, lse = attention.causal_ragged_attention(inp.q, k, k, inp.cu_q_lens, max_q_len=1)
    self.assertEqual((o.shape, o.dtype, lse.shape, lse.dtype),
                     ((0, 4, 16), jnp.bfloat16, (0, 4), jnp.float32))
    o = attention.prefill_attention(inp.q, k, k, *inp[1:], max_q_len=1)
    self.assertEqual((o.shape, o.dtype), ((0, 4, 16), jnp.bfloat16))

  def test_bf16_in_bf16_out(self):
    inp = testing.random_paged_inputs(3, [5, 9], q_lens=[5, 2], page_size=4, dtype=jnp.bfloat16)
    k, v = testing.step_kv(inp)
    o, lse = attention.causal_ragged_attention(inp.q, k, v, inp.cu_q_lens, max_q_len=5)
    self.assertEqual((o.dtype, lse.dtype), (jnp.bfloat16, jnp.float32))
    self.assertEqual(attention.prefill_attention(inp.q, k, v, *inp[1:], max_q_len=5).dtype,
                     jnp.bfloat16)

  @parameterized.parameters(None, 1)
  def test_xla_paths_keep_bf16_and_padding_lse_is_minus_inf(self, max_q_len):
    # Two padding tokens after the rows' queries (max_q_len None: paged_attention_xla; 1:
    # decode_attention_xla).
    inp = testing.random_paged_inputs(3, [5, 9], page_size=4, dtype=jnp.bfloat16, pad_tokens=2)
    o, lse = attention.paged_attention(*inp, max_q_len=max_q_len, impl="xla", return_lse=True)
    self.assertEqual((o.dtype, lse.dtype), (jnp.bfloat16, jnp.float32))
    self.assertTrue(np.all(np.isneginf(np.asarray(lse[2:]))))
    self.assertTrue(np.all(np.isfinite(np.asarray(lse[:2]))))
    np.testing.assert_array_equal(np.asarray(o[2:], np.float32), 0)

  @parameterized.parameters(([1], [1]), ([5], [1]), ([4, 3], [3, 3]), ([2, 6], [1, 5]),
                            ([1] * 5, [1] * 5))
  def test_one_token_rows_and_one_key_prefixes(self, seq_lens, q_lens):
    # One-token batches and rows (five fresh one-token prompts fill causal's tile slots exactly:
    # one tile more per row would push the last row past them); prefixes of exactly one key
    # (the smallest that must be read).
    inp = testing.random_paged_inputs(2, seq_lens, q_lens=q_lens, page_size=4)
    k, v = testing.step_kv(inp)
    out = attention.prefill_attention(inp.q, k, v, *inp[1:], max_q_len=max(q_lens), scale=0.3)
    chex.assert_trees_all_close(out, _reference(*inp, scale=0.3), **TOL[jnp.float32])
    if seq_lens == q_lens:   # no prefix: the causal part alone
      o, _ = attention.causal_ragged_attention(inp.q, k, v, inp.cu_q_lens, max_q_len=max(q_lens),
                                               scale=0.3)
      chex.assert_trees_all_close(o, _reference(*inp, scale=0.3), **TOL[jnp.float32])

  def test_more_decode_rows_than_heads(self):
    # 5 decode rows, then a chunk of 3: num_decode exceeds the 4 query heads.
    inp = testing.random_paged_inputs(5, [3, 7, 1, 9, 4, 6], q_lens=[1] * 5 + [3], page_size=4)
    k, v = testing.step_kv(inp)
    out = attention.step_attention(inp.q, k, v, *inp[1:], num_decode=5, max_q_len=3, impl="xla")
    chex.assert_trees_all_close(out, _reference(*inp), **TOL[jnp.float32])

  @parameterized.named_parameters(
      ("window", dict(sliding_window=0), "sliding_window=0 must be >= 1 (None: no window)"),
      ("cap", dict(soft_cap=0.0), "soft_cap=0.0 must be > 0 (None: no capping)"),
      ("bound", dict(max_q_len=2),
       "sequence 0: q_len=3 exceeds max_q_len=2 (its queries past the bound would be dropped)"))
  def test_causal_checks_its_options(self, kw, message):
    inp = testing.random_paged_inputs(1, [3, 2], q_lens=[3, 2], page_size=4)
    k, v = testing.step_kv(inp)
    kw = dict(dict(max_q_len=3), **kw)
    with self.assertRaisesRegex(ValueError, f"^{re.escape(message)}$"):
      attention.causal_ragged_attention(inp.q, k, v, inp.cu_q_lens, **kw)


class StepDispatchTest(parameterized.TestCase):
  """Which path `step_attention` takes, with what: the kernel in one launch (`paged_attention`)
  or the XLA split (decode rows, then prefill chunks). Both give the same numbers, so the route
  is observed by standing in for `paged_attention` and for the device's answer."""

  def setUp(self):
    super().setUp()
    self.inp = testing.random_paged_inputs(8, [9, 1, 6, 11], q_lens=[1, 1, 6, 3], page_size=4,
                                           pad_tokens=1)
    self.k, self.v = testing.step_kv(self.inp)
    self.kw = dict(scale=0.3, sliding_window=5, soft_cap=3.0)

  def _step(self, **kw):
    return attention.step_attention(self.inp.q, self.k, self.v, *self.inp[1:], num_decode=2,
                                    max_q_len=6, **self.kw, **kw)

  def test_options_reach_the_xla_split(self):
    # The default impl is "auto", which is the XLA split on the CPU.
    chex.assert_trees_all_close(self._step(), _reference(*self.inp, **self.kw),
                                **TOL[jnp.float32])

  @contextlib.contextmanager
  def _stand_ins(self, reason, launcher, name):
    """The device's answer `reason`, and `launcher.name` recording its calls (q, args, kwargs)
    and returning zeros; yields the two lists of calls."""
    asked, launched = [], []

    def unavailable(*args, **kwargs):
      asked.append((args, kwargs))
      return reason

    def launch(q, *args, **kwargs):
      launched.append((q, args, kwargs))
      return jnp.zeros_like(q)

    with mock.patch.object(attention, "kernel_unavailable_reason", unavailable), \
         mock.patch.object(launcher, name, launch):
      yield asked, launched

  @parameterized.parameters(
      # (impl, the device's reason the kernel cannot run, whether the kernel launch is taken)
      ("auto", "no GPU here", False), ("auto", None, True), ("xla", None, False),
      ("xla", "no GPU here", False), ("pallas", "no GPU here", True),
      ("interpret", "no GPU here", True), ("interpret", None, True))
  def test_route(self, impl, reason, kernel):
    with self._stand_ins(reason, attention, "paged_attention") as (asked, launched):
      out = self._step(impl=impl)
    self.assertEqual(asked, [((16, 4), {})])   # this call's head_dim and page_size
    if kernel:
      ((q, args, kwargs),) = launched
      self.assertIs(q, self.inp.q)
      self.assertEqual(len(args), 5)   # pages, tables and lengths, passed on as they came
      self.assertTrue(all(a is b for a, b in zip(args, self.inp[1:])))
      self.assertEqual(kwargs, dict(max_q_len=6, impl=impl, **self.kw))
      np.testing.assert_array_equal(out, 0)
    else:
      self.assertEqual(launched, [])
      chex.assert_trees_all_close(out, _reference(*self.inp, **self.kw), **TOL[jnp.float32])

  def test_decode_only_asks_the_kernel_for_one_query_rows(self):
    inp = testing.random_paged_inputs(8, [9, 1], page_size=4)
    k, v = testing.step_kv(inp)
    with mock.patch.object(attention, "paged_attention",
                           lambda q, *a, **kw: (self.assertEqual(kw["max_q_len"], 1), q)[1]):
      attention.step_attention(inp.q, k, v, *inp[1:], num_decode=2, max_q_len=0,
                               impl="interpret")

  @parameterized.parameters(
      # (impl, interpret, the device's reason the kernel cannot run, what runs: the kernel
      # compiled, interpreted, or the XLA path)
      ("interpret", False, "no GPU here", "interpreted"), ("pallas", True, "no GPU here",
      "interpreted"), ("auto", False, "no GPU here", "xla"), ("xla", False, None, "xla"),
      ("auto", False, None, "compiled"), ("pallas", False, None, "compiled"))
  def test_paged_attention_route(self, impl, interpret, reason, runs):
    with self._stand_ins(reason, kernel_triton, "paged_attention") as (asked, launched):
      out = attention.paged_attention(*self.inp, max_q_len=6, impl=impl, interpret=interpret,
                                      precision="tf32x3")
    self.assertEqual(asked, [((16, 4), {})])   # this call's head_dim and page_size
    if runs == "xla":
      self.assertEqual(launched, [])
      chex.assert_trees_all_close(out, _reference(*self.inp), **TOL[jnp.float32])
    else:
      self.assertEqual([kwargs for _, _, kwargs in launched], [dict(block_sizes=kernel_triton.BlockSizes(),
                                       interpret=runs == "interpreted", precision="tf32x3",
                                       max_q_len=6, scale=None, sliding_window=None,
                                       soft_cap=None, return_lse=False)])

  def test_decode_rows_through_the_dispatcher_keep_their_options(self):
    # max_q_len=1 takes decode_attention_xla; the options and return_lse must go with it.
    inp = testing.random_paged_inputs(4, [9, 1, 17], page_size=4)
    for impl in ("xla", "cpu"):   # decode_attention_xla, the C++ CPU kernel
      o, lse = attention.paged_attention(*inp, max_q_len=1, impl=impl, return_lse=True, **self.kw)
      chex.assert_trees_all_close(o, _reference(*inp, **self.kw), **TOL[jnp.float32])
      _, lse_ref = attention.paged_attention_xla(*inp, return_lse=True, **self.kw)
      chex.assert_trees_all_close(lse, lse_ref, **TOL[jnp.float32])

  def test_unknown_impl_is_named(self):
    with self.assertRaisesRegex(ValueError, r"^impl='triton' is not one of \('auto', 'xla', "
                                r"'pallas', 'interpret', 'cpu'\)$"):
      self._step(impl="triton")


class IndependentReferenceTest(parameterized.TestCase):
  """The XLA path and the dense reference against `testing.naive_paged_attention`: float64 loops
  with their own masking, sharing no helper (`attention_mask`, `ragged_to_padded`) with either,
  so a bug in a shared helper cannot hide on both sides of a comparison."""

  def test_the_oracle_reproduces_the_seeds_example(self):
    K = np.array([[0.0, 1.0], [math.log(2), 0.0], [math.log(3), 1.0], [math.log(4), -1.0]])
    V = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [2.0, 4.0]])
    k_pages = np.full((10, 2, 1, 2), np.nan)
    v_pages = np.full((10, 2, 1, 2), np.nan)
    k_pages[9, :, 0], k_pages[2, :, 0] = K[:2], K[2:]
    v_pages[9, :, 0], v_pages[2, :, 0] = V[:2], V[2:]
    out = testing.naive_paged_attention(np.array([[[math.sqrt(2), 0.0]]]), k_pages, v_pages,
                                        [[9, 2]], [4], [0, 1])
    np.testing.assert_allclose(out[0, 0], [1.8, 2.3], atol=1e-12)

  @parameterized.parameters(
      dict(page_size=1, q_per_kv=1, window=None, cap=None),
      dict(page_size=4, q_per_kv=2, window=1, cap=None),
      dict(page_size=4, q_per_kv=4, window=3, cap=2.5),
      dict(page_size=4, q_per_kv=1, window=4, cap=None),
      dict(page_size=4, q_per_kv=2, window=5, cap=30.0),
      dict(page_size=16, q_per_kv=4, window=100, cap=None),
      dict(page_size=16, q_per_kv=2, window=17, cap=2.5),
  )
  def test_xla_and_dense_match_the_oracle(self, page_size, q_per_kv, window, cap):
    seq_lens = [page_size + 1, 1, 3 * page_size + 2, 9, 0, 2 * page_size, 3 * page_size - 1]
    q_lens = [page_size + 1, 1, 5, 1, 0, page_size, 1]
    inp = testing.random_paged_inputs(11, seq_lens, q_lens=q_lens, page_size=page_size,
                                      num_kv_heads=2, q_per_kv=q_per_kv, pad_tokens=2)
    kw = dict(sliding_window=window, soft_cap=cap, scale=0.3)
    oracle = testing.naive_paged_attention(*inp, **kw)
    xla = attention.paged_attention(*inp, impl="xla", pages_per_block=1, **kw)
    dense = _reference(*inp, **kw)
    for out in (xla, dense):
      np.testing.assert_allclose(np.asarray(out, np.float64), oracle, **TOL[jnp.float32])


  def test_each_query_shifts_by_its_own_max(self):
    # Scores in the hundreds (scale 50 on unit-normal q.k of std 4): queries' best scores differ
    # by far more than f32's exp range (~88), so a max shared by all queries would underflow
    # a query's every weight to 0, and adding the max instead of subtracting it would overflow.
    inp = testing.random_paged_inputs(3, [6, 7, 5], q_lens=[3, 2, 5], page_size=4)
    oracle = testing.naive_paged_attention(*inp, scale=50.0)
    # The weights are nearly one-hot; an f32 score of ~500 carries ~3e-5 absolute error, which
    # moves a weight by as much where two scores are within a few units: rtol 1e-4.
    for out in (attention.paged_attention(*inp, impl="xla", scale=50.0),
                _reference(*inp, scale=50.0)):
      np.testing.assert_allclose(np.asarray(out, np.float64), oracle, rtol=1e-4, atol=1e-4)


class DecodeWorkItemsTest(parameterized.TestCase):
  """`decode_attention_xla` (one query per row, split into (row, key block) work items merged by
  scatter) against the float64 oracle: windows around a block's edges, blocks of 1-3 pages,
  chunks smaller than one row's items (a row's items spread over several loop iterations)."""

  @parameterized.product(window=(None, 1, 3, 4, 5, 100), blocks=((1, 1), (2, 3), (3, 64)))
  def test_matches_the_oracle(self, window, blocks):
    pages_per_block, items_per_chunk = blocks
    page_size = 4
    # Rows: long, a padding row (0 keys), one key, a row with keys but no query, lengths around
    # the page and block edges; pad_tokens adds query tokens past the last row.
    seq_lens = [3 * 12 + 2, 0, 1, 6, page_size, page_size + 1, 2 * 12 - 1, 12]
    q_lens = [1, 0, 1, 0, 1, 1, 1, 1]
    inp = testing.random_paged_inputs(13, seq_lens, q_lens=q_lens, page_size=page_size,
                                      num_kv_heads=2, q_per_kv=2, pad_tokens=2)
    cap = 2.5 if window in (3, 100) else None
    kw = dict(sliding_window=window, soft_cap=cap, scale=0.3)
    oracle = testing.naive_paged_attention(*inp, **kw)
    out, lse = attention.decode_attention_xla(*inp, pages_per_block=pages_per_block,
                                              items_per_chunk=items_per_chunk, return_lse=True,
                                              **kw)
    np.testing.assert_allclose(np.asarray(out, np.float64), oracle, **TOL[jnp.float32])
    _, lse_blocked = attention.paged_attention_xla(*inp, max_q_len=1, return_lse=True, **kw)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_blocked), **TOL[jnp.float32])

  @parameterized.parameters(221, 400)
  def test_one_row_with_the_default_chunk(self, seq_len):
    # One user: the default chunk shrinks to DECODE_ITEMS_PER_ROW items; at 400 keys (13 items
    # of 32) the row's items spread over two loop iterations.
    self.assertEqual(attention.decode_items_per_chunk(1), attention.DECODE_ITEMS_PER_ROW)
    self.assertEqual(attention.decode_items_per_chunk(8), attention.DECODE_ITEMS_PER_CHUNK)
    self.assertEqual(attention.decode_items_per_chunk(64), attention.DECODE_ITEMS_PER_CHUNK)
    inp = testing.random_paged_inputs(17, [seq_len], q_lens=[1], page_size=16, num_kv_heads=3,
                                      q_per_kv=3)
    np.testing.assert_allclose(np.asarray(attention.decode_attention_xla(*inp), np.float64),
                               testing.naive_paged_attention(*inp), **TOL[jnp.float32])

  def test_the_dispatcher_sends_decode_rows_here(self):
    inp = testing.random_paged_inputs(3, [9, 30, 2], page_size=4, pad_tokens=1)
    chex.assert_trees_all_equal(attention.paged_attention(*inp, max_q_len=1, impl="xla"),
                                attention.decode_attention_xla(*inp))


class SeedExamplesTest(absltest.TestCase):
  """The worked numbers of the seeds (section 10 and 11 of the first document), exactly."""

  q = jnp.array([[math.sqrt(2), 0.0]])
  K = jnp.array([[0.0, 1.0], [math.log(2), 0.0], [math.log(3), 1.0], [math.log(4), -1.0]])
  V = jnp.array([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [2.0, 4.0]])

  def test_four_token_example_dense(self):
    s = (self.q @ self.K.T / math.sqrt(2))[0]
    chex.assert_trees_all_close(jnp.exp(s), jnp.array([1.0, 2, 3, 4]), atol=1e-6)
    out = attention.dense_attention(self.q[None].reshape(1, 1, 2), self.K[None, :, None],
                                    self.V[None, :, None], jnp.array([0, 1], jnp.int32),
                                    jnp.array([4], jnp.int32))
    chex.assert_trees_all_close(out[0, 0], jnp.array([1.8, 2.3]), atol=1e-6)

  def test_two_pages_9_and_2(self):
    # Two tokens per page; tokens 0-1 in physical page 9, tokens 2-3 in physical page 2.
    k_pages = jnp.full((10, 2, 1, 2), jnp.nan).at[9, :, 0].set(self.K[:2]).at[2, :, 0].set(self.K[2:])
    v_pages = jnp.full((10, 2, 1, 2), jnp.nan).at[9, :, 0].set(self.V[:2]).at[2, :, 0].set(self.V[2:])
    args = (self.q.reshape(1, 1, 2), k_pages, v_pages, jnp.array([[9, 2]], jnp.int32),
            jnp.array([4], jnp.int32), jnp.array([0, 1], jnp.int32))
    out = attention.paged_attention(*args, pages_per_block=1)
    chex.assert_trees_all_close(out[0, 0], jnp.array([1.8, 2.3]), atol=1e-6)

  def test_page_sums_and_stable_merge(self):
    s = (self.q @ self.K.T / math.sqrt(2))[0]
    a = attention.block_summary(s[:2], self.V[:2])
    b = attention.block_summary(s[2:], self.V[2:])
    # Unshifted sums Z and N of section 10: Z = z * e^m, N = u * e^m.
    chex.assert_trees_all_close(a.z * jnp.exp(a.m), 3.0, atol=1e-6)
    chex.assert_trees_all_close(a.u * jnp.exp(a.m), jnp.array([1.0, 4.0]), atol=1e-6)
    chex.assert_trees_all_close(b.z * jnp.exp(b.m), 7.0, atol=1e-5)
    chex.assert_trees_all_close(b.u * jnp.exp(b.m), jnp.array([17.0, 19.0]), atol=1e-5)
    # Shifted summaries of section 11.
    chex.assert_trees_all_close(a, Summary(jnp.float32(math.log(2)), jnp.float32(1.5),
                                           jnp.array([0.5, 2.0])), atol=1e-6)
    chex.assert_trees_all_close(b, Summary(jnp.float32(math.log(4)), jnp.float32(1.75),
                                           jnp.array([4.25, 4.75])), atol=1e-6)
    merged = attention.merge_summaries(a, b)
    chex.assert_trees_all_close(merged.z, 2.5, atol=1e-6)
    chex.assert_trees_all_close(merged.u, jnp.array([4.5, 5.75]), atol=1e-6)
    o, _ = attention.finalize(merged)
    chex.assert_trees_all_close(o, jnp.array([1.8, 2.3]), atol=1e-6)


class MergeTest(absltest.TestCase):
  """`merge.block_summary` and `merge.merge_along` on their own, against float64 softmax."""

  def test_each_query_shifts_by_its_own_max(self):
    # Scores of very different scales per query: a shared shift would underflow one of them.
    s = jnp.array([[100.0, 99.0, -jnp.inf], [-100.0, -101.0, -102.0], [-jnp.inf] * 3])
    v = jnp.arange(9.0).reshape(3, 3, 1) + 1.0
    summary = attention.block_summary(s, v)
    chex.assert_trees_all_close(summary.m, jnp.array([100.0, -100.0, -jnp.inf]))
    o, lse = attention.finalize(summary)
    s64 = np.asarray(s, np.float64)
    for i in range(2):
      p = np.exp(s64[i] - s64[i].max())
      np.testing.assert_allclose(o[i, 0], (p / p.sum()) @ np.asarray(v[i, :, 0]), rtol=1e-6)
      np.testing.assert_allclose(lse[i], s64[i].max() + np.log(p.sum()), rtol=1e-6)
    self.assertEqual((float(o[2, 0]), float(lse[2])), (0.0, -np.inf))

  def test_merge_along_equals_pairwise_merges(self):
    rng = np.random.default_rng(0)
    m = rng.normal(0, 30, (3, 4)).astype(np.float32)
    m[1, 2] = m[0, 3] = -np.inf                 # empty summaries are the identity
    m[:, 0] = -np.inf                           # a query every split missed
    z = np.where(np.isfinite(m), rng.uniform(1, 3, m.shape), 0).astype(np.float32)
    u = (z[..., None] * rng.normal(size=m.shape + (5,))).astype(np.float32)
    stacked = Summary(jnp.asarray(m), jnp.asarray(z), jnp.asarray(u))
    want = Summary(*(x[0] for x in stacked))
    for i in (1, 2):
      want = merge_summaries(want, Summary(*(x[i] for x in stacked)))
    chex.assert_trees_all_close(merge_along(stacked), want, rtol=1e-6)      # axis 0 by default
    moved = Summary(stacked.m.T, stacked.z.T, jnp.swapaxes(stacked.u, 0, 1))
    chex.assert_trees_all_close(merge_along(moved, axis=1), want, rtol=1e-6)
    self.assertEqual(float(want.m[0]), -np.inf)
    self.assertEqual(float(want.z[0]), 0.0)


class CompileOnceTest(absltest.TestCase):

  def test_traces_once_per_shape_bucket(self):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=2)
    def step(*args):
      return attention.paged_attention(*args, max_q_len=1, pages_per_block=2)

    for seed, lens in enumerate(([1, 5, 9], [3, 12, 2], [11, 11, 0])):   # one bucket: 3 seqs
      q_lens = [min(1, n) for n in lens]
      inp = testing.random_paged_inputs(seed, lens, q_lens=q_lens, pad_tokens=3 - sum(q_lens),
                                        page_size=4, num_free_pages=2,
                                        extra_table_columns=4 - -(-max(lens) // 4))
      self.assertEqual(inp.block_tables.shape, (3, 4))
      # Pools of one bucket have the same num_pages: pad every pool to 12 pages.
      pad = 12 - inp.k_pages.shape[0]
      inp = inp._replace(k_pages=jnp.pad(inp.k_pages, ((0, pad), (0, 0), (0, 0), (0, 0))),
                         v_pages=jnp.pad(inp.v_pages, ((0, pad), (0, 0), (0, 0), (0, 0))))
      step(*inp).block_until_ready()
    inp = testing.random_paged_inputs(0, [1, 2, 3, 4, 5], page_size=4)   # second bucket
    step(*inp).block_until_ready()
    with self.assertRaises(AssertionError):   # a third shape would be one trace too many
      step(*testing.random_paged_inputs(0, [1, 2], page_size=4)).block_until_ready()


class BadInputTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.inp = testing.random_paged_inputs(0, [5, 9], q_lens=[2, 1], page_size=4)

  def _call(self, **changes):
    inp = self.inp._replace(**changes)
    attention.validate_attention_inputs(*inp)

  def test_valid_inputs_pass(self):
    self._call()

  @parameterized.named_parameters(
      ("heads", "num_q_heads=3 must be divisible by num_kv_heads=2",
       lambda i: dict(q=i.q[:, :3])),
      ("head_dim", "head dims differ", lambda i: dict(q=i.q[..., :8])),
      ("dtype", "dtypes differ", lambda i: dict(q=i.q.astype(jnp.bfloat16))),
      ("table_dtype", "block_tables must be int32", lambda i: dict(block_tables=i.block_tables.astype(jnp.float32))),
      ("lens_dtype", "kv_lens must be int32", lambda i: dict(seq_lens=i.seq_lens.astype(jnp.int16))),
      ("q_len", "sequence 1: q_len=3 is larger than its kv_len=2",
       lambda i: dict(seq_lens=jnp.array([5, 2], jnp.int32), cu_q_lens=jnp.array([0, 0, 3], jnp.int32))),
      ("capacity", "seq_len=17 exceeds the block table's capacity",
       lambda i: dict(seq_lens=jnp.array([5, 17], jnp.int32))),
      ("page_range", "is outside [0, num_pages=",
       lambda i: dict(block_tables=i.block_tables.at[0, 0].set(99))),
      ("negative_page", "=-1 is outside",
       lambda i: dict(block_tables=i.block_tables.at[1, 2].set(-1))),
      ("null_live", "block_tables[1, 2] is NULL_PAGE",
       lambda i: dict(block_tables=i.block_tables.at[1, 2].set(0))),
  )
  def test_rejected_with_named_values(self, message, change):
    with self.assertRaisesRegex(ValueError, message.replace("[", r"\[").replace("]", r"\]")):
      self._call(**change(self.inp))

  @parameterized.named_parameters(
      # 3 query tokens, 9 pages of 4, tables [[6 1 0 0], [2 5 3 0]] (capacity 16 keys).
      ("cu_start", lambda i: dict(cu_q_lens=jnp.array([1, 2, 3], jnp.int32)),
       "cu_q_lens=[1, 2, 3] must start at 0 and never decrease"),
      ("cu_decreasing", lambda i: dict(cu_q_lens=jnp.array([0, 3, 2], jnp.int32)),
       "cu_q_lens=[0, 3, 2] must start at 0 and never decrease"),
      ("cu_past_q", lambda i: dict(cu_q_lens=jnp.array([0, 2, 4], jnp.int32)),
       "cu_q_lens[-1]=4 exceeds num_tokens=3"),
      ("negative_len", lambda i: dict(seq_lens=jnp.array([-1, 9], jnp.int32),
                                      cu_q_lens=jnp.array([0, 0, 1], jnp.int32)),
       "seq_lens=[-1, 9] has negative entries"),
      ("q_len", lambda i: dict(seq_lens=jnp.array([1, 9], jnp.int32)),
       "sequence 0: q_len=2 is larger than its kv_len=1"),
      ("capacity", lambda i: dict(seq_lens=jnp.array([5, 17], jnp.int32)),
       "sequence 1: seq_len=17 exceeds the block table's capacity 4 pages x page_size=4 = 16"),
      ("page_id_is_num_pages", lambda i: dict(block_tables=i.block_tables.at[1, 3].set(9)),
       "block_tables[1, 3]=9 is outside [0, num_pages=9)"),
      ("null_live", lambda i: dict(block_tables=i.block_tables.at[1, 2].set(0)),
       "block_tables[1, 2] is NULL_PAGE but sequence 1 has seq_len=9 tokens, so page 2 is live"),
  )
  def test_value_refusals_say_exactly_what(self, change, message):
    with self.assertRaisesRegex(ValueError, f"^{re.escape(message)}$"):
      self._call(**change(self.inp))

  def test_boundary_values_are_accepted(self):
    i = self.inp
    self._call(seq_lens=jnp.array([2, 9], jnp.int32))     # q_len = kv_len
    self._call(seq_lens=jnp.array([5, 0], jnp.int32), cu_q_lens=jnp.array([0, 2, 2], jnp.int32))
    self._call(cu_q_lens=jnp.array([0, 2, 2], jnp.int32))  # fewer queries than tokens, a q_len 0
    # A full table (the last column's page given to sequence 1) and the last page id.
    self._call(seq_lens=jnp.array([5, 16], jnp.int32), block_tables=i.block_tables.at[1, 3].set(8))

  def test_dispatcher_refusals_say_exactly_what(self):
    with self.assertRaisesRegex(ValueError, r"^impl='cuda' is not one of \('auto', 'xla', "
                                r"'pallas', 'interpret', 'cpu'\)$"):
      attention.paged_attention(*self.inp, impl="cuda")
    with self.assertRaisesRegex(ValueError, "^block_tables must be int32; got int16$"):
      attention.paged_attention(*self.inp._replace(
          block_tables=self.inp.block_tables.astype(jnp.int16)))
    # The kernel forced where it cannot run compiled (here: a CPU), without interpret=True.
    with self.assertRaisesRegex(ValueError, re.escape(
        "impl='pallas' cannot run here: the Triton kernel needs a CUDA GPU; this device is "
        "cpu. Use impl='xla' (or interpret=True to run the kernel through Pallas' interpreter).")):
      attention.paged_attention(*self.inp, impl="pallas")

  def test_jitted_path_rejects_static_problems_too(self):
    with self.assertRaisesRegex(ValueError, "num_q_heads=3"):
      attention.paged_attention(self.inp.q[:, :3], *self.inp[1:])

  # The example: rows (q 5, kv 9) and (q 1, kv 4) with max_q_len=2 dropped three queries.
  _SHORT_BOUND = dict(seq_lens=[9, 4], q_lens=[5, 1])

  @parameterized.parameters("xla", "pallas")
  def test_max_q_len_below_a_rows_q_len_is_refused(self, impl):
    inp = testing.random_paged_inputs(1, **self._SHORT_BOUND, page_size=4)
    kw = dict(interpret=True) if impl == "pallas" else {}
    with self.assertRaisesRegex(ValueError, "sequence 0: q_len=5 exceeds max_q_len=2"):
      attention.paged_attention(*inp, max_q_len=2, impl=impl, **kw)
    with self.assertRaisesRegex(ValueError, "q_len=5 exceeds max_q_len=2"):
      attention.validate_attention_inputs(*inp, max_q_len=2)
    with self.assertRaisesRegex(ValueError, "q_len=5 exceeds max_q_len=2"):
      attention.dense_attention(inp.q, inp.k_pages[inp.block_tables].reshape(2, -1, 2, 16),
                                inp.v_pages[inp.block_tables].reshape(2, -1, 2, 16),
                                inp.cu_q_lens, inp.seq_lens, max_q_len=2)
    got = attention.paged_attention(*inp, max_q_len=5, impl=impl, **kw)   # the true bound works
    chex.assert_trees_all_close(got, _reference(*inp, max_q_len=5), **TOL[jnp.float32])

  @parameterized.named_parameters(
      ("window_0", dict(sliding_window=0), "sliding_window=0 must be >= 1"),
      ("window_negative", dict(sliding_window=-3), "sliding_window=-3 must be >= 1"),
      ("cap_0", dict(soft_cap=0.0), r"soft_cap=0.0 must be > 0"),
      ("cap_negative", dict(soft_cap=-1.0), r"soft_cap=-1.0 must be > 0"),
      ("max_q_len_0", dict(max_q_len=0), "max_q_len=0 must be >= 1"),
  )
  def test_options_that_meant_nothing_are_refused(self, kw, message):
    # Before: a window <= 0 gave zeros and soft_cap=0 uniform weights, silently.
    for fn in (lambda: attention.paged_attention(*self.inp, impl="xla", **kw),
               lambda: attention.paged_attention(*self.inp, impl="pallas", interpret=True, **kw),
               lambda: attention.paged_attention_reference(*self.inp, **kw),
               lambda: jax.jit(lambda *a: attention.paged_attention_xla(*a, **kw))(*self.inp)):
      with self.assertRaisesRegex(ValueError, message):
        fn()

  @parameterized.parameters("xla", "pallas")
  def test_zero_query_tokens(self, impl):
    # A batch with no query tokens (every row q_len 0) returns an empty result on every path.
    inp = self.inp._replace(q=self.inp.q[:0], cu_q_lens=jnp.zeros(3, jnp.int32))
    attention.validate_attention_inputs(*inp)
    kw = dict(interpret=True) if impl == "pallas" else {}
    o, lse = attention.paged_attention(*inp, max_q_len=1, impl=impl, return_lse=True, **kw)
    self.assertEqual((o.shape, lse.shape), ((0, 4, 16), (0, 4)))
    k = jnp.zeros((0, 2, 16))
    o = attention.step_attention(inp.q, k, k, *inp[1:], num_decode=0, max_q_len=1, impl="xla")
    self.assertEqual(o.shape, (0, 4, 16))
    self.assertEqual(attention.paged_attention_reference(*inp).shape, (0, 4, 16))


class ReferenceChecksTest(parameterized.TestCase):
  """reference.check_static_args, the checks every path runs: the whole message, and the
  boundary values that are accepted."""

  def setUp(self):
    super().setUp()
    self.inp = testing.random_paged_inputs(0, [5, 9], q_lens=[2, 1], page_size=4)

  def _check(self, **changes):
    i = self.inp
    args = dict(q=i.q, k=i.k_pages, v=i.v_pages, block_tables_or_none=i.block_tables,
                kv_lens=i.seq_lens, cu_q_lens=i.cu_q_lens)
    options = {key: changes.pop(key) for key in ("max_q_len", "sliding_window", "soft_cap")
               if key in changes}
    args.update(changes)
    reference.check_static_args(*args.values(), **options)

  def test_boundary_values_are_accepted(self):
    self._check(sliding_window=1, soft_cap=1e-6, max_q_len=2)
    self._check(block_tables_or_none=None)
    reference.check_max_q_len(np.array([0], np.int32), 1)   # no rows

  @parameterized.named_parameters(
      ("window", dict(sliding_window=0), "sliding_window=0 must be >= 1 (None: no window)"),
      ("cap", dict(soft_cap=0.0), "soft_cap=0.0 must be > 0 (None: no capping)"),
      ("max_q_len", dict(max_q_len=0), "max_q_len=0 must be >= 1"),
      ("q_rank", lambda i: dict(q=i.q[0]),
       "q must be [num_tokens, num_q_heads, head_dim]; got shape (4, 16)"),
      ("kv_shapes", lambda i: dict(v=i.v_pages[:, :2]),
       "k and v shapes differ: (9, 4, 2, 16) vs (9, 2, 2, 16)"),
      ("v_dtype", lambda i: dict(v=i.v_pages.astype(jnp.bfloat16)),
       "dtypes differ: q=float32, k=float32, v=bfloat16"),
      ("q_dtype", lambda i: dict(q=i.q.astype(jnp.bfloat16)),
       "dtypes differ: q=bfloat16, k=float32, v=float32"),
      ("head_dim", lambda i: dict(q=i.q[..., :8]),
       "head dims differ: q head_dim=8, kv head_dim=16"),
      ("groups", lambda i: dict(q=i.q[:, :3]),
       "num_q_heads=3 must be divisible by num_kv_heads=2"),
      ("kv_lens_dtype", lambda i: dict(kv_lens=i.seq_lens.astype(jnp.int16)),
       "kv_lens must be int32; got int16"),
      ("cu_q_lens_dtype", lambda i: dict(cu_q_lens=i.cu_q_lens.astype(jnp.int16)),
       "cu_q_lens must be int32; got int16"),
      ("table_dtype", lambda i: dict(block_tables_or_none=i.block_tables.astype(jnp.int16)),
       "block_tables must be int32; got int16"),
      ("cu_q_lens_shape", lambda i: dict(cu_q_lens=i.cu_q_lens[:2]),
       "cu_q_lens shape (2,) must be (num_seqs + 1,) = (3,)"),
      ("table_rows", lambda i: dict(block_tables_or_none=i.block_tables[:1]),
       "block_tables has 1 rows but kv_lens has 2"),
      ("q_len_bound", dict(max_q_len=1),
       "sequence 0: q_len=2 exceeds max_q_len=1 (its queries past the bound would be dropped)"),
  )
  def test_each_refusal_says_exactly_what(self, change, message):
    change = change(self.inp) if callable(change) else change
    with self.assertRaisesRegex(ValueError, f"^{re.escape(message)}$"):
      self._check(**change)

  def test_dense_attention_checks_its_own_options(self):
    i = self.inp
    k = reference.gather_pages(i.k_pages, i.block_tables)
    for kw, message in ((dict(sliding_window=0), "sliding_window=0 must be >= 1 (None: no window)"),
                        (dict(soft_cap=-2.0), "soft_cap=-2.0 must be > 0 (None: no capping)")):
      with self.assertRaisesRegex(ValueError, f"^{re.escape(message)}$"):
        reference.dense_attention(i.q, k, k, i.cu_q_lens, i.seq_lens, **kw)

  def test_the_paged_reference_checks_its_block_table(self):
    i = self.inp
    for table, message in ((i.block_tables.astype(jnp.int16),
                            "block_tables must be int32; got int16"),
                           (i.block_tables[:1], "block_tables has 1 rows but kv_lens has 2")):
      with self.assertRaisesRegex(ValueError, f"^{re.escape(message)}$"):
        reference.paged_attention_reference(i.q, i.k_pages, i.v_pages, table, i.seq_lens,
                                            i.cu_q_lens)

  def test_empty_results_keep_the_query_dtype(self):
    q = jnp.zeros((0, 4, 16), jnp.bfloat16)
    o, lse = reference.empty_result(q, return_lse=True)
    self.assertEqual((o.shape, o.dtype, lse.shape, lse.dtype),
                     ((0, 4, 16), jnp.bfloat16, (0, 4), jnp.float32))
    self.assertEqual(reference.empty_result(q).dtype, jnp.bfloat16)

  def test_dense_attention_keeps_the_query_dtype(self):
    i = testing.random_paged_inputs(0, [5, 9], q_lens=[2, 1], page_size=4, dtype=jnp.bfloat16)
    k = reference.gather_pages(i.k_pages, i.block_tables)
    self.assertEqual(reference.dense_attention(i.q, k, k, i.cu_q_lens, i.seq_lens).dtype,
                     jnp.bfloat16)
    none = reference.dense_attention(i.q[:0], k, k, jnp.zeros(3, jnp.int32), i.seq_lens)
    self.assertEqual((none.shape, none.dtype), ((0, 4, 16), jnp.bfloat16))

  def test_a_query_that_sees_no_key_gets_zeros(self):
    # Two queries over one key (the engine never builds this; validate_attention_inputs refuses
    # it): the first sits at position -1, before every key, and gets zeros as documented, not
    # 0 / 0; the second sees the key and gets its value.
    q = jnp.ones((2, 1, 16), jnp.float32)
    k = jnp.full((1, 1, 1, 16), 0.5, jnp.float32)
    o = reference.dense_attention(q, k, k, jnp.array([0, 2], jnp.int32), jnp.array([1], jnp.int32))
    np.testing.assert_array_equal(o[:, 0], np.stack([np.zeros(16), np.full(16, 0.5)]))

  def test_ragged_to_padded_and_back(self):
    # Rows of 2 (= max_q_len), 1 and 0 queries over 5, 1 and 0 keys, one padding token; bf16,
    # which the way back keeps.
    q = (jnp.arange(4.0, dtype=jnp.bfloat16) + 1)[:, None, None]
    cu, kv_lens = jnp.array([0, 2, 3, 3], jnp.int32), jnp.array([5, 1, 0], jnp.int32)
    q_padded, q_pos, q_valid = reference.ragged_to_padded(q, cu, kv_lens, 2)
    np.testing.assert_array_equal(q_valid, [[1, 1], [1, 0], [0, 0]])
    np.testing.assert_array_equal(q_pos, [[3, 4], [0, 1], [0, 1]])
    np.testing.assert_array_equal(np.where(q_valid, q_padded[..., 0, 0], 0), [[1, 2], [3, 0], [0, 0]])
    back = reference.padded_to_ragged(q_padded, cu, 4)
    self.assertEqual(back.dtype, jnp.bfloat16)
    np.testing.assert_array_equal(back[:, 0, 0], [1, 2, 3, 0])   # the padding token gets 0

  def test_the_longest_row_is_named(self):
    with self.assertRaisesRegex(ValueError, r"^sequence 2: q_len=4 exceeds max_q_len=3 "):
      reference.check_max_q_len(np.array([0, 3, 4, 8, 10], np.int32), 3)


class KernelAvailabilityTest(parameterized.TestCase):
  """attention.kernel_unavailable_reason on stand-in devices (the CPU has only one answer)."""

  @staticmethod
  def _gpu(capability, kind="NVIDIA H200"):
    return types.SimpleNamespace(platform="gpu", compute_capability=capability, device_kind=kind)

  @parameterized.named_parameters(
      ("cpu", types.SimpleNamespace(platform="cpu"), {},
       "the Triton kernel needs a CUDA GPU; this device is cpu"),
      ("no_capability", types.SimpleNamespace(platform="gpu", device_kind="Radeon"), {},
       "Radeon reports no CUDA compute capability (not a CUDA GPU?)"),
      ("turing", "7.5", {}, "T4 has compute capability 7.5; the Triton backend needs >= 8.0"),
      ("head_dim", "9.0", dict(head_dim=72), "head_dim=72 is not a multiple of 16"),
      ("page_size", "8.0", dict(head_dim=64, page_size=12), "page_size=12 is not a power of two"),
  )
  def test_each_reason(self, device, kw, reason):
    if isinstance(device, str):
      device = self._gpu(device, "T4" if device == "7.5" else "NVIDIA H200")
    self.assertEqual(attention.kernel_unavailable_reason(device=device, **kw), reason)

  def test_the_kernel_runs_on_ampere_and_later(self):
    for capability in ("8.0", "8.6", "9.0", "10.0", "12.0.1"):
      self.assertIsNone(attention.kernel_unavailable_reason(64, 16, self._gpu(capability)))
    self.assertIsNone(attention.kernel_unavailable_reason(16, 1, self._gpu("8.0")))
    self.assertIsNone(attention.kernel_unavailable_reason(device=self._gpu("9.0")))
    self.assertIn("this device is cpu", attention.kernel_unavailable_reason())   # the default


if __name__ == "__main__":
  absltest.main()
