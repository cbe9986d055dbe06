"""One user's decode round, timed on the device: rows bucket and attention chunk side by side.

  python -m experiments.decode_round_bench --model_dir=/tmp/sb/smol_hf     # SmolLM2-135M
  python -m experiments.decode_round_bench --model_dir=D --dtype=bfloat16 --scan_layers

One request (a 221-token prompt) is prefilled through the engine; then its k-step decode round
(`step.multi_step_decode`, the engine's own arrays) is compiled and timed (median of --rounds
calls) for each variant:

- rows: the round padded to this many rows (the engine pads one sequence to
  `batching.decode_bucket(1)` = 1 row; 8 was the floor before issue 32);
- items_per_chunk: decode attention's work items per loop iteration (the default follows the
  rows, `attention.decode_items_per_chunk`; 64 was the default before issue 32; the XLA path's);
- matmul: how the model multiplies (`ModelConfig.matmul`: "xla", or "mkl" / "onednn" with their
  extras; "onednn" on weights packed by `model.pack_for_onednn`, as its engine runs them).

--impl picks decode attention's path for every variant ("xla", the default here; "cpu": the C++
kernel the engine takes on a CPU).

Prints milliseconds per decode step (one token) for each (rows, items_per_chunk).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

import jax
import numpy as np

DEFAULT_CHUNK = 0   # items_per_chunk 0: the default for the rows


@dataclasses.dataclass(frozen=True)
class RoundConfig:
  model_dir: str | None = None   # None: the embedded model
  dtype: str = "float32"
  prompt_tokens: int = 221
  steps_per_sync: int = 16
  rows: tuple[int, ...] = (1, 8)
  items_per_chunk: tuple[int, ...] = (DEFAULT_CHUNK, 64)
  scan_layers: bool = False
  rounds: int = 8
  matmul: tuple[str, ...] = ("xla",)
  impl: str = "xla"


def run(cfg: RoundConfig) -> dict:
  """{"rows": [{rows, items_per_chunk, matmul, ms_per_step}], ...}."""
  from paged_jax import attention, checkpoint, embedded, model, step
  from paged_jax.engine import Engine
  from paged_jax.host import batching
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingArrays, SamplingParams
  params, mcfg, _ = checkpoint.load_checkpoint(cfg.model_dir or embedded.EMBEDDED_MODEL_DIR,
                                               cfg.dtype)
  engine = Engine(params, mcfg, scheduler=SchedulerConfig(steps_per_sync=cfg.steps_per_sync),
                  validate_tables=False, scan_layers=cfg.scan_layers)
  prompt = [int(t) for t in np.random.default_rng(0).integers(3, mcfg.vocab_size,
                                                              cfg.prompt_tokens)]
  engine.add_request(prompt, SamplingParams(max_tokens=cfg.steps_per_sync + 2, ignore_eos=True))
  engine.step()   # the prefill
  plan = engine.scheduler.schedule()
  if plan.num_steps != cfg.steps_per_sync or len(plan.rows) != 1:
    raise RuntimeError(f"expected a {cfg.steps_per_sync}-step round of one row, got {plan}")
  one = batching.build_decode_round(plan, engine.bm, engine.max_pages_per_seq)
  out = []
  real = attention.decode_attention_xla

  @functools.cache
  def packed_params(backend):   # what an Engine with that backend runs (it packs for oneDNN)
    if backend == "onednn":
      return model.pack_for_onednn(engine.params, dataclasses.replace(mcfg, matmul=backend))
    return engine.params

  try:
    for rows in cfg.rows:
      pad = rows - len(one["tokens"])
      if pad < 0:
        raise ValueError(f"rows={rows} is below the round's {len(one['tokens'])} rows")
      grow = lambda x: np.concatenate([x, np.zeros((pad,) + x.shape[1:], x.dtype)])
      state = step.DecodeState(*(jax.device_put(grow(one[k])) for k in
                                 ("tokens", "positions", "block_tables", "write_limit")))
      sampling = SamplingArrays.from_rows(batching.sampling_rows(plan), rows)
      for chunk, backend in itertools.product(cfg.items_per_chunk, cfg.matmul):
        params = packed_params(backend)
        attention.decode_attention_xla = (real if chunk == DEFAULT_CHUNK else
                                          functools.partial(real, items_per_chunk=chunk))
        fn = jax.jit(functools.partial(step.multi_step_decode.__wrapped__,
                                       cfg=dataclasses.replace(mcfg, matmul=backend),
                                       num_steps=plan.num_steps, impl=cfg.impl, greedy_only=True),
                     donate_argnums=(1,))
        pool = engine.pool
        res, pool = fn(params, pool, state, sampling)
        jax.block_until_ready(res)
        times = []
        for _ in range(cfg.rounds):
          t = time.perf_counter()
          res, pool = fn(params, pool, state, sampling)
          jax.block_until_ready(res)
          times.append(time.perf_counter() - t)
        engine.pool = pool
        out.append(dict(rows=rows, items_per_chunk=chunk or
                        attention.decode_items_per_chunk(rows),
                        default_chunk=chunk == DEFAULT_CHUNK, matmul=backend,
                        ms_per_step=1e3 * float(np.median(times)) / plan.num_steps))
  finally:
    attention.decode_attention_xla = real
  return dict(kind="decode_round_bench", config=dataclasses.asdict(cfg), jax=jax.__version__,
              rows=out)


def format_result(r: dict) -> str:
  c = r["config"]
  lines = [f"one user's decode round ({c['model_dir'] or 'embedded'}, {c['dtype']}, jax "
           f"{r['jax']}{', layers as a scan' if c['scan_layers'] else ''}, attention impl "
           f"{c.get('impl', 'xla')}): ms per decode step"]
  for x in r["rows"]:
    lines.append(f"  rows {x['rows']:3d}  items_per_chunk {x['items_per_chunk']:3d}"
                 f"{' (default)' if x['default_chunk'] else '          '}  matmul "
                 f"{x.get('matmul', 'xla'):3s}  {x['ms_per_step']:8.2f}")
  return "\n".join(lines)


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  print(format_result(run(RoundConfig(
      model_dir=f.model_dir, dtype=f.dtype, rows=tuple(int(x) for x in f.rows),
      items_per_chunk=tuple(int(x) for x in f.items_per_chunk), scan_layers=f.scan_layers,
      matmul=tuple(f.matmul), impl=f.impl))))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("model_dir", None, "A checkpoint directory or GGUF file (default: the "
                      "embedded model).")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and KV pool dtype.")
  flags.DEFINE_list("rows", ["1", "8"], "Rows the round is padded to.")
  flags.DEFINE_list("items_per_chunk", ["0", "64"], "Decode attention chunk (0: the default).")
  flags.DEFINE_bool("scan_layers", False, "The layers as a lax.scan.")
  flags.DEFINE_list("matmul", ["xla"], "Matmul backends to time (paged_jax.matmul.BACKENDS).")
  flags.DEFINE_enum("impl", "xla", ["xla", "cpu", "auto"], "Decode attention's path.")
  app.run(main)
