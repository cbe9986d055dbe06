"""The model's matrix multiplications: one function every projection, MLP and LM head calls.

`dot_general` is `jax.lax.dot_general` with two CPU-measured rules for 2-byte floats (bf16 /
f16), neither of which changes f32 programs:

- **Accumulate and emit f32, then cast back** (`preferred_element_type=f32`). XLA:CPU lowers a
  bf16 x bf16 -> f32 dot to its library kernel (YNNPACK: `__ynn_fusion` in the compiled program)
  that reads bf16 as it is, but a bf16 x bf16 ->
  bf16 dot to converts of both operands (the whole weight, every call) and an f32 dot.
  `python -m experiments.matmul_floor` on SmolLM2-135M's shapes, jax 0.10.2, 2 threads:
  [4560x576]x[576x1536] 251 -> 434 GFLOP/s (f32: 336), [32x576]x[576x49152] 35 -> 278 GFLOP/s
  (f32: 176); jax 0.11 / 0.12 got faster plain bf16 dots, and this route matches them there.
  The result equals a bf16 dot that accumulates in f32 and rounds once, as torch's does.
- **Never a single row**: a bf16 [1, k] x [k, n] dot takes the slow path even with f32 output
  (SmolLM2's LM head at batch 1: 47 ms; padded to 2 rows 4.5 ms), so a one-row lhs is padded to two
  rows and the pad row dropped. Rows are independent, so the kept row is unchanged.

**Intel MKL on a CPU, optional** (`ModelConfig.matmul="mkl"`; `serve --matmul=mkl`). XLA:CPU's
f32 dot is slow at the few rows of a decode step, and its bf16 dot at one row (see the numbers
in `mkl_dot_general`). `cpu_matmul.cc` (beside this file) calls MKL's `cblas_sgemm` /
`cblas_gemm_bf16bf16f32` (sequential, the columns split over XLA's intra-op threads) as an FFI
custom call. It needs the `mkl` and `mkl-include` wheels (`pip install -e .[mkl]`); it is built
on first use like `cpu_kernel` (same compiler, same cache), and `mkl_unavailable_reason()` says
why it cannot run. `jax.lax.dot_general` stays the default and the reference in tests.

**oneDNN on a CPU, optional** (`ModelConfig.matmul="onednn"`; `serve --matmul=onednn`; the
`onednn` extra: Intel's CPU-only GNU OpenMP build, 39 MB). The library vLLM's CPU build multiplies
with; its kernels are chosen by instruction set, not by maker (AVX-512 brgemm on an AMD EPYC,
where MKL runs its generic code). Two routes, both in `cpu_matmul_onednn.cc`:

- **Packed weights** (what an engine with matmul="onednn" runs): `model.pack_for_onednn` puts
  every projection's kernel, and a packed copy of a tied LM head's embedding, into the layout
  oneDNN's brgemm kernel asks for (`onednn_pack`, once, on the host); `model.Dense` multiplies
  them through `onednn_packed_dot` at every row count, split between XLA's pool threads by rows
  (2 x MIN_ROWS_PER_THREAD rows and more) or by column blocks. Faster than XLA's dot from 4 rows
  in f32 and from one row in bf16, level with it at one row in f32 (results page). A scanned
  model's packed kernels stay stacked ([reps, bytes]) and each product is given the layer
  index, so the scan's body reads the stack in place instead of copying a slice per call.
  Each product is also given the step's real token count (`padding_rows`, opened by
  `model.apply`): the token rows a bucket pads with are not multiplied (a 48-token prompt
  beside 8 decode rows pads 56 token rows to 64: that step 94 -> 83 ms on SmolLM2, results
  page).
- **Plain weights** (`onednn_dot_general`: weights the packing left, and models applied without
  an engine): one matmul primitive per shape and column block on strided views of the weights,
  for products of ONEDNN_MIN_ROWS rows or more by a [k, n] kernel, where it was measured
  faster; fewer rows and the tied head's transposed product stay on XLA's dot
  (ONEDNN_TAKES_TRANSPOSED).

Each block runs on a pool thread with one OpenMP thread (oneDNN's own two-thread OpenMP team was
measured slower at 8-32 rows) and that thread's own scratchpad.

MKL's speed depends on the CPU's maker: it dispatches its tuned kernels on Intel CPUs only. On
an AMD EPYC (Zen 4, AVX-512) it loads its generic kernels (`libmkl_def`): the engine ran 0.93x
as fast in f32 as on XLA's dots, and the one-row bf16 LM head took 20x XLA's time
(`experiments/matmul_floor.py`, `serve_bench`; the results page). So off Intel bf16 stays on
XLA, and `mkl_slow_reason()` names the maker for the engine's warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np

_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """`jax.lax.dot_general` (flax's `dot_general` signature); result in the operands' dtype.

  For bf16 / f16 operands the product is accumulated and emitted in f32 and cast back once; a
  2-d lhs with a single row is padded to two rows first (see the module docstring).
  """
  dt = jnp.result_type(lhs, rhs)
  if preferred_element_type is not None or dt not in _NARROW:
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type)
  (lhs_contract, _), (lhs_batch, _) = dimension_numbers
  one_row = lhs.ndim == 2 and lhs.shape[0] == 1 and not lhs_batch and tuple(lhs_contract) == (1,)
  if one_row:
    lhs = jnp.concatenate([lhs, lhs], axis=0)
  out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=jnp.float32).astype(dt)
  return out[:1] if one_row else out


BACKENDS = ("xla", "mkl", "onednn")
MKL_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_matmul.cc")
MKL_TARGET = "paged_jax_cpu_matmul"
ONEDNN_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_matmul_onednn.cc")
ONEDNN_TARGET = "paged_jax_onednn_matmul"
ONEDNN_PACKED_TARGET = "paged_jax_onednn_packed_matmul"
# Columns of w per thread before a second thread takes half: an MLP projection of SmolLM2 (576
# or 1,536 columns) is split, a tiny test matrix is not.
MIN_COLUMNS_PER_THREAD = 256
# oneDNN takes products of at least this many rows; fewer stay on XLA's dot. SmolLM2's MLP as 30
# unrolled layers (weights from memory, 2 threads, jax 0.12.1, ms; XLA -> oneDNN): f32 1 row
# 13.9 -> 14.7, 16 rows 25.9 -> 23.2, 32 rows 41.2 -> 33.1, 64 rows 71.3 -> 53.3, 1,024 rows
# 849 -> 778; bf16 16 rows 18.0 -> 17.4, 32 rows 27.6 -> 24.8, 1,024 rows 485 -> 466. A whole
# one-row f32 decode step took 25.8 -> 34.6 ms (experiments/decode_round_bench.py): the small
# q / k / v / o products and the transposed tied head lose most there.
ONEDNN_MIN_ROWS = 16
# Whether oneDNN takes a transposed rhs ([n, k]: the tied LM head). It does not: read as
# oneDNN's plain "ba" layout it lost to XLA's dot at every row count in f32 (SmolLM2's head,
# [rows x 576] x [576 x 49152] from memory, jax 0.10.2, XLA -> oneDNN ms: 16 rows 13.3 -> 19.5,
# 32 rows 16.4 -> 24.4, 64 rows 25.8 -> 32.5) and at 16 rows in bf16 (6.1 -> 10.6; 32 rows
# 8.8 -> 8.5, 64 rows 15.0 -> 12.6). The call itself takes it (tests set this to True).
ONEDNN_TAKES_TRANSPOSED = False
_MKL_LIBS = ("libmkl_intel_lp64.so", "libmkl_sequential.so", "libmkl_core.so")


def _wheel_flags(what: str, lib_pkg: str, inc_pkg: str, header: str, include_depth: int,
                 libs: tuple[str, ...], extra: tuple[str, ...] = ()) -> tuple[str, ...] | str:
  """Compiler flags that find `header` in the installed `inc_pkg` wheel (its include directory
  `include_depth` levels above the header) and link `libs` from the `lib_pkg` wheel, with an
  rpath; a string saying what is missing otherwise (`what`: the library's name, which is also
  the extra that installs it)."""
  from importlib import metadata
  name = {"mkl": "Intel MKL", "onednn": "oneDNN"}[what]
  try:
    lib_files, inc_files = metadata.files(lib_pkg) or [], metadata.files(inc_pkg) or []
  except metadata.PackageNotFoundError as e:
    return f"{name} is not installed ({e.name!r}: pip install -e .[{what}])"
  found = next((f for f in inc_files if str(f).replace(os.sep, "/").endswith(header)), None)
  libs_found = {want: next((f for f in lib_files if f.name.startswith(want + ".")), None)
                for want in libs}
  missing = [name for name, f in libs_found.items() if f is None] + ([] if found else [header])
  if missing:
    return f"the installed {name} wheels ({lib_pkg}, {inc_pkg}) lack {missing}"
  include = str(found.locate())
  for _ in range(include_depth):
    include = os.path.dirname(include)
  lib_dir = os.path.dirname(str(libs_found[libs[-1]].locate()))
  return ("-I", include, "-L", lib_dir, *(f"-l:{f.name}" for f in libs_found.values()),
          f"-Wl,-rpath,{lib_dir}", *extra)


def mkl_build_flags() -> tuple[str, ...] | str:
  """The compiler flags that find MKL's header and link its sequential libraries, from the
  installed `mkl` / `mkl-include` wheels; a string saying what is missing otherwise."""
  return _wheel_flags("mkl", "mkl", "mkl-include", "mkl_cblas.h", 1, _MKL_LIBS)


def onednn_build_flags() -> tuple[str, ...] | str:
  """The compiler flags that find oneDNN's C++ header and link its library (and GNU OpenMP, its
  threading runtime), from the installed `onednn-cpu-gomp` / `onednn-devel-cpu-gomp` wheels; a
  string saying what is missing otherwise."""
  return _wheel_flags("onednn", "onednn-cpu-gomp", "onednn-devel-cpu-gomp",
                      "oneapi/dnnl/dnnl.hpp", 3, ("libdnnl.so",), ("-lgomp",))


_LIBRARIES = {   # backend: (source, FFI symbol, target, build flags, further (symbol, target))
    "mkl": (MKL_SOURCE, "PagedJaxCpuMatmul", MKL_TARGET, mkl_build_flags, ()),
    "onednn": (ONEDNN_SOURCE, "PagedJaxOnednnMatmul", ONEDNN_TARGET, onednn_build_flags,
               (("PagedJaxOnednnPackedMatmul", ONEDNN_PACKED_TARGET),)),
}


@functools.cache
def _load(backend: str) -> str | None:
  """Builds, loads and registers a library backend's call once per process; None on success,
  else why not."""
  from paged_jax import cpu_kernel
  source, symbol, target, build_flags, also = _LIBRARIES[backend]
  flags = build_flags()
  if isinstance(flags, str):
    return flags
  return cpu_kernel.load(source, symbol, target, flags, also)


def unavailable_reason(backend: str, device: jax.Device | None = None) -> str | None:
  """Why a library backend ("mkl", "onednn") cannot run here (None if it can): it needs the CPU
  backend, its wheels and a C++ compiler; the first call builds and registers it."""
  device = device or jax.devices()[0]
  if device.platform != "cpu":
    return f"the {backend} matmul runs on the CPU backend; this device is {device.platform}"
  return _load(backend)


def mkl_unavailable_reason(device: jax.Device | None = None) -> str | None:
  """`unavailable_reason("mkl", device)`."""
  return unavailable_reason("mkl", device)


def cpu_info(field: str) -> str:
  """A field of the first CPU in /proc/cpuinfo ("vendor_id", "model name", ...), or "" where
  there is none (not Linux, or not x86)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith(field):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def cpu_vendor() -> str:
  """The CPU's maker as the kernel reports it (`GenuineIntel`, `AuthenticAMD`, ...), or ""."""
  return cpu_info("vendor_id")


