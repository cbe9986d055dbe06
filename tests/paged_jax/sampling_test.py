"""The device sampler as distributions: temperature, top-k, top-p, per-row settings, seeds."""

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling import SamplingArrays, SamplingParams, argmax, sample

DRAWS = 6000
LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))


def draw(params: SamplingParams, logits=LOGITS, draws=DRAWS, seed=5) -> np.ndarray:
  """Tokens of `draws` rows with the same logits and seed, at output indices 0..draws-1."""
  rows = [(params, seed, 0, t) for t in range(draws)]
  arrays = SamplingArrays.from_rows(rows, draws)
  out = jax.jit(sample, static_argnames=("greedy_only", "num_logprobs"))(
      jnp.tile(jnp.asarray(logits, jnp.float32), (draws, 1)), jax.device_put(arrays))
  return np.asarray(out.tokens)


def assert_frequencies(test, tokens, probs):
  """Each frequency within 5 binomial standard deviations of its probability (and zero where the
  probability is zero). A correct sampler fails one token's bound with probability ~6e-7 (normal
  tail beyond 5 sigma), a 6-token check ~3e-6; the draws are seeded, so a run is reproducible."""
  freq = np.bincount(tokens, minlength=len(probs)) / len(tokens)
  sigma = np.sqrt(np.asarray(probs) * (1 - np.asarray(probs)) / len(tokens))
  for f, p, s in zip(freq, probs, sigma):
    if p == 0:
      test.assertEqual(f, 0)
    else:
      test.assertLess(abs(f - p), 5 * s + 1e-9, (freq, probs))


