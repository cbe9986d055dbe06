"""Shape buckets of the host's step arrays (`paged_jax.host.batching`): how many programs a run
compiles, and which rows, tokens and table columns each one pads to."""

import collections
import dataclasses

from absl.testing import absltest
import numpy as np

from paged_jax import config, cpu_kernel, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host import batching
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

CFG = config.tiny_config(vocab_size=1000, max_position=512)


class BucketTest(absltest.TestCase):

  def test_decode_rows(self):
    # One sequence decodes alone; two or more pad to a power of two of at least MIN_DECODE_ROWS.
    got = [batching.decode_bucket(n) for n in (1, 2, 7, 8, 9, 16, 17, 64)]
    self.assertEqual(got, [1, 8, 8, 8, 16, 16, 32, 64])
    # A decode round pads to the next power of two: its matmuls cost by the padded rows.
    got = [batching.round_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)]
    self.assertEqual(got, [1, 2, 4, 4, 8, 8, 16, 64])

  def test_token_buckets(self):
    # Powers of two up to 64, four buckets an octave up to 256, eight above.
    self.assertEqual([batching.token_bucket(n) for n in (1, 16, 17, 33, 64, 65, 81, 128, 129, 144,
                                                          161, 256, 257, 300, 2049)],
                     [16, 16, 32, 64, 64, 80, 96, 128, 160, 160, 192, 256, 288, 320, 2304])
    self.assertEqual(sorted({batching.token_bucket(n) for n in range(1, 513)}),
                     [16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256] + list(range(288, 513, 32)))

  def test_decode_rounds_pad_to_a_power_of_two_rows(self):
    for users, rows in ((1, 1), (2, 2), (3, 4), (9, 16)):
      engine = Engine(None, CFG, cache=CacheConfig(page_size=4, num_pages=64),
                      scheduler=SchedulerConfig(steps_per_sync=4),
                      steps=testing.FakeSteps().functions())
      for i in range(users):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=16, ignore_eos=True))
      engine.step()   # the prefill of every prompt
      plan = engine.scheduler.schedule()
      self.assertEqual((plan.num_steps, len(plan.rows)), (4, users))
      arrays = batching.build_decode_round(plan, engine.bm, engine.max_pages_per_seq)
      self.assertEqual(arrays["tokens"].shape, (rows,), users)
      self.assertEqual(arrays["block_tables"].shape[0], rows)