def mkl_slow_reason(vendor: str | None = None) -> str | None:
  """Why MKL is likely slower than XLA here (None on an Intel CPU): MKL runs its tuned kernels
  on Intel CPUs only and its generic ones elsewhere."""
  vendor = cpu_vendor() if vendor is None else vendor
  if vendor == "GenuineIntel":
    return None
  return (f"this CPU is {vendor or 'of an unknown maker'!r}, not GenuineIntel: MKL runs its "
          "generic kernels here (0.93x XLA's dots end to end in f32 on an AMD EPYC)")


def mkl_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """`dot_general` through Intel MKL where it applies, else `dot_general` itself.

  It applies to f32 operands, and to bf16 ones with a single lhs row on an Intel CPU: one
  dtype, no batch dimensions, the lhs contracting its last axis and the rhs its first ([k, n], a
  projection's kernel) or its second ([n, k], the tied LM head), no preferred_element_type. The
  product is accumulated in f32 (bf16: cast back once, as `dot_general` does). Why those:
  scratch timings on an Intel Xeon with AMX, 2 cores (20 SmolLM2 matrices in one program, ms
  per product, XLA -> MKL): f32 [4 x 576] x [576 x 1536] 0.28 -> 0.17, [32 x 1536] x
  [1536 x 576] 0.47 -> 0.34, [32 x 576] x [576 x 49152] 18.3 -> 15.1 (jax 0.10.2); bf16
  [1 x 576] x [576 x 49152] 5.9 -> 1.9, but at 2-32 rows MKL's bf16 product was no faster than
  XLA's (YNNPACK) and up to 1.4x slower, so bf16 with more rows stays on XLA. On an AMD EPYC
  MKL's generic kernels took that one-row bf16 head 20x XLA's time (74 against 3.6 ms,
  `experiments/matmul_floor.py`), so off Intel (`mkl_slow_reason`) bf16 stays on XLA too.
  `precision` is not passed on: XLA:CPU's f32 dot ignores it too (full f32 products). Raises a
  ValueError naming the reason where MKL cannot run.
  """
  rows = _library_rows(lhs, rhs, dimension_numbers, preferred_element_type)
  if rows is None or (jnp.result_type(lhs, rhs) == jnp.dtype(jnp.bfloat16)   # see the docstring
                      and (rows != 1 or mkl_slow_reason() is not None)):
    return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
  return _through_library(mkl_matmul, lhs, rhs, dimension_numbers)


