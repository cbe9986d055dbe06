"""A load test over HTTP against any OpenAI-compatible server, as its clients see it (issue 30,
item 5): ours and vLLM's side by side on one checkpoint.

  python -m experiments.http_bench --servers=paged_jax --rates=1,4 --num_requests=32  # embedded
  python -m experiments.http_bench --servers=paged_jax,vllm --model=SmolLM2.gguf --rates=0.5,1
  python -m experiments.http_bench --url=http://127.0.0.1:8000/v1 --rates=2         # any server
  python -m experiments.http_bench --num_requests=1000 --rates=16 --disconnect=0.1  # the soak

An asyncio client (httpx) replays the serve workload's requests (`paged_jax.workloads`: lengths
as in ../shared/WORKLOADS.md, token-id prompts uniform over the vocabulary, greedy, EOS ignored
so lengths hold) at each Poisson rate, streaming every completion. Each rate draws its own
prompts (seed + rate index; the same for every server), so no rate finds the last one's pages
in a prefix cache. Per request: TTFT (send to the first chunk with a choice: text, or the
finish when a request streams no text, as a token id can decode to none), TPOT ((last chunk -
first) / (tokens - 1)), end to end; per rate: p50 / p90 / p99 of each, output tokens/s and
errors. With --disconnect=F, a fraction F of the clients (chosen by the seed) close their
stream after the first chunk.

--servers launches each server here in turn on a free loopback port (`paged_jax`: our
`paged_jax.server` with --server_arg flags, stoppable rounds by default; `paged_jax_scan`:
the same with --nostoppable_rounds, for an A/B in one run; any of ours with more flags of its
own after colons, `paged_jax:--links_ahead=0`; a name may repeat, to interleave; `vllm`: vLLM's
OpenAI server from its CPU build, the venv `serve_bench` builds), all on the same Hugging Face
directory (--model; a GGUF file is written out once as one, from the engine's dequantized f32
weights, as serve_bench does) and the same scheduler knobs (--max_num_seqs,
--max_num_batched_tokens, --page_size, --kv_cache_gib).
Before the timed rates each server gets --warmup_requests of another draw at once and, with
--warmup_sweep, every rate once on other draws (compiling, allocating), untimed. Our rows count
the step programs first run during the rate (`new_programs`) and those compiled, or loaded from
the program store, while clients waited (`programs_on_demand`: not by the server's --warmup;
with the seconds they took and, from the server's log, each one's key and origin).
Our rows also split the server's mean TTFT into its queue time (arrival to the request's first
step: admission, and the step in flight when it came) and its prefill (that step's start to the
first token), from its /metrics histograms; the client's mean TTFT minus the server's is the
HTTP path's share (with --disconnect the server's means include the aborted requests).
For our server the run then reads /metrics after each rate and reports what it still holds (KV
pages in use, swap copies, open and queued requests, asyncio tasks above the idle server's),
which must all be 0. Loopback only; bounded by --num_requests and --timeout.
With vLLM among the servers, each other server's p90 TTFT and TPOT over vLLM's at each rate
are printed with a 95% bootstrap interval (`p90_ratio`: the p90 of a few dozen requests moves
by tens of ms between runs; an interval that holds 1 is a tie at this size).
Results: stdout and experiments/results/http_bench.jsonl (one row per server and rate; each
with the paper's normalized latency, end to end over output tokens, averaged, and every
request's TTFT and TPOT, `ttft_all_s` / `tpot_all_s`), and with more
than one rate experiments/results/http_bench.png (TTFT, TPOT and tokens/s against the rate).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time

from absl import app, flags
import numpy as np

FLAGS = flags.FLAGS


SERVERS = ("paged_jax", "paged_jax_scan", "paged_jax_stoppable", "vllm")
# our server under each name: the flags it adds to --server_arg (the server's own default is
# stoppable rounds; `paged_jax_scan` runs k-step scans, `paged_jax_stoppable` says it outright)
OURS = {"paged_jax": (), "paged_jax_scan": ("--nostoppable_rounds",),
        "paged_jax_stoppable": ("--stoppable_rounds",)}


def our_flags(server: str) -> tuple[str, ...] | None:
  """The flags our server named `server` adds to --server_arg ("NAME" or "NAME:FLAG:FLAG...",
  NAME one of OURS), or None when it is not ours."""
  name, *extra = server.split(":")
  return OURS[name] + tuple(extra) if name in OURS else None


@dataclasses.dataclass(frozen=True)
class HttpBenchConfig:
  url: str | None = None               # an OpenAI-compatible base URL (".../v1"); else `servers`
  servers: tuple[str, ...] = ("paged_jax",)   # launched here, in turn (SERVERS)
  model: str | None = None             # checkpoint (HF dir or GGUF); None: the embedded model
  model_name: str | None = None        # the id to send (default: the server's first)
  rates: tuple[float, ...] = (2.0,)
  num_requests: int = 32
  warmup_requests: int = 0             # sent at once, untimed, before the rates
  warmup_sweep: bool = False           # every rate once, untimed, on another draw, first
  workload: str = "sharegpt"
  max_total: int = 512                 # prompt + output tokens of a request at most
  vocab_size: int | None = None        # token ids drawn below it (default: the model's)
  disconnect: float = 0.0
  seed: int = 0
  timeout: float = 600.0               # seconds per rate
  dtype: str = "float32"
  max_num_seqs: int = 64               # the scheduler knobs, the same for both servers
  max_num_batched_tokens: int = 2048
  page_size: int = 32                  # vLLM's CPU attention takes multiples of 32 only
  kv_cache_gib: float = 1.0
  server_args: tuple[str, ...] = ()    # more flags for paged_jax.server
  vllm_args: tuple[str, ...] = ()      # more flags for vLLM's server
  vllm_python: str = ".venv-vllm/bin/python"
  model_dir: str | None = None         # where a GGUF --model is written as HF (default: a temp dir)
  results_dir: str | None = "experiments/results"
  keep_texts: bool = False             # each row keeps its requests' texts (None: not completed)


def vocab_size(cfg: HttpBenchConfig, model_dir: str | None) -> int:
  if cfg.vocab_size:
    return cfg.vocab_size
  if model_dir is None:   # the embedded model
    from paged_jax import embedded
    model_dir = embedded.EMBEDDED_MODEL_DIR
  with open(os.path.join(model_dir, "config.json")) as f:
    return json.load(f)["vocab_size"]


def requests_for(cfg: HttpBenchConfig, seed: int, vocab: int,
                 n: int | None = None) -> list[dict]:
  """`n` (default num_requests) of the workload's requests drawn with `seed`:
  {prompt (token ids), max_tokens, disconnect}."""
  from paged_jax import workloads
  n = cfg.num_requests if n is None else n
  rng = np.random.default_rng(seed)
  lens_in, lens_out = workloads.sample_lengths(rng, cfg.workload, n, max_total=cfg.max_total)
  prompts = workloads.random_prompts(rng, lens_in, vocab)
  leave = rng.random(n) < cfg.disconnect
  return [{"prompt": [int(t) for t in p], "max_tokens": int(o), "disconnect": bool(d)}
          for p, o, d in zip(prompts, lens_out, leave)]


async def one(client, url: str, model: str, req: dict) -> dict:
  """Streams one completion; its timings, tokens and error (None if it succeeded)."""
  body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
          "temperature": 0.0, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}
  t0 = time.perf_counter()
  first = last = None
  tokens, text = 0, []
  try:
    async with client.stream("POST", url + "/completions", json=body) as r:
      if r.status_code != 200:
        return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
      async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
          return {"error": str(chunk["error"])[:200]}
        if chunk.get("usage"):
          tokens = chunk["usage"]["completion_tokens"]
        if chunk.get("choices"):   # a token's text (or, at the end, the finish reason)
          text.append(chunk["choices"][0].get("text") or "")
          last = time.perf_counter()
          first = first or last
          if req["disconnect"]:
            return {"disconnected": True, "ttft": first - t0}
  except Exception as e:   # noqa: BLE001 - counted as the request's error
    return {"error": f"{type(e).__name__}: {e}"[:200]}
  if first is None:
    return {"error": "no text streamed"}
  return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens, "text": "".join(text),
          "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


def _pct(values) -> dict:
  values = [v for v in values if v is not None]
  if not values:
    return {"p50": None, "p90": None, "p99": None}
  p = np.percentile(values, [50, 90, 99])
  return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


# The bootstrap's draws and level: the p90 of 32-64 requests is their 4th-7th largest, so one run
# of a rate moves it by tens of ms; its interval says how far.
BOOTSTRAP_DRAWS = 4000
BOOTSTRAP_LEVEL = 0.95


def p90_ratio(ours, theirs, seed: int = 0) -> dict | None:
  """p90(ours) / p90(theirs) of two samples (per-request values; None entries dropped), and
  its BOOTSTRAP_LEVEL percentile-bootstrap interval (each sample resampled with replacement,
  independently: two runs of a rate draw the same requests but not the same timings).
  None when either sample is empty."""
  a = np.asarray([v for v in ours if v is not None], float)
  b = np.asarray([v for v in theirs if v is not None], float)
  if not len(a) or not len(b):
    return None
  rng = np.random.default_rng(seed)
  ra = np.percentile(a[rng.integers(0, len(a), (BOOTSTRAP_DRAWS, len(a)))], 90, axis=1)
  rb = np.percentile(b[rng.integers(0, len(b), (BOOTSTRAP_DRAWS, len(b)))], 90, axis=1)
  tail = 100 * (1 - BOOTSTRAP_LEVEL) / 2
  lo, hi = np.percentile(ra / rb, [tail, 100 - tail])
  return {"ratio": float(np.percentile(a, 90) / np.percentile(b, 90)), "low": float(lo),
          "high": float(hi)}


def compare(rows: list[dict], against: str = "vllm") -> list[str]:
  """For each row of another server, its p90 TTFT and TPOT over `against`'s at the same rate
  (the first such row), with `p90_ratio`'s interval: lines to print; rows without per-request
  values (written before they were kept) are left out."""
  base = {}
  for r in rows:
    if r["server"] == against and "ttft_all_s" in r:
      base.setdefault(r["rate"], r)
  lines = []
  for r in rows:
    other = base.get(r["rate"])
    if r["server"] == against or other is None or "ttft_all_s" not in r:
      continue
    parts = []
    for key in ("ttft", "tpot"):
      q = p90_ratio(r[key + "_all_s"], other[key + "_all_s"])
      if q is not None:
        parts.append(f"p90 {key.upper()} {q['ratio']:.2f}x ({100 * BOOTSTRAP_LEVEL:.0f}% "
                     f"interval {q['low']:.2f}-{q['high']:.2f})")
    if parts:
      lines.append(f"{r['server']} over {against} at {r['rate']:g}/s: " + ", ".join(parts))
  return lines


async def at_rate(url: str, model: str, reqs: list[dict], rate: float, seed: int,
                  timeout: float, keep_texts: bool = False) -> dict:
  """Sends `reqs` as a Poisson process at `rate` per second; the summary of their results."""
  import httpx
  from paged_jax import workloads
  arrivals = workloads.poisson_arrivals(np.random.default_rng(seed), len(reqs), rate)
  limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
  async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
    start = time.perf_counter()

    async def later(req, at):
      await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))   # the arrival time
      return await one(client, url, model, req)
    results = await asyncio.wait_for(
        asyncio.gather(*(later(r, float(t)) for r, t in zip(reqs, arrivals))), timeout)
    seconds = time.perf_counter() - start
  done = [r for r in results if "e2e" in r]
  return {"rate": rate, "requests": len(reqs), "completed": len(done), "seconds": seconds,
          "disconnected": sum("disconnected" in r for r in results),
          "errors": sum("error" in r for r in results),
          "error_examples": [r["error"] for r in results if "error" in r][:3],
          "output_tokens_per_s": sum(r["tokens"] for r in done) / seconds,
          # the paper's metric: the mean over requests of end-to-end latency / output tokens
          "normalized_latency_s": (float(np.mean([r["e2e"] / r["tokens"] for r in done]))
                                   if done else None),
          "ttft_s": _pct(r["ttft"] for r in done), "tpot_s": _pct(r["tpot"] for r in done),
          "ttft_mean_s": float(np.mean([r["ttft"] for r in done])) if done else None,
          "e2e_s": _pct(r["e2e"] for r in done),
          # per request, in the workload's order (None: not completed / one token), for intervals
          "ttft_all_s": [r["ttft"] if "e2e" in r else None for r in results],
          "tpot_all_s": [r["tpot"] if "e2e" in r else None for r in results],
          **({"texts": [r.get("text") if "e2e" in r else None for r in results]}
             if keep_texts else {})}


# Our server's histograms of TTFT and of its parts (queue, then prefill), vLLM's names.
TTFT_PARTS = ("time_to_first_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds")


def server_state(base: str) -> dict:
  """What our server holds now (its /metrics): KV pages in use, swap copies, open and queued
  requests, and the asyncio tasks in its event loop."""
  import httpx
  names = ("kv_pages_in_use", "num_swap_copies", "num_open_requests", "num_requests_running",
           "num_requests_waiting", "server_asyncio_tasks", "num_programs",
           "num_programs_on_demand", "programs_on_demand_seconds",
           "num_rounds_stopped_total") + tuple(
               f"{h}_{part}" for h in TTFT_PARTS for part in ("sum", "count"))
  state = dict.fromkeys(names, 0.0)
  for line in httpx.get(base + "/metrics").text.splitlines():
    name = line.split("{")[0].removeprefix("paged_jax:")
    if name in state:
      state[name] += float(line.rsplit(" ", 1)[1])
  return state


def leftovers(base: str, idle_tasks: float) -> dict:
  """What the server still holds after every client finished or left: each 0 when nothing
  leaked (the tasks as a count above those of the idle server, `idle_tasks`)."""
  state = server_state(base)
  state["tasks_over_idle"] = state.pop("server_asyncio_tasks") - idle_tasks
  for name in list(state):
    if "program" in name or name.endswith(("_sum", "_count", "_total")):
      del state[name]
  return state


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


class VllmServer:
  """vLLM's OpenAI server (`vllm.entrypoints.openai.api_server`, its CPU build) in a
  subprocess on a free loopback port, ready once /health answers; stopped with SIGTERM.
  Its output goes to a temporary file (the tail is in the error if it fails to start)."""

  def __init__(self, cfg: HttpBenchConfig, model_dir: str, start_timeout: float = 900.0):
    self.cfg, self.model_dir, self.start_timeout = cfg, model_dir, start_timeout
    self.proc = self.url = self.base = None

  def start(self) -> "VllmServer":
    import httpx
    from experiments import serve_bench
    why = serve_bench.ensure_vllm(self.cfg.vllm_python)
    if why:
      raise RuntimeError(f"vLLM is not available: {why}")
    c, port = self.cfg, _free_port()
    threads = os.cpu_count() or 2
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{c.kv_cache_gib:g}",
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "OMP_NUM_THREADS": str(threads)}
    cmd = [c.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", c.dtype,
           "--max-model-len", str(c.max_total), "--block-size", str(c.page_size),
           "--max-num-seqs", str(c.max_num_seqs),
           "--max-num-batched-tokens", str(c.max_num_batched_tokens),
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *c.vllm_args]
    self._log = tempfile.NamedTemporaryFile("w+", prefix="vllm_server_", suffix=".log")
    self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
    self.base = f"http://127.0.0.1:{port}"
    self.url = self.base + "/v1"
    deadline = time.monotonic() + self.start_timeout
    while True:
      if self.proc.poll() is not None or time.monotonic() > deadline:
        self._log.seek(0)
        out = self._log.read()
        errors = "\n".join(line for line in out.splitlines() if "Error:" in line)[-2000:]
        self.stop()
        raise RuntimeError(f"vLLM's server did not start (`{' '.join(cmd)}`):\n"
                           f"{errors}\n...\n{out[-2000:]}")
      try:
        if httpx.get(self.base + "/health", timeout=5).status_code == 200:
          return self
      except httpx.HTTPError:
        pass
      time.sleep(1.0)

  def stop(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)
      try:
        self.proc.wait(60)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self._log.close()


def model_dir_for(cfg: HttpBenchConfig) -> str | None:
  """The Hugging Face directory both servers read: --model itself, or for a GGUF file the one
  serve_bench writes from the engine's dequantized weights (once, into cfg.model_dir)."""
  if cfg.model is None or os.path.isdir(cfg.model):
    return cfg.model
  from experiments import serve_bench
  out = cfg.model_dir or tempfile.mkdtemp(prefix="http_bench_model_")
  os.makedirs(out, exist_ok=True)
  return serve_bench.peer_model_dir(serve_bench.BenchConfig(model=cfg.model), out)


