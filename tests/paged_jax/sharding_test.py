"""paged_jax.sharding and data_parallel on one device, and the 8-device checks in their own process."""

import os
import subprocess
import sys

from absl.testing import absltest, parameterized
import jax
from jax.sharding import PartitionSpec as P
import pytest

from paged_jax import config, data_parallel, sharding
from paged_jax.config import CacheConfig

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class MeshTest(parameterized.TestCase):

  @parameterized.parameters(("1x8", (1, 8)), ("2x4", (2, 4)), ("4", (1, 4)), ("8X1", (8, 1)))
  def test_parse_mesh(self, spec, want):
    self.assertEqual(sharding.parse_mesh(spec), want)

  @parameterized.parameters("0x4", "2x", "x", "2x2x2", "a", "-1x2")
  def test_parse_mesh_rejects(self, spec):
    with self.assertRaisesRegex(ValueError, f"mesh={spec!r}"):
      sharding.parse_mesh(spec)

  def test_one_device_needs_no_mesh(self):
    self.assertIsNone(sharding.mesh_from_flag("1x1"))
    self.assertIsNone(sharding.mesh_from_flag(None))
    mesh = sharding.make_mesh(1, 1)
    self.assertEqual(sharding.axis_size(mesh, sharding.MODEL), 1)
    self.assertEqual(sharding.axis_size(None, sharding.DATA), 1)
    with self.assertRaisesRegex(ValueError, f"needs 2 devices; {jax.device_count()} are visible"):
      sharding.make_mesh(1, 2, devices=jax.devices()[:1])

  def test_ensure_host_devices(self):
    old = os.environ.get("XLA_FLAGS")
    try:
      os.environ["XLA_FLAGS"] = "--xla_dump_to=/tmp/x"
      sharding.ensure_host_devices("2x4")
      self.assertEqual(os.environ["XLA_FLAGS"],
                       "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
      sharding.ensure_host_devices("4x4")   # a count already given is kept
      self.assertTrue(os.environ["XLA_FLAGS"].endswith("device_count=8"))
      os.environ.pop("XLA_FLAGS")
      sharding.ensure_host_devices("1x1")
      self.assertNotIn("XLA_FLAGS", os.environ)
    finally:
      if old is None:
        os.environ.pop("XLA_FLAGS", None)
      else:
        os.environ["XLA_FLAGS"] = old


class TensorParallelLayoutTest(parameterized.TestCase):

  @parameterized.parameters(
      # (num_kv_heads, model) -> KV heads the pool stores
      (4, 1, 4), (4, 2, 4), (4, 4, 4), (4, 8, 8), (2, 8, 8), (1, 4, 4), (8, 4, 8))
  def test_stored_kv_heads(self, kv, model, want):
    cfg = config.tiny_config(num_q_heads=8, num_kv_heads=kv)
    self.assertEqual(cfg.stored_kv_heads(model), want)

  def test_stored_kv_heads_rejects(self):
    with self.assertRaisesRegex(ValueError, "num_kv_heads=6 does not divide across "
                                            "model_parallel=4"):
      config.tiny_config(num_q_heads=12, num_kv_heads=6).stored_kv_heads(4)
    with self.assertRaisesRegex(ValueError, "num_kv_heads=3 cannot be replicated evenly over "
                                            "model_parallel=4"):
      config.tiny_config(num_q_heads=12, num_kv_heads=3).stored_kv_heads(4)

  def test_check_tensor_parallel(self):
    sharding.check_tensor_parallel(config.tiny_config(num_q_heads=8, num_kv_heads=2), 8)
    with self.assertRaisesRegex(ValueError, "num_q_heads=4 does not divide across model=8"):
      sharding.check_tensor_parallel(config.tiny_config(), 8)
    with self.assertRaisesRegex(ValueError, "intermediate_size=60 does not divide"):
      sharding.check_tensor_parallel(
          config.tiny_config(num_q_heads=8, intermediate_size=60), 8)

  def test_megatron_roles(self):
    cfg = config.tiny_config(num_q_heads=8, num_kv_heads=4)
    spec = lambda name, ndim=2, model=4, c=cfg: sharding.param_spec(tuple(name.split("/")),
                                                                     ndim, c, model)
    self.assertEqual(spec("layers_0_self_attn/q_proj/kernel"), P(None, "model"))
    self.assertEqual(spec("layers_0_self_attn/q_proj/bias", 1), P("model"))
    self.assertEqual(spec("layers_0_self_attn/k_proj/kernel"), P(None, "model"))
    self.assertEqual(spec("layers_1_mlp/up_proj/kernel"), P(None, "model"))
    self.assertEqual(spec("layers_1_mlp/gate_proj/kernel"), P(None, "model"))
    self.assertEqual(spec("layers_0_self_attn/o_proj/kernel"), P("model", None))
    self.assertEqual(spec("layers_1_mlp/down_proj/kernel"), P("model", None))
    for name in ("embed_tokens/embedding", "lm_head/kernel", "norm/weight",
                 "layers_0_input_layernorm/weight"):
      self.assertEqual(spec(name, 2 if "/kernel" in name or "embedding" in name else 1), P())
    # 4 KV heads over 8 devices: every device computes all of them (replicated k / v weights).
    self.assertEqual(spec("layers_0_self_attn/k_proj/kernel", model=8), P())
    self.assertEqual(spec("layers_0_self_attn/q_proj/kernel", model=8), P(None, "model"))
    self.assertEqual(spec("layers_0_self_attn/q_proj/kernel", model=1), P())

  def test_pool_heads_must_divide(self):
    from paged_jax.state import KVPool
    mesh = sharding.make_mesh(1, 1)
    kw = dict(num_layers=1, num_pages=4, page_size=2, num_kv_heads=3, head_dim=4)
    self.assertEqual(sharding.new_pool(mesh, **kw).k.shape, (1, 4, 2, 3, 4))
    self.assertEqual(sharding.shard_pool(KVPool.create(**kw), mesh).v.shape, (1, 4, 2, 3, 4))
    with self.assertRaisesRegex(ValueError, "a pool of 3 KV heads does not divide across "
                                            "model=2"):
      sharding._pool_sharding(jax.sharding.AbstractMesh((1, 2), ("data", "model")),
                              KVPool.create(**kw))

  def test_budget_per_device(self):
    # A byte budget is per device: each of `model` devices holds 1 / model of every page, so the
    # pool's pages (and tokens) grow with the devices until KV heads are replicated.
    cfg = config.tiny_config(num_q_heads=8, num_kv_heads=4)
    cache = CacheConfig(page_size=4, memory_bytes=1 << 20)
    one = cache.bytes_per_page(cfg)
    self.assertEqual(one, 2 * cfg.num_layers * 4 * 4 * cfg.head_dim * 4)
    pages = [cache.resolve_num_pages(cfg, None, m) for m in (1, 2, 4, 8)]
    self.assertEqual(pages, [(1 << 20) // one, (1 << 21) // one, (1 << 22) // one,
                             (1 << 22) // one])   # model=8 stores 8 heads: one per device
    self.assertEqual(cache.bytes_per_page(cfg, 8), one // 4)


class PlacementTest(absltest.TestCase):

  def test_least_loaded_lowest_index(self):
    self.assertEqual(data_parallel.place([3, 1, 1, 2]), 1)
    self.assertEqual(data_parallel.place([0, 0]), 0)
    self.assertEqual(data_parallel.place([5, 4, 9]), 1)


@pytest.mark.slow
class MultiDeviceTest(absltest.TestCase):
  """Runs sharding_multidevice.py with 8 simulated CPU devices in its own process (XLA reads the
  device count once, when jax starts)."""

  def test_eight_devices(self):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=8").strip())
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sharding_multidevice.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = (proc.stdout + proc.stderr)[-6000:]
    self.assertEqual(proc.returncode, 0, tail)
    self.assertRegex(proc.stderr, r"Ran (1[0-9]|[2-9][0-9]) tests", tail)   # nothing silently skipped
    self.assertNotIn("skipped", proc.stderr, tail)


@pytest.mark.slow
class MultiHostTest(absltest.TestCase):

  def test_loopback_processes(self):
    # 2 processes x 2 CPU devices joined by jax.distributed (gloo): the engine's mesh spans
    # both, and each process's greedy tokens equal one device's.
    proc = subprocess.run([sys.executable, "-m", "experiments.multihost_check", "--timeout_s=240"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    tail = (proc.stdout + proc.stderr)[-4000:]
    self.assertEqual(proc.returncode, 0, tail)
    self.assertIn("process 1: 2 of 4 devices", proc.stdout, tail)
    self.assertIn("mesh 1x4: tokens equal one device's: True", proc.stdout, tail)


if __name__ == "__main__":
  absltest.main()
