"""Step benchmark: prefill and decode tokens/s per batch bucket, compile time apart from steady
state, and the effect of multi-step decode (k decode steps per host sync).

  python -m experiments.step_bench
  python -m experiments.step_bench --batches=1,16,64 --ks=1,4,16 --prompt_len=128 --new_tokens=64

For each batch size B and k it runs `Generator.generate` (the engine) on B random prompts twice
with the same shapes: the first call compiles (its extra time is reported as compile time), the
second is the steady state. Prefill tokens/s = prompt tokens / device time of the prefill steps;
decode tokens/s = tokens of decode-only steps / their wall time, split into device time (launch to
tokens on the host) and host time (scheduler, block manager, batch building, outputs), so the
host's share of a decode step is visible. The model is a
random Llama-shaped config by default (or --model, an HF-format directory), f32, XLA attention on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags
import jax
import numpy as np

from paged_jax import attention, checkpoint, testing
from paged_jax.config import ModelConfig
from paged_jax.generate import Generator


@dataclasses.dataclass(frozen=True)
class StepBenchConfig:
  batch: int = 16
  steps_per_sync: int = 4
  prompt_len: int = 128
  new_tokens: int = 64
  page_size: int = 16
  impl: str = "auto"
  model_dir: str | None = None
  # The default random model (when model_dir is None): ~6M parameters.
  num_layers: int = 4
  hidden_size: int = 256
  num_q_heads: int = 8
  num_kv_heads: int = 2
  vocab_size: int = 2048


def load_model(cfg: StepBenchConfig):
  if cfg.model_dir:
    params, mcfg, _ = checkpoint.load_checkpoint(cfg.model_dir)
    return params, mcfg
  mcfg = ModelConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=4 * cfg.hidden_size, num_layers=cfg.num_layers,
                     num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.hidden_size // cfg.num_q_heads, max_position=2048)
  return testing.random_params(mcfg, scale=0.05), mcfg


def run(cfg: StepBenchConfig, model=None) -> dict:
  params, mcfg = model or load_model(cfg)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, mcfg.vocab_size, cfg.prompt_len).tolist() for _ in range(cfg.batch)]
  pages_per_seq = -(-(cfg.prompt_len + cfg.new_tokens + cfg.steps_per_sync) // cfg.page_size)
  timings = []
  for _ in range(2):   # first: compile + run; second: steady state, same shapes
    gen = Generator(params, mcfg, num_pages=1 + cfg.batch * pages_per_seq, page_size=cfg.page_size,
                    steps_per_sync=cfg.steps_per_sync, max_batch=cfg.batch, impl=cfg.impl,
                    enable_prefix_caching=False)
    t = time.perf_counter()
    gen.generate(prompts, cfg.new_tokens)
    timings.append((time.perf_counter() - t, gen.stats))
  (first, _), (steady, s) = timings
  decode_s = s.decode_s + s.decode_host_s
  return {**dataclasses.asdict(cfg), "compile_s": first - steady, "steady_s": steady,
          "prefill_tokens_per_s": s.prefill_tokens / s.prefill_s,
          "decode_tokens_per_s": s.decode_tokens / decode_s,
          "decode_ms_per_step": 1e3 * decode_s / s.decode_steps,
          "host_share_of_decode": s.decode_host_s / decode_s,
          "decode_rounds": s.decode_rounds, "jax": jax.__version__,
          "device": jax.devices()[0].device_kind}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  base = StepBenchConfig(prompt_len=_PROMPT_LEN.value, new_tokens=_NEW_TOKENS.value,
                         page_size=_PAGE_SIZE.value, impl=_IMPL.value, model_dir=_MODEL.value)
  model = load_model(base)
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  print(f"step bench [jax {jax.__version__}, {jax.devices()[0].device_kind}], prompt "
        f"{base.prompt_len}, {base.new_tokens} new tokens, page {base.page_size}")
  for batch in map(int, _BATCHES.value):
    for k in map(int, _KS.value):
      r = run(dataclasses.replace(base, batch=batch, steps_per_sync=k), model)
      print(f"  B={batch:<3d} k={k:<2d} prefill {r['prefill_tokens_per_s']:8.0f} tok/s   decode "
            f"{r['decode_tokens_per_s']:7.0f} tok/s ({r['decode_ms_per_step']:6.2f} ms/step, host "
            f"{100 * r['host_share_of_decode']:4.1f}%)   compile {r['compile_s']:5.1f} s", flush=True)
      with open(_OUT.value, "a") as f:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  # Flags exist only when run as a script (see experiments/attention_bench.py).
  _BATCHES = flags.DEFINE_list("batches", ["1", "4", "16", "64"], "Batch buckets.")
  _KS = flags.DEFINE_list("ks", ["1", "4", "16"], "Decode steps per host sync.")
  _PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Prompt tokens.")
  _NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Generated tokens per sequence.")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  _IMPL = flags.DEFINE_enum("impl", "auto", list(attention.IMPLS), "Attention path.")
  _MODEL = flags.DEFINE_string("model", None, "HF-format model directory (default: random model).")
  _OUT = flags.DEFINE_string("out", "experiments/results/step_bench.jsonl", "JSONL to append to.")
  app.run(main)
