"""Attention benchmark: paged vs dense on the same data, in one run, with copy bandwidth beside it.

  python -m experiments.attention_bench                      # the issue's CPU sweep
  python -m experiments.attention_bench --seq_lens=1024 --num_seqs=8 --modes=decode

For every shape it checks each path against the f32 reference first, then times them side by side
(interleaved rounds, median), and prints milliseconds, effective bandwidth (K/V bytes read / time),
that bandwidth as a fraction of the machine's copy bandwidth measured in the same run, and each
path's time relative to the contiguous baseline. One JSONL record per (shape, path) is appended to
--out.

Paths:
  dense_reference  `dense_attention`: the definition (materialises every score), on contiguous K/V.
  dense_blocked    `contiguous_attention`: the paged path's loop over contiguous K/V. The fair
                   baseline: the paged/dense ratio is paged_xla / dense_blocked.
  paged_xla        `paged_attention`: reads K/V through shuffled block tables.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from typing import Callable, Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, testing


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  num_seqs: int = 32
  seq_len: int = 1024
  q_len: int = 1              # 1 = decode
  page_size: int = 16
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64
  dtype: str = "float32"
  block_tokens: int = attention.DEFAULT_BLOCK_TOKENS
  impls: tuple[str, ...] = ("dense_reference", "dense_blocked", "paged_xla")
  rounds: int = 5
  iters: int = 5

  @property
  def mode(self) -> str:
    return "decode" if self.q_len == 1 else "prefill"


def copy_bandwidth(num_bytes: int = 256 * 2**20, rounds: int = 5) -> float:
  """Bytes read + written per second by a jitted elementwise pass over a buffer larger than L3."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  f(x).block_until_ready()
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * num_bytes / statistics.median(times)


def make_inputs(cfg: BenchConfig):
  """Contiguous and paged copies of the same random K/V, and ragged queries."""
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(cfg.dtype)
  shape = (cfg.num_seqs, cfg.seq_len, cfg.num_kv_heads, cfg.head_dim)
  k = rng.standard_normal(shape, np.float32)
  v = rng.standard_normal(shape, np.float32)
  seq_lens = np.full(cfg.num_seqs, cfg.seq_len, np.int32)
  k_pages, v_pages, tables = testing.paged_from_dense(k, v, seq_lens, cfg.page_size)
  q = rng.standard_normal((cfg.num_seqs * cfg.q_len, cfg.num_q_heads, cfg.head_dim), np.float32)
  cu = np.arange(cfg.num_seqs + 1, dtype=np.int32) * cfg.q_len
  as_dev = lambda a: jnp.asarray(a, dtype)
  return dict(q=as_dev(q), k=as_dev(k), v=as_dev(v), k_pages=as_dev(k_pages),
              v_pages=as_dev(v_pages), block_tables=jnp.asarray(tables),
              seq_lens=jnp.asarray(seq_lens), cu_q_lens=jnp.asarray(cu))


def implementations(cfg: BenchConfig) -> dict[str, Callable[[dict], jax.Array]]:
  """name -> f(inputs) for every path this machine can run."""
  ppb = max(1, cfg.block_tokens // cfg.page_size)
  dense_ref = jax.jit(attention.dense_attention, static_argnames=("max_q_len",))
  return {
      "dense_reference": lambda d: dense_ref(d["q"], d["k"], d["v"], d["cu_q_lens"], d["seq_lens"],
                                             max_q_len=cfg.q_len),
      "dense_blocked": lambda d: attention.contiguous_attention(
          d["q"], d["k"], d["v"], d["seq_lens"], d["cu_q_lens"], max_q_len=cfg.q_len,
          block_tokens=cfg.block_tokens),
      "paged_xla": lambda d: attention.paged_attention(
          d["q"], d["k_pages"], d["v_pages"], d["block_tables"], d["seq_lens"], d["cu_q_lens"],
          max_q_len=cfg.q_len, pages_per_block=ppb),
  }


def run(cfg: BenchConfig, copy_bytes_per_s: float | None = None) -> list[dict]:
  """Checks every path against the reference, then times them interleaved. One record per path."""
  if copy_bytes_per_s is None:
    copy_bytes_per_s = copy_bandwidth()
  data = make_inputs(cfg)
  impls = implementations(cfg)
  unknown = set(cfg.impls) - set(impls)
  if unknown:
    raise ValueError(f"impls {sorted(unknown)} are not available here; choose from {sorted(impls)}")
  # 1) Correctness before timing: every path against the f32 reference on the paged data.
  reference = np.asarray(jax.jit(attention.paged_attention_reference, static_argnames=("max_q_len",))(
      *(data[n].astype(jnp.float32) if n in ("q", "k_pages", "v_pages") else data[n]
        for n in ("q", "k_pages", "v_pages", "block_tables", "seq_lens", "cu_q_lens")),
      max_q_len=cfg.q_len))
  tol = 1e-5 if cfg.dtype == "float32" else 2e-2
  errors, compile_s = {}, {}
  for name in cfg.impls:
    t = time.perf_counter()
    out = np.asarray(impls[name](data), np.float32)   # 2) first call: compile + run
    compile_s[name] = time.perf_counter() - t
    errors[name] = float(np.max(np.abs(out - reference)))
    if not errors[name] <= tol * (1 + np.max(np.abs(reference))):
      raise AssertionError(f"{name}: max error {errors[name]} against the reference exceeds {tol}")
  # 3) Steady state, interleaved so drift on a noisy machine hits every path alike.
  samples = {name: [] for name in cfg.impls}
  for _ in range(cfg.rounds):
    for name in cfg.impls:
      f = impls[name]
      f(data).block_until_ready()
      t = time.perf_counter()
      for _ in range(cfg.iters):
        out = f(data)
      out.block_until_ready()
      samples[name].append((time.perf_counter() - t) / cfg.iters)
  kv_bytes = 2 * cfg.num_seqs * cfg.seq_len * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  base = statistics.median(samples["dense_blocked"]) if "dense_blocked" in samples else None
  records = []
  for name in cfg.impls:
    seconds = statistics.median(samples[name])
    records.append({
        **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("impls",)},
        "mode": cfg.mode, "impl": name, "ms": seconds * 1e3, "compile_s": compile_s[name],
        "kv_bytes": kv_bytes, "kv_gb_per_s": kv_bytes / seconds / 1e9,
        "copy_gb_per_s": copy_bytes_per_s / 1e9,
        "fraction_of_copy_bw": kv_bytes / seconds / copy_bytes_per_s,
        "ratio_vs_dense_blocked": seconds / base if base else None,
        "max_abs_err": errors[name],
        "jax": jax.__version__, "device": jax.devices()[0].device_kind,
    })
  return records


