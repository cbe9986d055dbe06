"""End to end, in f32: greedy tokens from the paged steps equal greedy decoding with a dense cache."""

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import config, generate, model, step, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

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


SCAN_CASES = {   # name -> tiny_config overrides; each depth puts a scan of >= 2 reps in
    "llama": dict(num_layers=5),
    "qwen2_some_windows": dict(num_layers=6, sliding_window=3, attention_bias=True,
                               layer_types=("full_attention",) * 2 + ("sliding_attention",) * 4),
    "gemma2": dict(num_layers=6, sliding_window=3, sandwich_norms=True, unit_offset_norms=True,
                   scale_embeddings=True, query_scale=0.3, attn_soft_cap=1.5, final_soft_cap=2.5,
                   hidden_act="gelu_pytorch_tanh", tie_embeddings=True,
                   layer_types=("sliding_attention", "full_attention") * 3),
    "gemma3": dict(num_layers=8, sliding_window=3, qk_norm=True, unit_offset_norms=True,
                   sandwich_norms=True, local_rope_theta=50.0,
                   rope_scaling={"rope_type": "linear", "factor": 2.0},
                   layer_types=(("sliding_attention",) * 2 + ("full_attention",)) * 2
                   + ("sliding_attention",) * 2),
}


class ScannedLayersTest(parameterized.TestCase):
  """`model.scanned_forward` over `stack_layers` params against the unrolled Decoder."""

  def test_layer_groups(self):
    groups = lambda **kw: model.layer_groups(config.tiny_config(**kw))
    self.assertEqual(groups(num_layers=1), ((0, 1, 1),))
    self.assertEqual(groups(num_layers=2), ((0, 1, 1), (1, 1, 1)))
    self.assertEqual(groups(num_layers=30), ((0, 1, 29), (29, 1, 1)))
    self.assertEqual(groups(**SCAN_CASES["qwen2_some_windows"]),
                     ((0, 1, 2), (2, 1, 3), (5, 1, 1)))
    self.assertEqual(groups(**SCAN_CASES["gemma2"]), ((0, 2, 2), (4, 1, 1), (5, 1, 1)))
    # S S F S S F S S: the period-3 pattern twice, then a lone S, then the last layer.
    self.assertEqual(groups(**SCAN_CASES["gemma3"]), ((0, 3, 2), (6, 1, 1), (7, 1, 1)))
    # Gemma 3 1B's 26 layers (5 local, 1 global): four periods of 6, one more local, the last.
    gemma3_1b = (("sliding_attention",) * 5 + ("full_attention",)) * 4 + ("sliding_attention",) * 2
    self.assertEqual(groups(num_layers=26, sliding_window=8, local_rope_theta=10.0,
                            layer_types=gemma3_1b), ((0, 6, 4), (24, 1, 1), (25, 1, 1)))

  def test_stack_layers_layout(self):
    cfg = config.tiny_config(num_layers=5)
    params = testing.random_params(cfg, seed=1)
    stacked = model.stack_layers(params, cfg)
    self.assertEqual(sorted(stacked), sorted(["embed_tokens", "layers", "norm"] +
                                             (["lm_head"] if "lm_head" in params else [])))
    (scanned,), (last,) = stacked["layers"]
    self.assertEqual(scanned["mlp"]["up_proj"]["kernel"].shape, (4, 32, 64))   # layers 0-3
    np.testing.assert_array_equal(scanned["mlp"]["up_proj"]["kernel"][2],
                                  params["layers_2_mlp"]["up_proj"]["kernel"])
    np.testing.assert_array_equal(last["self_attn"]["q_proj"]["kernel"],
                                  params["layers_4_self_attn"]["q_proj"]["kernel"])
    with self.assertRaisesRegex(ValueError, "stacked already"):
      model.stack_layers(stacked, cfg)

  def test_engine_takes_stacked_params_only_with_scan_layers(self):
    # load_checkpoint(stacked=True) hands the engine the scan layout: taken as it is (not
    # stacked twice), and refused by name by an engine told to unroll the layers.
    cfg = config.tiny_config(num_layers=3)
    stacked = model.stack_layers(testing.random_params(cfg, seed=1), cfg)
    engine = Engine(stacked, cfg, cache=CacheConfig(page_size=4, num_pages=8), scan_layers=True)
    self.assertEqual(jax.tree.structure(engine.params), jax.tree.structure(stacked))
    with self.assertRaisesRegex(ValueError, "stack_layers' layout: pass scan_layers=True"):
      Engine(stacked, cfg, cache=CacheConfig(page_size=4, num_pages=8))

  @parameterized.parameters("mixed_step", "decode_round")
  def test_logits_and_pool_equal_the_unrolled_decoder(self, program):
    _scan_equals_unrolled(SCAN_CASES["llama"], program)

  def test_program_size_does_not_grow_with_depth(self):
    # The compiled decode round of 3 and of 12 layers: unrolled it grows ~4x, scanned it does not.
    sizes = {}
    for n in (3, 12):
      cfg = config.tiny_config(num_layers=n)
      params = testing.random_params(cfg, seed=0)
      for name, p in (("unrolled", params), ("scan", model.stack_layers(params, cfg))):
        _, pool, state = _mixed_step_inputs(cfg)
        hlo = step.multi_step_decode.lower(p, pool, state, _greedy_rows(4), cfg=cfg, num_steps=2,
                                           impl="xla", greedy_only=True).as_text()
        sizes[name, n] = hlo.count("dot_general")
    self.assertGreater(sizes["unrolled", 12], 3 * sizes["unrolled", 3])
    self.assertEqual(sizes["scan", 12], sizes["scan", 3])


