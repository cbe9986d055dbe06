"""generate_on_device (issue 12): one jitted call, pages allocated inside the loop. Greedy equals
dense decoding and the engine; seeded n > 1 samples (copy-on-write of the shared prompt page)
equal the engine's; EOS and limits stop rows; a pool too small stops rows with "overflow" and
right tokens so far; a NaN-filled initial pool changes nothing; one trace per shape bucket; no
host transfer during the call."""

from absl.testing import absltest, parameterized
import pytest
import chex
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import config, ondevice, page_table as ptm, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.sampling import SamplingParams
from paged_jax.state import KVPool

CFG = config.tiny_config()
PARAMS = testing.random_params(CFG, seed=0, scale=0.3)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42], [5, 6, 7, 8, 9, 10, 11]]
L = max(map(len, PROMPTS))
TOKENS = jnp.asarray([p + [0] * (L - len(p)) for p in PROMPTS], jnp.int32)
LENS = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
_DENSE = {}


def dense(i, new=10):
  if (i, new) not in _DENSE:
    _DENSE[(i, new)] = testing.dense_greedy(PARAMS, CFG, PROMPTS[i], new)
  return _DENSE[(i, new)]


def rows(out):
  return [np.asarray(out.tokens[r, :int(out.lengths[r])]).tolist()
          for r in range(out.tokens.shape[0])]


def run(**kw):
  args = dict(cfg=CFG, max_new_tokens=10, num_pages=64, page_size=4, impl="xla")
  return ondevice.generate_on_device(PARAMS, TOKENS, LENS, **{**args, **kw})


class OnDeviceTest(parameterized.TestCase):

  def test_greedy_equals_dense_and_the_engine(self):
    out = run()
    self.assertEqual(rows(out), [dense(i) for i in range(5)])
    np.testing.assert_array_equal(out.finish_reason, ondevice.FINISH_LENGTH)
    engine = Engine(PARAMS, CFG, cache=CacheConfig(page_size=4, num_pages=64), impl="xla")
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10))
    self.assertEqual(rows(out), [o.outputs[0].token_ids for o in outs])
    np.testing.assert_allclose(np.asarray(out.logprobs[:, :10]),
                               [o.outputs[0].logprobs for o in outs], rtol=1e-5, atol=1e-5)
    ptm.check_invariants(out.page_table)
    self.assertEqual(int(out.page_table.num_free), 63)   # every page back

  @parameterized.parameters(2, 4)
  @pytest.mark.slow   # ~20-33 s: out of the README tier (651 s on 2026-12-03)
  def test_parallel_samples_share_and_copy(self, page_size):
    # Greedy n = 3: every sample is the dense sequence (a missed copy-on-write would let the
    # samples overwrite each other's partial page).
    pages = 160   # 15 rows of up to 19 tokens fit even with 2-token pages
    out = run(n=3, page_size=page_size, num_pages=pages)
    self.assertEqual(rows(out), [dense(i) for i in range(5) for _ in range(3)])
    # Seeded sampling: the engine's tokens, sample for sample.
    seeds = np.arange(5) + 11
    engine = Engine(PARAMS, CFG, cache=CacheConfig(page_size=page_size, num_pages=pages), impl="xla")
    outs = engine.generate(PROMPTS, [SamplingParams(max_tokens=10, n=3, temperature=0.8,
                                                    top_p=0.9, seed=int(s)) for s in seeds])
    got = run(n=3, page_size=page_size, num_pages=pages, temperature=jnp.full(5, 0.8),
              top_p=jnp.full(5, 0.9), seeds=jnp.asarray(seeds))
    self.assertEqual(rows(got), [c.token_ids for o in outs for c in o.outputs])
    self.assertGreater(len({tuple(r) for r in rows(got)}), 5)   # samples differ
    ptm.check_invariants(got.page_table)
    self.assertEqual(int(got.page_table.num_free), pages - 1)

  def test_eos_and_per_prompt_limits(self):
    eos = dense(0)[3]   # prompt 0 stops at its 4th token (kept)
    out = run(eos_token_ids=(eos,), max_tokens=jnp.asarray([10, 2, 10, 5, 10]))
    got = rows(out)
    self.assertEqual(got[0], dense(0)[:4])
    self.assertEqual(int(out.finish_reason[0]), ondevice.FINISH_STOP)
    self.assertEqual(got[1], dense(1)[:2])
    self.assertEqual(got[3], dense(3)[:5])
    for i in (1, 3):
      if eos not in got[i]:
        self.assertEqual(int(out.finish_reason[i]), ondevice.FINISH_LENGTH)
    for i, g in enumerate(got):   # every row stops at its first EOS
      self.assertNotIn(eos, g[:-1], i)

  def test_overflow_stops_rows_with_right_tokens(self):
    out = run(num_pages=12)   # 11 pages of 4 for five rows of up to 19 tokens
    reasons = np.asarray(out.finish_reason)
    self.assertIn(ondevice.FINISH_OVERFLOW, reasons)
    for i, g in enumerate(rows(out)):
      self.assertEqual(g, dense(i)[:len(g)], i)
      if reasons[i] != ondevice.FINISH_OVERFLOW:
        self.assertLen(g, 10)
    ptm.check_invariants(out.page_table)
    self.assertEqual(int(out.page_table.num_free), 11)

  @pytest.mark.slow   # ~20-33 s: out of the README tier (651 s on 2026-12-03)
  def test_nan_pool_changes_nothing(self):
    nan = KVPool.create(num_layers=CFG.num_layers, num_pages=64, page_size=4,
                        num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim, dtype=CFG.dtype)
    nan = nan.replace(k=jnp.full_like(nan.k, jnp.nan), v=jnp.full_like(nan.v, jnp.nan))
    clean = run(n=2, temperature=jnp.full(5, 0.7))
    dirty = run(n=2, temperature=jnp.full(5, 0.7), pool=nan)
    np.testing.assert_array_equal(clean.tokens, dirty.tokens)
    np.testing.assert_array_equal(clean.logprobs, dirty.logprobs)
    self.assertTrue(np.isfinite(np.asarray(dirty.logprobs)).all())

  def test_one_trace_per_bucket_and_no_host_transfer(self):
    fn = jax.jit(chex.assert_max_traces(ondevice.generate_on_device.__wrapped__, n=1),
                 static_argnames=("cfg", "max_new_tokens", "num_pages", "page_size", "n",
                                  "eos_token_ids", "impl", "greedy_only"))
    kw = dict(cfg=CFG, max_new_tokens=6, num_pages=32, page_size=4, impl="xla")
    params, tokens, lens = jax.device_put((PARAMS, TOKENS, LENS))
    other = jax.device_put(jnp.asarray([3, 2, 1, 9, 4], jnp.int32))
    shifted = jax.device_put((TOKENS + 1) % CFG.vocab_size)
    fn(params, tokens, lens, **kw)   # compiles
    with jax.transfer_guard("disallow"):   # the whole generation: no host round trip
      out = fn(params, tokens, other, **kw)
      out = fn(params, shifted, lens, **kw)
      jax.block_until_ready(out)
    self.assertEqual(rows(out)[0], testing.dense_greedy(PARAMS, CFG, [2, 3, 4, 5, 6], 6))


if __name__ == "__main__":
  absltest.main()
