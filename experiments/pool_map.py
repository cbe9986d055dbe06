"""Pictures of the KV pool itself during a serving run (issue 11, item 7), drawn from the block
manager's state after every step (`Engine.pool_map`).

  python -m experiments.pool_map                        # PNGs + GIF in experiments/results/
  python -m experiments.pool_map --num_pages=96 --num_requests=24

The run: the embedded model on a small pool, requests arriving a few per step (Poisson), some
sharing a long system prompt (prefix-cache hits), some sampled n = 3 times (shared prompt pages,
copy-on-write), so the pool fills, pages are shared, cached and evicted, and requests are
preempted. Outputs:

  pool_map.png        the page grid at four steps: each page coloured by the request that owns it
                      (hatched: shared by several sequences), cached-idle pages grey, free white;
  pool_usage.png      pages in use / cached-idle / free per step, preemptions marked;
  pool_map.gif        the page grid, step by step;
  pool_map.jsonl      one line per step: counts (and the run's config).
"""

from __future__ import annotations

import dataclasses
import json
import os

from absl import app, flags
import numpy as np

from paged_jax import embedded
from paged_jax.config import CacheConfig
from paged_jax.engine import Engine
from paged_jax.host.scheduler import SchedulerConfig
from paged_jax.sampling import SamplingParams

RESULTS = os.path.join(os.path.dirname(__file__), "results")


@dataclasses.dataclass(frozen=True)
class PoolMapConfig:
  num_pages: int = 80
  page_size: int = 4
  num_requests: int = 24
  arrivals_per_step: float = 1.0
  seed: int = 0
  snapshots: int = 4
  gif: bool = True
  results_dir: str | None = RESULTS


def serve(cfg: PoolMapConfig) -> tuple[list[dict], list[dict]]:
  """Runs the workload; returns (per-step pool maps, per-step counts)."""
  params, mcfg, tokenizer = embedded.load_embedded()
  rng = np.random.default_rng(cfg.seed)
  engine = Engine(params, mcfg, cache=CacheConfig(page_size=cfg.page_size, num_pages=cfg.num_pages),
                  scheduler=SchedulerConfig(max_num_seqs=16, steps_per_sync=1,
                                            preemption_mode="recompute"),
                  impl="xla", eos_token_ids=())
  letters = lambda n: [int(t) for t in rng.integers(4, mcfg.vocab_size, n)]
  system = letters(24)   # a shared "system prompt": 6 full pages of 4
  maps, counts = [], []
  added = 0
  while added < cfg.num_requests or engine.has_unfinished():
    for _ in range(int(rng.poisson(cfg.arrivals_per_step))):
      if added >= cfg.num_requests:
        break
      prompt = (system if rng.random() < 0.4 else []) + letters(int(rng.integers(4, 20)))
      n = 3 if rng.random() < 0.25 else 1
      engine.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(8, 40)), n=n,
                                                temperature=0.8 if n > 1 else 0.0,
                                                seed=int(rng.integers(2 ** 31)),
                                                ignore_eos=True))
      added += 1
    before = engine.stats.preemptions
    engine.step()
    m = engine.pool_map()
    maps.append(m)
    counts.append(dict(step=len(counts), in_use=int((m["refcount"] > 0).sum()),
                       shared=int(m["shared"].sum()), cached_idle=int(m["cached_idle"].sum()),
                       free=int(m["free"].sum()), preempted=engine.stats.preemptions - before,
                       running=len(engine.scheduler.running),
                       waiting=len(engine.scheduler.waiting)))
  engine.bm.check_invariants()
  return maps, counts


