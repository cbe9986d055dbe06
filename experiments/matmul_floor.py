"""The matmul floor: how fast this machine multiplies a model's matrices, through each route.

  python -m experiments.matmul_floor                       # SmolLM2-135M's shapes
  python -m experiments.matmul_floor --hidden=1024 --intermediate=2752 --vocab=32000

For each shape a step multiplies (prefill's MLP and projections over --tokens rows, decode's over
--rows rows, the LM head, batch-1 decode) it times, best of --rounds interleaved rounds:

  f32           jnp.dot on f32 operands (XLA's dot);
  bf16_plain    jnp.dot on bf16 operands, bf16 result (what a bf16 model got before
                `paged_jax.matmul`);
  bf16_ours     `paged_jax.matmul.dot_general` (bf16 operands, f32 accumulation and result, cast
                back; a single row padded to two);
  mkl_f32 / mkl_bf16       `paged_jax.matmul.mkl_matmul` (Intel MKL through XLA's FFI, f32
                result), when the `mkl` extra is installed (--nomkl: not timed);
  onednn_f32 / onednn_bf16 `paged_jax.matmul.onednn_matmul` (oneDNN through XLA's FFI on the
                plain weights, f32 result, every row count), with the `onednn` extra
                (--noonednn: not timed);
  onednn_packed_f32 / onednn_packed_bf16   `paged_jax.matmul.onednn_packed_matmul` on weights
                packed by `onednn_pack` beforehand (oneDNN's call on them at every row count);
  packed_dot_f32  `paged_jax.matmul.onednn_packed_dot` on the same packed f32 weights: what a
                `model.Dense` of an engine with matmul="onednn" runs (one row of at most
                PACKED_ROW_ON_XLA_MAX_COLUMNS columns on XLA's batched dot over the packed column
                blocks, oneDNN's call otherwise);
  numpy_f32     np.matmul (numpy's bundled OpenBLAS, on its own threads: all cores);
  torch_f32 / torch_bf16   torch.matmul at the same threads, when torch is installed (oneDNN).

and prints GFLOP/s and the weight-read rate (GB/s of the [k, n] operand), with the machine's
read bandwidth (an XLA sum over 512 MiB; with torch also torch's sum on --threads threads, which
XLA's single-threaded reduce does not reach) and the rate of an n x n x n f32 matmul beside them.
A batch-1 product is timed over enough distinct weights to fill --cold_mib (one call reads each
once), so a weight that fits the L3 cache is read from memory, as a decode step reads it: its
GB/s is the one-user floor's rate, not the cache's.
Appends one JSONL record with the JAX version and the CPU's maker and model, so runs under
jaxlib 0.10 / 0.11 / 0.12, and on Intel and AMD machines, compare (MKL's rate depends on the
maker: `paged_jax.matmul.mkl_slow_reason`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import output
from paged_jax import matmul


@dataclasses.dataclass(frozen=True)
class FloorConfig:
  hidden: int = 576          # SmolLM2-135M
  intermediate: int = 1536
  kv: int = 192              # num_kv_heads * head_dim
  vocab: int = 49_152
  tokens: int = 4560         # the serve benchmark's prefill step
  rows: int = 32             # its decode batch
  rounds: int = 7
  threads: int = 2
  mkl: bool = True           # the mkl_* routes, where MKL can run
  onednn: bool = True        # the onednn_* routes, where oneDNN can run
  read_mib: int = 512        # the read-bandwidth probe's array
  cold_mib: float = 256      # batch-1 shapes: distinct weights of this many MiB per timed call


def shapes(cfg: FloorConfig) -> list[tuple[str, int, int, int]]:
  """(name, m, k, n) of the products a step runs."""
  h, i = cfg.hidden, cfg.intermediate
  return [("prefill gate/up", cfg.tokens, h, i), ("prefill down", cfg.tokens, i, h),
          ("prefill q/o", cfg.tokens, h, h), ("prefill k/v", cfg.tokens, h, cfg.kv),
          ("decode gate/up", cfg.rows, h, i), ("decode down", cfg.rows, i, h),
          ("decode q/o", cfg.rows, h, h), ("decode lm head", cfg.rows, h, cfg.vocab),
          ("batch-1 gate/up", 1, h, i), ("batch-1 lm head", 1, h, cfg.vocab)]


MAX_COPIES = 256   # bounds the unrolled program of a tiny shape's batch-1 call


def copies(cfg: FloorConfig, m: int, k: int, n: int) -> int:
  """Distinct [k, n] f32 weights a timed call of shape (m, k, n) multiplies: enough to fill
  cfg.cold_mib at one row (out of the cache, as a decode step's 30 layers are; at most
  MAX_COPIES), else one."""
  if m != 1:
    return 1
  return min(MAX_COPIES, max(1, -(-int(cfg.cold_mib * (1 << 20)) // (4 * k * n))))


def _best_of(call, rounds):
  """Seconds of the fastest of `rounds` calls of `call()`, after one untimed call."""
  call()
  best = float("inf")
  for _ in range(rounds):
    t = time.perf_counter()
    call()
    best = min(best, time.perf_counter() - t)
  return best


def _time(fn, args, rounds):
  return _best_of(lambda: jax.block_until_ready(fn(*args)), rounds)


def read_bandwidth(rounds: int = 5, mib: int = 512) -> float:
  """Bytes per second an XLA sum reads from an f32 array of `mib` MiB (the read floor)."""
  x = jnp.ones((mib << 18,), jnp.float32)
  return x.nbytes / _time(jax.jit(jnp.sum), (x,), rounds)


def torch_read_bandwidth(threads: int, rounds: int = 5, mib: int = 512) -> float | None:
  """Bytes per second torch's sum reads from an f32 array of `mib` MiB on `threads` threads
  (None without torch): the read floor when every core streams."""
  try:
    import torch
  except ImportError:
    return None
  torch.set_num_threads(threads)
  x = torch.ones(mib << 18, dtype=torch.float32)
  return x.numel() * 4 / _best_of(x.sum, rounds)


def _numpy_routes():
  def run(x, ws, rounds):
    return _best_of(lambda: [x @ w for w in ws], rounds)
  return {"numpy_f32": run}


def _torch_routes(threads: int):
  try:
    import torch
  except ImportError:
    return {}
  torch.set_num_threads(threads)

  def route(dtype):
    def run(x, ws, rounds):
      a, bs = torch.from_numpy(x).to(dtype), [torch.from_numpy(w).to(dtype) for w in ws]
      return _best_of(lambda: [torch.matmul(a, b) for b in bs], rounds)
    return run
  return {"torch_f32": route(torch.float32), "torch_bf16": route(torch.bfloat16)}


def run(cfg: FloorConfig) -> dict:
  dot = lambda x, w: jnp.dot(x, w)                                      # noqa: E731
  ours = lambda x, w: matmul.dot_general(x, w, (((1,), (0,)), ((), ())))  # noqa: E731
  each = lambda f: jax.jit(lambda x, ws: [f(x, w) for w in ws])      # noqa: E731
  xla = {"f32": (each(dot), jnp.float32), "bf16_plain": (each(dot), jnp.bfloat16),
         "bf16_ours": (each(ours), jnp.bfloat16)}
  if cfg.mkl and matmul.mkl_unavailable_reason() is None:
    mkl = each(matmul.mkl_matmul)
    xla.update({"mkl_f32": (mkl, jnp.float32), "mkl_bf16": (mkl, jnp.bfloat16)})
  packed = {}   # route: (product, dtype), of the routes whose weights are packed first
  if cfg.onednn and matmul.unavailable_reason("onednn") is None:
    onednn = each(matmul.onednn_matmul)
    xla.update({"onednn_f32": (onednn, jnp.float32), "onednn_bf16": (onednn, jnp.bfloat16)})
    packed = {"onednn_packed_f32": (matmul.onednn_packed_matmul, jnp.float32),
              "onednn_packed_bf16": (matmul.onednn_packed_matmul, jnp.bfloat16),
              "packed_dot_f32": (matmul.onednn_packed_dot, jnp.float32)}
  peers = {**_numpy_routes(), **_torch_routes(cfg.threads)}
  rows = []
  rng = np.random.default_rng(0)
  for name, m, k, n in shapes(cfg):
    c = copies(cfg, m, k, n)
    x = rng.normal(size=(m, k)).astype(np.float32)
    ws = [rng.normal(size=(k, n)).astype(np.float32) for _ in range(c)]
    row = {"shape": name, "m": m, "k": k, "n": n, "copies": c}
    for route, (fn, dt) in xla.items():
      args = (jnp.asarray(x, dt), [jnp.asarray(w, dt) for w in ws])
      row[route] = _time(fn, args, cfg.rounds) / c
      del args
    for route, (product, dt) in packed.items():
      fn = jax.jit(lambda x, ps, n=n, product=product: [product(x, p, n) for p in ps])
      args = (jnp.asarray(x, dt), [matmul.onednn_pack(jnp.asarray(w, dt)) for w in ws])
      row[route] = _time(fn, args, cfg.rounds) / c
      del args
    for route, fn in peers.items():
      row[route] = fn(x, ws, cfg.rounds) / c
    rows.append(row)
  n = min(2048, 8 * cfg.hidden)
  square = jnp.ones((n, n), jnp.float32)
  return {"jax": jax.__version__, "cpu_vendor": matmul.cpu_vendor(),
          "cpu_model": matmul.cpu_info("model name"), "config": dataclasses.asdict(cfg), "rows": rows,
          "read_bandwidth": read_bandwidth(mib=cfg.read_mib),
          "torch_read_bandwidth": torch_read_bandwidth(cfg.threads, mib=cfg.read_mib),
          "square_f32_flops": 2 * n ** 3 / _time(jax.jit(dot), (square, square), cfg.rounds)}


def format_result(r: dict) -> str:
  routes = [k for k in r["rows"][0] if k not in ("shape", "m", "k", "n", "copies")]
  torch_read = r.get("torch_read_bandwidth")
  lines = [f"jax {r['jax']} on {r.get('cpu_model') or r.get('cpu_vendor') or 'an unknown CPU'}"
           f": read bandwidth {r['read_bandwidth'] / 1e9:.1f} GB/s (XLA)"
           + (f", {torch_read / 1e9:.1f} GB/s (torch, {r['config']['threads']} threads)"
              if torch_read else "") + ", "
           f"f32 {min(2048, 8 * r['config']['hidden'])}^3 matmul "
           f"{r['square_f32_flops'] / 1e9:.0f} GFLOP/s",
           f"{'shape':18s} {'m x k x n':>18s}  " + "  ".join(f"{k:>22s}" for k in routes)]
  for row in r["rows"]:
    m, k, n = row["m"], row["k"], row["n"]
    cells = []
    for route in routes:
      t = row[route]
      item = 4 if route.endswith("f32") else 2
      cells.append(f"{t * 1e3:7.3f}ms {2 * m * k * n / t / 1e9:5.0f}GF {k * n * item / t / 1e9:4.1f}GB/s")
    lines.append(f"{row['shape']:18s} {f'{m}x{k}x{n}':>18s}  " + "  ".join(f"{c:>22s}" for c in cells)
                 + (f"  (over {row['copies']} weights)" if row.get("copies", 1) > 1 else ""))
  return "\n".join(lines)


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  r = run(FloorConfig(hidden=f.hidden, intermediate=f.intermediate, kv=f.kv, vocab=f.vocab,
                      tokens=f.tokens, rows=f.rows, rounds=f.rounds, mkl=f.mkl, onednn=f.onednn,
                      cold_mib=f.cold_mib))
  print(format_result(r))
  if f.out:
    output.append_jsonl(r, f.out)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_integer("hidden", FloorConfig.hidden, "Hidden size.")
  flags.DEFINE_integer("intermediate", FloorConfig.intermediate, "MLP intermediate size.")
  flags.DEFINE_integer("kv", FloorConfig.kv, "KV heads x head_dim (k/v projections).")
  flags.DEFINE_integer("vocab", FloorConfig.vocab, "Vocabulary (the LM head).")
  flags.DEFINE_integer("tokens", FloorConfig.tokens, "Prefill rows.")
  flags.DEFINE_integer("rows", FloorConfig.rows, "Decode rows.")
  flags.DEFINE_integer("rounds", FloorConfig.rounds, "Timed rounds (best is reported).")
  flags.DEFINE_bool("mkl", FloorConfig.mkl, "Time the mkl_* routes where MKL can run.")
  flags.DEFINE_bool("onednn", FloorConfig.onednn, "Time the onednn_* routes where it can run.")
  flags.DEFINE_float("cold_mib", FloorConfig.cold_mib, "Batch-1 shapes: MiB of distinct "
                     "weights per timed call (read from memory, not the cache).")
  flags.DEFINE_string("out", "experiments/results/matmul_floor.jsonl", "JSONL to append to.")
  app.run(main)
