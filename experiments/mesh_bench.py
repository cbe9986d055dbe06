"""Scale-out with jax.sharding: per-device pool memory, the pool's capacity in tokens, and step
time for 1, 2, 4 and 8 devices, tensor parallel (1xM) and data parallel (Dx1), in one process.

  python -m experiments.mesh_bench                        # small preset, 7 meshes
  python -m experiments.mesh_bench --preset=large --num_requests=16
  python -m experiments.mesh_bench --preset=tiny --meshes=1x1,1x2,2x1 --num_requests=4

Per mesh, two things:
- capacity: an engine built with the same KV budget per device (--kv_bytes_per_device): the
  pool bytes each device holds (read from the arrays' shards), usable pages and tokens over all
  replicas, and their ratio to one device;
- time: the serve benchmark's workload (its random-init preset model, prompts 16-256 tokens,
  greedy, --new_tokens each, EOS off) on a pool that holds all of it (every replica the same
  size, so no mesh preempts and all run the same steps), on a fresh engine after a warm-up run
  that compiles its shapes: output tokens/s, decode ms per step (the slowest replica's), the
  pool bytes per device, and whether the greedy tokens equal one device's.

On a CPU the devices are simulated (main sets XLA_FLAGS=--xla_force_host_platform_device_count
before jax starts): they share this machine's cores, so time here measures what partitioning
costs, not a speed-up; on a host with real devices the same command measures scaling. Capacity
and bytes per device are the same either way. Output: a table, one JSONL line and a figure in
experiments/results/ (mesh_bench.jsonl, mesh_bench.png).
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import numpy as np

from experiments import output, serve_bench

DEFAULT_MESHES = ("1x1", "1x2", "1x4", "1x8", "2x1", "4x1", "8x1")


@dataclasses.dataclass(frozen=True)
class MeshBenchConfig:
  preset: str = "small"
  meshes: tuple[str, ...] = DEFAULT_MESHES
  num_requests: int = 32
  new_tokens: int = 32
  page_size: int = 16
  kv_bytes_per_device: int = 8 * 2 ** 20
  steps_per_sync: int = 8
  results_dir: str | None = output.RESULTS


def _model(cfg: MeshBenchConfig):
  from experiments import ondevice_bench
  return ondevice_bench.preset_model(ondevice_bench.OnDeviceBenchConfig(
      preset=cfg.preset, num_requests=cfg.num_requests, new_tokens=cfg.new_tokens))


def pool_bytes_per_device(engine) -> int:
  """The most pool bytes any one device holds, read from the arrays' shards."""
  per_device: dict = {}
  replicas = getattr(engine, "replicas", [engine])
  for e in replicas:
    for x in (e.pool.k, e.pool.v):
      for shard in x.addressable_shards:
        per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values())


def run_mesh(cfg: MeshBenchConfig, spec: str, params, mcfg, prompts) -> dict:
  """Capacity at the fixed per-device budget (an engine built, not run), then the timed run on
  a pool that holds the whole workload (no preemption, so every mesh runs the same steps)."""
  from paged_jax import data_parallel, sharding
  from paged_jax.config import CacheConfig
  from paged_jax.host.addressing import pages_needed
  from paged_jax.host.scheduler import SchedulerConfig
  from paged_jax.sampling import SamplingParams
  data, model = sharding.parse_mesh(spec)
  mesh = sharding.make_mesh(data, model)
  sp = SamplingParams(max_tokens=cfg.new_tokens, ignore_eos=True)
  sched = SchedulerConfig(steps_per_sync=cfg.steps_per_sync, max_num_seqs=64,
                          max_num_batched_tokens=4096)
  budget = data_parallel.make_engine(
      params, mcfg, mesh=mesh, scheduler=sched,
      cache=CacheConfig(page_size=cfg.page_size, memory_bytes=cfg.kv_bytes_per_device))
  replicas = getattr(budget, "replicas", [budget])
  row = dict(mesh=spec, data=data, model=model, devices=data * model,
             stored_kv_heads=mcfg.stored_kv_heads(model),
             pool_bytes_per_device=pool_bytes_per_device(budget),
             usable_pages=sum(r.num_pages - 1 for r in replicas),
             capacity_tokens=budget.capacity_tokens)
  del budget, replicas
  need = 1 + sum(pages_needed(len(p) + cfg.new_tokens, cfg.page_size) for p in prompts)

  def engine():
    return data_parallel.make_engine(
        params, mcfg, mesh=mesh, scheduler=sched,
        cache=CacheConfig(page_size=cfg.page_size, num_pages=need))
  engine().generate(prompts, sp)   # warm-up: compiles this mesh's shapes
  e = engine()
  t = time.perf_counter()
  outs = e.generate(prompts, sp)
  seconds = time.perf_counter() - t
  replicas = getattr(e, "replicas", [e])
  slowest = max(replicas, key=lambda r: r.stats.decode_s + r.stats.decode_host_s)
  row.update(timed_pool_bytes_per_device=pool_bytes_per_device(e), seconds=seconds,
             output_tokens_per_s=len(prompts) * cfg.new_tokens / seconds,
             decode_step_ms=1e3 * (slowest.stats.decode_s + slowest.stats.decode_host_s) /
             max(1, slowest.stats.decode_steps),
             preemptions=e.metrics()["preemptions"],
             tokens=[o.outputs[0].token_ids for o in outs])
  return row


