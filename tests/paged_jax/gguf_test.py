"""GGUF files read directly (paged_jax.gguf_file), against transformers' own GGUF loader.

Small files are written here with `gguf.GGUFWriter` from a random transformers checkpoint: F32
and the quantized types the gguf package writes (Q8_0, Q4_0, Q4_1), plus K-quant tensors (Q4_K,
Q5_K, Q6_K) written as raw random blocks with sane scales (the package cannot quantize to those),
so both loaders dequantize the same bytes with their own code. The errors each name the file and
the thing. The real pretrained model (SmolLM2-135M-Instruct, Q4_1) is in `tests/paged_jax/
smollm2_test.py` (the slow tier).
"""

import gc
import os
import shutil
import tempfile

from absl.testing import absltest, parameterized
import jax
import numpy as np

from paged_jax import checkpoint, testing

try:
  import gguf
except ImportError:   # pragma: no cover - the test extra installs it
  gguf = None
try:
  import torch
  import transformers
except ImportError:   # pragma: no cover - CI installs both
  torch = transformers = None

PROMPTS = ([5], [3, 14, 15, 9, 2, 6], [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 33, 21, 60, 11])
NEEDS = "gguf / torch / transformers not installed: pip install -e '.[test]' installs them"


def random_llama(directory, seed=0, **overrides):
  """A random transformers Llama saved in `directory`; returns it."""
  torch.manual_seed(seed)
  cfg = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-5)
  cfg.update(overrides)
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
  hf.save_pretrained(directory)
  return hf


def transformers_from_gguf(path):
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def _hf_logits(hf, prompt):
  with torch.no_grad():
    return hf(torch.tensor([prompt])).logits[0].numpy()


@absltest.skipIf((gguf is None or torch is None) and not testing.REQUIRE_TORCH, NEEDS)
class WrittenGGUFTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    if gguf is None or torch is None:
      self.fail(f"PAGED_JAX_REQUIRE_TORCH=1 but {NEEDS}")
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)

  @parameterized.parameters(("F32", False), ("F16", True), ("BF16", False), ("Q8_0", False),
                            ("Q4_0", True), ("Q4_1", False))
  def test_matches_transformers_from_the_same_file(self, tensor_type, tied):
    from paged_jax import gguf_file
    hf_dir = os.path.join(self.dir, "hf")
    random_llama(hf_dir, tie_word_embeddings=tied)
    params, cfg, _ = checkpoint.load_checkpoint(hf_dir)
    path = os.path.join(self.dir, f"tiny-{tensor_type}.gguf")
    gguf_file.save(params, cfg, path, tensor_type=tensor_type)
    ours, ours_cfg, tok = checkpoint.load_checkpoint(path)
    self.assertIsNone(tok)   # no tokenizer metadata written
    self.assertEqual(ours_cfg.tie_embeddings, tied)
    hf = transformers_from_gguf(path)
    for prompt in PROMPTS:
      np.testing.assert_allclose(testing.dense_logits(ours, ours_cfg, prompt),
                                 _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
    if tensor_type == "F32":   # lossless: the round trip gives back the very weights
      for a, b in zip(*(jax_leaves(p) for p in (params, ours))):
        np.testing.assert_array_equal(a, b)

  def test_k_quants_match_transformers(self):
    # Q4_K / Q5_K / Q6_K blocks are 256 values wide: a model whose rows are 256 long.
    from paged_jax import gguf_file
    hf_dir = os.path.join(self.dir, "hf")
    random_llama(hf_dir, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    params, cfg, _ = checkpoint.load_checkpoint(hf_dir)
    path = os.path.join(self.dir, "k.gguf")
    gguf_file.save(params, cfg, path, tensor_type="F32")
    kinds = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K",
             "blk.0.attn_v.weight": "Q6_K", "blk.0.attn_output.weight": "Q4_K",
             "blk.0.ffn_gate.weight": "Q5_K", "blk.0.ffn_up.weight": "Q6_K",
             "blk.0.ffn_down.weight": "Q4_K"}
    rewrite_with_random_k_blocks(path, kinds, seed=1)
    ours, ours_cfg, _ = checkpoint.load_checkpoint(path)
    hf = transformers_from_gguf(path)
    with torch.no_grad():
      theirs = hf.model.layers[0].self_attn.k_proj.weight.numpy()
    np.testing.assert_allclose(np.asarray(ours["layers_0_self_attn"]["k_proj"]["kernel"]).T,
                               theirs, rtol=1e-6, atol=1e-6)
    for prompt in PROMPTS:
      np.testing.assert_allclose(testing.dense_logits(ours, ours_cfg, prompt),
                                 _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)

  def test_llama3_rope_as_llama_cpp_writes_it(self):
    # Llama 3.1+ GGUF files carry llama3 RoPE as a tensor of per-frequency divisors
    # (rope_freqs.weight) instead of its parameters: read back, the rotations are llama3's, and
    # the logits those of transformers running the Hugging Face checkpoint. (transformers' own
    # GGUF loader ignores that tensor, so it is not the reference here.)
    from paged_jax import gguf_file
    hf_dir = os.path.join(self.dir, "hf")
    hf = random_llama(hf_dir, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10_000.0})
    params, cfg, _ = checkpoint.load_checkpoint(hf_dir)
    path = os.path.join(self.dir, "llama3.gguf")
    gguf_file.save(params, cfg, path, tensor_type="F32")
    ours, ours_cfg, _ = checkpoint.load_checkpoint(path)
    self.assertEqual(dict(ours_cfg.rope_scaling)["rope_type"], "factors")
    np.testing.assert_allclose(ours_cfg.layer_rope(0)[0], cfg.layer_rope(0)[0], rtol=1e-6)
    for prompt in PROMPTS:
      np.testing.assert_allclose(testing.dense_logits(ours, ours_cfg, prompt),
                                 _hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)

  def test_bfloat16_load(self):
    from paged_jax import gguf_file
    hf_dir = os.path.join(self.dir, "hf")
    random_llama(hf_dir)
    params, cfg, _ = checkpoint.load_checkpoint(hf_dir)
    path = os.path.join(self.dir, "t.gguf")
    gguf_file.save(params, cfg, path, tensor_type="Q8_0")
    ours, ours_cfg, _ = checkpoint.load_checkpoint(path, dtype="bfloat16")
    self.assertEqual(ours_cfg.dtype, "bfloat16")
    self.assertEqual(str(ours["layers_0_mlp"]["up_proj"]["kernel"].dtype), "bfloat16")


