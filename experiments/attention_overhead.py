"""Paged against contiguous attention across context lengths and batch sizes (issue 11, item 6;
the PagedAttention paper's kernel microbenchmark, which reports 20-26% overhead for its GPU kernel).

  python -m experiments.attention_overhead                          # decode, CPU (XLA path)
  python -m experiments.attention_overhead --seq_lens=256,1024 --batch_sizes=8,32

Each point runs `attention_bench` on one shape with two paths over the same K/V, timed
interleaved (median of rounds): `contiguous_attention` (contiguous K/V, the XLA blocked loop) and
`paged_attention_xla` (the same loop reading pages through shuffled block tables). Overhead =
paged / contiguous - 1. GPU rows for the Pallas kernel come from `experiments/gpu_check.sh`
(`attention_bench --preset=gpu`), when a GPU has run it: this script reads any such records from
experiments/results/attention_bench_gpu.jsonl if present and lists them beside the CPU points.
Output: stdout, experiments/results/attention_overhead.{jsonl,png}.
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags

from experiments import attention_bench, output

RESULTS = output.RESULTS


@dataclasses.dataclass(frozen=True)
class OverheadConfig:
  seq_lens: tuple[int, ...] = (128, 512, 2048)
  batch_sizes: tuple[int, ...] = (1, 8, 32)
  page_size: int = 16
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64
  rounds: int = 5
  iters: int = 5
  results_dir: str | None = RESULTS


def paged_vs_contiguous(copy_bytes_per_s: float, **shape) -> dict:
  """One decode shape (attention_bench.BenchConfig fields) through both paths, checked against
  the reference and timed side by side: contiguous_ms, paged_ms, overhead, max_abs_err."""
  bench = attention_bench.BenchConfig(q_len=1, impls=("dense_blocked", "paged_xla"),
                                      baseline="dense_blocked", **shape)
  records = {r["impl"]: r for r in attention_bench.run(bench, copy_bytes_per_s=copy_bytes_per_s)}
  paged, dense = records["paged_xla"], records["dense_blocked"]
  return dict(contiguous_ms=dense["ms"], paged_ms=paged["ms"],
              overhead=paged["ms"] / dense["ms"] - 1, max_abs_err=paged["max_abs_err"])


def run(cfg: OverheadConfig, progress=print) -> dict:
  copy_bw = attention_bench.copy_bandwidth()
  points = []
  for batch in cfg.batch_sizes:
    for seq_len in cfg.seq_lens:
      point = dict(batch=batch, seq_len=seq_len, **paged_vs_contiguous(
          copy_bw, num_seqs=batch, seq_len=seq_len, page_size=cfg.page_size,
          num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
          rounds=cfg.rounds, iters=cfg.iters))
      points.append(point)
      progress(f"batch {batch:3d} x {seq_len:5d} tokens: contiguous {point['contiguous_ms']:8.3f} "
               f"ms, paged {point['paged_ms']:8.3f} ms, overhead {100 * point['overhead']:+6.1f}%")
  gpu = _gpu_records(cfg.results_dir)
  result = {"config": dataclasses.asdict(cfg), "points": points, "gpu_records": gpu}
  return output.record(result, cfg.results_dir, "attention_overhead", plot)


def _gpu_records(results_dir: str | None) -> list[dict]:
  """Records of a GPU run of attention_bench (gpu_check.sh), if one was copied here."""
  path = results_dir and os.path.join(results_dir, "attention_bench_gpu.jsonl")
  if not path or not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def plot(result: dict, path: str) -> str:
  plt = output.pyplot()
  fig, ax = plt.subplots(figsize=(6, 3.4))
  points = result["points"]
  for batch in sorted({p["batch"] for p in points}):
    row = [p for p in points if p["batch"] == batch]
    ax.plot([p["seq_len"] for p in row], [100 * p["overhead"] for p in row], marker="o",
            label=f"batch {batch}")
  ax.axhspan(20, 26, color="#f4d4a4", alpha=0.6, label="paper's GPU kernel: 20-26%")
  ax.axhline(0, color="#555", linewidth=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("context length (tokens)")
  ax.set_ylabel("paged / contiguous - 1 (%)")
  ax.set_title("Decode attention overhead of paging (XLA path, CPU)")
  ax.legend(fontsize=8)
  return output.save_figure(fig, path)


def main(_):
  cfg = OverheadConfig(seq_lens=tuple(int(x) for x in _SEQ_LENS.value),
                       batch_sizes=tuple(int(x) for x in _BATCH_SIZES.value))
  r = run(cfg)
  if r["gpu_records"]:
    print(f"{len(r['gpu_records'])} GPU records from gpu_check.sh are in the JSONL")
  else:
    print("no GPU records (experiments/results/attention_bench_gpu.jsonl): no GPU has run "
          "gpu_check.sh yet")


if __name__ == "__main__":
  _SEQ_LENS = flags.DEFINE_list("seq_lens", ["128", "512", "2048"], "Context lengths.")
  _BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "Batch sizes.")
  app.run(main)
