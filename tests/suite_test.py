"""The suite's own machinery (tests/conftest.py): the tiers, the run's compilation cache, the
duration check and the profile, each run in a pytest subprocess on a small generated test file
with a copy of the conftest; and experiments.test_durations' split of a profile."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest, parameterized
import pytest

from experiments import test_durations

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# A test over a limit of 1.5 s without sleeping (a host loop of ~3.3 s here, ~8 s on a slow
# day), one well under it (the backend starts at import, so its one small compile is all the test
# pays: ~0.1 s, but 0.5 s on a slow day under xdist, so the limit keeps 3x margin either side).
_FILE = '''
import jax, jax.numpy as jnp, pytest

ADD = jax.jit(lambda x: x + 1)
ADD(jnp.ones(2))

def test_quick():
  assert ADD(jnp.ones(3)).sum() == 6

def test_busy():
  assert sum(i * i for i in range(40_000_000)) > 0

@pytest.mark.slow
def test_busy_but_slow():
  assert sum(i * i for i in range(40_000_000)) > 0
'''


# Each test runs pytest in subprocesses (~43 s together): the slow tier, which CI also runs.
@pytest.mark.slow
class SuiteTest(parameterized.TestCase):

  def _pytest(self, *args, **env):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp)
    with open(os.path.join(tmp, "gen_test.py"), "w") as fh:
      fh.write(_FILE)
    with open(os.path.join(tmp, "setup.cfg"), "w") as fh:
      fh.write('[tool:pytest]\npython_files = *_test.py\naddopts = -p no:cacheprovider '
               '-m "not slow"\n')
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PAGED_JAX_", "JAX_"))}
    base["PAGED_JAX_DURATION_SCALE"] = "1"   # the bound as given, whatever the machine's day
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=tmp,
                          env=dict(base, **env), capture_output=True, text=True, timeout=300)
    return proc, tmp

  @parameterized.parameters((), ("-n", "2"))
  def test_duration_check_names_the_slow_test(self, *xdist):
    proc, _ = self._pytest(*xdist, PAGED_JAX_MAX_TEST_SECONDS="1.5")
    out = proc.stdout + proc.stderr
    self.assertEqual(proc.returncode, 1, out)
    self.assertIn("2 passed", out)   # the slow tier is left out by default
    if not xdist:   # (xdist's workers deselect; its summary does not count them)
      self.assertIn("2 passed, 1 deselected", out)
    self.assertIn("duration check: 1 test(s) outside the slow tier took over 1.5 s", out)
    self.assertIn("gen_test.py::test_busy\n", out)
    self.assertNotIn("gen_test.py::test_quick", out)

  def test_slow_tier_is_exempt_and_the_check_can_be_off(self):
    proc, _ = self._pytest("-m", "slow", PAGED_JAX_MAX_TEST_SECONDS="1.5")
    self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
    self.assertIn("1 passed, 2 deselected", proc.stdout)
    proc, _ = self._pytest(PAGED_JAX_MAX_TEST_SECONDS="0")
    self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
    # a machine 1,000x slower than usual stretches the 1.5 s bound past the busy test
    proc, _ = self._pytest(PAGED_JAX_MAX_TEST_SECONDS="1.5", PAGED_JAX_DURATION_SCALE="1000")
    self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
    self.assertNotIn("duration check", proc.stdout)

  def test_profile_rows_and_their_summary(self):
    prof = os.path.join(tempfile.mkdtemp(), "prof.jsonl")
    self.addCleanup(shutil.rmtree, os.path.dirname(prof), ignore_errors=True)
    proc, _ = self._pytest("-n", "2", "-k", "quick", PAGED_JAX_TEST_PROFILE=prof)
    self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
    rows = test_durations.load(prof)
    call = [r for r in rows if r["test"].endswith("test_quick") and r["phase"] == "call"]
    self.assertLen(call, 1)
    self.assertGreater(call[0]["compile"], 0)   # the jit's compile lands in its own test
    self.assertGreater(call[0]["trace"], 0)
    self.assertEqual(sorted(r["pid"] for r in rows if r["phase"] == "collect"),
                     sorted({r["pid"] for r in rows}))   # one collection row per worker
    s = test_durations.summarize(rows, "fast")
    self.assertEqual(s["tests"], {"gen_test.py": 1})
    self.assertIn("| gen_test.py | 1 |", test_durations.format_summary(s))

  def test_compile_cache_across_runs(self):
    # PAGED_JAX_TEST_COMPILE_CACHE=DIR: the first run writes its programs there, the next loads.
    cache = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, cache, ignore_errors=True)
    hits = []
    for _ in range(2):
      prof = os.path.join(cache, "prof.jsonl")
      proc, _ = self._pytest("-k", "quick", PAGED_JAX_TEST_COMPILE_CACHE=cache,
                             PAGED_JAX_TEST_PROFILE=prof)
      self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
      [call] = [r for r in test_durations.load(prof) if r["phase"] == "call"]
      hits.append(call.get("cache_hits", 0))
      os.remove(prof)
    self.assertEqual(hits[0], 0)
    self.assertGreaterEqual(hits[1], 1)
    # Without it, nothing is cached.
    prof = os.path.join(cache, "prof.jsonl")
    proc, _ = self._pytest("-k", "quick", PAGED_JAX_TEST_PROFILE=prof)
    [call] = [r for r in test_durations.load(prof) if r["phase"] == "call"]
    self.assertNotIn("cache_hits", call)

  def test_split_of_a_profile_row(self):
    row = dict(test="t.py::a", phase="call", seconds=10.0, trace=1.0, lower=0.5, compile=4.0,
               cache_load=1.0, cache_saved=2.5, cache_hits=3, subprocess=2.0)
    self.assertEqual(test_durations.split(row),
                     dict(trace=1.5, compile=3.0, cache_load=1.0, subprocess=2.0, run=2.5,
                          hits=3, saved=2.5))
    rows = [dict(row, slow=False), dict(row, test="t.py::b", slow=True),
            dict(test="(collection)", phase="collect", seconds=3.0, slow=False)]
    fast = test_durations.summarize(rows, "fast")
    self.assertEqual(fast["tests"], {"t.py": 1})
    self.assertEqual(fast["total"]["seconds"], 13.0)
    self.assertEqual(test_durations.summarize(rows)["by_file"]["t.py"]["seconds"], 20.0)
    with self.assertRaisesRegex(ValueError, "tier='quick'"):
      test_durations.summarize(rows, "quick")


class LongestFirstTest(absltest.TestCase):
  """The slow tier's file order (conftest.longest_first), in this process."""

  def test_known_files_longest_first_then_most_tests_first(self):
    import conftest   # pytest's own module for tests/conftest.py (tests/ is not a package)
    ids = ["a.py::t1", "b.py::t1", "b.py::t2", "c.py::t1", "d.py::t1", "d.py::t2", "c.py::t2",
           "e.py::t1"]
    got = conftest.longest_first(ids, {"c.py": 10, "e.py": 50, "x.py": 99})
    self.assertEqual(got, ["e.py::t1", "c.py::t1", "c.py::t2", "b.py::t1", "b.py::t2",
                           "d.py::t1", "d.py::t2", "a.py::t1"])
    self.assertEqual(conftest.longest_first(ids, {}), conftest.longest_first(ids, {"x.py": 1}))
    self.assertCountEqual(got, ids)

  def test_every_listed_file_exists(self):
    import conftest
    for path in conftest.SLOW_TIER_SECONDS:   # a renamed file would silently lose its place
      self.assertTrue(os.path.exists(os.path.join(ROOT, path)), path)


if __name__ == "__main__":
  absltest.main()
