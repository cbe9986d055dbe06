"""The serve command's run(config) on the embedded model, and the synthetic workloads."""

import dataclasses
import json
import math
import os
import tempfile

from absl.testing import absltest
import pytest
import numpy as np

from paged_jax import model, serve, workloads

MODEL = serve.load_model(serve.ServeConfig())


class ServeTest(absltest.TestCase):

  def test_text_prompts_on_the_embedded_copy_model(self):
    r = serve.run(serve.ServeConfig(prompts=("h e l l o", "k v c a c h e"), page_size=4,
                                    num_pages=64, progress=False), MODEL)
    self.assertEqual([c["text"] for c in r["completions"]], [" h e l l o", " k v c a c h e"])
    self.assertEqual([c["finish_reason"] for c in r["completions"]], ["stop", "stop"])
    self.assertEqual(r["output_tokens"], 5 + 1 + 7 + 1)   # the letters and EOS
    self.assertGreater(r["output_tokens_per_s"], 0)
    self.assertIsNotNone(r["ttft_s"]["p50"])

  def test_one_user_warmup_covers_the_prompts(self):
    # The embedded model's context (128) leaves two token buckets: warmup compiles their prefill,
    # the decode programs of every row count, and the prompts then run nothing unwarmed.
    cfg = serve.ServeConfig(prompts=("h e l l o",), page_size=4, num_pages=64, max_num_seqs=4,
                            warmup="one_user", progress=False)
    r = serve.run(cfg, MODEL)
    self.assertEqual(r["completions"][0]["text"], " h e l l o")
    self.assertEqual((r["programs_not_warmed"], r["compile_included"]), (0, False))
    self.assertEqual(r["warmup"]["compiled"], r["warmup"]["programs"])
    self.assertIn("programs: 2 ran; warmup compiled", serve.report(r))
    with self.assertRaisesRegex(ValueError, "warmup='yes' is not one of"):
      serve.run(serve.ServeConfig(prompts=("a",), warmup="yes"), MODEL)

  def test_prompts_together_stay_in_one_prompt_warmup(self):
    # Two prompts at once (40 and 30 tokens). Under max_prefill_rows=1, passed on to the
    # scheduler, they prefill a step apart. Under 4 they share a step, which on the XLA path
    # would be a program outside what `--warmup=one_prompt` compiles (batching_test: their
    # longest chunk buckets below their token bucket); on the C++ CPU kernel, the engine's path
    # here, the step's max_q_len follows its token bucket and the program is one prompt's.
    texts = (" ".join("abcdefgh" * 5), " ".join("pqrst" * 6))
    for rows, steps in ((1, 2), (4, 1)):
      with self.subTest(max_prefill_rows=rows):
        cfg = serve.ServeConfig(prompts=texts, page_size=4, num_pages=64, max_num_seqs=2,
                                max_num_batched_tokens=128, max_prefill_rows=rows,
                                warmup="one_prompt", progress=False)
        r = serve.run(cfg, MODEL)
        self.assertLen(r["completions"], 2)
        self.assertTrue(all(c["text"] for c in r["completions"]))
        self.assertEqual(r["prefill_steps"], steps)
        self.assertEqual(r["programs_not_warmed"], 0)
        self.assertEqual(r["programs_on_demand"], 0)

  def test_a_due_arrival_interrupts_the_step(self):
    # serve() asks the engine to end a stoppable round when the next request is due: on a
    # clock each step advances by 0.1 s, the request arriving at 0.25 s is due from 0.3 s on.
    from unittest import mock
    from paged_jax.host.sequence import CompletionOutput, RequestOutput
    clock = [0.0]

    class Fake:   # each request finishes after 5 steps
      def __init__(self):
        self.left, self.asked = {}, []
      def validate_request(self, prompt, params):
        pass
      def add_request(self, prompt, params, arrival_time=None):
        self.left[f"r{len(self.left)}"] = 5
        return f"r{len(self.left) - 1}"
      def has_unfinished(self):
        return any(self.left.values())
      def step(self, interrupt=None):
        self.asked.append(interrupt())
        clock[0] += 0.1
        self.asked.append(interrupt())
        outs = []
        for rid in [r for r, n in self.left.items() if n]:
          self.left[rid] -= 1
          done = not self.left[rid]
          outs.append(RequestOutput(rid, [1], [CompletionOutput(0, [7], [7], None, None, [], None,
                                                                0.0, 0.0, "length" if done else None)],
                                    done, 0.0, 0.1, 0.01, 1.0 if done else None))
        return outs
    fake = Fake()
    reqs = [serve._Request([1], None, 0.0), serve._Request([2], None, 0.25)]
    with mock.patch.object(serve.time, "perf_counter", lambda: clock[0]):
      outs, _ = serve.serve(fake, reqs)
    self.assertLen(outs, 2)
    self.assertEqual(fake.asked[:6], [False, False, False, False, False, True])
    self.assertNotIn(True, fake.asked[6:])   # once added, nothing is due

  def test_stoppable_rounds_serve_the_same_tokens(self):
    cfgs = [serve.ServeConfig(prompts=("a b c d", "e f"), page_size=4, num_pages=64,
                              max_tokens=12, progress=False, stoppable_rounds=s)
            for s in (False, True)]
    runs = [serve.run(c, MODEL) for c in cfgs]
    self.assertEqual(*[[c["token_ids"] for c in r["completions"]] for r in runs])
    self.assertEqual(runs[1]["rounds_stopped"], 0)   # nothing arrived mid-round
    self.assertEqual([serve.make_engine(c, *MODEL).stoppable_rounds for c in cfgs], [False, True])
    now = dataclasses.replace(cfgs[1], links_ahead=0)
    self.assertEqual(serve.make_engine(now, *MODEL).links_ahead, 0)
    fused = serve.make_engine(dataclasses.replace(cfgs[0], fuse_projections=True), *MODEL)
    self.assertTrue(model.is_fused(fused.params))   # --fuse_projections reaches the engine

  def test_jsonl_requests_with_their_own_settings(self):
    path = os.path.join(tempfile.mkdtemp(), "requests.jsonl")
    with open(path, "w") as f:
      f.write(json.dumps({"prompt": "a b c", "n": 2, "temperature": 1.0, "seed": 1}) + "\n\n")
      f.write(json.dumps({"prompt_token_ids": [1, 5, 6, 2], "max_tokens": 2,
                          "ignore_eos": True}) + "\n")
    r = serve.run(serve.ServeConfig(prompts_file=path, page_size=4, num_pages=64,
                                    progress=False), MODEL)
    self.assertEqual([c["request"] for c in r["completions"]], [0, 0, 1])
    self.assertLen(r["completions"][2]["token_ids"], 2)
    with open(path, "a") as f:
      f.write(json.dumps({"prompt": "x", "temprature": 1}) + "\n")
    with self.assertRaisesRegex(ValueError, r"requests.jsonl:4: unknown keys \['temprature'\]"):
      serve.run(serve.ServeConfig(prompts_file=path, progress=False), MODEL)

  @pytest.mark.slow   # ~20-33 s: out of the README tier (651 s on 2026-12-03)
  def test_synthetic_workload_with_arrivals_and_preemption(self):
    # A pool of 40 pages of 4 tokens for 24 requests arriving at 2,000/s: it fills and preempts.
    r = serve.run(serve.ServeConfig(workload="alpaca", num_requests=24, request_rate=2000.0,
                                    page_size=4, num_pages=40, max_num_seqs=16,
                                    max_num_batched_tokens=64, progress=False), MODEL)
    self.assertEqual(r["num_requests"], 24)
    lens = [len(c["token_ids"]) for c in r["completions"]]
    self.assertEqual(r["output_tokens"], sum(lens))
    self.assertTrue(all(c["finish_reason"] == "length" for c in r["completions"]))   # EOS ignored
    self.assertGreater(r["preemptions"], 0)
    self.assertGreater(r["peak_kv_usage"], 0.5)
    for key in ("ttft_s", "tpot_s"):
      p = r[key]
      self.assertLessEqual(p["p50"], p["p90"])
      self.assertLessEqual(p["p90"], p["p99"])

  def test_bad_requests_are_refused_before_anything_runs(self):
    with self.assertRaisesRegex(ValueError, "it can never fit"):
      serve.run(serve.ServeConfig(prompts=("a b c d e f g h",), max_tokens=100, page_size=4,
                                  num_pages=4, progress=False), MODEL)
    with self.assertRaisesRegex(ValueError, "give --prompt or --prompts_file, not both"):
      serve.run(serve.ServeConfig(prompts=("a",), prompts_file="x"), MODEL)
    with self.assertRaisesRegex(ValueError, r"--prompts_file=/no/such.jsonl: cannot read it"):
      serve.run(serve.ServeConfig(prompts_file="/no/such.jsonl"), MODEL)


