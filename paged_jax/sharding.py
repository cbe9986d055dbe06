"""Scale-out with jax.sharding: the mesh, where each array lives, and paged attention per device.

The mesh has two axes, ("data", "model") (written DATAxMODEL: "2x4" is 2 replicas of 4 devices).

"model" is tensor parallelism over heads, Megatron-style:
  * q/k/v, gate and up projections are column-parallel (their output features split across the
    axis), o_proj and down_proj row-parallel (their input features split): XLA adds the one
    all-reduce after each (attention block, MLP block). Embeddings, norms and the LM head are
    replicated.
  * The KV pool is split on its heads axis: each device holds its KV heads' slice of every page.
    Page ids are global and block tables replicated, so the host side (block manager, scheduler,
    copy-on-write pairs, swaps, prefix cache) is the same as on one device, and a page copy or
    swap touches every shard.
  * Writing this step's K/V and attending run per device under `shard_map` (`over_kv_heads`):
    no communication, and the Pallas kernel (a custom call XLA cannot partition) sees its local
    heads only.
  * Fewer KV heads than devices: each KV head is replicated on model / num_kv_heads devices (one
    head per device, as vLLM does), `ModelConfig.stored_kv_heads`; query heads must divide.

"data" is data parallelism over sequences: each row of the mesh is a replica with its own pool,
block manager and scheduler (`paged_jax.data_parallel.DataParallelEngine` places each request on
one replica).

Steps learn the mesh from JAX's ambient mesh (`jax.set_mesh`, which the engine enters around
each step), so their signatures are the same with or without one.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from paged_jax.config import ModelConfig
from paged_jax.state import KVPool

DATA, MODEL = "data", "model"

# Megatron roles by parameter name: column-parallel layers split their output features,
# row-parallel ones their input features; anything else is replicated.
_COLUMN = ("q_proj", "gate_proj", "up_proj")
_KV = ("k_proj", "v_proj")          # column-parallel, or replicated when KV heads are replicated
_ROW = ("o_proj", "down_proj")

POOL_SPEC = P(None, None, None, MODEL, None)   # [layers, pages, page_size, stored_kv_heads, D]
HEADS_SPEC = P(None, MODEL, None)        # [num_tokens, heads, head_dim]


def parse_mesh(spec: str) -> tuple[int, int]:
  """"DATAxMODEL" (e.g. "2x4"; "4" means 1x4) -> (data, model)."""
  parts = str(spec).lower().split("x")
  try:
    sizes = [int(p) for p in parts]
  except ValueError:
    sizes = []
  if len(parts) == 1 and sizes:
    sizes = [1] + sizes
  if len(sizes) != 2 or min(sizes) < 1:
    raise ValueError(f"mesh={spec!r}: give DATAxMODEL with positive sizes, e.g. '1x8' or '2x4'")
  return sizes[0], sizes[1]


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh over the first data * model devices (Auto axes: XLA's partitioner
  places what the specs here do not)."""
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1:
    raise ValueError(f"mesh {data}x{model}: sizes must be >= 1")
  if data * model > len(devices):
    raise ValueError(f"mesh {data}x{model} needs {data * model} devices; {len(devices)} are "
                     f"visible (on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
                     f"before jax starts)")
  return Mesh(np.array(devices[:data * model]).reshape(data, model), (DATA, MODEL))


def mesh_from_flag(spec: str | None) -> Mesh | None:
  """The serve / experiment `--mesh` flag: None or "1x1" -> None (one device), else a mesh."""
  if spec is None or parse_mesh(spec) == (1, 1):
    return None
  return make_mesh(*parse_mesh(spec))


def ensure_host_devices(spec: str) -> None:
  """Asks XLA for DATA x MODEL CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)
  unless XLA_FLAGS already sets a count. It only takes effect before jax first touches a device
  (a script's main, before any computation); a GPU or TPU backend ignores it. After that,
  `make_mesh` says how many devices there are."""
  data, model = parse_mesh(spec)
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if data * model > 1 and "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = (xla_flags +
                               f" --xla_force_host_platform_device_count={data * model}").strip()


def axis_size(mesh, axis: str) -> int:
  """Devices along `axis` of a Mesh / AbstractMesh (1 when there is no mesh or no such axis)."""
  if mesh is None or getattr(mesh, "empty", False) or axis not in mesh.axis_names:
    return 1
  return int(dict(mesh.shape)[axis])


def check_tensor_parallel(cfg: ModelConfig, model: int) -> None:
  """Raises ValueError naming the size that does not split across `model` devices."""
  if cfg.num_q_heads % model:
    raise ValueError(f"num_q_heads={cfg.num_q_heads} does not divide across model={model} "
                     f"devices (tensor parallel over heads)")
  if cfg.intermediate_size % model:
    raise ValueError(f"intermediate_size={cfg.intermediate_size} does not divide across "
                     f"model={model} devices (the MLP's column / row split)")
  cfg.stored_kv_heads(model)   # raises when KV heads neither divide nor replicate evenly


