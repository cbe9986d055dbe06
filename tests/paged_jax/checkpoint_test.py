"""Checkpoint loading, and exactness against Hugging Face transformers (PyTorch, CPU, f32).

The cross-checks skip where torch or transformers is missing; `.ci/run` installs both (the CPU
torch wheel), so CI runs them.
"""

import json
import os
import shutil
import tempfile

from absl.testing import absltest, parameterized
import chex
import jax.numpy as jnp
import numpy as np

from paged_jax import checkpoint, config, generate, model, testing

try:
  import torch
  import transformers
except ImportError:   # pragma: no cover - CI installs both
  torch = transformers = None

_PROMPTS = ([5], [3, 14, 15, 9, 2, 6], [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0])


def _hf_model(family: str, **overrides):
  torch.manual_seed(0)
  common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                initializer_range=0.1)   # 0.02 makes a tiny random model repeat one token
  common.update(overrides)
  cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
         "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
  return cls[1](cls[0](**common)).eval()


_our_logits = testing.dense_logits
REQUIRE_TORCH = testing.REQUIRE_TORCH


@absltest.skipIf(torch is None and not REQUIRE_TORCH,
                 "torch / transformers not installed: the cross-check against Hugging Face "
                 "transformers did NOT run (pip install -e '.[test]' installs both)")
class HuggingFaceExactnessTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if torch is None:
      self.fail("PAGED_JAX_REQUIRE_TORCH=1 but torch / transformers cannot be imported: the "
                "cross-check against Hugging Face transformers cannot run")
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)

  @parameterized.named_parameters(
      ("llama_gqa", "llama", {}),
      ("llama_tied", "llama", dict(tie_word_embeddings=True)),
      ("qwen2_bias", "qwen2", {}),
      ("mistral_window", "mistral", dict(sliding_window=4)),
  )
  def test_logits_match(self, family, overrides):
    hf = _hf_model(family, **overrides)
    hf.save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir)
    if family == "mistral":
      self.assertEqual(cfg.sliding_window, 4)
    if family == "qwen2":
      self.assertTrue(cfg.attention_bias)
    for prompt in _PROMPTS:
      with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
      np.testing.assert_allclose(_our_logits(params, cfg, prompt), expected, atol=1e-4, rtol=1e-4)

  @parameterized.named_parameters(
      # Qwen2 windows only layers >= max_window_layers (here layer 1 of 2) ...
      ("qwen2_max_window_layers", "qwen2",
       dict(use_sliding_window=True, sliding_window=3, max_window_layers=1), (None, 3)),
      # ... or the layers transformers' layer_types names.
      ("qwen2_layer_types", "qwen2",
       dict(use_sliding_window=True, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"]), (4, None)),
      ("qwen2_window_off", "qwen2", dict(use_sliding_window=False, sliding_window=3), (None, None)),
      ("llama_gelu", "llama", dict(hidden_act="gelu"), (None, None)),
      ("llama_gelu_tanh", "llama", dict(hidden_act="gelu_pytorch_tanh"), (None, None)),
  )
  def test_per_layer_windows_and_activations(self, family, overrides, windows):
    hf = _hf_model(family, **overrides)
    hf.save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir)
    self.assertEqual(tuple(cfg.layer_window(i) for i in range(cfg.num_layers)), windows)
    self.assertEqual(cfg.hidden_act, overrides.get("hidden_act", "silu"))
    for prompt in _PROMPTS:   # the longest prompt (13) is past every window
      with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
      np.testing.assert_allclose(_our_logits(params, cfg, prompt), expected, atol=1e-4, rtol=1e-4)

  def test_config_without_architectures_uses_model_type(self):
    hf = _hf_model("mistral", sliding_window=4)
    hf.save_pretrained(self.dir)
    file = os.path.join(self.dir, "config.json")
    with open(file) as f:
      raw = json.load(f)
    del raw["architectures"]
    with open(file, "w") as f:
      json.dump(raw, f)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir)
    self.assertEqual(cfg.sliding_window, 4)   # read as Mistral, from model_type
    prompt = _PROMPTS[2]
    with torch.no_grad():
      expected = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(_our_logits(params, cfg, prompt), expected, atol=1e-4, rtol=1e-4)

  @parameterized.parameters("llama", "mistral")
  def test_greedy_tokens_match_paged(self, family):
    hf = _hf_model(family, **({"sliding_window": 6} if family == "mistral" else {}))
    hf.save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir)
    g = generate.Generator(params, cfg, num_pages=64, page_size=4, impl="xla")
    ours = g.generate([list(p) for p in _PROMPTS], max_new_tokens=10)
    for prompt, got in zip(_PROMPTS, ours):
      with torch.no_grad():
        ids = torch.tensor([prompt])
        # An explicit mask: generate() would otherwise treat tokens equal to pad_token_id as
        # padding (a prompt here contains token 0).
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                          do_sample=False, pad_token_id=0)
      self.assertEqual(got, out[0, len(prompt):].tolist(), f"prompt {prompt}")

  def test_bfloat16_load(self):
    _hf_model("llama").save_pretrained(self.dir)
    params, cfg, _ = checkpoint.load_checkpoint(self.dir, dtype="bfloat16")
    self.assertEqual(cfg.dtype, "bfloat16")
    self.assertEqual(params["layers_0_self_attn"]["q_proj"]["kernel"].dtype, jnp.bfloat16)


class CheckpointErrorsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)
    self.cfg = config.tiny_config()
    self.params = testing.random_params(self.cfg)
    checkpoint.save_checkpoint(self.params, self.cfg, self.dir)

  def test_round_trip(self):
    params, cfg, tokenizer = checkpoint.load_checkpoint(self.dir)
    self.assertEqual(cfg, self.cfg)
    self.assertIsNone(tokenizer)
    chex.assert_trees_all_equal(params, self.params)

  def test_missing_files(self):
    with self.assertRaisesRegex(checkpoint.CheckpointError, "is not a directory"):
      checkpoint.load_checkpoint(os.path.join(self.dir, "nope"))
    os.remove(os.path.join(self.dir, "model.safetensors"))
    with self.assertRaisesRegex(checkpoint.CheckpointError, r"no \*.safetensors file"):
      checkpoint.load_checkpoint(self.dir)
    os.remove(os.path.join(self.dir, "config.json"))
    with self.assertRaisesRegex(checkpoint.CheckpointError, "missing config.json"):
      checkpoint.load_checkpoint(self.dir)

  def _edit_config(self, **changes):
    file = os.path.join(self.dir, "config.json")
    with open(file) as f:
      hf = json.load(f)
    hf.update(changes)
    with open(file, "w") as f:
      json.dump(hf, f)

  def test_unsupported_architecture_and_rope(self):
    self._edit_config(architectures=["GPT2LMHeadModel"])
    with self.assertRaisesRegex(checkpoint.CheckpointError, "unsupported architecture 'GPT2LMHeadModel'"):
      checkpoint.load_checkpoint(self.dir)
    self._edit_config(architectures=["LlamaForCausalLM"], rope_scaling={"rope_type": "longrope"})
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                "config.json.*rope_type='longrope' is not supported"):
      checkpoint.load_checkpoint(self.dir)

  def test_wrong_shape_and_missing_tensor(self):
    self._edit_config(intermediate_size=48)
    with self.assertRaisesRegex(checkpoint.CheckpointError, r"has shape \(32, 64\); the config needs \(32, 48\)"):
      checkpoint.load_checkpoint(self.dir)
    self._edit_config(intermediate_size=64, num_hidden_layers=3)
    with self.assertRaisesRegex(checkpoint.CheckpointError, "missing tensors for.*layers_2"):
      checkpoint.load_checkpoint(self.dir)

  def test_wrong_dtype_and_unexpected_tensor(self):
    from safetensors.numpy import load_file, save_file
    file = os.path.join(self.dir, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)
    save_file(tensors, file)
    with self.assertRaisesRegex(checkpoint.CheckpointError, "'model.norm.weight' has dtype int32"):
      checkpoint.load_checkpoint(self.dir)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float32)
    tensors["model.vision_tower.weight"] = np.zeros(3, np.float32)
    save_file(tensors, file)
    with self.assertRaisesRegex(checkpoint.CheckpointError, "unexpected tensor 'model.vision_tower.weight'"):
      checkpoint.load_checkpoint(self.dir)

  def test_embedded_model_and_its_tokenizer(self):
    from paged_jax import embedded
    params, cfg, tokenizer = embedded.load_embedded()
    self.assertEqual(cfg.vocab_size, 32)
    # Letters after 4 special tokens, framed as the copy task's prompt: <bos> ... <sep>.
    self.assertEqual(tokenizer.encode("a b z").ids, [embedded.BOS, 4, 5, 29, embedded.SEP])
    self.assertEqual(tokenizer.decode([4, 5, 29]), "a b z")
    self.assertEqual(checkpoint.load_eos_token_ids(embedded.EMBEDDED_MODEL_DIR), (embedded.EOS,))
    with open(os.path.join(self.dir, "tokenizer.json"), "w") as f:
      f.write("{not json")
    with self.assertRaisesRegex(checkpoint.CheckpointError, "cannot read the tokenizer"):
      checkpoint.load_checkpoint(self.dir)

  def test_stacked_load_of_a_directory_is_stack_layers(self):
    # serve --scan_layers loads stacked (load_checkpoint(stacked=True)); a Hugging Face
    # directory is stacked after its load, leaf for leaf what the engine used to stack.
    from paged_jax import embedded, model
    params, cfg, _ = checkpoint.load_checkpoint(embedded.EMBEDDED_MODEL_DIR)
    stacked, _, _ = checkpoint.load_checkpoint(embedded.EMBEDDED_MODEL_DIR, stacked=True)
    self.assertTrue(model.is_stacked(stacked))
    chex.assert_trees_all_equal(stacked, model.stack_layers(params, cfg))

  def test_eos_ids_from_generation_config_then_config(self):
    self.assertEqual(checkpoint.load_eos_token_ids(self.dir), ())
    with open(os.path.join(self.dir, "config.json")) as f:
      hf = json.load(f)
    with open(os.path.join(self.dir, "config.json"), "w") as f:
      json.dump({**hf, "eos_token_id": 5}, f)
    self.assertEqual(checkpoint.load_eos_token_ids(self.dir), (5,))
    with open(os.path.join(self.dir, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": [7, 9]}, f)   # several, and it takes precedence
    self.assertEqual(checkpoint.load_eos_token_ids(self.dir), (7, 9))
    with open(os.path.join(self.dir, "generation_config.json"), "w") as f:
      json.dump({"eos_token_id": "x"}, f)
    with self.assertRaisesRegex(checkpoint.CheckpointError, "eos_token_id='x' must be"):
      checkpoint.load_eos_token_ids(self.dir)

  def test_unsupported_activation_is_refused(self):
    self._edit_config(hidden_act="relu")
    with self.assertRaisesRegex(checkpoint.CheckpointError, "config.json.*hidden_act='relu'"):
      checkpoint.load_checkpoint(self.dir)

  def test_no_architectures_and_unknown_model_type(self):
    self._edit_config(architectures=None, model_type="gpt2")
    with self.assertRaisesRegex(checkpoint.CheckpointError, "unsupported architecture None "
                                r"\(model_type 'gpt2'\)"):
      checkpoint.load_checkpoint(self.dir)
    self._edit_config(model_type="llama")
    _, cfg, _ = checkpoint.load_checkpoint(self.dir)
    self.assertEqual(cfg, self.cfg)

  def test_tied_embeddings_with_a_stored_head(self):
    from safetensors.numpy import load_file, save_file
    cfg = config.tiny_config(tie_embeddings=True)
    params = testing.random_params(cfg)
    checkpoint.save_checkpoint(params, cfg, self.dir)
    file = os.path.join(self.dir, "model.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()   # equal: accepted
    save_file(tensors, file)
    loaded, got_cfg, _ = checkpoint.load_checkpoint(self.dir)
    self.assertTrue(got_cfg.tie_embeddings)
    chex.assert_trees_all_equal(loaded, params)
    tensors["lm_head.weight"][3, 1] += 0.5   # differs: refused, with the difference
    save_file(tensors, file)
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"model.safetensors: tie_word_embeddings is true but the stored "
                                r"'lm_head.weight' differs .*max \|diff\| 0.5"):
      checkpoint.load_checkpoint(self.dir)

  def test_file_errors_name_the_file(self):
    from safetensors.numpy import load_file, save_file
    # A shard listed in the index but missing.
    tensors = load_file(os.path.join(self.dir, "model.safetensors"))
    os.remove(os.path.join(self.dir, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]},
              os.path.join(self.dir, "model-00001-of-00002.safetensors"))
    index = os.path.join(self.dir, "model.safetensors.index.json")
    with open(index, "w") as f:
      json.dump({"weight_map": {n: f"model-0000{1 + (i >= half)}-of-00002.safetensors"
                                for i, n in enumerate(names)}}, f)
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                "model-00002-of-00002.safetensors: listed in .*index.json but missing"):
      checkpoint.load_checkpoint(self.dir)
    save_file({n: tensors[n] for n in names[half:]},
              os.path.join(self.dir, "model-00002-of-00002.safetensors"))
    params, _, _ = checkpoint.load_checkpoint(self.dir)   # both shards: loads
    chex.assert_trees_all_equal(params, self.params)
    with open(index, "w") as f:
      f.write("{")
    with self.assertRaisesRegex(checkpoint.CheckpointError, "index.json: not valid JSON"):
      checkpoint.load_checkpoint(self.dir)
    os.remove(index)
    # config.json that is not JSON; then a dtype we do not load.
    with open(os.path.join(self.dir, "config.json"), "w") as f:
      f.write("{'vocab_size': 64")
    with self.assertRaisesRegex(checkpoint.CheckpointError, "config.json: not valid JSON"):
      checkpoint.load_checkpoint(self.dir)
    with self.assertRaisesRegex(checkpoint.CheckpointError, "config.json: not valid JSON"):
      checkpoint.load_eos_token_ids(self.dir)
    checkpoint.save_checkpoint(self.params, self.cfg, self.dir)
    with self.assertRaisesRegex(checkpoint.CheckpointError, "dtype='float16' is not supported"):
      checkpoint.load_checkpoint(self.dir, dtype="float16")

  def test_truncated_safetensors(self):
    file = os.path.join(self.dir, "model.safetensors")
    with open(file, "rb") as f:
      data = f.read()
    with open(file, "wb") as f:
      f.write(data[:len(data) // 2])
    with self.assertRaisesRegex(checkpoint.CheckpointError, "cannot read safetensors"):
      checkpoint.load_checkpoint(self.dir)


if __name__ == "__main__":
  absltest.main()
