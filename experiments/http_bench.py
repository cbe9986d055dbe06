"""A load test over HTTP against any OpenAI-compatible server, as its clients see it (issue 30,
item 5).

  python -m experiments.http_bench --launch --rates=1,4 --num_requests=32       # our server
  python -m experiments.http_bench --url=http://127.0.0.1:8000/v1 --model=NAME --rates=2
  python -m experiments.http_bench --launch --num_requests=1000 --rates=8 --disconnect=0.1

An asyncio client (httpx) replays the serve workload's requests (`paged_jax.workloads`: lengths
as in ../shared/WORKLOADS.md, token-id prompts, EOS ignored so lengths hold) at each Poisson
rate, streaming every completion. Per request: TTFT (send to the first chunk with a choice: text,
or the finish when a request streams no text, as a token id can decode to none), TPOT
((last chunk - first) / (tokens - 1)), end to end; per rate: p50 / p90 / p99 of each, output
tokens/s and errors. With --disconnect=F, a fraction F of the clients (chosen by the seed) close
their stream after the first chunk; with --launch (our server, started here in a subprocess) the
run then reads /metrics and reports what the server still holds (KV pages in use, swap copies,
open requests, asyncio tasks above the idle server's), which must be 0. Loopback only; bounded by --num_requests and --timeout.
Results: stdout and experiments/results/http_bench.jsonl.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

from absl import app, flags
import numpy as np

FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class HttpBenchConfig:
  url: str | None = None               # an OpenAI-compatible base URL (".../v1"); None: --launch
  model: str | None = None             # the model id to send (default: the server's first)
  rates: tuple[float, ...] = (2.0,)
  num_requests: int = 32
  workload: str = "sharegpt"
  max_total: int = 512                 # prompt + output tokens of a request at most
  vocab_size: int = 32                 # token ids drawn below it (the model's vocabulary)
  disconnect: float = 0.0
  seed: int = 0
  timeout: float = 600.0               # seconds per rate
  server_args: tuple[str, ...] = ()    # --launch: flags for paged_jax.server
  results_dir: str | None = "experiments/results"


def requests_for(cfg: HttpBenchConfig) -> list[dict]:
  """The workload's requests: {prompt (token ids), max_tokens, disconnect}."""
  from paged_jax import workloads
  rng = np.random.default_rng(cfg.seed)
  lens_in, lens_out = workloads.sample_lengths(rng, cfg.workload, cfg.num_requests,
                                               max_total=cfg.max_total)
  prompts = workloads.random_prompts(rng, lens_in, cfg.vocab_size)
  leave = rng.random(cfg.num_requests) < cfg.disconnect
  return [{"prompt": [int(t) for t in p], "max_tokens": int(o), "disconnect": bool(d)}
          for p, o, d in zip(prompts, lens_out, leave)]


async def one(client, url: str, model: str, req: dict) -> dict:
  """Streams one completion; its timings, tokens and error (None if it succeeded)."""
  body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
          "temperature": 0.0, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}
  t0 = time.perf_counter()
  first = last = None
  tokens = 0
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
          last = time.perf_counter()
          first = first or last
          if req["disconnect"]:
            return {"disconnected": True, "ttft": first - t0}
  except Exception as e:   # noqa: BLE001 - counted as the request's error
    return {"error": f"{type(e).__name__}: {e}"[:200]}
  if first is None:
    return {"error": "no text streamed"}
  return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens,
          "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


def _pct(values) -> dict:
  values = [v for v in values if v is not None]
  if not values:
    return {"p50": None, "p90": None, "p99": None}
  p = np.percentile(values, [50, 90, 99])
  return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


async def at_rate(url: str, model: str, reqs: list[dict], rate: float, seed: int,
                  timeout: float) -> dict:
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
          "ttft_s": _pct(r["ttft"] for r in done), "tpot_s": _pct(r["tpot"] for r in done),
          "e2e_s": _pct(r["e2e"] for r in done)}


def server_state(base: str) -> dict:
  """What our server holds now (its /metrics): KV pages in use, swap copies, open and queued
  requests, and the asyncio tasks in its event loop."""
  import httpx
  names = ("kv_pages_in_use", "num_swap_copies", "num_open_requests", "num_requests_running",
           "num_requests_waiting", "server_asyncio_tasks")
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
  return state


