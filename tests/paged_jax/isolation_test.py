"""Isolation (issue 10, item 1): a request's output depends on no page outside its own block
table; freed pages can be scrubbed; the per-step table validation catches a foreign page and a
missed copy-on-write; requests with different cache salts never share a page.

The poisoning tests run the same workload twice through the engine, once clean and once with
every page the target request does not reference (free, cached-idle, other requests' pages,
NULL_PAGE) overwritten with NaN or random garbage between steps, and require the target's
tokens and logprobs to be bit-identical. The other requests' outputs become garbage; their
lengths do not (no EOS, fixed max_tokens), so the schedule is the same in both runs.
"""

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, config, cpu_kernel, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host import batching
from paged_jax.host.block_manager import BlockManager, Growth
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

CFG = config.tiny_config(head_dim=16)   # the kernel (interpret mode) needs head_dim % 16 == 0
PARAMS = testing.random_params(CFG, seed=1, scale=0.3)
OTHERS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
TARGET = [11, 12, 13, 14, 15, 16]   # shares no page-sized prefix with the others
TARGET_PARAMS = SamplingParams(max_tokens=10, n=2, temperature=0.9, seed=5)   # forks, copies


def make(impl="xla", caching=True, mode="swap", num_pages=14, **kw):
  return Engine(PARAMS, CFG, cache=CacheConfig(page_size=2, num_pages=num_pages,
                                               enable_prefix_caching=caching),
                scheduler=SchedulerConfig(preemption_mode=mode, steps_per_sync=3,
                                          max_num_batched_tokens=12, max_num_seqs=8),
                impl=impl, **kw)


def poison(engine, keep, fill, rng):
  """Overwrites every page outside `keep` (K and V, every layer) with NaN or garbage."""
  idx = np.setdiff1d(np.arange(engine.num_pages), np.fromiter(keep, int, len(keep)))

  def f(x):   # [num_layers, num_pages, ...]
    shape = (x.shape[0], idx.size) + x.shape[2:]
    value = np.full(shape, np.nan) if fill == "nan" else rng.normal(0, 50, shape)
    return x.at[:, idx].set(jnp.asarray(value, x.dtype))

  engine.pool = engine.pool.replace(k=f(engine.pool.k), v=f(engine.pool.v))


def run(engine, target_first, fill=None, seed=0):
  """Runs OTHERS and TARGET; with `fill`, poisons foreign pages before every step once the
  target holds pages. Returns the target's final output."""
  rng = np.random.default_rng(seed)
  greedy = SamplingParams(max_tokens=10)
  ids = [engine.add_request(p, greedy) for p in OTHERS]
  target = engine.add_request(TARGET, TARGET_PARAMS)
  if target_first:   # the oldest request is never the preemption victim; the newest is
    engine.scheduler.waiting.rotate(1)
  started, final, poisoned_steps = False, None, 0
  while engine.has_unfinished():
    keep = engine.pages_of(target)
    started = started or bool(keep)
    if fill and started and final is None:
      poison(engine, keep, fill, rng)
      poisoned_steps += 1
    for out in engine.step():
      if out.request_id == target and out.finished:
        final = out
  del ids
  return final, poisoned_steps


def skip_without_compiled_kernel(test, impl):
  """Skips `test`, saying why, when `impl` is the compiled kernel and this device cannot run it
  (every CPU: the interpret-mode cases cover the kernel's logic there)."""
  reason = attention.kernel_unavailable_reason(CFG.head_dim, 2)
  if impl == "pallas" and reason is not None:
    test.skipTest(f"compiled kernel: {reason}")
  if impl == "cpu" and jax.devices()[0].platform != "cpu":   # on a CPU it must build: no skip
    test.skipTest(f"C++ CPU kernel: {cpu_kernel.unavailable_reason()}")