def launch(cfg: HttpBenchConfig, server: str, model_dir: str | None):
  """A started server: ours (a ServerProcess) or vLLM's (a VllmServer)."""
  if server == "vllm":
    if model_dir is None:
      raise ValueError("servers=vllm needs --model (vLLM cannot read the embedded model)")
    return VllmServer(cfg, model_dir).start()
  if our_flags(server) is None:
    raise ValueError(f"server={server!r}: one of {SERVERS} (ours may add flags: "
                     f"paged_jax:--links_ahead=0)")
  from paged_jax.server.process import ServerProcess
  args = [f"--dtype={cfg.dtype}", f"--max_num_seqs={cfg.max_num_seqs}",
          f"--max_num_batched_tokens={cfg.max_num_batched_tokens}",
          f"--page_size={cfg.page_size}"]
  if model_dir is not None:
    args += [f"--model={model_dir}", f"--kv_cache_bytes={int(cfg.kv_cache_gib * 2 ** 30)}"]
  return ServerProcess(args + list(cfg.server_args) + list(our_flags(server)),
                       start_timeout=900.0).start()


def _summary(row: dict) -> str:
  ms = lambda d: "-" if d["p90"] is None else f"{1e3 * d['p50']:.0f}/{1e3 * d['p90']:.0f}"
  return (f"{row['server']} rate {row['rate']:g}/s: {row['completed']}/{row['requests']} "
          f"completed, {row['disconnected']} left, {row['errors']} errors; TTFT p50/p90 "
          f"{ms(row['ttft_s'])} ms, TPOT {ms(row['tpot_s'])} ms, e2e {ms(row['e2e_s'])} ms, "
          f"{row['output_tokens_per_s']:.1f} tok/s"
          + (f"; mean TTFT {1e3 * row['ttft_mean_s']:.0f} ms, the server's "
             f"{1e3 * row['server_ttft_mean_s']:.0f} = queue {1e3 * row['queue_mean_s']:.0f} + "
             f"prefill {1e3 * row['prefill_mean_s']:.0f}"
             if row.get("server_ttft_mean_s") is not None and row["ttft_mean_s"] is not None
             else "")
          + (f"; {row['new_programs']:g} new programs, {row['programs_on_demand']:g} of them "
             f"compiled or loaded while clients waited ({row['programs_on_demand_s']:.1f} s: "
             f"{'; '.join(row['on_demand_log']) or '-'}), {row['rounds_stopped']:g} rounds "
             f"stopped" if "new_programs" in row else "")
          + (f"; server holds {row['server_holds']}" if "server_holds" in row else ""))


