"""On-device generation (`generate_on_device`: one jitted call, pages allocated in the loop) against
the engine (host block manager, one sync per step or per k-step round), on the serve benchmark's
workload, in one process, alternating, median of the repetitions, compiling excluded.

  python -m experiments.ondevice_bench                    # small preset, 32 requests
  python -m experiments.ondevice_bench --preset=tiny --num_requests=8
  python -m experiments.ondevice_bench --steps_per_sync=1    # the engine syncing every step

Both run the same random-init model (the serve benchmark's preset shapes, vocabulary 512), greedy,
`new_tokens` tokens per request, no EOS, with the pool large enough for everything (the on-device
loop has no preemption). Reported: output tokens/s, seconds, host syncs (the engine: one
`device_get` per step; on device: one, at the end), and whether the tokens are identical.
Output: stdout and a JSONL line in experiments/results/ondevice_bench.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import serve_bench
from paged_jax import ondevice, testing
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine import Engine
from paged_jax.host.batching import token_bucket
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

RESULTS = os.path.join(os.path.dirname(__file__), "results", "ondevice_bench.jsonl")


@dataclasses.dataclass(frozen=True)
class OnDeviceBenchConfig:
  preset: str = "small"
  num_requests: int = 32
  new_tokens: int = 64
  repetitions: int = 3
  page_size: int = 16
  steps_per_sync: int = 16
  results: str | None = RESULTS


def preset_model(cfg: OnDeviceBenchConfig):
  """(params, model config, prompts): the serve benchmark's random-init preset and workload."""
  bench = serve_bench.BenchConfig(preset=cfg.preset, num_requests=cfg.num_requests,
                                  new_tokens=cfg.new_tokens)
  p = serve_bench.PRESETS[cfg.preset]
  model_cfg = ModelConfig(vocab_size=serve_bench.vocab_size(bench), hidden_size=p["hidden_size"],
                          intermediate_size=p["intermediate_size"], num_layers=p["num_layers"],
                          num_q_heads=p["num_q_heads"], num_kv_heads=p["num_kv_heads"],
                          head_dim=p["head_dim"], max_position=bench.max_prompt + cfg.new_tokens)
  return testing.random_params(model_cfg, seed=0, scale=0.05), model_cfg, serve_bench.workload(bench)


def run(cfg: OnDeviceBenchConfig, progress=print) -> dict:
  params, model_cfg, prompts = preset_model(cfg)
  num_pages = 1 + sum(-(-(len(p) + cfg.new_tokens) // cfg.page_size) for p in prompts)
  lens = np.asarray([len(p) for p in prompts], np.int32)
  padded = np.zeros((len(prompts), int(lens.max())), np.int32)
  for i, p in enumerate(prompts):
    padded[i, :len(p)] = p
  num_prefill_tokens = token_bucket(int(lens.sum()))
  ondevice.check_prompts(padded, lens, num_prefill_tokens)
  args = jax.device_put((params, jnp.asarray(padded), jnp.asarray(lens)))
  kw = dict(cfg=model_cfg, max_new_tokens=cfg.new_tokens, num_pages=num_pages,
            page_size=cfg.page_size, impl="xla", greedy_only=True,
            num_prefill_tokens=num_prefill_tokens)

  def on_device():
    out = jax.block_until_ready(ondevice.generate_on_device(*args, **kw))
    return [np.asarray(out.tokens[i, :int(out.lengths[i])]).tolist() for i in range(len(prompts))], 1

  def engine():
    e = Engine(params, model_cfg, cache=CacheConfig(page_size=cfg.page_size, num_pages=num_pages),
               scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192,
                                         steps_per_sync=cfg.steps_per_sync), impl="xla")
    outs = e.generate(prompts, SamplingParams(max_tokens=cfg.new_tokens))
    return [o.outputs[0].token_ids for o in outs], e.stats.steps

  runs = {"on_device": on_device, "engine": engine}
  times = {k: [] for k in runs}
  tokens, syncs = {}, {}
  for name, fn in runs.items():   # compile
    progress(f"warming up {name} ...")
    fn()
  for rep in range(cfg.repetitions):
    for name, fn in runs.items():
      t = time.perf_counter()
      tokens[name], syncs[name] = fn()
      times[name].append(time.perf_counter() - t)
    progress(f"repetition {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()))
  generated = cfg.num_requests * cfg.new_tokens
  result = {"config": dataclasses.asdict(cfg), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "identical": tokens["on_device"] == tokens["engine"],
            "engines": {}}
  for name in runs:
    secs = float(np.median(times[name]))
    result["engines"][name] = dict(seconds=secs, tokens_per_s=generated / secs,
                                   host_syncs=syncs[name], all_seconds=times[name])
  result["on_device_over_engine"] = (result["engines"]["on_device"]["tokens_per_s"]
                                     / result["engines"]["engine"]["tokens_per_s"])
  if cfg.results:
    os.makedirs(os.path.dirname(cfg.results), exist_ok=True)
    with open(cfg.results, "a") as f:
      f.write(json.dumps(result) + "\n")
  return result


def report(r: dict) -> str:
  c = r["config"]
  lines = [f"on-device vs engine [{c['preset']}]: {c['num_requests']} requests x "
           f"{c['new_tokens']} tokens, median of {c['repetitions']}; tokens identical: "
           f"{r['identical']}"]
  for name, v in r["engines"].items():
    lines.append(f"  {name:10s} {v['tokens_per_s']:8.0f} tok/s  ({v['seconds']:.3f} s, "
                 f"{v['host_syncs']} host syncs)")
  lines.append(f"  on_device / engine: {r['on_device_over_engine']:.2f}x")
  return "\n".join(lines)


def main(_):
  cfg = OnDeviceBenchConfig(preset=_PRESET.value, num_requests=_NUM_REQUESTS.value,
                            new_tokens=_NEW_TOKENS.value, repetitions=_REPETITIONS.value,
                            steps_per_sync=_STEPS_PER_SYNC.value)
  print(report(run(cfg)))


if __name__ == "__main__":
  _PRESET = flags.DEFINE_enum("preset", "small", list(serve_bench.PRESETS), "Model shape.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "Requests.")
  _NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens per request.")
  _REPETITIONS = flags.DEFINE_integer("repetitions", 3, "Alternating repetitions (median).")
  _STEPS_PER_SYNC = flags.DEFINE_integer("steps_per_sync", 16, "The engine's k (decode steps "
                                         "per host sync).")
  app.run(main)
