"""Tensor and data parallel runs on 8 simulated CPU devices equal one device.

Needs XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts, so it runs in its own
process: `sharding_test.MultiDeviceTest` launches it (the file name keeps pytest from collecting
it in the suite's process). By hand:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/paged_jax/sharding_multidevice.py

Meshes are DATAxMODEL. The test model has 8 query heads over 4 KV heads, so model=8 replicates
each KV head on 2 devices and model=2, 4 split them.
"""

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl.testing import absltest, parameterized  # noqa: E402
import chex  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import mesh_bench, output  # noqa: E402
from paged_jax import config, page_ops, serve, sharding, step, testing  # noqa: E402
from paged_jax.config import CacheConfig  # noqa: E402
from paged_jax.data_parallel import DataParallelEngine  # noqa: E402
from paged_jax.engine import Engine  # noqa: E402
from paged_jax.host.scheduler import SchedulerConfig  # noqa: E402
from paged_jax.sampling import SamplingParams  # noqa: E402
from paged_jax.state import AttentionMetadata, KVPool  # noqa: E402

CFG = config.tiny_config(num_q_heads=8, num_kv_heads=4, max_position=128)
PARAMS = testing.random_params(CFG, seed=0, scale=0.3)
MESHES = ((1, 8), (2, 4), (4, 2), (8, 1))
PAGE = 4
# f32 sums in another order (the all-reduce adds per-device partial sums): ~1e-6 apart.
TOL = dict(atol=2e-5, rtol=2e-5)


def _batch(tokens, positions, slots, table, seq_lens, cu_q_lens, max_q_len):
  md = AttentionMetadata(jnp.asarray(table, jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                         jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(slots, jnp.int32),
                         max_q_len=max_q_len)
  last = jnp.asarray(cu_q_lens[1:], jnp.int32) - 1
  return step.Batch(jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), md, last)


# Two sequences: 6 and 3 prompt tokens on pages [3, 5] and [2]; then one decode token each.
TABLE = [[3, 5], [2, 0]]
PREFILL = _batch([5, 9, 2, 7, 1, 8, 4, 4, 6], [0, 1, 2, 3, 4, 5, 0, 1, 2],
                 [12, 13, 14, 15, 20, 21, 8, 9, 10], TABLE, [6, 3], [0, 6, 9], 8)
DECODE = _batch([3, 11], [6, 3], [22, 11], TABLE, [7, 4], [0, 1, 2], 1)


def _pool(model: int):
  return KVPool.create(num_layers=CFG.num_layers, num_pages=8, page_size=PAGE,
                       num_kv_heads=CFG.stored_kv_heads(model), head_dim=CFG.head_dim)


def _as_stored(x, model: int):
  """One device's pool array with its KV heads repeated as `model` devices store them."""
  return np.repeat(np.asarray(x), CFG.stored_kv_heads(model) // CFG.num_kv_heads, axis=-2)


def _split_by_heads(x, mesh) -> bool:
  """x is laid out as the pool should be: its KV-heads axis split over the mesh's "model"."""
  return x.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, sharding.POOL_SPEC), x.ndim)


def _one_device_steps():
  pool = _pool(1)
  prefill, pool = step.prefill_step(PARAMS, pool, PREFILL, cfg=CFG, impl="xla")
  after_prefill = jax.device_get(pool)
  decode, pool = step.decode_step(PARAMS, pool, DECODE, cfg=CFG, impl="xla")
  return prefill, decode, after_prefill, jax.device_get(pool)