class SamplerTest(parameterized.TestCase):

  def test_temperature_one_follows_the_softmax(self):
    assert_frequencies(self, draw(SamplingParams(temperature=1.0)), np.exp(LOGITS))

  def test_temperature_sharpens(self):
    p = np.exp(LOGITS / 0.5)
    assert_frequencies(self, draw(SamplingParams(temperature=0.5)), p / p.sum())

  def test_top_k_renormalizes_over_the_k_best(self):
    p = np.exp(LOGITS) * (np.arange(6) < 3)
    assert_frequencies(self, draw(SamplingParams(temperature=1.0, top_k=3)), p / p.sum())

  def test_top_p_keeps_the_smallest_set_reaching_p(self):
    # Mass before each token: 0, .40, .65, .80, .90, .96; top_p = 0.7 keeps the first three.
    p = np.exp(LOGITS) * (np.arange(6) < 3)
    assert_frequencies(self, draw(SamplingParams(temperature=1.0, top_p=0.7)), p / p.sum())

  def test_top_k_then_top_p(self):
    # top-k 4 renormalizes to .4/.9, .25/.9, ...; mass before: 0, .444, .722 -> top_p .6 keeps 2.
    p = np.exp(LOGITS) * (np.arange(6) < 2)
    assert_frequencies(self, draw(SamplingParams(temperature=1.0, top_k=4, top_p=0.6)),
                       p / p.sum())

  def test_temperature_applies_before_the_filters(self):
    # The documented order: logits / temperature, then top-k, then top-p. Temperature 2 flattens
    # the distribution to sqrt(p) (.277, .219, .170, .139, ...): mass before each token 0, .277,
    # .496, .666, .805 -> top_p 0.7 keeps four tokens. Filtering first would keep three.
    p = np.exp(LOGITS / 2)
    p /= p.sum()
    keep = (np.cumsum(p) - p) < 0.7
    self.assertEqual(int(keep.sum()), 4)
    q = p * keep
    assert_frequencies(self, draw(SamplingParams(temperature=2.0, top_p=0.7)), q / q.sum())

  def test_rows_with_different_settings_in_one_batch(self):
    settings = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1),
                SamplingParams(temperature=1.0, top_k=2)]
    rows = [(settings[i % 3], 11, 0, i) for i in range(3 * 500)]
    logits = jnp.tile(jnp.asarray(LOGITS[::-1].copy(), jnp.float32), (len(rows), 1))
    out = np.asarray(sample(logits, SamplingArrays.from_rows(rows, len(rows))).tokens)
    self.assertTrue(np.all(out[0::3] == 5))             # greedy
    self.assertTrue(np.all(out[1::3] == 5))             # top-1
    self.assertEqual(set(out[2::3].tolist()), {4, 5})  # top-2: both appear

  def test_the_stream_depends_on_seed_sample_and_position_only(self):
    base = [(SamplingParams(temperature=1.0), 7, j, t) for j in range(2) for t in range(50)]
    a = np.asarray(sample(jnp.tile(jnp.asarray(LOGITS, jnp.float32), (100, 1)),
                          SamplingArrays.from_rows(base, 100)).tokens)
    # The same rows in another order and among other rows: the same tokens.
    order = np.random.default_rng(0).permutation(100)
    shuffled = [base[i] for i in order] + [(SamplingParams(temperature=2.0), 1, 0, 0)] * 28
    b = np.asarray(sample(jnp.tile(jnp.asarray(LOGITS, jnp.float32), (128, 1)),
                          SamplingArrays.from_rows(shuffled, 128)).tokens)
    np.testing.assert_array_equal(b[:100], a[order])
    self.assertFalse(np.array_equal(a[:50], a[50:]))   # the two samples' streams differ

  def test_logprobs_are_the_raw_log_softmax(self):
    arrays = SamplingArrays.from_rows([(SamplingParams(temperature=3.0), 0, 0, 0)], 1)
    out = sample(jnp.asarray(LOGITS[None], jnp.float32), arrays, num_logprobs=3)
    np.testing.assert_allclose(out.top_logprobs[0], LOGITS[:3], atol=1e-6)
    np.testing.assert_array_equal(out.top_ids[0], [0, 1, 2])
    np.testing.assert_allclose(out.logprob[0], LOGITS[int(out.tokens[0])], atol=1e-6)

  def test_logprobs_of_unnormalized_logits(self):
    # Shifted and scaled: log_softmax must subtract the log-sum-exp (LOGITS alone sum to one).
    logits = 2.0 * LOGITS + 3.0
    want = logits - np.log(np.exp(logits).sum())
    rows = [(SamplingParams(temperature=0.0), 0, 0, 0), (SamplingParams(temperature=1.0), 1, 0, 0)]
    out = sample(jnp.asarray(np.stack([logits, logits]), jnp.float32),
                 SamplingArrays.from_rows(rows, 2), num_logprobs=2)
    self.assertEqual(int(out.tokens[0]), 0)
    np.testing.assert_allclose(out.logprob, want[np.asarray(out.tokens)], atol=1e-5)
    np.testing.assert_allclose(out.top_logprobs, np.stack([want[:2]] * 2), atol=1e-5)

  def test_argmax_is_jnp_argmax(self):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 37)).astype(np.float32)
    x[1, [4, 20]] = 9.0                # a tie: the first index
    x[2, :] = -np.inf                   # all -inf: index 0
    x[3, [7, 30]] = np.nan              # NaN wins, the first one
    x[4, [2, 36]] = [np.inf, np.inf]    # +inf tie
    x[5] = np.round(x[5])               # many ties
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got[:5], [np.argmax(x[0]), 4, 0, 7, 2])
    self.assertEqual(got.dtype, np.int32)

  @parameterized.named_parameters(
      ("max_tokens", dict(max_tokens=0), "max_tokens=0 must be >= 1"),
      ("temperature", dict(temperature=-1.0), "temperature=-1.0 must be"),
      ("temperature_nan", dict(temperature=float("nan")), "temperature=nan must be"),
      ("top_k", dict(top_k=-2), "top_k=-2 must be >= 0"),
      ("top_p", dict(top_p=0.0), r"top_p=0.0 must be in \(0, 1\]"),
      ("n", dict(n=0), "n=0 must be >= 1"),
      ("beam_temperature", dict(beam_width=2, temperature=0.5), "beam search is deterministic"),
      ("beam_n", dict(beam_width=2, n=3), "n=3 must be <= beam_width=2"),
      ("stop", dict(stop_token_ids=[1.5]), "must be token ids"),
      ("seed", dict(seed=-1), r"seed=-1 must be in \[0, 2\*\*32\)"),
  )
  def test_bad_params_are_named(self, kw, message):
    with self.assertRaisesRegex(ValueError, message):
      SamplingParams(**kw)


if __name__ == "__main__":
  absltest.main()
