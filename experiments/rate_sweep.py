"""Throughput against request rate (issue 11, item 2; the PagedAttention paper's figure 12): the
paged engine against the same engine with contiguous Max / Pow2 / Oracle reservation driving
admission, on the ShareGPT-like and Alpaca-like workloads, Poisson arrivals, one fixed KV budget.

  python -m experiments.rate_sweep                          # embedded model, both workloads
  python -m experiments.rate_sweep --model=small            # a weight-bound random Llama
  python -m experiments.rate_sweep --workloads=alpaca --num_requests=64

Each system is `paged_jax.serve` with `--reservation=paged|oracle|pow2|max` on the same requests
(same lengths, prompts and arrival times per rate) and the same budget of `kv_pages` pages; a
baseline admits a request only when a first-fit contiguous extent of its reservation fits in the
budget's slots (`SchedulerConfig.reservation`), as Orca-style systems do. Per system and
workload:

1. a burst (every request at t = 0) on a throwaway engine compiles the shapes, then a second
   burst measures the saturation throughput;
2. Poisson runs at `rate_fractions` of the paged engine's saturation rate (the same absolute
   rates for every system), each reporting the paper's normalized latency: the mean over
   sequences of (finish - arrival) / output tokens, queueing included. A run during which JAX
   traced a new shape (a batch the burst did not meet) is run again (up to 5 runs); `retraced`
   counts the shapes traced during the kept run, and a point with retraced > 0 (its latency holds
   a compile) is left out of the sustainable rate and drawn hollow.

The sustainable rate of a system is the highest rate whose normalized latency stays under a
threshold: `latency_factor` times the paged engine's normalized latency at the lowest rate (the
paper reads 1.1 s/token off GPU plots; a CPU model's scale is its step time, so the threshold is
relative to it, and printed). The crossing is interpolated linearly between swept rates; a system
that never crosses is reported as ">= the highest rate". The paper: vLLM sustains 1.7-2.7x the
rate of Orca (Oracle), 2.7-8x Orca (Max) on ShareGPT; 2-4x overall.

Models (`experiments.models`): "embedded", the tiny copy model, whose CPU step time grows nearly
in proportion to the batch, so a larger batch buys little throughput; "small", a random Llama
whose decode step is weight-bound like a GPU's, the regime in which the paper's gains arise.

Output: stdout, experiments/results/rate_sweep.jsonl (a line per run) and a figure per run:
rate_sweep.png (embedded model, both workloads), rate_sweep_small_alpaca.png, ...
"""

from __future__ import annotations

import dataclasses
import math

from absl import app, flags

from experiments import output
from experiments.models import MODELS, load_model, serve_warm

RESULTS = output.RESULTS
SYSTEMS = ("paged", "oracle", "pow2", "max")


@dataclasses.dataclass(frozen=True)
class RateConfig:
  model: str = "embedded"
  workloads: tuple[str, ...] = ("sharegpt", "alpaca")
  systems: tuple[str, ...] = SYSTEMS
  num_requests: int = 300
  kv_pages: int = 33                   # NULL_PAGE included: 32 usable pages
  page_size: int = 16
  rate_fractions: tuple[float, ...] = (0.15, 0.3, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0)
  latency_factor: float = 3.0
  seed: int = 0
  mesh: str = "1x1"                    # DATAxMODEL devices for every engine (paged_jax.sharding)
  progress: bool = True
  results_dir: str | None = RESULTS


def sustainable_rate(rates, latencies, threshold: float, valid=None) -> tuple[float, str]:
  """(rate, how): the highest rate whose latency is <= threshold, interpolated linearly at the
  first crossing; how is "interpolated", "at least" (never crossed), "below" (crossed at once)
  or "no clean run".
  Points where `valid` is False (a run that kept compiling) are left out."""
  valid = [True] * len(rates) if valid is None else list(valid)
  rates = [r for r, ok in zip(rates, valid) if ok]
  latencies = [x for x, ok in zip(latencies, valid) if ok]
  if not rates:
    return math.nan, "no clean run"
  if latencies[0] > threshold:
    return rates[0], "below"
  for i in range(1, len(rates)):
    if latencies[i] > threshold:
      r0, r1, l0, l1 = rates[i - 1], rates[i], latencies[i - 1], latencies[i]
      return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0), "interpolated"
  return rates[-1], "at least"


