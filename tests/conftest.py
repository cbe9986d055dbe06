"""Suite-wide settings.

- Two tiers. Tests marked `slow` (system tests: 8 simulated devices, multi-host, the soak, the
  notebooks, the experiments' end-to-end runs of over ~10 s here on a usual day, the suite's
  own checks that run pytest in subprocesses, the scan against the unrolled decoder beyond
  Llama's; a slow day here runs ~2x longer, and the README tier must still fit its 10 minutes
  and every test its 20 s) are left out by default
  (setup.cfg's `-m "not slow"`), so the README's test command runs every other check;
  `.ci/run` then runs `pytest -m slow`.
- The slow tier hands its files to xdist's workers longest first (`SLOW_TIER_SECONDS`, measured;
  xdist's own order, most tests first, left one worker ~180 s of work after the other finished).
- A compilation cache across runs, for a developer's loop: PAGED_JAX_TEST_COMPILE_CACHE=DIR
  keeps every program the run compiles in DIR (JAX's persistent cache, however fast it
  compiled), inherited by xdist workers and subprocesses, so the next run reads them back
  (a tiny engine's compiles 4.4 s cold, 0.8 s warm). Off by default: within one run it saved nothing
  measurable (the programs that repeat across modules are the tiny eager ones; the engine's step
  programs differ by shape), so a clean clone (CI) gains nothing from it. A cache directory the
  caller set in JAX_COMPILATION_CACHE_DIR (mutation_score's) is left as it is.
- XLA compiles fast rather than well (`fast_compile_flags`, appended to XLA_FLAGS before jax
  starts, inherited like the cache); PAGED_JAX_TEST_FAST_COMPILE=0 compiles at XLA's defaults
  (`.ci/run`'s jax 0.11 stage does, so CI also runs the kernel, attention and CPU-lowering tests
  on the programs users get).
- GGUF loads keep their converted-model cache (`gguf_file.converted_cache_dir`) in a temporary
  folder of the process, removed at exit, not in ~/.cache (PAGED_JAX_GGUF_CACHE, unless set).
- Every Engine a test builds validates its step arrays against the block manager before each step
  (`Engine(validate_tables=None)` reads PAGED_JAX_VALIDATE_TABLES).
- Compiled programs are released after each test module. Each XLA:CPU executable keeps a few
  dozen memory mappings; the whole suite compiles thousands of programs and crossed the kernel's
  vm.max_map_count (65,530), after which compiling aborted or segfaulted at random places.
- A duration check: a test outside the slow tier that takes more than PAGED_JAX_MAX_TEST_SECONDS
  (default 20; setup, call and teardown together) fails the run, named, so the README's tier
  cannot silently grow back. 0 turns it off; it is off under mutmut (a mutant may only be slow).
  On a machine slower than usual the bound stretches by the measured slowdown of a matmul
  (`machine_speed_scale`, at most 4x; measured only when some test is over the bound).
- A profile (PAGED_JAX_TEST_PROFILE=FILE): one JSON line per test and phase, appended to FILE by
  each process, with its seconds and the part of them spent tracing, lowering and compiling
  (or loading from the cache: JAX's own monitoring events) and waiting on subprocesses;
  `python -m experiments.test_durations FILE` groups them by file and by what the time is.
- Under mutmut's coverage pass (MUTANT_UNDER_TEST=stats, `experiments/mutation_score.py`) the
  compiled programs are released before every test: a test that finds a function's program in
  jit's cache never calls the Python function, so mutmut would not see that the test reaches it
  and would not run the test against that function's mutants.
"""

import gc
import importlib.metadata
import json
import os
import subprocess
import time

os.environ.setdefault("PAGED_JAX_VALIDATE_TABLES", "1")
if "PAGED_JAX_GGUF_CACHE" not in os.environ:
  import atexit
  import shutil
  import tempfile
  os.environ["PAGED_JAX_GGUF_CACHE"] = tempfile.mkdtemp(prefix="paged_jax_gguf_")
  atexit.register(shutil.rmtree, os.environ["PAGED_JAX_GGUF_CACHE"], True)

if (os.environ.get("PAGED_JAX_TEST_COMPILE_CACHE")
    and not os.environ.get("JAX_COMPILATION_CACHE_DIR")):
  # Set before jax is imported (it reads these once) and inherited by workers and subprocesses:
  # mutation_score's settings (stdlib only at import), every program cached.
  from experiments.mutation_score import compile_cache_env
  os.environ.update(compile_cache_env(os.environ["PAGED_JAX_TEST_COMPILE_CACHE"], base={}))


