"""The one thread that owns the engine, and the server's Prometheus metrics.

HTTP handlers never touch the engine. They send commands (`submit`, `abort`, `call`) through a
queue to the engine thread, which applies them between steps, steps the engine while anything
is unfinished (and sleeps on the queue when nothing is), and hands every `RequestOutput` to
the callback its request was submitted with (the server's callback moves it onto the handler's
asyncio queue with `loop.call_soon_threadsafe`). After every step it refreshes the metrics'
gauges from `Engine.gauges()` and, for each finished request, observes its TTFT, TPOT and
end-to-end latency.

A step that raises out of the engine (a bookkeeping bug: device faults are recovered inside
`Engine.step`) stops the loop: every open request receives the exception, `error` says why, and
/health turns 503.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Callable

from absl import logging
import prometheus_client as prom

from paged_jax.host.sequence import RequestOutput

OnOutput = Callable[[RequestOutput | BaseException], None]

# Histogram buckets (seconds) as vLLM's server uses for the same three latencies.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0)
PREFIX = "paged_jax:"


class Metrics:
  """The server's metrics in a registry of its own (`render()` is the /metrics body).

  Gauges (set by the engine thread after every step): requests running / waiting / swapped,
  KV pages in use / cached-idle / usable and their share, swap copies in host memory, the
  prefix cache's hit rate, open server requests. Counters: prompt and generation tokens,
  preemptions, stoppable rounds ended early, finished requests by finish reason. Histograms:
  TTFT, TPOT, end-to-end.
  """

  def __init__(self, model_name: str):
    self.registry = r = prom.CollectorRegistry()
    labels = ["model_name"]
    g = lambda name, doc: prom.Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)
    c = lambda name, doc: prom.Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)
    h = lambda name, doc, buckets: prom.Histogram(PREFIX + name, doc, labels, buckets=buckets,
                                                  registry=r).labels(model_name)
    self.running = g("num_requests_running", "Requests with sequences in the running batch.")
    self.waiting = g("num_requests_waiting", "Requests queued for admission.")
    self.swapped = g("num_requests_swapped", "Requests preempted to host memory.")
    self.pages_in_use = g("kv_pages_in_use", "KV pages referenced by a sequence.")
    self.pages_cached = g("kv_pages_cached_idle", "KV pages only the prefix cache keeps.")
    self.pages_usable = g("kv_pages_usable", "KV pages in the pool (without the null page).")
    self.kv_usage = g("kv_cache_usage_perc", "Share of usable KV pages in use (0-1).")
    self.swap_copies = g("num_swap_copies", "Requests whose pages are held in host memory.")
    self.prefix_hit_rate = g("prefix_cache_hit_rate", "Prompt tokens served by the prefix "
                             "cache / prompt tokens looked up, since the start (0-1).")
    self.open_requests = g("num_open_requests", "Engine requests the server is still serving.")
    self.programs = g("num_programs", "Distinct step programs run so far (each compiled, or "
                      "loaded from the program store, on first use).")
    self.programs_on_demand = g("num_programs_on_demand", "Step programs compiled, or loaded "
                                "from the program store, while a step waited (not by warmup).")
    self.programs_on_demand_s = g("programs_on_demand_seconds", "Seconds steps waited for "
                                  "programs compiled or loaded on demand (with a program store).")
    self.asyncio_tasks = g("server_asyncio_tasks", "asyncio tasks in the server's event loop "
                           "(request handlers, streams), counted at this scrape.")
    self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests.")
    self.generation_tokens = c("generation_tokens", "Tokens generated.")
    self.preemptions = c("num_preemptions", "Preemptions (swap or recompute).")
    self.rounds_stopped = c("num_rounds_stopped", "Stoppable decode rounds ended early because "
                            "a command (a new request, an abort) was queued.")
    self._finished = prom.Counter(PREFIX + "request_success", "Finished requests by reason.",
                                  ["model_name", "finished_reason"], registry=r)
    self._model_name = model_name
    self.ttft = h("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
    self.tpot = h("time_per_output_token_seconds", "Time per output token after the first.",
                  TPOT_BUCKETS)
    self.e2e = h("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
    # TTFT's two parts, as vLLM names them: arrival to the first step with a row of the
    # request (admission, and the step in flight when it came), then its prompt's steps.
    self.queue = h("request_queue_time_seconds", "Arrival to the start of the request's first "
                   "step.", TTFT_BUCKETS)
    self.prefill = h("request_prefill_time_seconds", "The request's first step's start to its "
                     "first token.", TTFT_BUCKETS)
    self._seen = {"preemptions": 0, "rounds_stopped": 0}   # engine totals counted so far

  def update(self, gauges: dict, open_requests: int) -> None:
    self.running.set(gauges["running"])
    self.waiting.set(gauges["waiting"])
    self.swapped.set(gauges["swapped"])
    self.pages_in_use.set(gauges["pages_in_use"])
    self.pages_cached.set(gauges["pages_cached_idle"])
    self.pages_usable.set(gauges["pages_usable"])
    self.kv_usage.set(gauges["pages_in_use"] / max(1, gauges["pages_usable"]))
    self.swap_copies.set(gauges["swap_copies"])
    self.programs.set(gauges["programs"])
    self.programs_on_demand.set(gauges["programs_on_demand"])
    self.programs_on_demand_s.set(gauges["programs_on_demand_s"])
    self.prefix_hit_rate.set(gauges["prefix_hits_tokens"]
                             / max(1, gauges["prefix_queries_tokens"]))
    self.open_requests.set(open_requests)
    for name, counter in (("preemptions", self.preemptions),
                          ("rounds_stopped", self.rounds_stopped)):
      new = gauges.get(name, 0) - self._seen[name]
      if new > 0:
        counter.inc(new)
        self._seen[name] = gauges[name]

  def observe(self, out: RequestOutput) -> None:
    """Counts an output's new tokens; for a finished request, its latencies and reason."""
    self.generation_tokens.inc(sum(len(c.new_token_ids) for c in out.outputs))
    if not out.finished:
      return
    self.prompt_tokens.inc(len(out.prompt_token_ids))
    reasons = {c.finish_reason for c in out.outputs}
    reason = next((r for r in ("error", "abort", "stop", "length") if r in reasons), "length")
    self._finished.labels(self._model_name, reason).inc()
    if out.ttft is not None:
      self.ttft.observe(out.ttft)
      if out.time_in_queue is not None:
        self.queue.observe(out.time_in_queue)
        self.prefill.observe(out.ttft - out.time_in_queue)
    if out.tpot is not None:
      self.tpot.observe(out.tpot)
    if out.finish_time is not None:
      self.e2e.observe(out.finish_time - out.arrival_time)

  def render(self) -> bytes:
    return prom.generate_latest(self.registry)