def _library_rows(lhs, rhs, dimension_numbers, preferred_element_type) -> int | None:
  """The lhs rows of a product a library call takes, or None where it does not apply: one
  dtype (f32 or bf16), no batch dimensions, the lhs contracting its last axis and the rhs its
  first ([k, n], a projection's kernel) or its second ([n, k], the tied LM head), no
  preferred_element_type."""
  dt = jnp.result_type(lhs, rhs)
  (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
  applies = (dt in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)) and lhs.dtype == rhs.dtype
             and preferred_element_type is None and not lhs_b and not rhs_b and rhs.ndim == 2
             and lhs.ndim >= 1 and tuple(lhs_c) == (lhs.ndim - 1,)
             and tuple(rhs_c) in ((0,), (1,)))
  return int(np.prod(lhs.shape[:-1])) if applies else None


def _through_library(call, lhs, rhs, dimension_numbers):
  """lhs [..., k] times rhs by `call(x [rows, k], w, transpose)` (f32 out), cast to the dtype."""
  transpose = tuple(dimension_numbers[0][1]) == (1,)
  out = call(lhs.reshape(int(np.prod(lhs.shape[:-1])), lhs.shape[-1]), rhs, transpose)
  return out.astype(jnp.result_type(lhs, rhs)).reshape(*lhs.shape[:-1], out.shape[-1])


