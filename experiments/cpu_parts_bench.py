"""The CPU measurements behind issue 16's speed-ups, each against its alternative in one run.

  python -m experiments.cpu_parts_bench              # the large serve benchmark's shapes
  python -m experiments.cpu_parts_bench --tokens=912 --hidden=256 --intermediate=688

Prints, best of `--rounds` interleaved rounds:
  mlp        one SwiGLU MLP over a prefill's tokens, in one piece and in the model's token chunks
             (`model.MLP_CHUNK_TOKENS`), with GFLOP/s;
  weights    8 layers of MLP on a decode batch ([batch, hidden] rows): the rate weights are read
             at, the floor of a decode step's matmuls;
  argmax     `jnp.argmax` against `sampling.argmax` on f32[batch, vocab] logits;
  decode     decode attention's block work after the gather (scores, softmax summary, P V) on
             `items` gathered key blocks, in the pool's page layout ([items, tokens, kv heads,
             d]: batched dots, what `attention.decode_attention_xla` runs today) against
             multiply-reduces on head-major blocks, keys d-major ([items, kv heads, d, tokens])
             and values token-major ([items, kv heads, tokens, d]): a layout the pool would
             have to store, since a transpose after the gather costs what it saves. Then the
             same two with the gather inside the timing (each item's `block_tokens /
             page_size` pages taken from a pool of either layout by a shuffled page list), as
             the real path runs them: XLA fuses the gather into the multiply-reduces, and most
             of the head-major gain goes.
  SmolLM2-135M's decode: --items=192 --kv_heads=3 --group=3 --block_tokens=32 --head_dim=64.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from paged_jax import model, sampling
from pallas_kernels.paged_attention import merge


@dataclasses.dataclass(frozen=True)
class PartsConfig:
  tokens: int = 4560          # the serve benchmark's prefill step (32 prompts, 16-256 tokens)
  batch: int = 32             # decode rows
  hidden: int = 1024
  intermediate: int = 2752
  layers: int = 8
  vocab: int = 32_000
  items: int = 192            # decode work items (row, key block) of one layer
  kv_heads: int = 4
  group: int = 4              # query heads per KV head
  block_tokens: int = 32      # keys per work item (`attention.DECODE_BLOCK_TOKENS`)
  page_size: int = 16         # tokens per page of the gathered variants (divides block_tokens)
  head_dim: int = 64
  rounds: int = 5


DECODE_PARTS = ("decode page layout", "decode head-major", "decode page layout, gathered",
                "decode head-major, gathered")


def _best(fns: dict, args: dict, rounds: int) -> dict:
  """name -> best seconds of fns[name](*args[name]), rounds interleaved (after one warm-up call)."""
  jitted = {k: jax.jit(f) for k, f in fns.items()}
  for k, f in jitted.items():
    jax.block_until_ready(f(*args[k]))
  best = {k: float("inf") for k in fns}
  for _ in range(rounds):
    for k, f in jitted.items():
      t = time.perf_counter()
      jax.block_until_ready(f(*args[k]))
      best[k] = min(best[k], time.perf_counter() - t)
  return best


def _mlp(x, wg, wu, wd):
  g = x @ wg
  return (model.activation("silu", g) * (x @ wu)) @ wd


def _decode_page_layout(q, k, v):
  """q f32[C, K, G, D], k / v f32[C, T, K, D] (the pool's page layout) -> u f32[C, K, G, D]."""
  s = jnp.einsum("ckgd,ctkd->ckgt", q, k, precision=jax.lax.Precision.HIGHEST)
  return merge.block_summary(s, v, "ckgt,ctkd->ckgd").u


def _decode_head_major(q, kt, vh):
  """The same on kt f32[C, K, D, T] and vh f32[C, K, T, D]: each product a multiply-reduce over
  a non-minor axis, vectorized along the minor one (tokens for scores, d for P V)."""
  s = jnp.sum(q[..., None] * kt[:, :, None], axis=3)                  # [C, K, G, T]
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - m[..., None])
  return jnp.sum(p[..., None] * vh[:, :, None], axis=3)               # [C, K, G, D]


