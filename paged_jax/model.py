"""A Llama-family decoder in Flax (Llama, Qwen2 / 3, Mistral, Gemma 2 / 3, Phi-3) whose attention
runs on a KV store.

Layers: RMSNorm -> q/k/v projections (biases for Qwen2) -> per-head q/k RMSNorms (Qwen3, Gemma 3)
-> rotary embeddings (`paged_jax.rope`) -> write this step's K/V and attend -> o_proj -> residual
-> RMSNorm -> gated MLP -> residual; a final RMSNorm and a tied or untied LM head. Gemma adds
(1 + w) norms, an embedding scaled by sqrt(hidden), norms on the attention and MLP outputs before
their residual adds, a query scale, and soft caps on attention scores and logits: each a switch
of `ModelConfig`. Parameter names follow Hugging Face's (`layers_0/self_attn/q_proj`, ...), so
checkpoints map one to one (`paged_jax.checkpoint`).

The KV store is a pytree passed in and returned: `PagedKV` (the paged pool and this step's
`AttentionMetadata`) for the real thing, `DenseKV` (one contiguous cache row per sequence) as the
reference the paged path is tested against. Both see the same ragged token layout.
"""

from __future__ import annotations

import collections.abc
import contextlib

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from paged_jax import attention, kv_quant, matmul, sharding
from paged_jax import rope as rotary
from paged_jax.config import ModelConfig
from paged_jax.kv_write import write_kv_layer
from paged_jax.state import AttentionMetadata, KVPool


@flax.struct.dataclass
class PagedKV:
  """The paged pool plus this step's metadata. `impl` picks the attention path (static)."""
  pool: KVPool
  md: AttentionMetadata
  impl: str = flax.struct.field(pytree_node=False, default="auto")

  def attend(self, layer, q, k, v, *, sliding_window, scale=None, soft_cap=None, select=None):
    """Writes K/V of this step's tokens by slot, then paged attention.

    Args:
      layer: the layer, an int or a traced i32 scalar (inside a scan over layers): its pages
        are reached through the pool's flat view, block tables and slots offset by
        `KVPool.layer_offset` (no slice of the pool).
      q: [T, H, D] queries of every token, or with `select` [S, H, D] of the tokens it names.
      k, v: [T, K, D] of every token (all are written).
      select: i32[S] token indices whose queries alone are wanted (the last layer, when only
        some tokens' logits are). Each attends as a decode row (one query at its position).
      sliding_window, scale, soft_cap: as in `attention.step_attention` (static).

    Without `select`, decode rows and prefill chunks run as `attention.step_attention` splits
    them (one kernel launch on a GPU; decode rows and prefill rows apart on the XLA path).
    """
    pool = self.pool

    def local(q, k, v, arrays, md, select, offset):   # one device's heads (or all)
      shape = arrays[0].shape
      flat = lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
      md = md.replace(block_tables=md.block_tables + offset,
                      slots=md.slots + offset * shape[2])
      with jax.named_scope("kv_write"):
        if pool.quantized:   # codes and scales; the step's own K/V as they are stored
          fmt, dtype = pool.fmt, jnp.dtype(pool.compute_dtype)
          codes_k, scales_k, k = kv_quant.write_layer(flat(arrays[0]), flat(arrays[2]), k,
                                                      md.slots, fmt)
          codes_v, scales_v, v = kv_quant.write_layer(flat(arrays[1]), flat(arrays[3]), v,
                                                      md.slots, fmt)
          pages_k = kv_quant.QuantizedPages(codes_k, scales_k, dtype)
          pages_v = kv_quant.QuantizedPages(codes_v, scales_v, dtype)
          new = (codes_k, codes_v, scales_k, scales_v)
        else:
          pages_k = write_kv_layer(flat(arrays[0]), k, md.slots)
          pages_v = write_kv_layer(flat(arrays[1]), v, md.slots)
          new = (pages_k, pages_v)
      with jax.named_scope("attention"):
        o = self._attention(md, pages_k, pages_v, q, k, v, select, sliding_window=sliding_window,
                            scale=scale, soft_cap=soft_cap)
      return o, tuple(x.reshape(a.shape) for x, a in zip(new, arrays))
    offset = jnp.asarray(pool.layer_offset(layer), jnp.int32)
    o, arrays = sharding.over_kv_heads(local, q, k, v, pool.page_arrays(), self.md, select,
                                       offset)
    return o, self.replace(pool=pool.with_page_arrays(arrays))

  def _attention(self, md, pages_k, pages_v, q, k, v, select, **kw):
    if select is None:
      o = attention.step_attention(q, k, v, pages_k, pages_v, md.block_tables,
                                   md.seq_lens, md.cu_q_lens, num_decode=md.num_decode,
                                   max_q_len=md.max_q_len, impl=self.impl, **kw)
    else:
      row, position = attention.token_positions(md.seq_lens, md.cu_q_lens, select)
      o = attention.paged_attention(
          q, pages_k, pages_v, md.block_tables[row],
          jnp.maximum(position + 1, 1).astype(jnp.int32),
          jnp.arange(select.shape[0] + 1, dtype=jnp.int32), max_q_len=1, impl=self.impl, **kw)
    return o


