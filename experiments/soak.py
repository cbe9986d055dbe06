"""Soak test of the engine (issue 10, item 5): thousands of randomized requests on a tiny pool.

  python -m experiments.soak                          # 3,000 requests, both preemption modes
  python -m experiments.soak --num_requests=200       # about a minute

Requests arrive a few per step (Poisson) with random prompt lengths (some sharing a "system
prompt" prefix), random max_tokens, parallel samples (n up to 3, greedy or seeded sampling), beam
search (width 2-3), cache salts; a share of steps aborts a random unfinished request; bad
requests (empty prompts, ids out of the vocabulary or not ints, sampling parameters out of range,
malformed stop ids, ...) are mixed in and must be refused with a ValueError; faults are injected
into a share of device steps (an exception, sometimes after destroying the pool). Half the
requests run with preemption by recompute, half by swap, on a pool small enough to preempt often.

Checked at the end: every accepted request finished (completed, aborted, or failed with its
reason): none lost; every completed one's tokens equal a run of the same requests on an
unconstrained engine (a large pool, no faults, no aborts); no page is in use, the block manager's
invariants hold, and no host swap slot is held. Output: one JSONL line per preemption mode in
experiments/results/soak.jsonl, and a summary on stdout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, flags
import numpy as np

from paged_jax import config as config_lib, testing
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine, StepFunctions
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

RESULTS = os.path.join(os.path.dirname(__file__), "results", "soak.jsonl")


@dataclasses.dataclass(frozen=True)
class SoakConfig:
  num_requests: int = 3000          # split evenly over the two preemption modes
  seed: int = 0
  num_pages: int = 24               # a tiny pool: preemption is frequent
  page_size: int = 2
  max_prompt: int = 12
  max_tokens: int = 10
  arrivals_per_step: float = 1.5    # Poisson mean
  abort_prob: float = 0.03          # per step: abort one random unfinished request
  bad_prob: float = 0.2             # per arriving request: also try a bad one
  fault_prob: float = 0.02          # per device step: raise (a quarter of them destroy the pool)
  progress: bool = True
  results: str | None = RESULTS


class FaultySteps:
  """Wraps the real steps; raises in a random share of calls (after deleting the pool's buffers
  in some, as a failure that consumed the donated pool would)."""

  def __init__(self, rng: np.random.Generator, prob: float, steps: StepFunctions = StepFunctions()):
    self.rng, self.prob, self.steps = rng, prob, steps
    self.injected = 0
    self.pool_destroyed = 0

  def _wrap(self, fn):
    def call(params, pool, *args, **kw):
      if self.rng.random() < self.prob:
        self.injected += 1
        if self.rng.random() < 0.25:
          self.pool_destroyed += 1
          for x in (pool.k, pool.v):
            x.delete()
        raise RuntimeError(f"injected fault #{self.injected}")
      return fn(params, pool, *args, **kw)
    return call

  def functions(self) -> StepFunctions:
    return StepFunctions(self._wrap(self.steps.sample_step), self._wrap(self.steps.multi_step_decode))


def bad_requests(vocab_size: int, max_position: int):
  """(description, prompt, SamplingParams kwargs) of requests the engine must refuse."""
  ok = [1, 2, 3]
  return [
      ("empty prompt", [], {}),
      ("prompt past max_position", [1] * (max_position + 1), {}),
      ("prompt + max_tokens past max_position", [1] * (max_position - 2), dict(max_tokens=5)),
      ("token id = vocab_size", [1, vocab_size], {}),
      ("negative token id", [1, -1], {}),
      ("float token id", [1, 2.5], {}),
      ("float token id that is whole", [1.0, 2], {}),
      ("token id >= 2**63", [1, 2 ** 63], {}),
      ("None token id", [1, None], {}),
      ("text prompt", "hello", {}),
      ("bool token id", [True, 2], {}),
      ("negative temperature", ok, dict(temperature=-0.5)),
      ("NaN temperature", ok, dict(temperature=float("nan"))),
      ("top_p = 0", ok, dict(top_p=0.0)),
      ("top_p > 1", ok, dict(top_p=1.5)),
      ("top_k < 0", ok, dict(top_k=-1)),
      ("n = 0", ok, dict(n=0)),
      ("beam_width = 0", ok, dict(beam_width=0)),
      ("max_tokens = 0", ok, dict(max_tokens=0)),
      ("max_tokens a string", ok, dict(max_tokens="5")),
      ("stop id out of vocabulary", ok, dict(stop_token_ids=(vocab_size + 3,))),
      ("stop id negative", ok, dict(stop_token_ids=(-2,))),
      ("stop ids not a sequence", ok, dict(stop_token_ids=7)),
      ("stop id a float", ok, dict(stop_token_ids=(1.5,))),
      ("beam search with temperature", ok, dict(beam_width=2, temperature=0.7)),
      ("n > beam_width", ok, dict(beam_width=2, n=3)),
      ("too many samples for the batch", ok, dict(n=10_000)),
      ("logprobs beyond the vocabulary", ok, dict(logprobs=vocab_size + 1)),
      ("seed out of range", ok, dict(seed=-1)),
  ]


def _random_request(rng, cfg: SoakConfig, vocab: int, system_prompts):
  n_prompt = int(rng.integers(1, cfg.max_prompt + 1))
  prompt = [int(t) for t in rng.integers(4, vocab, n_prompt)]
  if rng.random() < 0.3:   # shared prefixes exercise the prefix cache
    prompt = list(system_prompts[int(rng.integers(len(system_prompts)))]) + prompt[:4]
  max_tokens = int(rng.integers(1, cfg.max_tokens + 1))
  kind = rng.random()
  if kind < 0.15:
    params = SamplingParams(max_tokens=max_tokens, beam_width=int(rng.integers(2, 4)),
                            n=int(rng.integers(1, 3)))
  elif kind < 0.5:
    params = SamplingParams(max_tokens=max_tokens, n=int(rng.integers(1, 4)), temperature=0.8,
                            top_p=0.9, seed=int(rng.integers(2 ** 31)))
  else:
    params = SamplingParams(max_tokens=max_tokens, n=int(rng.integers(1, 3)))
  salt = [None, None, "tenant-a", "tenant-b"][int(rng.integers(4))]
  return prompt, params, salt


def _soak_one(cfg: SoakConfig, mode: str, num_requests: int, seed: int, params, model_cfg) -> dict:
  from tqdm import tqdm
  rng = np.random.default_rng(seed)
  faulty = FaultySteps(np.random.default_rng(seed + 1), cfg.fault_prob)
  engine = Engine(params, model_cfg, cache=CacheConfig(page_size=cfg.page_size,
                                                       num_pages=cfg.num_pages),
                  scheduler=SchedulerConfig(preemption_mode=mode, max_num_seqs=8,
                                            max_num_batched_tokens=32, steps_per_sync=3,
                                            swap_space_pages=cfg.num_pages),
                  impl="xla", steps=faulty.functions(), eos_token_ids=(3,), validate_tables=True)
  vocab = model_cfg.vocab_size
  bad = bad_requests(vocab, model_cfg.max_position)
  system_prompts = [[int(t) for t in rng.integers(4, vocab, 6)] for _ in range(3)]
  requests: dict[str, tuple] = {}
  outcome: dict[str, str] = {}
  final = {}
  bad_tried = bad_accepted = 0
  aborted = 0
  t0 = time.perf_counter()
  with tqdm(total=num_requests, disable=not cfg.progress, unit="req", desc=f"soak {mode}") as bar:
    while len(requests) < num_requests or engine.has_unfinished():
      for _ in range(int(rng.poisson(cfg.arrivals_per_step))):
        if len(requests) >= num_requests:
          break
        prompt, sp, salt = _random_request(rng, cfg, vocab, system_prompts)
        rid = engine.add_request(prompt, sp, cache_salt=salt)
        requests[rid] = (prompt, sp, salt)
        if rng.random() < cfg.bad_prob:
          _, bad_prompt, kw = bad[int(rng.integers(len(bad)))]
          bad_tried += 1
          try:
            engine.add_request(bad_prompt, SamplingParams(**kw))
            bad_accepted += 1
          except ValueError:
            pass
      if rng.random() < cfg.abort_prob:
        live = [r for r in requests if r not in outcome]
        if live and engine.abort(live[int(rng.integers(len(live)))]):
          aborted += 1
      for out in engine.step():
        if out.finished:
          reasons = {c.finish_reason for c in out.outputs}
          outcome[out.request_id] = ("abort" if "abort" in reasons else
                                     "error" if "error" in reasons else "completed")
          if outcome[out.request_id] == "error":
            assert out.error, out
          final[out.request_id] = out
          bar.update(1)
  seconds = time.perf_counter() - t0
  engine.bm.check_invariants()
  engine.scheduler.check_swap_accounting()
  leaks = dict(pages_in_use=engine.bm.stats()["pages_in_use"],
               swap_pages_held=engine.scheduler.swap_pages_used, host_swap_copies=len(engine._swap))
  # The same completed requests on an unconstrained engine: no faults, aborts or pressure.
  completed = [r for r in requests if outcome.get(r) == "completed"]
  reference = Engine(params, model_cfg, cache=CacheConfig(page_size=cfg.page_size,
                                                          num_pages=4096),
                     scheduler=SchedulerConfig(max_num_seqs=256), impl="xla", eos_token_ids=(3,))
  ref_ids = {reference.add_request(requests[r][0], requests[r][1], cache_salt=requests[r][2]): r
             for r in completed}
  mismatched = []
  for out in reference.stream():
    if out.finished:
      r = ref_ids[out.request_id]
      if [c.token_ids for c in out.outputs] != [c.token_ids for c in final[r].outputs]:
        mismatched.append(r)
  lost = [r for r in requests if r not in outcome]
  return dict(
      preemption_mode=mode, requests=len(requests), completed=len(completed),
      identical_to_unconstrained=len(completed) - len(mismatched), mismatched=mismatched[:10],
      aborted=sum(1 for v in outcome.values() if v == "abort"),
      failed_with_reason=sum(1 for v in outcome.values() if v == "error"),
      errors=sorted({final[r].error for r in final if outcome[r] == "error"})[:5],
      lost=len(lost), bad_inputs_tried=bad_tried, bad_inputs_accepted=bad_accepted,
      faults_injected=faulty.injected, pools_destroyed=faulty.pool_destroyed,
      failed_steps=engine.stats.failed_steps, preemptions=engine.stats.preemptions,
      swapped_in_pages=engine.stats.swapped_in_pages,
      recomputed_tokens=engine.stats.recomputed_tokens,
      cached_prompt_tokens=engine.stats.cached_prompt_tokens,
      validate_s=engine.stats.validate_s, seconds=seconds, **leaks)


def run(cfg: SoakConfig) -> list[dict]:
  """Runs the soak in both preemption modes; returns (and writes) one record per mode."""
  model_cfg = config_lib.tiny_config()
  params = testing.random_params(model_cfg, seed=0, scale=0.3)
  half = cfg.num_requests // 2
  records = [_soak_one(cfg, mode, n, cfg.seed + 10 * i, params, model_cfg)
             for i, (mode, n) in enumerate([("recompute", half), ("swap", cfg.num_requests - half)])]
  if cfg.results:
    os.makedirs(os.path.dirname(cfg.results), exist_ok=True)
    with open(cfg.results, "a") as f:
      for r in records:
        f.write(json.dumps({"config": dataclasses.asdict(cfg), **r}) + "\n")
  return records


def main(_):
  cfg = SoakConfig(num_requests=_NUM_REQUESTS.value, seed=_SEED.value,
                   fault_prob=_FAULT_PROB.value, progress=_PROGRESS.value)
  for r in run(cfg):
    print(f"{r['preemption_mode']:>9}: {r['requests']} requests: {r['completed']} completed "
          f"({r['identical_to_unconstrained']} identical to the unconstrained run), "
          f"{r['aborted']} aborted, {r['failed_with_reason']} failed with a reason, "
          f"{r['lost']} lost; {r['bad_inputs_tried']} bad inputs tried, "
          f"{r['bad_inputs_accepted']} accepted; {r['faults_injected']} faults injected "
          f"({r['pools_destroyed']} destroyed the pool); {r['preemptions']} preemptions; "
          f"leaks: {r['pages_in_use']} pages, {r['swap_pages_held']} swap pages; "
          f"{r['seconds']:.1f} s (table validation {r['validate_s']:.2f} s)")


if __name__ == "__main__":
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", SoakConfig.num_requests,
                                       "Requests (split over the two preemption modes).")
  _SEED = flags.DEFINE_integer("seed", SoakConfig.seed, "Seed of the workload and the faults.")
  _PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
  _FAULT_PROB = flags.DEFINE_float("fault_prob", SoakConfig.fault_prob,
                                   "Share of device steps that raise.")
  app.run(main)
