"""vLLM's CPU build on the serve benchmark's workload: run by path in its own venv (.venv-vllm,
built by `serve_bench.ensure_vllm` with the recipe in ../shared/NOTES.md), standard library and
vllm only, so it never imports paged_jax or jax.

  .venv-vllm/bin/python experiments/vllm_worker.py JOB.json RESULT.json

JOB.json: {"model_dir", "prompts" (token-id lists), "new_tokens", "block_size", "threads",
"kv_cache_gib", "max_model_len"}. Runs `LLM.generate` on token-id prompts twice (the first
warms up: compiles, allocates) and writes RESULT.json (vLLM logs to stdout): the timed run's
seconds and each request's generated token ids, greedy with EOS off (every request gets
exactly new_tokens).
"""

import json
import os
import sys
import time


def main(job_path: str, result_path: str) -> None:
  with open(job_path) as fh:
    job = json.load(fh)
  os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
  os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job.get('threads', 2) - 1}")
  from vllm import LLM, SamplingParams, TokensPrompt   # pylint: disable=import-outside-toplevel
  llm = LLM(model=job["model_dir"], dtype="float32", block_size=job.get("block_size", 32),
            skip_tokenizer_init=True, max_model_len=job.get("max_model_len", 512))
  n = job["new_tokens"]
  sp = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True,
                      detokenize=False)
  prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
  llm.generate(prompts, sp, use_tqdm=False)   # warm-up
  t = time.perf_counter()
  outs = llm.generate(prompts, sp, use_tqdm=False)
  seconds = time.perf_counter() - t
  tokens = [list(o.outputs[0].token_ids) for o in outs]
  with open(result_path, "w") as fh:
    json.dump(dict(seconds=seconds, tokens=tokens), fh)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