def run(cfg: RateConfig, model=None, progress=print) -> dict:
  from tqdm import tqdm
  from paged_jax import serve
  for s in cfg.systems:
    if s not in SYSTEMS:
      raise ValueError(f"system {s!r} is not one of {SYSTEMS}")
  if cfg.systems[0] != "paged":
    raise ValueError(f"systems={cfg.systems}: the first must be 'paged' (rates are fractions of "
                     f"its saturation rate)")
  model = model or load_model(cfg.model)
  base = dict(num_pages=cfg.kv_pages, page_size=cfg.page_size, num_requests=cfg.num_requests,
              seed=cfg.seed, progress=False, mesh=cfg.mesh)
  rows, summary = [], {}
  total = len(cfg.workloads) * len(cfg.systems) * (len(cfg.rate_fractions) + 1)
  with tqdm(total=total, disable=not cfg.progress, unit="run", desc="rate sweep") as bar:
    for w in cfg.workloads:
      rates = None
      curves = {}
      for system in cfg.systems:
        sc = serve.ServeConfig(workload=w, reservation=system, warmup="workload", **base)
        burst = serve.run(sc, model=model)
        bar.update(1)
        saturation = burst["num_requests"] / burst["seconds"]
        if rates is None:
          rates = [f * saturation for f in cfg.rate_fractions]
        points = []
        for rate in rates:
          r = serve_warm(dataclasses.replace(sc, request_rate=rate, warmup="off"), model,
                         attempts=5)
          bar.update(1)
          points.append({
              "workload": w, "system": system, "request_rate": rate,
              "normalized_latency_s": r["normalized_latency_s_per_token"],
              "output_tokens_per_s": r["output_tokens_per_s"], "seconds": r["seconds"],
              "ttft_p50_s": r["ttft_s"]["p50"], "tpot_p50_s": r["tpot_s"]["p50"],
              "mean_decode_batch": r["mean_decode_batch"], "preemptions": r["preemptions"],
              "peak_kv_usage": r["peak_kv_usage"], "retraced": r["retraced"]})
        rows.extend(points)
        curves[system] = {"saturation_req_per_s": saturation,
                          "saturation_tokens_per_s": burst["output_tokens_per_s"],
                          "saturation_mean_batch": burst["mean_decode_batch"],
                          "latency": [p["normalized_latency_s"] for p in points],
                          "clean": [p["retraced"] == 0 for p in points]}
      paged = curves["paged"]
      threshold = cfg.latency_factor * next(
          (x for x, ok in zip(paged["latency"], paged["clean"]) if ok), paged["latency"][0])
      for system, c in curves.items():
        c["sustainable_rate"], c["sustainable_how"] = sustainable_rate(
            rates, c["latency"], threshold, c["clean"])
      for system, c in curves.items():
        c["paged_ratio"] = curves["paged"]["sustainable_rate"] / c["sustainable_rate"]
      summary[w] = {"rates": rates, "threshold_s": threshold, "systems": curves}
      progress(f"{w}: threshold {1e3 * threshold:.1f} ms/token; " + "; ".join(
          f"{s} sustains {'>= ' if c['sustainable_how'] == 'at least' else ''}"
          f"{c['sustainable_rate']:.1f} req/s (paged {c['paged_ratio']:.2f}x), "
          f"saturation {c['saturation_req_per_s']:.1f} req/s at batch "
          f"{c['saturation_mean_batch']:.1f}" for s, c in curves.items()))
  result = {"config": dataclasses.asdict(cfg), "rows": rows, "summary": summary}
  figure = "_".join(["rate_sweep"] + ([] if cfg.model == "embedded" else [cfg.model]) +
                    ([] if set(cfg.workloads) == {"sharegpt", "alpaca"} else list(cfg.workloads)))
  return output.record(result, cfg.results_dir, "rate_sweep", plot, figure + ".png")


def plot(result: dict, path: str) -> str:
  plt = output.pyplot()
  cfg, summary = result["config"], result["summary"]
  fig, axes = plt.subplots(1, len(summary), figsize=(5.5 * len(summary), 3.8), squeeze=False)
  colors = {"paged": "#c33", "oracle": "#36c", "pow2": "#3a3", "max": "#888"}
  for ax, (w, s) in zip(axes[0], summary.items()):
    for system, c in s["systems"].items():
      label = (f"{system} (sustains {'>=' if c['sustainable_how'] == 'at least' else ''}"
               f"{c['sustainable_rate']:.1f}/s)")
      clean = c.get("clean", [True] * len(s["rates"]))
      pts = [(r, 1e3 * v) for r, v, ok in zip(s["rates"], c["latency"], clean) if ok]
      ax.plot(*zip(*pts), marker="o", color=colors[system], label=label)
      compiled = [(r, 1e3 * v) for r, v, ok in zip(s["rates"], c["latency"], clean) if not ok]
      if compiled:
        ax.plot(*zip(*compiled), linestyle="none", marker="o", markerfacecolor="none",
                color=colors[system])
    ax.axhline(1e3 * s["threshold_s"], color="k", linestyle=":", linewidth=0.8,
               label=f"threshold {1e3 * s['threshold_s']:.0f} ms/token")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (ms/token)")
    ax.set_title(f"{w}: {cfg['model']} model, {cfg['kv_pages'] - 1} pages x "
                 f"{cfg['page_size']} tokens", fontsize=9)
    ax.legend(fontsize=7)
  return output.save_figure(fig, path)


def main(_):
  from paged_jax import sharding
  from paged_jax.config import enable_compilation_cache
  enable_compilation_cache()
  sharding.ensure_host_devices(_MESH.value)   # before jax starts (simulated CPU devices)
  run(RateConfig(model=_MODEL.value, workloads=tuple(_WORKLOADS.value),
                 num_requests=_NUM_REQUESTS.value, kv_pages=_KV_PAGES.value,
                 latency_factor=_FACTOR.value, mesh=_MESH.value))


if __name__ == "__main__":
  _MODEL = flags.DEFINE_enum("model", "embedded", list(MODELS), "Model.")
  _WORKLOADS = flags.DEFINE_list("workloads", ["sharegpt", "alpaca"], "Workloads.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", RateConfig.num_requests,
                                       "Requests per run.")
  _KV_PAGES = flags.DEFINE_integer("kv_pages", RateConfig.kv_pages,
                                   "KV budget in pages (NULL_PAGE included).")
  _FACTOR = flags.DEFINE_float("latency_factor", RateConfig.latency_factor,
                               "Sustainable = normalized latency under this factor times the "
                               "paged engine's at the lowest rate.")
  _MESH = flags.DEFINE_string("mesh", "1x1", "DATAxMODEL devices per engine (kv_pages is per "
                              "data replica).")
  app.run(main)
