"""The GPU kernel compiled to PTX and cubin without a GPU: registers, spills, shared memory and
occupancy for every configuration the kernel supports, for sm_80 and sm_90.

  python -m experiments.kernel_ptx                       # the whole matrix; exit 1 on a failure
  python -m experiments.kernel_ptx --write_table         # ... and rewrite WORKSPACE.md's table
  python -m experiments.kernel_ptx --dtypes=float32 --head_dims=64 --modes=decode   # a slice
  python -m experiments.kernel_ptx --errors              # precision errors, interpret mode
  python -m experiments.kernel_ptx --reuse=experiments/results/kernel_ptx.jsonl --spot_check=48
                                        # CI: compile only kernels the committed matrix has not

How: each configuration is lowered for CUDA here (`triton_ir.lower_for_cuda`), its Triton IR is
taken out of the lowering (`triton_ir.triton_kernels`), identical kernels are compiled once, and
`pallas_kernels/paged_attention/ptx_compile.py` compiles them with pip `triton==3.9.0` (its own
venv, --triton_python, built on first use: `python3 -m venv .venv-ptx && .venv-ptx/bin/pip install
triton==3.9.0`) and its bundled ptxas. A configuration fails on a lowering or compile error, on any
register spill, or on dynamic shared memory over the arch's per-block launch limit (163 KiB
sm_80, 227 KiB sm_90). Occupancy (programs resident per SM) follows from registers, warps and
shared memory (`ptx_compile.occupancy`).

The matrix: bf16 and f32 (f32 at each precision: highest, tf32x3, default); head_dim 64, 80, 96,
128, 256; page sizes 1, 16, 64; decode (q_len 1), mixed (chunks up to 16 beside decode rows) and
prefill (chunks of 256); GQA groups 1, 4, 8; plain, and sliding window with soft cap.

With --reuse, a kernel (same key: Triton IR, warps, stages) that the newest whole matrix of that
file compiled with the same triton and passed keeps its figures instead of being compiled again;
--spot_check=N compiles N of those anyway and fails where the figures differ.

Results: one JSON line per run in experiments/results/kernel_ptx.jsonl (every configuration's
figures), and with --write_table the per-(dtype, precision, head_dim) summary between the
kernel-resources markers of WORKSPACE.md.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import output, tool_venv
from pallas_kernels.paged_attention import kernel_triton, ptx_compile, triton_ir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTX_COMPILE = os.path.join(ROOT, "pallas_kernels", "paged_attention", "ptx_compile.py")
WORKSPACE = os.path.join(ROOT, "WORKSPACE.md")
TABLE_BEGIN, TABLE_END = "<!-- kernel-resources -->", "<!-- /kernel-resources -->"
TRITON_VERSION = "3.9.0"

_RESULTS_JSONL = os.path.join(output.RESULTS, "kernel_ptx.jsonl")
MODES = {"decode": 1, "mixed": 16, "prefill": 256}   # mode -> max_q_len
FEATURES = ("plain", "window+cap")
# The quantized pages of `paged_jax.kv_quant` the kernel dequantizes: codes and their scales.
QUANTIZED_FORMATS = ("int8:token", "int8:page", "float8_e4m3fn:tensor", "float8_e5m2:tensor")


def define_flags():
  """The script's flags, defined only when it runs as one: scripts that import this module
  (attention_bench's kernel note) have flags of their own, some with the same names."""
  flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Input dtypes.")
  flags.DEFINE_list("precisions", list(kernel_triton.PRECISIONS), "f32 precisions (bf16 has one).")
  flags.DEFINE_list("head_dims", ["64", "80", "96", "128", "256"], "Head dims.")
  flags.DEFINE_list("page_sizes", ["1", "16", "64"], "Page sizes.")
  flags.DEFINE_list("modes", list(MODES), f"Batch kinds: {', '.join(MODES)}.")
  flags.DEFINE_list("groups", ["1", "4", "8"], "Query heads per KV head.")
  flags.DEFINE_list("features", list(FEATURES), "plain, window+cap (sliding window and soft cap).")
  flags.DEFINE_list("archs", ["80", "90"], "Compute capabilities to compile for.")
  flags.DEFINE_list("kv_formats", list(QUANTIZED_FORMATS),
                    "Quantized page formats (kv_dtype:kv_scales) compiled on a sub-matrix: "
                    "--kv_head_dims, page 16, every mode, group 4, plain, bf16 and f32/highest "
                    "('' for none).")
  flags.DEFINE_list("kv_head_dims", ["64", "128"], "Head dims of the quantized sub-matrix.")
  flags.DEFINE_string("triton_python", ".venv-ptx/bin/python",
                      f"A python with triton=={TRITON_VERSION} (built there if missing).")
  flags.DEFINE_integer("lower_workers", min(4, os.cpu_count() or 1),
                       "Processes that lower the configurations (JAX tracing, one core each).")
  flags.DEFINE_string("keep", None, "Keep TTIR / PTX / cubin of every kernel in this directory.")
  flags.DEFINE_string("results_dir", output.RESULTS, "Where kernel_ptx.jsonl goes ('' for none).")
  flags.DEFINE_bool("write_table", False, "Rewrite the table in WORKSPACE.md.")
  flags.DEFINE_string("reuse", None, "Take the figures of kernels (same key, arch and triton) the "
                      "newest whole-matrix record of this kernel_ptx.jsonl compiled and passed "
                      "instead of compiling them again; the rest are compiled (CI: the committed "
                      "experiments/results/kernel_ptx.jsonl).")
  flags.DEFINE_integer("spot_check", 0, "With --reuse: compile this many of the reused kernels "
                       "anyway and fail where their figures differ from the reused ones.")
  flags.DEFINE_string("table_from", None, "Rewrite WORKSPACE.md's table from the newest whole-matrix "
                      "record of this kernel_ptx.jsonl (e.g. CI's PTX_RESULTS_DIR) without compiling.")
  flags.DEFINE_bool("errors", False, "Measure each precision's error in interpret mode instead.")
  flags.DEFINE_bool("legacy_tiles", False,
                    "Compile with the tiles the kernel used before default_tiles (64 rows, 64 keys per "
                    "step, 4 warps, whole power-of-two head_dim dots) instead: the control.")
  flags.DEFINE_enum("source", "triton", ["triton", "xla"],
                    "triton: pip triton's compiler on this machine (no GPU needed); xla: compile on "
                    "this machine's GPU with XLA's own Triton and read its PTX with ptxas "
                    "(gpu_check.sh; needs XLA_FLAGS=--xla_dump_to=--dump_dir).")
  flags.DEFINE_string("dump_dir", "/tmp/paged_jax_xla_dump", "XLA's dump directory (--source=xla).")


FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Config:
  dtype: str
  precision: str
  head_dim: int
  page_size: int
  mode: str
  group: int
  features: str
  kv: str = "auto"   # quantized pages: "kv_dtype:kv_scales" (QUANTIZED_FORMATS)

  @property
  def label(self) -> str:
    prec = "" if self.dtype == "bfloat16" else f"/{self.precision}"
    kv = "" if self.kv == "auto" else f" kv={self.kv}"
    return (f"{self.dtype}{prec} d{self.head_dim} page{self.page_size} {self.mode} "
            f"g{self.group} {self.features}{kv}")


def matrix(dtypes, precisions, head_dims, page_sizes, modes, groups, features) -> list[Config]:
  """Every combination; bf16 has one precision (its dots are bf16 tensor-core dots)."""
  out = []
  for dtype, prec, d, ps, mode, g, feat in itertools.product(
      dtypes, precisions, head_dims, page_sizes, modes, groups, features):
    if dtype == "bfloat16" and prec != precisions[0]:
      continue
    out.append(Config(dtype, prec if dtype == "float32" else "highest", int(d), int(ps), mode,
                      int(g), feat))
  return out


def quantized_matrix(kv_formats, head_dims) -> list[Config]:
  """The quantized pages' sub-matrix: each format x head dim x mode, page 16, group 4, plain,
  for bf16 and f32 at "highest" (the kernel dequantizes to the query's dtype, then runs the
  same dots as on plain pages)."""
  return [Config(dtype, "highest", int(d), 16, mode, 4, "plain", kv)
          for kv in kv_formats for dtype in ("bfloat16", "float32") for d in head_dims
          for mode in MODES]


def _call(cfg: Config, block_sizes: kernel_triton.BlockSizes = kernel_triton.BlockSizes()):
  """(fn, abstract args) of one configuration: 4 sequences, 2 KV heads, a 64-page pool."""
  num_seqs, num_kv_heads, num_pages, pages_per_seq = 4, 2, 64, 16
  max_q_len = MODES[cfg.mode]
  dtype = jnp.dtype(cfg.dtype)
  sds = lambda *s, d=dtype: jax.ShapeDtypeStruct(s, d)
  pages = sds(num_pages, cfg.page_size, num_kv_heads, cfg.head_dim)
  kw = dict(sliding_window=100, soft_cap=30.0) if cfg.features == "window+cap" else {}
  extra = ()
  if cfg.kv != "auto":
    from paged_jax import kv_quant
    kv_dtype, _, granularity = cfg.kv.partition(":")
    fmt = kv_quant.kv_format(kv_dtype, granularity or None)
    pages = sds(num_pages, cfg.page_size, num_kv_heads, cfg.head_dim, d=fmt.code_dtype)
    scales = sds(num_pages, *fmt.scale_shape(cfg.page_size, num_kv_heads), d=jnp.float32)
    extra = (scales, scales)
  args = (sds(num_seqs * max_q_len, num_kv_heads * cfg.group, cfg.head_dim), pages, pages,
          sds(num_seqs, pages_per_seq, d=jnp.int32), sds(num_seqs, d=jnp.int32),
          sds(num_seqs + 1, d=jnp.int32)) + extra

  def fn(*a):
    if len(a) == 8:
      a, kw["k_scales"], kw["v_scales"] = a[:6], a[6], a[7]
    return kernel_triton.paged_attention(*a, max_q_len=max_q_len, precision=cfg.precision,
                                         block_sizes=block_sizes, **kw)
  return fn, args


def legacy_block_sizes(cfg: Config) -> kernel_triton.BlockSizes:
  """The tiles of the kernel before `default_tiles` existed, for one configuration."""
  max_q_len = MODES[cfg.mode]
  block_q = 1 if max_q_len == 1 else max(1, min(max_q_len, 64 // cfg.group))
  return kernel_triton.BlockSizes(block_q=block_q, block_tokens=max(64, cfg.page_size),
                                  num_warps=4, num_stages=2, max_chunk=256)


def lower(cfg: Config, block_sizes: kernel_triton.BlockSizes = kernel_triton.BlockSizes()
          ) -> list[triton_ir.TritonKernel]:
  """The Triton kernels of one configuration, lowered for CUDA on this machine."""
  fn, args = _call(cfg, block_sizes)
  return triton_ir.triton_kernels(triton_ir.lower_for_cuda(fn, *args))


def _lower_chunk(cfgs: list[Config], legacy_tiles: bool) -> list[tuple]:
  """[(configuration, its kernels or None, None or the lowering error)] for `cfgs`."""
  out = []
  for cfg in cfgs:
    try:
      kernels = lower(cfg, legacy_block_sizes(cfg) if legacy_tiles else kernel_triton.BlockSizes())
      if not kernels:
        raise RuntimeError("no Triton call in the lowered module")
      out.append((cfg, kernels, None))
    except Exception as e:  # the caller reports it as that configuration's failure
      out.append((cfg, None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
  return out


def lower_all(cfgs: list[Config], legacy_tiles: bool = False, workers: int = 1) -> list[tuple]:
  """`_lower_chunk` of every configuration, in order, spread over `workers` processes.

  Lowering is JAX tracing in Python, one core each, and most of CI's PTX stage once the figures
  are reused: 226-246 s for 1,080 configurations in one process, 134 s for 1,128 in two."""
  if workers <= 1 or len(cfgs) < 2 * workers:
    return _lower_chunk(cfgs, legacy_tiles)
  import concurrent.futures
  import multiprocessing
  chunks = [cfgs[i::workers] for i in range(workers)]   # interleaved: alike costs per worker
  with concurrent.futures.ProcessPoolExecutor(
      workers, mp_context=multiprocessing.get_context("spawn")) as pool:
    parts = list(pool.map(_lower_chunk, chunks, [legacy_tiles] * workers))
  out = [None] * len(cfgs)
  for i, part in enumerate(parts):
    out[i::workers] = part
  return out


def find_ptxas() -> str | None:
  """The ptxas of the nvidia-cuda-nvcc wheel (which jax[cuda12] installs), else PATH's."""
  try:
    import nvidia.cuda_nvcc as nvcc   # pylint: disable=import-outside-toplevel
    for base in list(getattr(nvcc, "__path__", [])):
      candidate = os.path.join(base, "bin", "ptxas")
      if os.path.exists(candidate):
        return candidate
  except ImportError:
    pass
  return shutil.which("ptxas")


def dump_inventory(dump_dir: str) -> str:
  """What a dump directory holds, by file suffix (a count and one example of each)."""
  kinds = collections.defaultdict(list)
  for root, _, files in os.walk(dump_dir):
    for name in files:
      kinds[name.rsplit(".", 1)[-1] if "." in name else ""].append(os.path.join(root, name))
  return ", ".join(f"{len(v)} .{k} (e.g. {os.path.relpath(v[0], dump_dir)})"
                   for k, v in sorted(kinds.items())) or "nothing"


def xla_resources(cfgs: list[Config], dump_dir: str, ptxas: str) -> list[dict]:
  """On a GPU: compiles each configuration with XLA (its own pinned Triton), reads the PTX XLA
  dumps (XLA_FLAGS=--xla_dump_to=dump_dir, set before jax starts) with `ptxas -v`, and returns
  the kernel's registers and spills per configuration. Shared memory is Triton's dynamic
  allocation, which ptxas does not see: those rows leave it out (occupancy from registers and
  warps only)."""
  device = jax.devices()[0]
  arch = int(str(getattr(device, "compute_capability", "0")).replace(".", ""))
  ptx_files = lambda: set(glob.glob(os.path.join(dump_dir, "**", "*.ptx"), recursive=True))
  rows = []
  for cfg in cfgs:
    before = ptx_files()
    fn, args = _call(cfg)
    row = dict(dataclasses.asdict(cfg), label=cfg.label, arch=arch, source="xla")
    try:
      lowered = jax.jit(fn).lower(*args)
      lowered.compile()
      [kernel] = triton_ir.triton_kernels(lowered)
      row.update(num_warps=kernel.num_warps, num_stages=kernel.num_stages)
      entries = {}
      for path in sorted(ptx_files() - before):
        proc = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}", path, "-o", os.devnull],
                              capture_output=True, text=True)
        entries.update(ptx_compile.parse_ptxas_entries(proc.stderr + proc.stdout))
      mine = {k: v for k, v in entries.items() if "ragged_paged_attention" in k} or entries
      if not mine:
        raise RuntimeError(f"no PTX entry found in {dump_dir} (is XLA_FLAGS=--xla_dump_to set?); "
                           f"it holds {dump_inventory(dump_dir)}")
      name, res = max(mine.items(), key=lambda kv: kv[1]["regs"] or 0)
      row.update(ok=True, entry=name, shared=None, **res)
      spilled = (res.get("spill_stores") or 0) + (res.get("spill_loads") or 0)
      row["problems"] = [f"spills {spilled} B"] if spilled else []
      if arch in ptx_compile.ARCH_LIMITS:
        row.update(ptx_compile.occupancy(res["regs"], kernel.num_warps, 0, arch))
    except Exception as e:  # report and go on
      row.update(ok=False, problems=[f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"])
    row["pass"] = not row["problems"]
    rows.append(row)
  return rows


def ensure_triton(python: str) -> str | None:
  """None when `python` has triton==TRITON_VERSION (building the venv if missing), else why not."""
  return tool_venv.ensure(python, "triton", TRITON_VERSION, [f"triton=={TRITON_VERSION}"])


def kernel_key(kernel: triton_ir.TritonKernel) -> str:
  """One kernel's identity (12 hex digits of a SHA-1): its Triton IR (which holds no source
  locations), warps and stages. The same key, the same compile: `check` compiles each key once,
  and a matrix row's key says which kernel its figures are for."""
  return hashlib.sha1(f"{kernel.ttir}|{kernel.num_warps}|{kernel.num_stages}".encode()
                      ).hexdigest()[:12]


# What a compile gives (ptx_compile's result), and so what a reused row carries over.
FIGURES = ("ok", "regs", "spill_stores", "spill_loads", "shared")


def reusable(path: str = _RESULTS_JSONL, triton: str = TRITON_VERSION) -> dict:
  """(kernel key, arch) -> the compiled figures of each passing row of the newest whole-matrix
  record in `path`, when pip triton `triton` compiled it; {} otherwise. A kernel's key is its
  Triton IR, warps and stages, so the same key compiled by the same triton gives the same
  figures: `check` need not compile it again (CI lowers the whole matrix and compiles only the
  kernels the committed matrix has not, plus a spot check of the rest). The newest quantized
  sub-matrix record (kind "quantized_matrix": a run with --head_dims= compiles it alone) adds
  its rows."""
  out = {}
  for rec in (newest_matrix(path, "quantized_matrix"), newest_matrix(path)):
    if rec is None or rec.get("triton") != triton:
      continue
    out.update({(r["key"], r["arch"]): {k: r.get(k) for k in FIGURES}
                for r in rec["rows"] if r.get("key") and r.get("pass")})
  return out


def spot_sample(pairs, n: int) -> set:
  """n of the (key, arch) pairs, evenly spread over their sorted order (the same n each run)."""
  pairs = sorted(pairs)
  if n <= 0 or not pairs:
    return set()
  step = max(len(pairs) / n, 1.0)
  return {pairs[int(i * step)] for i in range(min(n, len(pairs)))}


def archs_for(cfg: Config, archs) -> list[int]:
  """The archs a configuration is compiled for: fp8 e4m3 pages not below sm_89, where Triton
  cannot convert them ("Conversion from/to f8e4m3nv is only supported on compute capability >=
  89") and the engine refuses the format by name (`kv_quant.unsupported_reason`)."""
  if cfg.kv.startswith("float8_e4m3fn"):
    return [a for a in archs if a >= 89]
  return list(archs)


def check(cfg_kernels, archs, triton_python, workdir, reuse: dict | None = None,
          spot_check: int = 0) -> list[dict]:
  """Compiles each distinct kernel once per arch; one row per (configuration, arch).

  reuse: `reusable()`'s figures: a (key, arch) found there is not compiled; its row takes those
  figures (marked reused). spot_check: that many of the reused pairs are compiled all the same,
  and a row whose figures differ from the reused ones fails (the toolchain is not the one the
  figures came from)."""
  reuse = reuse or {}
  jobs, key_of, seen, reused = [], {}, set(), set()
  for cfg, kernels in cfg_kernels:
    for k in kernels:
      key = kernel_key(k)
      key_of[(cfg, k.name)] = key
      if key in seen:
        continue
      seen.add(key)
      todo = [a for a in archs_for(cfg, archs) if (key, a) not in reuse]
      reused.update((key, a) for a in archs_for(cfg, archs) if (key, a) in reuse)
      if not todo:
        continue
      jobs += _jobs(k, key, todo, workdir)
  spot = spot_sample(reused, spot_check)
  kernel_of = {key_of[(cfg, k.name)]: k for cfg, kernels in cfg_kernels for k in kernels}
  for key, arch in sorted(spot):
    jobs += _jobs(kernel_of[key], key, [arch], workdir)
  compiled = _compile(jobs, triton_python, workdir) if jobs else {}
  rows = []
  for cfg, kernels in cfg_kernels:
    for k in kernels:
      for arch in archs_for(cfg, archs):
        key = key_of[(cfg, k.name)]
        if (key, arch) in reused:
          res = dict(reuse[(key, arch)], reused=True)
        else:
          res = dict(compiled[f"{key}/sm{arch}"])
        row = judge(dict(dataclasses.asdict(cfg), label=cfg.label, arch=arch, kernel=k.name,
                         key=key, num_warps=k.num_warps, num_stages=k.num_stages, **res))
        if (key, arch) in spot:
          now = compiled[f"{key}/sm{arch}"]
          differ = {f: (reuse[(key, arch)].get(f), now.get(f)) for f in FIGURES
                    if reuse[(key, arch)].get(f) != now.get(f)}
          row["spot_checked"] = True
          if differ:
            row["problems"].append(f"spot check: compiled now, the figures differ from the "
                                   f"reused ones (reused, now): {differ}")
            row["pass"] = False
        rows.append(row)
  return rows


def _jobs(kernel, key, archs, workdir) -> list[dict]:
  path = os.path.join(workdir, key + ".ttir")
  with open(path, "w") as fh:
    fh.write(kernel.ttir)
  return [dict(key=key, ttir=path, num_warps=kernel.num_warps, num_stages=kernel.num_stages,
               arch=a) for a in archs]


def _compile(jobs, triton_python, workdir) -> dict:
  jobs_path, results_path = os.path.join(workdir, "jobs.json"), os.path.join(workdir, "res.json")
  with open(jobs_path, "w") as fh:
    json.dump(jobs, fh)
  proc = subprocess.run([triton_python, PTX_COMPILE, jobs_path, results_path],
                        capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(f"ptx_compile.py failed: {proc.stderr[-2000:]}")
  with open(results_path) as fh:
    return json.load(fh)


def judge(row: dict) -> dict:
  """Adds occupancy and the verdict: ok only without errors, spills or too much shared memory."""
  problems = [row["error"]] if row.get("error") else []
  if row.get("ok"):
    spilled = (row.get("spill_stores") or 0) + (row.get("spill_loads") or 0)
    if spilled:
      problems.append(f"spills {row['spill_stores']}/{row['spill_loads']} B (stores/loads)")
    limit = ptx_compile.ARCH_LIMITS[row["arch"]]["smem_per_block"]
    if (row.get("shared") or 0) > limit:
      problems.append(f"shared memory {row['shared']} B > sm_{row['arch']} limit {limit} B")
    row.update(ptx_compile.occupancy(row["regs"], row["num_warps"], row.get("shared") or 0,
                                     row["arch"]))
  row["problems"] = problems
  row["pass"] = not problems
  return row


def summary_table(rows: list[dict]) -> str:
  """Markdown: per (dtype, precision, head_dim) and arch, the range over pages, modes, groups,
  features of registers, spills, shared memory and programs per SM."""
  groups = {}
  for r in rows:
    groups.setdefault((r["dtype"], r["precision"], r["head_dim"], r.get("kv") or "auto"),
                      []).append(r)
  archs = sorted({r["arch"] for r in rows})
  head = ["dtype / precision", "head_dim", "configs (kernels)", "warps"]
  for a in archs:
    head += [f"sm_{a} regs", f"sm_{a} spills (B)", f"sm_{a} smem (KiB)", f"sm_{a} programs/SM"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  def rng(xs, f="{}"):
    if not xs:
      return "n/a"
    lo, hi = f.format(min(xs)), f.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"
  for (dtype, prec, d, kv), rs in sorted(groups.items(),
                                         key=lambda g: (g[0][3] != "auto",) + g[0]):
    name = "bf16" if dtype == "bfloat16" else f"f32 / {prec}"
    name += "" if kv == "auto" else f", {kv} pages"
    cfgs = {r["label"] for r in rs}
    keys = {r["key"] for r in rs}
    cells = [name, str(d), f"{len(cfgs)} ({len(keys)})",
             rng(sorted({r["num_warps"] for r in rs}))]
    for a in archs:
      ra = [r for r in rs if r["arch"] == a]
      ok = [r for r in ra if r.get("ok", r.get("regs") is not None)]
      failed = len(ra) - len(ok)
      spills = [(r.get("spill_stores") or 0) + (r.get("spill_loads") or 0) for r in ok]
      cells += [rng([r["regs"] for r in ok]),
                (rng(spills) if spills else "n/a") + (f" ({failed} failed)" if failed else ""),
                rng([(r.get("shared") or 0) / 1024 for r in ok], "{:.0f}"),
                rng([r["programs"] for r in ok])]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_table(table: str, command: str, stamp: str, path: str = WORKSPACE) -> None:
  with open(path) as fh:
    text = fh.read()
  if TABLE_BEGIN not in text or TABLE_END not in text:
    raise ValueError(f"{path} has no {TABLE_BEGIN} ... {TABLE_END} block")
  before, rest = text.split(TABLE_BEGIN, 1)
  _, after = rest.split(TABLE_END, 1)
  block = f"{TABLE_BEGIN}\nGenerated by `{command}` ({stamp}).\n\n{table}\n{TABLE_END}"
  with open(path, "w") as fh:
    fh.write(before + block + after)


def precision_errors(seed: int = 0) -> list[dict]:
  """Max abs error of the kernel (interpret mode, TF32 rounding emulated) against exact f32
  attention (the float64 oracle), per precision, on unit-normal inputs."""
  from paged_jax import testing
  rows = []
  for head_dim, cap in ((64, None), (128, None), (80, 30.0)):
    inp = testing.random_paged_inputs(seed, [1, 37, 200, 64], q_lens=[1, 5, 1, 16], page_size=16,
                                      num_kv_heads=2, q_per_kv=4, head_dim=head_dim, pad_tokens=1)
    oracle = testing.naive_paged_attention(*inp, soft_cap=cap)
    for prec in kernel_triton.PRECISIONS:
      out = kernel_triton.paged_attention(*inp, max_q_len=16, soft_cap=cap, precision=prec,
                                          interpret=True)
      err = np.abs(np.asarray(out, np.float64) - oracle)
      rows.append(dict(precision=prec, head_dim=head_dim, soft_cap=cap,
                       max_abs_err=float(err.max()), mean_abs_err=float(err.mean())))
  return rows


def main(argv):
  del argv
  if FLAGS.errors:
    rows = precision_errors()
    for r in rows:
      print(f"{r['precision']:8s} d{r['head_dim']:<4d} cap={r['soft_cap']}: max abs err "
            f"{r['max_abs_err']:.2e}, mean {r['mean_abs_err']:.2e}")
    output.record(dict(kind="precision_errors", jax=jax.__version__, rows=rows),
                  FLAGS.results_dir, "kernel_ptx")
    return 0
  if FLAGS.source == "xla":
    return main_xla()
  if FLAGS.table_from:
    rec = newest_matrix(FLAGS.table_from)
    if rec is None:
      raise ValueError(f"table_from={FLAGS.table_from!r} holds no whole-matrix record")
    write_table(summary_table(rec["rows"]), "python -m experiments.kernel_ptx --write_table",
                f"jax {rec['jax']}, triton {rec['triton']}, {rec.get('date', 'CI run')}")
    print(f"wrote the table of {len(rec['rows'])} rows from {FLAGS.table_from} to {WORKSPACE}")
    return 0
  why = ensure_triton(FLAGS.triton_python)
  if why:
    print(f"SKIPPED: cannot compile to PTX without pip triton=={TRITON_VERSION}: {why}")
    return 0
  cfgs = matrix(FLAGS.dtypes, FLAGS.precisions, FLAGS.head_dims, FLAGS.page_sizes, FLAGS.modes,
                FLAGS.groups, FLAGS.features)
  if not FLAGS.legacy_tiles:
    cfgs += quantized_matrix([f for f in FLAGS.kv_formats if f], FLAGS.kv_head_dims)
  t0 = time.time()
  cfg_kernels, rows = [], []
  for cfg, kernels, error in lower_all(cfgs, FLAGS.legacy_tiles, FLAGS.lower_workers):
    if error is None:
      cfg_kernels.append((cfg, kernels))
    else:   # a lowering error is a compile failure: report it, go on
      rows += [dict(dataclasses.asdict(cfg), label=cfg.label, arch=int(a), ok=False,
                    problems=[f"lowering: {error}"]) for a in FLAGS.archs]
  t_lower = time.time() - t0
  archs = [int(a) for a in FLAGS.archs]
  with tempfile.TemporaryDirectory() as tmp:
    workdir = FLAGS.keep or tmp
    os.makedirs(workdir, exist_ok=True)
    reuse = reusable(FLAGS.reuse) if FLAGS.reuse else {}
    if FLAGS.reuse and not reuse:
      print(f"--reuse={FLAGS.reuse}: no whole-matrix record compiled by triton {TRITON_VERSION}"
            f" there; compiling everything")
    rows += check(cfg_kernels, archs, FLAGS.triton_python, workdir, reuse, FLAGS.spot_check)
  n_reused = sum(bool(r.get("reused")) for r in rows)
  n_spot = sum(bool(r.get("spot_checked")) for r in rows)
  if FLAGS.reuse:
    print(f"reused the figures of {n_reused} of {len(rows)} (configuration, arch) rows from "
          f"{FLAGS.reuse} (same kernel key, arch and triton); compiled the rest, and spot-"
          f"checked {n_spot} reused rows by compiling them again")
  for r in rows:
    r.setdefault("pass", False)
  failed = [r for r in rows if not r["pass"]]
  for r in failed:
    print(f"FAIL {r['label']} sm_{r['arch']}: {'; '.join(r['problems'])}")
  table = summary_table(rows)
  print(table)
  distinct = len({r.get("key") for r in rows if r.get("key")})
  print(f"kernel PTX: {len(cfgs)} configurations ({distinct} distinct kernels) x "
        f"{len(archs)} archs; {len(rows) - len(failed)}/{len(rows)} pass (no error, no spill, "
        f"shared memory within the launch limit); lowering {t_lower:.0f} s, "
        f"total {time.time() - t0:.0f} s")
  main_matrix = bool(FLAGS.head_dims) and bool(FLAGS.dtypes)
  kind = ("matrix_legacy_tiles" if FLAGS.legacy_tiles else
          "matrix" if main_matrix else "quantized_matrix")
  output.record(dict(kind=kind,
                     date=time.strftime("%Y-%m-%d"), jax=jax.__version__, triton=TRITON_VERSION,
                     rows=[{k: r.get(k) for k in _KEEP} for r in rows]),
                FLAGS.results_dir, "kernel_ptx")
  if FLAGS.write_table and kind == "matrix":
    write_table(table, "python -m experiments.kernel_ptx --write_table",
                f"jax {jax.__version__}, triton {TRITON_VERSION}, {time.strftime('%Y-%m-%d')}")
  return 1 if failed else 0


_KEEP = ("reused", "ok", "label", "dtype", "precision", "head_dim", "page_size", "mode", "group",
         "features", "kv", "arch", "num_warps", "num_stages", "regs", "spill_stores", "spill_loads",
         "shared", "programs", "occupancy", "limit", "pass", "problems", "key")



def newest_matrix(path: str = _RESULTS_JSONL, kind: str = "matrix") -> dict | None:
  """The newest record of `kind` ("matrix": the whole matrix) of a kernel_ptx.jsonl; None when
  none."""
  newest = None
  if os.path.exists(path):
    with open(path) as fh:
      for line in fh:
        rec = json.loads(line)
        if rec.get("kind") == kind:
          newest = rec
  return newest


def unmeasured(cfgs: list[Config], path: str = _RESULTS_JSONL) -> list[str]:
  """What the newest matrix in `path` does not vouch for among `cfgs`: a configuration whose
  kernel, lowered today, is not the kernel that matrix compiled (another key: the kernel or its
  tiles changed since), or whose compile there did not pass. [] when the committed figures and
  WORKSPACE.md's table are today's kernel's; otherwise re-run `python -m experiments.kernel_ptx
  --write_table`. Lowering needs no GPU and no triton (~0.2 s a configuration)."""
  rec = newest_matrix(path)
  if rec is None:
    return [f"no whole-matrix record in {path}"]
  rows = {}
  for r in rec["rows"]:
    rows.setdefault(r["label"], []).append(r)
  problems = []
  for cfg in cfgs:
    measured = rows.get(cfg.label)
    if not measured:
      problems.append(f"{cfg.label}: not in the matrix")
      continue
    keys = {kernel_key(k) for k in lower(cfg)}
    for r in measured:
      if r.get("key") not in keys:
        problems.append(f"{cfg.label} sm_{r['arch']}: today's kernel {sorted(keys)} is not the "
                        f"one measured ({r.get('key')})")
      elif not r["pass"]:
        problems.append(f"{cfg.label} sm_{r['arch']}: measured, and failed: {r['problems']}")
  return problems


def estimate(dtype: str, precision: str, head_dim: int, page_size: int, mode: str, group: int,
             features: str = "plain", arch: int = 90,
             path: str = _RESULTS_JSONL) -> dict | None:
  """The CPU-side PTX figures (registers, spills, programs per SM) of the matrix configuration
  nearest to a call, from the newest whole-matrix run in `path`; None when there is none. The
  nearest: same dtype, precision, head_dim, mode, features and arch; the closest page size and
  group. attention_bench prints it beside a GPU timing."""
  rec = newest_matrix(path)
  rows = rec["rows"] if rec else None
  if dtype == "bfloat16":
    precision = "highest"
  near = [r for r in rows or () if (r["dtype"], r["precision"], r["head_dim"], r["mode"],
                                    r["features"], r["arch"]) ==
          (dtype, precision, head_dim, mode, features, arch)]
  if not near:
    return None
  return min(near, key=lambda r: (abs(np.log2(r["page_size"]) - np.log2(page_size)),
                                  abs(r["group"] - group)))


def main_xla() -> int:
  ptxas = find_ptxas()
  if ptxas is None:
    print("SKIPPED: no ptxas here (the nvidia-cuda-nvcc wheel or PATH): cannot read XLA's PTX")
    return 0
  cfgs = matrix(FLAGS.dtypes, FLAGS.precisions, FLAGS.head_dims, FLAGS.page_sizes, FLAGS.modes,
                FLAGS.groups, FLAGS.features)
  rows = xla_resources(cfgs, FLAGS.dump_dir, ptxas)
  for r in rows:
    figures = (f"regs {r.get('regs')}, spills {r.get('spill_stores')}/{r.get('spill_loads')} B, "
               f"warps {r.get('num_warps')}, programs/SM {r.get('programs')}" if r.get("ok")
               else "; ".join(r["problems"]))
    print(f"{'ok  ' if r['pass'] else 'FAIL'} {r['label']} sm_{r['arch']} (XLA's Triton): {figures}")
  print(f"kernel PTX from XLA on {jax.devices()[0].device_kind}: "
        f"{sum(r['pass'] for r in rows)}/{len(rows)} configurations without spills")
  output.record(dict(kind="xla_matrix", jax=jax.__version__, device=jax.devices()[0].device_kind,
                     rows=rows), FLAGS.results_dir, "kernel_ptx")
  return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
  define_flags()
  app.run(main)