class ProgramsTest(absltest.TestCase):
  """`reachable_programs`: the set warmup compiles, against the keys real runs take."""

  def _serve(self, max_num_seqs, seed):
    # Requests of 1-300 tokens arriving while others decode: decode rounds, decode steps,
    # chunked prefills, mixed steps.
    rng = np.random.default_rng(seed)
    engine = Engine(None, CFG, cache=CacheConfig(page_size=4, num_pages=600),
                    scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                              max_num_batched_tokens=256, steps_per_sync=3),
                    steps=testing.FakeSteps().functions())
    for _ in range(40):
      for _ in range(rng.integers(0, 3)):
        n = int(rng.integers(1, 300))
        engine.add_request(rng.integers(0, 500, n).tolist(),
                           SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True))
      if engine.has_unfinished():
        engine.step()
    while engine.has_unfinished():
      engine.step()
    return engine

  def test_every_program_a_run_takes_is_reachable(self):
    for max_num_seqs, seed in ((6, 0), (6, 1), (1, 2)):
      engine = self._serve(max_num_seqs, seed)
      used = set(engine.programs)
      reach = set(batching.reachable_programs(engine.program_limits))
      self.assertEqual(used - reach, set(), (max_num_seqs, seed))
      kinds = {(k.kind, k.num_decode > 0, k.num_prefill_rows > 0) for k in used}
      if max_num_seqs > 1:   # the run met every kind of program, mixed steps included
        self.assertLessEqual({("round", True, False), ("step", True, True),
                              ("step", False, True)}, kinds)
      # XLA path: one block-table width, the model's whole context
      self.assertEqual({k.width for k in used}, {128})

  def test_one_users_programs(self):
    # One sequence at a time: a one-row round, a one-row decode step, and one prefill program
    # per token bucket of a chunk (its max_q_len follows from the bucket), nothing else.
    limits = batching.ProgramLimits(1, 256, 512, 4, steps_per_sync=3, fixed_width=True)
    keys = batching.reachable_programs(limits)
    buckets = sorted({batching.token_bucket(n, batching.MIN_PREFILL_TOKENS)
                      for n in range(1, 257)})
    self.assertEqual(buckets, [16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256])
    self.assertEqual(sorted(keys), sorted(
        [batching.ProgramKey("round", 1, 0, 0, 1, 128, 1, 0, 3),
         batching.ProgramKey("step", 1, 0, 0, 1, 128, 1)] +
        [batching.ProgramKey("step", 0, 4, t, batching.next_pow2(t, batching.MIN_Q_BUCKET), 128, 4)
         for t in buckets]))
    # The kernel path keeps its width buckets: 64 and 128 columns here.
    wide = batching.reachable_programs(dataclasses.replace(limits, fixed_width=False))
    self.assertEqual(len(wide), 2 * len(keys))
    # Several users multiply the mixed steps; the decode programs stay one per row bucket
    # (rounds: every power of two; one-step decodes: 1, then MIN_DECODE_ROWS and up).
    many = batching.reachable_programs(dataclasses.replace(limits, max_num_seqs=16))
    self.assertEqual(sorted(k.num_decode for k in many if k.kind == "round"), [1, 2, 4, 8, 16])
    self.assertEqual(sorted(k.num_decode for k in many if k.kind == "step" and
                            not k.num_prefill_rows), [1, 8, 16])
    self.assertGreater(len(many), 10 * len(keys))

  def test_one_prompt_programs_cover_a_light_load(self):
    # Requests arriving one at a time while others decode (a server under a light load) run
    # only programs of `reachable_programs(max_prompts=1)`: every decode program, and steps
    # that prefill one prompt's chunk beside any decode rows. On the XLA path two prompts in one
    # step can take a program outside it (a shorter longest chunk: a smaller max_q_len bucket).
    rng = np.random.default_rng(4)
    engine = Engine(None, CFG, cache=CacheConfig(page_size=4, num_pages=600),
                    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256,
                                              steps_per_sync=3),
                    impl="xla", steps=testing.FakeSteps().functions())
    self.assertFalse(engine.q_from_tokens)
    for n in rng.integers(1, 300, 30):
      engine.add_request(rng.integers(0, 500, n).tolist(),
                         SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True))
      for _ in range(int(rng.integers(1, 4))):
        if engine.has_unfinished():
          engine.step()
    while engine.has_unfinished():
      engine.step()
    limits = engine.program_limits
    light = set(batching.reachable_programs(limits, max_prompts=1))
    trickle = set(engine.programs)
    self.assertEqual(trickle - light, set())
    self.assertTrue(any(k.num_decode and k.num_prefill_rows for k in trickle))   # mixed steps
    self.assertLessEqual({k for k in batching.reachable_programs(limits) if not k.num_prefill_rows},
                         light)   # every decode program
    one_user = set(batching.reachable_programs(dataclasses.replace(limits, max_num_seqs=1)))
    self.assertLessEqual(one_user, light)
    self.assertEqual({k.num_prefill_rows for k in light}, {0, batching.MIN_PREFILL_ROWS})
    # Two short prompts in one step (40 + 30 tokens) make the 80-token bucket with max_q_len
    # 64, which one prompt of 65-80 tokens (max_q_len 128) never does.
    for p in ([1] * 40, [2] * 30):
      engine.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    pair = set(engine.programs) - trickle
    self.assertEqual([(k.num_prefill_tokens, k.max_q_len) for k in pair], [(80, 64)])
    self.assertEqual(pair & light, set())
    self.assertLess(len(light), len(batching.reachable_programs(limits)))   # 15 of 36 here
    # The scheduler's max_prefill_rows=1 makes `light` every program its limits reach, and
    # prompts that arrive together (that pair, and a long one chunked) run one a step inside it.
    capped = Engine(None, CFG, cache=CacheConfig(page_size=4, num_pages=600),
                    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256,
                                              steps_per_sync=3, max_prefill_rows=1),
                    steps=testing.FakeSteps().functions())
    self.assertEqual(set(batching.reachable_programs(capped.program_limits)), light)
    for together in (([1] * 40, [2] * 30), ([3] * 290, [4] * 7)):
      for p in together:
        capped.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
      while capped.has_unfinished():
        capped.step()
    self.assertLessEqual(set(capped.programs), light)
    self.assertEqual({k.num_prefill_rows for k in capped.programs}, {0, batching.MIN_PREFILL_ROWS})

  def test_on_the_cpu_kernel_prompts_together_run_one_prompts_programs(self):
    # The C++ kernel ignores max_q_len, so a step's follows its token bucket: up to
    # MIN_PREFILL_ROWS prompts in one step (none capped) run a program of
    # `reachable_programs(max_prompts=1)`, the pair above included.
    if cpu_kernel.unavailable_reason() is not None:
      self.skipTest(f"the CPU kernel cannot run here: {cpu_kernel.unavailable_reason()}")
    engine = Engine(None, CFG, cache=CacheConfig(page_size=4, num_pages=600),
                    scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=256,
                                              steps_per_sync=3, max_prefill_rows=4),
                    impl="cpu", steps=testing.FakeSteps().functions())
    self.assertTrue(engine.q_from_tokens)
    light = set(batching.reachable_programs(engine.program_limits, max_prompts=1))
    self.assertEqual(set(batching.reachable_programs(engine.program_limits)), light)
    self.assertEqual({k.max_q_len for k in light if k.num_prefill_rows},
                     {batching.next_pow2(k.num_prefill_tokens, batching.MIN_Q_BUCKET)
                      for k in light if k.num_prefill_rows})
    for together in (([1] * 40, [2] * 30), ([3] * 290, [4] * 7), ([5] * 9, [6] * 20, [7] * 50)):
      for p in together:
        engine.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
      before = collections.Counter(engine.programs)
      engine.step()
      (first,) = (engine.programs - before).keys()
      if sum(map(len, together)) <= 256:   # every prompt in the first step
        self.assertEqual(first.num_prefill_tokens,
                         batching.token_bucket(sum(map(len, together))))
      while engine.has_unfinished():
        engine.step()
      self.assertLessEqual(set(engine.programs), light)
    # 40 + 30 tokens: the program of one prompt of 65-80 tokens (max_q_len 128, not 64)
    self.assertIn(batching.ProgramKey("step", 0, 4, 80, 128, 128, 4), engine.programs)

  def test_a_mixed_step_samples_one_row_per_row(self):
    # 5 decode rows (padded to 8) and 4 prompts (4 rows) all sample: 9 sample rows pad to the
    # step's 12 rows, not to 16 (which would be a program of its own).
    engine = Engine(None, CFG, cache=CacheConfig(page_size=4, num_pages=64),
                    scheduler=SchedulerConfig(max_num_seqs=16), steps=testing.FakeSteps().functions())
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for r in range(5):
      engine.add_request([100 * r, 100 * r + 1], params)
    engine.step()
    for r in range(5, 9):
      engine.add_request([100 * r], params)
    engine.step()
    (key,) = [k for k in engine.programs if k.num_decode and k.num_prefill_rows]
    self.assertEqual((key.num_decode, key.num_prefill_rows, key.num_samples), (8, 4, 12))

  def test_placeholder_arrays_have_the_shapes_of_the_key(self):
    engine = self._serve(6, 3)
    for key in engine.programs:
      a = batching.placeholder_arrays(key)
      self.assertEqual(batching.program_key(a, key.num_steps, key.num_logprobs), key)


if __name__ == "__main__":
  absltest.main()