def _decode_page_layout_gathered(q, k_pool, v_pool, pages):
  """The page layout's block work on blocks gathered from f32[P, page, K, D] pools by
  pages i32[C, pages per block]."""
  c, kh, _, d = q.shape
  shape = (c, -1, kh, d)
  return _decode_page_layout(q, k_pool[pages].reshape(shape), v_pool[pages].reshape(shape))


def _decode_head_major_gathered(q, kt_pool, vh_pool, pages):
  """The head-major block work on blocks gathered from kt_pool f32[P, K, D, page] and vh_pool
  f32[P, K, page, D]: a block's pages stay an axis of their own (merging them with the page's
  tokens would be the transpose this layout exists to avoid)."""
  kt, vh = kt_pool[pages], vh_pool[pages]                            # [C, p, K, D, S], [C, p, K, S, D]
  s = jnp.sum(q[:, None, :, :, :, None] * kt[:, :, :, None], axis=4)  # [C, p, K, G, S]
  m = jnp.max(s, axis=(1, 4))
  p = jnp.exp(s - m[:, None, :, :, None])
  return jnp.sum(p[..., None] * vh[:, :, :, None], axis=(1, 4))        # [C, K, G, D]


def run(cfg: PartsConfig) -> dict:
  keys = jax.random.split(jax.random.key(0), 3 * cfg.layers + 2)
  h, i = cfg.hidden, cfg.intermediate
  w = [(jax.random.normal(keys[3 * l], (h, i)) * 0.02, jax.random.normal(keys[3 * l + 1], (h, i)) * 0.02,
        jax.random.normal(keys[3 * l + 2], (i, h)) * 0.02) for l in range(cfg.layers)]
  x = jax.random.normal(keys[-2], (cfg.tokens, h))
  chunks = model.token_chunks(cfg.tokens, model.MLP_CHUNK_TOKENS)

  def chunked(x, *wts):
    return jnp.concatenate([_mlp(x[s:e], *wts) for s, e in chunks], axis=0)

  def decode_layers(x, wts):
    for wg, wu, wd in wts:
      x = x + _mlp(x, wg, wu, wd)
    return x

  logits = jax.random.normal(keys[-1], (cfg.batch, cfg.vocab))
  c, kh, g, t, d = cfg.items, cfg.kv_heads, cfg.group, cfg.block_tokens, cfg.head_dim
  dk = jax.random.split(keys[-1], 3)
  q = jax.random.normal(dk[0], (c, kh, g, d)) * d ** -0.5
  k, v = (jax.random.normal(key, (c, t, kh, d)) for key in dk[1:])
  kt, vh = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)   # made outside the timing
  if t % cfg.page_size:
    raise ValueError(f"page_size={cfg.page_size} must divide block_tokens={t}")
  ppb, ps = t // cfg.page_size, cfg.page_size
  # The same blocks as pools: item i's pages are pages[i], a shuffle of 1..c*ppb (0 unused).
  pages = 1 + jax.random.permutation(dk[0], c * ppb).reshape(c, ppb).astype(jnp.int32)
  def pool(x):   # [C, T, K, D] -> [1 + C * ppb, page, K, D], page pages[i, j] = x[i, j-th page]
    x = x.reshape(c * ppb, ps, kh, d)
    return jnp.zeros((1 + c * ppb, ps, kh, d), x.dtype).at[pages.reshape(-1)].set(x)
  k_pool, v_pool = pool(k), pool(v)
  kt_pool, vh_pool = k_pool.transpose(0, 2, 3, 1), v_pool.transpose(0, 2, 1, 3)
  fns = {"mlp whole": _mlp, "mlp chunks": chunked, "weights": decode_layers,
         "jnp.argmax": lambda l: jnp.argmax(l, axis=-1), "sampling.argmax": sampling.argmax,
         "decode page layout": _decode_page_layout, "decode head-major": _decode_head_major,
         "decode page layout, gathered": _decode_page_layout_gathered,
         "decode head-major, gathered": _decode_head_major_gathered}
  args = {"mlp whole": (x,) + w[0], "mlp chunks": (x,) + w[0],
          "weights": (x[:cfg.batch], w), "jnp.argmax": (logits,), "sampling.argmax": (logits,),
          "decode page layout": (q, k, v), "decode head-major": (q, kt, vh),
          "decode page layout, gathered": (q, k_pool, v_pool, pages),
          "decode head-major, gathered": (q, kt_pool, vh_pool, pages)}
  best = _best(fns, args, cfg.rounds)
  same = [jax.jit(fns[n])(*args[n]) for n in DECODE_PARTS]
  mlp_flops = 6 * cfg.tokens * h * i
  return dict(config=dataclasses.asdict(cfg), chunks=len(chunks), seconds=best,
              mlp_gflops={k: mlp_flops / best[k] / 1e9 for k in ("mlp whole", "mlp chunks")},
              weight_gb_per_s=cfg.layers * 3 * h * i * 4 / best["weights"] / 1e9,
              decode_max_abs_diff=max(float(jnp.abs(o - same[0]).max()) for o in same[1:]),
              decode_kv_gb_per_s={k_: 2 * c * t * kh * d * 4 / best[k_] / 1e9
                                  for k_ in DECODE_PARTS})


