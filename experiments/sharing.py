"""Sharing (issue 11, item 4): KV memory saved by sharing pages in parallel sampling and beam
search (the PagedAttention paper's figure 15), and prefix caching on a shared-prefix workload.

  python -m experiments.sharing                         # both parts, both workloads
  python -m experiments.sharing --part=memory --num_requests=32
  python -m experiments.sharing --part=prefix --model=small

Memory. The engine serves the ShareGPT-like / Alpaca-like lengths (up to 2,048 tokens, all
requests at once, a pool large enough that nothing is preempted) with n = 2, 4, 6 parallel
samples or beam width 2, 4, 6. No model: `testing.RandomSteps` samples from fresh random logits,
so the real host logic runs (the scheduler, the policies' forks and frees, copy-on-write of a
shared partial page) while beams survive or die as their random scores say. After every step the
block manager tells which pages each live sequence references; the saving is
1 - (distinct pages in use) / (pages the sequences would hold without sharing: each sequence's
block-table length), summed over steps (a time average). The paper (OPT-13B, its traces):
parallel sampling 6.1-9.8% on Alpaca and 16.2-30.5% on ShareGPT; beam search 37.6-55.2% and
44.3-66.3%.

Prefix. Requests whose prompts start with a shared prefix, served by `paged_jax.serve` on a model
of `experiments.models`, prefix caching on against off: first all at once (warmed up: a burst
schedules the same way every run, so its timing is clean; output tokens/s), then as Poisson
arrivals at the rate the burst without caching sustained: prompt tokens prefilled (those the
cache served are saved), the hit rate (prompt tokens served by the cache over prompt tokens
looked up), normalized latency and TTFT (compared only when neither run compiled a shape:
`retraced` = 0). In a burst, requests admitted in the same step as the first cannot hit: a page
is shared once its tokens are computed. Two workloads: "system_prompt" (one long system
prompt, then a short question) and "few_shot" (one of 4 few-shot templates, then a question).

Output: stdout, experiments/results/sharing.{jsonl,png}.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
import numpy as np

from experiments import output
from experiments.models import MODELS, load_model, serve_warm

RESULTS = output.RESULTS
PAPER = {("alpaca", "parallel"): (6.1, 9.8), ("sharegpt", "parallel"): (16.2, 30.5),
         ("alpaca", "beam"): (37.6, 55.2), ("sharegpt", "beam"): (44.3, 66.3)}
PREFIX_WORKLOADS = ("system_prompt", "few_shot")


@dataclasses.dataclass(frozen=True)
class SharingConfig:
  parts: tuple[str, ...] = ("memory", "prefix")
  # memory
  workloads: tuple[str, ...] = ("sharegpt", "alpaca")
  widths: tuple[int, ...] = (2, 4, 6)
  num_requests: int = 64
  max_len: int = 2048
  page_size: int = 16
  max_num_seqs: int = 256
  # prefix
  model: str = "embedded"
  prefix_workloads: tuple[str, ...] = PREFIX_WORKLOADS
  prefix_requests: int = 128
  prefix_len: int | None = None      # default: half the model's context
  question_len: tuple[int, int] = (4, 16)
  output_len: int = 16
  seed: int = 0
  progress: bool = True
  results_dir: str | None = RESULTS


# ---------------------------------------------------------------------------------------- memory

def memory_saving(cfg: SharingConfig, workload: str, mode: str, width: int) -> dict:
  """Serves the workload with `width` samples or beams on RandomSteps; returns the pages in use
  and the pages without sharing, summed over steps, and the saving."""
  from paged_jax import config, testing, workloads
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host.addressing import pages_needed
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  rng = np.random.default_rng(cfg.seed)
  lens_in, lens_out = workloads.sample_lengths(rng, workload, cfg.num_requests,
                                               max_total=cfg.max_len)
  mcfg = config.tiny_config(vocab_size=256, max_position=cfg.max_len)
  # Room for every sequence of every request at its longest, unshared: nothing is preempted.
  need = sum(width * pages_needed(int(i + o), cfg.page_size) for i, o in zip(lens_in, lens_out))
  steps = testing.RandomSteps(mcfg.vocab_size, seed=cfg.seed)
  engine = Engine(None, mcfg, cache=CacheConfig(page_size=cfg.page_size, num_pages=need + 1),
                  scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                            max_num_batched_tokens=16_384, steps_per_sync=1),
                  steps=steps.functions(), validate_tables=False)
  for i, o in zip(lens_in, lens_out):
    prompt = rng.integers(0, mcfg.vocab_size, int(i)).tolist()
    kind = {"n": width, "temperature": 1.0} if mode == "parallel" else {"beam_width": width}
    engine.add_request(prompt, SamplingParams(max_tokens=int(o), ignore_eos=True, **kind))
  shared = unshared = 0
  bm = engine.bm
  while engine.has_unfinished():
    engine.step()
    tables = [bm.block_table(s.seq_id) for g in engine.scheduler.running for s in g.seqs
              if s.seq_id in bm]
    shared += len({p for t in tables for p in t})
    unshared += sum(len(t) for t in tables)
  bm.check_invariants()
  return {"workload": workload, "mode": mode, "width": width, "num_requests": cfg.num_requests,
          "page_steps_shared": shared, "page_steps_unshared": unshared,
          "saving": 1 - shared / unshared, "preemptions": engine.metrics()["preemptions"],
          "cow_copies": engine.metrics()["cow_copies"]}


# ---------------------------------------------------------------------------------------- prefix

def prefix_requests(cfg: SharingConfig, workload: str, vocab_size: int, max_position: int):
  """Token-id prompts: a shared prefix (one system prompt, or one of 4 few-shot templates) then a
  random question of question_len tokens."""
  rng = np.random.default_rng(cfg.seed)
  prefix_len = cfg.prefix_len or max_position // 2
  if prefix_len + cfg.question_len[1] + cfg.output_len > max_position:
    raise ValueError(f"prefix_len={prefix_len} + question up to {cfg.question_len[1]} + "
                     f"output_len={cfg.output_len} exceeds the model's context {max_position}")
  templates = 1 if workload == "system_prompt" else 4
  prefixes = [rng.integers(4, vocab_size, prefix_len).tolist() for _ in range(templates)]
  prompts = []
  for _ in range(cfg.prefix_requests):
    q = int(rng.integers(cfg.question_len[0], cfg.question_len[1] + 1))
    prompts.append(prefixes[int(rng.integers(templates))] + rng.integers(4, vocab_size, q).tolist())
  return prompts


def prefix_caching(cfg: SharingConfig, model) -> list[dict]:
  import tempfile
  from paged_jax import serve
  params, mcfg, _, _ = model
  rows = []
  for w in cfg.prefix_workloads:
    prompts = prefix_requests(cfg, w, mcfg.vocab_size, mcfg.max_position)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
      for p in prompts:
        f.write(json.dumps({"prompt_token_ids": p, "max_tokens": cfg.output_len,
                            "ignore_eos": True}) + "\n")
    try:
      saturation = None
      for on in (False, True):
        base = serve.ServeConfig(prompts_file=f.name, enable_prefix_caching=on, progress=False,
                                 seed=cfg.seed)
        burst = serve.run(dataclasses.replace(base, warmup="workload"), model=model)
        saturation = saturation or burst["num_requests"] / burst["seconds"]
        # Poisson arrivals at the saturation rate without caching: later requests find the
        # prefix computed by earlier ones (in a burst, requests admitted in the same step as
        # the first cannot: a page is shared once its tokens are computed).
        r = serve_warm(dataclasses.replace(base, request_rate=saturation), model)
        rows.append({"workload": w, "prefix_caching": on, "num_requests": len(prompts),
                     "request_rate": saturation, "prompt_tokens": r["input_tokens"],
                     "prefill_tokens": r["prefill_tokens"],
                     "cached_prompt_tokens": r["cached_prompt_tokens"],
                     "hit_rate": r["prefix_hit_rate"],
                     "normalized_latency_s": r["normalized_latency_s_per_token"],
                     "ttft_p50_s": r["ttft_s"]["p50"], "retraced": r["retraced"],
                     "burst_output_tokens_per_s": burst["output_tokens_per_s"],
                     "burst_hit_rate": burst["prefix_hit_rate"],
                     "_tokens": [c["token_ids"] for c in r["completions"]]})
    finally:
      os.unlink(f.name)
    off, on = rows[-2], rows[-1]
    on["same_tokens_as_off"] = on.pop("_tokens") == off.pop("_tokens")
    on["prefill_tokens_saved"] = 1 - on["prefill_tokens"] / off["prefill_tokens"]
    on["latency_ratio"] = on["normalized_latency_s"] / off["normalized_latency_s"]
    on["burst_speedup"] = on["burst_output_tokens_per_s"] / off["burst_output_tokens_per_s"]
  return rows


def off_row(rows: list[dict], on: dict) -> dict:
  """The caching-off row of `on`'s workload."""
  return next(r for r in rows if r["workload"] == on["workload"] and not r["prefix_caching"])