def run(cfg: MeshBenchConfig, progress=print) -> dict:
  import jax
  params, mcfg, prompts = _model(cfg)
  rows = []
  for spec in cfg.meshes:
    r = run_mesh(cfg, spec, params, mcfg, prompts)
    rows.append(r)
    progress(f"  {spec}: {r['output_tokens_per_s']:.0f} tok/s, {r['capacity_tokens']} tokens")
  base = next((r for r in rows if r["devices"] == 1), rows[0])
  for r in rows:
    r["capacity_x"] = r["capacity_tokens"] / base["capacity_tokens"]
    r["same_tokens_as_one_device"] = r["tokens"] == base["tokens"]
  for r in rows:
    del r["tokens"]
  return dict(kind="mesh_bench", config=dataclasses.asdict(cfg), jax=jax.__version__,
              platform=jax.devices()[0].platform, device_count=jax.device_count(),
              model=dataclasses.asdict(mcfg), rows=rows)


def format_result(r: dict) -> str:
  c = r["config"]
  lines = [f"mesh bench [{c['preset']}] on {r['device_count']} {r['platform']} devices: "
           f"{c['num_requests']} requests x {c['new_tokens']} tokens, KV budget "
           f"{c['kv_bytes_per_device'] / 2 ** 20:.0f} MiB per device; "
           f"{r['model']['num_q_heads']} query / {r['model']['num_kv_heads']} KV heads",
           "  mesh  devices  stored KV heads  budget pool MiB/device  capacity tokens  "
           "(x 1 device)  | timed pool MiB/device  tok/s  decode ms/step  same tokens"]
  for x in r["rows"]:
    lines.append(f"  {x['mesh']:5s} {x['devices']:7d} {x['stored_kv_heads']:16d} "
                 f"{x['pool_bytes_per_device'] / 2 ** 20:23.2f} {x['capacity_tokens']:16d} "
                 f"{x['capacity_x']:13.2f}x | {x['timed_pool_bytes_per_device'] / 2 ** 20:21.2f} "
                 f"{x['output_tokens_per_s']:6.0f} {x['decode_step_ms']:15.2f}  "
                 f"{x['same_tokens_as_one_device']}")
  return "\n".join(lines)


def plot(r: dict, path: str) -> str:
  plt = output.pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
  for kind, pick, style in (("tensor parallel (1xM)", lambda x: x["data"] == 1, "o-"),
                            ("data parallel (Dx1)", lambda x: x["model"] == 1, "s--")):
    xs = sorted((x for x in r["rows"] if pick(x)), key=lambda x: x["devices"])
    a.plot([x["devices"] for x in xs], [x["capacity_x"] for x in xs], style, label=kind)
    b.plot([x["devices"] for x in xs], [x["decode_step_ms"] for x in xs], style, label=kind)
  a.set(xlabel="devices", ylabel="pool capacity (x one device)",
        title="capacity at a fixed KV budget per device")
  b.set(xlabel="devices", ylabel="decode ms / step",
        title=f"step time ({r['platform']}: {'simulated' if r['platform'] == 'cpu' else 'real'})")
  for ax in (a, b):
    ax.set_xscale("log", base=2)
    ax.legend()
  return output.save_figure(fig, path)


def main(argv):
  del argv
  from paged_jax import sharding
  f = flags.FLAGS
  meshes = tuple(f.meshes)
  # Ask for the devices before jax starts (a no-op on GPU / TPU hosts).
  sharding.ensure_host_devices(f"1x{max(np.prod(sharding.parse_mesh(m)) for m in meshes)}")
  cfg = MeshBenchConfig(preset=f.preset, meshes=meshes, num_requests=f.num_requests,
                        new_tokens=f.new_tokens, kv_bytes_per_device=f.kv_bytes_per_device,
                        results_dir=f.results_dir)
  r = run(cfg)
  print(format_result(r))
  output.record(r, cfg.results_dir, "mesh_bench", plot)


if __name__ == "__main__":
  flags.DEFINE_enum("preset", "small", list(serve_bench.PRESETS), "Model shape.")
  flags.DEFINE_list("meshes", list(DEFAULT_MESHES), "DATAxMODEL meshes to run.")
  flags.DEFINE_integer("num_requests", 32, "Requests.")
  flags.DEFINE_integer("new_tokens", 32, "Tokens generated per request.")
  flags.DEFINE_integer("kv_bytes_per_device", MeshBenchConfig.kv_bytes_per_device,
                       "KV budget per device in bytes.")
  flags.DEFINE_string("results_dir", output.RESULTS, "Where the JSONL and figure go ('' for none).")
  app.run(main)
