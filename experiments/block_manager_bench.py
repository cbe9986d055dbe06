"""Block manager speed: admit / append / free cycles per second, and its share of a decode step.

  python -m experiments.block_manager_bench
  python -m experiments.block_manager_bench --num_pages=10000 --num_seqs=256 --decode_batch=64

Phase 1 admits `num_seqs` sequences (distinct prompts, so the prefix cache is queried but misses),
phase 2 runs `decode_steps` decode steps over all of them (append one token + mark it computed, as
the engine does every step), phase 3 frees them; repeated `cycles` times. Then it compares the
manager's cost of one batch-`decode_batch` decode step against one layer of paged decode attention
for the same batch (a lower bound on a model's decode step, so the ratio is conservative).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, testing
from paged_jax.host.block_manager import BlockManager


@dataclasses.dataclass(frozen=True)
class ManagerBenchConfig:
  num_pages: int = 10_000
  num_seqs: int = 256
  page_size: int = 16
  prompt_len: int = 200
  decode_steps: int = 100
  cycles: int = 3
  decode_batch: int = 64
  attention_seq_len: int = 1024   # context of the attention step compared against
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64


def time_manager(cfg: ManagerBenchConfig) -> dict[str, float]:
  """Seconds per admit, per decode-token update (append + mark_computed), per free."""
  needed = cfg.num_seqs * -(-(cfg.prompt_len + cfg.decode_steps) // cfg.page_size)
  if needed > cfg.num_pages - 1:
    raise ValueError(f"{cfg.num_seqs} seqs x {cfg.prompt_len + cfg.decode_steps} tokens need "
                     f"{needed} pages; num_pages={cfg.num_pages} is too small")
  bm = BlockManager(cfg.num_pages, cfg.page_size)
  admit_s = append_s = free_s = 0.0
  for cycle in range(cfg.cycles):
    prompts = [range((cycle * cfg.num_seqs + s) * 100_000, (cycle * cfg.num_seqs + s) * 100_000
                     + cfg.prompt_len) for s in range(cfg.num_seqs)]
    t = time.perf_counter()
    for s, prompt in enumerate(prompts):
      bm.admit(s, prompt)
      bm.mark_computed(s)
    admit_s += time.perf_counter() - t
    t = time.perf_counter()
    for step in range(cfg.decode_steps):
      for s in range(cfg.num_seqs):
        bm.append_tokens(s, (step,))
        bm.mark_computed(s)
    append_s += time.perf_counter() - t
    t = time.perf_counter()
    for s in range(cfg.num_seqs):
      bm.free(s)
    free_s += time.perf_counter() - t
  bm.check_invariants()
  n_seq = cfg.cycles * cfg.num_seqs
  return {"admit_us": admit_s / n_seq * 1e6, "decode_token_us": append_s / (n_seq * cfg.decode_steps) * 1e6,
          "free_us": free_s / n_seq * 1e6,
          "cycles_per_s": cfg.cycles / (admit_s + append_s + free_s),
          "admits_per_s": n_seq / admit_s, "decode_tokens_per_s": n_seq * cfg.decode_steps / append_s}


def time_attention_step(cfg: ManagerBenchConfig) -> float:
  """Seconds of one layer of paged decode attention at batch `decode_batch`."""
  rng = np.random.default_rng(0)
  shape = (cfg.decode_batch, cfg.attention_seq_len, cfg.num_kv_heads, cfg.head_dim)
  k = rng.standard_normal(shape, np.float32)
  lens = np.full(cfg.decode_batch, cfg.attention_seq_len, np.int32)
  kp, vp, tables = testing.paged_from_dense(k, k, lens, cfg.page_size)
  args = (jnp.asarray(rng.standard_normal((cfg.decode_batch, cfg.num_q_heads, cfg.head_dim)),
                      jnp.float32), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables),
          jnp.asarray(lens), jnp.arange(cfg.decode_batch + 1, dtype=jnp.int32))
  f = lambda: attention.paged_attention(*args, max_q_len=1)
  f().block_until_ready()
  times = []
  for _ in range(10):
    t = time.perf_counter()
    f().block_until_ready()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def run(cfg: ManagerBenchConfig) -> dict:
  record = {**dataclasses.asdict(cfg), **time_manager(cfg)}
  record["manager_step_us"] = record["decode_token_us"] * cfg.decode_batch
  record["attention_layer_step_us"] = time_attention_step(cfg) * 1e6
  record["manager_share_of_one_layer"] = record["manager_step_us"] / record["attention_layer_step_us"]
  record["jax"] = jax.__version__
  return record


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  cfg = ManagerBenchConfig(_NUM_PAGES.value, _NUM_SEQS.value, _PAGE_SIZE.value, _PROMPT_LEN.value,
                           _DECODE_STEPS.value, _CYCLES.value, _DECODE_BATCH.value)
  r = run(cfg)
  print(f"block manager, {cfg.num_pages} pages, {cfg.num_seqs} seqs, page_size {cfg.page_size}:")
  print(f"  admit ({cfg.prompt_len}-token prompt) {r['admit_us']:8.1f} us   "
        f"({r['admits_per_s']:.0f}/s)")
  print(f"  decode token (append + mark_computed) {r['decode_token_us']:6.2f} us   "
        f"({r['decode_tokens_per_s']:.0f}/s)")
  print(f"  free {r['free_us']:8.1f} us;  full admit/decode/free cycles: {r['cycles_per_s']:.2f}/s")
  print(f"  one decode step at batch {cfg.decode_batch}: manager {r['manager_step_us']:.0f} us vs "
        f"one layer of paged attention ({cfg.attention_seq_len} tokens) "
        f"{r['attention_layer_step_us']:.0f} us -> {100 * r['manager_share_of_one_layer']:.1f}%")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "a") as f:
    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  # Flags exist only when run as a script, so tests can import every experiment into one
  # process without absl's duplicate-flag error (several scripts share --page_size).
  _NUM_PAGES = flags.DEFINE_integer("num_pages", 10_000, "Pages in the pool (NULL_PAGE included).")
  _NUM_SEQS = flags.DEFINE_integer("num_seqs", 256, "Concurrent sequences.")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  _PROMPT_LEN = flags.DEFINE_integer("prompt_len", 200, "Prompt tokens per sequence.")
  _DECODE_STEPS = flags.DEFINE_integer("decode_steps", 100, "Decode steps per cycle.")
  _CYCLES = flags.DEFINE_integer("cycles", 3, "Admit/decode/free cycles.")
  _DECODE_BATCH = flags.DEFINE_integer("decode_batch", 64, "Batch of the decode step compared against.")
  _OUT = flags.DEFINE_string("out", "experiments/results/block_manager_bench.jsonl", "JSONL to append to.")
  app.run(main)
