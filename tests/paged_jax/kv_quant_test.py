"""Quantized KV pages (paged_jax.kv_quant): the formats and their errors, the quantizing write
(per token, per page with requantization, per tensor), every attention path (both XLA paths,
the mixed step, the Pallas kernel through its interpreter) equal within 1e-5 to dense f32
attention on the same quantized-and-dequantized K/V, the scales following every page operation,
and the engine's greedy tokens equal to a dense reference that stores K/V as the pool does."""

from unittest import mock

from absl.testing import absltest, parameterized
import pytest
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.reference import paged_attention_reference
from paged_jax import attention, config, kv_quant, page_ops, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.kv_write import write_kv
from paged_jax.sampling import SamplingParams
from paged_jax.state import KVPool

DTYPES = tuple(kv_quant.QMAX)
FORMATS = [kv_quant.KVFormat(d, g) for d in DTYPES for g in kv_quant.GRANULARITIES]
# A code's worst relative rounding error: half a unit in the last place (e4m3: 3 mantissa bits,
# e5m2: 2) of a value scaled into the format's normal range.
FP8_REL = {"float8_e4m3fn": 2.0 ** -4, "float8_e5m2": 2.0 ** -3}


class FormatTest(parameterized.TestCase):

  def test_names_and_refusals(self):
    self.assertIsNone(kv_quant.kv_format("auto"))
    self.assertEqual(kv_quant.kv_format("int8"), kv_quant.KVFormat("int8", "token"))
    self.assertEqual(kv_quant.kv_format("float8_e5m2", "page").granularity, "page")
    with self.assertRaisesRegex(ValueError, "kv_dtype='int4' is not one of"):
      CacheConfig(kv_dtype="int4")
    with self.assertRaisesRegex(ValueError, "kv_scales='row' is not one of"):
      CacheConfig(kv_dtype="int8", kv_scales="row")
    with self.assertRaisesRegex(ValueError, "kv_scales='token' needs a quantized kv_dtype"):
      CacheConfig(kv_scales="token")
    with self.assertRaisesRegex(ValueError, "kv_scale=0.0 must be a finite number > 0"):
      CacheConfig(kv_dtype="float8_e4m3fn", kv_scale=0.0)

  def test_fp8_kernel_refused_below_sm89_by_name(self):
    class Gpu:   # what jax reports for an A100
      platform, device_kind, compute_capability = "gpu", "NVIDIA A100", "8.0"
    fmt = kv_quant.KVFormat("float8_e4m3fn", "tensor")
    why = kv_quant.unsupported_reason(fmt, uses_kernel=True, device=Gpu())
    self.assertIn("kv_dtype='float8_e4m3fn'", why)
    self.assertIn("compute capability >= 8.9", why)
    self.assertIsNone(kv_quant.unsupported_reason(fmt, uses_kernel=False, device=Gpu()))
    self.assertIsNone(kv_quant.unsupported_reason(kv_quant.KVFormat("int8", "token"),
                                                  uses_kernel=True, device=Gpu()))
    Gpu.compute_capability = "9.0"
    self.assertIsNone(kv_quant.unsupported_reason(fmt, uses_kernel=True, device=Gpu()))

  def test_engine_refuses_at_start_a_format_it_cannot_run(self):
    fmt = kv_quant.KVFormat("float8_e5m2", "tensor")
    object.__setattr__(fmt, "dtype", "float8_e9m9")   # as if this jax had no such dtype
    self.assertIn("jax " + jax.__version__ + " has no jnp.float8_e9m9",
                  kv_quant.unsupported_reason(fmt, uses_kernel=False))
    cfg = config.tiny_config()
    why = "kv_dtype='float8_e4m3fn': the Triton kernel's fp8 loads need compute capability"
    with mock.patch.object(kv_quant, "unsupported_reason", return_value=why) as check:
      with self.assertRaisesRegex(ValueError, "cannot run here: kv_dtype='float8_e4m3fn'"):
        Engine(testing.random_params(cfg), cfg, impl="interpret",
               cache=CacheConfig(page_size=4, num_pages=8, kv_dtype="float8_e4m3fn"))
    self.assertTrue(check.call_args.kwargs["uses_kernel"])

  @parameterized.parameters(*DTYPES)
  def test_roundtrip_error_per_token(self, dtype):
    fmt = kv_quant.KVFormat(dtype, "token")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 2, 32)) * 3, jnp.float32)
    s = kv_quant.absmax_scale(x, fmt)
    err = np.abs(np.asarray(kv_quant.roundtrip(x, fmt)) - np.asarray(x))
    if dtype == "int8":   # half a step of the scale
      self.assertLessEqual(float((err / np.asarray(s)[..., None]).max()), 0.5 + 1e-6)
    else:   # relative, where the value is a normal number of the format
      big = np.abs(np.asarray(x)) > np.asarray(s)[..., None] * 2.0 ** -6 * fmt.qmax
      self.assertLessEqual(float((err / np.abs(np.asarray(x)))[big].max()), FP8_REL[dtype] + 1e-6)
    # the absmax element is stored exactly at the largest code
    idx = np.argmax(np.abs(np.asarray(x)), axis=-1)
    codes = kv_quant.quantize(x, s, fmt).astype(jnp.float32)
    top = np.take_along_axis(np.abs(np.asarray(codes)), idx[..., None], -1)
    np.testing.assert_allclose(top, fmt.qmax)

  @parameterized.parameters(*DTYPES)
  def test_static_scale_saturates_never_inf_or_nan(self, dtype):
    fmt = kv_quant.KVFormat(dtype, "tensor", tensor_scale=0.01)
    x = jnp.array([[[1e6, -1e6, 0.5, 0.0]]], jnp.float32)
    y = np.asarray(kv_quant.roundtrip(x, fmt, jnp.full((1, 1), 0.01)))
    self.assertTrue(np.all(np.isfinite(y)))
    np.testing.assert_allclose(y[0, 0, :2], [fmt.qmax * 0.01, -fmt.qmax * 0.01], rtol=1e-6)


