"""The models the serving experiments run on, by name, and how a serving run is timed warm.

  embedded  the 2-layer copy model shipped in `paged_jax/assets` (128-token context): a CPU step
            so small that its time grows nearly in proportion to the batch;
  small     a random Llama (4 layers, hidden 512, 8 q / 2 kv heads of 64, vocab 8,192, 512-token
            context, f32: 80 MB of weights read every decode step), whose step is weight-bound
            like a GPU's decode step: the regime in which batching more requests pays.
"""

from __future__ import annotations

MODELS = ("embedded", "small")


def load_model(name: str):
  """(params, model config, tokenizer, eos ids) of `name` in MODELS, as `serve.run` takes them."""
  from paged_jax import serve, testing
  from paged_jax.config import ModelConfig
  if name == "embedded":
    return serve.load_model(serve.ServeConfig())
  if name == "small":
    mcfg = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=4,
                       num_q_heads=8, num_kv_heads=2, head_dim=64, max_position=512)
    return testing.random_params(mcfg, 0), mcfg, None, ()
  raise ValueError(f"model={name!r} is not one of {MODELS}")


_TRACES = [0]


def _count_traces(name: str, *_, **__) -> None:
  if name == "/jax/core/compile/jaxpr_trace_duration":
    _TRACES[0] += 1


def traced_during(fn):
  """(fn(), number of jaxprs JAX traced while it ran: shapes compiled, or loaded from the
  persistent cache, for the first time in this process)."""
  import jax
  if not getattr(traced_during, "registered", False):
    jax.monitoring.register_event_duration_secs_listener(_count_traces)
    traced_during.registered = True
  before = _TRACES[0]
  out = fn()
  return out, _TRACES[0] - before


def serve_warm(cfg, model, attempts: int = 3) -> dict:
  """`serve.run(cfg)` again while a run traced a new shape (at most `attempts` runs): which
  batch shapes a run meets depends on its timing, so one warm-up run may not compile them all.
  The summary gets "retraced": the shapes traced during the run kept (0 unless attempts ran out).
  """
  from paged_jax import serve
  for _ in range(attempts):
    r, traced = traced_during(lambda: serve.run(cfg, model=model))
    if not traced:
      break
  r["retraced"] = traced
  return r
