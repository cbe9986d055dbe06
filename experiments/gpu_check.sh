#!/usr/bin/env bash
# The one short device check, for a session that is lent a GPU (run it through the device tool
# from the repository root): the kernel tests compiled on the GPU, then the kernel benchmark.
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
