"""Paged attention on the CPU as a C++ kernel behind XLA's FFI (`attention` impl "cpu").

XLA:CPU runs `attention.decode_attention_xla`'s block work as hundreds of tiny batched dots a
layer (a group of 3 query heads against 32 keys of 64 dims each), at 4-5 GB/s of K/V where
the machine reads 25-45 GB/s, and the tiled prefill path (`attention.prefill_attention`) as
small batched dots with gathers, sorts and scatters around them. This kernel (`cpu_kernel.cc`,
beside this file) takes a whole step's ragged causal rows, decode rows and prefill chunks
alike: one work unit is (row, tile of up to 8 of its queries, kv head); it walks the row's
pages once, scores the tile's query vectors (tokens x the query heads of the kv head) against
each chunk of up to 16 keys, masks what each query may not see (causal, sliding window), and
merges the softmax online with the seeds' section 11 rule, in f32 (exp by glibc's vector
libmvec), over XLA's intra-op thread pool.

The source is compiled on first use with the system C++ compiler (`$CXX`, else `c++`) against
the headers jaxlib ships (`jax.ffi.include_dir()`), `-O3 -march=native`, into
~/.cache/paged_jax/cpu_kernel (or `$PAGED_JAX_CPU_KERNEL_CACHE`), keyed by the source, jaxlib's
version, the compiler and this CPU's flags; later processes load the cached library (6.5 ms
here, the compiler's `--version` included). Where it cannot be built or run (no compiler, not
a CPU backend), `unavailable_reason()` says why, `attention`'s impl="cpu" raises a ValueError
quoting it, and impl="auto" takes the XLA path.

Exactness: the same f32 summary arithmetic as the XLA path in another summation order; the
tests compare it against the XLA paths and the dense reference
(tests/paged_jax/cpu_kernel_test.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention.reference import check_static_args

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernel.cc")
TARGET = "paged_jax_cpu_attention"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
         "-w")   # -w: jaxlib's FFI headers warn under g++ 12
# Query tokens x kv heads per thread before a second thread is asked to help: below this,
# scheduling a pool task costs more than it saves (one user is 3 on SmolLM2). A call that reads
# many keys gets a helper however few its units (cpu_kernel.cc's kMinKeyRowsPerThread: one
# user's long context).
MIN_UNITS_PER_THREAD = 8
MAX_GROUP = 16   # query heads per kv head at most (cpu_kernel.cc's kMaxGroup)
# glibc's vector math library, for the kernel's exp (cpu_kernel.cc's Exp16) on x86-64.
LINK = ("-lmvec",) if platform.machine().lower() in ("x86_64", "amd64") else ()
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def cache_dir() -> str:
  """Where built kernels are kept: $PAGED_JAX_CPU_KERNEL_CACHE, else ~/.cache/paged_jax/cpu_kernel."""
  return os.environ.get("PAGED_JAX_CPU_KERNEL_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "paged_jax", "cpu_kernel")


def compiler() -> str | None:
  """The C++ compiler's path ($CXX, else c++), None if it is not on PATH."""
  return shutil.which(os.environ.get("CXX", "c++"))


def _cpu_flags() -> str:
  """This CPU's feature flags (-march=native compiles for them), '' where /proc has none."""
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return platform.processor()


def library_path(compiler: str, source: str = SOURCE, extra: tuple[str, ...] = ()) -> str:
  """The cached library's path for this source, jaxlib, compiler, CPU and extra flags."""
  import jaxlib
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  with open(source, "rb") as f:
    key = hashlib.sha256(f.read())
  for part in (jaxlib.__version__, version, " ".join(FLAGS + tuple(extra)), _cpu_flags()):
    key.update(part.encode())
  name = os.path.splitext(os.path.basename(source))[0]
  return os.path.join(cache_dir(), f"{name}-{key.hexdigest()[:16]}.so")


def build(compiler: str, source: str = SOURCE, extra: tuple[str, ...] = ()) -> str:
  """Compiles `source` (default: the attention kernel) against jaxlib's FFI headers, with `extra`
  flags after it (include dirs, libraries), unless cached; returns the library's path. Raises
  RuntimeError with the compiler's message when it fails. `matmul.py` builds its MKL call here."""
  path = library_path(compiler, source, extra)
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
  os.close(fd)
  cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), source, "-o", tmp, *extra]
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    os.unlink(tmp)
    raise RuntimeError(f"building {os.path.basename(source)} failed ({' '.join(cmd)}):\n"
                       f"{done.stderr[-2000:]}")
  os.replace(tmp, path)   # atomic: a concurrent process sees the whole library or none
  return path


