"""The device sampler as distributions: temperature, top-k, top-p, per-row settings, seeds."""

import re

from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.sampling import SamplingArrays, SamplingParams, argmax, sample, truncate

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


class ParamsTest(parameterized.TestCase):
  """SamplingParams' validation: each refusal's whole message, and the boundary values accepted."""

  def test_boundary_values_are_accepted(self):
    p = SamplingParams(max_tokens=1, temperature=0, top_k=0, top_p=1.0, seed=0, n=1,
                       beam_width=1, logprobs=0, stop_token_ids=[0], length_penalty=-2)
    self.assertEqual((p.use_beam_search, p.greedy), (False, True))
    SamplingParams(seed=2 ** 32 - 1, top_p=1e-9, temperature=1e-9)
    beam = SamplingParams(beam_width=2, n=2, temperature=0.0)
    self.assertEqual((beam.use_beam_search, SamplingParams(temperature=0.5).greedy), (True, False))
    numpy = SamplingParams(max_tokens=np.int64(3), top_k=np.int32(2), temperature=np.float32(0.5),
                           top_p=np.float64(0.5), seed=np.uint32(7), ignore_eos=np.bool_(True),
                           stop_token_ids=np.array([4, 5]))
    self.assertEqual(numpy.stop_token_ids, (4, 5))
    self.assertEqual([type(t) for t in numpy.stop_token_ids], [int, int])

  @parameterized.named_parameters(
      *[(f"{name}_{type(value).__name__}", {name: value}, f"{name}={value!r} must be an int")
        for name in ("max_tokens", "top_k", "n", "beam_width", "logprobs")
        for value in (True, 2.0)],
      ("np_bool_int", dict(n=np.bool_(True)), f"n={np.bool_(True)!r} must be an int"),
      *[(f"{name}_{type(value).__name__}", {name: value}, f"{name}={value!r} must be a number")
        for name in ("temperature", "top_p", "length_penalty") for value in (False, "1")],
      ("np_bool_number", dict(top_p=np.bool_(True)), f"top_p={np.bool_(True)!r} must be a number"),
      ("seed_bool", dict(seed=True), "seed=True must be an int or None"),
      ("seed_np_bool", dict(seed=np.bool_(False)),
       f"seed={np.bool_(False)!r} must be an int or None"),
      ("seed_float", dict(seed=1.0), "seed=1.0 must be an int or None"),
      ("ignore_eos", dict(ignore_eos=1), "ignore_eos=1 must be a bool"),
      ("stop_not_a_sequence", dict(stop_token_ids=3),
       "stop_token_ids=3 must be a sequence of token ids"),
      ("stop_floats", dict(stop_token_ids=[1, 1.5, True, "a", 2.5]),
       "stop_token_ids=(1, 1.5, True, 'a', 2.5) must be token ids (ints); got [1.5, True, 'a']"),
      ("max_tokens", dict(max_tokens=0), "max_tokens=0 must be >= 1"),
      ("temperature", dict(temperature=-1.0), "temperature=-1.0 must be a finite number >= 0"),
      ("temperature_nan", dict(temperature=float("nan")),
       "temperature=nan must be a finite number >= 0"),
      ("temperature_inf", dict(temperature=float("inf")),
       "temperature=inf must be a finite number >= 0"),
      ("top_k", dict(top_k=-1), "top_k=-1 must be >= 0 (0 = off)"),
      ("top_p_0", dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
      ("top_p_above_1", dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
      ("length_penalty", dict(length_penalty=float("inf")), "length_penalty=inf must be finite"),
      ("n", dict(n=0), "n=0 must be >= 1"),
      ("beam_width", dict(beam_width=0), "beam_width=0 must be >= 1"),
      ("logprobs", dict(logprobs=-1), "logprobs=-1 must be >= 0"),
      ("stop_negative", dict(stop_token_ids=[3, -1]),
       "stop_token_ids=(3, -1) must be token ids >= 0"),
      ("seed_negative", dict(seed=-1), "seed=-1 must be in [0, 2**32)"),
      ("seed_too_big", dict(seed=2 ** 32), "seed=4294967296 must be in [0, 2**32)"),
      ("beam_temperature", dict(beam_width=2, temperature=0.5),
       "beam search is deterministic: temperature=0.5 must be 0"),
      ("beam_n", dict(beam_width=2, n=3), "n=3 must be <= beam_width=2"),
      # Beam search adds its checks to the others, not in their place.
      ("beam_max_tokens", dict(beam_width=2, max_tokens=0), "max_tokens=0 must be >= 1"),
      ("beam_seed", dict(beam_width=3, seed=-1), "seed=-1 must be in [0, 2**32)"),
  )
  def test_each_refusal_says_exactly_what(self, kw, message):
    with self.assertRaisesRegex(ValueError, f"^{re.escape(message)}$"):
      SamplingParams(**kw)

  def test_from_rows_places_each_row_and_pads_with_greedy_rows(self):
    p = SamplingParams(temperature=0.7, top_k=3, top_p=0.9)
    a = SamplingArrays.from_rows([(p, 11, 2, 5), (SamplingParams(), 12, 0, 1)], 3)
    np.testing.assert_allclose(a.temperature, [0.7, 0.0, 0.0])
    np.testing.assert_array_equal(a.top_k, [3, 0, 0])
    np.testing.assert_allclose(a.top_p, [0.9, 1.0, 1.0])
    np.testing.assert_array_equal(a.seed, [11, 12, 0])
    np.testing.assert_array_equal(a.sample_index, [2, 0, 0])
    np.testing.assert_array_equal(a.output_index, [5, 1, 0])
    self.assertEqual([x.dtype for x in (a.temperature, a.top_k, a.top_p, a.seed, a.sample_index,
                                        a.output_index)],
                     [np.float32, np.int32, np.float32, np.uint32, np.int32, np.int32])


class TruncateAndOutputsTest(parameterized.TestCase):
  """truncate's cut-offs checked exactly (no draws), sample's outputs' shapes and dtypes."""

  def test_top_k_keeps_exactly_k(self):
    # Random rows without ties: exactly the k largest stay finite, whatever f32 rounding does to
    # the mass of the k kept tokens (top_p = 1). Found by mutation testing: top_p = 1 used to drop
    # the last 1-2 of 50 tokens in 18 of 200 rows (the mass before them rounded to 1).
    logits = np.random.default_rng(3).normal(size=(200, 50)).astype(np.float32) * 3
    for k in (1, 3, 49, 50, 80):
      out = np.asarray(truncate(jnp.asarray(logits), jnp.full(200, k), jnp.ones(200)))
      kept = np.isfinite(out)
      np.testing.assert_array_equal(kept.sum(-1), min(k, 50))
      np.testing.assert_array_equal(out[kept], logits[kept])
      np.testing.assert_array_equal(
          kept, logits >= np.sort(logits, -1)[:, ::-1][:, min(k, 50) - 1:min(k, 50)])

  def test_top_p_runs_on_the_top_k_renormalized(self):
    # top-k 2 renormalizes .4, .25 to .615, .385: the first token alone reaches top_p .6. (Over
    # three tokens, .5 / .3125 / ..., or over the raw mass, .4, it would not.)
    out = truncate(jnp.asarray(LOGITS[None], jnp.float32), jnp.array([2]), jnp.array([0.6]))
    np.testing.assert_array_equal(np.isfinite(np.asarray(out[0])), [1, 0, 0, 0, 0, 0])

  def test_mass_exactly_p_stops_the_set(self):
    # exp(-0.6931472) is 0.5 in f32, so these probabilities are exactly .5, .25, .25: the first
    # token's mass is exactly top_p = .5, so the set is {token 0} (the mass "reaches" p).
    x = np.float32(-0.6931472)
    logits = jnp.array([[0.0, x, x]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.nn.softmax(logits, axis=-1))[0], [.5, .25, .25])
    out = truncate(logits, jnp.array([0]), jnp.array([0.5], jnp.float32))
    np.testing.assert_array_equal(np.isfinite(np.asarray(out[0])), [1, 0, 0])

  def test_argmax_of_other_ranks(self):
    rng = np.random.default_rng(1)
    for shape in ((7,), (3, 4, 9), (2, 3, 2, 5)):
      x = np.round(rng.normal(size=shape)).astype(np.float32)   # ties
      got = np.asarray(argmax(jnp.asarray(x)))
      np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
      self.assertEqual((got.shape, got.dtype), (shape[:-1], np.int32))

  def test_outputs_without_logprobs(self):
    arrays = SamplingArrays.from_rows([(SamplingParams(temperature=1.0), 0, 0, 0)] * 3, 3)
    out = sample(jnp.asarray(np.stack([LOGITS] * 3), jnp.float32), arrays)
    self.assertEqual((out.top_ids.shape, out.top_ids.dtype), ((3, 0), jnp.int32))
    self.assertEqual((out.top_logprobs.shape, out.top_logprobs.dtype), ((3, 0), jnp.float32))
    self.assertEqual((out.tokens.shape, out.tokens.dtype), ((3,), jnp.int32))

  def test_bf16_logits_give_f32_logprobs(self):
    logits = jnp.asarray(np.stack([LOGITS, LOGITS[::-1]]), jnp.bfloat16)
    arrays = SamplingArrays.from_rows([(SamplingParams(), 0, 0, 0)] * 2, 2)
    out = sample(logits, arrays, num_logprobs=2)
    f = np.asarray(logits.astype(jnp.float32))
    want = f - np.log(np.exp(f).sum(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(out.tokens), [0, 5])
    self.assertEqual((out.logprob.dtype, out.top_logprobs.dtype), (jnp.float32, jnp.float32))
    np.testing.assert_allclose(np.asarray(out.logprob), [want[0, 0], want[1, 5]], rtol=1e-6)

  def test_greedy_only_is_argmax(self):
    logits = np.random.default_rng(2).normal(size=(5, 11)).astype(np.float32)
    arrays = SamplingArrays.from_rows([(SamplingParams(), 0, 0, 0)] * 5, 5)
    fast = sample(jnp.asarray(logits), arrays, greedy_only=True, num_logprobs=1)
    full = sample(jnp.asarray(logits), arrays, num_logprobs=1)
    np.testing.assert_array_equal(np.asarray(fast.tokens), np.argmax(logits, -1))
    for a, b in zip(jax.tree_util.tree_leaves(fast), jax.tree_util.tree_leaves(full)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


if __name__ == "__main__":
  absltest.main()
