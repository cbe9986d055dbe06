"""An OpenAI-compatible HTTP server over the engine (`python -m paged_jax.server`).

  python -m paged_jax.server --model=SmolLM2-135M-Instruct.Q4_1.gguf --port=8000
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

Pieces: `protocol` (the API's request schemas, response bodies, stop strings), `runner` (the
one thread that owns the engine, and the Prometheus metrics), `app` (the FastAPI endpoints),
`__main__` (absl flags: `paged_jax.serve`'s engine flags plus host, port, model name,
--max_waiting, and uvicorn to run it). `build` makes the pieces from a `ServeConfig`, for a
script or a test that serves in-process.
"""

from __future__ import annotations

import os

from paged_jax.server.app import Served, create_app
from paged_jax.server.runner import EngineRunner, Metrics

__all__ = ["Served", "create_app", "EngineRunner", "Metrics", "build", "default_model_name"]


def default_model_name(model_dir: str | None) -> str:
  """The id /v1/models lists: the checkpoint's file or directory name (without .gguf), or
  "paged_jax-embedded" for the embedded model."""
  if not model_dir:
    return "paged_jax-embedded"
  name = os.path.basename(os.path.normpath(model_dir))
  return name[:-5] if name.endswith(".gguf") else name


def build(cfg, *, model_name: str | None = None, max_waiting: int | None = None,
          model=None) -> Served:
  """Loads the model of `cfg` (a `paged_jax.serve.ServeConfig`), builds its engine, warms it
  (cfg.warmup: "off" or one of `engine.WARMUP_SCOPES`), starts the engine thread; returns what
  `create_app` serves.

  model: (params, model config, tokenizer, eos ids) to reuse instead of loading cfg.model_dir.
  """
  from paged_jax import chat as chat_lib
  from paged_jax import embedded
  from paged_jax import serve
  from paged_jax.engine import WARMUP_SCOPES
  if cfg.warmup not in ("off",) + WARMUP_SCOPES:
    raise ValueError(f"warmup={cfg.warmup!r}: a server warms up with off or one of "
                     f"{WARMUP_SCOPES}")
  if max_waiting is not None and max_waiting < 0:
    raise ValueError(f"max_waiting={max_waiting} must be >= 0 (or None: no bound)")
  params, mcfg, tokenizer, eos = model or serve.load_model(cfg)
  path = cfg.model_dir or embedded.EMBEDDED_MODEL_DIR
  chat = None
  if tokenizer is not None and chat_lib.load_template(path) is not None:
    chat = chat_lib.Chat(path, tokenizer, eos)
  engine = serve.make_engine(cfg, params, mcfg, tokenizer, eos)
  if cfg.warmup != "off":
    engine.warmup(cfg.warmup, progress=cfg.progress)
  name = model_name or default_model_name(cfg.model_dir)
  runner = EngineRunner(engine, Metrics(name))
  runner.start()
  return Served(runner, model_name=name, tokenizer=tokenizer, chat=chat,
                max_position=mcfg.max_position, max_waiting=max_waiting)