def _library_call(backend: str, name: str, x, w, transpose: bool):
  """f32[m, n] = x @ w (or x @ w.T) through a library backend's FFI call; a ValueError naming
  the reason where it cannot run."""
  reason = unavailable_reason(backend)
  if reason is not None:
    raise ValueError(f"the {name} matmul cannot run here: {reason}")
  n = w.shape[0] if transpose else w.shape[1]
  target = _LIBRARIES[backend][2]
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
      x, w, transpose_rhs=transpose, min_columns_per_thread=np.int64(MIN_COLUMNS_PER_THREAD))


def mkl_matmul(x, w, transpose: bool = False):
  """The MKL call itself, at any row count (no routing): f32[m, n] = x @ w.

  x: f32 or bf16 [m, k]; w: the same dtype, [k, n] (or [n, k] with `transpose`). Raises a
  ValueError naming the reason where MKL cannot run.
  """
  return _library_call("mkl", "MKL", x, w, transpose)


def onednn_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
  """`dot_general` through oneDNN where it applies, else `dot_general` itself.

  It applies to f32 and bf16 operands with at least ONEDNN_MIN_ROWS lhs rows, under
  `_library_rows`' conditions, to a projection's kernel ([k, n]); the tied LM head ([n, k]) only
  with ONEDNN_TAKES_TRANSPOSED (off: measured slower). Accumulated in f32
  (bf16: cast back once, as `dot_general` does). `precision` is not passed on (XLA:CPU's f32 dot
  ignores it too). Raises a ValueError naming the reason where oneDNN cannot run.
  """
  rows = _library_rows(lhs, rhs, dimension_numbers, preferred_element_type)
  transposed = tuple(dimension_numbers[0][1]) == (1,)
  if rows is None or rows < ONEDNN_MIN_ROWS or (transposed and not ONEDNN_TAKES_TRANSPOSED):
    return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
  return _through_library(onednn_matmul, lhs, rhs, dimension_numbers)