# ---------------------------------------------------------------------------------------- run

def run(cfg: SharingConfig, model=None, progress=print) -> dict:
  from tqdm import tqdm
  for part in cfg.parts:
    if part not in ("memory", "prefix"):
      raise ValueError(f"part {part!r} is not 'memory' or 'prefix'")
  result = {"config": dataclasses.asdict(cfg), "memory": [], "prefix": []}
  if "memory" in cfg.parts:
    cases = [(w, m, n) for w in cfg.workloads for m in ("parallel", "beam") for n in cfg.widths]
    for w, m, n in tqdm(cases, disable=not cfg.progress, unit="run", desc="memory saving"):
      r = memory_saving(cfg, w, m, n)
      r["paper_range_pct"] = PAPER[(w, m)]
      result["memory"].append(r)
      progress(f"{w:8s} {m:8s} {n}: {100 * r['saving']:.1f}% saved (paper "
               f"{PAPER[(w, m)][0]}-{PAPER[(w, m)][1]}% for 2-6)")
  if "prefix" in cfg.parts:
    model = model or load_model(cfg.model)
    result["prefix"] = prefix_caching(cfg, model)
    for r in result["prefix"]:
      if r["prefix_caching"]:
        clean = r["retraced"] == 0 and off_row(result["prefix"], r)["retraced"] == 0
        progress(f"{r['workload']}: burst {r['burst_output_tokens_per_s']:.0f} tok/s with caching, "
                 f"{r['burst_speedup']:.2f}x without (hit rate {100 * r['burst_hit_rate']:.1f}%); "
                 f"at {r['request_rate']:.0f} req/s: {100 * r['prefill_tokens_saved']:.1f}% of "
                 f"prefill tokens saved (hit rate {100 * r['hit_rate']:.1f}%), normalized latency "
                 + (f"x{r['latency_ratio']:.2f}" if clean else "not compared (a run compiled)")
                 + f"; same tokens as off: {r['same_tokens_as_off']}")
  return output.record(result, cfg.results_dir, "sharing", plot)


