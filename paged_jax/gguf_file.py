"""GGUF files (llama.cpp's format) read directly, with the `gguf` package (llama.cpp's own
reader and dequantizer: `pip install -e '.[gguf]'`). Host side.

A GGUF file holds metadata (architecture, sizes, tokenizer, chat template) and tensors, many of
them quantized in blocks. `load` maps both to what `paged_jax.checkpoint` reads from a Hugging
Face directory and goes through the same checks:

  metadata `{arch}.block_count`, ... -> a config.json dict -> `checkpoint.config_from_hf`
  tensor `blk.{i}.attn_q.weight`     -> `model.layers.{i}.self_attn.q_proj.weight`
                                     -> `checkpoint.assemble_params`

Every tensor is dequantized by `gguf.quants.dequantize` to f32 (then cast to the load dtype):
F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K and the IQ types the package knows. The
Q / K rows of a llama GGUF are in llama.cpp's rotary order (convert_hf_to_gguf.py permutes them);
they are permuted back. llama.cpp writes Llama 3's RoPE scaling as a tensor of per-frequency
divisors, `rope_freqs.weight`: it becomes the config's RoPE ("factors", `paged_jax.rope`). The
tokenizer is built with `tokenizers` from the file's byte-level BPE
vocabulary and merges (`tokenizer.ggml.model == "gpt2"`, as Llama 3, Qwen and SmolLM files
have). Supported architectures: `ARCHITECTURES`. Anything else (another architecture, a tensor
type the package cannot dequantize, a truncated file, a SentencePiece tokenizer, an unknown
pre-tokenizer) raises `CheckpointError` naming the file and the thing, before anything is
returned.

What a load produces (the config, the serving metadata, the tokenizer and the dequantized
params) is kept in a converted-model cache, keyed by the file's path, size and mtime
(`converted_cache_dir`: ~/.cache/paged_jax/gguf, or $PAGED_JAX_GGUF_CACHE; "" turns it off): a
later process loads it without parsing the file (gguf's reader parses every metadata field,
the 49k-token vocabulary included: ~3 s for SmolLM2) or dequantizing anything (~1.3 s). The
params are kept as one .npy file per leaf, each layer leaf stacked over the layers, and read as
memory maps: on the CPU `jax.device_put` then takes them without a copy, in either layout (per
layer: a view of one layer; `stacked=True`, `model.stack_layers`' layout: the stack itself), so a
warm load of SmolLM2 takes ~0.1 s with its tokenizer, where reading an .npz took ~0.6 s and
stacking it ~0.5 s more (results page, "Latency for one user"). A file cut short under a live
process's map is a SIGBUS at its next read: the cache renames files into place, never rewrites.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from typing import Any

from absl import logging

import numpy as np

from paged_jax import rope
from paged_jax.checkpoint import FAMILIES, CheckpointError, assemble_params, config_from_hf

# GGUF architecture -> the Hugging Face architecture its tensors and metadata map to, and whether
# llama.cpp permuted the Q / K rows when converting (it does for "llama" only).
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True),
                 "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False)}

# metadata key (after "{arch}.") -> config.json field
_CONFIG_KEYS = {"block_count": "num_hidden_layers", "context_length": "max_position_embeddings",
                "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads",
                "attention.head_count_kv": "num_key_value_heads",
                "attention.key_length": "head_dim", "rope.freq_base": "rope_theta",
                "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}

# {arch}.rope.scaling.* -> the rope_scaling field (llama.cpp's names)
_ROPE_SCALING_KEYS = {"factor": "factor", "original_context_length":
                      "original_max_position_embeddings", "yarn_beta_fast": "beta_fast",
                      "yarn_beta_slow": "beta_slow"}

# GGUF tensor names -> Hugging Face names ({i}: the layer)
_TENSOR_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}

# tokenizer.ggml.pre -> the split regex its merges were learned with (None: GPT-2's, which the
# ByteLevel pre-tokenizer applies itself). Regexes as llama.cpp and transformers state them.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": None, "gpt2": None, "smollm": None, "starcoder": None,
                  "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                  "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
                  "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4   # tokenizer.ggml.token_type values


def _reader(path: str):
  try:
    import gguf
  except ImportError:
    raise CheckpointError(f"{path}: reading GGUF needs the gguf package (pip install -e "
                          f"'.[gguf]', or pip install gguf)") from None
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: no such file")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:   # the reader raises ValueError / IndexError / struct errors alike
    raise CheckpointError(f"{path}: cannot read it as GGUF (truncated or corrupt?): "
                          f"{type(e).__name__}: {e}") from None


def _value(reader, key: str, default=None):
  field = reader.fields.get(key)
  if field is None:
    return default
  value = field.contents()
  return value


def metadata(path: str, reader=None) -> dict[str, Any]:
  """The file's serving metadata: architecture, bos / eos ids, chat template, add_bos_token
  (read once per file version: the serve command asks for it several times)."""
  if reader is None:
    if not os.path.isfile(path):
      raise CheckpointError(f"{path}: no such file")
    stat = os.stat(path)
    return dict(_metadata_cached(path, stat.st_mtime_ns, stat.st_size))
  return _metadata(reader)


@functools.lru_cache(maxsize=8)
def _metadata_cached(path, mtime_ns, size):
  entry = _cache_entry(path)
  converted = _read_converted_meta(entry) if entry else None
  if converted is not None:
    return converted["metadata"]
  return _metadata(_reader(path))


def _metadata(reader) -> dict[str, Any]:
  get = lambda k, d=None: _value(reader, k, d)
  eos = get("tokenizer.ggml.eos_token_id")
  eot = get("tokenizer.ggml.eot_token_id")
  return {"architecture": get("general.architecture"),
          "bos_token_id": get("tokenizer.ggml.bos_token_id"),
          "eos_token_ids": tuple(dict.fromkeys(i for i in (eos, eot) if i is not None)),
          "chat_template": get("tokenizer.chat_template"),
          "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", False))}


def hf_config(path: str, reader) -> dict[str, Any]:
  """A config.json dict from the file's metadata (raises naming an unsupported architecture)."""
  arch = _value(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{sorted(ARCHITECTURES)}")
  hf: dict[str, Any] = {"architectures": [ARCHITECTURES[arch][0]]}
  for key, field in _CONFIG_KEYS.items():
    value = _value(reader, f"{arch}.{key}")
    if value is not None:
      hf[field] = value
  names = {t.name for t in reader.tensors}
  if "vocab_size" not in hf:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is not None:
      hf["vocab_size"] = int(embed.shape[1])   # GGML order: [hidden, vocab]
    elif tokens is not None:
      hf["vocab_size"] = len(tokens.data)
  hf["tie_word_embeddings"] = "output.weight" not in names
  freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
  if freqs is not None:   # llama.cpp's per-frequency divisors (Llama 3.1+ files): theta / f_i
    if _value(reader, f"{arch}.rope.scaling.type") not in (None, "none"):
      raise CheckpointError(f"{path}: both rope_freqs.weight and {arch}.rope.scaling.type")
    hf["rope_scaling"] = {"rope_type": "factors",
                          "factors": tuple(float(f) for f in np.asarray(freqs.data, np.float32))}
  rotary = _value(reader, f"{arch}.rope.dimension_count")
  head_dim = hf.get("head_dim") or (hf.get("hidden_size", 0) // max(1, hf.get(
      "num_attention_heads", 1)))
  if rotary is not None and rotary != head_dim:
    hf["partial_rotary_factor"] = rotary / head_dim   # refused by the family table
  scaling = _value(reader, f"{arch}.rope.scaling.type")
  if scaling not in (None, "none"):
    rope = {"rope_type": scaling}
    prefix = f"{arch}.rope.scaling."
    for key in reader.fields:
      if not key.startswith(prefix) or key[len(prefix):] in ("type", "finetuned"):
        continue
      name = _ROPE_SCALING_KEYS.get(key[len(prefix):])
      if name is None:
        raise CheckpointError(f"{path}: {key} is not supported (known: "
                              f"{sorted(prefix + k for k in _ROPE_SCALING_KEYS)})")
      rope[name] = _value(reader, key)
    hf["rope_scaling"] = rope
  if arch in ("qwen2", "qwen3") and any(n.endswith("attn_q.bias") for n in names):
    hf["attention_bias"] = True
  return hf