def onednn_matmul(x, w, transpose: bool = False):
  """The oneDNN call itself (no routing): f32[m, n] = x @ w.

  x: f32 or bf16 [m, k]; w: the same dtype, [k, n] (or [n, k] with `transpose`). Raises a
  ValueError naming the reason where oneDNN cannot run.
  """
  return _library_call("onednn", "oneDNN", x, w, transpose)


# A packed product of at least twice this many rows is split between threads by rows (each
# reads all of w); fewer rows, by column blocks (each reads its share of w). SmolLM2's 30 layers
# of projections and its tied head as one chain (f32, jax 0.10.2, ms; split by columns -> by
# rows): 16 rows 35.3 -> 38.6-42.1, 32 rows 59.6 -> 54.8-56.1, 64 rows 102.9 -> 97.8-99.1.
MIN_ROWS_PER_THREAD = 16


@functools.cache
def _onednn_library() -> ctypes.CDLL:
  """The built oneDNN call's host-side functions (packing); a ValueError where it cannot run."""
  reason = unavailable_reason("onednn")
  if reason is not None:
    raise ValueError(f"the oneDNN matmul cannot run here: {reason}")
  from paged_jax import cpu_kernel
  lib = ctypes.CDLL(cpu_kernel.build(cpu_kernel.compiler(), ONEDNN_SOURCE, onednn_build_flags()))
  i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
  lib.PagedJaxOnednnPackedBytes.restype = i64
  lib.PagedJaxOnednnPackedBytes.argtypes = [i32, i64, i64, ctypes.POINTER(i64)]
  lib.PagedJaxOnednnPack.argtypes = [i32, i64, i64, i32, ptr, ptr]
  lib.PagedJaxOnednnPackedImpl.argtypes = [i32, i64, i64, i64, ctypes.c_char_p, i64]
  return lib


