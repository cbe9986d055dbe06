"""KV memory waste: paged allocation vs contiguous Max / Pow2 / Oracle reservation (PagedAttention
paper, section 6 and figure 2), by an iteration-level simulation on the same request stream.

  python -m experiments.allocator_waste                        # ShareGPT- and Alpaca-like
  python -m experiments.allocator_waste --workloads=sharegpt --num_requests=2000

Requests arrive all at once and are admitted FIFO whenever their memory fits; each step every
running request stores one more token (its prompt is stored when admitted); finished requests free
their memory. Paged allocation grows a page at a time and preempts the newest request (recompute)
when a page is missing; the baselines reserve their whole extent at admission. Reported, averaged
over steps: the fraction of reserved KV slots that hold token states, and the number of running
requests (the batch the memory allows). Lengths come from `paged_jax.workloads`: the ShareGPT-like
and Alpaca-like generators fitted in ../shared/WORKLOADS.md (means 161.5 / 335.6 and 19.3 / 58.4
tokens in / out; the paper's 161.31 / 337.99 and 19.31 / 58.45); no dataset is downloaded here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

from absl import app, flags
import numpy as np

from paged_jax import workloads
from paged_jax.host import baselines
from paged_jax.host.block_manager import BlockManager

WORKLOADS = workloads.WORKLOADS


@dataclasses.dataclass(frozen=True)
class WasteConfig:
  workload: str = "sharegpt"
  num_requests: int = 1000
  capacity_tokens: int = 32_768
  page_size: int = 16
  max_len: int = 2048
  seed: int = 0


def sample_lengths(cfg: WasteConfig) -> np.ndarray:
  """i64[num_requests, 2] (prompt_len, output_len) from the workload's generator
  (`paged_jax.workloads`: the ShareGPT-like and Alpaca-like fits of WORKLOADS.md)."""
  prompt, output = workloads.sample_lengths(np.random.default_rng(cfg.seed), cfg.workload,
                                            cfg.num_requests, max_total=cfg.max_len)
  return np.stack([prompt, output], 1)


class _Paged:
  def __init__(self, cfg):
    self.bm = BlockManager(1 + cfg.capacity_tokens // cfg.page_size, cfg.page_size,
                           enable_prefix_caching=False)

  def admit(self, rid, prompt_len, final_len):
    return self.bm.admit(rid, range(prompt_len)) is not None

  def grow(self, rid):
    return self.bm.append_tokens(rid, (0,)) is not None

  def free(self, rid):
    self.bm.free(rid)

  def stats(self):
    return self.bm.stats()


class _Contiguous:
  def __init__(self, cfg, policy):
    self.alloc = baselines.ContiguousAllocator(cfg.capacity_tokens, policy, cfg.max_len)

  def admit(self, rid, prompt_len, final_len):
    return self.alloc.admit(rid, prompt_len, final_len)

  def grow(self, rid):
    self.alloc.append(rid)
    return True

  def free(self, rid):
    self.alloc.free(rid)

  def stats(self):
    return self.alloc.stats()


def simulate(cfg: WasteConfig, allocator: str) -> dict:
  """Runs the request stream to completion; returns step-averaged waste and batch figures."""
  lengths = sample_lengths(cfg)
  mem = _Paged(cfg) if allocator == "paged" else _Contiguous(cfg, allocator)
  waiting = collections.deque(range(cfg.num_requests))
  generated = np.zeros(cfg.num_requests, np.int64)
  running: list[int] = []
  fractions, batch, steps, preemptions = [], [], 0, 0
  while waiting or running:
    while waiting:   # FIFO admission while memory allows
      rid = waiting[0]
      stored = lengths[rid, 0] + generated[rid]   # a preempted request recomputes its tokens
      if not mem.admit(rid, int(stored), int(lengths[rid].sum())):
        break
      running.append(waiting.popleft())
    if not running:
      raise RuntimeError(f"request {waiting[0]} can never fit in {cfg.capacity_tokens} slots")
    s = mem.stats()
    fractions.append(s["stored_tokens"] / max(1, s["reserved_token_slots"]))
    batch.append(len(running))
    for rid in list(running):
      if rid not in running:
        continue
      while not mem.grow(rid):   # out of pages: preempt the newest other request (recompute)
        victim = running[-1] if running[-1] != rid else (running[-2] if len(running) > 1 else None)
        if victim is None:
          raise RuntimeError(f"request {rid} cannot grow even alone")
        running.remove(victim)
        mem.free(victim)
        waiting.appendleft(victim)
        preemptions += 1
      generated[rid] += 1
      if generated[rid] == lengths[rid, 1]:
        running.remove(rid)
        mem.free(rid)
    steps += 1
  return {**dataclasses.asdict(cfg), "allocator": allocator,
          "token_state_fraction": float(np.mean(fractions)), "mean_batch": float(np.mean(batch)),
          "steps": steps, "preemptions": preemptions}


def run(cfg: WasteConfig) -> list[dict]:
  return [simulate(cfg, a) for a in ("paged",) + baselines.POLICIES]


def plot(records: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  workloads = sorted({r["workload"] for r in records})
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
  names = ["paged"] + list(baselines.POLICIES)
  width = 0.8 / len(workloads)
  for i, w in enumerate(workloads):
    rs = {r["allocator"]: r for r in records if r["workload"] == w}
    x = np.arange(len(names)) + i * width
    axes[0].bar(x, [100 * rs[n]["token_state_fraction"] for n in names], width, label=w)
    axes[1].bar(x, [rs[n]["mean_batch"] for n in names], width, label=w)
  for ax, title in zip(axes, ["KV slots holding token states (%)", "mean running requests"]):
    ax.set_xticks(np.arange(len(names)) + width * (len(workloads) - 1) / 2, names)
    ax.set_title(title)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  records = []
  for w in _WORKLOADS.value:
    if w not in WORKLOADS:
      raise app.UsageError(f"--workloads: {w!r} is not one of {sorted(WORKLOADS)}")
    cfg = WasteConfig(w, _NUM_REQUESTS.value, _CAPACITY.value, _PAGE_SIZE.value, _MAX_LEN.value)
    for r in run(cfg):
      records.append(r)
      print(f"{w:9s} {r['allocator']:7s} token states {100 * r['token_state_fraction']:5.1f}% of "
            f"reserved  mean batch {r['mean_batch']:6.1f}  steps {r['steps']:6d}  "
            f"preemptions {r['preemptions']}")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "a") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  if _PLOT.value:
    try:
      plot(records, _PLOT.value)
      print(f"plot: {_PLOT.value}")
    except ImportError:
      print("matplotlib is not installed (pip install '.[plot]'); skipped the plot")


if __name__ == "__main__":
  # Flags exist only when run as a script, so tests can import every experiment into one
  # process without absl's duplicate-flag error (several scripts share --page_size).
  _WORKLOADS = flags.DEFINE_list("workloads", ["sharegpt", "alpaca"], "Length distributions.")
  _NUM_REQUESTS = flags.DEFINE_integer("num_requests", 1000, "Requests per workload.")
  _CAPACITY = flags.DEFINE_integer("capacity_tokens", 32_768, "KV capacity in token slots.")
  _PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page (paged allocator).")
  _MAX_LEN = flags.DEFINE_integer("max_len", 2048, "Model maximum length (the Max reservation).")
  _OUT = flags.DEFINE_string("out", "experiments/results/allocator_waste.jsonl", "JSONL to append to.")
  _PLOT = flags.DEFINE_string("plot", "experiments/results/allocator_waste.png",
                              "PNG to write (needs matplotlib); empty to skip.")
  app.run(main)