class CacheLayoutTest(absltest.TestCase):
  """How the converted-model cache lays params out as files, and back (no GGUF file needed)."""

  def test_periodic_groups_are_strided_views_of_the_stacks(self):
    # Gemma 3's pattern (S S F twice, then S, then the last layer): groups (0, 3, 2), (6, 1, 1),
    # (7, 1, 1), so phase j of group 0 is layers j and j + 3, every third row of each stack.
    from paged_jax import config, gguf_file, model
    cfg = config.tiny_config(num_layers=8, sliding_window=3, local_rope_theta=50.0,
                             layer_types=(("sliding_attention",) * 2 + ("full_attention",)) * 2
                             + ("sliding_attention",) * 2)
    self.assertEqual(model.layer_groups(cfg), ((0, 3, 2), (6, 1, 1), (7, 1, 1)))
    params = testing.random_params(cfg, seed=4)
    files = gguf_file._param_files(params, cfg.num_layers)
    got = gguf_file._params_from_files(files, cfg, stacked=True)
    want = model.stack_layers(params, cfg)
    self.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      self.assertEqual(a.shape, b.shape)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stack = files["layers~mlp~up_proj~kernel"]
    self.assertTrue(np.shares_memory(got["layers"][0][1]["mlp"]["up_proj"]["kernel"], stack))


