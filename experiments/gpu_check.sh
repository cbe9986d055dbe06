#!/usr/bin/env bash
# The one short device check, for a session that is lent a GPU (run it through the device tool
# from the repository root): the kernel's tests compiled on the GPU (the kernel against dense
# attention and the float64 oracle, each precision's error on real tensor cores, the engine on
# the compiled kernel against the XLA path and under poisoned pages), the kernel benchmark, the
# kernel's registers and spills as XLA's own Triton compiles them (read from its PTX dump with
# ptxas, to set beside WORKSPACE.md's "Kernel resources"), and the main job on the kernel.
# It uses the GPU image's own python3 (jax 0.11 with CUDA, flax, chex, pytest: no installs).
# Each part has its own time limit, so one that hangs leaves the others their time; the whole
# took 309 s on an H200 (2026-12-04), of a 15-minute device budget (experiments/results/
# README.md, "Pallas kernel (issue 4) on a GPU").
# Results land under $OUT (the device tool brings them back) or experiments/results/.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 PATH="$PATH:/usr/local/cuda/bin"
# XLA's default compile flags (the suite's fast-compile flags are for CPU CI), no per-test bound
# (Triton compiles inside the tests).
export PAGED_JAX_TEST_FAST_COMPILE=0 PAGED_JAX_MAX_TEST_SECONDS=0
out="${OUT:-experiments/results}"
mkdir -p "$out"
part() {   # part NAME SECONDS CMD...: runs CMD under a time limit, says how it ended
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@"
  echo "== $name: exit $? after $((SECONDS - start)) s"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c 'import jax, jaxlib; d = jax.devices()[0]; print("jax", jax.__version__, "jaxlib",
jaxlib.__version__, d.device_kind, "cc", getattr(d, "compute_capability", None))'
  which ptxas; } 2>&1 | tee "$out/gpu_env.txt"
part tests 200 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/pallas_kernels/paged_attention_test.py tests/paged_jax/isolation_test.py \
    -k "KernelTest or CompiledTest or compiled or DispatchTest" 2>&1 | tee "$out/gpu_kernel_tests.log"
part attention_bench 140 python3 -m experiments.attention_bench --preset=gpu --modes=decode,mixed \
    --seq_lens=512,4096,32768 --rounds=3 --iters=10 --out="$out/attention_bench_gpu.jsonl" 2>&1 \
    | grep -v -i warning | tee "$out/attention_bench_gpu.txt"
# Resources from the real compiler: a slice of the PTX matrix (every dtype and precision, head_dim
# 64 and 128, page 16, decode and prefill, GQA group 4, plain and window + soft cap).
part kernel_ptx 100 env XLA_FLAGS=--xla_dump_to=/tmp/paged_jax_xla_dump python3 -m experiments.kernel_ptx \
    --source=xla --dump_dir=/tmp/paged_jax_xla_dump --page_sizes=16 --modes=decode,prefill \
    --groups=4 --head_dims=64,128 --results_dir="$out" 2>&1 | grep -v -i warning \
    | tee "$out/kernel_ptx_xla.txt"
# The README's main job (the embedded model's synthetic workload) on the compiled kernel.
part serve 70 python3 -m paged_jax.serve --impl=pallas 2>&1 | grep -v -i warning \
    | tee "$out/serve_pallas.txt"
