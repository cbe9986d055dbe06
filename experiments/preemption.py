"""Preemption (issue 11, item 5): swap against recompute per preempted sequence across page sizes
(the PagedAttention paper's figure 19), and what preemption costs a serving run under overload.

  python -m experiments.preemption                       # small random Llama, both parts
  python -m experiments.preemption --model=embedded --page_sizes=4,16,64

Per preempted sequence (a microbenchmark, as the paper's figure 19): a sequence of `seq_len`
tokens, for each page size:
  swap       the engine's swap-out then swap-in of its pages: `page_ops.read_pages` (device ->
             host NumPy) and `page_ops.write_pages` (host -> device), median of `reps`;
  recompute  the engine's prefill of its tokens: one `Engine.step` running the prompt of
             `seq_len` tokens (a warm engine; the one sampled token is part of the step), median.
The paper (A100, PCIe): swapping pays per block, so small blocks make it slow and the overhead
falls as blocks grow; recompute does not depend on the block size and wins at small blocks. Here
the pages of a swap move in one gather / one scatter whatever their number, and device and host
are the same memory, so the page size barely matters to swap (see the results page).

Under overload: the same burst of `num_requests` requests through `paged_jax.serve` with a pool
too small for them (`tight_pages`), preempting by recompute and by swap, against a pool that
never preempts (`ample_pages`), and against the same tight budget admitted conservatively
(`reservation="oracle"`: a request is admitted only when its whole final length fits, so nothing
is ever preempted, at the price of a smaller batch): output tokens/s, preemptions, pages
swapped, tokens recomputed, mean batch, and the throughput each keeps relative to the ample
pool.

Output: stdout, experiments/results/preemption.{jsonl,png}.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import numpy as np

from experiments import output
from experiments.models import MODELS, load_model, serve_warm

RESULTS = output.RESULTS


@dataclasses.dataclass(frozen=True)
class PreemptionConfig:
  model: str = "small"
  page_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
  seq_len: int = 256
  reps: int = 5
  workload: str = "alpaca"
  num_requests: int = 64
  tight_pages: int = 33
  ample_pages: int = 1025
  seed: int = 0
  results_dir: str | None = RESULTS


def _median_s(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def per_sequence(cfg: PreemptionConfig, model, page_size: int) -> dict:
  """Swap (out + in) and recompute time of one preempted sequence of seq_len tokens."""
  import jax
  from paged_jax import page_ops
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  params, mcfg, _, _ = model
  if cfg.seq_len + 1 > mcfg.max_position:
    raise ValueError(f"seq_len={cfg.seq_len} + 1 exceeds the model's max_position "
                     f"{mcfg.max_position}")
  n = -(-cfg.seq_len // page_size)
  engine = Engine(params, mcfg, cache=CacheConfig(page_size=page_size, num_pages=2 * n + 2,
                                                  enable_prefix_caching=False),
                  scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                            steps_per_sync=1),
                  impl="xla", eos_token_ids=(), validate_tables=False)
  rng = np.random.default_rng(cfg.seed)

  def prefill():
    engine.add_request(rng.integers(0, mcfg.vocab_size, cfg.seq_len).tolist(),
                       SamplingParams(max_tokens=1))
    while engine.has_unfinished():
      engine.step()

  prefill()                                   # compiles the step
  recompute = _median_s(prefill, cfg.reps)
  pages = rng.permutation(np.arange(1, 2 * n + 2))[:n]   # scattered, as a pool's pages are

  def swap():
    arrays = page_ops.read_pages(engine.pool, pages)
    engine.pool = page_ops.write_pages(engine.pool, pages, *arrays)
    jax.block_until_ready(engine.pool.k)

  swap()                                      # compiles the gather and the scatter
  swap_s = _median_s(swap, cfg.reps)
  kv_bytes = 2 * mcfg.num_layers * n * page_size * mcfg.num_kv_heads * mcfg.head_dim * 4
  return {"page_size": page_size, "pages": n, "swap_ms": 1e3 * swap_s,
          "recompute_ms": 1e3 * recompute, "swap_bytes": 2 * kv_bytes,
          "swap_gb_per_s": 2 * kv_bytes / swap_s / 1e9}


def overload(cfg: PreemptionConfig, model) -> list[dict]:
  from paged_jax import serve
  rows = []
  for label, pages, mode, reservation in (
      ("no preemption", cfg.ample_pages, "recompute", "paged"),
      ("recompute", cfg.tight_pages, "recompute", "paged"),
      ("swap", cfg.tight_pages, "swap", "paged"),
      ("oracle reservation", cfg.tight_pages, "recompute", "oracle")):
    sc = serve.ServeConfig(workload=cfg.workload, num_requests=cfg.num_requests, num_pages=pages,
                           preemption_mode=mode, reservation=reservation, seed=cfg.seed,
                           warmup="workload", progress=False, enable_prefix_caching=False)
    r = serve_warm(sc, model)
    rows.append({"run": label, "num_pages": pages, "preemption_mode": mode,
                 "reservation": reservation, "mean_decode_batch": r["mean_decode_batch"],
                 "output_tokens_per_s": r["output_tokens_per_s"], "seconds": r["seconds"],
                 "preemptions": r["preemptions"], "swapped_out_pages": r["swapped_out_pages"],
                 "recomputed_tokens": r["recomputed_tokens"], "retraced": r["retraced"],
                 "tokens": [c["token_ids"] for c in r["completions"]]})
  base = rows[0]
  for r in rows:
    r["throughput_vs_no_preemption"] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    r["same_tokens_as_no_preemption"] = r["tokens"] == base["tokens"]
  for r in rows:
    del r["tokens"]
  return rows


def run(cfg: PreemptionConfig, model=None, progress=print) -> dict:
  model = model or load_model(cfg.model)
  micro = []
  for ps in cfg.page_sizes:
    micro.append(per_sequence(cfg, model, ps))
    m = micro[-1]
    progress(f"page {ps:4d}: swap {m['swap_ms']:.3f} ms ({m['pages']} pages, "
             f"{m['swap_gb_per_s']:.2f} GB/s), recompute {m['recompute_ms']:.3f} ms")
  rows = overload(cfg, model)
  for r in rows:
    progress(f"{r['run']:18s} {r['num_pages']:5d} pages: {r['output_tokens_per_s']:.0f} tok/s "
             f"({r['throughput_vs_no_preemption']:.2f}x), {r['preemptions']} preemptions, "
             f"{r['swapped_out_pages']} pages swapped, {r['recomputed_tokens']} tokens "
             f"recomputed, batch {r['mean_decode_batch']:.1f}, same tokens: "
             f"{r['same_tokens_as_no_preemption']}")
  result = {"config": dataclasses.asdict(cfg), "per_sequence": micro, "overload": rows}
  return output.record(result, cfg.results_dir, "preemption", plot)


def plot(result: dict, path: str) -> str:
  plt = output.pyplot()
  cfg, micro, rows = result["config"], result["per_sequence"], result["overload"]
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
  x = [m["page_size"] for m in micro]
  axes[0].plot(x, [m["swap_ms"] for m in micro], marker="o", label="swap (out + in)")
  axes[0].plot(x, [m["recompute_ms"] for m in micro], marker="s", label="recompute (prefill)")
  axes[0].set_xscale("log", base=2)
  axes[0].set_yscale("log")
  axes[0].set_xlabel("page size (tokens)")
  axes[0].set_ylabel("ms per preempted sequence")
  axes[0].set_title(f"{cfg['model']} model, {cfg['seq_len']}-token sequence", fontsize=9)
  axes[0].legend(fontsize=8)
  axes[1].bar([r["run"].replace(" ", "\n") for r in rows],
              [r["output_tokens_per_s"] for r in rows], color=["#888", "#36c", "#c63", "#3a3"])
  for i, r in enumerate(rows):
    axes[1].annotate(f"{r['throughput_vs_no_preemption']:.2f}x\n{r['preemptions']} preempted\n"
                     f"batch {r['mean_decode_batch']:.1f}",
                     (i, r["output_tokens_per_s"]), ha="center", va="top", fontsize=8, color="w")
  axes[1].set_ylabel("output tok/s")
  axes[1].set_title(f"{cfg['num_requests']} {cfg['workload']} requests at once; pool "
                    f"{cfg['tight_pages'] - 1} vs {cfg['ample_pages'] - 1} pages", fontsize=9)
  return output.save_figure(fig, path)


def main(_):
  from paged_jax.config import enable_compilation_cache
  enable_compilation_cache()
  run(PreemptionConfig(model=_MODEL.value, page_sizes=tuple(int(p) for p in _PAGE_SIZES.value),
                       num_requests=_NUM_REQUESTS.value))


if __name__ == "__main__":
  _MODEL = flags.DEFINE_enum("model", "small", list(MODELS), "Model.")
  _PAGE_SIZES = flags.DEFINE_list("page_sizes", ["1", "2", "4", "8", "16", "32", "64", "128",
                                                 "256"], "Page sizes.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", PreemptionConfig.num_requests,
                                       "Requests in the overload burst.")
  app.run(main)
