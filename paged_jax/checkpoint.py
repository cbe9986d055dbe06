"""Hugging Face-format checkpoints (Llama, Qwen2, Mistral) <-> the Flax decoder. Host side.

A checkpoint directory holds `config.json`, one `model.safetensors` or shards listed in
`model.safetensors.index.json`, and optionally `tokenizer.json` (read with the `tokenizers`
package). Tensors are read with `safetensors` (its Flax reader, so bf16 arrives as bf16) and mapped
by name: `model.layers.{i}.self_attn.q_proj.weight` -> `layers_{i}_self_attn/q_proj/kernel`
(transposed: torch Linear stores [out, in], flax Dense [in, out]). Every problem (missing file,
unsupported architecture or RoPE scaling, missing / unexpected / mis-shaped tensor, non-float
dtype, truncated file) raises `CheckpointError` naming the file or tensor.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.config import ModelConfig

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                           "MistralForCausalLM": "mistral"}
_MODEL_TYPES = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class CheckpointError(ValueError):
  """A checkpoint directory cannot be loaded; the message names the file or tensor."""


def config_from_hf(hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a Hugging Face config.json dict (transformers 4.x and 5.x layouts).

  The family comes from `architectures`, else from `model_type`. Sliding windows follow
  transformers: Mistral windows every layer; Qwen2 only with `use_sliding_window`, on the layers
  `layer_types` names "sliding_attention" (default: layers >= `max_window_layers`).
  """
  arch = (hf.get("architectures") or [None])[0]
  if arch is None and hf.get("model_type") in _MODEL_TYPES:
    arch = _MODEL_TYPES[hf["model_type"]]
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(f"unsupported architecture {arch!r} (model_type "
                          f"{hf.get('model_type')!r}); supported: {sorted(SUPPORTED_ARCHITECTURES)}")
  family = SUPPORTED_ARCHITECTURES[arch]
  rope = hf.get("rope_parameters") or {}   # transformers 5.x nests rope_theta here
  rope_type = rope.get("rope_type", "default")
  scaling = hf.get("rope_scaling")
  if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
    raise CheckpointError(f"RoPE scaling {scaling or rope} is not supported (plain RoPE only)")
  num_layers = hf.get("num_hidden_layers")
  sliding_window, layer_types = None, None
  if family == "mistral":
    sliding_window = hf.get("sliding_window")
  elif family == "qwen2" and hf.get("use_sliding_window"):
    sliding_window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None and sliding_window is not None and isinstance(num_layers, int):
      first = hf.get("max_window_layers", 28)   # transformers' Qwen2Config default
      layer_types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(num_layers)]
  if sliding_window is None:
    layer_types = None
  num_heads = hf["num_attention_heads"] if "num_attention_heads" in hf else None
  try:
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_q_heads=hf["num_attention_heads"], num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=True if family == "qwen2" else bool(hf.get("attention_bias", False)),
        sliding_window=sliding_window,
        layer_types=None if layer_types is None else tuple(layer_types),
        hidden_act=hf.get("hidden_act", "silu"),
        max_position=hf.get("max_position_embeddings", 2048), dtype=dtype)
  except KeyError as e:
    raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
  except (ValueError, TypeError) as e:   # ModelConfig's own checks: name the value
    raise CheckpointError(f"config.json (with dtype={dtype!r}): {e}") from None


def _param_path(hf_name: str) -> tuple[tuple[str, ...], bool] | None:
  """HF tensor name -> (our param path, transpose?) or None if it is not a model weight."""
  parts = hf_name.split(".")
  if parts[0] == "model":
    parts = parts[1:]
  if parts == ["embed_tokens", "weight"]:
    return ("embed_tokens", "embedding"), False
  if parts == ["norm", "weight"]:
    return ("norm", "weight"), False
  if parts == ["lm_head", "weight"]:
    return ("lm_head", "kernel"), True
  if len(parts) >= 4 and parts[0] == "layers":
    i, rest = parts[1], parts[2:]
    if rest[0] in ("input_layernorm", "post_attention_layernorm") and rest[1:] == ["weight"]:
      return (f"layers_{i}_{rest[0]}", "weight"), False
    if rest[0] in ("self_attn", "mlp") and len(rest) == 3:
      leaf = {"weight": "kernel", "bias": "bias"}.get(rest[2])
      if leaf:
        return (f"layers_{i}_{rest[0]}", rest[1], leaf), leaf == "kernel"
  return None


