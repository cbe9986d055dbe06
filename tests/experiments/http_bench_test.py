"""experiments.http_bench against our server (launched by it) on the embedded model."""

import json
import math
import os
import tempfile

from absl.testing import absltest
import pytest

from experiments import http_bench


class HttpBenchTest(absltest.TestCase):

  # A server subprocess (imports, compiling): ~24 s, over the README tier's 20 s bound. A planted
  # task leak (a task left running per stream) fails it: tasks_over_idle 8.
  @pytest.mark.slow
  def test_a_burst_with_disconnects_completes_the_rest_and_leaks_nothing(self):
    with tempfile.TemporaryDirectory() as tmp:
      cfg = http_bench.HttpBenchConfig(
          rates=(math.inf,), num_requests=8, max_total=64, disconnect=0.5, seed=3,
          server_args=("--num_pages=64", "--program_store=", "--compilation_cache="),
          results_dir=tmp)
      lines = []
      (row,) = http_bench.run(cfg, progress=lines.append)
      self.assertEqual(row["errors"], 0, row["error_examples"])
      left = sum(r["disconnect"] for r in http_bench.requests_for(cfg))
      self.assertGreater(left, 0)
      self.assertEqual((row["disconnected"], row["completed"]), (left, 8 - left))
      self.assertEqual(row["server_holds"], dict.fromkeys(row["server_holds"], 0.0))
      for key in ("ttft_s", "e2e_s"):
        self.assertLessEqual(row[key]["p50"], row[key]["p90"])
      self.assertLessEqual(row["ttft_s"]["p90"], row["e2e_s"]["p99"])
      self.assertGreater(row["output_tokens_per_s"], 0)
      with open(os.path.join(tmp, "http_bench.jsonl")) as f:
        self.assertEqual(json.loads(f.readline())["completed"], 8 - left)
      self.assertIn("rate inf/s", lines[0])


if __name__ == "__main__":
  absltest.main()