class EngineRunner:
  """Runs `engine` on a thread of its own; see the module docstring.

  Args:
    engine: an `Engine` (or anything with add_request / abort / step / has_unfinished /
      gauges).
    metrics: updated after every step (None: none kept).
  """

  def __init__(self, engine, metrics: Metrics | None = None):
    self._engine = engine
    self.metrics = metrics
    self._commands: queue.SimpleQueue = queue.SimpleQueue()
    self._subscribers: dict[str, OnOutput] = {}   # engine thread only
    self._thread = threading.Thread(target=self._loop, name="paged_jax-engine", daemon=True)
    self.error: str | None = None
    self.gauges: dict = engine.gauges()   # the latest snapshot, replaced (not mutated) per step
    self.steps = 0

  # ---------------------------------------------------------------- any thread

  def start(self) -> None:
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self.error is None

  def submit(self, prompt: list[int], params, on_output: OnOutput, *,
             arrival_time: float | None = None) -> concurrent.futures.Future:
    """Queues a request; the future gives its engine id, or the engine's ValueError. Outputs
    (or the exception that stopped the loop) go to `on_output`, on the engine thread."""
    fut = concurrent.futures.Future()
    self._put(("add", (prompt, params, on_output, arrival_time or time.perf_counter()), fut))
    return fut

  def abort(self, request_id: str) -> None:
    """Aborts a request (its pages are freed before the next step); unknown ids are ignored."""
    self._put(("abort", request_id, None))

  def call(self, fn: Callable) -> concurrent.futures.Future:
    """Runs fn(engine) on the engine thread between steps; the future gives its result."""
    fut = concurrent.futures.Future()
    self._put(("call", fn, fut))
    return fut

  def shutdown(self, timeout: float | None = None) -> None:
    """Aborts what still runs, reports it, and stops the thread."""
    if self._thread.is_alive():
      self._commands.put(("stop", None, None))
      self._thread.join(timeout)

  def _put(self, command) -> None:
    if not self.alive:
      fut = command[2]
      error = RuntimeError(f"the engine loop is not running ({self.error or 'stopped'})")
      if fut is not None:
        fut.set_exception(error)
      return
    self._commands.put(command)

  # ---------------------------------------------------------------- the engine thread

  def _loop(self) -> None:
    engine = self._engine
    try:
      while True:
        block = not engine.has_unfinished()
        while True:   # every queued command, waiting for one when the engine is idle
          try:
            kind, arg, fut = self._commands.get(block=block)
          except queue.Empty:
            break
          block = False
          if kind == "stop":
            self._stop()
            return
          self._apply(kind, arg, fut)
        if engine.has_unfinished():
          outs = engine.step(self._commands_waiting)
          self.steps += 1
          self._deliver(outs)
    except Exception as e:   # noqa: BLE001 - reported to every open request, then the loop ends
      logging.exception("the engine loop failed")
      self.error = f"{type(e).__name__}: {e}"
      for cb in self._subscribers.values():
        cb(e)
      self._subscribers.clear()
      self._fail_commands(e)

  def _commands_waiting(self) -> bool:
    """The engine's interrupt: a command (a new request, an abort) is queued, so a stoppable
    round ends early and the command is applied ~1-2 steps after it came, not k."""
    return not self._commands.empty()

  def _apply(self, kind, arg, fut) -> None:
    engine = self._engine
    if kind == "add":
      prompt, params, on_output, arrival = arg
      try:
        request_id = engine.add_request(prompt, params, arrival_time=arrival)
      except ValueError as e:
        fut.set_exception(e)
        return
      self._subscribers[request_id] = on_output
      fut.set_result(request_id)
    elif kind == "abort":
      engine.abort(arg)
    elif kind == "call":
      try:
        fut.set_result(arg(engine))
      except Exception as e:   # noqa: BLE001 - the caller's
        fut.set_exception(e)

  def _deliver(self, outs: list[RequestOutput]) -> None:
    for out in outs:
      cb = self._subscribers.get(out.request_id)
      if out.finished:
        self._subscribers.pop(out.request_id, None)
      if self.metrics is not None:
        self.metrics.observe(out)
      if cb is not None:
        cb(out)
    self.gauges = self._engine.gauges()
    if self.metrics is not None:
      self.metrics.update(self.gauges, len(self._subscribers))

  def _stop(self) -> None:
    for request_id in list(self._subscribers):
      self._engine.abort(request_id)
    while self._subscribers and self._engine.has_unfinished():
      self._deliver(self._engine.step())   # an aborted request's final output comes first
    self.error = self.error or "shut down"
    self._fail_commands(RuntimeError("the server is shutting down"))

  def _fail_commands(self, error: BaseException) -> None:
    while True:
      try:
        _, _, fut = self._commands.get_nowait()
      except queue.Empty:
        return
      if fut is not None and not fut.done():
        fut.set_exception(error)