@absltest.skipIf(gguf is None and not testing.REQUIRE_TORCH, NEEDS)
class ConvertedCacheTest(absltest.TestCase):
  """The converted-model cache: a second load reads neither the file's metadata nor its
  tensors, and gives the same params, config, tokenizer and metadata."""

  def setUp(self):
    super().setUp()
    from paged_jax import config, gguf_file
    self.gguf_file = gguf_file
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)
    os.environ["PAGED_JAX_GGUF_CACHE"], old = os.path.join(self.dir, "cache"), os.environ.get(
        "PAGED_JAX_GGUF_CACHE")
    self.addCleanup(os.environ.__setitem__, "PAGED_JAX_GGUF_CACHE", old)
    self.cfg = config.tiny_config(rms_norm_eps=1e-5)
    self.path = os.path.join(self.dir, "m.gguf")
    gguf_file.save(testing.random_params(self.cfg, seed=0), self.cfg, self.path,
                   tensor_type="Q8_0")

  def _no_reader(self):
    def refuse(path):
      raise AssertionError(f"{path} was parsed")
    real = self.gguf_file._reader
    self.gguf_file._reader = refuse
    self.addCleanup(setattr, self.gguf_file, "_reader", real)

  def test_second_load_reads_the_cache(self):
    for dtype in ("float32", "bfloat16"):
      first = checkpoint.load_checkpoint(self.path, dtype)
      with self.subTest(dtype):
        real = self.gguf_file._reader
        self._no_reader()
        second = checkpoint.load_checkpoint(self.path, dtype)
        self.gguf_file._reader = real
        self.assertEqual(second[1], first[1])
        self.assertEqual(jax.tree.structure(second[0]), jax.tree.structure(first[0]))
        for a, b in zip(jax_leaves(second[0]), jax_leaves(first[0])):
          self.assertEqual(a.dtype, b.dtype)
          np.testing.assert_array_equal(a, b)
        self.assertTrue(all(isinstance(x, jax.Array) for x in jax.tree.leaves(second[0])))
    self.assertEqual(len(os.listdir(os.environ["PAGED_JAX_GGUF_CACHE"])), 1)   # one entry
    meta = self.gguf_file._metadata_cached.__wrapped__(self.path, 0, 0)
    self._no_reader()
    self.assertEqual(self.gguf_file._metadata_cached.__wrapped__(self.path, 0, 0), meta)

  def test_a_new_version_of_the_file_or_a_damaged_entry_is_converted_again(self):
    # The loaded params map the cache's files: a file cut short under a live mapping is a
    # SIGBUS on the next read (as with any mmap: the cache itself only ever renames files into
    # place), so the test keeps copies and lets go of each load before damaging its files.
    first = [np.array(x, copy=True) for x in jax_leaves(checkpoint.load_checkpoint(self.path)[0])]
    gc.collect()
    (entry,) = os.listdir(os.environ["PAGED_JAX_GGUF_CACHE"])
    folder = os.path.join(os.environ["PAGED_JAX_GGUF_CACHE"], entry, "params-float32")
    stem = "layers~mlp~up_proj~kernel"
    damage = {"garbage": lambda f: open(f, "wb").write(b"not an npy file"),
              "truncated": lambda f: os.truncate(f, os.path.getsize(f) - 4),
              "missing": os.remove,
              "another shape": lambda f: np.save(f, np.zeros((2, 3), np.float32))}
    for what, spoil in damage.items():
      with self.subTest(what):
        spoil(os.path.join(folder, f"{stem}.npy"))
        with self.assertLogs(level="WARNING") as logs:
          params, _, _ = checkpoint.load_checkpoint(self.path)
        self.assertIn("unreadable", logs.output[0])
        self.assertEqual(jax.tree.structure(params),
                         jax.tree.structure(testing.random_params(self.cfg, seed=0)))
        for a, b in zip(jax_leaves(params), first):
          np.testing.assert_array_equal(a, b)
        self.assertIsNotNone(self.gguf_file._load_converted(   # rewritten whole
            os.path.join(os.environ["PAGED_JAX_GGUF_CACHE"], entry), "float32"))
        del params
        gc.collect()
    gguf_file = self.gguf_file
    gguf_file.save(testing.random_params(self.cfg, seed=1), self.cfg, self.path,
                   tensor_type="Q8_0")   # rewritten: another size or mtime, another entry
    os.utime(self.path, ns=(1, 1))
    changed, _, _ = checkpoint.load_checkpoint(self.path)
    self.assertEqual(len(os.listdir(os.environ["PAGED_JAX_GGUF_CACHE"])), 2)
    self.assertFalse(np.array_equal(jax_leaves(changed)[0], first[0]))

  def test_stacked_loads_equal_stack_layers(self):
    # From the file (first load) and from the cache (second), in both dtypes: the layout
    # Engine(scan_layers=True) runs, leaf for leaf what model.stack_layers makes.
    from paged_jax import model
    for dtype in ("float32", "bfloat16"):
      per_layer, cfg, _ = checkpoint.load_checkpoint(self.path, dtype)
      want = model.stack_layers(per_layer, cfg)
      for source in ("file", "cache"):
        if source == "file":
          shutil.rmtree(os.environ["PAGED_JAX_GGUF_CACHE"])
        with self.subTest(dtype=dtype, source=source):
          got, _, _ = checkpoint.load_checkpoint(self.path, dtype, stacked=True)
          self.assertTrue(model.is_stacked(got))
          self.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            self.assertEqual((a.dtype, a.shape), (b.dtype, b.shape))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
          self.assertTrue(all(isinstance(x, jax.Array) for x in jax.tree.leaves(got)))

  def test_a_layer_leaf_not_in_every_layer_is_a_file_of_its_own(self):
    # _param_files stacks a layer leaf only when every layer has it alike; the rest (here a
    # made-up leaf of layer 1 alone, and one whose shape differs by layer) round-trip as they are.
    from paged_jax import model
    params = testing.random_params(self.cfg, seed=2)
    params["layers_1_extra"] = {"w": np.arange(3, dtype=np.float32)}
    for i in range(self.cfg.num_layers):
      params[f"layers_{i}_odd"] = {"w": np.ones(i + 1, np.float32)}
    files = self.gguf_file._param_files(params, self.cfg.num_layers)
    self.assertIn("layers~mlp~up_proj~kernel", files)
    self.assertIn("layers_1_extra~w", files)
    self.assertNotIn("layers~odd~w", files)
    self.assertEqual(files["layers~mlp~up_proj~kernel"].shape[0], self.cfg.num_layers)
    back = self.gguf_file._params_from_files(files, self.cfg, stacked=False)
    self.assertEqual(jax.tree.structure(back), jax.tree.structure(params))
    for a, b in zip(jax_leaves(back), jax_leaves(params)):
      np.testing.assert_array_equal(a, b)
    # stack_layers wants every layer alike: without the two made-up leaves, the stacked layout
    # comes straight from the stacked files.
    del params["layers_1_extra"]
    for i in range(self.cfg.num_layers):
      del params[f"layers_{i}_odd"]
    files = self.gguf_file._param_files(params, self.cfg.num_layers)
    stacked = self.gguf_file._params_from_files(files, self.cfg, stacked=True)
    want = model.stack_layers(params, self.cfg)
    self.assertEqual(jax.tree.structure(stacked), jax.tree.structure(want))
    for a, b in zip(jax_leaves(stacked), jax_leaves(want)):
      np.testing.assert_array_equal(a, b)

  def test_off(self):
    os.environ["PAGED_JAX_GGUF_CACHE"] = ""
    checkpoint.load_checkpoint(self.path)
    self.assertFalse(os.path.exists(os.path.join(self.dir, "cache")))