def load(source: str, symbol: str, target: str, extra: tuple[str, ...] = (),
         also: tuple[tuple[str, str], ...] = ()) -> str | None:
  """Builds `source` (`build`), loads its FFI handler `symbol` and registers it as the CPU custom
  call `target` (and each further (symbol, target) of `also`); None on success, else why not
  (no compiler, a failed build, no such symbol)."""
  compiler_path = compiler()
  if compiler_path is None:
    return f"no C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH; set $CXX)"
  try:
    lib = ctypes.CDLL(build(compiler_path, source, extra))
    handlers = [(getattr(lib, sym), tgt) for sym, tgt in ((symbol, target), *also)]
  except (RuntimeError, OSError, AttributeError) as e:
    return str(e)
  for handler, tgt in handlers:
    jax.ffi.register_ffi_target(tgt, jax.ffi.pycapsule(handler), platform="cpu")
  return None


@functools.cache
def _load() -> str | None:
  """Builds, loads and registers the kernel once per process; None on success, else why not."""
  return load(SOURCE, "PagedJaxAttention", TARGET, LINK)


def unavailable_reason(device: jax.Device | None = None) -> str | None:
  """Why the CPU kernel cannot run here (None if it can): it needs the CPU backend and a C++
  compiler; the first call builds and registers it."""
  device = device or jax.devices()[0]
  if device.platform != "cpu":
    return f"the CPU kernel runs on the CPU backend; this device is {device.platform}"
  return _load()


def unsupported(q, k_pages) -> str | None:
  """Why the kernel does not take these q / pages (None if it does): f32 or bf16 of one dtype,
  at most MAX_GROUP query heads per kv head."""
  dtype = jnp.dtype(q.dtype)
  if dtype not in _DTYPES or k_pages.dtype != dtype:
    return (f"the CPU attention kernel takes f32 or bf16 q and pages of one dtype; got q {q.dtype}, "
            f"k_pages {k_pages.dtype}")
  num_q_heads, num_kv_heads = q.shape[1], k_pages.shape[2]
  if num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads > MAX_GROUP:
    return (f"num_q_heads={num_q_heads} over num_kv_heads={num_kv_heads}: at most {MAX_GROUP} "
            f"query heads per kv head")
  return None


def paged_attention(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens, *,
                    scale: float | None = None, sliding_window: int | None = None,
                    soft_cap: float | None = None, return_lse: bool = False,
                    min_units_per_thread: int = MIN_UNITS_PER_THREAD):
  """`attention.paged_attention_xla`'s contract (ragged causal rows), run by the C++ kernel.

  Row r's queries are tokens cu_q_lens[r] .. cu_q_lens[r + 1] - 1, at positions
  seq_lens[r] - q_len[r], ..., seq_lens[r] - 1; each attends to keys 0..its position of the row
  (within the sliding window), read through the block table. Decode rows (q_len 1) and prefill
  chunks (after a cached prefix or not) mix freely; no bound on q_len is needed. This step's
  K/V must already be in the pages.

  Args:
    q: dtype[num_tokens, num_q_heads, head_dim], ragged by cu_q_lens; dtype f32 or bf16, the
      pages' dtype.
    k_pages, v_pages: dtype[num_pages, page_size, num_kv_heads, head_dim] (one layer).
    block_tables: i32[num_seqs, max_pages_per_seq]; seq_lens: i32[num_seqs];
      cu_q_lens: i32[num_seqs + 1].
    min_units_per_thread: query tokens x kv heads per thread before another thread helps (a
      call reading many keys gets a helper anyway: MIN_UNITS_PER_THREAD; 0: one thread).

  Returns:
    dtype[num_tokens, num_q_heads, head_dim] (and f32[num_tokens, num_q_heads] lse if asked);
    zeros (lse -inf) for tokens of no row and queries with no visible key.
  """
  reason = unavailable_reason()
  if reason is not None:
    raise ValueError(f"the CPU attention kernel cannot run here: {reason}")
  why = unsupported(q, k_pages)
  if why:
    raise ValueError(why)
  dtype = jnp.dtype(q.dtype)
  check_static_args(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                    sliding_window=sliding_window, soft_cap=soft_cap)   # what every path checks
  if k_pages.ndim != 4 or block_tables.ndim != 2:
    raise ValueError(f"k_pages must be [num_pages, page_size, num_kv_heads, head_dim] and "
                     f"block_tables 2-d; got {k_pages.shape} and {block_tables.shape}")
  head_dim = q.shape[-1]
  if q.shape[0] == 0:
    o, lse = jnp.zeros(q.shape, dtype), jnp.zeros(q.shape[:2], jnp.float32)
    return (o, lse) if return_lse else o
  call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q.shape, dtype),
                                   jax.ShapeDtypeStruct(q.shape[:2], jnp.float32)))
  o, lse = call(q, k_pages, v_pages, block_tables, seq_lens, cu_q_lens,
                scale=np.float32(head_dim ** -0.5 if scale is None else scale),
                sliding_window=np.int64(sliding_window or 0),
                soft_cap=np.float32(soft_cap or 0.0),
                min_units_per_thread=np.int64(min_units_per_thread))
  return (o, lse) if return_lse else o
