"""End to end, in f32: greedy tokens from the paged steps equal greedy decoding with a dense cache."""

from absl.testing import absltest, parameterized
import chex
import jax.numpy as jnp
import numpy as np

from paged_jax import config, generate, step, testing

CFG = config.tiny_config()
PARAMS = testing.random_params(CFG, seed=0, scale=0.3)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5], [42]]
NEW = 9
_REF = {}


def dense(prompt, new=NEW):
  key = (tuple(prompt), new)
  if key not in _REF:
    _REF[key] = testing.dense_greedy(PARAMS, CFG, prompt, new)
  return _REF[key]


def make(page_size=4, num_pages=80, **kw):
  return generate.Generator(PARAMS, CFG, num_pages=num_pages, page_size=page_size,
                            impl="xla", **kw)


class PagedEqualsDenseTest(parameterized.TestCase):

  def test_reference_tokens_are_varied(self):
    # A model that repeats one token would hide KV-cache bugs.
    self.assertGreater(len({t for p in PROMPTS for t in dense(p)}), 6)

  @parameterized.parameters(1, 4, 16)
  def test_page_sizes(self, page_size):
    g = make(page_size=page_size)
    self.assertEqual(g.generate(PROMPTS, NEW), [dense(p) for p in PROMPTS])
    g.bm.check_invariants()
    self.assertEqual(g.bm.stats()["pages_in_use"], 0)

  @parameterized.parameters(1, 4, 7)
  def test_multi_step_decode(self, k):
    g = make(steps_per_sync=k)
    self.assertEqual(g.generate(PROMPTS, NEW), [dense(p) for p in PROMPTS])
    self.assertEqual(g.stats.decode_rounds, -(-(NEW - 1) // k))

  def test_chunked_prefill(self):
    g = make(max_prefill_tokens=3)   # a 3-token budget per step (it also caps the batch at 3)
    self.assertEqual(g.generate(PROMPTS, NEW), [dense(p) for p in PROMPTS])
    self.assertGreater(g.stats.prefill_steps, 5)

  def test_prefill_after_a_shared_cached_prefix(self):
    g = make(page_size=4)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]   # two full pages
    first = g.generate([shared + [1]], NEW)
    second = g.generate([shared + [2, 3], shared + [4]], NEW)
    self.assertEqual(g.stats.cached_prompt_tokens, 16)   # 8 tokens hit, twice
    self.assertEqual(first + second, [dense(shared + [1]), dense(shared + [2, 3]),
                                      dense(shared + [4])])

  def test_forked_sequences_copy_on_write(self):
    g = make(page_size=4)
    prompt = [3, 1, 4, 1, 5, 9, 2]   # last page partial: the children must copy it
    out = g.generate([prompt], NEW, n=3)
    self.assertEqual(out, [dense(prompt)] * 3)   # greedy: every sample equals the reference
    self.assertEqual(g.stats.cow_copies, 2)      # two of three copy; the last writer keeps it
    g.bm.check_invariants()

  def test_preemption_under_memory_pressure(self):
    # 13 usable pages of 2 tokens: four sequences growing to ~14-18 tokens cannot all fit.
    g = make(page_size=2, num_pages=14, steps_per_sync=2)
    self.assertEqual(g.generate(PROMPTS, NEW), [dense(p) for p in PROMPTS])
    self.assertGreater(g.stats.preemptions, 0)
    g.bm.check_invariants()

  def test_eos_stops_a_sequence(self):
    ref = dense(PROMPTS[0])
    out = make().generate([PROMPTS[0]], NEW, eos_id=ref[2])
    self.assertEqual(out, [ref[:3]])

  def test_steps_compile_once_per_bucket(self):
    g = make()
    g.generate(PROMPTS, NEW)
    sizes = (step.sample_step._cache_size(), step.multi_step_decode._cache_size())
    g.generate([[9, 8, 7, 6, 5], [1, 1, 1], [2, 7, 1, 8, 2, 8, 1, 8, 2], [5]], NEW)
    self.assertEqual((step.sample_step._cache_size(), step.multi_step_decode._cache_size()),
                     sizes)

  def test_bad_requests(self):
    g = make()
    with self.assertRaisesRegex(ValueError, "prompt 1: the prompt is empty"):
      g.generate([[1], []], 2)
    with self.assertRaisesRegex(ValueError, r"token ids outside \[0, 64\): \[99\]"):
      g.generate([[1, 99]], 2)
    with self.assertRaisesRegex(ValueError, "exceeds the model's max_position=256"):
      g.generate([[1] * 250], 10)
    with self.assertRaisesRegex(ValueError, "needs up to 6 pages .* the pool has 2: it can never fit"):
      make(num_pages=3).generate([[1] * 20], 2)
    with self.assertRaisesRegex(ValueError, r"stop_token_ids=\('2',\) must be token ids"):
      g.generate([[1, 2]], 2, eos_id=["2"])
    self.assertEqual(g.generate([[1, 2]], 2), [dense([1, 2], 2)])   # still usable
    self.assertFalse(g.engine.has_unfinished())   # nothing half-queued by a refused call


class ModelPiecesTest(absltest.TestCase):

  def test_decode_step_matches_prefill_logits(self):
    # Prefill of n tokens vs prefill of n-1 then one decode step: same last-token logits.
    from paged_jax.state import AttentionMetadata, KVPool
    tokens = jnp.array([5, 9, 2, 7, 1], jnp.int32)
    table = jnp.array([[3, 1]], jnp.int32)
    slots = jnp.array([12, 13, 14, 15, 4], jnp.int32)
    mk_pool = lambda: KVPool.create(num_layers=CFG.num_layers, num_pages=5, page_size=4,
                                    num_kv_heads=CFG.num_kv_heads, head_dim=CFG.head_dim)

    def batch(toks, pos, sl, lens, q):
      md = AttentionMetadata(table, jnp.array([lens], jnp.int32),
                             jnp.array([0, len(toks)], jnp.int32), sl, max_q_len=q)
      return step.Batch(toks, pos, md, jnp.array([len(toks) - 1], jnp.int32))

    full, _ = step.prefill_step(PARAMS, mk_pool(), batch(tokens, jnp.arange(5), slots, 5, 8),
                                cfg=CFG, impl="xla")
    _, pool = step.prefill_step(PARAMS, mk_pool(), batch(tokens[:4], jnp.arange(4), slots[:4], 4, 4),
                                cfg=CFG, impl="xla")
    last, _ = step.decode_step(PARAMS, pool, batch(tokens[4:], jnp.arange(4, 5), slots[4:], 5, 1),
                               cfg=CFG, impl="xla")
    chex.assert_trees_all_close(last, full, atol=1e-5, rtol=1e-5)
    with self.assertRaisesRegex(ValueError, "decode_step needs max_q_len=1"):
      step.decode_step(PARAMS, mk_pool(), batch(tokens, jnp.arange(5), slots, 5, 8), cfg=CFG)

  def test_token_chunks(self):
    from paged_jax.model import token_chunks
    self.assertEqual(token_chunks(4560, 1024), [(0, 912), (912, 1824), (1824, 2736), (2736, 3648),
                                                (3648, 4560)])
    self.assertEqual(token_chunks(1024, 1024), [(0, 1024)])
    self.assertEqual(token_chunks(1025, 1024), [(0, 512), (512, 1025)])
    self.assertEqual(token_chunks(0, 1024), [(0, 0)])
    for n in (1, 7, 50, 1000):
      for rows in (1, 3, 16):
        chunks = token_chunks(n, rows)
        self.assertEqual([s for s, _ in chunks[1:]], [e for _, e in chunks[:-1]])   # contiguous
        self.assertEqual((chunks[0][0], chunks[-1][1]), (0, n))
        self.assertLessEqual(max(e - s for s, e in chunks), rows)
        self.assertLessEqual(max(e - s for s, e in chunks) - min(e - s for s, e in chunks), 1)

  def test_mlp_in_chunks_equals_in_one(self):
    from unittest import mock
    from paged_jax import model
    h = jnp.asarray(np.random.default_rng(0).standard_normal((11, CFG.hidden_size)), jnp.float32)
    mlp = model.MLP(CFG)
    params = {"params": PARAMS["layers_0_mlp"]}
    whole = mlp.apply(params, h)
    with mock.patch.object(model, "MLP_CHUNK_TOKENS", 3):   # 4 chunks: 3, 3, 3, 2
      chunked = mlp.apply(params, h)
    chex.assert_trees_all_close(chunked, whole, atol=1e-6, rtol=1e-6)
    self.assertGreater(float(jnp.abs(whole).max()), 1e-3)

  def test_config_validation(self):
    with self.assertRaisesRegex(ValueError, "num_q_heads=3 must be divisible by num_kv_heads=2"):
      config.tiny_config(num_q_heads=3)
    with self.assertRaisesRegex(ValueError, "head_dim=7 must be even"):
      config.tiny_config(head_dim=7)


if __name__ == "__main__":
  absltest.main()