class PoisonedPagesTest(parameterized.TestCase):

  @parameterized.named_parameters(
      # The target last: it is the newest, so it is swapped out and back in.
      ("xla_nan_swap_newest", "xla", "nan", True, "swap", False),
      ("xla_garbage_swap_newest", "xla", "garbage", True, "swap", False),
      # The target first: never preempted, while the others are, around it.
      ("xla_nan_oldest", "xla", "nan", True, "swap", True),
      # Recompute without the prefix cache (a recomputed prompt reads nothing cached).
      ("xla_nan_recompute", "xla", "nan", False, "recompute", False),
      # Decode rows on the C++ CPU kernel (impl "auto" on a CPU).
      ("cpu_kernel_nan_swap", "cpu", "nan", True, "swap", False),
      ("cpu_kernel_garbage_recompute", "cpu", "garbage", False, "recompute", True),
      ("kernel_nan_swap", "interpret", "nan", True, "swap", False),
      ("kernel_garbage_recompute", "interpret", "garbage", False, "recompute", True),
      # The kernel compiled by Triton: only on a CUDA GPU >= 8.0 (experiments/gpu_check.sh).
      ("kernel_compiled_nan_swap", "pallas", "nan", True, "swap", False),
      ("kernel_compiled_garbage_recompute", "pallas", "garbage", False, "recompute", True),
  )
  def test_target_output_is_bit_identical(self, impl, fill, caching, mode, target_first):
    skip_without_compiled_kernel(self, impl)
    clean, _ = run(make(impl, caching, mode), target_first)
    engine = make(impl, caching, mode)
    dirty, steps = run(engine, target_first, fill)
    self.assertGreater(steps, 3)
    self.assertGreater(engine.stats.preemptions, 0)
    for a, b in zip(clean.outputs, dirty.outputs):
      self.assertEqual(a.token_ids, b.token_ids)
      np.testing.assert_array_equal(a.logprobs, b.logprobs)   # bit-identical, NaN-free
      self.assertTrue(np.isfinite(b.logprobs).all())
    self.assertEqual(len(dirty.outputs), 2)
    self.assertNotEqual(dirty.outputs[0].token_ids, dirty.outputs[1].token_ids)

  def test_the_poison_reaches_the_others(self):
    # Guard against a poison that does nothing: the other requests' logprobs are wrecked.
    engine = make()
    rng = np.random.default_rng(0)
    rid = engine.add_request(OTHERS[0], SamplingParams(max_tokens=6))
    engine.add_request(TARGET, SamplingParams(max_tokens=6))
    finals = {}
    while engine.has_unfinished():
      poison(engine, engine.pages_of(rid), "nan", rng)   # keep only the first request's pages
      finals.update({o.request_id: o for o in engine.step() if o.finished})
    self.assertTrue(np.isfinite(finals[rid].outputs[0].logprobs).all())
    other = [o for k, o in finals.items() if k != rid][0]
    self.assertTrue(np.isnan(other.outputs[0].logprobs).any())


class KernelEnginesTest(parameterized.TestCase):
  """The engine on each kernel against the engine on the XLA path: greedy outputs of every
  request, with preemptions. "pallas": the Triton-compiled kernel (GPU only); "cpu": decode rows
  on the C++ CPU kernel."""

  @parameterized.named_parameters(
      # f32 at precision "highest" (IEEE dots in the kernel): the sums' order differs only.
      ("compiled_kernel", "pallas", 1e-4),
      ("cpu_kernel", "cpu", 1e-5),   # f32 both; the sums' order differs only
  )
  def test_greedy_tokens_and_logprobs_match_xla(self, impl, atol):
    skip_without_compiled_kernel(self, impl)
    outs = {}
    for name in ("xla", impl):
      engine = make(name)
      ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in OTHERS + [TARGET]]
      final = {}
      while engine.has_unfinished():
        final.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
      self.assertGreater(engine.stats.preemptions, 0)
      outs[name] = [final[i] for i in ids]
    for xla, kernel in zip(outs["xla"], outs[impl]):
      self.assertEqual(xla.token_ids, kernel.token_ids)
      np.testing.assert_allclose(kernel.logprobs, xla.logprobs, atol=atol)


class ScrubTest(absltest.TestCase):

  def test_freed_pages_are_zero_and_outputs_unchanged(self):
    plain = make(caching=True)
    scrubbed = make(caching=True, scrub_freed_pages=True)
    outs = {}
    for engine in (plain, scrubbed):
      prompts = OTHERS + [TARGET]
      ids = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
      final = {}
      while engine.has_unfinished():
        for o in engine.step():
          if o.finished:
            final[o.request_id] = o.outputs[0].token_ids
        if engine is scrubbed and engine.has_unfinished():
          free = [p for p in range(1, engine.num_pages)
                  if engine.bm.refcount(p) == 0 and not engine.bm.is_cached(p)]
          released_later = set(engine.bm._released)   # freed by this step: scrubbed next step
          stale = [p for p in free if p not in released_later
                   and (np.asarray(engine.pool.k[0][p]).any() or np.asarray(engine.pool.v[1][p]).any())]
          self.assertEqual(stale, [], "a free page still holds data")
      outs[id(engine)] = [final[i] for i in ids]
    self.assertEqual(outs[id(plain)], outs[id(scrubbed)])
    self.assertGreater(scrubbed.stats.scrubbed_pages, 0)
    self.assertEqual(plain.stats.scrubbed_pages, 0)
    # Without scrubbing, freed pages keep their old K/V (what scrubbing is for).
    free = [p for p in range(1, plain.num_pages)
            if plain.bm.refcount(p) == 0 and not plain.bm.is_cached(p)]
    self.assertTrue(any(np.asarray(plain.pool.k[0][p]).any() for p in free))


