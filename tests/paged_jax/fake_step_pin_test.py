"""Pins the generation loop's scheduling with a fake step (no model): next token = last token + 1.

Request r's prompt is 100 * r + (0, 1, ...), so every token names its request (token // 100) and
every output is predictable. The fake step records what each step ran: prefill rows as
(request, first position, stop) and decode rows with their step count.
"""

import types

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import config, generate, step

CFG = config.tiny_config(vocab_size=1000)


class FakeStep:
  """Stands in for `paged_jax.step`: logits put all mass on last token + 1."""

  def __init__(self):
    self.events = []

  def prefill_step(self, params, pool, batch, *, cfg, impl):
    cu = np.asarray(batch.md.cu_q_lens)
    pos, toks = np.asarray(batch.positions), np.asarray(batch.tokens)
    rows = [(int(toks[a]) // 100, int(pos[a]), int(pos[b - 1]) + 1)
            for a, b in zip(cu[:-1], cu[1:]) if b > a]
    self.events.append(("prefill", rows))
    return 10 * jax.nn.one_hot(toks[np.asarray(batch.logits_indices)] + 1, cfg.vocab_size), pool

  def multi_step_decode(self, params, pool, state, key, *, cfg, num_steps, sampling, impl):
    active, toks = np.asarray(state.active), np.asarray(state.tokens)
    self.events.append(("decode", [int(t) // 100 for t in toks[active]], num_steps))
    return jnp.asarray(toks[None, :] + np.arange(1, num_steps + 1)[:, None]), pool


def prompts(*lengths):
  return [[100 * r + i for i in range(n)] for r, n in enumerate(lengths)]


class GeneratorPinTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.fake = FakeStep()
    module = types.SimpleNamespace(prefill_step=self.fake.prefill_step,
                                   multi_step_decode=self.fake.multi_step_decode,
                                   DecodeState=step.DecodeState, Batch=step.Batch)
    original = generate.step
    generate.step = module
    self.addCleanup(setattr, generate, "step", original)

  def make(self, **kw):
    return generate.Generator(None, CFG, **{"num_pages": 40, "page_size": 4, **kw})

  def test_fifo_admission_and_chunked_prefill(self):
    g = self.make(steps_per_sync=2, max_prefill_tokens=6)
    out = g.generate(prompts(5, 7, 3), 4)
    self.assertEqual(out, [[5, 6, 7, 8], [107, 108, 109, 110], [203, 204, 205, 206]])
    self.assertEqual(self.fake.events, [
        ("prefill", [(0, 0, 5), (1, 0, 1)]),   # FIFO, the budget of 6 splits request 1
        ("prefill", [(1, 1, 7)]),              # its next chunk continues where it stopped
        ("prefill", [(2, 0, 3)]),              # prefill before any decode
        ("decode", [0, 1, 2], 2),              # 3 decode tokens at k = 2: two rounds
        ("decode", [0, 1, 2], 2),
    ])

  def test_finishing_on_eos_and_max_tokens_with_n(self):
    g = self.make(steps_per_sync=3)
    out = g.generate(prompts(2, 4), 5, n=2, eos_id=4)
    # Request 0 hits EOS (token 4) at its third token; request 1 runs to max_new_tokens.
    self.assertEqual(out, [[2, 3, 4], [2, 3, 4], [104, 105, 106, 107, 108],
                           [104, 105, 106, 107, 108]])
    self.assertEqual(self.fake.events, [
        ("prefill", [(0, 0, 2), (1, 0, 4)]),
        ("decode", [0, 0, 1, 1], 3),
        ("decode", [1, 1], 3),
    ])
    self.assertEqual(g.stats.cow_copies, 1)   # request 0's children diverge in a shared page
    g.bm.check_invariants()
    self.assertEqual(g.bm.stats()["pages_in_use"], 0)

  def test_preemption_victim_is_the_newest_other_sequence(self):
    # 8 usable pages of 2 tokens: three sequences of 3 + 6 tokens cannot all fit.
    g = self.make(num_pages=9, page_size=2, steps_per_sync=2)
    out = g.generate(prompts(3, 3, 3), 6)
    self.assertEqual(out, [[3, 4, 5, 6, 7, 8], [103, 104, 105, 106, 107, 108],
                           [203, 204, 205, 206, 207, 208]])
    # Growing request 2 preempts request 1 (the newest other than itself); it is recomputed
    # first, from the full pages the prefix cache kept (positions 2..4).
    self.assertEqual(self.fake.events[:3], [
        ("prefill", [(0, 0, 3), (1, 0, 3), (2, 0, 3)]),
        ("decode", [0, 2], 2),
        ("prefill", [(1, 2, 4)]),
    ])
    self.assertEqual(g.stats.preemptions, 4)


if __name__ == "__main__":
  absltest.main()