def jax_leaves(tree):
  import jax
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def rewrite_with_random_k_blocks(path, kinds, seed):
  """Rewrites a GGUF file with the named tensors replaced by random K-quant blocks of the same
  shape: random quants and sub-block scales, the f16 super-block scales set to small finite values
  (random bits there would be NaN / inf)."""
  reader = gguf.GGUFReader(path)
  rng = np.random.default_rng(seed)
  out = path + ".tmp"
  w = gguf.GGUFWriter(out, "llama")
  for key, field in reader.fields.items():
    if key.startswith(("GGUF.", "general.architecture")):
      continue
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(key, field.contents(), vtype, sub_type=sub)
  for t in reader.tensors:
    if t.name not in kinds:
      w.add_tensor(t.name, np.asarray(t.data))
      continue
    qtype = gguf.GGMLQuantizationType[kinds[t.name]]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(t.shape[1]), int(t.shape[0])
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = lambda n: rng.uniform(0.001, 0.01, (rows, cols // block, n)).astype(np.float16)
    if qtype == gguf.GGMLQuantizationType.Q6_K:   # ... ql, qh, int8 scales, then f16 d
      data[..., -2:] = scale(1).view(np.uint8)
    else:                                           # Q4_K / Q5_K: f16 d, f16 dmin, ...
      data[..., :4] = scale(2).view(np.uint8).reshape(rows, cols // block, 4)
    data = data.reshape(rows, -1)
    w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  os.replace(out, path)


@absltest.skipIf(gguf is None and not testing.REQUIRE_TORCH, NEEDS)
class GGUFErrorsTest(absltest.TestCase):
  """Each problem raises CheckpointError naming the file and the thing; nothing half-loaded."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    from paged_jax import config, gguf_file
    cls.dir = tempfile.mkdtemp()
    cls.cfg = config.tiny_config(rms_norm_eps=1e-5)
    cls.params = testing.random_params(cls.cfg, seed=0)
    cls.good = os.path.join(cls.dir, "good.gguf")
    gguf_file.save(cls.params, cls.cfg, cls.good, tensor_type="Q8_0")

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.dir)
    super().tearDownClass()

  def _write(self, name, arch="llama", extra_tensor=None, fields=(), raw=None):
    path = os.path.join(self.dir, name)
    w = gguf.GGUFWriter(path, arch)
    reader = gguf.GGUFReader(self.good)
    for key, field in reader.fields.items():
      if key.startswith(("GGUF.", "general.architecture")):
        continue
      if arch != "llama" and key.startswith("llama."):
        key = f"{arch}." + key[len("llama."):]
      vtype = field.types[0]
      sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
      w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, value, vtype, sub in fields:
      w.add_key_value(key, value, vtype, sub_type=sub)
    for t in reader.tensors:
      if raw is not None and t.name == raw[0]:
        w.add_tensor(t.name, raw[1], raw_shape=raw[1].shape, raw_dtype=raw[2])
      else:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape,
                     raw_dtype=t.tensor_type)
    if extra_tensor is not None:
      w.add_tensor(extra_tensor, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

  def test_good_file_loads(self):   # the base every error case edits
    params, cfg, _ = checkpoint.load_checkpoint(self.good)
    self.assertEqual(cfg.num_layers, self.cfg.num_layers)
    # on the device, not NumPy: a step given host arrays copies every weight in on each call
    self.assertTrue(all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)))

  def test_unsupported_architecture(self):
    path = self._write("gpt2.gguf", arch="gpt2")
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"gpt2.gguf: GGUF architecture 'gpt2' is not supported"):
      checkpoint.load_checkpoint(path)

  def test_unsupported_tensor_type(self):
    rows = np.zeros((self.cfg.num_q_heads * self.cfg.head_dim, 40), np.uint8)   # a Q8_1 block a row
    path = self._write("q81.gguf", raw=("blk.0.attn_q.weight", rows,
                                        gguf.GGMLQuantizationType.Q8_1))
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"q81.gguf: tensor 'blk.0.attn_q.weight' has type Q8_1, which "
                                r"the gguf package cannot dequantize"):
      checkpoint.load_checkpoint(path)

  def test_unexpected_tensor_and_bad_rope_factors(self):
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"extra.gguf: unexpected tensor 'blk.0.ssm_conv1d.weight'"):
      checkpoint.load_checkpoint(self._write("extra.gguf", extra_tensor="blk.0.ssm_conv1d.weight"))
    # 4 factors where head_dim 8 needs 4 is fine; zeros are not
    with self.assertRaisesRegex(checkpoint.CheckpointError, r"factors must all be > 0"):
      checkpoint.load_checkpoint(self._write("freqs.gguf", extra_tensor="rope_freqs.weight"))

  def test_rope_scaling_metadata(self):
    s, f32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.FLOAT32
    path = self._write("linear.gguf", fields=[("llama.rope.scaling.type", "linear", s, None),
                                              ("llama.rope.scaling.factor", 4.0, f32, None)])
    _, cfg, _ = checkpoint.load_checkpoint(path)
    self.assertEqual(dict(cfg.rope_scaling), {"rope_type": "linear", "factor": 4.0})
    path = self._write("odd.gguf", fields=[("llama.rope.scaling.type", "yarn", s, None),
                                           ("llama.rope.scaling.factor", 4.0, f32, None),
                                           ("llama.rope.scaling.yarn_log_multiplier", 0.1, f32,
                                            None)])
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"odd.gguf: llama.rope.scaling.yarn_log_multiplier is not supported"):
      checkpoint.load_checkpoint(path)

  def test_truncated_file(self):
    path = os.path.join(self.dir, "cut.gguf")
    with open(self.good, "rb") as f:
      data = f.read()
    for keep in (len(data) // 2, 40):   # inside the tensor data; inside the metadata
      with open(path, "wb") as f:
        f.write(data[:keep])
      with self.assertRaisesRegex(checkpoint.CheckpointError,
                                  r"cut.gguf: cannot read it as GGUF \(truncated or corrupt\?\)"):
        checkpoint.load_checkpoint(path)

  def test_missing_file_and_missing_tensor(self):
    with self.assertRaisesRegex(checkpoint.CheckpointError, r"nope.gguf: no such file"):
      checkpoint.load_checkpoint(os.path.join(self.dir, "nope.gguf"))

  def test_tokenizers_we_cannot_build(self):
    s = gguf.GGUFValueType.STRING
    arr = gguf.GGUFValueType.ARRAY
    tokens = [f"t{i}" for i in range(self.cfg.vocab_size)]
    spm = self._write("spm.gguf", fields=[("tokenizer.ggml.model", "llama", s, None),
                                          ("tokenizer.ggml.tokens", tokens, arr, s)])
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"spm.gguf: tokenizer.ggml.model='llama' cannot be built"):
      checkpoint.load_checkpoint(spm)
    pre = self._write("pre.gguf", fields=[("tokenizer.ggml.model", "gpt2", s, None),
                                          ("tokenizer.ggml.pre", "made-up", s, None),
                                          ("tokenizer.ggml.tokens", tokens, arr, s),
                                          ("tokenizer.ggml.merges", ["t 0"], arr, s)])
    with self.assertRaisesRegex(checkpoint.CheckpointError,
                                r"pre.gguf: tokenizer.ggml.pre='made-up' is not a pre-tokenizer"):
      checkpoint.load_checkpoint(pre)


if __name__ == "__main__":
  absltest.main()