def fast_compile_flags(jaxlib_version: str) -> tuple:
  """XLA's CPU compiler at its cheapest: LLVM at -O0 without its expensive passes, and on jaxlib
  0.10 the older loop emitters (0.11 removed that flag; XLA aborts on a flag it does not know).
  The suite is ~2/3 compiling; these cut a tiny engine's compiles ~3x on 0.10.2. The programs
  compute the same IEEE f32 operations; only the machine code is less optimized."""
  flags = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
  major_minor = tuple(int(x) for x in jaxlib_version.split(".")[:2])
  return flags + (("--xla_cpu_use_fusion_emitters=false",) if major_minor < (0, 11) else ())


def default_compile_options(jaxlib_version: str | None = None) -> dict:
  """The options that undo `fast_compile_flags` for one program (`Engine(compiler_options=)`):
  XLA's own defaults, for a test whose programs run long enough that -O0 costs more than it
  saves (SmolLM2's 30 layers: 68 s at -O0, most of it running the steps)."""
  jaxlib_version = jaxlib_version or importlib.metadata.version("jaxlib")
  major_minor = tuple(int(x) for x in jaxlib_version.split(".")[:2])
  opts = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False}
  return opts | ({"xla_cpu_use_fusion_emitters": True} if major_minor < (0, 11) else {})


if os.environ.get("PAGED_JAX_TEST_FAST_COMPILE", "1") != "0":
  _flags = os.environ.get("XLA_FLAGS", "").split()
  _names = {f.split("=")[0] for f in _flags}
  os.environ["XLA_FLAGS"] = " ".join(
      _flags + [f for f in fast_compile_flags(importlib.metadata.version("jaxlib"))
                if f.split("=")[0] not in _names])

import jax  # noqa: E402  (after the environment is set)
import pytest  # noqa: E402

MAX_TEST_SECONDS = float(os.environ.get("PAGED_JAX_MAX_TEST_SECONDS", "20"))
_durations: dict = {}   # README-tier test -> seconds (setup + call + teardown), for the check

PROFILE = os.environ.get("PAGED_JAX_TEST_PROFILE")
# JAX's monitoring events -> the profile's names. backend_compile wraps the persistent cache's
# lookup, so it is compile time on a miss and load time on a hit; compile_time_saved is what a
# hit saved (the program's recorded compile time less the load).
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "compile",
           "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load",
           "/jax/compilation_cache/compile_time_saved_sec": "cache_saved"}
_now: dict = {}   # the running test phase's profile figures


def _on_duration(event, seconds, **_):
  name = _EVENTS.get(event)
  if name:
    _now[name] = _now.get(name, 0.0) + seconds
    if name == "cache_saved":
      _now["cache_hits"] = _now.get("cache_hits", 0) + 1


def _timed(method):
  """Popen.wait / communicate, adding the time spent in them to the running test's profile."""
  def wrapper(self, *a, **kw):
    depth = _now.get("_depth", 0)
    _now["_depth"] = depth + 1
    t = time.perf_counter()
    try:
      return method(self, *a, **kw)
    finally:
      _now["_depth"] = depth
      if depth == 0:
        _now["subprocess"] = _now.get("subprocess", 0.0) + time.perf_counter() - t
  return wrapper


if PROFILE:
  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  subprocess.Popen.wait = _timed(subprocess.Popen.wait)
  subprocess.Popen.communicate = _timed(subprocess.Popen.communicate)


def _profile_row(test, phase, seconds, **kw):
  row = dict(test=test, phase=phase, seconds=seconds, pid=os.getpid(), **kw,
             **{k: v for k, v in _now.items() if not k.startswith("_")})
  with open(PROFILE, "a") as fh:
    fh.write(json.dumps(row) + "\n")
  _now.clear()


_t_start = time.perf_counter()


def pytest_collection_finish(session):
  # Module-level code (models, parameters) runs at collection: its compiles get a row of their own.
  if PROFILE:
    _profile_row("(collection)", "collect", time.perf_counter() - _t_start, slow=False)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: a system test (8 simulated devices, multi-host, the "
                          "soak, the notebooks, long experiment runs); run by `pytest -m slow`")
  if _slow_tier(config) and hasattr(config.option, "loadscopereorder"):
    # xdist's controller hands out files in collection order (`pytest_collection_modifyitems`
    # below), not its default of most tests first.
    config.option.loadscopereorder = False


