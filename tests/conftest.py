"""Suite-wide settings.

- Every Engine a test builds validates its step arrays against the block manager before each step
  (`Engine(validate_tables=None)` reads PAGED_JAX_VALIDATE_TABLES).
- Compiled programs are released after each test module. Each XLA:CPU executable keeps a few
  dozen memory mappings; the whole suite compiles thousands of programs and crossed the kernel's
  vm.max_map_count (65,530), after which compiling aborted or segfaulted at random places.
- Under mutmut's coverage pass (MUTANT_UNDER_TEST=stats, `experiments/mutation_score.py`) the
  compiled programs are released before every test: a test that finds a function's program in
  jit's cache never calls the Python function, so mutmut would not see that the test reaches it
  and would not run the test against that function's mutants.
"""

import gc
import os

os.environ.setdefault("PAGED_JAX_VALIDATE_TABLES", "1")

import jax  # noqa: E402  (after the environment is set)
import pytest  # noqa: E402


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
