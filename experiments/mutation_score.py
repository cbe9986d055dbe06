"""Mutation score of the core modules: mutmut (3.x) run per module, outside CI's time budget.

  .venv/bin/pip install -e '.[test,mutation]'
  .venv/bin/python -m experiments.mutation_score --modules=block_manager,scheduler
  .venv/bin/python -m experiments.mutation_score --modules=all        # hours on 2 cores

For each module it makes a scratch clone of the working tree, writes a `[mutmut]` section that
mutates that one file and runs only the tests that exercise it (MODULES below), runs
`mutmut run`, and reads mutmut's own counts (`mutmut export-cicd-stats`). It prints, and appends
to --out, per module: killed, survived, timed out, no tests, total, and the score
killed / (total - equivalent) (a mutant no test reaches is not killed), with the surviving
mutants' names and diffs (so a survivor can be judged: a missing test, or an equivalent mutant to
list in EQUIVALENT with its reason). Timeouts count as killed (mutmut's convention: the mutant made the tests hang).
"""

from __future__ import annotations

import configparser
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

# module name -> (file to mutate, tests that exercise it).
MODULES = {
    "block_manager": ("paged_jax/host/block_manager.py",
                      ["tests/paged_jax/host/block_manager_test.py"]),
    "scheduler": ("paged_jax/host/scheduler.py", ["tests/paged_jax/host/scheduler_test.py"]),
    "sampling": ("paged_jax/sampling.py", ["tests/paged_jax/sampling_test.py"]),
    "merge": ("pallas_kernels/paged_attention/merge.py", ["tests/paged_jax/attention_test.py"]),
    "reference": ("pallas_kernels/paged_attention/reference.py",
                  ["tests/paged_jax/attention_test.py"]),
    "attention": ("paged_jax/attention.py", ["tests/paged_jax/attention_test.py"]),
    "kernel": ("pallas_kernels/paged_attention/kernel_triton.py",
               ["tests/pallas_kernels/paged_attention_test.py"]),
    "kv_write": ("paged_jax/kv_write.py", ["tests/paged_jax/state_test.py"]),
    "page_ops": ("paged_jax/page_ops.py", ["tests/paged_jax/state_test.py",
                                           "tests/paged_jax/robustness_test.py"]),
}

# Imported by the fork server before it forks workers: libraries only (importing them runs no JAX
# computation; the project's modules may, at import).
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.linen", "chex", "hypothesis", "absl.testing.absltest",
           "pytest")

# Mutants judged equivalent (no test can tell them from the original), by mutmut name, with why.
# Filled in from runs of this script; see WORKSPACE.md, "Mutation testing".
EQUIVALENT: dict[str, str] = {
    "paged_jax.host.block_manager.xǁBlockManagerǁstats__mutmut_21":
        "stored.get(None, 0) for stored.get(p, 0): a page shared by several sequences holds the "
        "same number of tokens in each (a write into a shared page copies it first), so the max "
        "over its owners equals the last owner's value",
    "paged_jax.host.block_manager.xǁBlockManagerǁstats__mutmut_53":
        "max(2, queries) for max(1, queries) in prefix_hit_rate: they differ only at queries <= 1, "
        "where hits are 0 (the last prompt token is never a hit), so the rate is 0 either way",
}


@dataclasses.dataclass(frozen=True)
class MutationConfig:
  modules: tuple[str, ...] = ("block_manager",)
  max_children: int = 2
  keep: bool = False          # keep the scratch clone (to `mutmut show` / `mutmut browse` there)
  out: str = "experiments/results/mutation_score.jsonl"


def _setup_cfg(path: str, source: str, tests: list[str]) -> None:
  cfg = configparser.ConfigParser()
  cfg.read(path)
  if cfg.has_section("mutmut"):
    cfg.remove_section("mutmut")
  cfg.add_section("mutmut")
  cfg.set("mutmut", "source_paths", "\n" + source)
  cfg.set("mutmut", "also_copy", "\npaged_jax\npallas_kernels\nexperiments\ntests\nsetup.cfg")
  cfg.set("mutmut", "pytest_add_cli_args_test_selection", "\n" + "\n".join(tests))
  # JAX's CPU runtime starts thread pools when first used; a worker forked from a process that
  # ran JAX can deadlock, and mutmut reads that as a timeout (counted as killed). So workers fork
  # from a server that has only imported the libraries (PRELOAD), never run a test.
  cfg.set("mutmut", "process_isolation", "forkserver")
  cfg.set("mutmut", "forkserver_warmup", "import")
  preload = os.path.join(os.path.dirname(path), "mutmut_preload.txt")
  with open(preload, "w") as f:
    f.write("\n".join(PRELOAD) + "\n")
  cfg.set("mutmut", "preload_modules_file", preload)
  with open(path, "w") as f:
    cfg.write(f)