def _grid(ax, m: dict, title: str, cols: int):
  import matplotlib.colors as mcolors
  import matplotlib.patches as mpatches
  n = m["owner"].shape[0]
  rows = -(-n // cols)
  palette = list(mcolors.TABLEAU_COLORS.values())
  ax.set_xlim(0, cols)
  ax.set_ylim(rows, 0)
  ax.set_aspect("equal")
  ax.axis("off")
  ax.set_title(title, fontsize=9)
  for p in range(n):
    r, c = divmod(p, cols)
    if p == 0:
      face, hatch = "black", None            # NULL_PAGE
    elif m["owner"][p] >= 0:
      face = palette[int(m["owner"][p]) % len(palette)]
      hatch = "////" if m["shared"][p] else None
    elif m["cached_idle"][p]:
      face, hatch = "#bbbbbb", None
    else:
      face, hatch = "white", None
    ax.add_patch(mpatches.Rectangle((c, r), 0.92, 0.92, facecolor=face, edgecolor="#555",
                                    linewidth=0.4, hatch=hatch))


def draw(maps, counts, cfg: PoolMapConfig, out_dir: str) -> dict:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = 16
  peak = int(np.argmax([c["in_use"] for c in counts]))
  steps = sorted({int(s) for s in np.linspace(0, len(maps) - 1, cfg.snapshots)} | {peak})
  steps = steps[:cfg.snapshots] if peak in steps[:cfg.snapshots] else steps[:cfg.snapshots - 1] + [peak]
  fig, axes = plt.subplots(1, len(steps), figsize=(3.2 * len(steps), 2.3))
  for ax, s in zip(np.atleast_1d(axes), sorted(steps)):
    c = counts[s]
    _grid(ax, maps[s], f"step {s}: {c['in_use']} in use ({c['shared']} shared),\n"
                       f"{c['cached_idle']} cached-idle, {c['free']} free", cols)
  fig.suptitle("KV pool by page: colour = owning request, hatched = shared, grey = cached-idle, "
               "white = free, black = NULL_PAGE", fontsize=9)
  fig.tight_layout()
  paths = {"map": os.path.join(out_dir, "pool_map.png")}
  fig.savefig(paths["map"], dpi=110)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(7, 3))
  x = [c["step"] for c in counts]
  ax.stackplot(x, [c["in_use"] for c in counts], [c["cached_idle"] for c in counts],
               [c["free"] for c in counts], labels=["in use", "cached-idle", "free"],
               colors=["#48c", "#bbb", "#eee"])
  for c in counts:
    if c["preempted"]:
      ax.axvline(c["step"], color="#c44", linewidth=0.8)
  ax.plot([], [], color="#c44", label="preemption")
  ax.set_xlabel("step")
  ax.set_ylabel("pages")
  ax.set_xlim(0, len(counts) - 1)
  ax.legend(loc="upper right", fontsize=8)
  fig.tight_layout()
  paths["usage"] = os.path.join(out_dir, "pool_usage.png")
  fig.savefig(paths["usage"], dpi=110)
  plt.close(fig)

  if cfg.gif:
    from matplotlib import animation
    fig, ax = plt.subplots(figsize=(4, 3.6))

    def frame(i):
      ax.clear()
      c = counts[i]
      _grid(ax, maps[i], f"step {i}: {c['in_use']} in use, {c['cached_idle']} cached-idle, "
                         f"{c['free']} free", cols)

    anim = animation.FuncAnimation(fig, frame, frames=len(maps))
    paths["gif"] = os.path.join(out_dir, "pool_map.gif")
    anim.save(paths["gif"], writer=animation.PillowWriter(fps=4))
    plt.close(fig)
  return paths


def run(cfg: PoolMapConfig) -> dict:
  maps, counts = serve(cfg)
  result = {"steps": len(counts), "peak_in_use": max(c["in_use"] for c in counts),
            "max_shared": max(c["shared"] for c in counts),
            "max_cached_idle": max(c["cached_idle"] for c in counts),
            "preemptions": sum(c["preempted"] for c in counts), "counts": counts}
  if cfg.results_dir:
    os.makedirs(cfg.results_dir, exist_ok=True)
    result["paths"] = draw(maps, counts, cfg, cfg.results_dir)
    with open(os.path.join(cfg.results_dir, "pool_map.jsonl"), "w") as f:
      f.write(json.dumps({"config": dataclasses.asdict(cfg)}) + "\n")
      for c in counts:
        f.write(json.dumps(c) + "\n")
  return result


def main(_):
  r = run(PoolMapConfig(num_pages=_NUM_PAGES.value, num_requests=_NUM_REQUESTS.value,
                        gif=_GIF.value))
  print(f"{r['steps']} steps; peak {r['peak_in_use']} pages in use, up to {r['max_shared']} "
        f"shared and {r['max_cached_idle']} cached-idle; {r['preemptions']} preemptions")
  for k, v in r.get("paths", {}).items():
    print(f"{k}: {v}")


if __name__ == "__main__":
  _NUM_PAGES = flags.DEFINE_integer("num_pages", PoolMapConfig.num_pages, "Pages in the pool.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", PoolMapConfig.num_requests, "Requests.")
  _GIF = flags.DEFINE_bool("gif", True, "Also write the animated GIF.")
  app.run(main)
