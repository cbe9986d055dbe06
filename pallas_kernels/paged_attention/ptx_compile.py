"""Compiles the kernel's Triton IR to PTX and cubin with pip `triton`, and estimates occupancy.

No GPU and no jax needed: this file imports only the standard library (and `triton` inside the
compile functions), so it runs as a script in a venv that holds `triton==3.9.0` alone:

  python pallas_kernels/paged_attention/ptx_compile.py JOBS.json RESULTS.json

JOBS.json is a list of {"key", "ttir" (a path), "num_warps", "num_stages", "arch"}. Each job runs
Triton's CUDA pipeline for `GPUTarget("cuda", arch, 32)` from `make_ttir` on (ttir -> ttgir ->
llir -> ptx, as XLA does), then the ptxas bundled with the wheel with `-v`, in its own subprocess
(a crash in a pass fails one job, not all). RESULTS.json maps key -> {"ok", "regs",
"spill_stores", "spill_loads", "stack", "shared", "error"}.

`shared` is Triton's dynamic shared memory (the module's ttg.shared), which a launch needs; ptxas'
static shared memory is 0 for Triton kernels. XLA compiles Pallas kernels with the Triton it pins,
not pip Triton 3.9, so registers and shared memory are close to, not identical with, what a GPU
build gives; errors in Triton's passes do match (see WORKSPACE.md, "Kernel resources").

`occupancy` is pure arithmetic on the per-arch limits below, usable from any interpreter.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys

# Per-SM and per-block limits (CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"; shared memory per block is the opt-in maximum, 1 KiB per block is reserved).
ARCH_LIMITS = {
    80: dict(name="sm_80 (A100)", regs_per_sm=65536, max_regs_per_thread=255, max_warps_per_sm=64,
             max_blocks_per_sm=32, smem_per_sm=164 * 1024, smem_per_block=163 * 1024,
             smem_reserved_per_block=1024),
    90: dict(name="sm_90 (H100/H200)", regs_per_sm=65536, max_regs_per_thread=255,
             max_warps_per_sm=64, max_blocks_per_sm=32, smem_per_sm=228 * 1024,
             smem_per_block=227 * 1024, smem_reserved_per_block=1024),
}
_REG_UNIT = 256   # registers are allocated per warp in units of 256 (8 per thread x 32 lanes)


def occupancy(regs: int, num_warps: int, shared: int, arch: int) -> dict:
  """Programs (thread blocks) resident per SM, and which resource limits them.

  Args:
    regs: registers per thread (ptxas' "Used N registers").
    num_warps: warps per program.
    shared: dynamic shared memory per program in bytes.
    arch: 80 or 90.

  Returns:
    {"programs": int, "warps": int (resident warps per SM), "occupancy": warps / max warps,
     "limit": "registers" | "warps" | "shared" | "blocks"}.
  """
  lim = ARCH_LIMITS[arch]
  if shared > lim["smem_per_block"]:
    return dict(programs=0, warps=0, occupancy=0.0, limit="shared")
  regs_per_warp = -(-max(regs, 1) * 32 // _REG_UNIT) * _REG_UNIT
  by = {
      "registers": lim["regs_per_sm"] // (regs_per_warp * num_warps),
      "warps": lim["max_warps_per_sm"] // num_warps,
      "shared": lim["smem_per_sm"] // (shared + lim["smem_reserved_per_block"]),
      "blocks": lim["max_blocks_per_sm"],
  }
  limit = min(by, key=lambda k: (by[k], list(by).index(k)))
  programs = by[limit]
  warps = programs * num_warps
  return dict(programs=programs, warps=warps, occupancy=warps / lim["max_warps_per_sm"],
              limit=limit)


def parse_ptxas(log: str) -> dict:
  """Registers, stack and spill bytes from `ptxas -v` output (the kernel's entry)."""
  out = {}
  m = re.search(r"Used (\d+) registers", log)
  out["regs"] = int(m.group(1)) if m else None
  m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
  out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.groups()) if m else (None,) * 3
  return out


def parse_ptxas_entries(log: str) -> dict[str, dict]:
  """{entry function: parse_ptxas of its block} for a `ptxas -v` log over a whole module (XLA's
  PTX holds every kernel of a program; gpu_check.sh reads the Triton one out of it)."""
  out, name, block = {}, None, []
  for line in log.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
      if name is not None:
        out[name] = parse_ptxas("\n".join(block))
      name, block = m.group(1), []
    elif name is not None:
      block.append(line)
  if name is not None:
    out[name] = parse_ptxas("\n".join(block))
  return out


def _compile_one(ttir_path: str, arch: int, num_warps: int, num_stages: int, outdir: str) -> dict:
  """Runs in a subprocess: TTIR -> PTX (Triton's passes) -> cubin (ptxas -v)."""
  import warnings
  warnings.filterwarnings("ignore")
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
  from triton.compiler.compiler import IRSource, make_backend

  target = GPUTarget("cuda", arch, 32)
  backend = make_backend(target)
  context = ir.context()
  src = IRSource(ttir_path, context, backend)
  options = backend.parse_options(dict(num_warps=num_warps, num_stages=num_stages, num_ctas=1))
  stages = {}
  backend.add_stages(stages, options, src.language)
  metadata = {"hash": "none", "target": target, **options.__dict__}
  module = src.make_ir(target, options, None, None, context)
  os.makedirs(outdir, exist_ok=True)
  for ext, stage in stages.items():
    if ext == "cubin":   # ptxas is run by hand below, with -v
      break
    module = stage(module, metadata)
    with open(os.path.join(outdir, f"kernel.{ext}"), "w") as fh:
      fh.write(module if isinstance(module, str) else str(module))
  cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
         f"--gpu-name={sm_arch_from_capability(arch)}", os.path.join(outdir, "kernel.ptx"),
         "-o", os.path.join(outdir, "kernel.cubin")]
  proc = subprocess.run(cmd, capture_output=True, text=True)
  log = proc.stderr + proc.stdout
  res = dict(ok=proc.returncode == 0, shared=metadata.get("shared"), **parse_ptxas(log))
  if proc.returncode:
    res["error"] = "ptxas: " + " | ".join(l for l in log.splitlines() if "error" in l.lower())[:600]
  return res


