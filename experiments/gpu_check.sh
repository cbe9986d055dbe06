#!/usr/bin/env bash
# The one short device check, for a session that is lent a GPU (run it through the device tool
# from the repository root): the kernel tests compiled on the GPU, the kernel benchmark, then the
# kernel's registers and spills as XLA's own Triton compiles them (read from its PTX dump with
# ptxas), to set beside the CPU-side table of WORKSPACE.md ("Kernel resources").
# It uses the GPU image's own python3 (jax 0.11 with CUDA, flax, chex, pytest: no installs).
# Results land under $OUT (the device tool brings them back) or experiments/results/.
set -uo pipefail
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
out="${OUT:-experiments/results}"
mkdir -p "$out"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee "$out/gpu_env.txt"
python3 -m pytest -q tests/pallas_kernels 2>&1 | tee "$out/gpu_kernel_tests.log"
python3 -m experiments.attention_bench --preset=gpu --modes=decode,mixed --rounds=3 --iters=10 \
    --out="$out/attention_bench_gpu.jsonl" 2>&1 | grep -v -i warning | tee "$out/attention_bench_gpu.txt"
# Resources from the real compiler: a slice of the PTX matrix (every dtype, precision and head_dim;
# page 16; decode and prefill; GQA group 4; plain and window + soft cap).
XLA_FLAGS="--xla_dump_to=/tmp/paged_jax_xla_dump" python3 -m experiments.kernel_ptx --source=xla \
    --dump_dir=/tmp/paged_jax_xla_dump --page_sizes=16 --modes=decode,prefill --groups=4 \
    --results_dir="$out" 2>&1 | grep -v -i warning | tee "$out/kernel_ptx_xla.txt"
