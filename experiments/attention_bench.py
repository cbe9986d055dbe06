"""Attention benchmark: paged vs dense on the same data, in one run, with copy bandwidth beside it.

  python -m experiments.attention_bench                       # CPU sweep (issue 2's shapes)
  python -m experiments.attention_bench --preset=gpu          # GPU sweep (issue 4's shapes)
  python -m experiments.attention_bench --seq_lens=1024 --num_seqs=8 --modes=decode
  python -m experiments.attention_bench --modes=decode --num_seqs=1 --seq_lens=1024 \
      --num_q_heads=9 --num_kv_heads=3 --layers=30 --impls=decode_xla,decode_cpu \
      --baseline=decode_xla          # SmolLM2's one user, each layer's pages from memory

For every shape it checks each path against the f32 reference first, then times them side by side
(interleaved rounds, median), and prints milliseconds, effective bandwidth (K/V bytes read / time),
that bandwidth as a fraction of the machine's copy bandwidth measured in the same run, and each
path's time relative to a baseline. One JSONL record per (shape, path) is appended to --out, with
the device name and JAX version.

Paths:
  dense_reference  `dense_attention`: the definition (materialises every score), contiguous K/V.
  dense_blocked    `contiguous_attention`: the XLA paged loop over contiguous K/V. The fair CPU
                   baseline: the paged/dense ratio is paged_xla / dense_blocked.
  paged_xla        `paged_attention_xla`: reads K/V through shuffled block tables.
  decode_xla       `decode_attention_xla` (decode only): the same pages split into (row, key
                   block) work items, so ragged rows (--min_seq_len) cost their own length.
  decode_cpu       `cpu_kernel.paged_attention` on decode rows (CPU backend): the C++ kernel behind
                   XLA's FFI that impl "auto" runs a step's rows on, on a CPU.
  prefill_xla      `prefill_attention` (prefill only): the step's own keys by causal tiles, the
                   prefix through the block table; what prefill chunks run on where the C++
                   kernel does not (`attention.PREFILL_ON_CPU_KERNEL`).
  prefill_cpu      `cpu_kernel.paged_attention` on prefill chunks (CPU backend): the C++ kernel,
                   tiles of up to 16 queries per (row, kv head); what a step's prefill chunks run
                   on, on a CPU. Fresh prompts: --seq_lens=N --prefill_q_len=N.
  pallas           our Triton kernel (`pallas_kernels.paged_attention`), GPU (or --interpret).
  jax_paged        `jax.experimental.pallas.ops.gpu.paged_attention` (decode only; its pool is
                   [kv_heads, pages, page_size, head_dim], prepared once outside the timing; it has no
                   softmax scale, so q is pre-scaled).
  jax_decode       `jax.experimental.pallas.ops.gpu.decode_attention.gqa` on contiguous K/V (decode
                   only; its public API transposes K/V to [B, K, T, D] inside every call).

Modes: decode (q_len 1), prefill (every sequence a `prefill_q_len` chunk at the end of its context),
mixed (the first `num_prefill_seqs` sequences prefill chunks, the rest decode rows, in one batch:
our kernel does it in one launch; JAX's GPU kernels cannot).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import time
from typing import Callable, Sequence

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, cpu_kernel
from pallas_kernels.paged_attention import kernel_triton, reference

ALL_IMPLS = ("dense_reference", "dense_blocked", "paged_xla", "decode_xla", "decode_cpu",
             "prefill_xla", "prefill_cpu", "pallas", "jax_paged", "jax_decode")
KERNEL_IMPLS = ("pallas", "jax_paged", "jax_decode")
_DECODE_ONLY = ("jax_paged", "jax_decode")


@dataclasses.dataclass(frozen=True)
class BenchConfig:
  num_seqs: int = 32
  seq_len: int = 1024
  min_seq_len: int | None = None   # set: row lengths uniform in [min_seq_len, seq_len] (seeded)
  q_len: int = 1                # queries per prefill sequence (1 = decode)
  num_prefill_seqs: int | None = None   # mixed mode: this many prefill rows, the rest decode
  page_size: int = 16
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64
  dtype: str = "float32"
  block_tokens: int = attention.DEFAULT_BLOCK_TOKENS
  impls: tuple[str, ...] = ("dense_reference", "dense_blocked", "paged_xla")
  baseline: str = "dense_blocked"
  rounds: int = 5
  iters: int = 5
  interpret: bool = False       # run the kernels through Pallas' interpreter (CPU smoke tests)
  table_order: str = "shuffled"  # "shuffled" (worst case) or "sequential" (each sequence's pages
                                 # consecutive, as an allocator serving whole prompts hands them out)
  tiles: tuple[str, ...] = ()    # more runs of our kernel with these tiles (`parse_tiles`), each
                                 # timed beside the others as "pallas[<spec>]"
  layers: int = 1                # > 1: one program chains the path over `layers` copies of the
                                 # pages, each call's output the next one's queries, as a
                                 # model's layers do; past the last-level cache together, each
                                 # reads its pages from memory (a decode step's situation: the
                                 # weights between two steps evict them). 1: one call, hot

  @property
  def mode(self) -> str:
    if self.num_prefill_seqs is not None:
      return "mixed"
    return "decode" if self.q_len == 1 else "prefill"

  @property
  def q_lens(self) -> np.ndarray:
    if self.num_prefill_seqs is not None:
      return np.where(np.arange(self.num_seqs) < self.num_prefill_seqs, self.q_len, 1)
    return np.full(self.num_seqs, self.q_len)


_TILE_KEYS = {"q": "block_q", "bt": "block_tokens", "sp": "num_splits", "w": "num_warps",
              "s": "num_stages", "c": "max_chunk"}


def parse_tiles(spec: str) -> kernel_triton.BlockSizes:
  """"bt64-s3-w8" -> BlockSizes(block_tokens=64, num_stages=3, num_warps=8): dash-separated
  fields, each a key (q block_q, bt block_tokens, sp num_splits, w num_warps, s num_stages,
  c max_chunk) and a positive integer; the rest stay the kernel's own choice."""
  kw = {}
  for field in spec.split("-"):
    key = field.rstrip("0123456789")
    value = field[len(key):]
    if key not in _TILE_KEYS or not value:
      raise ValueError(f"tiles field {field!r} of {spec!r} is not one of "
                       f"{sorted(_TILE_KEYS)} followed by a number")
    kw[_TILE_KEYS[key]] = int(value)
  return kernel_triton.BlockSizes(**kw)


