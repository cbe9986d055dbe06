"""Where a step's time goes: one prefill step and one k-step decode round, per model part.

  python -m experiments.profile_step                     # the serve benchmark's small model
  python -m experiments.profile_step --preset=large --steps_per_sync=4
  python -m experiments.profile_step --model_dir=D --dtype=bfloat16   # a checkpoint, in bf16
  python -m experiments.profile_step --model_dir=D --num_requests=1    # one user (batch 1)
  python -m experiments.profile_step --model_dir=D --scan_layers       # layers as one scan
  python -m experiments.profile_step --model_dir=D --matmul=onednn     # oneDNN's packed matmuls

Runs the serve benchmark's workload (experiments/serve_bench.py) through the engine once to
compile, then traces one prefill step of every prompt and one decode round with
`jax.profiler` (a Perfetto trace), maps each executed XLA op to the model part its HLO metadata
names (attention, projections, MLP, norms, embedding, LM head, sampling, KV writes), and prints
milliseconds per part. Loop and call ops are containers; only the ops they run are counted.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import re
import shutil
import tempfile

import jax
import numpy as np

from experiments import serve_bench

# First match wins: the op_name of an XLA op (its JAX call stack) -> a model part.
# The names are flax module names and the `jax.named_scope`s of model.py and step.py. With
# --scan_layers the layer body is a `closed_call` whose modules carry their class names
# ("/MLP/", "RMSNorm"), and a tied LM head is "Embed.attend"; without these keys a scanned
# model's MLP and norms landed in "other".
PARTS = (
    ("kv write", ("/kv_write",)),
    ("attention", ("/attention",)),
    ("rope", ("/rope",)),
    ("q/k/v/o projections", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp", ("_mlp", "/MLP/")),
    ("norms", ("layernorm", "/norm", "RMSNorm")),
    ("lm head", ("lm_head", ".attend")),
    ("embedding", ("embed_tokens", "/Embed")),
    ("sampling", ("/sampling",)),
)
_CONTAINERS = ("while", "conditional", "call")


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
  """The serve benchmark's model, workload and engine settings, and traced calls per step."""
  bench: serve_bench.BenchConfig = serve_bench.BenchConfig()
  repeats: int = 3
  scan_layers: bool = False   # the decoder's layers as one scanned body (`Engine(scan_layers=)`)
  matmul: str = "xla"         # `ModelConfig.matmul` (the engine packs the weights for "onednn")


UNNAMED_DOTS = "matmuls (no op_name)"