def _greedy_rows(n):
  from paged_jax.sampling import SamplingArrays
  return SamplingArrays.from_rows([(SamplingParams(), 0, 0, 0)] * n, n)


def _scan_equals_unrolled(overrides, program):
  # On the same random pool, either a mixed step (two decode rows, a prefill chunk after a
  # cached prefix, a fresh prompt) or a 3-step decode round: every logit and every pool value.
  # (Two tests, not one: each compiles two programs per family, under the 20 s check.)
  cfg = config.tiny_config(**overrides)
  params = testing.random_params(cfg, seed=2, scale=0.3)
  stacked = model.stack_layers(params, cfg)
  out = {}
  for name, p in (("unrolled", params), ("scan", stacked)):
    batch, pool, state = _mixed_step_inputs(cfg)
    if program == "mixed_step":
      out[name] = step.prefill_step(p, pool, batch, cfg=cfg, impl="xla")
    else:
      dec, pool = step.multi_step_decode(p, pool, state, _greedy_rows(4), cfg=cfg,
                                         num_steps=3, impl="xla", greedy_only=True)
      out[name] = (dec.tokens, pool)
  # Bit for bit: the same ops, in a while loop's body or not (`_decode` materializes Gemma's
  # scaled embedding so that layer 0 reads the same rounded values both ways).
  chex.assert_trees_all_equal(out["scan"], out["unrolled"])


# The other families' layer groups (windows on some layers, Gemma's alternating bodies) and the
# engine on stacked params: the slow tier, which CI also runs (their deeper unrolled programs
# cost 60-70 s to compile; the engine run 15-25 s).
@pytest.mark.slow
class ScannedFamiliesTest(parameterized.TestCase):

  def test_engine_greedy_under_preemption(self):
    # The engine on stacked params (every family's body is pinned bit for bit against the
    # unrolled decoder: _scan_equals_unrolled; SmolLM2's scan against transformers: smollm2_test).
    cfg = config.tiny_config(**SCAN_CASES["llama"])
    params = testing.random_params(cfg, seed=3, scale=0.3)
    prompts, new = PROMPTS, 6
    engine = Engine(params, cfg, cache=CacheConfig(page_size=2, num_pages=14), impl="xla",
                    scheduler=SchedulerConfig(steps_per_sync=2), scan_layers=True)
    self.assertTrue(model.is_stacked(engine.params))
    outs = engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
    self.assertGreater(engine.stats.preemptions, 0)
    self.assertEqual([o.outputs[0].token_ids for o in outs],
                     [testing.dense_greedy(params, cfg, p, new) for p in prompts])
    with self.assertRaisesRegex(ValueError, "scan_layers=True with a mesh"):
      Engine(params, cfg, scan_layers=True, mesh=object())

  @parameterized.named_parameters(
      (f"{name}_{program}", SCAN_CASES[name], program)
      for name in ("qwen2_some_windows", "gemma2", "gemma3")
      for program in ("mixed_step", "decode_round"))
  def test_logits_and_pool_equal_the_unrolled_decoder(self, overrides, program):
    _scan_equals_unrolled(overrides, program)


