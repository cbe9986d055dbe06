"""`Generator`: batch generation as a thin wrapper over the `Engine` (token lists in and out).

  gen = Generator(params, cfg, num_pages=256, page_size=16)
  gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=32, n=2, eos_id=[2, 3])

Each call queues every prompt as a request and steps the engine until they finish. The engine (and
so its prefix cache) lives as long as the Generator: a later call hits pages an earlier one
cached. For streaming, arrivals, aborts or per-request sampling, use `paged_jax.engine.Engine`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine import Engine, EngineStats
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

__all__ = ["Generator", "EngineStats"]


class Generator:
  """Generation over a paged pool.

  Args:
    params, cfg: the model.
    num_pages, page_size: the pool (num_pages counts NULL_PAGE).
    steps_per_sync: decode steps per host sync (k of `multi_step_decode`).
    max_prefill_tokens: the per-step token budget (decode rows take one token each, prefill
      chunks the rest); it also caps the batch. None = whole prompts.
    max_batch: most sequences running at once.
    sampling: temperature / top-k / top-p / seed for every request (max_tokens and n come from
      `generate`); default greedy.
    preemption_mode: "recompute" or "swap".
    impl: attention path ("auto", "xla", "pallas", "interpret").
  """

  def __init__(self, params, cfg: ModelConfig, *, num_pages: int, page_size: int,
               steps_per_sync: int = 4, max_prefill_tokens: int | None = None,
               max_batch: int = 64, enable_prefix_caching: bool = True,
               sampling: SamplingParams = SamplingParams(), preemption_mode: str = "recompute",
               impl: str = "auto", seed: int = 0, tokenizer=None, steps=None):
    budget = max_prefill_tokens if max_prefill_tokens is not None else 1 << 20
    if budget < 1:
      raise ValueError(f"max_prefill_tokens={max_prefill_tokens} must be >= 1")
    self.sampling = sampling
    kw = {} if steps is None else {"steps": steps}
    self.engine = Engine(
        params, cfg,
        cache=CacheConfig(page_size=page_size, num_pages=num_pages,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=min(max_batch, budget),
                                  max_num_batched_tokens=budget, steps_per_sync=steps_per_sync,
                                  preemption_mode=preemption_mode),
        impl=impl, seed=seed, tokenizer=tokenizer, **kw)

  @property
  def bm(self):
    return self.engine.bm

  @property
  def stats(self) -> EngineStats:
    return self.engine.stats

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
               eos_id: int | Sequence[int] | None = None) -> list[list[int]]:
    """Completions for every prompt (n per prompt, prompt-major).

    Args:
      eos_id: one end-of-sequence id or several; a completion stops at (and keeps) the first.
    """
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    eos = () if eos_id is None else ((eos_id,) if not isinstance(eos_id, (list, tuple, set,
                                                                          frozenset)) else eos_id)
    params = dataclasses.replace(self.sampling, max_tokens=max_new_tokens, n=n,
                                 stop_token_ids=tuple(eos))
    outs = self.engine.generate([list(p) for p in prompts], params)
    return [c.token_ids for o in outs for c in o.outputs]
