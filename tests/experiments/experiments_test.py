"""Every experiment's importable run(config) on a tiny config: it runs, checks itself, reports."""

from absl.testing import absltest

from experiments import allocator_waste, attention_bench, block_manager_bench, demo


class ExperimentsTest(absltest.TestCase):

  def test_demo(self):
    r = demo.run(demo.DemoConfig(seq_lens=(1, 5, 17), q_lens=(1, 5, 2), page_size=4,
                                 num_q_heads=4, num_kv_heads=2, head_dim=8))
    self.assertLessEqual(r["max_abs_err"], 1e-5)
    self.assertEqual(r["nan_outputs"], 0)

  def test_demo_rejects_mismatched_lengths(self):
    with self.assertRaisesRegex(ValueError, "differ in length"):
      demo.run(demo.DemoConfig(seq_lens=(1, 2), q_lens=(1,)))

  def test_attention_bench(self):
    cfg = attention_bench.BenchConfig(num_seqs=2, seq_len=40, q_len=1, page_size=4, num_q_heads=4,
                                      num_kv_heads=2, head_dim=8, rounds=1, iters=1)
    records = attention_bench.run(cfg, copy_bytes_per_s=1e9)
    self.assertEqual([r["impl"] for r in records], list(cfg.impls))
    for r in records:
      self.assertLessEqual(r["max_abs_err"], 1e-5)
      self.assertGreater(r["ms"], 0)
    self.assertEqual(records[1]["ratio_vs_baseline"], 1.0)
    with self.assertRaisesRegex(ValueError, "not available"):
      attention_bench.run(attention_bench.BenchConfig(impls=("nope",)), copy_bytes_per_s=1e9)

  def test_attention_bench_kernels_interpreted(self):
    # The GPU comparison's code path, through Pallas' interpreter at a tiny shape.
    cfg = attention_bench.BenchConfig(
        num_seqs=2, seq_len=256, page_size=16, num_q_heads=4, num_kv_heads=2, head_dim=16,
        impls=("pallas", "jax_paged", "jax_decode", "paged_xla"), baseline="jax_paged",
        rounds=1, iters=1, interpret=True)
    records = attention_bench.run(cfg, copy_bytes_per_s=1e9)
    self.assertEqual([r["impl"] for r in records], list(cfg.impls))
    self.assertLessEqual(records[0]["max_abs_err"], 1e-5)

  def test_attention_bench_mixed_batch_in_one_kernel_launch(self):
    cfg = attention_bench.BenchConfig(
        num_seqs=3, seq_len=32, q_len=8, num_prefill_seqs=1, page_size=4, num_q_heads=4,
        num_kv_heads=2, head_dim=16, impls=("pallas", "paged_xla"), baseline="paged_xla",
        rounds=1, iters=1, interpret=True)
    records = attention_bench.run(cfg, copy_bytes_per_s=1e9)
    self.assertEqual({r["mode"] for r in records}, {"mixed"})
    self.assertTrue(all(r["max_abs_err"] <= 1e-5 for r in records))

  def test_block_manager_bench(self):
    r = block_manager_bench.run(block_manager_bench.ManagerBenchConfig(
        num_pages=200, num_seqs=8, page_size=4, prompt_len=10, decode_steps=5, cycles=2,
        decode_batch=4, attention_seq_len=16, num_q_heads=2, num_kv_heads=1, head_dim=8))
    self.assertGreater(r["decode_tokens_per_s"], 0)
    self.assertGreater(r["manager_share_of_one_layer"], 0)
    with self.assertRaisesRegex(ValueError, "is too small"):
      block_manager_bench.run(block_manager_bench.ManagerBenchConfig(num_pages=10, num_seqs=8))

  def test_allocator_waste_paged_beats_every_baseline(self):
    records = allocator_waste.run(allocator_waste.WasteConfig(
        workload="alpaca", num_requests=60, capacity_tokens=2048, page_size=16, max_len=512))
    by = {r["allocator"]: r for r in records}
    self.assertGreater(by["paged"]["token_state_fraction"], 0.9)
    for name in ("max", "pow2", "oracle"):
      self.assertLess(by[name]["token_state_fraction"], by["paged"]["token_state_fraction"])
      self.assertLessEqual(by[name]["mean_batch"], by["paged"]["mean_batch"])
    # Oracle reserves exactly the final length: never less than what it stores.
    self.assertLessEqual(by["oracle"]["token_state_fraction"], 1.0)


if __name__ == "__main__":
  absltest.main()
