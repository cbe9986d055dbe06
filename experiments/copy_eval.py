"""The main job: the embedded copy model served by paged decoding, with its task accuracy.

  python -m experiments.copy_eval                          # embedded model, 256 held-out prompts
  python -m experiments.copy_eval --page_size=4 --num_pages=200 --steps_per_sync=16

Held-out prompts `<bos> x1..xn <sep>` (n = 4..32 letters) go through `Generator`: continuous
batching over a paged pool (small pages and a small pool by default, so sequences cross many page
boundaries and the scheduler preempts), multi-step decode, greedy. A sequence is correct when it
reproduces x1..xn followed by <eos>. Accuracy is a paging test: a wrong page, slot or mask shows up
as wrong letters. The same prompts are also decoded with a dense contiguous cache for a subset, and
the two must agree token for token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags
import numpy as np

from experiments import train_copy_model
from paged_jax import attention, checkpoint, config, embedded, testing
from paged_jax.generate import Generator


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  model_dir: str = embedded.EMBEDDED_MODEL_DIR
  num_prompts: int = 256
  page_size: int = 4
  num_pages: int = 400
  steps_per_sync: int = 8
  max_batch: int = 64
  impl: str = "auto"
  dense_check: int = 8        # prompts also decoded with a dense cache (must agree exactly)
  seed: int = 1234            # held-out: training used seed 0


def run(cfg: EvalConfig) -> dict:
  params, mcfg, tokenizer = checkpoint.load_checkpoint(cfg.model_dir)
  tcfg = train_copy_model.TrainConfig()
  data = train_copy_model.prompts_and_answers(np.random.default_rng(cfg.seed), tcfg,
                                              cfg.num_prompts)
  prompts = [p for p, _ in data]
  max_new = max(len(a) for _, a in data) + 2
  gen = Generator(params, mcfg, num_pages=cfg.num_pages, page_size=cfg.page_size,
                  steps_per_sync=cfg.steps_per_sync, max_batch=cfg.max_batch, impl=cfg.impl)
  t = time.perf_counter()
  outs = gen.generate(prompts, max_new, eos_id=embedded.EOS)
  seconds = time.perf_counter() - t
  correct = [o == a for o, (_, a) in zip(outs, data)]
  dense_agree = all(testing.dense_greedy(params, mcfg, p, len(o)) == o
                    for p, o in list(zip(prompts, outs))[:cfg.dense_check])
  gen.bm.check_invariants()
  s = gen.stats
  examples = []
  for (p, a), o in list(zip(data, outs))[:3]:
    dec = (lambda ids: tokenizer.decode(ids)) if tokenizer else str
    examples.append({"prompt": dec(p[1:-1]), "output": dec([t for t in o if t != embedded.EOS]),
                     "correct": o == a})
  return {**dataclasses.asdict(cfg), "accuracy": float(np.mean(correct)),
          "num_correct": int(sum(correct)), "dense_agrees": dense_agree,
          "seconds": seconds, "generated_tokens": int(sum(len(o) for o in outs)),
          "tokens_per_s": sum(len(o) for o in outs) / seconds,
          "preemptions": s.preemptions, "prefix_cached_tokens": s.cached_prompt_tokens,
          "max_pages_in_use": s.max_pages_in_use, "decode_rounds": s.decode_rounds,
          "prefill_steps": s.prefill_steps, "examples": examples}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  config.enable_compilation_cache(_CACHE.value)
  cfg = EvalConfig(_MODEL.value, _NUM_PROMPTS.value, _PAGE_SIZE.value, _NUM_PAGES.value,
                   _STEPS_PER_SYNC.value, _MAX_BATCH.value, _IMPL.value)
  r = run(cfg)
  print(f"copy task, {cfg.num_prompts} held-out prompts, paged decoding (page_size "
        f"{cfg.page_size}, {cfg.num_pages} pages, {cfg.steps_per_sync} steps per sync):")
  for ex in r["examples"]:
    print(f"  {ex['prompt']!r:>70} -> {ex['output']!r} {'ok' if ex['correct'] else 'WRONG'}")
  print(f"  accuracy {100 * r['accuracy']:.1f}% ({r['num_correct']}/{cfg.num_prompts});  "
        f"dense-cache decoding agrees on the first {cfg.dense_check}: {r['dense_agrees']}")
  print(f"  {r['generated_tokens']} tokens in {r['seconds']:.1f} s ({r['tokens_per_s']:.0f} tok/s, "
        f"compile included); peak {r['max_pages_in_use']} pages in use; "
        f"{r['preemptions']} preemptions; {r['decode_rounds']} decode rounds")
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "a") as f:
      f.write(json.dumps(r) + "\n")
  if not r["dense_agrees"]:
    raise SystemExit("paged decoding disagrees with dense-cache decoding")


if __name__ == "__main__":
  # Flags exist only when run as a script (see experiments/attention_bench.py).
  _MODEL = flags.DEFINE_string("model", embedded.EMBEDDED_MODEL_DIR, "HF-format model directory.")
  _NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 256, "Held-out prompts.")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 4, "Tokens per page.")
  _NUM_PAGES = flags.DEFINE_integer("num_pages", 400, "Pages in the pool (NULL_PAGE included).")
  _STEPS_PER_SYNC = flags.DEFINE_integer("steps_per_sync", 8, "Decode steps per host sync.")
  _MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Most sequences decoded at once.")
  _IMPL = flags.DEFINE_enum("impl", "auto", list(attention.IMPLS), "Attention path.")
  _OUT = flags.DEFINE_string("out", "experiments/results/copy_eval.jsonl", "JSONL to append to.")
  _CACHE = flags.DEFINE_string("compilation_cache", config.DEFAULT_COMPILATION_CACHE,
                               "Directory for compiled programs ('' = off).")
  app.run(main)
