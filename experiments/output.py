"""Where an experiment puts what it measured: one JSONL line per run and a figure, in
experiments/results/ (or a directory a test passes). Host side only."""

from __future__ import annotations

import json
import os

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def pyplot():
  """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, path: str, dpi: int = 110) -> str:
  """Lays out, writes and closes `fig`; returns `path`."""
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
  return path


def append_jsonl(result: dict, path: str | None) -> None:
  """Appends `result`, with the JAX version it ran on, as one line to the JSONL file `path`
  (an --out flag; nothing when empty)."""
  if not path:
    return
  import jax
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "a") as f:
    f.write(json.dumps({**result, "jax": jax.__version__}) + "\n")


def record(result: dict, results_dir: str | None, name: str, plot=None,
           figure: str | None = None) -> dict:
  """Appends `result` as one line to results_dir/name.jsonl and, given `plot`, draws
  plot(result, path) into results_dir/figure (default name.png), keeping the path in
  result["png"]. Does nothing without a results_dir. Returns `result`."""
  if not results_dir:
    return result
  os.makedirs(results_dir, exist_ok=True)
  with open(os.path.join(results_dir, name + ".jsonl"), "a") as f:
    f.write(json.dumps(result) + "\n")
  if plot is not None:
    result["png"] = plot(result, os.path.join(results_dir, figure or name + ".png"))
  return result