def _layer(fmt, num_pages=6, page_size=4, heads=2, dim=8):
  codes = jnp.zeros((num_pages, page_size, heads, dim), fmt.code_dtype)
  scales = jnp.zeros((num_pages,) + fmt.scale_shape(page_size, heads), jnp.float32)
  return codes, scales


class WriteTest(parameterized.TestCase):

  @parameterized.parameters(*FORMATS)
  def test_written_slots_read_back_as_returned(self, fmt):
    rng = np.random.default_rng(1)
    codes, scales = _layer(fmt)
    slots = jnp.asarray(rng.permutation(np.arange(4, 24))[:11], jnp.int32)   # pages 1..5
    x = jnp.asarray(rng.standard_normal((11, 2, 8)), jnp.float32)
    codes, scales, x_hat = kv_quant.write_layer(codes, scales, x, slots, fmt)
    read = kv_quant.QuantizedPages(codes, scales)[slots // 4]
    got = read[jnp.arange(11), slots % 4]
    if fmt.granularity != "page":   # a page's scale may still grow: x_hat is exact for the rest
      np.testing.assert_array_equal(np.asarray(got), np.asarray(x_hat))
    tol = {"int8": 0.02, "float8_e4m3fn": 0.15, "float8_e5m2": 0.3}[fmt.dtype]
    if fmt.granularity == "tensor":   # scale 1: int8 rounds to whole numbers
      tol = {"int8": 0.5, "float8_e4m3fn": 0.15, "float8_e5m2": 0.3}[fmt.dtype]
    np.testing.assert_allclose(np.asarray(got), np.asarray(x), atol=tol * 3)

  @parameterized.parameters(*DTYPES)
  def test_page_scale_grows_requantizes_and_restarts_at_offset_0(self, dtype):
    fmt = kv_quant.KVFormat(dtype, "page")
    codes, scales = _layer(fmt, heads=1, dim=4)
    small = jnp.array([[[0.1, -0.2, 0.05, 0.0]]], jnp.float32)
    big = jnp.array([[[4.0, -1.0, 2.0, 0.5]]], jnp.float32)
    codes, scales, _ = kv_quant.write_layer(codes, scales, small, jnp.array([8]), fmt)  # page 2
    np.testing.assert_allclose(float(scales[2, 0, 0]), 0.2 / fmt.qmax, rtol=1e-6)
    codes, scales, _ = kv_quant.write_layer(codes, scales, big, jnp.array([9]), fmt)
    np.testing.assert_allclose(float(scales[2, 0, 0]), 4.0 / fmt.qmax, rtol=1e-6)
    pages = kv_quant.QuantizedPages(codes, scales)
    # the first token was requantized to the new scale: within its rounding, not lost
    step = 4.0 / fmt.qmax if dtype == "int8" else 4.0 * FP8_REL[dtype]
    np.testing.assert_allclose(np.asarray(pages[2][0]), np.asarray(small[0]), atol=step)
    np.testing.assert_allclose(np.asarray(pages[2][1]), np.asarray(big[0]), atol=step)
    # a write at offset 0 starts the page again (a freed page reused): the old scale is dropped
    codes, scales, _ = kv_quant.write_layer(codes, scales, small, jnp.array([8]), fmt)
    np.testing.assert_allclose(float(scales[2, 0, 0]), 0.2 / fmt.qmax, rtol=1e-6)

  def test_write_kv_on_a_quantized_pool(self):
    fmt = kv_quant.KVFormat("int8", "token")
    pool = KVPool.create(num_layers=2, num_pages=4, page_size=2, num_kv_heads=1, head_dim=4,
                         kv_format=fmt)
    self.assertEqual((pool.k.dtype, pool.k_scale.shape), (jnp.int8, (2, 4, 2, 1)))
    k = jnp.array([[[1.0, -2.0, 0.5, 0.0]], [[3.0, 0.0, 0.0, -1.0]]])
    pool = write_kv(pool, 1, k, -k, jnp.array([2, 7]))
    got = kv_quant.QuantizedPages(pool.k[1], pool.k_scale[1])[jnp.array([1, 3])]
    np.testing.assert_allclose(np.asarray(got[0, 0]), k[0], atol=2 / 127)
    np.testing.assert_allclose(np.asarray(got[1, 1]), k[1], atol=3 / 127)
    self.assertEqual(float(jnp.abs(pool.k_scale[0]).max()), 0.0)   # layer 0 untouched


def _inputs(seed, seq_lens, q_lens, page_size=4, dtype=jnp.float32):
  """Paged inputs whose unused slots hold large garbage (finite: codes of any value)."""
  inp = testing.random_paged_inputs(seed, seq_lens, q_lens=q_lens, page_size=page_size,
                                    dtype=jnp.float32)
  junk = lambda x: jnp.where(jnp.isnan(x), 50.0, x).astype(dtype)
  return inp._replace(q=jnp.nan_to_num(inp.q).astype(dtype), k_pages=junk(inp.k_pages),
                      v_pages=junk(inp.v_pages))


class ExactnessTest(parameterized.TestCase):
  """Paging and merging add no error of their own: every path on quantized pages equals dense
  f32 attention on the same dequantized K/V within 1e-5."""

  @parameterized.product(fmt=FORMATS, impl=("xla", "interpret"))
  def test_paths_equal_dense_on_dequantized_kv(self, fmt, impl):
    inp = _inputs(3, [5, 9, 1, 13], [1, 3, 1, 6])
    kq, vq = (kv_quant.quantize_pages(x, fmt) for x in (inp.k_pages, inp.v_pages))
    tail = (inp.block_tables, inp.seq_lens, inp.cu_q_lens)
    ref = paged_attention_reference(inp.q, kq.dequantized(), vq.dequantized(), *tail,
                                    max_q_len=6)
    out = attention.paged_attention(inp.q, kq, vq, *tail, max_q_len=6, impl=impl)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)

  @parameterized.parameters("token", "page", "tensor")
  def test_decode_path_and_mixed_step(self, granularity):
    fmt = kv_quant.KVFormat("int8", granularity)
    inp = _inputs(4, [7, 30, 2, 11, 19], [1, 1, 1, 4, 19], page_size=2)
    kq, vq = (kv_quant.quantize_pages(x, fmt) for x in (inp.k_pages, inp.v_pages))
    tail = (inp.block_tables, inp.seq_lens, inp.cu_q_lens)
    ref = paged_attention_reference(inp.q, kq.dequantized(), vq.dequantized(), *tail,
                                    max_q_len=19)
    dec = attention.decode_attention_xla(inp.q[:3], kq, vq, inp.block_tables[:3],
                                         inp.seq_lens[:3], inp.cu_q_lens[:4])
    np.testing.assert_allclose(np.asarray(dec), np.asarray(ref[:3]), atol=1e-5)
    # the mixed step: own keys from this step (as the pool stores them), the prefix from pages
    own = lambda pages: jnp.concatenate([pages[inp.block_tables[b]].reshape(-1, 2, 16)[
        int(inp.seq_lens[b]) - n:int(inp.seq_lens[b])] for b, n in enumerate([1, 1, 1, 4, 19])])
    out = attention.step_attention(inp.q, own(kq), own(vq), kq, vq, *tail, num_decode=3,
                                   max_q_len=19, impl="xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)

  def test_bf16_model_reads_int8_pages_in_bf16(self):
    fmt = kv_quant.KVFormat("int8", "token")
    inp = _inputs(5, [9, 4], [2, 1], dtype=jnp.bfloat16)
    kq, vq = (kv_quant.quantize_pages(x, fmt) for x in (inp.k_pages, inp.v_pages))
    self.assertEqual(kq.dtype, jnp.bfloat16)
    tail = (inp.block_tables, inp.seq_lens, inp.cu_q_lens)
    out = attention.paged_attention(inp.q, kq, vq, *tail, max_q_len=2, impl="interpret")
    ref = paged_attention_reference(inp.q, kq.dequantized(), vq.dequantized(), *tail,
                                    max_q_len=2)
    self.assertEqual(out.dtype, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)   # bf16 output rounding (8-bit mantissa)


class PageOpsTest(absltest.TestCase):

  def test_scales_follow_copy_swap_and_scrub(self):
    fmt = kv_quant.KVFormat("float8_e4m3fn", "page")
    pool = KVPool.create(num_layers=2, num_pages=8, page_size=2, num_kv_heads=2, head_dim=4,
                         kv_format=fmt)
    rng = np.random.default_rng(0)
    for layer in range(2):
      x = jnp.asarray(rng.standard_normal((14, 2, 4)) * (layer + 1), jnp.float32)
      pool = write_kv(pool, layer, x, 2 * x, jnp.arange(2, 16, dtype=jnp.int32))
    value = lambda p, page: np.stack([np.asarray(kv_quant.QuantizedPages(
        p.k[l], p.k_scale[l])[page]) for l in range(2)])
    before = value(pool, 3)
    pool = page_ops.copy_pages(pool, jnp.array([3]), jnp.array([7]))
    np.testing.assert_array_equal(value(pool, 7), before)
    arrays = page_ops.read_pages(pool, [3, 5])
    self.assertLen(arrays, 4)
    self.assertEqual(arrays[2].shape, (2, 2, 1, 2))
    pool = page_ops.zero_pages(pool, jnp.array([3, 5]))
    self.assertEqual(float(np.abs(value(pool, 3)).max()), 0.0)
    self.assertEqual(float(jnp.abs(pool.v_scale[:, 5]).max()), 0.0)
    pool = page_ops.write_pages(pool, [3, 5], *arrays)
    np.testing.assert_array_equal(value(pool, 3), before)
    with self.assertRaisesRegex(ValueError, "2 arrays for a pool of 4 page arrays"):
      page_ops.write_pages(pool, [3, 5], *arrays[:2])

  def test_budget_counts_the_scales(self):
    cfg = config.tiny_config()   # f32
    plain = CacheConfig(page_size=16).bytes_per_page(cfg)
    per_token = CacheConfig(page_size=16, kv_dtype="int8").bytes_per_page(cfg)
    per_tensor = CacheConfig(page_size=16, kv_dtype="float8_e5m2").bytes_per_page(cfg)
    codes = plain // 4
    heads = cfg.num_kv_heads
    self.assertEqual(per_token, codes + 2 * cfg.num_layers * 16 * heads * 4)
    self.assertEqual(per_tensor, codes + 2 * cfg.num_layers * 4)
    pool = KVPool.create(num_layers=cfg.num_layers, num_pages=3, page_size=16,
                         num_kv_heads=heads, head_dim=cfg.head_dim,
                         kv_format=kv_quant.KVFormat("int8", "token"))
    self.assertEqual(pool.nbytes, 3 * per_token)
    budget = CacheConfig(page_size=16, memory_bytes=100 * plain)
    self.assertEqual(budget.resolve_num_pages(cfg, None), 100)
    self.assertEqual(CacheConfig(page_size=16, memory_bytes=100 * plain, kv_dtype="float8_e5m2")
                     .resolve_num_pages(cfg, None), 100 * plain // per_tensor)


CFG = config.tiny_config()
PARAMS = testing.random_params(CFG, seed=0, scale=0.3)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42], [5, 6, 7, 8, 9, 10, 11]]


class EngineTest(parameterized.TestCase):

  @parameterized.parameters(("int8", "token", "swap"), ("float8_e4m3fn", "tensor", "recompute"))
  @pytest.mark.slow   # two engines under preemption, ~12 s each (README tier: 651 s)
  def test_greedy_equals_dense_with_kv_stored_alike(self, dtype, granularity, mode):
    fmt = kv_quant.KVFormat(dtype, granularity)
    dense = testing.DenseGreedy(PARAMS, CFG, kv_format=fmt)
    e = Engine(PARAMS, CFG, impl="xla",
               cache=CacheConfig(page_size=2, num_pages=14, kv_dtype=dtype, kv_scales=granularity),
               scheduler=SchedulerConfig(preemption_mode=mode, steps_per_sync=3,
                                         max_num_batched_tokens=8, max_num_seqs=8))
    self.assertEqual(e.pool.k.dtype, jnp.dtype(dtype))
    outs = e.generate(PROMPTS, SamplingParams(max_tokens=10))
    self.assertEqual([o.outputs[0].token_ids for o in outs], [dense(p, 10) for p in PROMPTS])
    self.assertGreater(e.stats.preemptions, 0)   # swap / recompute carried the scales


if __name__ == "__main__":
  absltest.main()
