"""Where the test suite's time goes: the conftest's profile grouped by file and by what the time is.

  PAGED_JAX_TEST_PROFILE=/tmp/prof.jsonl .venv/bin/python -m pytest -q -n 2
  .venv/bin/python -m experiments.test_durations --profile=/tmp/prof.jsonl [--top=20]

`tests/conftest.py` appends one JSON line per test phase (setup / call / teardown, and one for
each process's collection) with its seconds and the part of them JAX's monitoring events and the
subprocess waits account for. Each test's seconds split into:
  trace + lower   Python tracing and lowering to StableHLO (jit's own work before XLA);
  compile         XLA compiling a program (a persistent-cache miss, or no cache);
  cache loads     programs read back from the persistent compilation cache;
  subprocess      waiting on a process the test started (8 simulated devices, multi-host);
  run             the rest: running programs, host code, the test itself.
"saved" is what the cache's hits saved (their recorded compile time less the load): compile
without a cache would have been compile + cache loads + saved. Seconds are summed over the
processes (an xdist run's wall time is less); the install is outside pytest (`.ci/run` prints
its stages' times). Host side only: reads JSON, prints Markdown.
"""

from __future__ import annotations

import collections
import dataclasses
import json

from absl import app, flags

PARTS = ("trace", "compile", "cache_load", "subprocess", "run")
HEAD = ("trace + lower", "compile", "cache loads", "subprocess", "run")


@dataclasses.dataclass(frozen=True)
class DurationsConfig:
  profile: str = "/tmp/paged_jax_test_profile.jsonl"
  top: int = 20
  tier: str = "all"   # all | fast | slow


def load(path: str) -> list[dict]:
  with open(path) as fh:
    return [json.loads(line) for line in fh if line.strip()]


def split(row: dict) -> dict:
  """One profile row's seconds by part (PARTS), plus its cache hits and the compile they saved."""
  trace = row.get("trace", 0.0) + row.get("lower", 0.0)
  load_s = row.get("cache_load", 0.0)
  compile_s = max(row.get("compile", 0.0) - load_s, 0.0)   # backend_compile includes the loads
  sub = row.get("subprocess", 0.0)
  rest = max(row["seconds"] - trace - compile_s - load_s - sub, 0.0)
  return dict(trace=trace, compile=compile_s, cache_load=load_s, subprocess=sub, run=rest,
              hits=row.get("cache_hits", 0), saved=row.get("cache_saved", 0.0))


def summarize(rows: list[dict], tier: str = "all") -> dict:
  """Totals by file, by test and overall; tier "fast" / "slow" keeps one tier's tests."""
  if tier not in ("all", "fast", "slow"):
    raise ValueError(f"tier={tier!r}: one of all, fast, slow")
  by_file = collections.defaultdict(lambda: collections.Counter())
  by_test = collections.defaultdict(lambda: collections.Counter())
  tests_of = collections.defaultdict(set)
  total = collections.Counter()
  for r in rows:
    if tier != "all" and r["phase"] != "collect" and r.get("slow", False) != (tier == "slow"):
      continue
    parts = split(r)
    parts["seconds"] = r["seconds"]
    f = "(collection)" if r["phase"] == "collect" else r["test"].split("::")[0]
    by_file[f].update(parts)
    total.update(parts)
    if r["phase"] != "collect":
      by_test[r["test"]].update(parts)
      tests_of[f].add(r["test"])
  return dict(by_file=dict(by_file), by_test=dict(by_test),
              tests={f: len(t) for f, t in tests_of.items()}, total=dict(total))


def format_summary(s: dict, top: int = 20) -> str:
  head = ["file", "tests", "seconds"] + list(HEAD) + ["cache hits (saved s)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  def cells(c):
    return [f"{c.get('seconds', 0):.1f}"] + [f"{c.get(p, 0):.1f}" for p in PARTS] + [
        f"{int(c.get('hits', 0))} ({c.get('saved', 0):.1f})"]
  for f, c in sorted(s["by_file"].items(), key=lambda kv: -kv[1]["seconds"]):
    lines.append("| " + " | ".join([f, str(s["tests"].get(f, "-"))] + cells(c)) + " |")
  lines.append("| " + " | ".join(["**all**", str(sum(s["tests"].values()))] + cells(s["total"]))
               + " |")
  if top:
    lines += ["", f"Slowest {top} tests (setup + call + teardown):", ""]
    for t, c in sorted(s["by_test"].items(), key=lambda kv: -kv[1]["seconds"])[:top]:
      lines.append(f"  {c['seconds']:6.1f} s  (compile {c.get('compile', 0):.1f}, loads "
                   f"{c.get('cache_load', 0):.1f}, trace {c.get('trace', 0):.1f}, subprocess "
                   f"{c.get('subprocess', 0):.1f})  {t}")
  return "\n".join(lines)


def run(cfg: DurationsConfig) -> dict:
  return summarize(load(cfg.profile), cfg.tier)


def main(argv):
  del argv
  cfg = DurationsConfig(profile=FLAGS.profile, top=FLAGS.top, tier=FLAGS.tier)
  print(format_summary(run(cfg), cfg.top))


if __name__ == "__main__":
  flags.DEFINE_string("profile", DurationsConfig.profile, "The conftest's profile (JSONL).")
  flags.DEFINE_integer("top", DurationsConfig.top, "List this many slowest tests (0: none).")
  flags.DEFINE_enum("tier", "all", ["all", "fast", "slow"], "Which tests to count.")
  FLAGS = flags.FLAGS
  app.run(main)