def _op_parts(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> model part (from its metadata op_name). A dot XLA rewrote without
  metadata (SmolLM2's one-row decode: all 211 of a step's dots, 2026-12-05) is UNNAMED_DOTS, so
  its time is counted, if not placed."""
  parts = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if not m:
      continue
    meta = re.search(r'metadata=\{[^}]*?op_name="([^"]*)"', line)
    if meta:
      parts[m.group(1)] = next((p for p, keys in PARTS if any(k in meta.group(1) for k in keys)),
                               "other")
    elif re.search(r"\]\S* dot\(", line):
      parts[m.group(1)] = UNNAMED_DOTS
  return parts


def _profile(fn, hlo_text: str, repeats: int) -> dict[str, float]:
  """Milliseconds per model part of one call of fn (mean of `repeats` traced calls)."""
  jax.block_until_ready(fn())
  out_dir = tempfile.mkdtemp(prefix="profile_step_")
  try:
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
      for _ in range(repeats):
        jax.block_until_ready(fn())
    (trace,) = glob.glob(f"{out_dir}/**/*.trace.json.gz", recursive=True)
    events = json.load(gzip.open(trace))
  finally:
    shutil.rmtree(out_dir, ignore_errors=True)
  events = events["traceEvents"] if isinstance(events, dict) else events
  parts = _op_parts(hlo_text)
  total = collections.Counter()
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X" or name not in parts or name.split(".")[0] in _CONTAINERS:
      continue
    total[parts[name]] += e["dur"] / 1e3 / repeats
  return dict(total.most_common())


def run(cfg: ProfileConfig, model_dir: str | None = None) -> dict:
  """{"prefill": {part: ms}, "decode": {part: ms per decode step}, shapes}."""
  from paged_jax import checkpoint, step
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host import batching
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  bench = cfg.bench
  path = model_dir or tempfile.mkdtemp(prefix="profile_model_")
  if not glob.glob(f"{path}/config.json"):
    serve_bench.make_model(bench, path)
  params, mcfg, _ = checkpoint.load_checkpoint(path, bench.dtype, stacked=cfg.scan_layers)
  mcfg = dataclasses.replace(mcfg, matmul=cfg.matmul)
  prompts = serve_bench.workload(bench)
  longest = max(map(len, prompts)) + bench.new_tokens + bench.steps_per_sync
  engine = Engine(params, mcfg, cache=CacheConfig(
      page_size=bench.page_size, num_pages=1 + len(prompts) * -(-longest // bench.page_size)),
      scheduler=SchedulerConfig(max_num_seqs=max(bench.max_num_seqs, len(prompts)),
                                max_num_batched_tokens=max(bench.max_num_batched_tokens,
                                                           sum(map(len, prompts))),
                                steps_per_sync=bench.steps_per_sync),
      scan_layers=cfg.scan_layers)
  params = engine.params   # as the engine runs them (stacked, packed)
  sp = SamplingParams(max_tokens=bench.new_tokens, ignore_eos=True)
  for p in prompts:
    engine.add_request(p, sp)
  result = {}
  for kind in ("prefill", "decode"):
    plan = engine.scheduler.schedule()
    engine._apply_swaps_and_copies(plan)
    greedy = dict(greedy_only=True, num_logprobs=0, impl=engine.impl, cfg=mcfg)
    if kind == "prefill":
      assert plan.prefill_rows and plan.num_steps == 1, "the first step must prefill every prompt"
      a = batching.build_step(plan, engine.bm, engine.max_pages_per_seq)
      md = step.AttentionMetadata(a["block_tables"], a["seq_lens"], a["cu_q_lens"], a["slots"],
                                  max_q_len=a["max_q_len"], num_decode=a["num_decode"])
      inputs = jax.device_put((step.Batch(a["tokens"], a["positions"], md,
                                          a["logits_indices"]), a["sampling"]))
      fn, kw = step.sample_step, greedy
    else:
      assert plan.num_steps == bench.steps_per_sync > 1, "the second step must be a decode round"
      a = batching.build_decode_round(plan, engine.bm, engine.max_pages_per_seq)
      inputs = jax.device_put((step.DecodeState(a["tokens"], a["positions"], a["block_tables"],
                                                a["write_limit"]), a["sampling"]))
      fn, kw = step.multi_step_decode, dict(greedy, num_steps=plan.num_steps)
    hlo = fn.lower(params, engine.pool, *inputs, **kw).compile().as_text()
    holder = {"pool": engine.pool}

    def call():
      out, holder["pool"] = fn(params, holder["pool"], *inputs, **kw)
      return out.tokens

    ms = _profile(call, hlo, cfg.repeats)
    out, engine.pool = fn(params, holder["pool"], *inputs, **kw)
    engine.scheduler.update(plan, {f.name: np.asarray(getattr(out, f.name))[None]
                                   if plan.num_steps == 1 else np.asarray(getattr(out, f.name))
                                   for f in dataclasses.fields(out)})
    scale = 1 if kind == "prefill" else 1 / plan.num_steps
    result[kind] = {part: v * scale for part, v in ms.items()}
    result[f"{kind}_rows"] = len(plan.rows)
    result[f"{kind}_tokens"] = int(sum(r.stop - r.start for r in plan.rows))
  return result


def format_result(r: dict) -> str:
  lines = []
  for kind, unit in (("prefill", "ms per step"), ("decode", "ms per decode step")):
    parts = r[kind]
    lines.append(f"{kind} ({r[f'{kind}_rows']} rows, {r[f'{kind}_tokens']} tokens), {unit}: "
                 f"total {sum(parts.values()):.2f}")
    lines += [f"  {p:22s} {v:8.2f}" for p, v in parts.items()]
  return "\n".join(lines)


def main(argv):
  from absl import flags
  f = flags.FLAGS
  r = run(ProfileConfig(serve_bench.BenchConfig(preset=f.preset, steps_per_sync=f.steps_per_sync,
                                                 dtype=f.dtype,
                                                 num_requests=f.num_requests),
                         scan_layers=f.scan_layers, matmul=f.matmul),
          f.model_dir)
  print(format_result(r))


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_enum("preset", "small", list(serve_bench.PRESETS), "Model shape.")
  flags.DEFINE_integer("steps_per_sync", 16, "Decode steps in the profiled round.")
  flags.DEFINE_string("model_dir", None, "Reuse a saved model directory.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Weights and KV pool dtype.")
  flags.DEFINE_integer("num_requests", 32, "Prompts of the workload (1: a single user's decode).")
  flags.DEFINE_bool("scan_layers", False, "The decoder's layers as one scanned body.")
  flags.DEFINE_enum("matmul", "xla", ["xla", "mkl", "onednn"], "How the model multiplies "
                    "(paged_jax.matmul.BACKENDS).")
  app.run(main)