class ValidationTest(absltest.TestCase):

  def test_on_in_this_suite_and_timed(self):
    engine = make()
    self.assertTrue(engine.validate_tables)   # tests/conftest.py turns it on
    engine.generate(OTHERS, SamplingParams(max_tokens=4))
    self.assertGreater(engine.stats.validate_s, 0)

  def test_a_foreign_page_in_a_table_is_caught(self):
    engine = make()
    real = batching.build_step

    def corrupt(plan, bm, *args):
      a = real(plan, bm, *args)
      if len(plan.rows) > 1:   # row 0 gets a page of row 1
        a["block_tables"][0, 0] = bm.block_table(plan.rows[1].seq.seq_id)[0]
      return a

    batching.build_step = corrupt
    self.addCleanup(setattr, batching, "build_step", real)
    engine.add_request(OTHERS[0], SamplingParams(max_tokens=4))
    engine.add_request(OTHERS[1], SamplingParams(max_tokens=4))
    with self.assertRaisesRegex(batching.TableValidationError, "row 0: the block table sent"):
      engine.step()

  def test_a_missed_copy_on_write_is_caught(self):
    # The block manager forgets to copy a shared partial page: the write is caught.
    engine = make(caching=False)
    real = BlockManager.reserve

    def no_cow(self, seq_id, num_tokens):
      seq = self._running(seq_id)
      n, ps = seq.num_tokens, self.page_size
      new = max(0, -(-(n + num_tokens) // ps) - len(seq.block_table))
      if new > self.num_free_pages:
        return None
      seq.block_table.extend(self._take(new))
      return Growth((), ())

    BlockManager.reserve = no_cow
    self.addCleanup(setattr, BlockManager, "reserve", real)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=0))
    with self.assertRaisesRegex(batching.TableValidationError, "missed copy-on-write"):
      for _ in range(4):
        engine.step()

  def test_padding_and_range_checks(self):
    engine = make()
    engine.add_request(OTHERS[0], SamplingParams(max_tokens=4))
    plan = engine.scheduler.schedule()
    arrays = batching.build_step(plan, engine.bm, engine.max_pages_per_seq)
    batching.validate_step(plan, arrays, engine.bm)   # as built: fine
    for change, message in [
        (lambda a: a["block_tables"].__setitem__((0, 0), engine.num_pages), "is outside"),
        (lambda a: a["block_tables"].__setitem__((-1, 0), 3), "padding row"),
        (lambda a: a["slots"].__setitem__(-1, 3 * engine.page_size), "padding token writes"),
    ]:
      bad = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in arrays.items()}
      change(bad)
      with self.assertRaisesRegex(batching.TableValidationError, message):
        batching.validate_step(plan, bad, engine.bm)


class CacheSaltTest(absltest.TestCase):

  def test_different_salts_never_share_and_see_no_hits(self):
    prompt = list(range(1, 12))   # 5 full pages of 2 tokens, then one token
    engine = make(caching=True, num_pages=64)   # all four run at once
    a = engine.add_request(prompt, SamplingParams(max_tokens=6), cache_salt="alice")
    engine.step()
    b = engine.add_request(prompt, SamplingParams(max_tokens=6), cache_salt="bob")
    c = engine.add_request(prompt, SamplingParams(max_tokens=6), cache_salt="alice")
    d = engine.add_request(prompt, SamplingParams(max_tokens=6))   # no salt: its own namespace
    overlap = {}
    final = {}
    while engine.has_unfinished():
      pages = {r: engine.pages_of(r) for r in (a, b, c, d)}
      for x in (a, b, c, d):
        for y in (a, b, c, d):
          if x < y:
            overlap[(x, y)] = overlap.get((x, y), False) or bool(pages[x] & pages[y])
      final.update({o.request_id: o for o in engine.step() if o.finished})
    self.assertEqual(final[a].num_cached_tokens, 0)
    self.assertEqual(final[b].num_cached_tokens, 0)    # alice's pages are invisible to bob
    self.assertEqual(final[c].num_cached_tokens, 10)   # alice's second request hits her own
    self.assertEqual(final[d].num_cached_tokens, 0)
    self.assertTrue(overlap[(a, c)])
    for pair in [(a, b), (a, d), (b, c), (b, d), (c, d)]:
      self.assertFalse(overlap[tuple(sorted(pair))], pair)
    # Same tokens either way: the salt changes sharing, not results.
    self.assertEqual(len({tuple(final[r].outputs[0].token_ids) for r in (a, b, c, d)}), 1)

  def test_salt_must_be_a_string(self):
    engine = make()
    with self.assertRaisesRegex(ValueError, "cache_salt=5 must be a str"):
      engine.add_request([1, 2], cache_salt=5)


if __name__ == "__main__":
  absltest.main()