def format_result(r: dict) -> str:
  s, c = r["seconds"], r["config"]
  return "\n".join([
      f"mlp     [{c['tokens']}, {c['hidden']}] x {c['intermediate']}: whole "
      f"{s['mlp whole'] * 1e3:.1f} ms ({r['mlp_gflops']['mlp whole']:.0f} GFLOP/s), "
      f"{r['chunks']} chunks {s['mlp chunks'] * 1e3:.1f} ms ({r['mlp_gflops']['mlp chunks']:.0f} GFLOP/s)",
      f"weights {c['layers']} MLP layers on [{c['batch']}, {c['hidden']}]: {s['weights'] * 1e3:.2f} ms "
      f"({r['weight_gb_per_s']:.1f} GB/s of weights)",
      f"argmax  f32[{c['batch']}, {c['vocab']}]: jnp.argmax {s['jnp.argmax'] * 1e3:.3f} ms, "
      f"sampling.argmax {s['sampling.argmax'] * 1e3:.3f} ms",
      f"decode  {c['items']} items x {c['block_tokens']} keys, {c['kv_heads']} kv heads x "
      f"{c['group']}, d {c['head_dim']}, page {c['page_size']} (GB/s of K/V):"]
      + [f"        {n:<28} {s[n] * 1e3:.3f} ms ({r['decode_kv_gb_per_s'][n]:.1f} GB/s)"
         for n in DECODE_PARTS]
      + [f"        max |diff| {r['decode_max_abs_diff']:.1e}"])


def main(argv):
  del argv
  f = flags.FLAGS
  print(format_result(run(PartsConfig(tokens=f.tokens, batch=f.batch, hidden=f.hidden,
                                      intermediate=f.intermediate, layers=f.layers,
                                      vocab=f.vocab, items=f.items, kv_heads=f.kv_heads,
                                      group=f.group, block_tokens=f.block_tokens,
                                      page_size=f.page_size, head_dim=f.head_dim,
                                      rounds=f.rounds))))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_integer("tokens", PartsConfig.tokens, "Prefill tokens of the MLP comparison.")
  flags.DEFINE_integer("batch", PartsConfig.batch, "Decode rows.")
  flags.DEFINE_integer("hidden", PartsConfig.hidden, "Hidden size.")
  flags.DEFINE_integer("intermediate", PartsConfig.intermediate, "MLP intermediate size.")
  flags.DEFINE_integer("layers", PartsConfig.layers, "Layers of the decode weights pass.")
  flags.DEFINE_integer("vocab", PartsConfig.vocab, "Vocabulary of the argmax comparison.")
  flags.DEFINE_integer("items", PartsConfig.items, "Decode attention work items (one layer).")
  flags.DEFINE_integer("kv_heads", PartsConfig.kv_heads, "KV heads.")
  flags.DEFINE_integer("group", PartsConfig.group, "Query heads per KV head.")
  flags.DEFINE_integer("block_tokens", PartsConfig.block_tokens, "Keys per work item.")
  flags.DEFINE_integer("page_size", PartsConfig.page_size,
                       "Tokens per page of the gathered decode variants.")
  flags.DEFINE_integer("head_dim", PartsConfig.head_dim, "Head dimension.")
  flags.DEFINE_integer("rounds", PartsConfig.rounds, "Interleaved rounds (best is reported).")
  app.run(main)
