"""Serve requests through the engine; report throughput, latency, KV usage and cache hits.

  python -m paged_jax.serve                              # embedded model, ShareGPT-like workload
  python -m paged_jax.serve --prompt="h e l l o" --prompt="p a g e d"   # the embedded copy model
  python -m paged_jax.serve --model=/path/to/hf_dir --prompts_file=requests.jsonl
  python -m paged_jax.serve --workload=alpaca --num_requests=500 --request_rate=20 --json=out.json
  python -m paged_jax.serve --num_pages=33 --reservation=max  # a contiguous baseline of the paper
  python -m paged_jax.serve --model=SmolLM2-135M-Instruct.Q4_1.gguf --chat --stream \
      --prompt="What is the capital of France?"               # chat with a real model

Requests come from --prompt flags (text, through the checkpoint's tokenizer), from a JSONL file
(one object per line: "prompt" text, "prompt_token_ids" or chat "messages", and optionally
max_tokens, temperature, top_k, top_p, n, beam_width, seed, ignore_eos), or from a synthetic
workload (lengths as in
../shared/WORKLOADS.md, token ids uniform over the vocabulary, EOS ignored so lengths hold).
With --chat, each --prompt is a user turn; it and every "messages" line go through the
checkpoint's chat template (`paged_jax.chat`), and completions stop at the template's end of turn.
--stream prints the text as it is generated. --model takes a Hugging Face directory or a GGUF
file. They arrive as a Poisson process at --request_rate (inf: all at once). At the end: input and
output tokens/s, TTFT and TPOT percentiles (p50 / p90 / p99), the paper's normalized latency,
peak KV usage, prefix-cache hit rate and preemptions; --json writes the same as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from absl import app, flags
import jax
import numpy as np

from paged_jax import chat as chat_lib
from paged_jax import (attention, checkpoint, data_parallel, embedded, matmul, sharding,
                       workloads)
from paged_jax.config import DEFAULT_COMPILATION_CACHE, CacheConfig, enable_compilation_cache
from paged_jax.engine import WARMUP_SCOPES, Engine
from paged_jax.program_store import DEFAULT_PROGRAM_STORE
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

WARMUPS = ("off",) + WARMUP_SCOPES + ("workload",)
_SAMPLING_KEYS = ("max_tokens", "temperature", "top_k", "top_p", "n", "beam_width", "seed",
                  "ignore_eos", "logprobs", "length_penalty", "stop_token_ids")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """Everything `run` needs; `main` fills it from flags. See the flags for each field."""
  model_dir: str | None = None
  prompts: tuple[str, ...] = ()
  prompts_file: str | None = None
  workload: str = "sharegpt"
  num_requests: int = 64
  request_rate: float = math.inf
  max_tokens: int | None = None
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  n: int = 1
  beam_width: int = 1
  ignore_eos: bool | None = None
  page_size: int = 16
  num_pages: int | None = None
  kv_cache_bytes: int | None = None
  kv_cache_fraction: float | None = None
  kv_dtype: str = "auto"
  kv_scales: str | None = None
  max_num_seqs: int = 64
  max_num_batched_tokens: int = 2048
  steps_per_sync: int = 4
  max_prefill_rows: int | None = None
  stoppable_rounds: bool = False
  links_ahead: int = 1
  preemption_mode: str = "recompute"
  reservation: str = "paged"
  enable_prefix_caching: bool = True
  impl: str = "auto"
  dtype: str = "float32"
  matmul: str = "xla"
  seed: int = 0
  warmup: str = "off"
  progress: bool = True
  validate_tables: bool = False
  scrub_freed_pages: bool = False
  mesh: str = "1x1"
  scan_layers: bool = False
  fuse_projections: bool = False
  program_store: str | None = None
  chat: bool = False
  stream: bool = False


@dataclasses.dataclass
class _Request:
  prompt: list[int]
  params: SamplingParams
  arrival: float


def load_model(cfg: ServeConfig):
  """(params, model config, tokenizer, eos ids) of --model or the embedded model."""
  path = cfg.model_dir or embedded.EMBEDDED_MODEL_DIR
  # Stacked for --scan_layers here, not by the engine: from a GGUF's cache that is no copy.
  params, mcfg, tokenizer = checkpoint.load_checkpoint(path, cfg.dtype, stacked=cfg.scan_layers)
  if cfg.matmul != mcfg.matmul:   # how to multiply is the runner's choice, not the checkpoint's
    mcfg = dataclasses.replace(mcfg, matmul=cfg.matmul)
  return params, mcfg, tokenizer, checkpoint.load_eos_token_ids(path)


def _needs_chat(cfg: ServeConfig) -> bool:
  if cfg.chat:
    return True
  if cfg.prompts_file and not cfg.prompts:   # both: make_requests refuses them
    try:
      with open(cfg.prompts_file) as f:
        return any('"messages"' in line for line in f)
    except OSError as e:
      raise ValueError(f"--prompts_file={cfg.prompts_file}: cannot read it ({e.strerror})") from None
  return False


def make_requests(cfg: ServeConfig, mcfg, tokenizer, chat: chat_lib.Chat | None = None
                  ) -> list[_Request]:
  """The requests to serve, with arrival times (seconds from the start).

  Args:
    chat: renders --chat prompts and "messages" lines (needed for either).
  """
  rng = np.random.default_rng(cfg.seed)
  base = dict(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, n=cfg.n,
              beam_width=cfg.beam_width)
  if cfg.prompts and cfg.prompts_file:
    raise ValueError("give --prompt or --prompts_file, not both")
  specs = []   # (token ids, per-request overrides)
  if cfg.prompts:
    if tokenizer is None:
      raise ValueError("--prompt needs a tokenizer (the checkpoint has no tokenizer.json); give "
                       "token ids through --prompts_file instead")
    if cfg.chat:
      specs = [(chat.prompt_ids([{"role": "user", "content": p}]), {}) for p in cfg.prompts]
    else:
      specs = [(tokenizer.encode(p).ids, {}) for p in cfg.prompts]
  elif cfg.prompts_file:
    with open(cfg.prompts_file) as f:
      for line_no, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          obj = json.loads(line)
        except json.JSONDecodeError as e:
          raise ValueError(f"{cfg.prompts_file}:{line_no}: not JSON ({e})") from None
        if "messages" in obj:
          chat_lib.check_messages(obj["messages"], f"{cfg.prompts_file}:{line_no}: messages")
          ids = chat.prompt_ids(obj["messages"])
        elif "prompt_token_ids" in obj:
          ids = obj["prompt_token_ids"]
        elif "prompt" in obj:
          if tokenizer is None:
            raise ValueError(f"{cfg.prompts_file}:{line_no}: a text prompt needs a tokenizer; "
                             f"give prompt_token_ids")
          ids = tokenizer.encode(obj["prompt"]).ids
        else:
          raise ValueError(f"{cfg.prompts_file}:{line_no}: needs 'prompt', 'prompt_token_ids' or "
                           f"'messages'")
        unknown = set(obj) - {"prompt", "prompt_token_ids", "messages"} - set(_SAMPLING_KEYS)
        if unknown:
          raise ValueError(f"{cfg.prompts_file}:{line_no}: unknown keys {sorted(unknown)}")
        specs.append((ids, {k: obj[k] for k in _SAMPLING_KEYS if k in obj}))
  if specs:
    ignore_eos = bool(cfg.ignore_eos)
    requests = []
    for ids, over in specs:
      room = mcfg.max_position - len(ids)
      max_tokens = cfg.max_tokens or max(1, min(64, room))
      params = SamplingParams(**{**base, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
                                 **over})
      requests.append(_Request(list(ids), params, 0.0))
  else:
    lens_in, lens_out = workloads.sample_lengths(rng, cfg.workload, cfg.num_requests,
                                                 max_total=mcfg.max_position)
    prompts = workloads.random_prompts(rng, lens_in, mcfg.vocab_size)
    ignore_eos = True if cfg.ignore_eos is None else cfg.ignore_eos
    requests = [_Request(p, SamplingParams(**{**base, "max_tokens": cfg.max_tokens or int(o),
                                              "ignore_eos": ignore_eos}), 0.0)
                for p, o in zip(prompts, lens_out)]
  arrivals = workloads.poisson_arrivals(rng, len(requests), cfg.request_rate)
  for r, t in zip(requests, arrivals):
    r.arrival = float(t)
  return requests


def make_engine(cfg: ServeConfig, params, mcfg, tokenizer, eos):
  """The engine `cfg` describes: an `Engine` (tensor parallel over --mesh's "model" devices), or
  a `DataParallelEngine` of such replicas when --mesh has data > 1. With a contiguous baseline
  (--reservation=max/pow2/oracle) the KV budget becomes the baseline's slot space and the pool
  gets one slack page per batch row, so the reservation, not the page pool, limits admission
  (see SchedulerConfig.reservation)."""
  mesh = sharding.mesh_from_flag(cfg.mesh)
  cache = CacheConfig(page_size=cfg.page_size, num_pages=cfg.num_pages,
                      memory_bytes=cfg.kv_cache_bytes, memory_fraction=cfg.kv_cache_fraction,
                      enable_prefix_caching=cfg.enable_prefix_caching, kv_dtype=cfg.kv_dtype,
                      kv_scales=cfg.kv_scales)
  reservation_tokens = None
  if cfg.reservation != "paged":
    device = jax.devices()[0]
    budget = cache.resolve_num_pages(
        mcfg, device.memory_stats() if hasattr(device, "memory_stats") else None,
        sharding.parse_mesh(cfg.mesh)[1])
    reservation_tokens = (budget - 1) * cfg.page_size
    cache = dataclasses.replace(cache, num_pages=budget + cfg.max_num_seqs)
  sched = SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                          max_num_batched_tokens=cfg.max_num_batched_tokens,
                          steps_per_sync=cfg.steps_per_sync, preemption_mode=cfg.preemption_mode,
                          max_prefill_rows=cfg.max_prefill_rows,
                          reservation=cfg.reservation, reservation_tokens=reservation_tokens)
  kw = dict(cache=cache, scheduler=sched, impl=cfg.impl, seed=cfg.seed, tokenizer=tokenizer,
            eos_token_ids=eos, validate_tables=cfg.validate_tables,
            scrub_freed_pages=cfg.scrub_freed_pages)
  if cfg.scan_layers:
    kw["scan_layers"] = True
  if cfg.fuse_projections:
    kw["fuse_projections"] = True
  if cfg.stoppable_rounds:
    kw.update(stoppable_rounds=True, links_ahead=cfg.links_ahead)
  if cfg.program_store and mesh is None:   # one device: its compiled programs are kept
    kw["program_store"] = cfg.program_store
  return data_parallel.make_engine(params, mcfg, mesh=mesh, **kw)


def serve(engine: Engine, requests: list[_Request], *, progress: bool = False, on_output=None):
  """Feeds requests at their arrival times and steps the engine until all finish.

  Args:
    on_output: called with (request index, RequestOutput) for every output a step reports
      (--stream prints their new text).

  Returns (final outputs in request order, wall seconds)."""
  from tqdm import tqdm
  for r in requests:   # refuse a bad request before anything runs
    engine.validate_request(r.prompt, r.params)
  order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
  ids: dict[str, int] = {}
  final = {}
  start = time.perf_counter()
  nxt = 0

  def arrived() -> bool:   # ends a stoppable round: a request is due (Engine.step's interrupt)
    return nxt < len(order) and requests[order[nxt]].arrival <= time.perf_counter() - start

  with tqdm(total=len(requests), disable=not progress, unit="req", desc="serve") as bar:
    while nxt < len(order) or engine.has_unfinished():
      now = time.perf_counter() - start
      while nxt < len(order) and requests[order[nxt]].arrival <= now:
        r = requests[order[nxt]]
        ids[engine.add_request(r.prompt, r.params, arrival_time=start + r.arrival)] = order[nxt]
        nxt += 1
      if engine.has_unfinished():
        for out in engine.step(arrived):
          if on_output is not None:
            on_output(ids[out.request_id], out)
          if out.finished:
            final[ids[out.request_id]] = out
            bar.update(1)
      elif nxt < len(order):
        time.sleep(max(0.0, requests[order[nxt]].arrival - (time.perf_counter() - start)))
  return [final[i] for i in range(len(requests))], time.perf_counter() - start


def _streamer(num_requests: int):
  """Prints each output's new text as it arrives: bare for one request, else a line per chunk
  tagged with the request's index."""
  import sys

  def on_output(index, out):
    for c in out.outputs:
      if not c.new_text:
        continue
      if num_requests == 1 and len(out.outputs) == 1:
        sys.stdout.write(c.new_text)
      else:
        sys.stdout.write(f"[{index}] {c.new_text!r}\n")
      sys.stdout.flush()
    if out.finished and num_requests == 1:
      sys.stdout.write("\n")
  return on_output


def _percentiles(values) -> dict[str, float | None]:
  values = [v for v in values if v is not None]
  if not values:
    return {"p50": None, "p90": None, "p99": None}
  p = np.percentile(values, [50, 90, 99])
  return {"p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2])}


def summarize(engine: Engine, requests: list[_Request], outs, seconds: float) -> dict:
  """Throughput, latency percentiles, normalized latency, KV usage, cache hits, preemptions."""
  input_tokens = sum(len(r.prompt) for r in requests)
  output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
  per_seq_latency = [(o.finish_time - o.arrival_time) / max(1, len(c.token_ids))
                     for o in outs for c in o.outputs]
  m = engine.metrics()
  capacity = engine.kv_capacity_tokens   # a contiguous baseline's slots, else the pool
  return {
      "num_requests": len(requests), "seconds": seconds,
      "input_tokens": input_tokens, "output_tokens": output_tokens,
      "input_tokens_per_s": input_tokens / seconds, "output_tokens_per_s": output_tokens / seconds,
      "ttft_s": _percentiles(o.ttft for o in outs), "tpot_s": _percentiles(o.tpot for o in outs),
      "queue_s": _percentiles(o.time_in_queue for o in outs),
      "normalized_latency_s_per_token": float(np.mean(per_seq_latency)),
      "peak_kv_usage": m["max_pages_in_use"] * engine.page_size / capacity,
      "prefix_hit_rate": m["prefix_hit_rate"], "preemptions": m["preemptions"],
      "prefill_tokens": m["prefill_tokens"], "cached_prompt_tokens": m["cached_prompt_tokens"],
      "swapped_out_pages": m["swapped_out_pages"], "recomputed_tokens": m["recomputed_tokens"],
      "capacity_tokens": capacity, "num_pages": engine.num_pages,
      # decode rows per model step (a k-step round counts k steps; prefill steps count too)
      "mean_decode_batch": m["decode_tokens"] / max(1, m["decode_steps"] + m["prefill_steps"]),
      "steps": m["steps"], "prefill_steps": m["prefill_steps"],
      "prefill_s": m["prefill_s"], "decode_s": m["decode_s"],
      "host_s": m["host_s"], "validate_s": m["validate_s"],
      "scrubbed_pages": m["scrubbed_pages"],
      "programs": m["programs"], "programs_not_warmed": m["programs_not_warmed"],
      "programs_compiled": m["programs_compiled"], "programs_loaded": m["programs_loaded"],
      "programs_on_demand": m["programs_on_demand"], "evicted_programs": m["evicted_programs"],
      "rounds_stopped": m["rounds_stopped"],
  }


def run(cfg: ServeConfig, model=None) -> dict:
  """Serves the configured requests; returns the summary (and each completion's text/tokens).

  Args:
    model: (params, model config, tokenizer, eos ids) to reuse instead of loading cfg.model_dir.
  """
  if cfg.warmup not in WARMUPS:
    raise ValueError(f"warmup={cfg.warmup!r} is not one of {WARMUPS}")
  params, mcfg, tokenizer, eos = model or load_model(cfg)
  chat = None
  if _needs_chat(cfg):
    chat = chat_lib.Chat(cfg.model_dir or embedded.EMBEDDED_MODEL_DIR, tokenizer, eos)
    eos = chat.end_of_turn_ids   # a chat ends at the template's end of turn
  requests = make_requests(cfg, mcfg, tokenizer, chat)
  if cfg.warmup == "workload":   # the same run on a throwaway engine compiles what it will meet
    serve(make_engine(cfg, params, mcfg, tokenizer, eos), requests)
  engine = make_engine(cfg, params, mcfg, tokenizer, eos)
  warm = None
  if cfg.warmup in WARMUP_SCOPES:   # the programs the limits can hit, before any request
    warm = engine.warmup(cfg.warmup, progress=cfg.progress)
  outs, seconds = serve(engine, requests, progress=cfg.progress and not cfg.stream,
                        on_output=_streamer(len(requests)) if cfg.stream else None)
  engine.check_invariants()
  summary = summarize(engine, requests, outs, seconds)
  summary["compile_included"] = (summary["programs_not_warmed"] > 0 if warm is not None
                                 else cfg.warmup == "off")
  summary["warmup"] = warm
  summary["completions"] = [{"request": i, "token_ids": c.token_ids, "text": c.text,
                             "finish_reason": c.finish_reason}
                            for i, o in enumerate(outs) for c in o.outputs]
  summary["config"] = dataclasses.asdict(cfg)
  summary["jax"] = jax.__version__
  summary["device"] = jax.devices()[0].device_kind
  summary["devices"] = int(np.prod(sharding.parse_mesh(cfg.mesh)))
  return summary


def report(r: dict) -> str:
  ms = lambda v: "-" if v is None else f"{1e3 * v:.1f}"
  lines = [
      f"served {r['num_requests']} requests in {r['seconds']:.2f} s"
      f"{' (compiling included, unless cached from a run before or warmed up: --warmup)' if r['compile_included'] else ''}",
      f"  programs: {r['programs']} ran"
      + (f"; warmup compiled {r['warmup']['compiled']} and loaded {r['warmup']['loaded']} of "
         f"{r['warmup']['programs']} in {r['warmup']['seconds']:.1f} s, "
         f"{r['programs_not_warmed']} more on demand" if r["warmup"] else "")
      + (f" ({r['programs_loaded']} loaded from the program store in all)"
         if r["programs_loaded"] else "")
      + (f"; {r['evicted_programs']} dropped at the memory-map limit (Engine._bound_maps), "
         f"{r['programs_on_demand']} compiled or loaded while a step waited"
         if r["evicted_programs"] else ""),
      f"  throughput: {r['input_tokens_per_s']:.0f} input tok/s, "
      f"{r['output_tokens_per_s']:.0f} output tok/s "
      f"({r['input_tokens']} in, {r['output_tokens']} out)",
      "  TTFT ms:    p50 {} / p90 {} / p99 {}".format(*(ms(r["ttft_s"][p]) for p in ("p50", "p90", "p99"))),
      "  TPOT ms:    p50 {} / p90 {} / p99 {}".format(*(ms(r["tpot_s"][p]) for p in ("p50", "p90", "p99"))),
      f"  normalized latency: {r['normalized_latency_s_per_token'] * 1e3:.1f} ms/token",
      f"  KV: peak usage {100 * r['peak_kv_usage']:.1f}% of {r['capacity_tokens']} tokens; "
      f"prefix-cache hit rate {100 * r['prefix_hit_rate']:.1f}%; "
      f"{r['preemptions']} preemptions",
  ]
  if r["config"].get("mesh", "1x1") not in ("1x1", "1"):
    lines.append(f"  mesh {r['config']['mesh']} (data x model): {r['devices']} devices")
  if r["config"]["validate_tables"]:
    lines.append(f"  table validation: {r['validate_s'] * 1e3:.1f} ms "
                 f"({100 * r['validate_s'] / r['seconds']:.2f}% of the run)")
  if len(r["completions"]) <= 8:
    for c in r["completions"]:
      shown = c["text"] if c["text"] is not None else c["token_ids"]
      lines.append(f"  [{c['request']}] {shown!r} ({c['finish_reason']})")
  return "\n".join(lines)


ENGINE_FIELDS = ("page_size", "num_pages", "kv_cache_bytes", "kv_cache_fraction", "kv_dtype",
                 "kv_scales", "max_num_seqs", "max_num_batched_tokens", "steps_per_sync",
                 "max_prefill_rows", "stoppable_rounds", "links_ahead",
                 "preemption_mode", "reservation", "enable_prefix_caching", "impl", "dtype",
                 "matmul", "seed", "warmup", "validate_tables", "scrub_freed_pages", "mesh",
                 "scan_layers", "fuse_projections")


def config_from_flags(f, **fields) -> ServeConfig:
  """A ServeConfig with `define_engine_flags`' values from `f` (absl's FLAGS), then `fields`.

  With a program store on one device the store keeps the step programs and JAX's persistent
  cache stays off (an executable it supplies cannot be stored: program_store._hits); otherwise
  the persistent cache is switched on here."""
  if not f.program_store or int(np.prod(sharding.parse_mesh(f.mesh))) > 1:
    enable_compilation_cache(f.compilation_cache)
  engine = {name: getattr(f, name) for name in ENGINE_FIELDS}
  return ServeConfig(model_dir=f.model, program_store=f.program_store or None,
                     **{**engine, **fields})


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  f = flags.FLAGS
  cfg = config_from_flags(
      f, prompts=tuple(f.prompt or ()), prompts_file=f.prompts_file,
      workload=f.workload, num_requests=f.num_requests, request_rate=f.request_rate,
      max_tokens=f.max_tokens, temperature=f.temperature, top_k=f.top_k, top_p=f.top_p, n=f.n,
      beam_width=f.beam_width, ignore_eos=f.ignore_eos, progress=f.progress, chat=f.chat,
      stream=f.stream)
  sharding.ensure_host_devices(cfg.mesh)
  r = run(cfg)
  print(report(r))
  if f.json:
    os.makedirs(os.path.dirname(f.json) or ".", exist_ok=True)
    with open(f.json, "w") as out:
      json.dump(r, out, indent=1)


def define_engine_flags():
  """The flags that build the model and the engine (shared with `paged_jax.server`)."""
  flags.DEFINE_string("model", None, "A Hugging Face-format checkpoint directory or a GGUF file "
                      "(default: the embedded model).")
  flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  flags.DEFINE_integer("num_pages", None, "Pages in the pool (default: from the memory budget).")
  flags.DEFINE_integer("kv_cache_bytes", None, "KV budget in bytes (CPU default 256 MiB).")
  flags.DEFINE_float("kv_cache_fraction", None, "Share of free device memory (GPU; default 0.9).")
  flags.DEFINE_enum("kv_dtype", "auto", ["auto", "int8", "float8_e4m3fn", "float8_e5m2"],
                    "How pages store K/V: the model dtype, or quantized with f32 scales "
                    "(paged_jax.kv_quant).")
  flags.DEFINE_enum("kv_scales", None, ["token", "page", "tensor"],
                    "Scale granularity of a quantized kv_dtype (default: int8 per token, fp8 "
                    "per tensor).")
  flags.DEFINE_integer("max_num_seqs", 64, "Most sequences per step.")
  flags.DEFINE_integer("max_num_batched_tokens", 2048, "Token budget per step.")
  flags.DEFINE_integer("steps_per_sync", 4, "Decode steps per host sync.")
  flags.DEFINE_integer("max_prefill_rows", None, "Most prompts prefilled in one step (default: "
                       "no bound; with --warmup=one_prompt no step waits for a compile at 4 "
                       "on the C++ CPU kernel, at 1 on the XLA path).",
                       lower_bound=1)
  flags.DEFINE_bool("stoppable_rounds", False, "Run each decode round as chained one-step "
                    "programs that the server ends early when a request arrives (its queue "
                    "time ~1-2 steps, not steps_per_sync); the same tokens.")
  flags.DEFINE_integer("links_ahead", 1, "With --stoppable_rounds: steps queued on the device "
                       "beyond the one running (0: a new request waits for the running step "
                       "only, but the device idles while each step is dispatched).",
                       lower_bound=0)
  flags.DEFINE_enum("preemption_mode", "recompute", ["recompute", "swap"], "Preemption.")
  flags.DEFINE_enum("reservation", "paged", ["paged", "max", "pow2", "oracle"],
                    "KV allocation: paged, or a contiguous baseline of the paper driving "
                    "admission (the KV budget becomes its slot space).")
  flags.DEFINE_bool("enable_prefix_caching", True, "Share full pages by chained hash.")
  flags.DEFINE_enum("impl", "auto", list(attention.IMPLS), "Attention path.")
  flags.DEFINE_enum("matmul", "xla", list(matmul.BACKENDS),
                    "How the model multiplies: XLA's dot, or on a CPU Intel MKL (pip install "
                    "-e .[mkl]) or oneDNN on weights packed at start (pip install -e "
                    ".[onednn]); paged_jax.matmul.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Parameter dtype.")
  flags.DEFINE_integer("seed", 0, "Workload and request seeds.")
  flags.DEFINE_enum("warmup", "off", list(WARMUPS),
                    "Compile before serving: one_user (every program one user's requests run, "
                    "and every decode program), one_prompt (those, and every step that "
                    "prefills one prompt beside any decode rows: a server under a light "
                    "load), all (every program the limits can hit; "
                    "thousands at the default limits), workload (run the workload once on a "
                    "throwaway engine: exactly its programs, for benchmarks); off.")
  flags.DEFINE_bool("validate_tables", False, "Check every step's block tables and write slots "
                    "against the block manager before the device runs it (its cost is reported).")
  flags.DEFINE_bool("scrub_freed_pages", False, "Zero pages as they are freed.")
  flags.DEFINE_string("mesh", "1x1", "DATAxMODEL devices: MODEL-way tensor parallel over heads, "
                      "DATA engine replicas (on the CPU, that many simulated devices).")
  flags.DEFINE_bool("scan_layers", False, "Run the layers as a lax.scan over stacked weights: "
                    "compile time stops growing with depth; unrolled (the default) reads each "
                    "weight in place, faster at small batches on a CPU.")
  flags.DEFINE_bool("fuse_projections", False, "Each layer's q / k / v products as one and "
                    "gate / up as one (model.fuse_projections): 4 products a layer, not 7. "
                    "One device.")
  flags.DEFINE_string("program_store", DEFAULT_PROGRAM_STORE,
                      "Directory of compiled step programs, loaded by later runs without "
                      "tracing or compiling (paged_jax.program_store; '' = off; one device).")
  flags.DEFINE_string("compilation_cache", DEFAULT_COMPILATION_CACHE,
                      "Directory for JAX's persistent compilation cache, reused by later runs "
                      "('' = off); used only with --program_store=''.")


def define_flags():
  define_engine_flags()
  flags.DEFINE_bool("chat", False, "Each --prompt is a user turn, rendered with the checkpoint's "
                    "chat template; completions stop at its end of turn.")
  flags.DEFINE_bool("stream", False, "Print the text as it is generated.")
  flags.DEFINE_multi_string("prompt", None, "A text prompt (repeat for more).")
  flags.DEFINE_string("prompts_file", None, "JSONL of requests (prompt or prompt_token_ids, ...).")
  flags.DEFINE_enum("workload", "sharegpt", list(workloads.WORKLOADS),
                    "Synthetic workload when no prompts are given.")
  flags.DEFINE_integer("num_requests", 64, "Synthetic requests.")
  flags.DEFINE_float("request_rate", math.inf, "Poisson arrivals per second (inf: all at once).")
  flags.DEFINE_integer("max_tokens", None, "Tokens per completion (default: the workload's "
                       "lengths; 64 or what max_position leaves for given prompts).")
  flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
  flags.DEFINE_integer("top_k", 0, "0 = off.")
  flags.DEFINE_float("top_p", 1.0, "1 = off.")
  flags.DEFINE_integer("n", 1, "Completions per request (parallel sampling, shared pages).")
  flags.DEFINE_integer("beam_width", 1, "> 1: beam search.")
  flags.DEFINE_bool("ignore_eos", None, "Do not stop at EOS (default: on for synthetic workloads).")
  flags.DEFINE_bool("progress", True, "Show a progress bar.")
  flags.DEFINE_string("json", None, "Write the summary as JSON here.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