def bench_one(cfg: HttpBenchConfig, url: str, base: str | None, name: str, vocab: int,
              progress=print, server_log=None) -> list[dict]:
  """The warm-up and every rate against the server at `url`; `base` (ours) for its /metrics,
  `server_log` (ours: a callable returning what it printed so far) for the programs it met on
  demand."""
  import httpx
  model = cfg.model_name or httpx.get(url + "/models").json()["data"][0]["id"]
  idle_tasks = server_state(base)["server_asyncio_tasks"] if base else 0.0
  if cfg.warmup_requests:
    warm = dataclasses.replace(cfg, disconnect=0.0)
    row = asyncio.run(at_rate(url, model, requests_for(warm, cfg.seed + 1000, vocab,
                                                       cfg.warmup_requests),
                              float("inf"), cfg.seed, cfg.timeout))
    progress(f"{name} warm-up: {row['completed']}/{row['requests']} in {row['seconds']:.1f} s")
  if cfg.warmup_sweep:
    for i, rate in enumerate(cfg.rates):
      row = asyncio.run(at_rate(url, model, requests_for(cfg, cfg.seed + 2000 + i, vocab), rate,
                                cfg.seed + 2000 + i, cfg.timeout))
      progress(f"{name} warm-up sweep: {_summary(dict(row, server=name))}")
  def snapshot():   # /metrics, and how much the server had printed
    return server_state(base), len(server_log()) if server_log else 0
  rows = []
  for i, rate in enumerate(cfg.rates):
    reqs = requests_for(cfg, cfg.seed + i, vocab)
    before = snapshot() if base else None
    row = asyncio.run(at_rate(url, model, reqs, rate, cfg.seed + i, cfg.timeout,
                              cfg.keep_texts))
    if base is not None:   # programs first run during this rate, and those clients waited for
      after = snapshot()
      delta = lambda name: after[0][name] - before[0][name]
      row["new_programs"] = delta("num_programs")
      row["programs_on_demand"] = delta("num_programs_on_demand")
      row["programs_on_demand_s"] = delta("programs_on_demand_seconds")
      row["rounds_stopped"] = delta("num_rounds_stopped_total")   # ended for a command
      # the server's own TTFT and its two parts, means over the requests it finished this rate
      # (aborted ones too): client TTFT - server TTFT is the HTTP path's share
      for h, key in zip(TTFT_PARTS, ("server_ttft_mean_s", "queue_mean_s", "prefill_mean_s")):
        n = delta(h + "_count")
        row[key] = delta(h + "_sum") / n if n else None
      # which ones, loaded or compiled, and how long each took (the engine's log lines)
      row["on_demand_log"] = ([ln.split("step program ", 1)[1].strip() for ln in
                               server_log()[before[1]:after[1]].splitlines()
                               if "on demand in" in ln] if server_log else [])
      # the server's next step frees what the last disconnects held
      deadline = time.monotonic() + 30
      while any(leftovers(base, idle_tasks).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
      row["server_holds"] = leftovers(base, idle_tasks)
    extra = our_flags(name)
    row.update(server=name, url=url, model=model, checkpoint=cfg.model, workload=cfg.workload,
               disconnect=cfg.disconnect, max_total=cfg.max_total, dtype=cfg.dtype,
               warmup_requests=cfg.warmup_requests, warmup_sweep=cfg.warmup_sweep,
               max_num_seqs=cfg.max_num_seqs,
               max_num_batched_tokens=cfg.max_num_batched_tokens, page_size=cfg.page_size,
               server_args=list(cfg.server_args) + list(extra) if extra is not None else
               list(cfg.vllm_args) if name == "vllm" else [])
    rows.append(row)
    progress(_summary(row))
  return rows


def plot(rows: list[dict], path: str) -> str:
  """p90 (solid) and p50 (dashed) TTFT and TPOT, and output tokens/s, against the rate, a line
  per server."""
  from experiments import output
  plt = output.pyplot()
  fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
  colors = {"paged_jax": "#c33", "paged_jax_scan": "#e83", "vllm": "#36c"}
  for name in dict.fromkeys(r["server"] for r in rows):
    mine = sorted((r for r in rows if r["server"] == name), key=lambda r: r["rate"])
    rates = [r["rate"] for r in mine]
    c = colors.get(name, "#555")
    for ax, key in zip(axes, ("ttft_s", "tpot_s")):
      for q, style in (("p90", "-"), ("p50", "--")):
        ax.plot(rates, [1e3 * r[key][q] if r[key][q] is not None else float("nan")
                        for r in mine], style, marker="o", color=c, label=f"{name} {q}")
    axes[2].plot(rates, [r["output_tokens_per_s"] for r in mine], marker="o", color=c,
                 label=name)
  first = rows[0]
  for ax, label in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output tokens/s")):
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(label)
    ax.legend(fontsize=7)
  axes[0].set_yscale("log")
  axes[1].set_title(f"{os.path.basename(first['checkpoint'] or 'embedded')}, {first['workload']}"
                    f" (max {first['max_total']} tokens), {first['requests']} requests a rate, "
                    f"{first['dtype']}", fontsize=9)
  return output.save_figure(fig, path)


def run(cfg: HttpBenchConfig, progress=print) -> list[dict]:
  """One row per server and rate (and, for our own server, what it held afterwards)."""
  model_dir = model_dir_for(cfg)
  vocab = vocab_size(cfg, model_dir)
  rows = []
  if cfg.url is not None:
    rows += bench_one(cfg, cfg.url, None, cfg.url, vocab, progress)
  else:
    for name in cfg.servers:
      server = launch(cfg, name, model_dir)
      try:
        ours = our_flags(name) is not None
        rows += bench_one(cfg, server.url, server.base if ours else None, name, vocab, progress,
                          (lambda: server.output) if ours else None)
      finally:
        server.stop()
  for line in compare(rows):
    progress(line)
  if cfg.results_dir:
    os.makedirs(cfg.results_dir, exist_ok=True)
    with open(os.path.join(cfg.results_dir, "http_bench.jsonl"), "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
    if len(cfg.rates) > 1:
      progress(f"plot: {plot(rows, os.path.join(cfg.results_dir, 'http_bench.png'))}")
  return rows


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per request
  f = FLAGS
  cfg = HttpBenchConfig(
      url=f.url, servers=tuple(f.servers), model=f.model, model_name=f.model_name,
      rates=tuple(float(r) for r in f.rates), num_requests=f.num_requests,
      warmup_requests=f.warmup_requests, warmup_sweep=f.warmup_sweep, workload=f.workload, max_total=f.max_total,
      vocab_size=f.vocab_size, disconnect=f.disconnect, seed=f.seed, timeout=f.timeout,
      dtype=f.dtype, max_num_seqs=f.max_num_seqs,
      max_num_batched_tokens=f.max_num_batched_tokens, page_size=f.page_size,
      kv_cache_gib=f.kv_cache_gib, server_args=tuple(f.server_arg or ()),
      vllm_args=tuple(f.vllm_arg or ()), model_dir=f.model_dir,
      results_dir=f.results_dir or None)
  run(cfg)


if __name__ == "__main__":
  flags.DEFINE_string("url", None, "An OpenAI-compatible base URL (http://127.0.0.1:8000/v1); "
                      "else --servers are launched here.")
  flags.DEFINE_list("servers", ["paged_jax"], f"Servers to launch, in turn: {SERVERS}.")
  flags.DEFINE_string("model", None, "Checkpoint (HF dir or GGUF) for both servers "
                      "(default: the embedded model; vllm needs one).")
  flags.DEFINE_string("model_dir", None, "Where a GGUF --model is written as HF (reused).")
  flags.DEFINE_multi_string("server_arg", None, "Another flag for paged_jax.server (repeat).")
  flags.DEFINE_multi_string("vllm_arg", None, "Another flag for vLLM's server (repeat).")
  flags.DEFINE_string("model_name", None, "The model id to send (default: the server's first).")
  flags.DEFINE_list("rates", ["2"], "Poisson request rates per second, one run each.")
  flags.DEFINE_integer("num_requests", 32, "Requests per rate.")
  flags.DEFINE_integer("warmup_requests", 0, "Requests sent at once, untimed, before the rates.")
  flags.DEFINE_bool("warmup_sweep", False, "Every rate once, untimed, on another draw, first.")
  flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Request lengths.")
  flags.DEFINE_integer("max_total", 512, "Most prompt + output tokens per request.")
  flags.DEFINE_integer("vocab_size", None, "Prompt token ids below this (default: the model's).")
  flags.DEFINE_float("disconnect", 0.0, "Share of clients that leave after the first chunk.")
  flags.DEFINE_integer("seed", 0, "Workload, arrivals and disconnects.")
  flags.DEFINE_float("timeout", 600.0, "Seconds per rate at most.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Both servers' dtype.")
  flags.DEFINE_integer("max_num_seqs", 64, "Most sequences per step (both servers).")
  flags.DEFINE_integer("max_num_batched_tokens", 2048, "Token budget per step (both servers).")
  flags.DEFINE_integer("page_size", 32, "Tokens per page / vLLM's block size (its CPU "
                       "attention: a multiple of 32).")
  flags.DEFINE_float("kv_cache_gib", 1.0, "KV cache GiB (both servers; ours: only with --model).")
  flags.DEFINE_string("results_dir", "experiments/results", "Where the JSONL goes ('' = none).")
  app.run(main)