class StepsTest(parameterized.TestCase):
  """The jitted steps and page operations with params and pool split over "model"."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.ref = _one_device_steps()

  @parameterized.parameters(*[m for _, m in MESHES])
  def test_prefill_decode_copy_swap(self, model):
    ref_prefill, ref_decode, ref_pool_prefill, ref_pool = self.ref
    mesh = sharding.make_mesh(1, model)
    params = sharding.shard_params(PARAMS, CFG, mesh)
    pool = sharding.shard_pool(_pool(model), mesh)
    with jax.set_mesh(mesh):
      prefill, pool = step.prefill_step(params, pool, PREFILL, cfg=CFG, impl="xla")
      chex.assert_trees_all_close(prefill, ref_prefill, **TOL)
      for got, want in zip((*pool.k, *pool.v), (*ref_pool_prefill.k, *ref_pool_prefill.v)):
        chex.assert_trees_all_close(np.asarray(got), _as_stored(want, model), **TOL)
      decode, pool = step.decode_step(params, pool, DECODE, cfg=CFG, impl="xla")
    chex.assert_trees_all_close(decode, ref_decode, **TOL)
    self.assertTrue(_split_by_heads(pool.k, mesh))   # still split by heads

    # Copy-on-write pairs and swaps touch every shard (page ops donate their input pool).
    src, dst = jnp.array([5, 2], jnp.int32), jnp.array([6, 7], jnp.int32)
    copied = page_ops.copy_pages(pool, src, dst)
    ref_copied = page_ops.copy_pages(jax.device_put(ref_pool), src, dst)
    for got, want in zip((*copied.k, *copied.v), (*ref_copied.k, *ref_copied.v)):
      chex.assert_trees_all_close(np.asarray(got), _as_stored(want, model), **TOL)
    self.assertTrue(_split_by_heads(copied.v, mesh))
    before_swap = jax.device_get(copied)
    k, v = page_ops.read_pages(copied, [3, 5])          # swap out
    ref_k, ref_v = page_ops.read_pages(ref_copied, [3, 5])
    np.testing.assert_allclose(k, _as_stored(ref_k, model), **TOL)
    np.testing.assert_allclose(v, _as_stored(ref_v, model), **TOL)
    scrubbed = page_ops.zero_pages(copied, jnp.array([3, 5], jnp.int32))
    self.assertFalse(np.asarray(scrubbed.k[0])[[3, 5]].any())
    restored = page_ops.write_pages(scrubbed, [3, 5], k, v)   # swap in
    for got, want in zip((*restored.k, *restored.v), (*before_swap.k, *before_swap.v)):
      np.testing.assert_array_equal(np.asarray(got), want)
    self.assertTrue(_split_by_heads(restored.k, mesh))

  def test_one_all_reduce_per_block_and_no_gather(self):
    # Megatron: the attention block and the MLP block each end in one all-reduce; the pool and
    # the heads are never gathered.
    mesh = sharding.make_mesh(1, 4)
    params = sharding.shard_params(PARAMS, CFG, mesh)
    pool = sharding.shard_pool(_pool(4), mesh)
    with jax.set_mesh(mesh):
      hlo = step.prefill_step.lower(params, pool, PREFILL, cfg=CFG, impl="xla").compile().as_text()
    count = lambda op: len(re.findall(rf"\b{op}(-start)?\(", hlo))
    self.assertEqual(count("all-reduce"), 2 * CFG.num_layers)
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
      self.assertEqual(count(op), 0, op)

  def test_heads_that_do_not_divide(self):
    cfg = config.tiny_config(num_q_heads=6, num_kv_heads=2)
    mesh = sharding.make_mesh(1, 4)
    with self.assertRaisesRegex(ValueError, "num_q_heads=6 does not divide across model=4"):
      Engine(testing.random_params(cfg), cfg, cache=CacheConfig(page_size=4, num_pages=8),
             mesh=mesh)
    cfg = config.tiny_config(num_q_heads=12, num_kv_heads=3, intermediate_size=64)
    with self.assertRaisesRegex(ValueError, "num_kv_heads=3 cannot be replicated evenly"):
      sharding.shard_params(testing.random_params(cfg), cfg, mesh)
    with self.assertRaisesRegex(ValueError, "needs 16 devices; 8 are visible"):
      sharding.make_mesh(4, 4)


def _requests():
  """Greedy and seeded sampled requests; two share a 9-token prefix (prefix caching), one samples
  n=2 (its samples share the prompt's partial page: copy-on-write)."""
  rng = np.random.default_rng(3)
  prefix = list(rng.integers(0, CFG.vocab_size, 9))
  prompts = [prefix + [1, 2], list(rng.integers(0, CFG.vocab_size, 13)),
             list(rng.integers(0, CFG.vocab_size, 6)), prefix + [3],
             list(rng.integers(0, CFG.vocab_size, 21)), [5, 6, 7]]
  params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4 + [
      SamplingParams(max_tokens=12, temperature=0.9, top_k=20, n=2, seed=11, ignore_eos=True),
      SamplingParams(max_tokens=14, temperature=1.0, seed=5, ignore_eos=True)]
  return prompts, params


def _engine_kw():
  # A pool too small for everything at once: sequences are preempted and swapped.
  return dict(cache=CacheConfig(page_size=PAGE, num_pages=14),
              scheduler=SchedulerConfig(max_num_seqs=4, steps_per_sync=4,
                                        preemption_mode="swap"),
              impl="xla", seed=0)


def _run(engine):
  """The requests, then two one after the other with the same 8-token prefix: the second reuses
  the first's cached pages (prefix caching). The tokens of every completion."""
  prompts, params = _requests()
  outs = engine.generate(prompts, params)
  for tail in ([1], [2, 3]):
    outs += engine.generate([prompts[0][:8] + tail], SamplingParams(max_tokens=5, temperature=0))
  return [[c.token_ids for c in o.outputs] for o in outs]


class EngineTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    engine = Engine(PARAMS, CFG, **_engine_kw())
    cls.ref = _run(engine)
    cls.ref_stats = engine.stats

  def test_reference_run_exercises_the_features(self):
    s = self.ref_stats
    self.assertGreater(s.swapped_out_pages, 0)
    self.assertGreater(s.cow_copies, 0)
    self.assertGreater(s.cached_prompt_tokens, 0)
    self.assertGreater(s.decode_rounds, 0)   # multi-step decode rounds ran

  @parameterized.parameters(*MESHES)
  def test_engine_equals_one_device(self, data, model):
    mesh = sharding.make_mesh(data, model)
    if data == 1:
      engine = Engine(PARAMS, CFG, mesh=mesh, **_engine_kw())
      replicas = [engine]
    else:
      engine = DataParallelEngine(PARAMS, CFG, mesh=mesh, **_engine_kw())
      replicas = engine.replicas
    self.assertEqual(_run(engine), self.ref)
    engine.check_invariants()
    for e in replicas:
      self.assertTrue(_split_by_heads(e.pool.k, e.mesh))
      self.assertEqual(len(e.pool.k.sharding.device_set), model)
    if data > 1:   # the requests spread over the replicas, each on its own devices
      busy = sum(e.stats.prefill_tokens > 0 for e in replicas)
      self.assertEqual(busy, min(data, len(_requests()[0])))
      self.assertEqual(len(set().union(*(e.pool.k.sharding.device_set for e in replicas))),
                       data * model)

  @parameterized.parameters((4, "page"), (8, "tensor"), (2, "token"))
  def test_quantized_pool_equals_one_device(self, model, granularity):
    # int8 pages with their scales split over the heads (replicated where a head is, or where
    # there is one per tensor): the same tokens as the same format on one device.
    kw = _engine_kw()
    kw["cache"] = CacheConfig(page_size=PAGE, num_pages=14, kv_dtype="int8",
                              kv_scales=granularity)
    ref = _run(Engine(PARAMS, CFG, **kw))
    mesh = sharding.make_mesh(1, model)
    engine = Engine(PARAMS, CFG, mesh=mesh, **kw)
    self.assertEqual(_run(engine), ref)
    self.assertGreater(engine.stats.swapped_out_pages, 0)   # the scales went to host and back
    self.assertTrue(_split_by_heads(engine.pool.k, engine.mesh))
    self.assertEqual(len(engine.pool.k_scale.sharding.device_set), model)

  def test_data_parallel_bookkeeping(self):
    engine = DataParallelEngine(PARAMS, CFG, mesh=sharding.make_mesh(2, 1), **_engine_kw())
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    long = SamplingParams(max_tokens=30, temperature=0.0)
    a = engine.add_request([1, 2, 3], long)      # 9 pages at most -> replica 0
    b = engine.add_request([4, 5], sp)           # replica 1 (0 is loaded)
    c = engine.add_request([6, 7, 8], sp)        # replica 1 again: 2 + 2 pages < 9
    self.assertEqual([engine.placement(x) for x in (a, b, c)], [0, 1, 1])
    with self.assertRaisesRegex(ValueError, "request_id='req-0' is already in use"):
      engine.add_request([1], sp, request_id=a)
    with self.assertRaisesRegex(ValueError, "outside"):
      engine.add_request([CFG.vocab_size], sp)   # refused, nothing queued
    self.assertTrue(engine.abort(c))
    self.assertFalse(engine.abort("nope"))
    finished = {o.request_id: o for o in engine.stream() if o.finished}
    self.assertEqual(set(finished), {a, b, c})
    self.assertEqual(finished[c].outputs[0].finish_reason, "abort")
    self.assertEqual(len(finished[a].outputs[0].token_ids), 30)
    self.assertIsNone(engine.placement(a))        # finished: the load is released
    self.assertEqual(engine.loads, [0, 0])
    m = engine.metrics()
    self.assertEqual(m["decode_tokens"], sum(r["decode_tokens"] for r in m["replicas"]))
    self.assertEqual(m["num_pages"], 2 * 14)
    self.assertEqual(engine.capacity_tokens, 2 * 13 * PAGE)
    engine.check_invariants()


class ServeTest(absltest.TestCase):
  """`python -m paged_jax.serve --mesh=...` on the embedded model (4 query heads over 2 KV
  heads): the same completions as one device."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = serve.load_model(serve.ServeConfig())
    cls.ref = cls._completions("1x1")

  @classmethod
  def _completions(cls, mesh):
    cfg = serve.ServeConfig(num_requests=6, max_tokens=8, progress=False, mesh=mesh,
                            num_pages=40, page_size=8)
    return [c["token_ids"] for c in serve.run(cfg, cls.model)["completions"]]

  def test_mesh_flag(self):   # the other meshes run in EngineTest; this is the flag's path
    self.assertEqual(self._completions("2x4"), self.ref)

  def test_heads_that_do_not_divide(self):
    with self.assertRaisesRegex(ValueError, "num_q_heads=4 does not divide across model=8"):
      self._completions("1x8")


class MeshBenchTest(absltest.TestCase):

  def test_capacity_grows_with_devices(self):
    out = self.create_tempdir().full_path
    cfg = mesh_bench.MeshBenchConfig(preset="tiny", meshes=("1x1", "1x2", "1x4", "2x1"),
                                     num_requests=3, new_tokens=4, results_dir=out)
    r = mesh_bench.run(cfg, progress=lambda *_: None)
    rows = {x["mesh"]: x for x in r["rows"]}
    self.assertTrue(all(x["same_tokens_as_one_device"] for x in r["rows"]))
    budget = cfg.kv_bytes_per_device
    for x in r["rows"]:   # every device's shard of the pool stays within the budget
      self.assertLessEqual(x["pool_bytes_per_device"], budget)
      self.assertGreater(x["pool_bytes_per_device"], 0.99 * budget)
    # tiny: 2 KV heads. 2-way TP halves each device's page: twice the pages; 4-way replicates
    # each KV head on 2 devices (one head per device): still twice; 2 replicas: twice.
    self.assertAlmostEqual(rows["1x2"]["capacity_x"], 2.0, delta=0.01)
    self.assertAlmostEqual(rows["1x4"]["capacity_x"], 2.0, delta=0.01)
    self.assertEqual(rows["1x4"]["stored_kv_heads"], 4)
    self.assertAlmostEqual(rows["2x1"]["capacity_x"], 2.0, delta=0.01)
    self.assertIn("1x4", mesh_bench.format_result(r))
    output.record(r, out, "mesh_bench", mesh_bench.plot)
    self.assertTrue(os.path.getsize(os.path.join(out, "mesh_bench.png")) > 0)


if __name__ == "__main__":
  if jax.device_count() < 8:
    sys.exit(f"needs 8 devices, found {jax.device_count()}: set "
             f"XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")
  absltest.main()