class FusedProjectionsTest(parameterized.TestCase):
  """`model.fuse_projections`: q / k / v as one product and gate / up as one."""

  @parameterized.parameters("llama", "qwen2_some_windows", "gemma3")
  def test_same_logits_on_both_layouts(self, name):
    # With attention biases (Qwen2) and q / k norms after the products (Gemma 3). The same
    # sums over the same inputs; XLA blocks the wider product differently, so the last bits
    # may differ: 1e-5 absolute on logits of magnitude ~1 (observed up to ~6e-6).
    cfg = config.tiny_config(**SCAN_CASES[name])
    params = testing.random_params(cfg, seed=4, scale=0.3)
    fused = model.fuse_projections(params)
    self.assertTrue(model.is_fused(fused))
    self.assertFalse(model.is_fused(params))
    attn, mlp = fused["layers_0_self_attn"], fused["layers_0_mlp"]
    self.assertNotIn("q_proj", attn)
    self.assertEqual(attn["qkv_proj"]["kernel"].shape,
                     (cfg.hidden_size, (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim))
    self.assertEqual(sorted(mlp), ["down_proj", "gate_up_proj"])
    self.assertEqual("bias" in attn["qkv_proj"], cfg.attention_bias)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_allclose(testing.dense_logits(fused, cfg, prompt),
                               testing.dense_logits(params, cfg, prompt), atol=1e-5, rtol=0)
    # stacked then fused is fused then stacked
    chex.assert_trees_all_equal(model.fuse_projections(model.stack_layers(params, cfg)),
                                model.stack_layers(fused, cfg))

  def test_engine_greedy_on_fused_stacked_params(self):
    cfg = config.tiny_config(**SCAN_CASES["llama"])
    params = testing.random_params(cfg, seed=3, scale=0.3)
    engine = Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=40), impl="xla",
                    scheduler=SchedulerConfig(steps_per_sync=2), scan_layers=True,
                    fuse_projections=True)
    self.assertTrue(model.is_fused(engine.params) and model.is_stacked(engine.params))
    outs = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=5, ignore_eos=True))
    self.assertEqual([o.outputs[0].token_ids for o in outs],
                     [testing.dense_greedy(params, cfg, p, 5) for p in PROMPTS[:2]])

  def test_refused_by_name(self):
    with self.assertRaisesRegex(ValueError, "fuse_projections=True with a mesh"):
      Engine(PARAMS, CFG, fuse_projections=True, mesh=object())
    half = {"layers_0_self_attn": {"q_proj": {"kernel": np.ones((2, 2))},
                                   "k_proj": {"kernel": np.ones((2, 2))}}}
    with self.assertRaisesRegex(ValueError, r"\['k_proj', 'q_proj'\] but not all of"):
      model.fuse_projections(half)


def _mixed_step_inputs(cfg):
  """(Batch of a mixed step, a random pool, the DecodeState of a decode round after it)."""
  import jax
  from paged_jax.state import AttentionMetadata, KVPool
  rng = np.random.default_rng(7)
  pool = KVPool.create(num_layers=cfg.num_layers, num_pages=24, page_size=4,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  pool = pool.replace(k=jnp.asarray(rng.normal(size=pool.k.shape), pool.dtype),
                      v=jnp.asarray(rng.normal(size=pool.v.shape), pool.dtype))
  # rows: decode at 9 keys, decode at 5, a 6-token chunk after 6 cached keys, a 7-token prompt;
  # each table holds the 3 decode steps after it too
  tables = np.array([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 11, 12, 0]], np.int32)
  seq_lens = np.array([9, 5, 12, 7], np.int32)
  q_lens = np.array([1, 1, 6, 7], np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  positions = np.concatenate([np.arange(l - q, l) for l, q in zip(seq_lens, q_lens)])
  rows = np.repeat(np.arange(4), q_lens)
  slots = tables[rows, positions // 4] * 4 + positions % 4
  md = AttentionMetadata(jnp.asarray(tables), jnp.asarray(seq_lens), jnp.asarray(cu),
                         jnp.asarray(slots, jnp.int32), max_q_len=8, num_decode=2)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, size=len(positions)), jnp.int32)
  batch = step.Batch(tokens, jnp.asarray(positions, jnp.int32), md, jnp.asarray(cu[1:] - 1))
  state = step.DecodeState(jnp.asarray([3, 5, 7, 9], jnp.int32), jnp.asarray(seq_lens),
                           jnp.asarray(tables), jnp.asarray(seq_lens + 3))
  return jax.device_put((batch, pool, state))


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