def _clone(repo: str) -> str:
  """A scratch copy of the working tree (uncommitted changes included), without venvs."""
  scratch = tempfile.mkdtemp(prefix="mutation_")
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=repo, check=True,
                         capture_output=True, text=True).stdout.split("\n")
  for rel in filter(None, files):
    if os.path.isfile(os.path.join(repo, rel)):
      os.makedirs(os.path.join(scratch, os.path.dirname(rel)), exist_ok=True)
      shutil.copy2(os.path.join(repo, rel), os.path.join(scratch, rel))
  return scratch


def _mutmut(args: list[str], cwd: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "mutmut"] + args, cwd=cwd, capture_output=True,
                        text=True)


def score(stats: dict, survivors: list[str]) -> dict:
  """Counts and score from mutmut's cicd stats. Survivors listed in EQUIVALENT leave the total;
  a mutant no test reaches counts as not killed."""
  equivalent = [s for s in survivors if s in EQUIVALENT]
  killed = stats["killed"] + stats.get("timeout", 0)
  judged = stats["total"] - stats.get("skipped", 0) - len(equivalent)
  return dict(killed=killed, survived=stats["survived"] - len(equivalent),
              equivalent=len(equivalent), timeout=stats.get("timeout", 0),
              no_tests=stats.get("no_tests", 0), total=stats["total"],
              score=killed / judged if judged else None)


def run_module(name: str, cfg: MutationConfig, repo: str) -> dict:
  if name not in MODULES:
    raise ValueError(f"module {name!r} is not one of {sorted(MODULES)}")
  source, tests = MODULES[name]
  scratch = _clone(repo)
  try:
    _setup_cfg(os.path.join(scratch, "setup.cfg"), source, tests)
    t = time.perf_counter()
    run = _mutmut(["run", "--max-children", str(cfg.max_children)], scratch)
    seconds = time.perf_counter() - t
    if run.returncode:
      raise RuntimeError(f"mutmut run failed for {name}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    _mutmut(["export-cicd-stats"], scratch)
    with open(os.path.join(scratch, "mutants", "mutmut-cicd-stats.json")) as f:
      stats = json.load(f)
    results = _mutmut(["results"], scratch).stdout
    survivors = [line.split(":")[0].strip() for line in results.splitlines()
                 if line.strip().endswith("survived")]
    diffs = {s: _mutmut(["show", s], scratch).stdout for s in survivors}
    return dict(module=name, file=source, tests=tests, seconds=seconds, stats=stats,
                **score(stats, survivors), survivors=survivors, diffs=diffs)
  finally:
    if cfg.keep:
      print(f"kept {scratch}")
    else:
      shutil.rmtree(scratch, ignore_errors=True)


def format_result(r: dict) -> str:
  s = "-" if r["score"] is None else f"{r['score']:.1%}"
  lines = [f"{r['module']:14s} {r['file']}: killed {r['killed']} (timeouts {r['timeout']}), "
           f"survived {r['survived']}, equivalent {r['equivalent']}, no tests {r['no_tests']}, "
           f"total {r['total']}; score {s} ({r['seconds'] / 60:.1f} min)"]
  lines += [f"  survivor {name}" for name in r["survivors"]]
  return "\n".join(lines)


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  modules = tuple(MODULES) if f.modules == ["all"] else tuple(f.modules)
  cfg = MutationConfig(modules=modules, max_children=f.max_children, keep=f.keep, out=f.out)
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for name in cfg.modules:
    r = run_module(name, cfg, repo)
    print(format_result(r), flush=True)
    if cfg.out:
      os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
      with open(cfg.out, "a") as out:
        out.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_list("modules", ["block_manager"], f"Modules to mutate, from {sorted(MODULES)}, or all.")
  flags.DEFINE_integer("max_children", 2, "Parallel mutmut workers.")
  flags.DEFINE_bool("keep", False, "Keep the scratch clone.")
  flags.DEFINE_string("out", "experiments/results/mutation_score.jsonl", "JSONL to append to.")
  app.run(main)
