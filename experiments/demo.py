"""The main job on its embedded default: build a random paged pool, run paged attention on a ragged
batch that mixes prefill chunks and decode rows, check it against dense attention, print the error
and timings.

  python -m experiments.demo
  python -m experiments.demo --page_size=4 --seq_lens=5,17,64,300 --q_lens=5,1,16,1
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import jax
import numpy as np

from paged_jax import attention, testing


@dataclasses.dataclass(frozen=True)
class DemoConfig:
  seq_lens: tuple[int, ...] = (1, 15, 16, 17, 200, 1000)
  q_lens: tuple[int, ...] = (1, 15, 1, 4, 1, 64)
  page_size: int = 16
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64


def run(cfg: DemoConfig) -> dict:
  """Returns the max error against dense attention, NaN count, and timings (ms)."""
  if len(cfg.seq_lens) != len(cfg.q_lens):
    raise ValueError(f"seq_lens={cfg.seq_lens} and q_lens={cfg.q_lens} differ in length")
  if cfg.num_q_heads % cfg.num_kv_heads:
    raise ValueError(f"num_q_heads={cfg.num_q_heads} must be divisible by "
                     f"num_kv_heads={cfg.num_kv_heads}")
  inp = testing.random_paged_inputs(
      0, cfg.seq_lens, q_lens=cfg.q_lens, page_size=cfg.page_size,
      num_kv_heads=cfg.num_kv_heads, q_per_kv=cfg.num_q_heads // cfg.num_kv_heads,
      head_dim=cfg.head_dim, shuffle_pages=True, poison=True)
  attention.validate_attention_inputs(*inp)
  max_q_len = max(cfg.q_lens)
  reference = jax.jit(attention.paged_attention_reference, static_argnames=("max_q_len",))
  timings = {}
  outs = {}
  for name, f in (("dense_reference", lambda: reference(*inp, max_q_len=max_q_len)),
                  ("paged_xla", lambda: attention.paged_attention(*inp, max_q_len=max_q_len))):
    t = time.perf_counter()
    outs[name] = f().block_until_ready()
    timings[f"{name}_first_call_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    for _ in range(10):
      f().block_until_ready()
    timings[f"{name}_ms"] = (time.perf_counter() - t) * 1e2
  out = np.asarray(outs["paged_xla"])
  return {"num_pages": int(inp.k_pages.shape[0]), "num_tokens": int(inp.q.shape[0]),
          "max_abs_err": float(np.max(np.abs(out - np.asarray(outs["dense_reference"])))),
          "nan_outputs": int(np.isnan(out).sum()), **timings}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  cfg = DemoConfig(tuple(map(int, _SEQ_LENS.value)), tuple(map(int, _Q_LENS.value)),
                   _PAGE_SIZE.value, _NUM_Q_HEADS.value, _NUM_KV_HEADS.value, _HEAD_DIM.value)
  print(f"paged attention demo [jax {jax.__version__}, {jax.devices()[0].device_kind}]")
  print(f"  seq_lens={cfg.seq_lens} q_lens={cfg.q_lens} page_size={cfg.page_size} "
        f"heads={cfg.num_q_heads}q/{cfg.num_kv_heads}kv head_dim={cfg.head_dim}")
  print("  pool: shuffled pages; NaN in NULL_PAGE, free pages and every slot past a length")
  r = run(cfg)
  print(f"  {r['num_tokens']} query tokens over {r['num_pages']} pages")
  print(f"  max |paged - dense| = {r['max_abs_err']:.2e}  (f32 promise: 1e-5); NaN outputs: "
        f"{r['nan_outputs']}")
  for name in ("dense_reference", "paged_xla"):
    print(f"  {name:16s} first call (compile) {r[name + '_first_call_ms']:8.1f} ms   "
          f"steady {r[name + '_ms']:7.2f} ms")
  if not (r["max_abs_err"] <= 1e-5 and r["nan_outputs"] == 0):
    raise SystemExit("paged attention disagrees with dense attention")


if __name__ == "__main__":
  # Flags exist only when run as a script, so tests can import every experiment into one
  # process without absl's duplicate-flag error (several scripts share --page_size).
  _SEQ_LENS = flags.DEFINE_list("seq_lens", ["1", "15", "16", "17", "200", "1000"], "Keys per sequence.")
  _Q_LENS = flags.DEFINE_list("q_lens", ["1", "15", "1", "4", "1", "64"],
                              "Queries per sequence (1 = decode; == seq_len = whole prompt).")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  _NUM_Q_HEADS = flags.DEFINE_integer("num_q_heads", 8, "Query heads.")
  _NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "KV heads.")
  _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
  app.run(main)
