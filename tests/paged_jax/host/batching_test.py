"""Shape buckets of the host's step arrays (`paged_jax.host.batching`): how many programs a run
compiles, and which rows, tokens and table columns each one pads to."""

from absl.testing import absltest

from paged_jax import config, testing
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

  def test_token_buckets(self):
    self.assertEqual([batching.token_bucket(n) for n in (1, 16, 17, 256, 257, 300, 2049)],
                     [16, 16, 32, 256, 288, 320, 2304])

  def test_a_single_users_decode_round_has_one_row(self):
    for users, rows in ((1, 1), (2, 8), (9, 16)):
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


if __name__ == "__main__":
  absltest.main()
