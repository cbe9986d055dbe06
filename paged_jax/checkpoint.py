"""Hugging Face-format checkpoints (Llama 2 / 3.x, Qwen2 / 2.5 / 3, Mistral, Gemma 2 / 3, Phi-3)
<-> the Flax decoder. Host side. GGUF files go through `paged_jax.gguf_file`, which maps them to
the same names and config and comes back here.

`FAMILIES` holds one table per family: the config.json fields it reads, the ModelConfig switches
it sets, its fused projections, and the values it refuses (each refusal names the field and
value; nothing runs approximately).

A checkpoint directory holds `config.json`, one `model.safetensors` or shards listed in
`model.safetensors.index.json`, and optionally `tokenizer.json` (read with the `tokenizers`
package). Tensors are read with `safetensors` (its Flax reader, so bf16 arrives as bf16) and mapped
by name: `model.layers.{i}.self_attn.q_proj.weight` -> `layers_{i}_self_attn/q_proj/kernel`
(transposed: torch Linear stores [out, in], flax Dense [in, out]). Every problem (missing file,
unsupported architecture or RoPE scaling, missing / unexpected / mis-shaped tensor, non-float
dtype, truncated file) raises `CheckpointError` naming the file or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import rope
from paged_jax.config import ModelConfig

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


class CheckpointError(ValueError):
  """A checkpoint directory cannot be loaded; the message names the file or tensor."""


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: what it reads from config.json, how its weights map, what it refuses.

  Attributes:
    architectures, model_types: the names config.json gives it (`architectures[0]`, else
      `model_type`).
    features: ModelConfig switches every model of the family has.
    read: config.json -> the ModelConfig fields that vary within the family.
    fused: a stored projection -> the projections it splits into, by rows in that order
      (Phi-3's qkv_proj and gate_up_proj).
    refuses: (field, predicate, why): a config whose field makes the predicate true cannot run
      exactly and is refused naming the field and value.
  """
  architectures: tuple[str, ...]
  model_types: tuple[str, ...]
  features: dict[str, Any]
  read: Callable[[dict], dict[str, Any]]
  fused: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  refuses: tuple[tuple[str, Callable[[Any], bool], str], ...] = ()


def _rope_params(hf: dict, layer_type: str | None = None) -> dict:
  """The RoPE dict of a config: transformers 5.x `rope_parameters` (nested by layer type for
  Gemma 3) over 4.x `rope_scaling`, with rope_theta wherever it was given."""
  params = dict(hf.get("rope_scaling") or {})
  nested = hf.get("rope_parameters") or {}
  if layer_type is not None and isinstance(nested.get(layer_type), dict):
    nested = nested[layer_type]
  elif any(isinstance(v, dict) for v in nested.values()):
    nested = nested.get("full_attention") or {}
  params.update(nested)
  return params


def _window_every_layer(hf: dict) -> dict:   # Mistral, Phi-3
  return {"sliding_window": hf.get("sliding_window")}


def _qwen_window(hf: dict) -> dict:
  """Qwen2 / Qwen3: a window only with use_sliding_window, on the layers layer_types names
  "sliding_attention" (default: layers >= max_window_layers)."""
  if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
    return {}
  layer_types = hf.get("layer_types")
  num_layers = hf.get("num_hidden_layers")
  if layer_types is None and isinstance(num_layers, int):
    first = hf.get("max_window_layers", 28)   # transformers' Qwen2Config default
    layer_types = ["sliding_attention" if i >= first else "full_attention"
                   for i in range(num_layers)]
  return {"sliding_window": hf["sliding_window"], "layer_types": layer_types}


def _gemma(pattern: int, hf: dict) -> dict:
  """Gemma 2 (pattern 2) / Gemma 3 (pattern 6): every pattern-th layer global, the rest windowed,
  unless layer_types says otherwise; Gemma's defaults where config.json is silent."""
  num_layers = hf.get("num_hidden_layers")
  pattern = hf.get("sliding_window_pattern", pattern)
  layer_types = hf.get("layer_types")
  if layer_types is None and isinstance(num_layers, int):
    layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                   for i in range(num_layers)]
  out = {"sliding_window": hf.get("sliding_window", 4096), "layer_types": layer_types,
         "query_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
         "hidden_act": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
         "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
         "attn_soft_cap": hf.get("attn_logit_softcapping"),
         "final_soft_cap": hf.get("final_logit_softcapping")}
  return out


def _gemma3(hf: dict) -> dict:
  local = _rope_params(hf, "sliding_attention")
  return {**_gemma(6, hf),
          "rope_theta": _rope_params(hf, "full_attention").get("rope_theta")
          or hf.get("rope_theta") or 1_000_000.0,
          "local_rope_theta": float(local.get("rope_theta") or hf.get("rope_local_base_freq")
                                    or 10_000.0)}