def format_records(records: Sequence[dict]) -> str:
  lines = []
  for r in records:
    ratio = f"{r['ratio_vs_dense_blocked']:.2f}x" if r["ratio_vs_dense_blocked"] else "-"
    lines.append(f"{r['mode']:7s} B={r['num_seqs']:<3d} T={r['seq_len']:<5d} {r['impl']:16s} "
                 f"{r['ms']:8.2f} ms  {r['kv_gb_per_s']:6.2f} GB/s  "
                 f"{r['fraction_of_copy_bw']:5.2f} of copy  {ratio:>6s} vs dense_blocked  "
                 f"err {r['max_abs_err']:.1e}  compile {r['compile_s']:.2f}s")
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  copy_bw = copy_bandwidth()
  print(f"copy bandwidth (read + write, 256 MiB): {copy_bw / 1e9:.2f} GB/s  "
        f"[jax {jax.__version__}, {jax.devices()[0].device_kind}]")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  for mode in _MODES.value:
    for seq_len in map(int, _SEQ_LENS.value):
      decode = mode == "decode"
      cfg = BenchConfig(
          num_seqs=_NUM_SEQS.value if decode else _PREFILL_NUM_SEQS.value, seq_len=seq_len,
          q_len=1 if decode else min(_PREFILL_Q_LEN.value, seq_len), page_size=_PAGE_SIZE.value,
          num_q_heads=_NUM_Q_HEADS.value, num_kv_heads=_NUM_KV_HEADS.value,
          head_dim=_HEAD_DIM.value, dtype=_DTYPE.value, block_tokens=_BLOCK_TOKENS.value,
          impls=tuple(_IMPLS.value), rounds=_ROUNDS.value, iters=_ITERS.value)
      records = run(cfg, copy_bw)
      print(format_records(records), flush=True)
      with open(_OUT.value, "a") as f:
        for r in records:
          f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  # Flags exist only when run as a script, so tests can import every experiment into one
  # process without absl's duplicate-flag error (several scripts share --page_size).
  _SEQ_LENS = flags.DEFINE_list("seq_lens", ["1024", "2048", "4096"], "Tokens per sequence (sweep).")
  _NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "Sequences per batch.")
  _MODES = flags.DEFINE_list("modes", ["decode", "prefill"], "decode (q_len 1) and/or prefill.")
  _PREFILL_Q_LEN = flags.DEFINE_integer("prefill_q_len", 128,
                                        "Queries per sequence in prefill mode (a chunk after a prefix).")
  _PREFILL_NUM_SEQS = flags.DEFINE_integer("prefill_num_seqs", 4, "Sequences in prefill mode.")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  _NUM_Q_HEADS = flags.DEFINE_integer("num_q_heads", 8, "Query heads.")
  _NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "KV heads.")
  _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
  _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "K/V and query dtype.")
  _BLOCK_TOKENS = flags.DEFINE_integer("block_tokens", attention.DEFAULT_BLOCK_TOKENS,
                                       "Keys per loop iteration of the blocked paths.")
  _IMPLS = flags.DEFINE_list("impls", ["dense_reference", "dense_blocked", "paged_xla"], "Paths to time.")
  _ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (median is reported).")
  _ITERS = flags.DEFINE_integer("iters", 5, "Calls per round.")
  _OUT = flags.DEFINE_string("out", "experiments/results/attention_bench.jsonl", "JSONL to append to.")
  app.run(main)
