"""The model families against transformers' own implementations (PyTorch, CPU, f32): Llama with
every RoPE scaling we run (llama3, linear, dynamic, yarn), Qwen3, Gemma 2, Gemma 3 and Phi-3,
each a small random checkpoint written with transformers' config classes.

Every weight is random, norms included (transformers initializes norms to the identity, which
would hide a missing or mis-offset norm). Checked: RoPE inverse frequencies against
transformers' ROPE_INIT_FUNCTIONS at the Llama 3.2 1B / 3B reference shapes; last-position and
every-position logits within 1e-4; greedy tokens through the paged engine identical to
transformers' `generate`, under chunked prefill and under preemption; bf16 at a stated agreement;
and what the loader refuses.
"""

import json
import os
import shutil
import tempfile

from absl.testing import absltest, parameterized
import jax.numpy as jnp
import numpy as np

from paged_jax import checkpoint, rope, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

try:
  import torch
  import transformers
except ImportError:   # pragma: no cover - CI installs both
  torch = transformers = None

PROMPTS = ([5], [3, 14, 15, 9, 2, 6], [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 33, 21, 60, 11])
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128, initializer_range=0.1, eos_token_id=None,
              bos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10_000.0}
WINDOWED3 = ["sliding_attention", "full_attention", "sliding_attention"]

# name -> (family, config overrides). Scales chosen so each feature bites at these tiny sizes:
# llama3's original length 16 rescales most frequencies of head_dim 8; the soft caps are below
# the scores' and logits' range; windows are shorter than the longest prompt (17).
CASES = {
    "llama3_rope": ("llama", dict(rope_parameters=LLAMA3)),
    "linear_rope": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                   "rope_theta": 10_000.0})),
    "dynamic_rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                    "rope_theta": 10_000.0})),
    "yarn_rope": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32,
                                                 "rope_theta": 10_000.0})),
    "yarn_mscale": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0,
        "truncate": False, "rope_theta": 500.0})),
    "qwen3": ("qwen3", dict(rms_norm_eps=1e-6)),
    "qwen3_window": ("qwen3", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "gemma2": ("gemma2", dict(num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=12,
                              attn_logit_softcapping=1.5, final_logit_softcapping=2.5)),
    "gemma3": ("gemma3", dict(num_hidden_layers=3, sliding_window=4, layer_types=WINDOWED3,
                              query_pre_attn_scalar=12, rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 100_000.0},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 50.0}})),
    "phi3": ("phi3", dict(sliding_window=5)),
}


def _classes(family):
  return {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
          "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
          "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
          "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
          "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[family]


def hf_model(family: str, seed: int = 0, **overrides):
  """A random transformers model of the family, every norm weight random too."""
  torch.manual_seed(seed)
  config_cls, model_cls = _classes(family)
  hf = model_cls(config_cls(**{**COMMON, **overrides}, attn_implementation="eager")).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:   # around 1 for Llama-style norms, around 0 for Gemma's (1 + w)
        p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.3 * torch.randn_like(p))
  return hf


def hf_greedy(hf, prompt, n):
  with torch.no_grad():
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      min_new_tokens=n, do_sample=False, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def skip_without_torch(cls):
  return absltest.skipIf(torch is None and not testing.REQUIRE_TORCH,
                         "torch / transformers not installed: the cross-check against Hugging "
                         "Face transformers did NOT run (pip install -e '.[test]')")(cls)


class _WithDir(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if torch is None:
      self.fail("PAGED_JAX_REQUIRE_TORCH=1 but torch / transformers cannot be imported")
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)


