"""A server's first token: the step that prefills one prompt beside running decode rows, timed.

  python -m experiments.mixed_step_bench --model_dir=/tmp/smol_hf --scan_layers   # SmolLM2-135M
  python -m experiments.mixed_step_bench --prompt_tokens=16,64 --decode_rows=1,8

When a request arrives at a busy server, its first token comes from one step that prefills its
prompt beside the decode rows already running. For each (decode rows, prompt tokens) this runs
`decode_rows` requests through the engine (one step per sync), then, for every trial, adds one
request of `prompt_tokens` random tokens that wants one token, and times the `Engine.step` that
prefills it (wall time: the host's scheduling and batch building, the compiled step, the
sampled token back on the host). Prompt lengths at the engine's token buckets (16, 32, 64, 80,
...) are what their padded programs cost. --prompts=k adds k such requests at once instead,
all prefilled in that one step (prompts that arrive together; one prompt a step would take k
steps of the one-prompt time).

Variants, each its own engine, timed interleaved trial by trial:
- engine: the engine as it is;
- tiled_prefill_attention: every prefill chunk on the tiled XLA path
  (`attention.prefill_attention`; `attention.PREFILL_ON_CPU_KERNEL` = False), decode rows on
  the C++ kernel, as before prefill chunks ran on the kernel;
- no_prefill_attention: an ablation: the prefill chunks' attention answers zeros (decode rows
  keep theirs, on the kernel alone), so the difference is what that attention costs
  inside the step. Its tokens are not checked.
- onednn (not in the default list): the engine with its matmuls in oneDNN on packed weights
  (`ModelConfig.matmul="onednn"`, the `onednn` extra; packed at the engine's construction), so
  a server's first-token step on XLA's dots and on oneDNN's is timed in one process.

Each engine traces its programs with step functions of its own (`own_steps`): jit caches a
trace by the Python callable and argument shapes, so engines sharing `step.sample_step` would
all run the first one's trace, whatever their patches.

Prints the median milliseconds per (decode rows, prompt tokens, variant) and appends one JSONL
record per run to --out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from unittest import mock

import jax
import numpy as np

VARIANTS = ("engine", "tiled_prefill_attention", "no_prefill_attention")   # the default list
OPTIONAL_VARIANTS = ("onednn",)   # named in --variants only (it needs the onednn extra)


@dataclasses.dataclass(frozen=True)
class MixedStepConfig:
  model_dir: str | None = None    # None: the embedded model
  dtype: str = "float32"
  prompt_tokens: tuple[int, ...] = (16, 32, 64, 128)
  decode_rows: tuple[int, ...] = (1, 8)
  variants: tuple[str, ...] = VARIANTS
  trials: int = 11
  background_prompt: int = 32     # the decode rows' prompt tokens
  scan_layers: bool = False
  page_size: int = 32
  prompts: int = 1                # requests of prompt_tokens added together, one step for all


def _variant(name: str):
  """The context under which an engine's programs trace the variant `name` (nothing is
  patched until it is entered)."""
  from paged_jax import attention
  if name not in VARIANTS + OPTIONAL_VARIANTS:
    raise ValueError(f"variant {name!r} is not one of {VARIANTS + OPTIONAL_VARIANTS}")
  if name in ("engine", "onednn"):   # onednn differs in its model config (`variant_config`)
    return contextlib.nullcontext()
  if name == "tiled_prefill_attention":
    return mock.patch.object(attention, "PREFILL_ON_CPU_KERNEL", False)
  return _no_prefill_attention()


@contextlib.contextmanager
def _no_prefill_attention():
  from paged_jax import attention
  zeros = lambda q, *args, **kwargs: jax.numpy.zeros_like(q)
  with mock.patch.object(attention, "prefill_attention", zeros), \
       mock.patch.object(attention, "PREFILL_ON_CPU_KERNEL", False):   # decode rows alone
    yield


def variant_config(name: str, mcfg):
  """The model config an engine of variant `name` runs: the checkpoint's, or for "onednn" the
  same with its matmuls in oneDNN."""
  return dataclasses.replace(mcfg, matmul="onednn") if name == "onednn" else mcfg


def own_steps():
  """Step functions of an engine's own (new callables over the same code), so that its programs
  are traced under its variant's patch and never taken from another engine's traces (jit
  caches a trace by callable and argument shapes, across engines)."""
  from paged_jax import step
  from paged_jax.engine import StepFunctions
  # A partial of its own: jit keys its trace cache by the Python callable, not the jit object.
  fresh = lambda f, static: jax.jit(functools.partial(f.__wrapped__), static_argnames=static,
                                    donate_argnames=("pool",))
  return StepFunctions(
      sample_step=fresh(step.sample_step, ("cfg", "impl", "greedy_only", "num_logprobs")),
      multi_step_decode=fresh(step.multi_step_decode, ("cfg", "num_steps", "impl",
                                                       "greedy_only", "num_logprobs")))


def run(cfg: MixedStepConfig, progress=print) -> dict:
  """{"rows": [{decode_rows, prompt_tokens, prompts, variant, ms, ms_all}], ...}."""
  from paged_jax import checkpoint, embedded
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  for r in cfg.variants:
    _variant(r)   # a bad variant fails before loading anything
  if cfg.prompts < 1:
    raise ValueError(f"prompts={cfg.prompts}: at least one prompt a step")
  params, mcfg, _ = checkpoint.load_checkpoint(cfg.model_dir or embedded.EMBEDDED_MODEL_DIR,
                                               cfg.dtype)
  rng = np.random.default_rng(0)
  prompt = lambda n: [int(t) for t in rng.integers(3, mcfg.vocab_size, n)]
  budget = cfg.prompts * max(cfg.prompt_tokens) + max(cfg.decode_rows)
  rows = []
  for d in cfg.decode_rows:
    # Enough tokens for every timed step, once per variant, plus one warm-up pass.
    steps = (cfg.trials + 1) * len(cfg.prompt_tokens) + 2
    engines = {r: Engine(params, variant_config(r, mcfg),
                         cache=CacheConfig(page_size=cfg.page_size),
                         scheduler=SchedulerConfig(steps_per_sync=1, max_num_batched_tokens=budget,
                                                   max_num_seqs=d + cfg.prompts),
                         scan_layers=cfg.scan_layers, steps=own_steps()) for r in cfg.variants}
    background = [prompt(cfg.background_prompt) for _ in range(d)]
    for r, engine in engines.items():
      with _variant(r):
        ids = {engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True))
               for p in background}
        while ids:   # the background prompts' prefill, in as many steps as the budget needs
          ids -= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    times = {(n, r): [] for n in cfg.prompt_tokens for r in cfg.variants}
    for trial in range(cfg.trials + 1):   # trial 0 compiles (untimed)
      for n in cfg.prompt_tokens:
        ps = [prompt(n) for _ in range(cfg.prompts)]
        for r, engine in engines.items():
          with _variant(r):
            rids = {engine.add_request(p, SamplingParams(max_tokens=1)) for p in ps}
            t = time.perf_counter()
            outs = engine.step()
            seconds = time.perf_counter() - t
          if {o.request_id for o in outs if o.finished} & rids != rids:
            raise RuntimeError(f"{cfg.prompts} prompt(s) of {n} tokens were not prefilled in one "
                               f"step ({r})")
          if trial:
            times[(n, r)].append(seconds)
    for (n, r), ts in times.items():
      ts = 1e3 * np.asarray(ts)
      base = 1e3 * np.asarray(times[(n, "engine")]) if "engine" in cfg.variants else None
      rows.append(dict(decode_rows=d, prompt_tokens=n, prompts=cfg.prompts, variant=r,
                       ms=float(np.median(ts)),
                       ms_all=ts.tolist(),   # paired: the median of trial-by-trial differences
                       vs_engine_ms=None if base is None else float(np.median(ts - base))))
      x = rows[-1]
      progress(f"decode rows {d:3d}  prompt {n:4d} tokens" + (f" x {cfg.prompts}" if
               cfg.prompts > 1 else "") + f"  {r:20s}  {x['ms']:8.2f} ms"
               + ("" if base is None else f"  ({x['vs_engine_ms']:+.2f} ms against engine)"))
  return dict(kind="mixed_step_bench", config=dataclasses.asdict(cfg), jax=jax.__version__,
              device=jax.devices()[0].device_kind, rows=rows)


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  result = run(MixedStepConfig(
      model_dir=f.model_dir, dtype=f.dtype, prompt_tokens=tuple(int(x) for x in f.prompt_tokens),
      decode_rows=tuple(int(x) for x in f.decode_rows), variants=tuple(f.variants),
      trials=f.trials, scan_layers=f.scan_layers, page_size=f.page_size, prompts=f.prompts))
  if f.out:
    os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
    with open(f.out, "a") as fh:
      fh.write(json.dumps(result) + "\n")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("model_dir", None, "A checkpoint directory or GGUF file (default: the "
                      "embedded model).")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and KV pool dtype.")
  flags.DEFINE_list("prompt_tokens", ["16", "32", "64", "128"], "The new prompt's tokens.")
  flags.DEFINE_list("decode_rows", ["1", "8"], "Decode rows running beside it.")
  flags.DEFINE_list("variants", list(VARIANTS),
                    f"Engines to time, from {VARIANTS + OPTIONAL_VARIANTS}.")
  flags.DEFINE_integer("trials", 11, "Timed steps per (rows, prompt, variant); the median.")
  flags.DEFINE_bool("scan_layers", False, "The layers as a lax.scan.")
  flags.DEFINE_integer("page_size", 32, "Tokens per page.")
  flags.DEFINE_integer("prompts", 1, "Prompts of --prompt_tokens added together, all prefilled "
                       "in the timed step.")
  flags.DEFINE_string("out", "experiments/results/mixed_step_bench.jsonl", "JSONL to append to "
                      "('' = none).")
  app.run(main)
