"""The kernel's Triton IR, taken out of a CUDA lowering on any machine (no GPU needed).

`lower_for_cuda` lowers a jitted function for CUDA (jax >= 0.11 wants an abstract GPU mesh for
that on a CPU-only machine); `triton_kernels` finds every Pallas Triton call in the result: a
`stablehlo.custom_call "__gpu$xla.gpu.triton"` whose `mhlo.backend_config` dict holds the Triton
module as MLIR bytecode (`ir`), `num_warps`, `num_stages` and the grid. The bytecode is parsed with
jaxlib's bundled Triton dialect and printed as TTIR text, which pip `triton` compiles to PTX
(`ptx_compile.py`, run in a venv with triton; see experiments/kernel_ptx.py).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax._src.lib.mlir import ir

try:
  from jaxlib.mlir._mlir_libs import _triton_ext
except ImportError:  # pragma: no cover - jaxlib builds without the Triton dialect
  _triton_ext = None


def _jax_version() -> tuple[int, int]:
  return tuple(int(x) for x in jax.__version__.split(".")[:2])


def lower_for_cuda(fn, *args):
  """`jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))`, on a machine without a GPU.

  args may be jax.ShapeDtypeStruct. Under jax >= 0.11 this runs inside an abstract mesh of one
  H200 (that version refuses a CUDA lowering without a GPU device otherwise).
  """
  ctx = contextlib.nullcontext()
  if _jax_version() >= (0, 11):
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    ctx = jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))
  with ctx:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One Pallas Triton call of a lowered module."""
  name: str
  ttir: str                # the tt.func module as MLIR text
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]


def _walk_custom_calls(op, out):
  for region in op.regions:
    for block in region:
      for inner in block.operations:
        if inner.name == "stablehlo.custom_call":
          out.append(inner)
        _walk_custom_calls(inner, out)
  return out


def _backend_config(call) -> ir.DictAttr:
  for key in ("mhlo.backend_config", "backend_config"):
    if key in call.attributes:
      try:
        return ir.DictAttr(call.attributes[key])
      except ValueError:   # the empty string backend_config that sits beside the dict
        continue
  raise RuntimeError("a Triton custom call without a dict backend_config: this jaxlib serializes "
                     "Pallas calls differently; update triton_ir.triton_kernels")


def triton_kernels(lowered) -> list[TritonKernel]:
  """Every Pallas Triton call in `lowered` (a jax Lowered), as TTIR text with its launch config."""
  if _triton_ext is None:
    raise RuntimeError("this jaxlib has no Triton MLIR dialect (jaxlib.mlir._mlir_libs._triton_ext)")
  module = lowered.compiler_ir("stablehlo")
  kernels = []
  for call in _walk_custom_calls(module.operation, []):
    if "triton" not in ir.StringAttr(call.attributes["call_target_name"]).value:
      continue
    cfg = _backend_config(call)
    ctx = ir.Context()
    _triton_ext.register_dialect(ctx)
    with ctx:
      text = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes).operation.get_asm(
          enable_debug_info=False)
    get = lambda k: ir.IntegerAttr(cfg[k]).value
    kernels.append(TritonKernel(name=ir.StringAttr(cfg["name"]).value, ttir=text,
                                num_warps=get("num_warps"), num_stages=get("num_stages"),
                                grid=(get("grid_x"), get("grid_y"), get("grid_z"))))
  return kernels