def _packable_dtype(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@functools.cache
def _packed_layout(dtype, k: int, n: int) -> tuple[int, int] | None:
  """(bytes, columns per block) of a [k, n] weight in oneDNN's layout, as `onednn_packed_bytes`."""
  if not _packable_dtype(dtype):
    return None
  block = ctypes.c_int64(0)
  got = _onednn_library().PagedJaxOnednnPackedBytes(
      int(jnp.dtype(dtype) == jnp.bfloat16), k, n, ctypes.byref(block))
  if got == -2:
    raise ValueError(f"oneDNN failed to choose a layout for a {jnp.dtype(dtype).name} [{k}, {n}] "
                     "weight")
  return None if got < 0 else (int(got), int(block.value))


def onednn_packed_bytes(dtype, k: int, n: int) -> int | None:
  """Bytes of a [k, n] weight in the layout oneDNN's matmul asks for, or None where that layout
  is not one `onednn_packed_matmul` takes (not blocked by columns) or the dtype is not f32 /
  bf16. A ValueError where oneDNN cannot run."""
  layout = _packed_layout(jnp.dtype(dtype), k, n)
  return None if layout is None else layout[0]


def packed_column_blocks(dtype, k: int, n: int) -> tuple[int, int, int] | None:
  """f32 weights only: (blocks, padded k, columns per block) such that the packed [k, n] is
  [blocks, padded k, columns] row-major (oneDNN's `BA16a<cols>b`: each block of columns holds
  all of k, padded to 16, rows of `cols` contiguous), or None (bf16 pairs rows: `...b2a`)."""
  layout = _packed_layout(jnp.dtype(dtype), k, n)
  if jnp.dtype(dtype) != jnp.float32 or layout is None:
    return None
  nbytes, cols = layout
  blocks = -(-n // cols)
  kp = nbytes // (4 * blocks * cols)
  return (blocks, kp, cols) if kp * blocks * cols * 4 == nbytes and kp >= k else None


def onednn_pack(w, transpose: bool = False) -> jax.Array:
  """w's copy in oneDNN's packed layout, for `onednn_packed_matmul`: computed on the host once.

  w: f32 or bf16 [k, n] (a projection's kernel), or [n, k] with `transpose` (a tied LM head's
  embedding). Returns a 1-d array of w's dtype holding `onednn_packed_bytes` bytes (zero padding
  where n is not a whole number of oneDNN's column blocks). Raises a ValueError naming the
  reason where it cannot (oneDNN missing, another dtype, a layout it does not take)."""
  arr = np.ascontiguousarray(np.asarray(w))
  if arr.ndim != 2 or not _packable_dtype(arr.dtype):
    raise ValueError(f"onednn_pack takes a 2-d f32 or bf16 weight; got {arr.dtype} {arr.shape}")
  k, n = (arr.shape[1], arr.shape[0]) if transpose else arr.shape
  nbytes = onednn_packed_bytes(arr.dtype, k, n)
  if nbytes is None:
    raise ValueError(f"oneDNN asks for a {arr.dtype} [{k}, {n}] weight in a layout the packed "
                     "product does not take (not blocked by columns)")
  out = np.empty(nbytes // arr.itemsize, arr.dtype)
  rc = _onednn_library().PagedJaxOnednnPack(int(arr.dtype == jnp.bfloat16), k, n,
                                            int(transpose), arr.ctypes.data, out.ctypes.data)
  if rc:
    raise ValueError(f"oneDNN failed to pack a {arr.dtype} [{k}, {n}] weight (code {rc})")
  return jnp.asarray(out)


def onednn_packed_impl(dtype, m: int, k: int, cols: int) -> str:
  """oneDNN's name for the kernel a packed product of m rows and `cols` columns runs (e.g.
  "brg:avx512_core"; "ref" would be its slow reference code)."""
  buf = ctypes.create_string_buffer(128)
  rc = _onednn_library().PagedJaxOnednnPackedImpl(int(jnp.dtype(dtype) == jnp.bfloat16), m, k,
                                                  cols, buf, len(buf))
  if rc:
    raise ValueError(f"no packed oneDNN product for {jnp.dtype(dtype).name} [{m}, {k}] x "
                     f"[{k}, {cols}] (code {rc})")
  return buf.value.decode()


def onednn_packed_matmul(x, packed, n: int, layer=None, valid_rows=None):
  """f32[m, n] = x @ w, w given as `onednn_pack(w)` (`packed`, 1-d, x's dtype), at any row count.

  `valid_rows` (an int or a traced i32 scalar; None: all m): x's rows from it on are padding.
  Their rows of the result are zero and are not multiplied (the rows multiplied are rounded up
  to a multiple of 8-32 past 16, so that oneDNN builds a kernel for few row counts: see
  `ComputedRows` in `cpu_matmul_onednn.cc`); the rows before it are the same as without it.

  Or `packed` is a stack of packed weights, one per layer ([layers, elements], as
  `model.pack_for_onednn` stacks a scanned model's kernels) and `layer` (an int or a traced i32
  scalar: a `lax.scan`'s layer index) picks the one to multiply by, read in place: a scan body
  that sliced the stack would have XLA copy the slice before every call (SmolLM2's f32 weights,
  ~425 MB a step).

  Split between XLA's pool threads by rows from 2 x MIN_ROWS_PER_THREAD rows, else by column
  blocks. Raises a ValueError naming the reason where oneDNN cannot run or `packed` is not a
  packed [k, n] of x's dtype; a layer outside the stack is refused when the product runs."""
  reason = unavailable_reason("onednn")
  if reason is not None:
    raise ValueError(f"the oneDNN matmul cannot run here: {reason}")
  if x.ndim != 2 or packed.ndim not in (1, 2) or packed.dtype != x.dtype:
    raise ValueError(f"onednn_packed_matmul takes x [m, k] and a packed 1-d weight (or a "
                     f"[layers, elements] stack) of its dtype; got {x.dtype}{list(x.shape)} and "
                     f"{packed.dtype}{list(packed.shape)}")
  if (packed.ndim == 2) != (layer is not None):
    raise ValueError(f"onednn_packed_matmul: a stack of packed weights takes a layer and a single "
                     f"one does not; got packed {list(packed.shape)} and layer={layer!r}")
  if isinstance(layer, (int, np.integer)) and not 0 <= layer < packed.shape[0]:
    raise ValueError(f"onednn_packed_matmul: layer={layer} is not in [0, {packed.shape[0]})")
  want = onednn_packed_bytes(x.dtype, x.shape[1], n)
  got = packed.shape[-1] * packed.dtype.itemsize
  if want is None or got != want:
    raise ValueError(f"packed has {got} bytes a layer; oneDNN's packed {x.dtype} "
                     f"[{x.shape[1]}, {n}] has {want}")
  if isinstance(valid_rows, (int, np.integer)) and valid_rows < 0:
    raise ValueError(f"onednn_packed_matmul: valid_rows={valid_rows} is negative")
  index = jnp.asarray(0 if layer is None else layer, jnp.int32)
  valid = jnp.asarray(-1 if valid_rows is None else valid_rows, jnp.int32)
  return jax.ffi.ffi_call(ONEDNN_PACKED_TARGET,
                          jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))(
      x, packed, index, valid, n=np.int64(n),
      min_columns_per_thread=np.int64(MIN_COLUMNS_PER_THREAD),
      min_rows_per_thread=np.int64(MIN_ROWS_PER_THREAD))


# One row of f32 times a packed weight (not a stack) runs as XLA's batched dot over the packed
# column blocks: SmolLM2's one-row layer products read at 26-33 GB/s that way against 20-24
# through oneDNN's call (scratch, weights from memory; results page, "one f32 row on XLA's batched
# dot"). Its tied head (n = 49,152) read slower that way (21 against 24 GB/s) and stays on
# oneDNN, as do stacks (a scan's layer: XLA would copy the slice) and bf16 (XLA's bf16 dots are
# slow on a CPU).
PACKED_ROW_ON_XLA = True
PACKED_ROW_ON_XLA_MAX_COLUMNS = 16384


def packed_row_on_xla(x, packed, n: int):
  """f32[1, n] = x @ w for x f32[1, k] and w = `onednn_pack(w)` (f32), through XLA's batched
  dot over the packed column blocks ([blocks, padded k, cols]); k is zero-padded to the
  layout's."""
  blocks, kp, cols = packed_column_blocks(x.dtype, x.shape[1], n)
  if kp != x.shape[1]:
    x = jnp.pad(x, ((0, 0), (0, kp - x.shape[1])))
  out = jax.lax.dot_general(jnp.broadcast_to(x, (blocks, 1, kp)),
                            packed.reshape(blocks, kp, cols), (((2,), (1,)), ((0,), (0,))),
                            preferred_element_type=jnp.float32)
  return out.reshape(1, blocks * cols)[:, :n]


# The step's real tokens, while a step is traced (`padding_rows`): (token rows, i32 count).
_PADDING = threading.local()


@contextlib.contextmanager
def _padding(value):
  """`_PADDING.value` = value inside, restored after."""
  saved = getattr(_PADDING, "value", None)
  _PADDING.value = value
  try:
    yield
  finally:
    _PADDING.value = saved


def padding_rows(rows: int, valid):
  """While tracing inside it, a packed product (`onednn_packed_dot`) of x with `rows` rows
  multiplies only the first `valid` (an i32 scalar, traced) and gives zeros for the rest: a
  step's token axis is padded to its bucket (`batching.token_bucket`), and its padding tokens
  need no products (`model.apply` opens it around the decoder with the step's real token
  count). Products of other row counts (the LM head's selected rows) are untouched; XLA's dots
  always multiply every row."""
  return _padding((int(rows), valid))


def padding_slice(rows: int, start: int, stop: int):
  """Inside `padding_rows(rows, valid)`, around products of x[start:stop] (a chunk of the token
  rows): those see `padding_rows(stop - start, clip(valid - start, 0, stop - start))`.
  Elsewhere it changes nothing."""
  saved = getattr(_PADDING, "value", None)
  if saved is None or saved[0] != rows:
    return _padding(saved)
  return _padding((stop - start, jnp.clip(saved[1] - start, 0, stop - start)))


def every_row():
  """Inside it, `padding_rows` does not apply (products of selected rows)."""
  return _padding(None)


def onednn_packed_dot(x, packed, n: int, layer=None):
  """x [..., k] @ w -> [..., n] in x's dtype (accumulated in f32, cast once), w packed by
  `onednn_pack` (or layer `layer` of a stack of them, as `onednn_packed_matmul`): what a packed
  projection (`model.Dense`) and a packed tied head run. One f32 row by a single packed weight
  of at most PACKED_ROW_ON_XLA_MAX_COLUMNS columns runs `packed_row_on_xla` (PACKED_ROW_ON_XLA).
  Inside `padding_rows(rows, valid)`, an x of `rows` rows multiplies its first `valid` only."""
  rows = int(np.prod(x.shape[:-1]))
  x2 = x.reshape(rows, x.shape[-1])
  padding = getattr(_PADDING, "value", None)
  valid_rows = padding[1] if padding is not None and padding[0] == rows and rows > 1 else None
  if (PACKED_ROW_ON_XLA and rows == 1 and layer is None and packed.ndim == 1
      and n <= PACKED_ROW_ON_XLA_MAX_COLUMNS
      and packed_column_blocks(x.dtype, x.shape[-1], n) is not None
      and packed.size * packed.dtype.itemsize == onednn_packed_bytes(x.dtype, x.shape[-1], n)):
    out = packed_row_on_xla(x2, packed, n)
  else:
    out = onednn_packed_matmul(x2, packed, n, layer, valid_rows)
  return out.astype(x.dtype).reshape(*x.shape[:-1], n)


def for_backend(backend: str):
  """The dot_general of a matmul backend name (one of BACKENDS)."""
  if backend not in BACKENDS:
    raise ValueError(f"matmul={backend!r} is not one of {BACKENDS}")
  return {"xla": dot_general, "mkl": mkl_dot_general, "onednn": onednn_dot_general}[backend]


def matmul(x, w):
  """x: [..., k] @ w: [k, n] -> [..., n] through `dot_general`."""
  lead = x.shape[:-1]
  out = dot_general(x.reshape(-1, x.shape[-1]), w, (((1,), (0,)), ((), ())))
  return out.reshape(*lead, w.shape[-1])