def _tensors(path: str, reader, hf: dict, permute_qk: bool):
  """(file, Hugging Face name, f32 array in [out, in] layout) of every tensor."""
  from gguf import GGMLQuantizationType
  from gguf.quants import dequantize
  heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
  for t in reader.tensors:
    if t.name == "rope_freqs.weight":
      continue   # read into the config's rope_scaling (hf_config)
    name = _hf_name(t.name)
    if name is None:
      raise CheckpointError(f"{path}: unexpected tensor {t.name!r} (no Hugging Face "
                            f"counterpart in the {sorted(ARCHITECTURES)} architectures)")
    try:
      if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        x = np.asarray(t.data, np.float32)
      else:
        x = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
      raise CheckpointError(f"{path}: tensor {t.name!r} has type {t.tensor_type.name}, which "
                            f"the gguf package cannot dequantize") from None
    except (ValueError, KeyError) as e:
      raise CheckpointError(f"{path}: tensor {t.name!r} of type {t.tensor_type.name}: {e}") from None
    x = x.reshape(tuple(int(d) for d in reversed(t.shape)))   # GGML [in, out] -> [out, in]
    if permute_qk and t.name.endswith(("attn_q.weight", "attn_k.weight")):
      x = _unpermute(x, heads if "attn_q" in t.name else kv_heads)
    yield path, name, x