def _read_json(file: str) -> dict:
  try:
    with open(file) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{file}: not valid JSON ({e})") from None
  except OSError as e:
    raise CheckpointError(f"{file}: cannot read it ({e.strerror})") from None
  if not isinstance(data, dict):
    raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
  return data


def _safetensors_files(path: str) -> list[str]:
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index}: no 'weight_map' object")
    files = sorted({os.path.join(path, v) for v in weight_map.values()})
    for file in files:
      if not os.path.exists(file):
        raise CheckpointError(f"{file}: listed in {index} but missing")
    return files
  single = os.path.join(path, "model.safetensors")
  if os.path.exists(single):
    return [single]
  shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  if not shards:
    raise CheckpointError(f"{path}: no *.safetensors file (expected model.safetensors)")
  return [os.path.join(path, f) for f in shards]


def load_tokenizer(path: str):
  """The directory's tokenizer.json as a `tokenizers.Tokenizer`, or None if there is none."""
  file = os.path.join(path, "tokenizer.json")
  if not os.path.exists(file):
    return None
  import tokenizers
  try:
    return tokenizers.Tokenizer.from_file(file)
  except Exception as e:   # tokenizers raises plain Exception subclasses from Rust
    raise CheckpointError(f"{file}: cannot read the tokenizer ({e})") from None


def load_checkpoint(path: str, dtype: str = "float32"):
  """Loads a Hugging Face-format directory.

  Args:
    path: local directory with config.json and *.safetensors (and optionally tokenizer.json).
    dtype: "float32" or "bfloat16": parameters are cast to it.

  Returns:
    (params, cfg, tokenizer): Flax params for `model.Decoder(cfg)`, the ModelConfig, and a
    `tokenizers.Tokenizer` or None.
  """
  from safetensors import SafetensorError, safe_open
  from paged_jax import model   # the model imports attention; keep this module light to import

  config_file = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise CheckpointError(f"{path} is not a directory")
  if not os.path.exists(config_file):
    raise CheckpointError(f"{path}: missing config.json")
  if dtype not in ("float32", "bfloat16"):
    raise CheckpointError(f"dtype={dtype!r} is not supported; load as 'float32' or 'bfloat16'")
  try:
    cfg = config_from_hf(_read_json(config_file), dtype)
  except CheckpointError as e:
    raise CheckpointError(f"{config_file}: {e}") from None
  expected = jax.eval_shape(lambda: model.init_params(cfg))
  flat_expected = {tuple(k.key for k in p): leaf for p, leaf in
                   jax.tree_util.tree_flatten_with_path(expected)[0]}
  loaded: dict[tuple[str, ...], jax.Array] = {}
  tied_head = None   # a stored lm_head.weight of a tied model: kept only to compare
  for file in _safetensors_files(path):
    try:
      with safe_open(file, framework="flax") as f:
        for name in f.keys():
          target = _param_path(name)
          if target is None:
            if name.endswith("rotary_emb.inv_freq"):
              continue   # recomputed from rope_theta
            raise CheckpointError(f"{file}: unexpected tensor {name!r}")
          key, transpose = target
          if cfg.tie_embeddings and key == ("lm_head", "kernel"):
            tied_head = (file, f.get_tensor(name))
            continue
          if key not in flat_expected:
            raise CheckpointError(f"{file}: tensor {name!r} does not belong to this config "
                                  f"(no parameter {'/'.join(key)})")
          x = f.get_tensor(name)
          if x.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has dtype {x.dtype}; expected a float")
          want = tuple(flat_expected[key].shape)
          need = want[::-1] if transpose else want   # in the checkpoint's own layout
          if tuple(x.shape) != need:
            raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(x.shape)}; "
                                  f"the config needs {need}")
          loaded[key] = (x.T if transpose else x).astype(dtype)
    except SafetensorError as e:
      raise CheckpointError(f"{file}: cannot read safetensors (truncated or corrupt?): {e}") from None
  if tied_head is not None and ("embed_tokens", "embedding") in loaded:
    # transformers ties the head to the embedding and ignores the stored copy; we accept it only
    # where that changes nothing.
    file, head = tied_head
    embedding = loaded[("embed_tokens", "embedding")]
    if head.shape != embedding.shape or not bool(jnp.array_equal(head.astype(dtype), embedding)):
      diff = (float(jnp.max(jnp.abs(head.astype(jnp.float32) - embedding.astype(jnp.float32))))
              if head.shape == embedding.shape else f"shape {tuple(head.shape)}")
      raise CheckpointError(f"{file}: tie_word_embeddings is true but the stored 'lm_head.weight' "
                            f"differs from 'model.embed_tokens.weight' (max |diff| {diff}); set "
                            f"tie_word_embeddings to false to use the stored head")
  missing = sorted("/".join(k) for k in flat_expected if k not in loaded)
  if missing:
    raise CheckpointError(f"{path}: missing tensors for {missing[:4]}"
                          f"{' ...' if len(missing) > 4 else ''}")
  params: dict = {}
  for key, x in loaded.items():
    node = params
    for part in key[:-1]:
      node = node.setdefault(part, {})
    node[key[-1]] = x
  return params, cfg, load_tokenizer(path)


