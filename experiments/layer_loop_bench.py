"""Layers as a Python loop or as a `lax.scan` over stacked weights: compile time and step time.

  python -m experiments.layer_loop_bench                       # SmolLM2-135M's MLP, 30 layers
  python -m experiments.layer_loop_bench --rows=1,32 --num_layers=2,30 --dtype=bfloat16

The question behind issue 32's "compile once per layer body": what a scan costs the step. Each
layer here is SmolLM2-135M's gated MLP (fused gate / up [576, 3072], down [1536, 576]) through
`paged_jax.matmul`; nothing else, so a step at one row is bound by reading the weights. Routes:

- unrolled: one weight array per layer, a Python loop (what `model.Decoder` does today);
- scan: weights stacked [num_layers, ...], `jax.lax.scan` over them (XLA slices each layer's
  weights out with a dynamic-slice inside the loop);
- static: weights stacked, a Python loop over static slices `w[i]`.

Prints compile seconds and milliseconds per step (median) with the weights' read rate.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import matmul

ROUTES = ("unrolled", "scan", "static")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  hidden: int = 576
  intermediate: int = 1536
  num_layers: tuple[int, ...] = (2, 30)
  rows: tuple[int, ...] = (1, 32)
  dtype: str = "float32"
  routes: tuple[str, ...] = ROUTES
  rounds: int = 10


def _step(route: str, f: int):
  mm = lambda a, b: matmul.dot_general(a, b, (((1,), (0,)), ((), ())))

  def layer(x, w_in, w_out):
    g = mm(x, w_in)
    gate, up = g[:, :f], g[:, f:]
    return x + mm(gate / (1 + jnp.exp(-gate)) * up, w_out)

  if route == "unrolled":
    def step(x, ws):
      for w_in, w_out in ws:
        x = layer(x, w_in, w_out)
      return x
  elif route == "scan":
    def step(x, ws):
      return jax.lax.scan(lambda x, w: (layer(x, *w), None), x, ws)[0]
  elif route == "static":
    def step(x, ws):
      for i in range(ws[0].shape[0]):
        x = layer(x, ws[0][i], ws[1][i])
      return x
  else:
    raise ValueError(f"route={route!r} is not one of {ROUTES}")
  return step


def run(cfg: LoopConfig) -> dict:
  """{"rows": [{route, num_layers, rows, compile_s, step_s, read_bytes_per_s}, ...]}."""
  dt = jnp.dtype(cfg.dtype)
  rng = np.random.default_rng(0)
  out = []
  for n in cfg.num_layers:
    w_in = rng.normal(size=(n, cfg.hidden, 2 * cfg.intermediate)).astype(np.float32) * 0.02
    w_out = rng.normal(size=(n, cfg.intermediate, cfg.hidden)).astype(np.float32) * 0.02
    stacked = (jnp.asarray(w_in, dt), jnp.asarray(w_out, dt))
    per_layer = [(stacked[0][i], stacked[1][i]) for i in range(n)]
    nbytes = stacked[0].nbytes + stacked[1].nbytes
    for rows in cfg.rows:
      x = jnp.asarray(rng.normal(size=(rows, cfg.hidden)).astype(np.float32), dt)
      for route in cfg.routes:
        ws = per_layer if route == "unrolled" else stacked
        t = time.perf_counter()
        fn = jax.jit(_step(route, cfg.intermediate)).lower(x, ws).compile()
        compile_s = time.perf_counter() - t
        jax.block_until_ready(fn(x, ws))
        times = []
        for _ in range(cfg.rounds):
          t = time.perf_counter()
          jax.block_until_ready(fn(x, ws))
          times.append(time.perf_counter() - t)
        step_s = float(np.median(times))
        out.append(dict(route=route, num_layers=n, rows=rows, compile_s=compile_s,
                        step_s=step_s, read_bytes_per_s=nbytes / step_s))
  return dict(kind="layer_loop_bench", config=dataclasses.asdict(cfg), jax=jax.__version__,
              rows=out)


def format_result(r: dict) -> str:
  lines = [f"layers as a loop or a scan (jax {r['jax']}, {r['config']['dtype']}): compile s, "
           f"ms per step, weights' read rate"]
  for x in r["rows"]:
    lines.append(f"  {x['route']:9s} {x['num_layers']:3d} layers {x['rows']:3d} rows: compile "
                 f"{x['compile_s']:6.2f} s  step {1e3 * x['step_s']:8.2f} ms  "
                 f"{x['read_bytes_per_s'] / 1e9:6.1f} GB/s")
  return "\n".join(lines)


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  print(format_result(run(LoopConfig(
      num_layers=tuple(int(x) for x in f.num_layers), rows=tuple(int(x) for x in f.rows),
      dtype=f.dtype, routes=tuple(f.routes)))))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_list("num_layers", ["2", "30"], "Depths to compile.")
  flags.DEFINE_list("rows", ["1", "32"], "Rows (tokens) per step.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and activations.")
  flags.DEFINE_list("routes", list(ROUTES), "Which layer loops to time.")
  app.run(main)
