"""The engine tensor parallel across processes (`jax.distributed`), on loopback: the closest one
machine gets to several hosts.

  python -m experiments.multihost_check                          # 2 processes x 2 CPU devices
  python -m experiments.multihost_check --num_processes=4 --devices_per_process=2

The launcher starts `num_processes` copies of this script (--process_id=i), each with
`devices_per_process` simulated CPU devices and gloo collectives. Every process calls
`jax.distributed.initialize` with the same coordinator, builds the same 1 x (num_processes x
devices_per_process) mesh over the global devices, and runs the same `Engine` on the same
requests: its "model" axis spans the processes, so each all-reduce crosses them. Each process
prints its greedy tokens as JSON; the launcher checks they all equal one device's (run in this
process, no mesh) and exits 1 if not. On real hosts the same per-process code runs with the
coordinator at host 0's address (WORKSPACE.md, "Scale-out").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from absl import app, flags

flags.DEFINE_integer("num_processes", 2, "Processes (hosts) to start.")
flags.DEFINE_integer("devices_per_process", 2, "Simulated CPU devices in each.")
flags.DEFINE_integer("process_id", None, "Internal: this worker's rank.")
flags.DEFINE_string("coordinator", None, "Internal: the coordinator's host:port.")
flags.DEFINE_integer("timeout_s", 240, "Give up on the workers after this long.")
FLAGS = flags.FLAGS

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def _model():
  from paged_jax import config, testing
  cfg = config.tiny_config(num_q_heads=8, num_kv_heads=4, max_position=128)
  return testing.random_params(cfg, seed=0, scale=0.3), cfg


def generate(mesh=None) -> list[list[int]]:
  """The check's requests through an Engine (tensor parallel over `mesh`'s devices)."""
  from paged_jax.config import CacheConfig
  from paged_jax.engine import Engine
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  params, cfg = _model()
  engine = Engine(params, cfg, cache=CacheConfig(page_size=4, num_pages=32), mesh=mesh,
                  scheduler=SchedulerConfig(steps_per_sync=4), impl="xla")
  outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0))
  return [o.outputs[0].token_ids for o in outs]


def worker() -> None:
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=FLAGS.coordinator,
                             num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
  from paged_jax import sharding
  mesh = sharding.make_mesh(1, jax.device_count())
  print(json.dumps(dict(process=jax.process_index(), devices=jax.device_count(),
                        local_devices=jax.local_device_count(), tokens=generate(mesh))))


def launch() -> dict:
  """Starts the workers, waits, compares their tokens with one device's. Returns the summary."""
  with socket.socket() as s:   # a free port for the coordinator
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, XLA_FLAGS=(
      f"--xla_force_host_platform_device_count={FLAGS.devices_per_process}"))
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  procs = [subprocess.Popen(
      [sys.executable, "-m", "experiments.multihost_check", f"--process_id={i}",
       f"--num_processes={FLAGS.num_processes}", f"--coordinator=127.0.0.1:{port}"],
      cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(FLAGS.num_processes)]
  results, errors = [], []
  for i, p in enumerate(procs):
    try:
      out, err = p.communicate(timeout=FLAGS.timeout_s)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      errors.append(f"process {i}: no answer in {FLAGS.timeout_s} s")
      break
    if p.returncode:
      errors.append(f"process {i} exited {p.returncode}: {err[-1500:]}")
    else:
      results.append(json.loads(out.strip().splitlines()[-1]))
  reference = generate()
  same = bool(results) and not errors and all(r["tokens"] == reference for r in results)
  return dict(num_processes=FLAGS.num_processes, devices_per_process=FLAGS.devices_per_process,
              results=results, errors=errors, reference=reference, tokens_equal_one_device=same)


def main(argv):
  del argv
  if FLAGS.process_id is not None:
    worker()
    return 0
  r = launch()
  for e in r["errors"]:
    print("ERROR", e)
  for x in r["results"]:
    print(f"process {x['process']}: {x['local_devices']} of {x['devices']} devices, "
          f"tokens {x['tokens']}")
  print(f"multihost: {r['num_processes']} processes x {r['devices_per_process']} devices, mesh "
        f"1x{r['num_processes'] * r['devices_per_process']}: tokens equal one device's: "
        f"{r['tokens_equal_one_device']}")
  return 0 if r["tokens_equal_one_device"] else 1


if __name__ == "__main__":
  app.run(main)
