"""Process start to first token, by phase, cold and warm (issue 32, items 2 and 4).

  python -m experiments.restart_bench --model=PATH.gguf --scan_layers
  python -m experiments.restart_bench --model=embedded --runs=3

Each run is a fresh Python process (`--child`) that imports the framework, loads the model
(`serve.load_model`: a GGUF file from its converted-model cache once warm), builds the engine
(`serve.make_engine`, with a program store), and serves one chat-style prompt, timing each phase
and the first token from the process's start. The first run starts with empty caches (a fresh
converted-model cache and program store in a temporary directory: cold); the later runs reuse
them (warm). With --warmup=one_user the engine also warms up before the request (compiled cold,
loaded warm). Results: stdout and experiments/results/restart_bench.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

T0 = time.perf_counter()   # before the framework's imports: the child's phases start here

from absl import app, flags   # noqa: E402

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class RestartConfig:
  model: str = "embedded"      # a GGUF file or Hugging Face directory, or the embedded model
  scan_layers: bool = False
  warmup: str = "off"          # serve's --warmup for every run ("off" or "one_user")
  runs: int = 2                # the first cold, the rest warm
  prompt: str = "What is the capital of France?"
  max_tokens: int = 8
  results_dir: str | None = "experiments/results"


def child(cfg: RestartConfig) -> dict:
  """One process's phases, in seconds from its start (run in the child)."""
  from paged_jax import chat as chat_lib, embedded, serve
  from paged_jax.sampling import SamplingParams
  t_import = time.perf_counter()
  sc = serve.ServeConfig(model_dir=None if cfg.model == "embedded" else cfg.model,
                         scan_layers=cfg.scan_layers, program_store=os.environ["RESTART_STORE"])
  params, mcfg, tok, eos = serve.load_model(sc)
  t_load = time.perf_counter()
  engine = serve.make_engine(sc, params, mcfg, tok, eos)
  warm = engine.warmup(cfg.warmup) if cfg.warmup != "off" else None
  t_engine = time.perf_counter()
  if cfg.model == "embedded":
    ids = tok.encode("h e l l o").ids
  else:
    ch = chat_lib.Chat(cfg.model, tok, eos)
    ids = ch.prompt_ids([{"role": "user", "content": cfg.prompt}])
    eos = ch.end_of_turn_ids
  engine.add_request(ids, SamplingParams(max_tokens=cfg.max_tokens))
  first = None
  while engine.has_unfinished():
    for out in engine.step():
      if first is None and out.outputs[0].token_ids:
        first = time.perf_counter()
  end = time.perf_counter()
  m = engine.metrics()
  return {"import_s": t_import - T0, "load_s": t_load - t_import,
          "engine_s": t_engine - t_load, "first_token_after_engine_s": first - t_engine,
          "first_token_s": first - T0, "total_s": end - T0, "programs": m["programs"],
          "programs_compiled": m["programs_compiled"], "programs_loaded": m["programs_loaded"],
          "warmup": warm}


def run(cfg: RestartConfig, progress=print) -> list[dict]:
  """`cfg.runs` child processes over one pair of fresh caches; a row per run."""
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    env = dict(os.environ, PAGED_JAX_GGUF_CACHE=os.path.join(tmp, "gguf"),
               RESTART_STORE=os.path.join(tmp, "programs"))
    for i in range(cfg.runs):
      args = [sys.executable, "-m", "experiments.restart_bench", "--child",
              f"--model={cfg.model}", f"--scan_layers={cfg.scan_layers}",
              f"--warmup={cfg.warmup}", f"--max_tokens={cfg.max_tokens}"]
      done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
      if done.returncode:
        raise RuntimeError(f"restart_bench child failed ({done.returncode}):\n{done.stderr[-3000:]}")
      row = json.loads(done.stdout.strip().splitlines()[-1])
      import jax
      row.update(run=i, cold=i == 0, model=cfg.model, scan_layers=cfg.scan_layers,
                 warmup=cfg.warmup, jax=jax.__version__)
      rows.append(row)
      progress(f"{'cold' if i == 0 else 'warm'}: import {row['import_s']:.2f} s, load "
               f"{row['load_s']:.2f} s, engine {row['engine_s']:.2f} s, first token "
               f"{row['first_token_after_engine_s']:.2f} s after it ({row['first_token_s']:.2f} s "
               f"from the start); programs compiled {row['programs_compiled']}, loaded "
               f"{row['programs_loaded']}")
  if cfg.results_dir:
    os.makedirs(cfg.results_dir, exist_ok=True)
    with open(os.path.join(cfg.results_dir, "restart_bench.jsonl"), "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  return rows


def main(argv):
  del argv
  cfg = RestartConfig(model=FLAGS.model, scan_layers=FLAGS.scan_layers, warmup=FLAGS.warmup,
                      runs=FLAGS.runs, max_tokens=FLAGS.max_tokens,
                      results_dir=FLAGS.results_dir or None)
  if FLAGS.child:
    print(json.dumps(child(cfg)))
  else:
    run(cfg)


if __name__ == "__main__":
  flags.DEFINE_string("model", "embedded", "A GGUF file or HF directory, or 'embedded'.")
  flags.DEFINE_bool("scan_layers", False, "Run the layers as a lax.scan.")
  flags.DEFINE_enum("warmup", "off", ["off", "one_user"], "Engine.warmup before the request.")
  flags.DEFINE_integer("runs", 2, "Processes: the first cold, the rest warm.")
  flags.DEFINE_integer("max_tokens", 8, "Tokens to generate.")
  flags.DEFINE_string("results_dir", "experiments/results", "Where the JSONL goes ('' = none).")
  flags.DEFINE_bool("child", False, "Internal: one timed process.")
  app.run(main)