def copy_bandwidth(num_bytes: int = 256 * 2**20, rounds: int = 5) -> float:
  """Bytes read + written per second by a jitted elementwise pass over a buffer larger than the
  last-level cache (L3 here, L2 on a GPU)."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  f(x).block_until_ready()
  times = []
  for _ in range(rounds):
    t = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t)
  return 2 * num_bytes / statistics.median(times)


def seq_lens(cfg: BenchConfig) -> np.ndarray:
  """i32[num_seqs] keys per row: seq_len each, or uniform in [min_seq_len, seq_len]."""
  if cfg.min_seq_len is None:
    return np.full(cfg.num_seqs, cfg.seq_len, np.int32)
  if not 1 <= cfg.min_seq_len <= cfg.seq_len:
    raise ValueError(f"min_seq_len={cfg.min_seq_len} must be in [1, seq_len={cfg.seq_len}]")
  return np.random.default_rng(0).integers(cfg.min_seq_len, cfg.seq_len + 1, cfg.num_seqs,
                                           dtype=np.int32)


def make_inputs(cfg: BenchConfig) -> dict:
  """Contiguous and paged (shuffled pages, NaN in NULL_PAGE) copies of the same K/V, built on
  the device so GPU-sized shapes do not wait on host RNG."""
  if cfg.seq_len % cfg.page_size:
    raise ValueError(f"seq_len={cfg.seq_len} must be a multiple of page_size={cfg.page_size}")
  dtype = jnp.dtype(cfg.dtype)
  kk, kv, kq, kp = jax.random.split(jax.random.key(0), 4)
  shape = (cfg.num_seqs, cfg.seq_len, cfg.num_kv_heads, cfg.head_dim)
  k = jax.random.normal(kk, shape, dtype)
  v = jax.random.normal(kv, shape, dtype)
  pages_per_seq = cfg.seq_len // cfg.page_size
  num_live = cfg.num_seqs * pages_per_seq
  if cfg.table_order not in ("shuffled", "sequential"):
    raise ValueError(f"table_order={cfg.table_order!r} must be 'shuffled' or 'sequential'")
  ids = jnp.arange(num_live) if cfg.table_order == "sequential" else jax.random.permutation(
      kp, num_live)
  tables = (1 + ids).astype(jnp.int32).reshape(cfg.num_seqs, pages_per_seq)
  page_shape = (num_live, cfg.page_size, cfg.num_kv_heads, cfg.head_dim)
  as_pages = lambda x: jnp.full((num_live + 1,) + page_shape[1:], jnp.nan, dtype).at[
      tables.reshape(-1)].set(x.reshape(page_shape))
  q_lens = cfg.q_lens
  q = jax.random.normal(kq, (int(q_lens.sum()), cfg.num_q_heads, cfg.head_dim), dtype)
  return dict(q=q, k=k, v=v, k_pages=as_pages(k), v_pages=as_pages(v), block_tables=tables,
              seq_lens=jnp.asarray(seq_lens(cfg), jnp.int32),
              cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32))


def _jax_paged(cfg: BenchConfig, data: dict) -> Callable[[dict], jax.Array]:
  from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged   # deprecated in 0.11
  k_splits = 16
  pages_per_seq = data["block_tables"].shape[1]
  pad = -pages_per_seq % k_splits   # its k_splits must divide pages_per_seq
  tables = jnp.pad(data["block_tables"], ((0, 0), (0, pad)))
  k_heads_first = jnp.transpose(data["k_pages"], (2, 0, 1, 3))   # [K, P, S, D]
  v_heads_first = jnp.transpose(data["v_pages"], (2, 0, 1, 3))
  scale = cfg.head_dim ** -0.5
  ppcb = math.gcd(8, (pages_per_seq + pad) // k_splits)   # must divide its partition
  return lambda d: jax_paged.paged_attention(
      d["q"] * jnp.asarray(scale, d["q"].dtype), k_heads_first, v_heads_first, tables,
      d["seq_lens"], k_splits=k_splits, pages_per_compute_block=ppcb, interpret=cfg.interpret)


def _jax_decode(cfg: BenchConfig) -> Callable[[dict], jax.Array]:
  from jax.experimental.pallas.ops.gpu import decode_attention
  return lambda d: decode_attention.gqa(d["q"], d["k"], d["v"], kv_seq_len=d["seq_lens"],
                                        interpret=cfg.interpret)


def implementations(cfg: BenchConfig, data: dict) -> dict[str, Callable[[dict], jax.Array]]:
  """name -> f(inputs) for every path that can run here with this config."""
  max_q_len = int(cfg.q_lens.max())
  ppb = max(1, cfg.block_tokens // cfg.page_size)
  dense_ref = jax.jit(attention.dense_attention, static_argnames=("max_q_len",))
  impls = {
      "dense_reference": lambda d: dense_ref(d["q"], d["k"], d["v"], d["cu_q_lens"], d["seq_lens"],
                                             max_q_len=max_q_len),
      "dense_blocked": lambda d: attention.contiguous_attention(
          d["q"], d["k"], d["v"], d["seq_lens"], d["cu_q_lens"], max_q_len=max_q_len,
          block_tokens=cfg.block_tokens),
      "paged_xla": lambda d: attention.paged_attention_xla(
          d["q"], d["k_pages"], d["v_pages"], d["block_tables"], d["seq_lens"], d["cu_q_lens"],
          max_q_len=max_q_len, pages_per_block=ppb),
  }
  if cfg.mode == "decode":
    impls["decode_xla"] = lambda d: attention.decode_attention_xla(
        d["q"], d["k_pages"], d["v_pages"], d["block_tables"], d["seq_lens"], d["cu_q_lens"])
    if cpu_kernel.unavailable_reason() is None:
      impls["decode_cpu"] = lambda d: cpu_kernel.paged_attention(
          d["q"], d["k_pages"], d["v_pages"], d["block_tables"], d["seq_lens"], d["cu_q_lens"])
  if cfg.mode == "prefill":
    # The chunks' own keys (each row's last q_len), as a step has them beside its pages.
    lens, q_len = seq_lens(cfg), cfg.q_len
    own = [jnp.concatenate([x[b, n - q_len:n] for b, n in enumerate(lens)])
           for x in (data["k"], data["v"])]
    prefill_xla = jax.jit(functools.partial(attention.prefill_attention, max_q_len=max_q_len))
    impls["prefill_xla"] = lambda d: prefill_xla(d["q"], *own, d["k_pages"], d["v_pages"],
                                                 d["block_tables"], d["seq_lens"], d["cu_q_lens"])
    if cpu_kernel.unavailable_reason() is None:
      prefill_cpu = jax.jit(cpu_kernel.paged_attention)
      impls["prefill_cpu"] = lambda d: prefill_cpu(d["q"], d["k_pages"], d["v_pages"],
                                                   d["block_tables"], d["seq_lens"],
                                                   d["cu_q_lens"])
  if cfg.interpret or attention.kernel_unavailable_reason(cfg.head_dim, cfg.page_size) is None:
    impls["pallas"] = lambda d: kernel_triton.paged_attention(
        d["q"], d["k_pages"], d["v_pages"], d["block_tables"], d["seq_lens"], d["cu_q_lens"],
        max_q_len=max_q_len, interpret=cfg.interpret)
    for spec in cfg.tiles:
      impls[f"pallas[{spec}]"] = functools.partial(
          lambda d, bs: kernel_triton.paged_attention(
              d["q"], d["k_pages"], d["v_pages"], d["block_tables"], d["seq_lens"],
              d["cu_q_lens"], max_q_len=max_q_len, interpret=cfg.interpret, block_sizes=bs),
          bs=parse_tiles(spec))
    if cfg.mode == "decode":
      impls["jax_paged"] = _jax_paged(cfg, data)
      impls["jax_decode"] = _jax_decode(cfg)
  return impls


def run(cfg: BenchConfig, copy_bytes_per_s: float | None = None) -> list[dict]:
  """Checks every path against the reference, then times them interleaved. One record per path."""
  unknown = set(cfg.impls) - set(ALL_IMPLS)
  if unknown:
    raise ValueError(f"impls {sorted(unknown)} are not available; choose from {ALL_IMPLS}")
  if cfg.layers < 1:
    raise ValueError(f"layers={cfg.layers} must be >= 1")
  if copy_bytes_per_s is None:
    copy_bytes_per_s = copy_bandwidth()
  data = make_inputs(cfg)
  available = implementations(cfg, data)
  names = [n for n in cfg.impls if n in available]   # GPU-only paths drop out on a CPU
  names += [f"pallas[{spec}]" for spec in cfg.tiles if f"pallas[{spec}]" in available]
  # 1) Correctness before timing, against the f32 reference on the paged data. The reference
  #    materialises all scores; at GPU-sized shapes check the first 8 sequences only (their pages
  #    gathered, so the f32 copy stays small).
  check = min(cfg.num_seqs, 8)
  cu = np.asarray(data["cu_q_lens"])
  sub = lambda x: x[:check]
  dense_of = lambda pages: reference.gather_pages(pages, sub(data["block_tables"])).astype(jnp.float32)
  expected = np.asarray(jax.jit(attention.dense_attention, static_argnames=("max_q_len",))(
      data["q"][:cu[check]].astype(jnp.float32), dense_of(data["k_pages"]),
      dense_of(data["v_pages"]), data["cu_q_lens"][:check + 1], sub(data["seq_lens"]),
      max_q_len=int(cfg.q_lens.max())))
  errors, compile_s = {}, {}
  for name in list(names):
    try:
      t = time.perf_counter()
      out = np.asarray(available[name](data)[:cu[check]], np.float32)   # first call: compile + run
      compile_s[name] = time.perf_counter() - t
      errors[name] = float(np.max(np.abs(out - expected)))
      # JAX's own kernels keep partial outputs in the input dtype; their tests use 5e-2 for f16.
      tol = 1e-5 if cfg.dtype == "float32" else (5e-2 if name in _DECODE_ONLY else 2e-2)
      if not errors[name] <= tol * (1 + np.max(np.abs(expected))):
        raise AssertionError(f"{name}: max error {errors[name]} against the reference exceeds "
                             f"{tol}")
    except Exception as e:   # a --tiles run that fails is reported and dropped; others raise
      if not name.startswith("pallas["):
        raise
      print(f"{cfg.mode} B={cfg.num_seqs} T={cfg.seq_len}: {name} FAILED ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]})", flush=True)
      names.remove(name)
  # 2) Steady state, interleaved so drift on a noisy machine hits every path alike. With
  #    `layers`, each timed call is one program of `layers` chained calls (seconds per call).
  timed, arg = available, data
  if cfg.layers > 1:
    arg = [data] + [dict(data, k_pages=jnp.array(data["k_pages"], copy=True),
                         v_pages=jnp.array(data["v_pages"], copy=True))
                    for _ in range(cfg.layers - 1)]

    def chain(f, copies):
      q = copies[0]["q"]
      for d in copies:
        q = f(dict(d, q=q)).astype(q.dtype)
      return q
    timed = {name: jax.jit(functools.partial(chain, available[name])) for name in names}
  samples = {name: [] for name in names}
  for _ in range(cfg.rounds):
    for name in names:
      f = timed[name]
      f(arg).block_until_ready()
      t = time.perf_counter()
      for _ in range(cfg.iters):
        out = f(arg)
      out.block_until_ready()
      samples[name].append((time.perf_counter() - t) / cfg.iters / cfg.layers)
  kv_bytes = (2 * int(seq_lens(cfg).sum()) * cfg.num_kv_heads * cfg.head_dim
               * jnp.dtype(cfg.dtype).itemsize)   # the keys and values the rows hold
  base = statistics.median(samples[cfg.baseline]) if cfg.baseline in samples else None
  records = []
  for name in names:
    seconds = statistics.median(samples[name])
    records.append({
        **{k: v for k, v in dataclasses.asdict(cfg).items() if k != "impls"},
        "mode": cfg.mode, "impl": name, "ms": seconds * 1e3, "compile_s": compile_s[name],
        "kv_bytes": kv_bytes, "kv_gb_per_s": kv_bytes / seconds / 1e9,
        "copy_gb_per_s": copy_bytes_per_s / 1e9,
        "fraction_of_copy_bw": kv_bytes / seconds / copy_bytes_per_s,
        "ratio_vs_baseline": seconds / base if base else None,
        "max_abs_err": errors[name],
        "jax": jax.__version__, "device": jax.devices()[0].device_kind,
    })
  return records


def kernel_note(cfg: BenchConfig) -> str:
  """The kernel's planned tiles for this shape, and the CPU-side PTX estimate of its registers
  and occupancy (experiments/kernel_ptx.py's table) to read a GPU timing against."""
  from experiments import kernel_ptx   # pylint: disable=import-outside-toplevel
  group = cfg.num_q_heads // cfg.num_kv_heads
  max_q_len = int(cfg.q_lens.max())
  p = kernel_triton.plan(cfg.num_seqs, cfg.num_kv_heads, group, max_q_len,
                         -(-cfg.seq_len // cfg.page_size), cfg.page_size,
                         kernel_triton.BlockSizes(), head_dim=cfg.head_dim, dtype=cfg.dtype)
  tiles = (f"pallas tiles: {p.block_rows} rows, {p.block_tokens} keys per step, {p.num_warps} "
           f"warps, {p.num_stages} stages, {p.num_splits} splits")
  est = kernel_ptx.estimate(cfg.dtype, "highest", cfg.head_dim, cfg.page_size, cfg.mode, group)
  if est is None or est.get("regs") is None:
    return tiles + "; no CPU-side PTX estimate (run python -m experiments.kernel_ptx)"
  return (tiles + f"; CPU-side PTX estimate for sm_90 ({est['label']}): {est['regs']} registers, "
          f"{est['programs']} programs/SM ({est['occupancy']:.0%} occupancy, {est['limit']}-bound)")


def format_records(records: Sequence[dict]) -> str:
  lines = []
  for r in records:
    ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] else "-"
    lines.append(f"{r['mode']:7s} B={r['num_seqs']:<3d} T={r['seq_len']:<5d} {r['table_order'][:4]} "
                 f"{'L=%d ' % r['layers'] if r.get('layers', 1) > 1 else ''}"
                 f"{r['impl']:16s} "
                 f"{r['ms']:8.3f} ms  {r['kv_gb_per_s']:7.1f} GB/s  "
                 f"{r['fraction_of_copy_bw']:5.2f} of copy  {ratio:>6s} vs {r['baseline']}  "
                 f"err {r['max_abs_err']:.1e}  compile {r['compile_s']:.2f}s")
  return "\n".join(lines)


PRESETS = {
    # issue 2: CPU, 32 seqs x 1k-4k tokens, 8 q / 2 kv heads, head_dim 64, f32.
    "cpu": dict(batches=None, seq_lens=(1024, 2048, 4096), num_q_heads=8, num_kv_heads=2,
                head_dim=64, dtype="float32", impls=("dense_reference", "dense_blocked", "paged_xla"),
                baseline="dense_blocked"),
    # issue 4: GPU, batches 1-128 x 512-32k tokens, 32 q / 8 kv heads, head_dim 128, page 16, bf16.
    "gpu": dict(batches=(1, 8, 32, 128), seq_lens=(512, 2048, 8192, 32768), num_q_heads=32,
                num_kv_heads=8, head_dim=128, dtype="bfloat16",
                impls=("pallas", "jax_paged", "jax_decode", "paged_xla"), baseline="jax_paged"),
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  preset = PRESETS[_PRESET.value]
  pick = lambda flag, key: flag.value if flag.present else preset[key]
  seq_lens = [int(x) for x in _SEQ_LENS.value] if _SEQ_LENS.present else preset["seq_lens"]
  batches = ([_NUM_SEQS.value] if _NUM_SEQS.present or preset["batches"] is None
             else preset["batches"])
  impls = tuple(_IMPLS.value) if _IMPLS.present else preset["impls"]
  copy_bw = copy_bandwidth()
  print(f"copy bandwidth (read + write, 256 MiB): {copy_bw / 1e9:.2f} GB/s  "
        f"[jax {jax.__version__}, {jax.devices()[0].device_kind}]")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  common = dict(page_size=_PAGE_SIZE.value, num_q_heads=pick(_NUM_Q_HEADS, "num_q_heads"),
                num_kv_heads=pick(_NUM_KV_HEADS, "num_kv_heads"),
                head_dim=pick(_HEAD_DIM, "head_dim"), dtype=pick(_DTYPE, "dtype"),
                block_tokens=_BLOCK_TOKENS.value, impls=impls, table_order=_TABLE_ORDER.value,
                baseline=_BASELINE.value or preset["baseline"], rounds=_ROUNDS.value,
                iters=_ITERS.value, min_seq_len=_MIN_SEQ_LEN.value, layers=_LAYERS.value,
                tiles=tuple(_TILES.value or ()))
  for spec in common["tiles"]:
    parse_tiles(spec)   # a bad spec fails here, before any timing
  configs = []
  for mode in _MODES.value:
    for seq_len in seq_lens:
      if mode == "decode":
        configs += [BenchConfig(num_seqs=b, seq_len=seq_len, **common) for b in batches]
      elif mode == "prefill":
        configs.append(BenchConfig(num_seqs=_PREFILL_NUM_SEQS.value, seq_len=seq_len,
                                   q_len=min(_PREFILL_Q_LEN.value, seq_len), **common))
      elif mode == "mixed":
        configs.append(BenchConfig(num_seqs=max(batches), seq_len=seq_len,
                                   q_len=min(_PREFILL_Q_LEN.value, seq_len),
                                   num_prefill_seqs=_PREFILL_NUM_SEQS.value, **common))
      else:
        raise app.UsageError(f"--modes: {mode!r} is not decode, prefill or mixed")
  for cfg in configs:
    try:
      records = run(cfg, copy_bw)
    except (MemoryError, jax.errors.JaxRuntimeError) as e:   # too big for this device: say so
      print(f"{cfg.mode} B={cfg.num_seqs} T={cfg.seq_len}: skipped ({type(e).__name__}: "
            f"{str(e)[:120]})", flush=True)
      continue
    print(format_records(records), flush=True)
    if "pallas" in {r["impl"] for r in records}:
      print("  " + kernel_note(cfg), flush=True)
    with open(_OUT.value, "a") as f:
      for r in records:
        f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  # Flags exist only when run as a script, so tests can import every experiment into one
  # process without absl's duplicate-flag error (several scripts share --page_size).
  _PRESET = flags.DEFINE_enum("preset", "cpu", list(PRESETS), "Shape sweep (flags below override).")
  _SEQ_LENS = flags.DEFINE_list("seq_lens", None, "Tokens per sequence (sweep).")
  _NUM_SEQS = flags.DEFINE_integer("num_seqs", 32, "Sequences per decode batch.")
  _MIN_SEQ_LEN = flags.DEFINE_integer("min_seq_len", None,
                                      "Ragged rows: lengths uniform in [min_seq_len, seq_len].")
  _MODES = flags.DEFINE_list("modes", ["decode", "prefill"], "decode, prefill and/or mixed.")
  _PREFILL_Q_LEN = flags.DEFINE_integer("prefill_q_len", 128,
                                        "Queries per prefill sequence (a chunk after a prefix).")
  _PREFILL_NUM_SEQS = flags.DEFINE_integer("prefill_num_seqs", 4,
                                           "Sequences in prefill mode; prefill rows in mixed mode.")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page.")
  _NUM_Q_HEADS = flags.DEFINE_integer("num_q_heads", 8, "Query heads.")
  _NUM_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "KV heads.")
  _HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
  _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "K/V and query dtype.")
  _BLOCK_TOKENS = flags.DEFINE_integer("block_tokens", attention.DEFAULT_BLOCK_TOKENS,
                                       "Keys per loop iteration of the blocked XLA paths.")
  _IMPLS = flags.DEFINE_list("impls", None, f"Paths to time, from {ALL_IMPLS}.")
  _TILES = flags.DEFINE_list("tiles", None, "More runs of our kernel with these tiles, e.g. "
                             "bt64-s3-w8 (q block_q, bt block_tokens, sp num_splits, w num_warps, "
                             "s num_stages, c max_chunk), timed beside the rest (GPU or "
                             "--interpret).")
  _BASELINE = flags.DEFINE_string("baseline", None, "Path the ratios are relative to.")
  _TABLE_ORDER = flags.DEFINE_enum("table_order", "shuffled", ["shuffled", "sequential"],
                                   "Page order in the block tables.")
  _ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (median is reported).")
  _ITERS = flags.DEFINE_integer("iters", 5, "Calls per round.")
  _LAYERS = flags.DEFINE_integer("layers", 1, "Copies of the pages one timed program chains the "
                                 "path over (30: SmolLM2's layers; the pages come from memory).")
  _OUT = flags.DEFINE_string("out", "experiments/results/attention_bench.jsonl", "JSONL to append to.")
  app.run(main)
