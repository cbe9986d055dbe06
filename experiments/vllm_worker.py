"""vLLM's CPU build on the serve benchmark's workload: run by path in its own venv (.venv-vllm,
built by `serve_bench.ensure_vllm` with the recipe in ../shared/NOTES.md), standard library and
vllm only, so it never imports paged_jax or jax.

  .venv-vllm/bin/python experiments/vllm_worker.py JOB.json RESULT.json

JOB.json: {"model_dir", "block_size", "threads", "kv_cache_gib", "max_model_len"} and either
- offline: "prompts" (token-id lists), "new_tokens": `LLM.generate` on the token-id prompts
  after a warm-up `generate` of the same prompts reversed (compiles, allocates, and leaves
  nothing in vLLM's prefix cache for the timed prompts); RESULT.json (vLLM logs to stdout) holds the
  timed run's seconds and each request's generated token ids; or
- online: "runs": [{"name", "requests": [{"prompt", "max_tokens", "arrival"}]}]: after the
  same warm-up on the first run's requests, each run (prefix cache emptied first) feeds its requests to the engine
  (`LLM.llm_engine.add_request`) at their arrival times (seconds from the run's start) and
  steps it until all finish; RESULT.json holds, per run, each request's arrival, first-token
  and finish times (perf_counter seconds from the run's start) and token ids.
Greedy with EOS off in both: every request gets exactly its max tokens.
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
  llm = LLM(model=job["model_dir"], dtype=job.get("dtype", "float32"),
            block_size=job.get("block_size", 32), skip_tokenizer_init=True,
            max_model_len=job.get("max_model_len", 512))
  # ignore_eos alone gives exactly n tokens; min_tokens=n would also mask EOS's logit, so a
  # greedy row whose argmax is EOS would differ from the other engines' (none of them masks it).
  greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                    detokenize=False)
  if "runs" in job:
    result = online(llm, job["runs"], greedy, TokensPrompt)
  else:
    result = offline(llm, job["prompts"], greedy(job["new_tokens"]), TokensPrompt)
  with open(result_path, "w") as fh:
    json.dump(result, fh)


def _warm_up(llm, prompt_ids, params, TokensPrompt) -> None:  # noqa: N803 (vllm's class)
  """Runs the same lengths with each prompt reversed: it compiles and allocates what the timed
  run needs, but vLLM's prefix cache (on by default) cannot serve the timed prompts from it."""
  llm.generate([TokensPrompt(prompt_token_ids=p[::-1]) for p in prompt_ids], params,
               use_tqdm=False)


def offline(llm, prompt_ids, sp, TokensPrompt) -> dict:  # noqa: N803
  prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
  _warm_up(llm, prompt_ids, sp, TokensPrompt)
  t = time.perf_counter()
  outs = llm.generate(prompts, sp, use_tqdm=False)
  seconds = time.perf_counter() - t
  return dict(seconds=seconds, tokens=[list(o.outputs[0].token_ids) for o in outs])


def online(llm, runs, greedy, TokensPrompt) -> dict:  # noqa: N803
  first = runs[0]["requests"]
  _warm_up(llm, [r["prompt"] for r in first], [greedy(r["max_tokens"]) for r in first],
           TokensPrompt)
  engine = llm.llm_engine
  out = {}
  for run in runs:
    llm.reset_prefix_cache()   # the runs share prompts (one seed); each starts cold, as ours
    reqs = run["requests"]
    order = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival"])
    first_token, finish, tokens = {}, {}, {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
      now = time.perf_counter() - start
      while nxt < len(order) and reqs[order[nxt]]["arrival"] <= now:
        i = order[nxt]
        engine.add_request(f"{run['name']}-{i}", TokensPrompt(prompt_token_ids=reqs[i]["prompt"]),
                           greedy(reqs[i]["max_tokens"]))
        nxt += 1
      if engine.has_unfinished_requests():
        for o in engine.step():
          i = int(o.request_id.rsplit("-", 1)[1])
          t = time.perf_counter() - start
          if i not in first_token and len(o.outputs[0].token_ids):
            first_token[i] = t
          if o.finished:
            finish[i], tokens[i] = t, list(o.outputs[0].token_ids)
      elif nxt < len(order):
        time.sleep(max(0.0, reqs[order[nxt]]["arrival"] - (time.perf_counter() - start)))
    out[run["name"]] = [dict(arrival=reqs[i]["arrival"], first_token=first_token[i],
                             finish=finish[i], tokens=tokens[i]) for i in range(len(reqs))]
  return out


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