@flax.struct.dataclass
class DenseKV:
  """A contiguous cache [num_layers, num_seqs, max_len, K, D]: the reference for the paged path.

  seq_ids/positions: i32[num_tokens] where each query token's K/V goes.
  fmt: a quantized pool's format (per token or per tensor): K/V are quantized and dequantized
    as the pool's write does before they are stored, so a quantized paged run can be compared
    with it exactly.
  """
  k: jax.Array
  v: jax.Array
  seq_ids: jax.Array
  positions: jax.Array
  seq_lens: jax.Array
  cu_q_lens: jax.Array
  max_q_len: int = flax.struct.field(pytree_node=False, default=1)
  fmt: kv_quant.KVFormat | None = flax.struct.field(pytree_node=False, default=None)

  def attend(self, layer: int, q, k, v, *, sliding_window, scale=None, soft_cap=None,
             select=None):
    kw = dict(sliding_window=sliding_window, scale=scale, soft_cap=soft_cap)
    if self.fmt is not None:   # the reference of a quantized pool: K/V as a write stores them
      scale_of = ((lambda x: jnp.full(x.shape[:2], self.fmt.tensor_scale, jnp.float32))
                  if self.fmt.granularity == "tensor" else None)
      if self.fmt.granularity == "page":
        raise ValueError("DenseKV has no pages: a per-page scale has no dense reference (test "
                         "the attention paths on `kv_quant.quantize_pages` instead)")
      k = kv_quant.roundtrip(k, self.fmt, None if scale_of is None else scale_of(k))
      v = kv_quant.roundtrip(v, self.fmt, None if scale_of is None else scale_of(v))
    kc = self.k.at[layer, self.seq_ids, self.positions].set(k.astype(self.k.dtype))
    vc = self.v.at[layer, self.seq_ids, self.positions].set(v.astype(self.v.dtype))
    if select is None:
      o = attention.dense_attention(q, kc[layer], vc[layer], self.cu_q_lens, self.seq_lens,
                                    max_q_len=self.max_q_len, **kw)
    else:   # each selected query alone, over its sequence's keys up to its position
      rows = self.seq_ids[select]
      o = attention.dense_attention(q, kc[layer][rows], vc[layer][rows],
                                    jnp.arange(select.shape[0] + 1, dtype=jnp.int32),
                                    self.positions[select] + 1, max_q_len=1, **kw)
    return o, self.replace(k=kc, v=vc)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis. Llama's form scales the normed x, cast to dtype, by `weight`;
  with unit_offset (Gemma) it scales by (1 + weight) in f32, then casts."""
  eps: float
  dtype: jnp.dtype
  unit_offset: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
    weight = self.param("weight", init, (x.shape[-1],), self.dtype)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.unit_offset:
      return (xf * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
    return weight * xf.astype(self.dtype)


def norm(cfg: ModelConfig, name: str | None = None) -> RMSNorm:
  return RMSNorm(cfg.rms_norm_eps, jnp.dtype(cfg.dtype), cfg.unit_offset_norms, name=name)


def _dense(features: int, name: str | None = None, dtype=None, bias: bool = False,
           backend: str = "xla") -> nn.Dense:
  return Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
               kernel_init=nn.initializers.normal(0.02), dot_general=matmul.for_backend(backend))


# `pack_for_onednn`'s parameter names: a projection's packed kernel (in place of `kernel`), and
# a tied LM head's packed copy of the embedding (beside the embedding, which the token lookup
# still reads).
PACKED_KERNEL = "packed_kernel"
PACKED_ATTEND = "packed_attend"
# Beside a stacked `packed_kernel` [reps, bytes] inside a scan body: the repetition (i32 scalar)
# whose kernel `Dense` multiplies by, read in place (`scanned_forward`).
PACKED_LAYER = "packed_layer"


class Dense(nn.Dense):
  """nn.Dense (same parameters, same product), or, where its params hold `packed_kernel`
  (`pack_for_onednn`: 1-d, oneDNN's layout of the [in, features] kernel) instead of `kernel`,
  the product through `matmul.onednn_packed_dot` at any row count, plus the same bias. In a
  scan body the packed kernel may be the whole stack [reps, bytes] with `packed_layer` (the
  repetition) beside it (`scanned_forward`)."""

  @nn.compact
  def __call__(self, inputs):
    if not self.has_variable("params", PACKED_KERNEL):
      return super().__call__(inputs)
    packed = self.get_variable("params", PACKED_KERNEL)   # not self.param: no [in, out] shape
    layer = (self.get_variable("params", PACKED_LAYER)
             if self.has_variable("params", PACKED_LAYER) else None)
    y = matmul.onednn_packed_dot(inputs.astype(self.dtype), packed, self.features, layer)
    if self.use_bias:
      y = y + self.get_variable("params", "bias").astype(self.dtype)
    return y


class Embed(nn.Embed):
  """nn.Embed (same parameter) with a clamping gather: `jnp.take`'s default "fill" mode adds a
  select over every embedded value, and token ids are validated on the host already. `attend`
  (the tied LM head) multiplies through the `matmul` backend's dot_general."""
  matmul: str = "xla"

  def __call__(self, inputs):
    return jnp.take(self.embedding.astype(self.dtype), inputs, axis=0, mode="clip")

  def attend(self, query):
    """query: [T, hidden] -> [T, vocab] against the embedding rows (a tied LM head); through its
    packed copy where `pack_for_onednn` made one."""
    if self.has_variable("params", PACKED_ATTEND):
      return matmul.onednn_packed_dot(query.astype(self.dtype),
                                      self.get_variable("params", PACKED_ATTEND),
                                      self.num_embeddings)
    return matmul.for_backend(self.matmul)(
        query.astype(self.dtype), self.embedding.astype(self.dtype), (((1,), (1,)), ((), ())))


class Attention(nn.Module):
  """layer: static, names the layer's window (`ModelConfig.layer_window`) and, unless kv_layer is
  given, its layer of the pool."""
  cfg: ModelConfig
  layer: int

  @nn.compact
  def __call__(self, x, kv, rope, select=None, kv_layer=None):
    """rope: this layer's `rotary.tables` (cos, sin) f32[T, head_dim // 2] of every token.
    select: i32[S] tokens whose outputs alone are wanted (K/V are still written for all).
    kv_layer: the pool layer, when it is traced (a scan over layers); default `layer`."""
    cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
    num_tokens = x.shape[0]
    cos, sin = rope
    q_rope = rope if select is None else (cos[select], sin[select])
    nq, nkv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if self.has_variable("params", "qkv_proj"):   # `fuse_projections`' layout: one product
      qkv = _dense(nq + 2 * nkv, "qkv_proj", dt, cfg.attention_bias, cfg.matmul)(x)
      q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
      q = q if select is None else q[select]
    else:
      xq = x if select is None else x[select]
      with _selected_rows(select):
        q = _dense(nq, "q_proj", dt, cfg.attention_bias, cfg.matmul)(xq)
      k = _dense(nkv, "k_proj", dt, cfg.attention_bias, cfg.matmul)(x)
      v = _dense(nkv, "v_proj", dt, cfg.attention_bias, cfg.matmul)(x)
    q = q.reshape(q.shape[0], cfg.num_q_heads, cfg.head_dim)
    k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
      q, k = norm(cfg, "q_norm")(q), norm(cfg, "k_norm")(k)
    with jax.named_scope("rope"):
      q = rotary.rotate(q, *q_rope)
      k = rotary.rotate(k, cos, sin)
    v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
    o, kv = kv.attend(self.layer if kv_layer is None else kv_layer, q, k, v,
                      sliding_window=cfg.layer_window(self.layer),
                      scale=cfg.query_scale, soft_cap=cfg.attn_soft_cap, select=select)
    with _selected_rows(select):
      o = _dense(cfg.hidden_size, "o_proj", dt, backend=cfg.matmul)(
          o.reshape(q.shape[0], -1).astype(dt))
    return o, kv


def _selected_rows(select):
  """Around a product of the selected tokens' rows (`select`): no `matmul.padding_rows` there
  (its count is of the step's token rows)."""
  return contextlib.nullcontext() if select is None else matmul.every_row()


# The MLP runs a long step's tokens in chunks of at most this many rows: on a CPU a 4,560-token
# prefill step of the serve benchmark's large model otherwise writes [4560, 2752] f32
# intermediates (50 MB, past the 32 MB L3) between the gate / up matmuls, the activation and
# down_proj. `python -m experiments.cpu_parts_bench`: one layer's MLP 198.5 ms (389 GFLOP/s) in
# one piece, 186.0 ms (414 GFLOP/s) in 5 chunks. Decode steps (a row per sequence) are one chunk.
MLP_CHUNK_TOKENS = 1024


def token_chunks(num_tokens: int, max_rows: int) -> list[tuple[int, int]]:
  """[start, stop) bounds splitting num_tokens rows into the fewest near-equal chunks of at most
  max_rows rows (static: shapes are known when tracing)."""
  if num_tokens <= max_rows:
    return [(0, num_tokens)]
  n = -(-num_tokens // max_rows)
  bounds = [i * num_tokens // n for i in range(n + 1)]
  return list(zip(bounds[:-1], bounds[1:]))


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    """x: [T, hidden] -> [T, hidden]; rows are independent, so a long step runs in chunks."""
    dt, width = jnp.dtype(self.cfg.dtype), self.cfg.intermediate_size
    down = _dense(self.cfg.hidden_size, "down_proj", dt, backend=self.cfg.matmul)
    if self.has_variable("params", "gate_up_proj"):   # `fuse_projections`' layout
      gate_up = _dense(2 * width, "gate_up_proj", dt, backend=self.cfg.matmul)

      def block(x):
        h = gate_up(x)
        return down(activation(self.cfg.hidden_act, h[:, :width]) * h[:, width:])
    else:
      gate = _dense(width, "gate_proj", dt, backend=self.cfg.matmul)
      up = _dense(width, "up_proj", dt, backend=self.cfg.matmul)

      def block(x):
        return down(activation(self.cfg.hidden_act, gate(x)) * up(x))
    chunks = token_chunks(x.shape[0], MLP_CHUNK_TOKENS)
    if len(chunks) == 1:
      return block(x)
    out = []
    for s, e in chunks:
      with matmul.padding_slice(x.shape[0], s, e):
        out.append(block(x[s:e]))
    return jnp.concatenate(out, axis=0)


def activation(name: str, x):
  """transformers' ACT2FN for the names in config.HIDDEN_ACTS."""
  if name == "silu":
    # Written out: nn.silu's lowering materialized a broadcast constant of the full shape.
    return x / (1 + jnp.exp(-x))
  if name == "gelu":
    return jax.nn.gelu(x, approximate=False)
  if name in ("gelu_pytorch_tanh", "gelu_new"):
    return jax.nn.gelu(x, approximate=True)
  raise ValueError(f"hidden_act={name!r} is not supported")


def _decode(cfg: ModelConfig, part, tokens, positions, kv, logits_indices, run_layers):
  """The decoder around its layers: embedding, RoPE tables, `run_layers`, final norm, LM head.

  part(name, cls, *args, **kw): the module `cls(*args, **kw)` as the parameter subtree `name`
  (a submodule of `Decoder`, or one bound to given params in `scanned_forward`).
  run_layers(x, kv, ropes) -> (x, kv): ropes maps `rope_key(cfg, i)` to layer i's tables.
  """
  dt = jnp.dtype(cfg.dtype)
  embed = part("embed_tokens", Embed, cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt,
               embedding_init=nn.initializers.normal(0.02), matmul=cfg.matmul)
  x = embed(tokens)
  if cfg.scale_embeddings:   # Gemma: sqrt(hidden) rounded to the dtype first, as transformers
    # Materialized (computed_once), as a scan's carry is: fused into layer 0's norm instead,
    # XLA rounds it differently (logits ~2e-6 apart, unrolled against scanned).
    x = computed_once(lambda e: e * jnp.asarray(cfg.hidden_size ** 0.5, jnp.float32).astype(dt),
                      x)
  ropes = {}   # one (cos, sin) per distinct RoPE of the layers (Gemma 3 has two)
  for i in range(cfg.num_layers):
    key = rope_key(cfg, i)
    if key not in ropes:
      inv_freq, factor = cfg.layer_rope(i)
      with jax.named_scope("rope"):
        ropes[key] = computed_once(
            lambda p, f=inv_freq, a=factor: rotary.tables(p, f, a), positions)
  x, kv = run_layers(x, kv, ropes)
  x = part("norm", norm, cfg)(x)
  if cfg.tie_embeddings:
    logits = embed.attend(x)
  else:
    logits = part("lm_head", _dense, cfg.vocab_size, dtype=dt, backend=cfg.matmul)(x)
  logits = logits.astype(jnp.float32)
  if cfg.final_soft_cap is not None:
    logits = cfg.final_soft_cap * jnp.tanh(logits / cfg.final_soft_cap)
  return logits, kv


def _layer(cfg: ModelConfig, layer: int, part, x, kv, rope, select=None, kv_layer=None):
  """One decoder layer; part(name, cls, *args) as in `_decode`, within the layer.

  layer: static (its window and RoPE); kv_layer: its pool layer when traced. select: the last
  layer's tokens whose outputs alone are wanted.
  """
  h = part("input_layernorm", norm, cfg)(x)
  h, kv = part("self_attn", Attention, cfg, layer)(h, kv, rope, select, kv_layer)
  if cfg.sandwich_norms:
    h = part("post_attention_layernorm", norm, cfg)(h)
  x = (x if select is None else x[select]) + h
  # Llama calls the MLP's input norm post_attention_layernorm; Gemma, pre_feedforward.
  h = part("pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm",
           norm, cfg)(x)
  with _selected_rows(select):
    h = part("mlp", MLP, cfg)(h)
  if cfg.sandwich_norms:
    h = part("post_feedforward_layernorm", norm, cfg)(h)
  return x + h, kv


def rope_key(cfg: ModelConfig, layer: int):
  """Layers with equal keys rotate by the same tables."""
  inv_freq, factor = cfg.layer_rope(layer)
  return inv_freq.tobytes(), factor


class Decoder(nn.Module):
  """tokens i32[num_tokens] (ragged, as in AttentionMetadata) -> logits f32[num_out, vocab_size].

  The layers run as a Python loop over per-layer parameters (`layers_{i}_self_attn/...`, Hugging
  Face's names): every compiled step holds each layer's code once. `stack_layers` and
  `scanned_forward` run the same model as a `lax.scan` over stacked layer parameters."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, kv, logits_indices=None):
    """Args:
      tokens, positions: i32[num_tokens].
      kv: PagedKV or DenseKV; returned updated.
      logits_indices: i32[num_out] tokens whose logits to return (default: all).

    Returns:
      (f32[num_out, vocab_size] logits, kv).

    With logits_indices, the last layer runs queries, attention, o_proj and MLP for those
    tokens only (every token's K/V is still written): nothing after it reads the others.
    """
    cfg = self.cfg

    def part(name, cls, *args, **kw):
      return cls(*args, name=name, **kw)

    def run_layers(x, kv, ropes):
      for i in range(cfg.num_layers):
        select = logits_indices if i == cfg.num_layers - 1 else None
        in_layer = lambda name, cls, *a, i=i, **kw: part(f"layers_{i}_{name}", cls, *a, **kw)
        x, kv = _layer(cfg, i, in_layer, x, kv, ropes[rope_key(cfg, i)], select)
      return x, kv

    return _decode(cfg, part, tokens, positions, kv, logits_indices, run_layers)


# ------------------------------------------------------------------------ layers as a scan

# Longest repeating pattern of layer kinds a scan body holds (Gemma 3: five local, one global).
MAX_LAYER_PERIOD = 8


def layer_kind(cfg: ModelConfig, layer: int):
  """What a scan body must know statically about a layer: its window and its RoPE."""
  return cfg.layer_window(layer), rope_key(cfg, layer)


def layer_groups(cfg: ModelConfig) -> tuple[tuple[int, int, int], ...]:
  """The layers as (start, period, reps) runs: layers start .. start + period * reps - 1 repeat a
  pattern of `period` kinds `reps` times (one scan whose body holds `period` layers; a period
  longer than 1 only when it repeats). Greedy from layer 0, the run covering the most layers
  first (the shortest period on ties); the last layer
  is always a run of its own (it alone computes only the selected tokens' outputs)."""
  kinds = [layer_kind(cfg, i) for i in range(cfg.num_layers)]
  n = cfg.num_layers - 1
  groups, j = [], 0
  while j < n:
    best = (1, 1)
    for period in range(1, min(MAX_LAYER_PERIOD, n - j) + 1):
      reps = 1
      while (j + (reps + 1) * period <= n and
             kinds[j + reps * period:j + (reps + 1) * period] == kinds[j:j + period]):
        reps += 1
      if (reps > 1 or period == 1) and period * reps > best[0] * best[1]:
        best = (period, reps)   # a pattern seen once is no scan: one layer at a time then
    groups.append((j,) + best)
    j += best[0] * best[1]
  groups.append((n, 1, 1))
  return tuple(groups)


# `fuse_projections`: each fused product and the products it replaces, in its column order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(params) -> dict:
  """The layers' q / k / v products as one `qkv_proj` and gate / up as one `gate_up_proj` (their
  kernels, and biases where they have them, joined along the output columns, as Phi-3's
  checkpoints store them): a layer runs 4 products instead of 7. A scratch chain of SmolLM2's
  30 layers' one-row products alone took 18.1 ms fused against 20.1 ms; whole engine steps
  showed no gain beyond their run-to-run spread (results page, "Fused projections"), so the
  engine leaves it off unless asked (`Engine(fuse_projections=True)`). Either layout
  (per-layer, or `stack_layers`' stacked leaves [reps, in, out]); the modules run whichever
  they are given. Each output column is the same
  sum of products over the same inputs; XLA may block the longer product differently, so
  logits can differ in the last bits (tested within 1e-5).

  params: a tree whose layer subtrees hold q_proj / k_proj / v_proj and gate_proj / up_proj.
  Returns a new tree; the unfused weights are not kept."""
  def fuse(out):
    for fused, parts in FUSED_PROJECTIONS.items():
      if all(p in out for p in parts):
        leaves = [out.pop(p) for p in parts]
        names = leaves[0].keys()
        if any(leaf.keys() != names for leaf in leaves):
          raise ValueError(f"{parts} have different parameters: {[sorted(x) for x in leaves]}")
        out[fused] = {n: jnp.concatenate([leaf[n] for leaf in leaves], axis=-1) for n in names}
      elif any(p in out for p in parts):
        raise ValueError(f"a layer has {sorted(p for p in parts if p in out)} but not all of "
                         f"{parts}: nothing to fuse into {fused}")
    return out
  return _rebuild_mappings(params, fuse)


def _rebuild_mappings(tree, fn):
  """`tree` rebuilt bottom up, every mapping replaced by fn(a new dict of its rebuilt items)
  (tuples and lists rebuilt, other leaves kept)."""
  if not isinstance(tree, collections.abc.Mapping):
    if isinstance(tree, (tuple, list)):
      return tree.__class__(_rebuild_mappings(t, fn) for t in tree)
    return tree
  return fn({k: _rebuild_mappings(v, fn) for k, v in tree.items()})


def pack_for_onednn(params, cfg: ModelConfig) -> dict:
  """Every projection's kernel in oneDNN's packed layout (`matmul.onednn_pack`), for
  `ModelConfig.matmul="onednn"` (the engine does this at construction): `kernel` [in, out] (or
  `stack_layers`' [reps, in, out]) becomes `packed_kernel` (1-d, or [reps, bytes]), which
  `Dense` multiplies through `matmul.onednn_packed_dot` at every row count; a tied LM head gets
  `packed_attend`, a packed copy of the embedding (the lookup keeps reading the embedding, so
  that is the one weight held twice: 113 MB for SmolLM2 in f32). In SmolLM2's decode steps the
  packed products ran faster than XLA's dot and than oneDNN on the plain weights (results
  page, "2026-12-07, later"). A weight
  oneDNN does not pack (another dtype, a layout not blocked by columns) is left as it is and
  runs through `matmul.onednn_dot_general`. Returns a new tree; ValueError where oneDNN cannot
  run."""
  def pack(kernel):
    k, n = kernel.shape[-2:]
    if matmul.onednn_packed_bytes(kernel.dtype, k, n) is None:
      return None
    if kernel.ndim == 2:
      return matmul.onednn_pack(kernel)
    return jnp.stack([matmul.onednn_pack(w) for w in kernel])

  def pack_dense(out):
    kernel = out.get("kernel")
    if kernel is not None and getattr(kernel, "ndim", 0) in (2, 3):
      packed = pack(kernel)
      if packed is not None:
        del out["kernel"]
        out[PACKED_KERNEL] = packed
    return out

  packed = _rebuild_mappings(params, pack_dense)
  embed = packed.get("embed_tokens")
  if cfg.tie_embeddings and embed is not None and PACKED_ATTEND not in embed:
    table = embed["embedding"]
    if matmul.onednn_packed_bytes(table.dtype, table.shape[1], table.shape[0]) is not None:
      packed["embed_tokens"] = {**embed, PACKED_ATTEND: matmul.onednn_pack(table, transpose=True)}
  return packed


def is_packed(params) -> bool:
  """Params in `pack_for_onednn`'s layout."""
  return any(getattr(k, "key", None) in (PACKED_KERNEL, PACKED_ATTEND)
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] for k in path)


def is_fused(params) -> bool:
  """Params in `fuse_projections`' layout."""
  return any(getattr(k, "key", None) in FUSED_PROJECTIONS
             for path, _ in jax.tree_util.tree_flatten_with_path(params)[0] for k in path)


def is_stacked(params) -> bool:
  """Params in `stack_layers`' layout (they run through `scanned_forward`)."""
  return "layers" in params


def stack_layers(params, cfg: ModelConfig) -> dict:
  """Per-layer params (`layers_{i}_...`) -> the scan layout: params["layers"][g][j] holds the
  j-th layer of each repetition of group g of `layer_groups(cfg)`, every leaf stacked over the
  repetitions [reps, ...] (unstacked where reps == 1). Other entries are kept as they are.
  Copies every layer weight once; drop the per-layer params after."""
  if is_stacked(params):
    raise ValueError("params are stacked already")
  prefixes = [f"layers_{i}_" for i in range(cfg.num_layers)]

  def layer(i):
    return {k[len(prefixes[i]):]: v for k, v in params.items() if k.startswith(prefixes[i])}
  out = {k: v for k, v in params.items() if not any(k.startswith(p) for p in prefixes)}
  groups = []
  for start, period, reps in layer_groups(cfg):
    phases = []
    for j in range(period):
      trees = [layer(start + r * period + j) for r in range(reps)]
      phases.append(trees[0] if reps == 1 else jax.tree.map(lambda *xs: jnp.stack(xs), *trees))
    groups.append(tuple(phases))
  out["layers"] = tuple(groups)
  return out


def _hold_packed(tree):
  """A scan group's stacked params -> (the tree without its stacked packed kernels, which the
  scan slices per repetition; those kernels alone, in the same nesting). XLA:CPU copies a
  slice of a stacked operand before a custom call reads it (SmolLM2's f32 first-token step:
  ~37 of 135 traced ms were those copies), so `Dense` reads the held stack in place instead."""
  if not isinstance(tree, collections.abc.Mapping):
    return tree, {}
  kept, held = {}, {}
  for k, v in tree.items():
    if k == PACKED_KERNEL and getattr(v, "ndim", 0) == 2:
      held[k] = v
      continue
    kept[k], h = _hold_packed(v)
    if h:
      held[k] = h
  return kept, held


def _with_held(tree, held, layer):
  """`_hold_packed`'s inverse inside a scan body: each held stack back in its place, with
  `packed_layer` = layer beside it."""
  if not held:
    return tree
  out = dict(tree)
  for k, v in held.items():
    if k == PACKED_KERNEL:
      out[PACKED_KERNEL], out[PACKED_LAYER] = v, layer
    else:
      out[k] = _with_held(tree[k], v, layer)
  return out


def scanned_forward(params, cfg: ModelConfig, tokens, positions, kv, logits_indices=None):
  """`Decoder(cfg).apply` on `stack_layers` params, each group of layers one `lax.scan`: a
  compiled step holds one body per group (one for a Llama, whatever its depth). Same arguments
  and results as `Decoder.__call__`."""
  def bound(tree):
    def part(name, cls, *args, **kw):
      return cls(*args, **kw).bind({"params": tree[name]})
    return part

  def run_layers(x, kv, ropes):
    for g, (start, period, reps) in enumerate(layer_groups(cfg)):
      phases = params["layers"][g]
      if reps == 1:
        for j in range(period):
          i = start + j
          select = logits_indices if i == cfg.num_layers - 1 else None
          x, kv = _layer(cfg, i, bound(phases[j]), x, kv, ropes[rope_key(cfg, i)], select)
        continue

      sliced, held = zip(*map(_hold_packed, phases))

      def body(carry, xs, start=start, period=period, held=held):
        x, kv = carry
        r, trees = xs
        trees = [_with_held(tree, h, r) for tree, h in zip(trees, held)]
        for j in range(period):
          x, kv = _layer(cfg, start + j, bound(trees[j]), x, kv,
                         ropes[rope_key(cfg, start + j)], kv_layer=start + r * period + j)
        return (x, kv), None
      (x, kv), _ = jax.lax.scan(body, (x, kv), (jnp.arange(reps, dtype=jnp.int32), sliced))
    return x, kv

  return _decode(cfg, bound(params), tokens, positions, kv, logits_indices, run_layers)


# Packed products (`pack_for_onednn`) skip a step's padding token rows (`apply`). A bucket pads a
# prompt's tokens by up to a quarter (`batching.token_bucket`), and on the packed path products
# are most of a prompt's step. Off: every row is multiplied (the reference in tests).
PACKED_SKIPS_PADDING = True


def apply(params, cfg: ModelConfig, tokens, positions, kv, logits_indices=None):
  """The model on either layout: per-layer params through `Decoder`, stacked ones through
  `scanned_forward`. With packed params (`pack_for_onednn`) the token rows past the step's real
  ones (`cu_q_lens[-1]`: the bucket's padding) are not multiplied (`matmul.padding_rows`); their
  outputs are no one's (their K/V go to the null page, no logits row reads them)."""
  rows = (matmul.padding_rows(tokens.shape[0], kv.md.cu_q_lens[-1])
          if PACKED_SKIPS_PADDING and isinstance(kv, PagedKV) and is_packed(params)
          else contextlib.nullcontext())
  with rows:
    if is_stacked(params):
      return scanned_forward(params, cfg, tokens, positions, kv, logits_indices)
    return Decoder(cfg).apply({"params": params}, tokens, positions, kv, logits_indices)


def computed_once(fn, *args):
  """fn(*args) as one materialized value that its users read, not recompute.

  XLA:CPU fuses cheap elementwise producers into each consumer, and drops
  `jax.lax.optimization_barrier` before fusing, so RoPE tables shared by 30 layers were
  recomputed inside every layer's rotation, per head (SmolLM2's 4,560-token prefill: ~200 ms of
  sines and cosines, 4% of the step). A conditional is a fusion boundary; both branches are fn,
  so the result is fn(*args) whatever the predicate.
  """
  leaves = jax.tree.leaves(args)
  pred = jnp.any(leaves[0] < 0) if leaves else False
  return jax.lax.cond(pred, fn, fn, *args)


def init_params(cfg: ModelConfig, seed: int = 0):
  """Random parameters (normal(0.02) weights, unit norms) for a config."""
  pool = KVPool.create(num_layers=cfg.num_layers, num_pages=2, page_size=1,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype)
  md = AttentionMetadata(block_tables=jnp.ones((1, 1), jnp.int32), seq_lens=jnp.ones(1, jnp.int32),
                         cu_q_lens=jnp.array([0, 1], jnp.int32), slots=jnp.ones(1, jnp.int32))
  kv = PagedKV(pool, md, impl="xla")
  return Decoder(cfg).init(jax.random.key(seed), jnp.zeros(1, jnp.int32),
                           jnp.zeros(1, jnp.int32), kv)["params"]