def plot(result: dict, path: str) -> str:
  plt = output.pyplot()
  mem, pre = result["memory"], result["prefix"]
  panels = ([("parallel", "parallel sampling"), ("beam", "beam search")] if mem else []) + (
      [("prefix", "prefix caching")] if pre else [])
  fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
  for ax, (kind, title) in zip(axes[0], panels):
    if kind == "prefix":
      names = sorted({r["workload"] for r in pre})
      x = np.arange(len(names))
      for j, on in enumerate((False, True)):
        vals = [next(r["burst_output_tokens_per_s"] for r in pre if r["workload"] == w
                     and r["prefix_caching"] == on) for w in names]
        ax.bar(x + 0.4 * j - 0.2, vals, 0.4, label=f"prefix caching {'on' if on else 'off'}")
      for i, w in enumerate(names):
        r = next(r for r in pre if r["workload"] == w and r["prefix_caching"])
        ax.annotate(f"{r['burst_speedup']:.2f}x\nhit {100 * r['burst_hit_rate']:.0f}%\n"
                    f"prefill\n-{100 * r['prefill_tokens_saved']:.0f}%",
                    (i + 0.2, 0), ha="center", va="bottom", fontsize=7, color="w")
      ax.set_xticks(x, names)
      ax.set_ylabel("output tok/s, all requests at once")
    else:
      workloads_ = sorted({r["workload"] for r in mem})
      widths = sorted({r["width"] for r in mem})
      x = np.arange(len(widths))
      for j, w in enumerate(workloads_):
        vals = [100 * next(r["saving"] for r in mem if r["workload"] == w and r["mode"] == kind
                           and r["width"] == n) for n in widths]
        ax.bar(x + 0.4 * j - 0.2, vals, 0.4, label=w)
        lo, hi = PAPER[(w, kind)]
        ax.axhspan(lo, hi, alpha=0.12, color=f"C{j}", label=f"paper, {w} (widths 2-6)")
      ax.set_xticks(x, [f"{'n' if kind == 'parallel' else 'width'} {n}" for n in widths])
      ax.set_ylabel("KV memory saved (%)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
  return output.save_figure(fig, path)


def main(_):
  from paged_jax.config import enable_compilation_cache
  enable_compilation_cache()
  run(SharingConfig(parts=tuple(_PARTS.value), num_requests=_NUM_REQUESTS.value,
                    model=_MODEL.value))


if __name__ == "__main__":
  _PARTS = flags.DEFINE_list("part", ["memory", "prefix"], "memory, prefix or both.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", SharingConfig.num_requests,
                                       "Requests per memory-saving run.")
  _MODEL = flags.DEFINE_enum("model", "embedded", list(MODELS), "Model for the prefix part.")
  app.run(main)