class WorkloadsTest(absltest.TestCase):

  def test_means_match_the_fits(self):
    rng = np.random.default_rng(0)
    i, o = workloads.sample_lengths(rng, "sharegpt", 200_000)
    self.assertAlmostEqual(i.mean() / 161.5, 1, delta=0.03)   # WORKLOADS.md's fitted means
    self.assertAlmostEqual(o.mean() / 335.6, 1, delta=0.03)
    self.assertEqual(np.median(i), 35)
    self.assertLessEqual((i + o).max(), 2048)
    i, o = workloads.sample_lengths(rng, "alpaca", 200_000)
    self.assertAlmostEqual(i.mean() / 19.3, 1, delta=0.03)
    self.assertAlmostEqual(o.mean() / 58.4, 1, delta=0.03)
    self.assertTrue(((i >= 6) & (i <= 508)).all() and (o <= 1470).all())

  def test_short_contexts_redraw_and_arrivals(self):
    rng = np.random.default_rng(1)
    i, o = workloads.sample_lengths(rng, "sharegpt", 500, max_total=128)
    self.assertLessEqual((i + o).max(), 128)
    gaps = np.diff(workloads.poisson_arrivals(rng, 20_000, 50.0))
    self.assertAlmostEqual(gaps.mean(), 1 / 50, delta=0.001)
    self.assertAlmostEqual(gaps.std() / gaps.mean(), 1, delta=0.05)   # exponential: CV 1
    self.assertTrue((workloads.poisson_arrivals(rng, 5, math.inf) == 0).all())
    with self.assertRaisesRegex(ValueError, "workload='x'"):
      workloads.sample_lengths(rng, "x", 3)


if __name__ == "__main__":
  absltest.main()
