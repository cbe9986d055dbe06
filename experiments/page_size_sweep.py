"""Page size sweep (issue 11, item 3): memory waste, engine throughput and attention time for page
sizes 1 to 128, on the ShareGPT-like and Alpaca-like workloads.

  python -m experiments.page_size_sweep
  python -m experiments.page_size_sweep --page_sizes=4,16,64 --num_requests=32
  python -m experiments.page_size_sweep --max_tokens=8   # serving runs capped at 8 output tokens

Three measurements per page size:
  waste        1 - the share of reserved KV slots that hold token states, averaged over the steps
               of `allocator_waste`'s simulation (paged allocation, 1,000 requests, 32,768 slots),
               beside the last-page waste WORKLOADS.md computed from the real length data;
  throughput   output tokens/s of `paged_jax.serve` on the embedded model (the synthetic workload
               drawn within its 128-token context), compiling excluded (--warmup);
  attention    ms of one decode attention call through `paged_attention_xla`, and of
               `contiguous_attention` on the same K/V (8 sequences x 1,024 tokens, 8 q / 2 kv
               heads, head_dim 64), timed side by side by `attention_bench`.
Output: stdout, experiments/results/page_size_sweep.{jsonl,png}.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from experiments import allocator_waste, attention_bench, attention_overhead, output

RESULTS = output.RESULTS

# WORKLOADS.md: time-averaged last-page waste from the real length data (page sizes 8-256).
REAL_DATA_WASTE = {"sharegpt": {8: 0.0075, 16: 0.0160, 32: 0.0326, 64: 0.0640, 128: 0.122},
                   "alpaca": {8: 0.0424, 16: 0.0869, 32: 0.160, 64: 0.285, 128: 0.475}}


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  page_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
  workloads: tuple[str, ...] = ("sharegpt", "alpaca")
  waste_requests: int = 1000
  serve_requests: int = 64
  serve_max_tokens: int | None = None   # None: each request's own output length (the workload's)
  attention_seqs: int = 8
  attention_len: int = 1024
  attention_head_dim: int = 64
  rounds: int = 5
  results_dir: str | None = RESULTS


def run(cfg: SweepConfig, progress=print) -> dict:
  from paged_jax import serve
  model = serve.load_model(serve.ServeConfig())
  copy_bw = attention_bench.copy_bandwidth()
  rows = []
  for ps in cfg.page_sizes:
    row = {"page_size": ps}
    for w in cfg.workloads:
      sim = allocator_waste.simulate(allocator_waste.WasteConfig(
          workload=w, num_requests=cfg.waste_requests, page_size=ps), "paged")
      row[f"{w}_waste"] = 1 - sim["token_state_fraction"]
      row[f"{w}_real_data_waste"] = REAL_DATA_WASTE[w].get(ps)
      r = serve.run(serve.ServeConfig(workload=w, num_requests=cfg.serve_requests, page_size=ps,
                                      max_tokens=cfg.serve_max_tokens, warmup="workload",
                                      progress=False), model=model)
      row[f"{w}_tokens_per_s"] = r["output_tokens_per_s"]
    a = attention_overhead.paged_vs_contiguous(
        copy_bw, num_seqs=cfg.attention_seqs, seq_len=cfg.attention_len, page_size=ps,
        head_dim=cfg.attention_head_dim, rounds=cfg.rounds, iters=3)
    row["attention_paged_ms"] = a["paged_ms"]
    row["attention_contiguous_ms"] = a["contiguous_ms"]
    row["attention_max_abs_err"] = a["max_abs_err"]
    rows.append(row)
    progress(f"page {ps:4d}: " + ", ".join(
        f"{w} waste {100 * row[f'{w}_waste']:.2f}% / {row[f'{w}_tokens_per_s']:.0f} tok/s"
        for w in cfg.workloads) + f"; attention {row['attention_paged_ms']:.3f} ms paged, "
        f"{row['attention_contiguous_ms']:.3f} ms contiguous")
  result = {"config": dataclasses.asdict(cfg), "rows": rows}
  return output.record(result, cfg.results_dir, "page_size_sweep", plot)


def plot(result: dict, path: str) -> str:
  plt = output.pyplot()
  rows, cfg = result["rows"], result["config"]
  x = [r["page_size"] for r in rows]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
  for w, color in zip(cfg["workloads"], ("#48c", "#c84")):
    axes[0].plot(x, [100 * r[f"{w}_waste"] for r in rows], marker="o", color=color,
                 label=f"{w} (simulated)")
    real = [(r["page_size"], 100 * r[f"{w}_real_data_waste"]) for r in rows
            if r[f"{w}_real_data_waste"] is not None]
    if real:
      axes[0].plot(*zip(*real), linestyle="--", marker="x", color=color,
                   label=f"{w} (real data, WORKLOADS.md)")
    axes[1].plot(x, [r[f"{w}_tokens_per_s"] for r in rows], marker="o", color=color, label=w)
  axes[2].plot(x, [r["attention_paged_ms"] for r in rows], marker="o", label="paged (XLA)")
  axes[2].plot(x, [r["attention_contiguous_ms"] for r in rows], marker="o", label="contiguous")
  titles = ("KV waste (%)", "engine output tok/s (embedded model)",
            f"decode attention ms ({cfg['attention_seqs']} x {cfg['attention_len']} tokens)")
  for ax, title in zip(axes, titles):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("page size (tokens)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
  return output.save_figure(fig, path)


def main(_):
  run(SweepConfig(page_sizes=tuple(int(p) for p in _PAGE_SIZES.value),
                  serve_requests=_NUM_REQUESTS.value, serve_max_tokens=_MAX_TOKENS.value))


if __name__ == "__main__":
  _PAGE_SIZES = flags.DEFINE_list("page_sizes", ["1", "2", "4", "8", "16", "32", "64", "128"],
                                  "Page sizes.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", SweepConfig.serve_requests,
                                       "Requests per serving run.")
  _MAX_TOKENS = flags.DEFINE_integer("max_tokens", None, "Output tokens per request in the "
                                     "serving runs (default: the workload's own lengths).")
  app.run(main)