def load_eos_token_ids(path: str) -> tuple[int, ...]:
  """The checkpoint's end-of-sequence ids: generation_config.json's eos_token_id if present, else
  config.json's (an int or a list in either); () if neither names one."""
  for name in ("generation_config.json", "config.json"):
    file = os.path.join(path, name)
    if not os.path.exists(file):
      continue
    eos = _read_json(file).get("eos_token_id")
    if eos is None:
      continue
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
      raise CheckpointError(f"{file}: eos_token_id={eos!r} must be a token id or a list of them")
    return tuple(ids)
  return ()


def save_checkpoint(params, cfg: ModelConfig, path: str, tokenizer=None, *,
                    bos_token_id: int | None = None, eos_token_id: int | None = None) -> None:
  """Writes params in Hugging Face Llama format (config.json, model.safetensors, tokenizer.json)."""
  from safetensors.numpy import save_file
  os.makedirs(path, exist_ok=True)
  hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_q_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position,
        "torch_dtype": "float32"}
  if bos_token_id is not None:
    hf["bos_token_id"] = bos_token_id
  if eos_token_id is not None:
    hf["eos_token_id"] = eos_token_id
  if cfg.sliding_window is not None:
    raise ValueError("save_checkpoint writes Llama format, which has no sliding window")
  hf["hidden_act"] = cfg.hidden_act
  tensors = {}
  for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = tuple(k.key for k in p)
    mod = key[0]
    if mod in ("embed_tokens", "norm"):
      name = f"model.{mod}.weight"
    elif mod == "lm_head":
      name = "lm_head.weight"
    else:
      _, i, *rest = mod.split("_", 2)
      sub = rest[0]
      name = (f"model.layers.{i}.{sub}.weight" if len(key) == 2 else
              f"model.layers.{i}.{sub}.{key[1]}.{'weight' if key[2] == 'kernel' else 'bias'}")
    x = np.asarray(leaf, np.float32)
    tensors[name] = np.ascontiguousarray(x.T if key[-1] == "kernel" else x)
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  if tokenizer is not None:
    tokenizer.save(os.path.join(path, "tokenizer.json"))