# The slow tier's longest files, with their seconds (summed over their tests; the profile of
# 2026-12-06: PAGED_JAX_TEST_PROFILE=F pytest -n 2 --dist loadfile -m slow, then
# `python -m experiments.test_durations --profile=F --tier=slow`). The slow tier hands them out
# longest first. xdist's default (most tests first) ran the 266-s sharding file after five
# others, and the tier took 607 s on one worker against 429 on the other; longest first, the
# same tests replayed on xdist's rules split 503 / 498. Files not listed follow, most tests
# first (xdist's own order); a stale figure only costs balance, never a test.
SLOW_TIER_SECONDS = {
    "tests/paged_jax/sharding_test.py": 266,
    "tests/experiments/experiments_test.py": 236,
    "tests/paged_jax/smollm2_test.py": 159,
    "tests/notebooks_test.py": 72,
    "tests/paged_jax/robustness_test.py": 70,
    "tests/paged_jax/model_test.py": 54,
    "tests/suite_test.py": 50,
    "tests/paged_jax/kv_quant_test.py": 41,
    "tests/paged_jax/ondevice_test.py": 29,
}


def _slow_tier(config) -> bool:
  return (config.option.markexpr or "").strip() == "slow"


def longest_first(nodeids: list, seconds: dict) -> list:
  """`nodeids` regrouped by file: the files in `seconds` first, longest first, then the others,
  most tests first; each file's tests keep their order. Ties keep collection order."""
  files: dict = {}
  for i, nodeid in enumerate(nodeids):
    files.setdefault(nodeid.split("::")[0], []).append(i)
  order = sorted(files, key=lambda f: (-seconds.get(f, -1), -len(files[f])))
  return [nodeids[i] for f in order for i in files[f]]


def pytest_collection_modifyitems(config, items):
  if _slow_tier(config):
    by_id = {item.nodeid: item for item in items}
    items[:] = [by_id[n] for n in longest_first([item.nodeid for item in items],
                                                SLOW_TIER_SECONDS)]


def pytest_runtest_logreport(report):
  if PROFILE and not hasattr(report, "node"):   # this process ran it (not a worker's report)
    _profile_row(report.nodeid, report.when, report.duration, slow="slow" in report.keywords)
  # In the xdist controller too: each worker's reports arrive here with their durations.
  if "slow" not in report.keywords:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def too_slow(durations: dict, limit: float) -> list:
  """(seconds, test) of the tests over `limit` seconds, slowest first; none when limit <= 0."""
  if limit <= 0:
    return []
  return sorted(((s, t) for t, s in durations.items() if s > limit), reverse=True)


# This machine's 2048^3 f32 matmul on a usual day (WORKSPACE.md: 356-400 GFLOP/s; the low end).
USUAL_MATMUL_GFLOPS = 356.0


def machine_speed_scale() -> tuple[float, str]:
  """(factor, why) the 20 s bound is stretched by on a machine slower than usual: the usual
  matmul rate over the one measured now (at least 1, at most 4). The same tests ran 2-4x longer
  on some days here (2026-12-02: 105-193 GFLOP/s); the check is about a test's cost, not the
  day's. PAGED_JAX_DURATION_SCALE=F sets the factor (suite_test: 1)."""
  fixed = os.environ.get("PAGED_JAX_DURATION_SCALE")
  if fixed:
    return float(fixed), f"x {float(fixed):g} (PAGED_JAX_DURATION_SCALE)"
  a = jax.numpy.ones((2048, 2048), jax.numpy.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  t = time.perf_counter()
  for _ in range(5):
    matmul(a).block_until_ready()
  gflops = 5 * 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9
  factor = min(4.0, max(1.0, USUAL_MATMUL_GFLOPS / gflops))
  return factor, (f"x {factor:.2f}: this machine's 2048^3 f32 matmul at {gflops:.0f} GFLOP/s "
                  f"now, {USUAL_MATMUL_GFLOPS:.0f} on a usual day")


def pytest_sessionfinish(session, exitstatus):
  if hasattr(session.config, "workerinput") or os.environ.get("MUTANT_UNDER_TEST"):
    return
  limit, why = MAX_TEST_SECONDS, ""
  slow = too_slow(_durations, limit)
  if slow:   # measured only then, on the quiet machine the workers left
    factor, why = machine_speed_scale()
    limit = MAX_TEST_SECONDS * factor
    slow = too_slow(_durations, limit)
  if slow:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"duration check: {len(slow)} test(s) outside the slow tier took over "
             f"{limit:g} s ({MAX_TEST_SECONDS:g} s {why}; make them cheaper, or mark them slow):"]
    lines += [f"  {s:6.1f} s  {t}" for s, t in slow]
    if reporter is not None:
      reporter.write_line("\n".join(lines), red=True)
    else:
      print("\n".join(lines))
    if session.exitstatus == 0:
      session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _trace_afresh_under_mutmut_stats():
  if os.environ.get("MUTANT_UNDER_TEST") == "stats":
    jax.clear_caches()
  yield