def run(cfg: HttpBenchConfig, progress=print) -> list[dict]:
  """One row per rate (and, for our own server, what it held afterwards)."""
  import httpx
  from paged_jax.server.process import ServerProcess
  server = None
  url = cfg.url
  if url is None:
    server = ServerProcess(list(cfg.server_args)).start()
    url = server.url
  try:
    model = cfg.model or httpx.get(url + "/models").json()["data"][0]["id"]
    idle_tasks = server_state(server.base)["server_asyncio_tasks"] if server else 0.0
    reqs = requests_for(cfg)
    rows = []
    for i, rate in enumerate(cfg.rates):
      row = asyncio.run(at_rate(url, model, reqs, rate, cfg.seed + i, cfg.timeout))
      if server is not None:   # the server's next step frees what the last disconnects held
        deadline = time.monotonic() + 30
        while (any(leftovers(server.base, idle_tasks).values())
               and time.monotonic() < deadline):
          time.sleep(0.1)
        row["server_holds"] = leftovers(server.base, idle_tasks)
      row.update(url=url, model=model, workload=cfg.workload, disconnect=cfg.disconnect,
                 server="paged_jax" if server is not None else cfg.url,
                 server_args=list(cfg.server_args))
      rows.append(row)
      ms = lambda d: "-" if d["p90"] is None else f"{1e3 * d['p50']:.0f}/{1e3 * d['p90']:.0f}"
      progress(f"rate {rate:g}/s: {row['completed']}/{row['requests']} completed, "
               f"{row['disconnected']} left, {row['errors']} errors; TTFT p50/p90 "
               f"{ms(row['ttft_s'])} ms, TPOT {ms(row['tpot_s'])} ms, "
               f"{row['output_tokens_per_s']:.1f} tok/s"
               + (f"; server holds {row['server_holds']}" if server is not None else ""))
  finally:
    if server is not None:
      server.stop()
  if cfg.results_dir:
    os.makedirs(cfg.results_dir, exist_ok=True)
    with open(os.path.join(cfg.results_dir, "http_bench.jsonl"), "a") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")
  return rows


def main(argv):
  del argv
  if FLAGS.url is None and not FLAGS.launch:
    raise app.UsageError("give --url=... (any OpenAI-compatible server) or --launch (ours)")
  cfg = HttpBenchConfig(
      url=None if FLAGS.launch else FLAGS.url, model=FLAGS.model_name,
      rates=tuple(float(r) for r in FLAGS.rates), num_requests=FLAGS.num_requests,
      workload=FLAGS.workload, max_total=FLAGS.max_total, vocab_size=FLAGS.vocab_size,
      disconnect=FLAGS.disconnect, seed=FLAGS.seed, timeout=FLAGS.timeout,
      server_args=tuple(FLAGS.server_arg or ()), results_dir=FLAGS.results_dir or None)
  run(cfg)


if __name__ == "__main__":
  flags.DEFINE_string("url", None, "An OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1.")
  flags.DEFINE_bool("launch", False, "Start paged_jax.server here (with --server_arg flags).")
  flags.DEFINE_multi_string("server_arg", None, "A flag for the launched server (repeat).")
  flags.DEFINE_string("model_name", None, "The model id to send (default: the server's first).")
  flags.DEFINE_list("rates", ["2"], "Poisson request rates per second, one run each.")
  flags.DEFINE_integer("num_requests", 32, "Requests per rate.")
  flags.DEFINE_enum("workload", "sharegpt", ["sharegpt", "alpaca"], "Request lengths.")
  flags.DEFINE_integer("max_total", 512, "Most prompt + output tokens per request.")
  flags.DEFINE_integer("vocab_size", 32, "Prompt token ids are drawn below this.")
  flags.DEFINE_float("disconnect", 0.0, "Share of clients that leave after the first chunk.")
  flags.DEFINE_integer("seed", 0, "Workload, arrivals and disconnects.")
  flags.DEFINE_float("timeout", 600.0, "Seconds per rate at most.")
  flags.DEFINE_string("results_dir", "experiments/results", "Where the JSONL goes ('' = none).")
  app.run(main)