def _first_error(text: str) -> str:
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  for line in lines:
    if "error" in line.lower() and "warn" not in line.lower():
      return line[:400]
  return (lines[-1] if lines else "no output")[:400]


def _run_job(job: dict, workdir: str) -> dict:
  outdir = os.path.join(workdir, f"{job['key']}.sm{job['arch']}")
  try:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--one", job["ttir"], str(job["arch"]),
         str(job["num_warps"]), str(job["num_stages"]), outdir],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"})
  except subprocess.TimeoutExpired:
    return dict(ok=False, error="timeout after 600 s")
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode or not lines:
    return dict(ok=False, error=f"triton (rc={proc.returncode}): "
                                f"{_first_error(proc.stderr + proc.stdout)}")
  return json.loads(lines[-1][len("RESULT "):])


def compile_jobs(jobs: list[dict], workdir: str, parallel: int = 2) -> dict:
  """{job key + "/sm" + arch: result} for every job, `parallel` subprocesses at a time."""
  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    futures = {f"{j['key']}/sm{j['arch']}": pool.submit(_run_job, j, workdir) for j in jobs}
    return {k: f.result() for k, f in futures.items()}


def main(argv: list[str]) -> int:
  if argv[0] == "--one":
    path, arch, warps, stages, outdir = argv[1:6]
    res = _compile_one(path, int(arch), int(warps), int(stages), outdir)
    print("RESULT " + json.dumps(res))
    return 0
  jobs_path, results_path = argv[:2]
  with open(jobs_path) as fh:
    jobs = json.load(fh)
  workdir = os.path.dirname(os.path.abspath(results_path))
  results = compile_jobs(jobs, workdir, parallel=int(os.environ.get("PTX_PARALLEL", "2")))
  with open(results_path, "w") as fh:
    json.dump(results, fh)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
