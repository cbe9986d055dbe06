"""The serving engine: requests in, streamed outputs out, one scheduled step at a time.

  engine = Engine(params, cfg, cache=CacheConfig(page_size=16, num_pages=512))
  engine.add_request([1, 2, 3], SamplingParams(max_tokens=32, temperature=0.8, seed=7))
  while engine.has_unfinished():
    for out in engine.step():           # deltas: out.outputs[i].new_token_ids
      ...

One step: the scheduler plans (decode rows, prefill chunks within the token budget, copy-on-write
pairs, swaps, preemptions); the engine swaps pages out to / in from host memory
(`page_ops.read_pages` / `write_pages`), applies the copies in conflict-free batches, turns the
plan into padded arrays (`host.batching`), runs one jitted step (`step.sample_step`, or
`step.multi_step_decode` for a k-step decode round), brings the sampled tokens back (the one
sync), and lets the scheduler append them, fork or free sequences, and finish requests. The
engine owns the params, the pool and the request seeds; everything else is in `host/`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import time
from typing import Callable, Iterable, Iterator, NamedTuple, Sequence as Seq

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import attention, cpu_kernel, kv_quant, matmul, model, page_ops, sharding, step
from paged_jax import program_store as program_store_lib
from paged_jax.config import CacheConfig, ModelConfig
from paged_jax.host import batching
from paged_jax.host.addressing import pages_needed
from paged_jax.host.block_manager import BlockManager
from paged_jax.host.scheduler import Scheduler, SchedulerConfig, StepPlan
from paged_jax.host.sequence import (CompletionOutput, FinishReason, RequestOutput, Sequence,
                                     SequenceGroup)
from paged_jax.sampling import SamplingParams
from paged_jax.state import NULL_PAGE, AttentionMetadata, KVPool

WARMUP_SCOPES = ("one_user", "one_prompt", "all")   # `Engine.warmup_programs`, narrowest first
DECODE_CONTEXT = 5   # prompt tokens a completion's text is decoded after (vLLM's offset: 5)
LINKS_AHEAD = 1   # default `links_ahead`: a stoppable round's links queued beyond the one running


class StepFunctions(NamedTuple):
  """The device steps the engine calls; tests swap in fakes (no model) with the same signature."""
  sample_step: object = step.sample_step
  multi_step_decode: object = step.multi_step_decode
  decode_link: object = step.decode_link


def slow_narrow_kv_writes(dtype) -> bool:
  """Whether this JAX's CPU backend scatters a 2-byte KV pool by converting it (jaxlib < 0.11:
  `.at[].set` on bf16 runs in f32 over the whole operand; measured: 30 layers' decode writes 958
  ms on 0.10.2, 0.06 ms on 0.11.2 and 0.12.0)."""
  version = tuple(int(p) for p in jax.__version__.split(".")[:2])
  return (jnp.dtype(dtype).itemsize == 2 and version < (0, 11)
          and jax.default_backend() == "cpu")


@dataclasses.dataclass
class EngineStats:
  """Counters and wall-clock split since the engine started.

  Times: `prefill_s` / `decode_s` run from launching a step (with / without prefill chunks) to
  its tokens on the host; `host_s` is everything else in `step()` (scheduling, block manager,
  batching, swaps and copies dispatch, output building), `decode_host_s` the part of it spent
  in decode-only steps.
  """
  steps: int = 0
  prefill_steps: int = 0
  decode_rounds: int = 0
  decode_steps: int = 0
  prefill_tokens: int = 0
  decode_tokens: int = 0
  preemptions: int = 0
  swapped_out_pages: int = 0
  swapped_in_pages: int = 0
  recomputed_tokens: int = 0
  cached_prompt_tokens: int = 0
  cow_copies: int = 0
  copy_batches: int = 0
  max_pages_in_use: int = 0
  failed_steps: int = 0         # steps that raised (the requests in them were requeued)
  failed_requests: int = 0      # requests finished with reason "error"
  scrubbed_pages: int = 0
  evicted_programs: int = 0     # compiled programs dropped to stay under the map limit
  programs_on_demand: int = 0   # step programs compiled or loaded while a step waited for them
  programs_on_demand_s: float = 0.0   # seconds steps waited for them (with a program store)
  rounds_stopped: int = 0       # stoppable rounds that ended early (`step(interrupt=...)`)
  validate_s: float = 0.0       # host time in `batching.validate_step` (part of host_s)
  prefill_s: float = 0.0
  decode_s: float = 0.0
  host_s: float = 0.0
  decode_host_s: float = 0.0


class EngineLoop:
  """`stream()` and `generate()` for an engine with has_unfinished / step / validate_request /
  add_request (`Engine`, `data_parallel.DataParallelEngine`)."""

  def stream(self) -> Iterator[RequestOutput]:
    """Steps until every request has finished, yielding each output (a delta stream)."""
    while self.has_unfinished():
      yield from self.step()

  def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
               = SamplingParams()) -> list[RequestOutput]:
    """Runs prompts to completion (with whatever else is queued); final outputs in prompt order."""
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts):
      raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
    for i, (p, sp) in enumerate(zip(prompts, params)):
      try:
        self.validate_request(p, sp)
      except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None
    ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    for out in self.stream():
      if out.finished:
        final[out.request_id] = out
    return [final[i] for i in ids]


class Engine(EngineLoop):
  """Continuous batching over a paged KV pool.

  Args:
    params, cfg: the model.
    cache: page size and pool size (or a memory budget to carve it from).
    scheduler: batching and preemption policy.
    impl: attention path ("auto", "xla", "pallas", "cpu", or "interpret": the kernel in Pallas'
      interpreter, for tests); `attention.paged_attention` says what each runs. "auto" on a CPU
      decodes through the C++ CPU kernel where it builds (`cpu_kernel`), and "cpu" requires it.
    seed: draws the seed of every request that brings none.
    tokenizer: a `tokenizers.Tokenizer`; outputs then carry text.
    eos_token_ids: the model's end-of-sequence ids (one or several).
    steps: the device steps (tests pass fakes).
    validate_tables: check every step's arrays against the block manager before they reach the
      device (`batching.validate_step`); None = on when the environment variable
      PAGED_JAX_VALIDATE_TABLES is "1" (the test suite sets it).
    scrub_freed_pages: zero every page when it leaves its owners (freed, or evicted from the
      prefix cache), before the next step's writes.
    max_step_retries: a request whose step fails alone this many times finishes with reason
      "error" (see `step()`).
    mesh: a jax.sharding.Mesh with axes ("data", "model") and data size 1: tensor parallel over
      the "model" devices (`paged_jax.sharding`: params split Megatron-style, the pool split on
      its KV heads, the host side unchanged). None: one device. Several data replicas:
      `paged_jax.data_parallel.DataParallelEngine`.
    scan_layers: run the layers as a `lax.scan` over stacked layer params
      (`model.stack_layers`): every step compiles one layer body per group of layers, not one
      per layer (compile time stops growing with depth). Off: the layers are unrolled, which
      reads each weight in place (a scan slices each layer's weights out of the stack, a copy
      on XLA:CPU; `experiments.layer_loop_bench`). Not yet with a mesh. Params already in
      that layout (`load_checkpoint(..., stacked=True)`) are taken as they are; they need
      scan_layers=True.
    stoppable_rounds: run each k-step decode round as k chained dispatches of one step
      (`step.decode_link`, one kept queued ahead) instead of one k-step scan, so that
      `step(interrupt=...)` can end a round between two steps: a request that arrives
      mid-round then waits for ~1-2 steps, not k (the server passes "a command is queued").
      The same tokens either way; one sync per round still.
    links_ahead: with stoppable_rounds, links dispatched beyond the one running (`_chain`).
      1 (LINKS_AHEAD) hides each link's dispatch behind the one running, and a request that
      arrives waits for that link and the one queued; 0 makes it wait for the running link
      only, and the device idles while the host dispatches each link.
    program_store: a directory of compiled step programs (`paged_jax.program_store`): a
      program the engine needs is loaded from it (no trace, no compile) or compiled and kept
      there, so a restarted engine loads each program (~0.1-0.2 s for SmolLM2's scanned
      layers) instead of tracing and compiling it. None: off (each program is traced and
      compiled by jit on first use). Not with a mesh.
    fuse_projections: run each layer's q / k / v products as one and gate / up as one
      (`model.fuse_projections`: 4 products a layer instead of 7; the weights are joined once
      here). Same model; logits within 1e-5 (~6e-6 seen: XLA may sum the longer products in
      another order). Not with a mesh (the heads' shards would cut across the joined columns).
      Off by default: no measured gain in the engine here (results page).
    compiler_options: XLA options for the step programs this engine compiles (jax's
      `Lowered.compile(compiler_options)`, e.g. {"xla_cpu_use_onednn": True}); they override
      XLA_FLAGS for these programs only (the test suite's fast-compile flags, for one), and
      are part of the program store's identity. None: XLA_FLAGS as they are.
  """

  def __init__(self, params, cfg: ModelConfig, *, cache: CacheConfig = CacheConfig(),
               scheduler: SchedulerConfig = SchedulerConfig(), impl: str = "auto", seed: int = 0,
               tokenizer=None, eos_token_ids: Iterable[int] = (),
               steps: StepFunctions = StepFunctions(), validate_tables: bool | None = None,
               scrub_freed_pages: bool = False, max_step_retries: int = 2, mesh=None,
               scan_layers: bool = False, stoppable_rounds: bool = False,
               links_ahead: int = LINKS_AHEAD, program_store: str | None = None,
               fuse_projections: bool = False, compiler_options: dict | None = None):
    if max_step_retries < 1:
      raise ValueError(f"max_step_retries={max_step_retries} must be >= 1")
    if isinstance(links_ahead, bool) or not isinstance(links_ahead, int) or links_ahead < 0:
      raise ValueError(f"links_ahead={links_ahead!r} must be an int >= 0")
    if program_store and mesh is not None:
      raise ValueError("program_store with a mesh is not supported (sharded executables are "
                       "not stored): leave program_store=None on a mesh")
    stacked = params is not None and model.is_stacked(params)
    if stacked and not scan_layers:
      raise ValueError("params are in model.stack_layers' layout: pass scan_layers=True (or "
                       "per-layer params)")
    if fuse_projections and mesh is not None:
      raise ValueError("fuse_projections=True with a mesh is not supported (tensor parallelism "
                       "splits q / k / v by heads): leave it off on a mesh")
    if scan_layers and mesh is not None:
      raise ValueError("scan_layers=True with a mesh is not supported yet (the stacked params' "
                       "shardings): run the layers unrolled (scan_layers=False) on a mesh")
    if mesh is not None and sharding.axis_size(mesh, sharding.DATA) != 1:
      raise ValueError(f"mesh {dict(mesh.shape)} has {sharding.axis_size(mesh, sharding.DATA)} "
                       f"data replicas; one Engine runs one (use "
                       f"paged_jax.data_parallel.DataParallelEngine)")
    self.mesh = mesh
    self.model_parallel = sharding.axis_size(mesh, sharding.MODEL)
    if mesh is not None:
      params = sharding.shard_params(params, cfg, mesh)   # checks the heads divide
    else:   # host (NumPy) params would be copied to the device by every step
      params = jax.device_put(params)
    if fuse_projections and params is not None and not model.is_fused(params):
      params = model.fuse_projections(params)
    if scan_layers and params is not None and not stacked:
      params = model.stack_layers(params, cfg)
    self.params, self.cfg, self.impl = params, cfg, impl
    self.validate_tables = (os.environ.get("PAGED_JAX_VALIDATE_TABLES") == "1"
                            if validate_tables is None else bool(validate_tables))
    self.scrub_freed_pages = scrub_freed_pages
    self.max_step_retries = max_step_retries
    self.tokenizer = tokenizer
    self.eos_token_ids = frozenset(_token_ids(eos_token_ids, cfg.vocab_size, "eos_token_ids"))
    self.steps = steps
    self.stoppable_rounds = bool(stoppable_rounds)
    self.links_ahead = links_ahead
    device = (jax.devices()[0] if mesh is None else   # this process's first device of the mesh
              next(d for d in mesh.devices.flat if d.process_index == jax.process_index()))
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    self.num_pages = cache.resolve_num_pages(cfg, stats, self.model_parallel)
    self.page_size = cache.page_size
    self.kv_format = cache.kv_format
    self.bm = BlockManager(self.num_pages, cache.page_size,
                           enable_prefix_caching=cache.enable_prefix_caching,
                           track_released=scrub_freed_pages)
    self._seq_ids = itertools.count()
    self.scheduler = Scheduler(self.bm, scheduler, lambda: next(self._seq_ids),
                               max_len=cfg.max_position)
    self.capacity_tokens = (self.num_pages - 1) * cache.page_size
    self.max_pages_per_seq = -(-cfg.max_position // cache.page_size)
    # The XLA path gets one block-table width (the model's whole context): its attention work
    # follows seq_lens; the Pallas kernel splits keys by the width, so it keeps the buckets.
    uses_kernel = impl in ("pallas", "interpret") or (
        impl == "auto" and attention.kernel_unavailable_reason(cfg.head_dim, cache.page_size)
        is None)
    self.fixed_width = not uses_kernel
    if impl not in attention.IMPLS:
      raise ValueError(f"impl={impl!r} is not one of {attention.IMPLS}")
    # The C++ CPU kernel is built and registered now (not at the first trace), so executables
    # loaded from a program store find their custom call, and impl="cpu" fails here if it can't.
    self.cpu_kernel_reason = ("not asked for" if impl not in ("cpu", "auto") or uses_kernel
                              else cpu_kernel.unavailable_reason(device))
    if impl == "cpu" and self.cpu_kernel_reason:
      raise ValueError(f"impl='cpu' cannot run here: {self.cpu_kernel_reason}")
    if cfg.matmul != "xla":   # a library: registered now for the same reason; refused where
      why = (f"tensor parallelism (mesh=): the {cfg.matmul} call has no sharding rule"   # it can't
             if self.model_parallel > 1 else matmul.unavailable_reason(cfg.matmul, device))
      if why:
        raise ValueError(f"matmul={cfg.matmul!r} cannot run here: {why}")
      logging.info("matmuls: %s (paged_jax.matmul.%s_dot_general)", cfg.matmul, cfg.matmul)
      if cfg.matmul == "onednn" and params is not None and not model.is_packed(params):
        params = self.params = model.pack_for_onednn(params, cfg)   # model.Dense runs them
      if cfg.matmul == "mkl" and (slow := matmul.mkl_slow_reason()):
        logging.warning("matmul='mkl': %s", slow)
    why = kv_quant.unsupported_reason(self.kv_format, uses_kernel=uses_kernel, device=device)
    if why:   # refused by name, never upcast behind the caller's back
      raise ValueError(f"the KV pool format cannot run here: {why}")
    self.pool = self._new_pool()
    # Prefill chunks on the C++ CPU kernel, which ignores max_q_len: a step's max_q_len then
    # follows its token bucket, and a step of two to four prompts runs the program one prompt of
    # its bucket runs (`batching.ProgramLimits.q_from_tokens`), so `--warmup=one_prompt` covers
    # it. On the other paths max_q_len pads work, so it follows the longest chunk.
    self.q_from_tokens = bool(
        impl in ("cpu", "auto") and not uses_kernel and not self.cpu_kernel_reason
        and not self.kv_format and attention.PREFILL_ON_CPU_KERNEL
        and attention.cpu_kernel_applies(
            jax.ShapeDtypeStruct((1, cfg.num_q_heads, cfg.head_dim), jnp.dtype(cfg.dtype)),
            jax.ShapeDtypeStruct(self.pool.k.shape[1:], self.pool.k.dtype), impl))
    self.programs: collections.Counter[batching.ProgramKey] = collections.Counter()  # -> calls
    self._compiled: dict[batching.ProgramKey, object] = {}   # warmed up, or loaded
    self._warmed: set[batching.ProgramKey] = set()           # what `warmup` provided
    self._jit_held: set[batching.ProgramKey] = set()   # compiled by jit's own cache (no store)
    self._new_programs = False   # a program was compiled since the last `_bound_maps`
    self._program_origin = collections.Counter()             # "compiled" / "loaded" programs
    self._store = program_store_lib.ProgramStore(program_store) if program_store else None
    self._identity = None   # program_store.engine_identity, computed on first use
    self.compiler_options = dict(compiler_options) if compiler_options else None
    self.stats = EngineStats()
    self._rng = np.random.default_rng(seed)
    self._swap: dict[str, tuple[np.ndarray, ...]] = {}   # request id -> host page arrays
    self._requests: dict[str, SequenceGroup] = {}
    self._finished_outputs: list[RequestOutput] = []
    self._ids = itertools.count()
    self._stage = "run"
    logging.info("KV pool: %d pages x %d tokens = %d tokens (%.1f MiB per device, %d devices, "
                 "%s)", self.num_pages - 1, cache.page_size, self.capacity_tokens,
                 self.num_pages * cache.bytes_per_page(cfg, self.model_parallel) / 2 ** 20,
                 self.model_parallel, self.kv_format or cfg.dtype)
    if impl in ("cpu", "auto") and not uses_kernel:
      logging.info("decode attention: %s", "the C++ CPU kernel" if not self.cpu_kernel_reason
                   else f"the XLA path (CPU kernel: {self.cpu_kernel_reason})")
    if slow_narrow_kv_writes(cfg.dtype):
      logging.warning(
          "dtype=%s on jax %s's CPU backend: each KV write converts the whole layer of pages to "
          "f32 and back (a decode step of SmolLM2-135M: ~20 ms of ~90). jax >= 0.11 (Python "
          "3.12) writes them in place.", cfg.dtype, jax.__version__)

  def _new_pool(self) -> KVPool:
    cfg = self.cfg
    kw = dict(num_layers=cfg.num_layers, num_pages=self.num_pages, page_size=self.page_size,
              num_kv_heads=cfg.stored_kv_heads(self.model_parallel), head_dim=cfg.head_dim,
              dtype=cfg.dtype, kv_format=self.kv_format)
    return KVPool.create(**kw) if self.mesh is None else sharding.new_pool(self.mesh, **kw)

  # ------------------------------------------------------------------------------ requests

  def validate_request(self, prompt: Seq[int], params: SamplingParams) -> None:
    """Raises ValueError, naming the value, for a request that can never run."""
    cfg, sc = self.cfg, self.scheduler.config
    if not isinstance(params, SamplingParams):
      raise ValueError(f"params={params!r} is not a SamplingParams")
    if isinstance(prompt, (str, bytes)):
      raise ValueError(f"the prompt is text ({prompt[:20]!r}); pass token ids (tokenize it)")
    try:
      prompt = list(prompt)
    except TypeError:
      raise ValueError(f"the prompt {prompt!r} is not a sequence of token ids") from None
    if not prompt:
      raise ValueError("the prompt is empty")
    _token_ids(prompt, cfg.vocab_size, "the prompt")
    _token_ids(params.stop_token_ids, cfg.vocab_size, "stop_token_ids")
    if len(prompt) + params.max_tokens > cfg.max_position:
      raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} exceeds "
                       f"the model's max_position={cfg.max_position}")
    width = params.beam_width if params.use_beam_search else params.n
    if width > sc.max_num_seqs:
      raise ValueError(f"{'beam_width' if params.use_beam_search else 'n'}={width} exceeds "
                       f"max_num_seqs={sc.max_num_seqs}")
    top_n = max(params.logprobs, 2 * params.beam_width if params.use_beam_search else 0)
    if top_n > cfg.vocab_size:
      raise ValueError(f"logprobs={params.logprobs} / beam_width={params.beam_width} asks for "
                       f"{top_n} tokens per step; the vocabulary has {cfg.vocab_size}")
    need = self.pages_at_most(len(prompt), params)
    if need > self.num_pages - 1:
      raise ValueError(f"the request needs up to {need} pages (prompt {len(prompt)} + "
                       f"max_tokens {params.max_tokens}, {width} sequence(s), page_size "
                       f"{self.page_size}); the pool has {self.num_pages - 1}: it can never fit")
    reserved = self.scheduler.reserved
    if reserved is not None:
      size = reserved.extent_size(min(len(prompt) + params.max_tokens, reserved.max_len), width)
      if size > reserved.capacity_tokens:
        raise ValueError(f"the request reserves {size} slots under reservation="
                         f"{reserved.policy!r}; reservation_tokens is "
                         f"{reserved.capacity_tokens}: it can never fit")

  def pages_at_most(self, prompt_len: int, params: SamplingParams) -> int:
    """Pages a request can hold at once: every sequence's K/V up to its last useful position,
    the prompt's full pages shared by its samples or beams."""
    per_seq = pages_needed(prompt_len + params.max_tokens - 1, self.page_size)
    shared = prompt_len // self.page_size
    width = params.beam_width if params.use_beam_search else params.n
    return per_seq + (width - 1) * (per_seq - shared)

  def add_request(self, prompt: Seq[int], params: SamplingParams = SamplingParams(), *,
                  request_id: str | None = None, arrival_time: float | None = None,
                  cache_salt: str | None = None) -> str:
    """Queues a request; returns its id. Raises ValueError (and queues nothing) if it can never
    run: bad token ids, longer than max_position, more pages than the whole pool.

    cache_salt: the request's prefix-cache namespace (e.g. one per user or tenant): requests
    with different salts never share a page, so none can tell from its own cache hits (or its
    timing) what another one's prompt was.
    """
    request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
    if request_id in self._requests:
      raise ValueError(f"request_id={request_id!r} is already in use")
    if cache_salt is not None and not isinstance(cache_salt, str):
      raise ValueError(f"cache_salt={cache_salt!r} must be a str or None")
    self.validate_request(prompt, params)
    seed = params.seed if params.seed is not None else int(self._rng.integers(2 ** 32))
    seq = Sequence(next(self._seq_ids), [int(t) for t in prompt], len(prompt))
    group = SequenceGroup(request_id, tuple(seq.tokens), params, [seq], seed,
                          eos_token_ids=self.eos_token_ids, cache_salt=cache_salt,
                          arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
    self._requests[request_id] = group
    self.scheduler.add(group)
    return request_id

  def abort(self, request_id: str) -> bool:
    """Stops a request and frees its pages; the next `step()` reports it finished ("abort").
    Returns False if it is unknown or already finished."""
    group = self.scheduler.abort(request_id)
    if group is None:
      return False
    self._swap.pop(request_id, None)
    group.finish_time = time.perf_counter()
    self._finished_outputs.append(self._output(group))
    del self._requests[request_id]
    return True

  def has_unfinished(self) -> bool:
    return self.scheduler.has_unfinished() or bool(self._finished_outputs)

  def pages_of(self, request_id: str) -> frozenset[int]:
    """Pages the request's live sequences reference now (none while waiting or swapped)."""
    g = self._requests.get(request_id)
    if g is None:
      return frozenset()
    return frozenset(p for s in g.seqs if s.seq_id in self.bm for p in self.bm.block_table(s.seq_id))

  def pool_map(self) -> dict[str, np.ndarray]:
    """The pool's state page by page, for pictures (experiments/pool_map.py).

    Returns:
      owner: i64[num_pages] admission rank (SequenceGroup.order) of the oldest request that
        references the page, -1 if none; refcount: i32[num_pages]; shared: bool[num_pages] referenced by
        more than one sequence; cached_idle / free: bool[num_pages]. NULL_PAGE is none of them.
    """
    n = self.num_pages
    owner = np.full(n, -1, np.int64)
    refcount = np.zeros(n, np.int32)
    cached_idle = np.zeros(n, bool)
    seq_request = {s.seq_id: g.order for g in self.scheduler.groups() for s in g.seqs
                   if g.order is not None}
    for page, seqs in self.bm.page_owners().items():
      owner[page] = min(seq_request.get(s, -1) for s in seqs)
      refcount[page] = len(seqs)
    for page in self.bm.cached_idle_pages():
      cached_idle[page] = True
    free = (refcount == 0) & ~cached_idle
    free[NULL_PAGE] = False
    return dict(owner=owner, refcount=refcount, shared=refcount > 1, cached_idle=cached_idle,
                free=free)

  # ------------------------------------------------------------------------------ the loop

  def step(self, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
    """Runs one scheduled step. Returns an output for every request that got tokens or finished
    (beam search requests report once, when they finish).

    interrupt: with `stoppable_rounds`, asked before each step of a decode round after its
    first; True ends the round there (the steps already dispatched run and are applied; the
    slots reserved for the rest stay with their sequences). Ignored otherwise.

    Faults: if the device work of a step raises, no token of it is applied. If the model step
    itself failed and the pool is intact, the host state is still consistent (the next plan
    recomputes the same positions), so the requests stay as they are. If swaps or copies failed
    (pages may hold garbage) or the failure consumed the pool (it is rebuilt), the requests
    involved (all, when the pool is lost) are requeued holding no pages, their tokens kept, to
    be recomputed. Either way each request of the failed step becomes a suspect: suspects run
    alone, oldest first, until a step of their own succeeds; one whose steps fail alone
    `max_step_retries` times in a row finishes with reason "error" and the exception's
    message. The others go on.
    """
    t0 = time.perf_counter()
    outputs, self._finished_outputs = self._finished_outputs, []
    plan = self.scheduler.schedule()
    for r in plan.rows:
      if r.group.first_scheduled_time is None:
        r.group.first_scheduled_time = t0
    if not plan:
      if self.scheduler.has_unfinished():
        raise RuntimeError("no request can run although some are unfinished; this is a bug "
                           "(add_request rejects what can never fit)")
      self.stats.host_s += time.perf_counter() - t0
      return outputs
    device_s = 0.0
    out = None
    self._stage = "apply"
    try:
      self._apply_swaps_and_copies(plan)
      self._stage = "run"
      if plan.rows:
        out, device_s = self._run(plan, interrupt)
    except batching.TableValidationError:
      raise   # a bookkeeping bug: never papered over
    except Exception as e:   # noqa: BLE001 - any failure of the device work is recoverable
      outputs += self._recover(plan, e)
      self.stats.host_s += time.perf_counter() - t0
      return outputs
    alone = {id(r.group): r.group for r in plan.rows}
    if len(alone) == 1:   # a suspect that ran a step of its own is cleared
      g = next(iter(alone.values()))
      g.suspect, g.failures = False, 0
    now = time.perf_counter()
    groups = self.scheduler.update(plan, out) if out is not None else []
    for g in groups:
      if g.first_token_time is None:
        g.first_token_time = now
      if g.is_finished:
        g.finish_time = now
        del self._requests[g.request_id]
      if g.is_finished or not g.params.use_beam_search:
        outputs.append(self._output(g))
    self._count(plan, device_s, time.perf_counter() - t0 - device_s)
    return outputs

  # ------------------------------------------------------------------------------ faults

  def _recover(self, plan: StepPlan, error: Exception) -> list[RequestOutput]:
    """Undoes a failed step: requeues its requests (see `step`); returns those that failed."""
    self.stats.failed_steps += 1
    message = f"{type(error).__name__}: {error}"
    logging.warning("step failed (%s); its requests run alone until they succeed", message)
    affected = {id(r.group): r.group for r in plan.rows}
    pool_lost = any(x.is_deleted() for x in jax.tree_util.tree_leaves(self.pool))
    requeue = {}
    if self._stage == "apply":   # swaps or copies may be half done: recompute who they touch
      requeue = dict(affected)
      for request_id, _ in plan.swap_out + plan.swap_in:
        if request_id not in self._swap:   # its host copy was never made, or was consumed
          g = self.scheduler.find(request_id)
          if g is not None:
            requeue[id(g)] = g
    if pool_lost:   # a donated pool died with the step: every page's contents are gone
      requeue.update({id(g): g for g in self.scheduler.running})
    alone = len(affected) == 1
    failed = []
    for key, g in {**affected, **requeue}.items():
      if key in affected:
        g.suspect = True
        if alone:
          g.failures += 1
          g.error = message
      if key in requeue and g.failures < self.max_step_retries:
        self._swap.pop(g.request_id, None)
        if self.scheduler.requeue(g):
          continue
        g.error = (f"{message}; its {len(g.seqs)} sequences cannot be recomputed: they would "
                   f"need more pages unshared than the pool's {self.num_pages - 1}")
        g.failures = self.max_step_retries
      if g.failures >= self.max_step_retries:
        self._swap.pop(g.request_id, None)
        self.scheduler.abort(g.request_id, FinishReason.ERROR)
        g.finish_time = time.perf_counter()
        del self._requests[g.request_id]
        failed.append(self._output(g))
        self.stats.failed_requests += 1
    if pool_lost:
      self.pool = self._new_pool()
      self.bm.reset_prefix_cache()   # cached-idle pages lost their contents too
      self.bm.drain_released()
    return failed

  # ------------------------------------------------------------------------------ device work

  def _apply_swaps_and_copies(self, plan: StepPlan) -> None:
    # Order matters: read swapped-out pages before anything reuses them, scrub released pages,
    # restore swapped-in pages, then copy (a copy may read a restored page), then the step
    # writes.
    for request_id, pages in plan.swap_out:
      self._swap[request_id] = page_ops.read_pages(self.pool, pages)
    if self.scrub_freed_pages:
      released = self.bm.drain_released()
      if released:
        pages = np.full(batching.next_pow2(len(released)), NULL_PAGE, np.int32)
        pages[:len(released)] = released
        self.pool = page_ops.zero_pages(self.pool, jnp.asarray(pages))
        self.stats.scrubbed_pages += len(released)
    for request_id, pages in plan.swap_in:
      self.pool = page_ops.write_pages(self.pool, pages, *self._swap.pop(request_id))
    for pairs in batching.copy_batches(plan.copies):
      src, dst = batching.pad_copy_pairs(pairs)
      page_ops.check_copy_batch(src, dst)
      self.pool = page_ops.copy_pages(self.pool, jnp.asarray(src), jnp.asarray(dst))
      self.stats.copy_batches += 1

  def _run(self, plan: StepPlan, interrupt=None) -> tuple[dict, float]:
    """Builds the arrays, runs the step, brings the samples back: (host arrays, device seconds).
    A stoppable round that `interrupt` ends early leaves plan.num_steps at the steps that ran."""
    top_n = max((2 * r.group.params.beam_width if r.group.params.use_beam_search
                 else r.group.params.logprobs) for r in plan.rows)
    num_logprobs = batching.next_pow2(top_n) if top_n else 0
    if plan.num_steps > 1:
      a = batching.build_decode_round(plan, self.bm, self.max_pages_per_seq, self.fixed_width)
    else:
      a = batching.build_step(plan, self.bm, self.max_pages_per_seq, self.fixed_width,
                              self.q_from_tokens)
    self._validate(plan, a)
    key = batching.program_key(a, plan.num_steps, num_logprobs, self.stoppable_rounds)
    self.programs[key] += 1
    fn, inputs, kw = self._call(a, key)
    args = (self.params, self.pool) + inputs
    compiled = self._compiled.pop(key, None)   # warmed up: no trace, no cache lookup
    if compiled is not None:
      self._compiled[key] = compiled   # the most recently used last (`_bound_maps`)
    elif self._store is not None or self.compiler_options:   # load it, or compile and keep it
      t = time.perf_counter()
      with self._mesh_context():
        compiled, loaded = self._program(key, fn, args, kw)
      waited = time.perf_counter() - t
      self._new_programs = True
      self.stats.programs_on_demand += 1
      self.stats.programs_on_demand_s += waited
      logging.info("step program %s %s on demand in %.2f s", tuple(key),
                   "loaded" if loaded else "compiled", waited)
    elif key not in self._jit_held:   # jit compiles it below (again, after `_bound_maps`)
      self._jit_held.add(key)
      self._new_programs = True
      self.stats.programs_on_demand += 1
    t = time.perf_counter()
    run = functools.partial(fn, **kw) if compiled is None else compiled
    with self._mesh_context():
      if key.kind == "link":
        sampled = self._chain(run, args, plan, interrupt)
      else:
        sampled, self.pool = run(*args)
    out = jax.device_get(sampled)   # the one sync of the step
    device_s = time.perf_counter() - t
    if key.kind == "link":   # [steps run][1, S] -> [steps run, S]
      out = jax.tree_util.tree_map(lambda *x: np.concatenate(x), *out)
    if self._new_programs:
      self._bound_maps(keep=key)
    host = {f.name: np.asarray(getattr(out, f.name)) for f in dataclasses.fields(out)}
    if key.kind == "step":   # [S] -> [1, S]: one layout for every kind of step
      host = {k: v[None] for k, v in host.items()}
    return host, device_s

  def _chain(self, run, args, plan: StepPlan, interrupt) -> list:
    """Dispatches a round's links one after another, each on the last one's outputs, keeping
    `links_ahead` queued beyond the one running: link s is dispatched once link s - 1 -
    links_ahead is done (and `interrupt()` is False). Returns the links' samples (on the
    device); self.pool is the last link's pool."""
    params, pool, state, sampling = args
    outs = []
    for s in range(plan.num_steps):
      if s:
        if s - 1 - self.links_ahead >= 0:
          outs[s - 1 - self.links_ahead].tokens.block_until_ready()
        if interrupt is not None and interrupt():
          break
      out, pool, state, sampling = run(params, pool, state, sampling)
      outs.append(out)
    self.pool = pool
    if len(outs) < plan.num_steps:
      plan.num_steps = len(outs)
      self.stats.rounds_stopped += 1
    return outs

  def _call(self, a: dict, key: batching.ProgramKey):
    """(device step, its array inputs on the device, its static options) for step arrays `a`.
    One sampling variant serves greedy and sampled rows (`sampling.sample`'s lax.cond): two
    programs per shape would not pay for themselves."""
    kw = dict(cfg=self.cfg, impl=self.impl, greedy_only=False, num_logprobs=key.num_logprobs)
    if key.kind in ("round", "link"):
      state = step.DecodeState(a["tokens"], a["positions"], a["block_tables"], a["write_limit"])
      inputs = jax.device_put((state, a["sampling"]))   # one transfer for every array
      if key.kind == "link":
        return self.steps.decode_link, inputs, kw
      return self.steps.multi_step_decode, inputs, dict(kw, num_steps=key.num_steps)
    md = AttentionMetadata(a["block_tables"], a["seq_lens"], a["cu_q_lens"], a["slots"],
                           max_q_len=a["max_q_len"], num_decode=a["num_decode"])
    batch = step.Batch(a["tokens"], a["positions"], md, a["logits_indices"])
    return self.steps.sample_step, jax.device_put((batch, a["sampling"])), kw

  @property
  def program_limits(self) -> batching.ProgramLimits:
    """What bounds this engine's step shapes (`batching.reachable_programs`)."""
    sc = self.scheduler.config
    return batching.ProgramLimits(sc.max_num_seqs, sc.max_num_batched_tokens,
                                  self.cfg.max_position, self.page_size, sc.steps_per_sync,
                                  self.fixed_width, sc.max_prefill_rows,
                                  self.stoppable_rounds, self.q_from_tokens)

  def warmup_programs(self, scope: str = "one_user") -> list[batching.ProgramKey]:
    """The programs `warmup(scope)` compiles (n=1, no beams or logprobs). "one_user":
    everything one user's requests run (`reachable_programs` at max_num_seqs=1) and every
    decode program for any number of rows (rounds and one-step decodes); "one_prompt": those,
    and every step that prefills one prompt's chunk beside any number of decode rows (a server
    under a light load: requests arrive one at a time and join the running ones;
    `reachable_programs(max_prompts=1)`); "all": every program the limits can hit
    (`reachable_programs`; thousands at the default limits, from the mixed steps of several
    prompts at once)."""
    if scope not in WARMUP_SCOPES:
      raise ValueError(f"scope={scope!r} is not one of {WARMUP_SCOPES}")
    limits = self.program_limits
    if scope == "one_prompt":
      return batching.reachable_programs(limits, max_prompts=1)
    every = batching.reachable_programs(limits)
    if scope == "all":
      return every
    keys = batching.reachable_programs(dataclasses.replace(limits, max_num_seqs=1))
    keys += [k for k in every if k.num_prefill_rows == 0 and k not in keys]
    return keys

  def warmup(self, scope: str = "one_user", *, progress: bool = False) -> dict:
    """Compiles the programs of `warmup_programs(scope)` that this process does not hold yet,
    so that no request pays for them; with a program store they are loaded from it where it
    has them (no trace, no compile) and stored where it does not. Largest steps first (tokens
    per step), so that where the map limit drops some, the small ones stay. Returns {"programs",
    "compiled", "loaded", "seconds"}."""
    from tqdm import tqdm
    keys = self.warmup_programs(scope)
    t0 = time.perf_counter()
    self._warmed.update(k for k in keys if k in self._compiled)
    # `_bound_maps` keeps the most recently compiled; small steps are what a server meets most
    # (in `reachable_programs`' order a SmolLM2 server lost them and loaded 5-8 per rate later).
    todo = sorted((k for k in keys if k not in self._compiled),
                  key=lambda k: -(k.num_decode + k.num_prefill_tokens))
    loaded = 0
    with self._mesh_context():
      for key in tqdm(todo, disable=not progress, unit="program", desc="warmup"):
        fn, inputs, kw = self._call(batching.placeholder_arrays(key), key)
        loaded += self._program(key, fn, (self.params, self.pool) + inputs, kw)[1]
        self._warmed.add(key)
        self._bound_maps(keep=key)
    return {"programs": len(keys), "compiled": len(todo) - loaded, "loaded": loaded,
            "seconds": time.perf_counter() - t0}

  def _program(self, key: batching.ProgramKey, fn, args, kw) -> tuple[object, bool]:
    """(the compiled program of `key`, whether it came from the program store): from the
    store if it has it, else lowered and compiled (and stored)."""
    path = None
    if self._store is not None:
      if self._identity is None:
        self._identity = program_store_lib.engine_identity(self.cfg, self.impl, self.params,
                                                           self.pool, self.compiler_options)
      path = self._store.path(self._identity, key)
      compiled = self._store.load(path)
      if compiled is not None:
        self._compiled[key] = compiled
        self._program_origin["loaded"] += 1
        return compiled, True
    hits = program_store_lib.cache_hits()
    compiled = fn.lower(*args, **kw).compile(self.compiler_options)
    self._program_origin["compiled"] += 1
    if path is not None:
      if program_store_lib.cache_hits() == hits:
        self._store.save(path, compiled)
      else:   # from JAX's persistent cache: it would not load back (program_store._hits)
        logging.info("program store: %s came from JAX's compilation cache; not stored", key)
    self._compiled[key] = compiled
    return compiled, False

  def _bound_maps(self, keep: batching.ProgramKey | None = None) -> int:
    """Keeps this process under its memory-map limit (`program_store.map_limit`; every compiled
    kernel holds its own maps, and past the limit the next compile crashes the process): above
    MAPS_HIGH of it, drops the least recently used half of the programs this engine holds
    (never `keep`, the one just run) and JAX's own caches of compiled programs
    (`jax.clear_caches`: jit's programs go too), until below MAPS_LOW. A dropped program is
    loaded from the program store, or compiled again, when a step meets it. Returns how many
    were dropped."""
    self._new_programs = False
    limit, held = program_store_lib.map_limit(), program_store_lib.mapped_regions()
    if limit is None or held is None or held <= program_store_lib.MAPS_HIGH * limit:
      return 0
    dropped, before = 0, held
    while held > program_store_lib.MAPS_LOW * limit:
      old = [k for k in self._compiled if k != keep]
      for k in old[:max(1, len(old) // 2)]:
        del self._compiled[k]
        dropped += 1
      self._jit_held.clear()
      jax.clear_caches()
      gc.collect()
      held = program_store_lib.mapped_regions()
      if not old:
        break
    self.stats.evicted_programs += dropped
    logging.warning("this process held %d memory maps of the %d it may (vm.max_map_count): "
                    "dropped %d compiled programs and JAX's caches, now %d maps; a dropped "
                    "program loads from the program store or compiles again when met",
                    before, limit, dropped, held)
    return dropped

  def _mesh_context(self):
    """The ambient mesh the model step reads (`sharding.over_kv_heads`); nothing without one."""
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _validate(self, plan: StepPlan, arrays: dict) -> None:
    if self.validate_tables:
      t = time.perf_counter()
      batching.validate_step(plan, arrays, self.bm)
      self.stats.validate_s += time.perf_counter() - t

  def _count(self, plan: StepPlan, device_s: float, host_s: float) -> None:
    s, ss = self.stats, self.scheduler.stats
    s.steps += 1
    s.host_s += host_s
    prefill = plan.prefill_rows
    if prefill:
      s.prefill_steps += 1
      s.prefill_tokens += sum(r.stop - r.start for r in prefill)
      s.prefill_s += device_s
    elif plan.rows:
      s.decode_rounds += 1
      s.decode_s += device_s
      s.decode_host_s += host_s
    s.decode_steps += plan.num_steps if plan.rows and not prefill else 0
    s.decode_tokens += len(plan.decode_rows) * plan.num_steps
    for name in ("preemptions", "swapped_out_pages", "swapped_in_pages", "recomputed_tokens",
                 "cached_prompt_tokens", "cow_copies"):
      setattr(s, name, getattr(ss, name))
    s.max_pages_in_use = max(s.max_pages_in_use, self.num_pages - 1 - self.bm.num_free_pages)

  # ------------------------------------------------------------------------------ outputs

  def _output(self, g: SequenceGroup) -> RequestOutput:
    completions = []
    for index, seq in enumerate(g.completions()):
      tokens = seq.output_tokens
      seen = g.num_reported.get(seq.seq_id, 0)
      g.num_reported[seq.seq_id] = len(tokens)
      text = new_text = None
      if self.tokenizer is not None:   # EOS stays in token_ids, not in the text
        text = self._continuation(g, [t for t in tokens if t not in g.eos_token_ids])
        before = g.text_reported.get(seq.seq_id, "")
        new_text = text[len(before):] if text.startswith(before) else text
        g.text_reported[seq.seq_id] = text
      score = g.beam_scores.get(seq.seq_id, seq.cumulative_logprob)
      completions.append(CompletionOutput(
          index=index, token_ids=tokens, new_token_ids=tokens[seen:], text=text,
          new_text=new_text, logprobs=list(seq.logprobs),
          top_logprobs=list(seq.top_logprobs) if g.params.logprobs else None,
          cumulative_logprob=seq.cumulative_logprob, score=score,
          finish_reason=seq.finish_reason.value if seq.finish_reason else None))
    ttft = None if g.first_token_time is None else g.first_token_time - g.arrival_time
    tpot = None
    longest = max((len(c.token_ids) for c in completions), default=0)
    if g.finish_time is not None and g.first_token_time is not None and longest > 1:
      tpot = (g.finish_time - g.first_token_time) / (longest - 1)
    error = g.error if any(c.finish_reason == "error" for c in completions) else None
    queued = (None if g.first_scheduled_time is None
              else g.first_scheduled_time - g.arrival_time)
    return RequestOutput(g.request_id, list(g.prompt), completions, g.is_finished,
                         g.arrival_time, ttft, tpot, g.finish_time,
                         num_cached_tokens=g.num_cached_tokens, error=error,
                         time_in_queue=queued)

  def _continuation(self, g: SequenceGroup, tokens: list[int]) -> str:
    """The text `tokens` add after g's prompt, decoded in the context of the prompt's last
    DECODE_CONTEXT tokens (as vLLM's detokenizer and transformers' text-generation pipeline do):
    a decoder that joins words with spaces (WordPiece) or turns a leading "▁" into a space
    (SentencePiece) gives the continuation its first space, so prompt + text reads as the
    whole. Where the context's text is not a prefix of the joint text (a character split
    across the boundary), the tokens alone."""
    if not tokens:
      return ""
    if g.context_text is None:
      g.context_text = self.tokenizer.decode(list(g.prompt[-DECODE_CONTEXT:]))
    joint = self.tokenizer.decode(list(g.prompt[-DECODE_CONTEXT:]) + tokens)
    if joint.startswith(g.context_text):
      return joint[len(g.context_text):]
    return self.tokenizer.decode(tokens)

  # ------------------------------------------------------------------------------ metrics

  @property
  def kv_capacity_tokens(self) -> int:
    """Tokens the KV budget holds: the pool's, or a contiguous baseline's slot space (the
    scheduler's `reservation`), which then limits admission."""
    reserved = self.scheduler.reserved
    return reserved.capacity_tokens if reserved is not None else self.capacity_tokens

  def check_invariants(self) -> None:
    """The block manager's invariants (refcounts, free list, prefix cache); raises if broken."""
    self.bm.check_invariants()

  def metrics(self) -> dict:
    """Counters, KV usage and prefix-cache hit rate (from the block manager)."""
    bm = self.bm.stats()
    return {**dataclasses.asdict(self.stats), "kv_usage": bm["kv_usage"],
            # distinct programs the steps ran, and how many of them `warmup` had not compiled
            "programs": len(self.programs),
            "programs_not_warmed": sum(k not in self._warmed for k in self.programs),
            # programs this engine compiled itself / loaded from its program store (jit's own
            # compiles, without a store, are not counted here)
            "programs_compiled": self._program_origin["compiled"],
            "programs_loaded": self._program_origin["loaded"],
            "prefix_hit_rate": bm["prefix_hit_rate"], "capacity_tokens": self.capacity_tokens,
            "num_pages": self.num_pages, "page_size": self.page_size}


  def gauges(self) -> dict[str, int]:
    """What a server reports after every step, cheap to read (no walk over the pool): requests
    waiting / running / swapped out, pages referenced by a sequence, cached-idle and usable,
    requests whose pages are held in host memory (swap copies), the prefix cache's queried
    and hit prompt tokens, the distinct step programs run so far, how many programs a step
    had to wait for (compiled, or loaded from the program store, not by `warmup`), and the
    stoppable rounds that `step(interrupt)` ended early."""
    s, bm = self.scheduler, self.bm
    idle = bm.num_cached_idle_pages
    return {"waiting": len(s.waiting), "running": len(s.running), "swapped": len(s.swapped),
            "pages_in_use": self.num_pages - 1 - bm.num_free_pages,
            "pages_cached_idle": idle, "pages_usable": self.num_pages - 1,
            "swap_copies": len(self._swap),
            "prefix_queries_tokens": bm.prefix_queries_tokens,
            "prefix_hits_tokens": bm.prefix_hits_tokens, "preemptions": self.stats.preemptions,
            "programs": len(self.programs), "programs_on_demand": self.stats.programs_on_demand,
            "programs_on_demand_s": self.stats.programs_on_demand_s,
            "rounds_stopped": self.stats.rounds_stopped}


def _token_ids(ids: Iterable[int], vocab_size: int, what: str) -> list[int]:
  out = []
  for t in ids:
    if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
      raise ValueError(f"{what}: {t!r} is not a token id (an int)")
    out.append(int(t))
  bad = [t for t in out if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"{what} has token ids outside [0, {vocab_size}): {bad[:5]}")
  return out
