"""Compile time against depth: the engine's two programs, layers unrolled or scanned.

  python -m experiments.depth_compile                       # SmolLM2-135M's shape, 2-60 layers
  python -m experiments.depth_compile --num_layers=2,30 --layouts=scan

Issue 32's item 1. For each depth, the model is SmolLM2-135M's layer shape (hidden 576, 9 query
/ 3 KV heads of 64, MLP 1536, vocab 49,152, tied head) with that many layers; each program is
traced, lowered and compiled from shapes alone (no weights are made); the persistent compilation
cache is not enabled here (so nothing is read from disk):

- prefill: `step.sample_step` on one 256-token prompt (the engine's step for prompts);
- decode: `step.multi_step_decode`, 8 rows, 4 steps (the engine's decode round).

Layouts: "unrolled" (per-layer params, `model.Decoder`) and "scan" (`model.stack_layers`,
`model.scanned_forward`). Prints seconds per program and each depth's time over the shallowest.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYOUTS = ("unrolled", "scan")


@dataclasses.dataclass(frozen=True)
class DepthConfig:
  num_layers: tuple[int, ...] = (2, 8, 30, 60)
  layouts: tuple[str, ...] = LAYOUTS
  hidden_size: int = 576
  intermediate_size: int = 1536
  num_q_heads: int = 9
  num_kv_heads: int = 3
  head_dim: int = 64
  vocab_size: int = 49152
  prompt_tokens: int = 256
  decode_rows: int = 8
  steps_per_sync: int = 4
  page_size: int = 16
  num_pages: int = 256


def _model_config(cfg: DepthConfig, num_layers: int):
  from paged_jax.config import ModelConfig
  return ModelConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_layers=num_layers,
                     num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, tie_embeddings=True, max_position=2048)


def _inputs(cfg: DepthConfig, mcfg):
  """Shapes of params (per-layer) and pool; concrete small step inputs."""
  from paged_jax import model, step
  from paged_jax.sampling import SamplingArrays, SamplingParams
  from paged_jax.state import AttentionMetadata, KVPool
  params = jax.eval_shape(lambda: model.init_params(mcfg))
  pool = jax.eval_shape(lambda: KVPool.create(
      num_layers=mcfg.num_layers, num_pages=cfg.num_pages, page_size=cfg.page_size,
      num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim))
  n, ps = cfg.prompt_tokens, cfg.page_size
  width = 64
  table = np.zeros((4, width), np.int32)
  table[0, :n // ps] = np.arange(1, n // ps + 1)
  md = AttentionMetadata(jnp.asarray(table), jnp.asarray([n, 0, 0, 0], jnp.int32),
                         jnp.asarray([0, n, n, n, n], jnp.int32),
                         jnp.asarray(table[0, np.arange(n) // ps] * ps + np.arange(n) % ps),
                         max_q_len=n, num_decode=0)
  batch = step.Batch(jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32), md,
                     jnp.asarray([n - 1, 0, 0, 0], jnp.int32))
  rows = cfg.decode_rows
  state = step.DecodeState(jnp.zeros(rows, jnp.int32), jnp.full(rows, 40, jnp.int32),
                           jnp.ones((rows, width), jnp.int32), jnp.full(rows, 48, jnp.int32))
  sampling = lambda k: SamplingArrays.from_rows([(SamplingParams(), 0, 0, 0)] * k, k)
  return params, pool, batch, sampling(4), state, sampling(rows)


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def run(cfg: DepthConfig) -> dict:
  """{"rows": [{layout, num_layers, program, seconds}], "ratios": {layout/program: deepest /
  shallowest}}."""
  from paged_jax import model, step
  rows = []
  for n in cfg.num_layers:
    mcfg = _model_config(cfg, n)
    params, pool, batch, prefill_sampling, state, decode_sampling = _inputs(cfg, mcfg)
    for layout in cfg.layouts:
      if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
      p = params if layout == "unrolled" else jax.eval_shape(
          lambda x: model.stack_layers(x, mcfg), params)
      kw = dict(cfg=mcfg, impl="xla", greedy_only=True, num_logprobs=0)
      programs = {
          "prefill": lambda: step.sample_step.lower(p, pool, batch, prefill_sampling,
                                                    **kw).compile(),
          "decode": lambda: step.multi_step_decode.lower(
              p, pool, state, decode_sampling, num_steps=cfg.steps_per_sync, **kw).compile()}
      for program, fn in programs.items():
        rows.append(dict(layout=layout, num_layers=n, program=program, seconds=_timed(fn)))
  ratios = {}
  lo, hi = min(cfg.num_layers), max(cfg.num_layers)
  for layout in cfg.layouts:
    for program in ("prefill", "decode"):
      t = {r["num_layers"]: r["seconds"] for r in rows
           if r["layout"] == layout and r["program"] == program}
      ratios[f"{layout}/{program}"] = t[hi] / t[lo]
  return dict(kind="depth_compile", config=dataclasses.asdict(cfg), jax=jax.__version__,
              rows=rows, ratios=ratios)


def format_result(r: dict) -> str:
  depths = r["config"]["num_layers"]
  lines = [f"compile seconds against depth (jax {r['jax']}; SmolLM2-135M layer shape)",
           "  layout    program  " + "".join(f"{n:>8d}L" for n in depths) + "   deepest / shallowest"]
  for layout in r["config"]["layouts"]:
    for program in ("prefill", "decode"):
      t = {x["num_layers"]: x["seconds"] for x in r["rows"]
           if x["layout"] == layout and x["program"] == program}
      lines.append(f"  {layout:9s} {program:8s}" + "".join(f"{t[n]:9.2f}" for n in depths)
                   + f"   {r['ratios'][f'{layout}/{program}']:.2f}x")
  return "\n".join(lines)


def main(argv):
  del argv
  from absl import flags
  from experiments import output
  f = flags.FLAGS
  r = run(DepthConfig(num_layers=tuple(int(x) for x in f.num_layers),
                      layouts=tuple(f.layouts)))
  print(format_result(r))
  output.record(r, f.results_dir, "depth_compile")


if __name__ == "__main__":
  from absl import app, flags
  from experiments import output
  flags.DEFINE_list("num_layers", ["2", "8", "30", "60"], "Depths to compile.")
  flags.DEFINE_list("layouts", list(LAYOUTS), "unrolled and / or scan.")
  flags.DEFINE_string("results_dir", output.RESULTS, "Where the JSONL goes ('' for none).")
  app.run(main)
