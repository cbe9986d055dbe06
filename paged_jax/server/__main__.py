"""python -m paged_jax.server --model=... --port=8000: serve the OpenAI API (see the package).

Flags: `paged_jax.serve`'s engine flags (model, dtype, pool size / memory budget, scheduler
knobs, mesh, warmup, program store; --stoppable_rounds on and --links_ahead=0 by default
here) plus --host, --port, --served_model_name, --max_waiting and --shutdown_timeout.
SIGTERM (or Ctrl-C) stops accepting connections, lets open requests finish for up to
--shutdown_timeout seconds, aborts the rest, and exits.
"""

from __future__ import annotations

import signal
import socket

from absl import app, flags, logging

from paged_jax import serve, sharding

flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free one, printed at start).")
flags.DEFINE_string("served_model_name", None, "The model id clients send (default: the "
                    "checkpoint's file or directory name; paged_jax-embedded).")
flags.DEFINE_integer("max_waiting", None, "Answer 503 while this many requests wait for "
                     "admission (default: queue without bound).")
flags.DEFINE_float("shutdown_timeout", 30.0, "Seconds open requests get to finish on SIGTERM.")
flags.DEFINE_string("log_level", "warning", "uvicorn's log level (info logs every request).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  import uvicorn

  from paged_jax import server
  f = flags.FLAGS
  cfg = serve.config_from_flags(f, progress=False)
  sharding.ensure_host_devices(cfg.mesh)
  served = server.build(cfg, model_name=f.served_model_name, max_waiting=f.max_waiting)
  config = uvicorn.Config(server.create_app(served), host=f.host, port=f.port,
                          log_level=f.log_level, timeout_graceful_shutdown=f.shutdown_timeout)
  # Bound and listening before the line is printed: a client (a test) that reads it can
  # connect at once (the kernel queues it until uvicorn accepts).
  sock = socket.create_server((f.host, f.port))
  port = sock.getsockname()[1]
  print(f"paged_jax.server: serving {served.model_name} on http://{f.host}:{port}/v1", flush=True)
  # uvicorn handles SIGTERM / SIGINT while it runs (a graceful shutdown), then raises the
  # signal again for the handler it found: this one, so that the process exits with 0.
  signal.signal(signal.SIGTERM, lambda *_: None)
  uvicorn.Server(config).run(sockets=[sock])
  logging.info("paged_jax.server: stopped")


def define_flags():
  """`paged_jax.serve`'s engine flags with the server's own defaults: stoppable rounds on (a
  server's requests arrive while rounds run; over HTTP they cut the queue and p90 TTFT at no
  measured TPOT cost: results page, "Stoppable rounds"); --nostoppable_rounds for k-step scans;
  and no link queued ahead of the running one (--links_ahead=0: a new request waits for the
  running step only; over HTTP on SmolLM2 it cut p90 TTFT in each of seven A/B pairs and
  left TPOT within the pairs' spread: results page, issue 30)."""
  serve.define_engine_flags()
  flags.FLAGS.set_default("stoppable_rounds", True)
  flags.FLAGS.set_default("links_ahead", 0)


if __name__ == "__main__":
  define_flags()
  app.run(main)