@skip_without_torch
class RopeFrequenciesTest(_WithDir):
  """paged_jax.rope against transformers' ROPE_INIT_FUNCTIONS at real shapes."""

  @parameterized.named_parameters(
      # Llama 3.2 1B / 3B: head_dim 64, theta 500,000, llama3 factor 32, original length 8,192.
      ("llama3_2_1b", dict(hidden_size=2048, num_attention_heads=32, head_dim=64,
                           max_position_embeddings=131072,
                           rope_parameters={"rope_type": "llama3", "factor": 32.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192,
                                            "rope_theta": 500_000.0})),
      ("llama3_2_3b", dict(hidden_size=3072, num_attention_heads=24, head_dim=128,
                           max_position_embeddings=131072,
                           rope_parameters={"rope_type": "llama3", "factor": 32.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192,
                                            "rope_theta": 500_000.0})),
      ("linear", dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                       "rope_theta": 10_000.0}, head_dim=128)),
      ("dynamic", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                        "rope_theta": 1_000_000.0}, head_dim=128)),
      ("yarn", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768,
                                     "rope_theta": 1_000_000.0}, head_dim=128,
                    max_position_embeddings=131072)),
      ("yarn_mscale", CASES["yarn_mscale"][1]),
      ("yarn_attention_factor", dict(rope_parameters={
          "rope_type": "yarn", "factor": 2.0, "attention_factor": 0.7,
          "original_max_position_embeddings": 64, "rope_theta": 10_000.0})),
  )
  def test_inverse_frequencies_match(self, overrides):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg = transformers.LlamaConfig(**{**COMMON, **overrides})
    kind = hf_cfg.rope_parameters["rope_type"]
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    hf_cfg.save_pretrained(self.dir)
    with open(os.path.join(self.dir, "config.json")) as f:
      cfg = checkpoint.config_from_hf(json.load(f))
    got, factor = cfg.layer_rope(0)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    self.assertAlmostEqual(factor, float(want_factor), places=6)

  def test_llama3_changes_the_low_frequencies_only(self):
    base, _ = rope.frequencies(64, 500_000.0, None, 131072)
    scaled, _ = rope.frequencies(64, 500_000.0, rope.freeze(
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}), 131072)
    np.testing.assert_array_equal(scaled[:8], base[:8])           # high frequencies kept
    np.testing.assert_allclose(scaled[-4:], base[-4:] / 32, rtol=1e-6)   # low ones / factor


@skip_without_torch
class FamilyLogitsTest(_WithDir):

  @parameterized.named_parameters(*((name, *case) for name, case in CASES.items()))
  def test_logits_match(self, family, overrides):
    hf = hf_model(family, **overrides)
    hf.save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir)
    for prompt in PROMPTS:
      with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
      ours = testing.dense_logits(params, cfg, prompt)
      np.testing.assert_allclose(ours[-1], expected[-1], atol=1e-4, rtol=1e-4)
      np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=1e-4)

  def test_what_each_family_reads(self):
    cases = {"gemma2": lambda c: (c.attn_soft_cap, c.final_soft_cap, c.query_scale,
                                  c.layer_window(0), c.layer_window(1), c.tie_embeddings),
             "gemma3": lambda c: (c.qk_norm, c.local_rope_theta, dict(c.rope_scaling)["factor"],
                                  c.layer_window(1)),
             "phi3": lambda c: (c.layer_window(0), c.layer_window(1)),
             "qwen3": lambda c: (c.qk_norm, c.attention_bias)}
    want = {"gemma2": (1.5, 2.5, 12 ** -0.5, 4, None, True), "gemma3": (True, 50.0, 2.0, None),
            "phi3": (5, 5), "qwen3": (True, False)}
    for name, read in cases.items():
      family, overrides = CASES[name]
      config_cls, _ = _classes(family)
      config_cls(**{**COMMON, **overrides}).save_pretrained(self.dir)
      with open(os.path.join(self.dir, "config.json")) as f:
        cfg = checkpoint.config_from_hf(json.load(f))
      self.assertEqual(read(cfg), want[name], name)

  def test_bfloat16_agreement(self):
    # bf16 both sides (transformers in bf16, ours loaded as bf16): logits agree within 0.1 of a
    # logit range of ~+-3, and the argmax agrees on most positions. Not exact: the two round at
    # different points (we keep RoPE, norms and softmax in f32), which is why it is stated, not 1e-4.
    hf = hf_model("llama", rope_parameters=LLAMA3)
    hf.save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir, dtype="bfloat16")
    hf = hf.to(torch.bfloat16)
    prompt = PROMPTS[2]
    with torch.no_grad():
      expected = hf(torch.tensor([prompt])).logits[0].float().numpy()
    ours = testing.dense_logits(params, cfg, prompt)
    self.assertLess(np.max(np.abs(ours - expected)), 0.1)
    self.assertGreaterEqual(np.mean(ours.argmax(-1) == expected.argmax(-1)), 0.8)


