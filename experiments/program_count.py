"""How many programs a realistic serve run compiles (issue 32, item 2).

  python -m experiments.program_count                          # the embedded model, run for real
  python -m experiments.program_count --shapes=PATH.gguf       # a model's shapes, host side only

Real run: the default serve workload (ShareGPT-like, 64 requests at once) on the embedded model,
greedy then sampled (temperature 0.8) in one process; the programs are jit's own count for the
two device steps (`step.sample_step._cache_size()`, `multi_step_decode`), the same count at any
commit. --shapes: the same burst on a checkpoint's config with `testing.FakeSteps` (no model:
the engine's step keys, `Engine.programs`), once on the XLA path (one table width) and once on
the kernel's (width buckets), beside what the default limits can reach
(`batching.reachable_programs`). Stdout.
"""

from __future__ import annotations

import time

from absl import app, flags

FLAGS = flags.FLAGS


def real_run() -> dict:
  from paged_jax import serve, step
  model = serve.load_model(serve.ServeConfig())
  t = time.perf_counter()
  for temperature in (0.0, 0.8):
    serve.run(serve.ServeConfig(temperature=temperature, progress=False), model)
  return {"sample_step": step.sample_step._cache_size(),
          "multi_step_decode": step.multi_step_decode._cache_size(),
          "seconds": time.perf_counter() - t}


def shapes_run(path: str, num_requests: int = 64, seed: int = 0) -> list[dict]:
  import numpy as np
  from paged_jax import checkpoint, testing, workloads
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host import batching
  from paged_jax.sampling import SamplingParams
  cfg = checkpoint.load_config(path)
  rows = []
  for impl in ("xla", "interpret"):
    rng = np.random.default_rng(seed)
    lens_in, lens_out = workloads.sample_lengths(rng, "sharegpt", num_requests,
                                                 max_total=cfg.max_position)
    engine = Engine(None, cfg, cache=CacheConfig(page_size=16, num_pages=8192), impl=impl,
                    steps=testing.FakeSteps().functions())
    for n, o in zip(lens_in, lens_out):
      engine.add_request(rng.integers(0, cfg.vocab_size, int(n)).tolist(),
                         SamplingParams(max_tokens=int(o), ignore_eos=True))
    while engine.has_unfinished():
      engine.step()
    keys = set(engine.programs)
    rows.append({"impl": impl, "programs": len(keys),
                 "rounds": sum(k.kind == "round" for k in keys),
                 "widths": sorted({k.width for k in keys}),
                 "reachable": len(batching.reachable_programs(engine.program_limits))})
  return rows


def main(argv):
  del argv
  if FLAGS.shapes:
    for r in shapes_run(FLAGS.shapes):
      print(f"{r['impl']}: {r['programs']} programs ({r['rounds']} decode rounds), table widths "
            f"{r['widths']}; reachable at the default limits: {r['reachable']}")
  else:
    r = real_run()
    print(f"sample_step {r['sample_step']} programs, multi_step_decode "
          f"{r['multi_step_decode']}; {r['seconds']:.1f} s for both runs, compiling included")


if __name__ == "__main__":
  flags.DEFINE_string("shapes", None, "A checkpoint whose config to count on (host side only).")
  app.run(main)