def _scaled(value) -> bool:
  return bool(value) and value.get("rope_type", value.get("type", "default")) != "default"


_LOCAL_ROPE_SCALED = ("rope_parameters", lambda v: isinstance(v, dict) and _scaled(
    v.get("sliding_attention")), "a scaled RoPE on sliding-window layers is not implemented")
_NO_MLP_BIAS = ("mlp_bias", bool, "MLP biases are not implemented")
_NO_PARTIAL_ROTARY = ("partial_rotary_factor", lambda v: v not in (None, 1, 1.0),
                      "rotary embeddings over part of each head are not implemented")
_NO_BIDIRECTIONAL = ("use_bidirectional_attention", bool,
                     "the engine decodes causally; bidirectional attention is for encoders")

FAMILIES: dict[str, Family] = {
    "llama": Family(("LlamaForCausalLM",), ("llama",), {},
                    lambda hf: {"attention_bias": bool(hf.get("attention_bias", False))},
                    refuses=(_NO_MLP_BIAS,)),
    "mistral": Family(("MistralForCausalLM",), ("mistral",), {}, _window_every_layer),
    "qwen2": Family(("Qwen2ForCausalLM",), ("qwen2",), {"attention_bias": True}, _qwen_window),
    "qwen3": Family(("Qwen3ForCausalLM",), ("qwen3",), {"qk_norm": True},
                    lambda hf: {**_qwen_window(hf),
                                "attention_bias": bool(hf.get("attention_bias", False))}),
    "gemma2": Family(("Gemma2ForCausalLM",), ("gemma2",),
                     {"unit_offset_norms": True, "scale_embeddings": True,
                      "sandwich_norms": True},
                     lambda hf: {**_gemma(2, hf),
                                 "attention_bias": bool(hf.get("attention_bias", False))}),
    "gemma3": Family(("Gemma3ForCausalLM",), ("gemma3_text",),
                     {"unit_offset_norms": True, "scale_embeddings": True,
                      "sandwich_norms": True, "qk_norm": True},
                     lambda hf: {**_gemma3(hf),
                                 "attention_bias": bool(hf.get("attention_bias", False))},
                     refuses=(_NO_BIDIRECTIONAL, _LOCAL_ROPE_SCALED)),
    "phi3": Family(("Phi3ForCausalLM",), ("phi3",), {}, _window_every_layer,
                   fused={"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                          "gate_up_proj": ("gate_proj", "up_proj")},
                   # transformers' Phi3Config reads "su" and "yarn" as longrope
                   refuses=(("rope_type", lambda v: v in ("su", "yarn", "longrope"),
                             "Phi-3 runs these as longrope, which switches frequency sets by "
                             "the batch's longest sequence: not reproducible in a paged batch"),)),
}
for _family in FAMILIES.values():   # every family refuses a partial rotary dimension
  object.__setattr__(_family, "refuses", _family.refuses + (_NO_PARTIAL_ROTARY,))
SUPPORTED_ARCHITECTURES = {arch: name for name, fam in FAMILIES.items()
                           for arch in fam.architectures}
_MODEL_TYPES = {mt: name for name, fam in FAMILIES.items() for mt in fam.model_types}


def family_of(hf: dict[str, Any]) -> str:
  """The FAMILIES key of a config.json dict: from `architectures`, else from `model_type`."""
  arch = (hf.get("architectures") or [None])[0]
  if arch in SUPPORTED_ARCHITECTURES:
    return SUPPORTED_ARCHITECTURES[arch]
  if arch is None and hf.get("model_type") in _MODEL_TYPES:
    return _MODEL_TYPES[hf["model_type"]]
  raise CheckpointError(f"unsupported architecture {arch!r} (model_type "
                        f"{hf.get('model_type')!r}); supported: {sorted(SUPPORTED_ARCHITECTURES)}")


def config_from_hf(hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
  """ModelConfig from a Hugging Face config.json dict (transformers 4.x and 5.x layouts).

  The family (`FAMILIES`) comes from `architectures`, else from `model_type`; its table says
  which fields it reads and which values it refuses. RoPE scaling follows `paged_jax.rope`:
  the types it names run exactly, any other is refused naming it.
  """
  name = family_of(hf)
  family = FAMILIES[name]
  rope_params = _rope_params(hf)
  for field, refused, why in family.refuses:
    if field in ("partial_rotary_factor", "rope_type"):   # read from the RoPE dict first
      value = rope_params.get(field, rope_params.get("type") if field == "rope_type" else
                              hf.get(field))
    else:
      value = hf.get(field)
    if refused(value):
      raise CheckpointError(f"{name}: {field}={value!r} is not supported ({why})")
  num_heads = hf.get("num_attention_heads")
  try:
    fields = dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_q_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(rope_params.get("rope_theta") or hf.get("rope_theta") or 10_000.0),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_act=hf.get("hidden_act", "silu"),
        max_position=hf.get("max_position_embeddings", 2048), dtype=dtype,
        rope_scaling=freeze_rope(rope_params, hf))
  except KeyError as e:
    raise CheckpointError(f"config.json lacks {e.args[0]!r}") from None
  fields.update(family.features)
  fields.update({k: v for k, v in family.read(hf).items() if v is not None})
  if fields.get("sliding_window") is None:
    fields.pop("layer_types", None)
  if fields.get("layer_types") is not None:
    fields["layer_types"] = tuple(fields["layer_types"])
  for key in ("rope_theta", "local_rope_theta", "query_scale", "attn_soft_cap", "final_soft_cap"):
    if fields.get(key) is not None:
      fields[key] = float(fields[key])
  try:
    return ModelConfig(**fields)
  except (ValueError, TypeError) as e:   # ModelConfig's own checks: name the value
    raise CheckpointError(f"config.json (with dtype={dtype!r}): {e}") from None


def freeze_rope(params: dict, hf: dict):
  """The hashable rope_scaling of a config (None: plain RoPE). yarn's original length defaults
  to max_position_embeddings, as transformers' standardization does."""
  params = dict(params)
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "yarn" and not params.get("original_max_position_embeddings"):
    params["original_max_position_embeddings"] = hf.get("max_position_embeddings", 2048)
  return rope.freeze(params)


def _param_path(hf_name: str, family: Family) -> list[tuple[tuple[str, ...], bool, int]] | None:
  """HF tensor name -> [(our param path, transpose?, part)] (one entry, or one per part of a
  fused projection, `part` its index) or None if it is not a model weight."""
  parts = hf_name.split(".")
  if parts[0] == "model":
    parts = parts[1:]
  if parts == ["embed_tokens", "weight"]:
    return [(("embed_tokens", "embedding"), False, 0)]
  if parts == ["norm", "weight"]:
    return [(("norm", "weight"), False, 0)]
  if parts == ["lm_head", "weight"]:
    return [(("lm_head", "kernel"), True, 0)]
  if len(parts) >= 4 and parts[0] == "layers":
    i, rest = parts[1], parts[2:]
    if rest[0].endswith("layernorm") and rest[1:] == ["weight"]:
      return [((f"layers_{i}_{rest[0]}", "weight"), False, 0)]
    if rest[0] == "self_attn" and rest[1] in ("q_norm", "k_norm") and rest[2:] == ["weight"]:
      return [((f"layers_{i}_self_attn", rest[1], "weight"), False, 0)]
    if rest[0] in ("self_attn", "mlp") and len(rest) == 3:
      leaf = {"weight": "kernel", "bias": "bias"}.get(rest[2])
      if leaf:
        targets = family.fused.get(rest[1], (rest[1],))
        return [((f"layers_{i}_{rest[0]}", t, leaf), leaf == "kernel", n)
                for n, t in enumerate(targets)]
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


def load_checkpoint(path: str, dtype: str = "float32", stacked: bool = False):
  """Loads a Hugging Face-format directory or a GGUF file (`paged_jax.gguf_file`).

  Args:
    path: a local directory with config.json and *.safetensors (and optionally tokenizer.json),
      or a `.gguf` file.
    dtype: "float32" or "bfloat16": parameters are cast to it.
    stacked: return the params in `model.stack_layers`' layout (what `Engine(scan_layers=True)`
      runs). A GGUF file's converted-model cache stores them stacked, so then this is no copy.

  Returns:
    (params, cfg, tokenizer): Flax params for `model.Decoder(cfg)`, the ModelConfig, and a
    `tokenizers.Tokenizer` or None.
  """
  if dtype not in ("float32", "bfloat16"):
    raise CheckpointError(f"dtype={dtype!r} is not supported; load as 'float32' or 'bfloat16'")
  if path.endswith(".gguf") or os.path.isfile(path):
    from paged_jax import gguf_file
    return gguf_file.load(path, dtype, stacked)
  config_file = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise CheckpointError(f"{path} is not a directory")
  if not os.path.exists(config_file):
    raise CheckpointError(f"{path}: missing config.json")
  hf = _read_json(config_file)
  try:
    cfg = config_from_hf(hf, dtype)
  except CheckpointError as e:
    raise CheckpointError(f"{config_file}: {e}") from None
  params = assemble_params(cfg, FAMILIES[family_of(hf)], _safetensors_tensors(path), path)
  if stacked:
    from paged_jax import model
    params = model.stack_layers(params, cfg)
  return params, cfg, load_tokenizer(path)


def load_config(path: str, dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a checkpoint directory or GGUF file, without reading its weights."""
  if path.endswith(".gguf") or os.path.isfile(path):
    from paged_jax import gguf_file
    return gguf_file.load_config(path, dtype)
  config_file = os.path.join(path, "config.json")
  if not os.path.exists(config_file):
    raise CheckpointError(f"{path}: missing config.json")
  try:
    return config_from_hf(_read_json(config_file), dtype)
  except CheckpointError as e:
    raise CheckpointError(f"{config_file}: {e}") from None


def _safetensors_tensors(path: str):
  """(file, name, array) of every tensor in the directory's safetensors files."""
  from safetensors import SafetensorError, safe_open
  for file in _safetensors_files(path):
    try:
      with safe_open(file, framework="flax") as f:
        for name in f.keys():
          yield file, name, f.get_tensor(name)
    except SafetensorError as e:
      raise CheckpointError(f"{file}: cannot read safetensors (truncated or corrupt?): {e}") from None


def assemble_params(cfg: ModelConfig, family: Family, tensors, path: str) -> dict:
  """Flax params for `model.Decoder(cfg)` from Hugging Face-named tensors.

  Args:
    tensors: iterable of (file, HF tensor name, array in the checkpoint's own [out, in] layout).
    path: the checkpoint, named in errors about what is missing.

  Every tensor must belong to the config (shape and float dtype checked); a fused projection is
  split by rows into its parts; nothing is returned half-loaded: any problem raises
  CheckpointError naming the file and tensor.
  """
  from paged_jax import model   # the model imports attention; keep this module light to import
  dtype = cfg.dtype
  expected = jax.eval_shape(lambda: model.init_params(cfg))
  flat_expected = {tuple(k.key for k in p): leaf for p, leaf in
                   jax.tree_util.tree_flatten_with_path(expected)[0]}
  loaded: dict[tuple[str, ...], jax.Array] = {}
  tied_head = None   # a stored lm_head.weight of a tied model: kept only to compare
  for file, name, x in tensors:
    targets = _param_path(name, family)
    if targets is None:
      if name.endswith("rotary_emb.inv_freq"):
        continue   # recomputed from the RoPE parameters
      raise CheckpointError(f"{file}: unexpected tensor {name!r}")
    if cfg.tie_embeddings and targets[0][0] == ("lm_head", "kernel"):
      tied_head = (file, x)
      continue
    for key, _, _ in targets:
      if key not in flat_expected:
        raise CheckpointError(f"{file}: tensor {name!r} does not belong to this config "
                              f"(no parameter {'/'.join(key)})")
    if x.dtype not in _FLOAT_DTYPES:
      raise CheckpointError(f"{file}: tensor {name!r} has dtype {x.dtype}; expected a float")
    transpose = targets[0][1]
    # in the checkpoint's own layout: [out, in] for kernels, parts stacked along out
    wants = [tuple(flat_expected[key].shape)[::-1] if t else tuple(flat_expected[key].shape)
             for key, t, _ in targets]
    need = (sum(w[0] for w in wants),) + wants[0][1:]
    if tuple(x.shape) != need:
      fused = f" ({' + '.join(k[-2] for k, _, _ in targets)})" if len(targets) > 1 else ""
      raise CheckpointError(f"{file}: tensor {name!r} has shape {tuple(x.shape)}; "
                            f"the config needs {need}{fused}")
    start = 0
    for (key, t, _), want in zip(targets, wants):
      part = x[start:start + want[0]]
      start += want[0]
      loaded[key] = (part.T if t else part).astype(dtype)
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
  # On the device whatever the source (GGUF tensors are NumPy): a step given host arrays copies
  # every weight in on each call (SmolLM2-135M f32 from its GGUF: ~20 ms of a ~40 ms token).
  return jax.device_put(params)


def load_eos_token_ids(path: str) -> tuple[int, ...]:
  """The checkpoint's end-of-sequence ids: generation_config.json's eos_token_id if present, else
  config.json's (an int or a list in either); () if neither names one. A GGUF file: its
  tokenizer.ggml.eos_token_id and eot_token_id."""
  if os.path.isfile(path):
    from paged_jax import gguf_file
    return gguf_file.metadata(path)["eos_token_ids"]
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
  beyond = [f for f in ("local_rope_theta", "qk_norm", "unit_offset_norms", "scale_embeddings",
                        "sandwich_norms", "query_scale", "attn_soft_cap", "final_soft_cap")
            if getattr(cfg, f)]
  if beyond:
    raise ValueError(f"save_checkpoint writes Llama format, which has none of {beyond}")
  if cfg.rope_scaling is not None:
    hf["rope_scaling"] = dict(cfg.rope_scaling)
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