def param_spec(path: tuple[str, ...], ndim: int, cfg: ModelConfig, model: int) -> P:
  """The PartitionSpec of one parameter, from its name (`layers_3_self_attn/q_proj/kernel`)."""
  layer = next((p for p in path if p in _COLUMN + _KV + _ROW), None)
  if layer is None or model == 1:
    return P()
  if layer in _KV and cfg.stored_kv_heads(model) != cfg.num_kv_heads:
    return P()        # KV heads replicated: every device computes all of them
  if layer in _ROW:
    return P(MODEL, None) if path[-1] == "kernel" else P()
  return P(None, MODEL) if ndim == 2 else P(MODEL)   # column: kernel [in, out] or bias [out]


def param_shardings(params, cfg: ModelConfig, mesh: Mesh):
  """A pytree of NamedShardings matching `params` (Megatron layout over the "model" axis)."""
  model = axis_size(mesh, MODEL)
  check_tensor_parallel(cfg, model)

  def spec(path, x):
    names = tuple(str(getattr(k, "key", k)) for k in path)
    return NamedSharding(mesh, param_spec(names, x.ndim, cfg, model))
  return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, cfg: ModelConfig, mesh: Mesh):
  """`params` placed on the mesh (replicated over "data", split over "model")."""
  return jax.device_put(params, param_shardings(params, cfg, mesh))


def _pool_sharding(mesh: Mesh, pool: KVPool):
  """The pool pytree's shardings: every page array split over "model" by `_pool_array_spec`."""
  model = axis_size(mesh, MODEL)
  if pool.num_kv_heads % model:
    raise ValueError(f"a pool of {pool.num_kv_heads} KV heads does not divide across "
                     f"model={model} devices (give it ModelConfig.stored_kv_heads({model}) heads)")
  return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, _pool_array_spec(x)), pool)


def new_pool(mesh: Mesh, **create_kw) -> KVPool:
  """`KVPool.create(**create_kw)` born split over the mesh (no device ever holds it whole)."""
  make = lambda: KVPool.create(**create_kw)
  return jax.jit(make, out_shardings=_pool_sharding(mesh, jax.eval_shape(make)))()


def shard_pool(pool: KVPool, mesh: Mesh) -> KVPool:
  """The pool placed with its KV-heads axis split over "model" (a quantized pool's scales
  alike)."""
  return jax.device_put(pool, _pool_sharding(mesh, pool))


def replica_meshes(mesh: Mesh) -> list[Mesh]:
  """One (1, model) mesh per row of the "data" axis: the devices of each replica."""
  return [Mesh(mesh.devices[d:d + 1], (DATA, MODEL)) for d in range(mesh.devices.shape[0])]


def _pool_array_spec(x) -> P:
  """K / V pages [layers, pages, page_size, heads, D] split over heads; a quantized pool's scales
  [layers, pages, S, H] too where they have a heads axis (H > 1), whole where they are one per
  page or per tensor (H == 1)."""
  if x.ndim == 5:
    return POOL_SPEC
  return P(None, None, None, MODEL) if x.shape[3] > 1 else P()


def over_kv_heads(fn, q, k, v, pool_arrays, *replicated):
  """fn(q, k, v, pool_arrays, *replicated) run per device on its heads when the ambient mesh has
  a "model" axis of more than one device; plain `fn(...)` otherwise.

  Args:
    q: [T, num_q_heads, D]; k, v: [T, num_kv_heads, D]; pool_arrays: the pool's
      `KVPool.page_arrays()`: K and V dtype[num_layers, num_pages, page_size, stored_kv_heads, D]
      (k and v are repeated to the stored heads when KV heads are replicated), and a quantized
      pool's scales.
    replicated: pytrees every device sees whole (metadata, token indices).

  fn returns (o [T, num_q_heads_local, D], pool_arrays) on local heads.
  """
  mesh = jax.sharding.get_abstract_mesh()
  model = axis_size(mesh, MODEL)
  if model == 1:
    return fn(q, k, v, pool_arrays, *replicated)
  stored = pool_arrays[0].shape[3]
  if stored != k.shape[1]:   # replicated KV heads: head j of the pool is KV head j // r
    k = jnp.repeat(k, stored // k.shape[1], axis=1)
    v = jnp.repeat(v, stored // v.shape[1], axis=1)
  pool_specs = tuple(_pool_array_spec(x) for x in pool_arrays)
  specs = (HEADS_SPEC, HEADS_SPEC, HEADS_SPEC, pool_specs) + (P(),) * len(replicated)
  return jax.shard_map(fn, in_specs=specs, out_specs=(HEADS_SPEC, pool_specs),
                       check_vma=False)(q, k, v, tuple(pool_arrays), *replicated)
