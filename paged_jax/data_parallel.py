"""Data parallelism over sequences: one engine replica per row of the mesh's "data" axis.

  mesh = sharding.make_mesh(data=2, model=4)       # 8 devices: 2 replicas x 4-way tensor parallel
  engine = DataParallelEngine(params, cfg, mesh=mesh, cache=CacheConfig(page_size=16))
  engine.generate(prompts, SamplingParams(max_tokens=32))

Each replica is an `Engine` on its row's devices (tensor parallel over them when the row has
more than one) with its own pool, block manager, prefix cache and scheduler: a sequence lives
on one replica for its whole life, so nothing moves between replicas. The placement policy is
`place`: a new request goes to the replica whose unfinished requests may hold the fewest pages
(`Engine.pages_at_most`, the bound admission uses), ties to the lowest index. All of a
request's samples or beams stay together (they share its prompt pages).

`step()` runs one step on every replica with work, each in its own thread (JAX releases the
GIL while a step runs, so replicas on separate devices overlap), and returns their outputs.
Request seeds are drawn here, in arrival order, so a seeded run gives the same tokens as one
`Engine` with the same seed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from typing import Sequence as Seq

import numpy as np

from paged_jax import sharding
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.engine import Engine, EngineLoop
from paged_jax.host.sequence import RequestOutput
from paged_jax.sampling import SamplingParams


def make_engine(params, cfg: ModelConfig, *, mesh=None, **engine_kw):
  """The engine for a mesh: one `Engine` (tensor parallel over the "model" devices when there
  are several), or a `DataParallelEngine` of such replicas when the "data" axis has more than
  one row. mesh None: one device."""
  if mesh is not None and sharding.axis_size(mesh, sharding.DATA) > 1:
    return DataParallelEngine(params, cfg, mesh=mesh, **engine_kw)
  return Engine(params, cfg, mesh=mesh, **engine_kw)


def place(loads: Seq[int]) -> int:
  """The replica for a new request: the least loaded (pages its unfinished requests may hold;
  every replica has the same pool), the lowest index on a tie."""
  return int(np.argmin(loads))


class DataParallelEngine(EngineLoop):
  """`Engine`'s interface over the replicas of a ("data", "model") mesh.

  Args:
    params, cfg: the model (placed on every replica, split over its "model" devices).
    mesh: a `sharding.make_mesh(data, model)` mesh.
    cache: each replica's pool (a byte budget is per device, as for one Engine).
    seed: draws the seed of every request that brings none.
    engine_kw: the rest of `Engine`'s arguments, the same for every replica.
  """

  def __init__(self, params, cfg: ModelConfig, *, mesh, cache: CacheConfig = CacheConfig(),
               seed: int = 0, **engine_kw):
    self.mesh = mesh
    self.replicas = [Engine(params, cfg, cache=cache, mesh=m, seed=seed, **engine_kw)
                     for m in sharding.replica_meshes(mesh)]
    self.cfg = cfg
    self.page_size = self.replicas[0].page_size
    self._rng = np.random.default_rng(seed)
    self._ids = itertools.count()
    self._where: dict[str, int] = {}     # request id -> replica
    self._need: dict[str, int] = {}      # request id -> pages it may hold
    self._loads = [0] * len(self.replicas)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.replicas))

  # ------------------------------------------------------------------------------ requests

  @property
  def num_pages(self) -> int:
    """Pages over all replicas (each has its own NULL_PAGE)."""
    return sum(e.num_pages for e in self.replicas)

  @property
  def capacity_tokens(self) -> int:
    return sum(e.capacity_tokens for e in self.replicas)

  @property
  def kv_capacity_tokens(self) -> int:
    return sum(e.kv_capacity_tokens for e in self.replicas)

  def validate_request(self, prompt: Seq[int], params: SamplingParams) -> None:
    self.replicas[0].validate_request(prompt, params)

  def placement(self, request_id: str) -> int | None:
    """The replica a live request runs on (None once it finished or if unknown)."""
    return self._where.get(request_id)

  def add_request(self, prompt: Seq[int], params: SamplingParams = SamplingParams(), *,
                  request_id: str | None = None, **kw) -> str:
    """Places a request on one replica (`place`); returns its id. Raises ValueError (and queues
    nothing) if it can never run."""
    request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
    if request_id in self._where:
      raise ValueError(f"request_id={request_id!r} is already in use")
    self.validate_request(prompt, params)
    if params.seed is None:
      params = dataclasses.replace(params, seed=int(self._rng.integers(2 ** 32)))
    need = self.replicas[0].pages_at_most(len(prompt), params)
    r = place(self._loads)
    self.replicas[r].add_request(prompt, params, request_id=request_id, **kw)
    self._where[request_id], self._need[request_id] = r, need
    self._loads[r] += need
    return request_id

  @property
  def loads(self) -> list[int]:
    """Per replica: pages its unfinished requests may hold (what `place` compares)."""
    return list(self._loads)

  def abort(self, request_id: str) -> bool:
    """Stops a request on its replica (`Engine.abort`); False if unknown or finished."""
    r = self._where.get(request_id)
    return r is not None and self.replicas[r].abort(request_id)

  def has_unfinished(self) -> bool:
    return any(e.has_unfinished() for e in self.replicas)

  # ------------------------------------------------------------------------------ the loop

  def step(self, interrupt=None) -> list[RequestOutput]:
    """One step on every replica with work (concurrently); their outputs, replica by replica.
    interrupt: as `Engine.step`'s, asked by every replica."""
    busy = [e for e in self.replicas if e.has_unfinished()]
    if len(busy) > 1:
      results = list(self._pool.map(lambda e: e.step(interrupt), busy))
    else:
      results = [e.step(interrupt) for e in busy]
    outputs = [o for outs in results for o in outs]
    for o in outputs:
      if o.finished and o.request_id in self._where:
        self._loads[self._where.pop(o.request_id)] -= self._need.pop(o.request_id)
    return outputs

  def warmup(self, scope: str = "one_user", *, progress: bool = False) -> dict:
    """`Engine.warmup` on every replica (each compiles for its own devices); summed."""
    runs = [e.warmup(scope, progress=progress) for e in self.replicas]
    return {k: sum(r[k] for r in runs) for k in runs[0]}

  # ------------------------------------------------------------------------------ metrics

  def metrics(self) -> dict:
    """Counters summed over replicas (max_pages_in_use: the sum of each replica's peak); KV usage
    and prefix hit rate over all pools; each replica's own under "replicas"."""
    per = [e.metrics() for e in self.replicas]
    out = {k: sum(m[k] for m in per) for k, v in per[0].items()
           if isinstance(v, (int, float)) and k not in ("kv_usage", "prefix_hit_rate", "page_size")}
    stats = [e.bm.stats() for e in self.replicas]
    out["kv_usage"] = (sum(s["pages_in_use"] for s in stats) /
                       sum(e.num_pages - 1 for e in self.replicas))
    out["prefix_hit_rate"] = (sum(s["prefix_hits_tokens"] for s in stats) /
                              max(1, sum(s["prefix_queries_tokens"] for s in stats)))
    out["page_size"] = self.page_size
    out["replicas"] = per
    return out

  def gauges(self) -> dict[str, int]:
    """`Engine.gauges` summed over the replicas."""
    per = [e.gauges() for e in self.replicas]
    return {k: sum(g[k] for g in per) for k in per[0]}

  def check_invariants(self) -> None:
    for e in self.replicas:
      e.check_invariants()