@skip_without_torch
class FamilyGreedyThroughTheEngineTest(_WithDir):
  """Greedy tokens of the paged engine equal transformers' generate, with prefill chunked (8
  tokens a step) and with a pool so small that sequences are preempted (recompute)."""

  @parameterized.named_parameters(("llama3_rope", "llama3_rope"), ("yarn_rope", "yarn_rope"),
                                  ("qwen3", "qwen3"), ("gemma2", "gemma2"), ("gemma3", "gemma3"),
                                  ("phi3", "phi3"))
  def test_greedy_tokens_match(self, name):
    family, overrides = CASES[name]
    hf = hf_model(family, **overrides)
    hf.save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir)
    new = 12
    want = [hf_greedy(hf, list(p), new) for p in PROMPTS]
    # 12 usable pages of 4 tokens for three sequences of up to 17 + 12: preemption.
    engine = Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=13),
                    scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4,
                                              steps_per_sync=2), impl="xla")
    outs = engine.generate([list(p) for p in PROMPTS],
                           SamplingParams(max_tokens=new, ignore_eos=True))
    self.assertGreater(engine.stats.preemptions, 0)
    self.assertEqual([o.outputs[0].token_ids for o in outs], want)


class RefusalsTest(absltest.TestCase):
  """What a config asks for that cannot run exactly is refused, naming the field and value."""

  def _hf(self, **fields):
    return {**{k: v for k, v in COMMON.items() if v is not None},
            "num_hidden_layers": 2, **fields}

  def test_refusals_name_the_field(self):
    cases = [
        (dict(architectures=["Phi3ForCausalLM"],
              rope_scaling={"type": "su", "short_factor": [1.0], "long_factor": [2.0]}),
         r"rope_type='su'"),
        (dict(architectures=["LlamaForCausalLM"],
              rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
         r"rope_type='longrope' is not supported \(it switches"),
        (dict(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "llama3",
                                                                "factor": 8.0}),
         r"llama3.*lacks \['low_freq_factor'"),
        (dict(architectures=["LlamaForCausalLM"], mlp_bias=True), r"mlp_bias=True"),
        (dict(architectures=["Phi3ForCausalLM"],
              rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.75}),
         r"partial_rotary_factor=0.75"),
        (dict(architectures=["Gemma3ForCausalLM"], use_bidirectional_attention=True),
         r"use_bidirectional_attention=True"),
        (dict(architectures=["Gemma3ForCausalLM"], rope_parameters={
            "full_attention": {"rope_type": "default"},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
         r"rope_parameters=.*sliding"),
        (dict(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "mrope"}),
         r"rope_type='mrope'"),
    ]
    for fields, pattern in cases:
      with self.assertRaisesRegex(checkpoint.CheckpointError, pattern, msg=str(fields)):
        checkpoint.config_from_hf(self._hf(**fields))

  def test_dynamic_runs_only_where_it_equals_plain_rope(self):
    # Dynamic NTK rescales only past max_position_embeddings, and the engine refuses longer
    # sequences (max_position is that length): within it the frequencies are plain RoPE's.
    cfg = checkpoint.config_from_hf(self._hf(
        architectures=["LlamaForCausalLM"], max_position_embeddings=64,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0}))
    self.assertEqual(cfg.max_position, 64)
    np.testing.assert_array_equal(cfg.layer_rope(0)[0], rope.frequencies(8, 10_000.0, None, 64)[0])


if __name__ == "__main__":
  absltest.main()