def _hf_name(name: str) -> str | None:
  if name in _TENSOR_NAMES:
    return _TENSOR_NAMES[name]
  parts = name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
    return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
  return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Undoes convert_hf_to_gguf.py's `permute`: per head, rows (pairs interleaved) back to
  Hugging Face's rotate-half order. w: [heads * head_dim, in]."""
  rows = w.shape[0]
  return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
  """convert_hf_to_gguf.py's Q / K row permutation (Hugging Face -> llama.cpp order)."""
  rows = w.shape[0]
  return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer(path: str, reader, meta: dict | None = None):
  """A `tokenizers.Tokenizer` from the file's tokenizer metadata, or None if it has none."""
  model = _value(reader, "tokenizer.ggml.model")
  if model is None:
    return None
  if model != "gpt2":
    raise CheckpointError(f"{path}: tokenizer.ggml.model={model!r} cannot be built (only "
                          f"byte-level BPE, 'gpt2', is supported; a SentencePiece 'llama' "
                          f"vocabulary is not yet)")
  pre = _value(reader, "tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise CheckpointError(f"{path}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer we know the "
                          f"split of; known: {sorted(PRE_TOKENIZERS)}")
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors
  tokens = _value(reader, "tokenizer.ggml.tokens")
  merges = _value(reader, "tokenizer.ggml.merges")
  types = _value(reader, "tokenizer.ggml.token_type") or []
  if not tokens or merges is None:
    raise CheckpointError(f"{path}: tokenizer.ggml.tokens / merges missing for a BPE tokenizer")
  try:
    bpe = models.BPE(vocab={tok: i for i, tok in enumerate(tokens)},
                     merges=[tuple(m.split(" ", 1)) for m in merges])
    tok = tokenizers.Tokenizer(bpe)
    split = PRE_TOKENIZERS[pre]
    if split is None:
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
      tok.pre_tokenizer = pre_tokenizers.Sequence([
          pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    special = [tokenizers.AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [tokenizers.AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_special_tokens(special)
    if user:
      tok.add_tokens(user)
    meta = meta or metadata(path, reader)
    bos = meta["bos_token_id"]
    if meta["add_bos_token"] and bos is not None:
      tok.post_processor = processors.TemplateProcessing(
          single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
          special_tokens=[(tokens[bos], bos)])
  except CheckpointError:
    raise
  except Exception as e:   # tokenizers raises plain Exceptions from Rust
    raise CheckpointError(f"{path}: cannot build the tokenizer ({e})") from None
  if tok.get_vocab_size() != len(tokens):
    raise CheckpointError(f"{path}: the tokenizer has {tok.get_vocab_size()} tokens, the file "
                          f"lists {len(tokens)}")
  return tok


def load_config(path: str, dtype: str = "float32"):
  """The file's ModelConfig, without dequantizing anything."""
  hf = hf_config(path, _reader(path))
  try:
    return config_from_hf(hf, dtype)
  except CheckpointError as e:
    raise CheckpointError(f"{path}: {e}") from None


def load(path: str, dtype: str = "float32", stacked: bool = False):
  """(params, cfg, tokenizer) of a GGUF file, as `checkpoint.load_checkpoint` returns them
  (from the converted-model cache when it holds this version of the file). stacked: the params
  in `model.stack_layers`' layout (from the cache without a copy)."""
  if not os.path.isfile(path):
    raise CheckpointError(f"{path}: no such file")
  entry = _cache_entry(path)
  converted = _load_converted(entry, dtype, stacked) if entry else None
  if converted is not None:
    return converted
  reader = _reader(path)
  hf = hf_config(path, reader)
  try:
    cfg = config_from_hf(hf, dtype)
  except CheckpointError as e:
    raise CheckpointError(f"{path}: {e}") from None
  arch, permute_qk = ARCHITECTURES[_value(reader, "general.architecture")]
  family = FAMILIES[{"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                     "Qwen3ForCausalLM": "qwen3"}[arch]]
  meta = metadata(path, reader)
  tok = tokenizer(path, reader, meta)   # before the weights: a bad tokenizer fails fast
  params = assemble_params(cfg, family, _tensors(path, reader, hf, permute_qk), path)
  if entry:
    _save_converted(entry, dtype, path, hf, meta, tok, params)
    converted = _load_converted(entry, dtype, stacked)   # memory maps, as every later load
    if converted is not None:
      return converted
  if stacked:
    from paged_jax import model
    params = model.stack_layers(params, cfg)
  return params, cfg, tok


# ------------------------------------------------------------------ the converted-model cache

DEFAULT_CONVERTED_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "gguf")
# Bump when what a load produces, or how the cache stores it, changes. 2: the params as a folder
# of .npy files (`_param_files`) read as memory maps, not one .npz read into memory.
_CONVERTED_FORMAT = 2
_LAYER_KEY = re.compile(r"layers_(\d+)_(.+)")


def converted_cache_dir() -> str | None:
  """Where converted GGUF models are kept: $PAGED_JAX_GGUF_CACHE if set ("" = nowhere: off),
  else DEFAULT_CONVERTED_CACHE."""
  directory = os.environ.get("PAGED_JAX_GGUF_CACHE")
  if directory is None:
    return DEFAULT_CONVERTED_CACHE
  return directory or None


def _cache_entry(path: str) -> str | None:
  """The cache folder of this version of the file (path, size, mtime), or None when off."""
  root = converted_cache_dir()
  if root is None:
    return None
  st = os.stat(path)
  ident = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{_CONVERTED_FORMAT}"
  return os.path.join(root, hashlib.sha1(ident.encode()).hexdigest()[:20])


def _read_converted_meta(entry: str) -> dict | None:
  try:
    with open(os.path.join(entry, "meta.json")) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  meta["metadata"]["eos_token_ids"] = tuple(meta["metadata"]["eos_token_ids"])
  return meta


def _param_parts(params, num_layers: int) -> dict[str, list[np.ndarray]]:
  """The params as the cache stores them: file stem -> its parts. A layer leaf that every layer
  has, with one shape and dtype, is one file stacked over the layers (`layers~mlp~up_proj~kernel`,
  its parts the layers' arrays in order); any other leaf is a file of its own (its tree path, "/"
  written "~"; one part)."""
  import jax
  flat = {"/".join(k.key for k in p): np.asarray(x) for p, x in
          jax.tree_util.tree_flatten_with_path(params)[0]}
  files, per_leaf = {}, {}
  for name, x in flat.items():
    if "~" in name:
      raise ValueError(f"parameter {name!r}: '~' cannot be written to the cache")
    top, _, rest = name.partition("/")
    m = _LAYER_KEY.fullmatch(top)
    if m:
      per_leaf.setdefault("/".join([m.group(2)] + ([rest] if rest else [])), {})[
          int(m.group(1))] = name
  for leaf, layers in per_leaf.items():
    xs = [flat[layers[i]] for i in range(num_layers)] if len(layers) == num_layers else None
    if xs and all(x.shape == xs[0].shape and x.dtype == xs[0].dtype for x in xs):
      files["layers~" + leaf.replace("/", "~")] = xs
      for name in layers.values():
        del flat[name]
  files.update({name.replace("/", "~"): [x] for name, x in flat.items()})
  return files


def _param_files(params, num_layers: int) -> dict[str, np.ndarray]:
  """`_param_parts` as the arrays the files hold (the stacked ones stacked)."""
  return {stem: np.stack(parts) if stem.startswith("layers~") else parts[0]
          for stem, parts in _param_parts(params, num_layers).items()}


def _nest(flat: dict[str, Any]) -> dict:
  """{"a/b": x} -> {"a": {"b": x}}."""
  from flax import traverse_util
  return traverse_util.unflatten_dict(flat, sep="/")


def _params_from_files(arrays: dict[str, np.ndarray], cfg, stacked: bool) -> dict:
  """`_param_files`' arrays (memory maps) -> params, per layer or in `model.stack_layers`' layout;
  every leaf a view of a file's array (no copy) where the layout allows it."""
  from paged_jax import model
  flat, per_leaf = {}, {}
  for stem, x in arrays.items():
    name = stem.replace("~", "/")
    if name.startswith("layers/"):
      per_leaf[name[len("layers/"):]] = x
    else:
      flat[name] = x
  if not stacked or any(_LAYER_KEY.fullmatch(n.split("/")[0]) for n in flat):
    for leaf, x in per_leaf.items():
      top, _, rest = leaf.partition("/")
      for i in range(cfg.num_layers):
        flat[f"layers_{i}_{top}" + (f"/{rest}" if rest else "")] = x[i]
    params = _nest(flat)
    return model.stack_layers(params, cfg) if stacked else params
  groups = []
  for start, period, reps in model.layer_groups(cfg):
    phases = []
    for j in range(period):
      first = start + j
      pick = (lambda x: x[first]) if reps == 1 else (
          lambda x: x[first:first + period * reps:period])
      phases.append(_nest({leaf: pick(x) for leaf, x in per_leaf.items()}))
    groups.append(tuple(phases))
  params = _nest(flat)
  params["layers"] = tuple(groups)
  return params


def _load_converted(entry: str, dtype: str, stacked: bool = False):
  """(params, cfg, tokenizer) from the cache, or None if it lacks them (or they are unreadable:
  the caller converts the file again and rewrites them). The params are memory maps of the
  cache's files, put on the device without a copy where the device is this CPU."""
  meta = _read_converted_meta(entry)
  folder = os.path.join(entry, f"params-{dtype}")
  if meta is None or not os.path.isdir(folder):
    return None
  try:
    cfg = config_from_hf(meta["hf"], dtype)
    with open(os.path.join(folder, "index.json")) as f:
      index = json.load(f)
    arrays = {}
    for stem, (shape, stored) in index.items():
      x = np.load(os.path.join(folder, f"{stem}.npy"), mmap_mode="r")
      if list(x.shape) != shape or str(x.dtype) != stored:
        raise ValueError(f"{stem}.npy is {x.dtype}{list(x.shape)}, the index says "
                         f"{stored}{shape}")
      if dtype == "bfloat16" and x.dtype == np.uint16:   # stored as its bits
        import ml_dtypes
        x = x.view(ml_dtypes.bfloat16)
      arrays[stem] = x
    params = _params_from_files(arrays, cfg, stacked)
    tok = None
    if os.path.exists(os.path.join(entry, "tokenizer.json")):
      import tokenizers
      tok = tokenizers.Tokenizer.from_file(os.path.join(entry, "tokenizer.json"))
  except Exception as e:   # noqa: BLE001 - a damaged entry is converted again, not fatal
    logging.warning("converted-model cache %s is unreadable (%s); converting again", entry, e)
    return None
  import jax
  return jax.device_put(params), cfg, tok   # on the device, as assemble_params returns them


def _save_converted(entry: str, dtype: str, path: str, hf: dict, meta: dict, tok, params):
  """Writes the cache entry (atomically: a temporary folder renamed into place, or one params
  folder renamed into an existing entry). A failure (a full or read-only disk) only logs. Files
  are never rewritten in place: a process may have them mapped."""
  files = _param_parts(params, int(hf["num_hidden_layers"]))
  if dtype == "bfloat16":   # stored as its bits: NumPy has no bfloat16 of its own
    files = {k: [x.view(np.uint16) for x in parts] for k, parts in files.items()}
  root = os.path.dirname(entry)
  name = f"params-{dtype}"
  try:
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
    try:
      with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"source": os.path.realpath(path), "hf": hf, "metadata": meta}, f,
                  default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
      if tok is not None:
        tok.save(os.path.join(tmp, "tokenizer.json"))
      os.makedirs(os.path.join(tmp, name))
      index = {}
      for stem, parts in files.items():   # each layer written into its row: no stacked copy
        shape = parts[0].shape if not stem.startswith("layers~") else (len(parts),) + parts[0].shape
        out = np.lib.format.open_memmap(os.path.join(tmp, name, f"{stem}.npy"), mode="w+",
                                        dtype=parts[0].dtype, shape=shape)
        for i, x in enumerate(parts):
          if stem.startswith("layers~"):
            out[i] = x
          else:
            out[...] = x
        out.flush()
        del out
        index[stem] = [list(shape), str(parts[0].dtype)]
      with open(os.path.join(tmp, name, "index.json"), "w") as f:
        json.dump(index, f)
      if not os.path.isdir(entry):
        os.replace(tmp, entry)
      else:   # another dtype of the same file, or a damaged one replaced: its params only
        target = os.path.join(entry, name)
        if os.path.exists(target):
          os.replace(target, os.path.join(tmp, "old"))
        os.replace(os.path.join(tmp, name), target)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  except OSError as e:
    logging.warning("cannot write the converted-model cache %s (%s); loads stay uncached",
                    entry, e)


def save(params, cfg, path: str, *, tensor_type: str = "F32"):
  """Writes params as a llama-architecture GGUF file (what llama.cpp's converter writes for a
  Llama): Q / K rows permuted to llama.cpp's order, 2-D weights in `tensor_type` (F32, F16, BF16,
  Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: the types `gguf.quants.quantize` writes), norms in F32. No
  tokenizer metadata is written.
  """
  import gguf
  from gguf.quants import quantize
  kind = dict(cfg.rope_scaling or {}).get("rope_type")
  if cfg.sliding_window is not None or cfg.qk_norm or cfg.unit_offset_norms or kind not in (
      None, "llama3", "factors"):
    raise ValueError("gguf_file.save writes Llama configs only (plain or llama3 RoPE)")
  qtype = gguf.GGMLQuantizationType[tensor_type]
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_q_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_key_length(cfg.head_dim)
  w.add_value_length(cfg.head_dim)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  names = {v: k for k, v in _LAYER_TENSORS.items()}
  def put(name, x, two_d):
    x = np.ascontiguousarray(np.asarray(x, np.float32))
    if two_d and qtype != gguf.GGMLQuantizationType.F32:
      data = quantize(x, qtype)
      w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    else:
      w.add_tensor(name, x)
  if kind is not None:   # as llama.cpp's converter: the divisors theta_i / theta'_i as a tensor
    plain, _ = rope.frequencies(cfg.head_dim, cfg.rope_theta, None, cfg.max_position)
    scaled, _ = cfg.layer_rope(0)
    w.add_tensor("rope_freqs.weight", (plain / scaled).astype(np.float32))
  put("token_embd.weight", params["embed_tokens"]["embedding"], True)
  for i in range(cfg.num_layers):
    attn, mlp = params[f"layers_{i}_self_attn"], params[f"layers_{i}_mlp"]
    for hf_name, x in (("input_layernorm", params[f"layers_{i}_input_layernorm"]["weight"]),
                       ("post_attention_layernorm",
                        params[f"layers_{i}_post_attention_layernorm"]["weight"])):
      put(f"blk.{i}.{names[hf_name]}.weight", x, False)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      x = np.asarray(attn[proj]["kernel"], np.float32).T
      if proj in ("q_proj", "k_proj"):
        x = permute(x, cfg.num_q_heads if proj == "q_proj" else cfg.num_kv_heads)
      put(f"blk.{i}.{names['self_attn.' + proj]}.weight", x, True)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      put(f"blk.{i}.{names['mlp.' + proj]}.weight", np.asarray(mlp[proj]["kernel"]).T, True)
  put("output_norm.weight", params["norm"]["weight"], False)
  if not cfg.tie_embeddings:
    put("output.weight", np.asarray(params["lm_head"]["kernel"]).T, True)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
