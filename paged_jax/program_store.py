"""Compiled step programs kept on disk, so that a restarted engine neither traces nor compiles.

JAX's persistent compilation cache (`config.enable_compilation_cache`) skips XLA's compile on a
restart, but every program is still traced and lowered before the cache is consulted: ~0.6 s a
program for SmolLM2-135M's scanned layers on this CPU, 37 of them for one user's programs. This
store keeps the compiled executable itself (`jax.experimental.serialize_executable`): a restart
loads it in ~0.1 s, donation and calling convention included, and calls it directly.

A program's file is named by its `batching.ProgramKey` and by everything else that decides what
was compiled (`engine_identity`): the model config, the attention path, the tree, shapes and
dtypes of the params and the pool, the JAX / jaxlib versions, the device, and the source of the
code that traces the programs (`source_digest`: an edit to the model or an attention path is
compiled afresh, never served from an older program). A file that cannot
be read (another jaxlib's format, a truncated write) is compiled again and rewritten.

Loading an executable runs code it contains: keep the store in a directory only you write.
Host side; one device (a mesh's sharded executables are not stored).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile

from absl import logging
import jax

DEFAULT_PROGRAM_STORE = os.path.join(os.path.expanduser("~"), ".cache", "paged_jax", "programs")
_FORMAT = 1   # in every file name: bump when what a stored program assumes changes

# An executable that JAX's persistent compilation cache supplied serializes without the
# functions XLA:CPU compiled for it (loading it back fails at its first call: "Function
# iota_slice_fusion not found"; jax 0.10.2). Such a compile is not stored: `cache_hits` counts
# the persistent cache's hits (JAX's monitoring event), and the engine compares it around each
# compile it means to store.
_hits = [0]


# Every compiled XLA:CPU kernel is mapped on its own (code, read-only data and writable data:
# three memory maps), so a process holds ~275-470 maps per SmolLM2 step program with scanned
# layers and ~710 unrolled (jax 0.10.2; `/proc/self/maps`, 2026-12-05), and Linux allows
# vm.max_map_count of them (65,530 by default). Past it LLVM fails ("Cannot allocate memory")
# and the process crashes: a server warming 174 programs died at ~140. The engine drops
# programs before that (`Engine._bound_maps`).
MAPS_HIGH = 0.75   # of the limit: drop least recently used programs above this
MAPS_LOW = 0.5     # ... until the process is below this (or nothing is left to drop)


def mapped_regions() -> int | None:
  """Memory maps this process holds (None where /proc/self/maps is not readable)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def map_limit() -> int | None:
  """The most memory maps a process may hold (vm.max_map_count; None where unknown)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def _on_event(event, **_):
  if event == "/jax/compilation_cache/cache_hits":
    _hits[0] += 1


jax.monitoring.register_event_listener(_on_event)


def cache_hits() -> int:
  """Hits of JAX's persistent compilation cache in this process so far."""
  return _hits[0]


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
SOURCE_ROOTS = (_PACKAGE, os.path.join(os.path.dirname(_PACKAGE), "pallas_kernels"))


@functools.lru_cache(maxsize=None)
def source_digest(roots: tuple[str, ...] = SOURCE_ROOTS) -> str:
  """A digest of the source that traces step programs: every .py and .cc file under `roots`
  (`paged_jax` and `pallas_kernels`; host-side files too: an edit there costs a compile, never
  a stale program), with its path relative to its root's parent."""
  digest = hashlib.sha1()
  for root in roots:
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames.sort()
      for name in sorted(filenames):
        if name.endswith((".py", ".cc")):
          path = os.path.join(dirpath, name)
          digest.update(os.path.relpath(path, os.path.dirname(root)).encode())
          with open(path, "rb") as f:
            digest.update(f.read())
  return digest.hexdigest()[:16]


def engine_identity(cfg, impl: str, params, pool, compiler_options: dict | None = None) -> str:
  """A digest of what, besides the program key, decides an engine's compiled programs."""
  import jaxlib
  device = jax.devices()[0]
  avals = [(jax.tree_util.keystr(p), x.shape, str(x.dtype))
           for p, x in jax.tree_util.tree_flatten_with_path((params, pool))[0]]
  ident = repr((_FORMAT, source_digest(), cfg, impl, jax.__version__, jaxlib.__version__,
                device.platform, device.device_kind,
                str(jax.tree_util.tree_structure((params, pool))), avals)
               + ((sorted(compiler_options.items()),) if compiler_options else ()))
  return hashlib.sha1(ident.encode()).hexdigest()[:16]


class ProgramStore:
  """Serialized `jax.stages.Compiled` step programs in one directory."""

  def __init__(self, directory: str):
    self.directory = directory

  def path(self, identity: str, key) -> str:
    digest = hashlib.sha1(repr(tuple(key)).encode()).hexdigest()[:16]
    return os.path.join(self.directory, f"{identity}-{key.kind}-{digest}.jaxexe")

  def load(self, path: str):
    """The compiled program in `path`, or None if it is absent or unreadable."""
    if not os.path.exists(path):
      return None
    from jax.experimental import serialize_executable
    try:
      with open(path, "rb") as f:
        payload, in_tree, out_tree = pickle.load(f)
      return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception as e:   # noqa: BLE001 - an unreadable program is compiled again
      logging.warning("program store: cannot load %s (%s: %s); compiling it again", path,
                      type(e).__name__, e)
      return None

  def save(self, path: str, compiled) -> None:
    """Writes `compiled` to `path` (atomically); a failure (a full disk, a backend that cannot
    serialize) only logs."""
    from jax.experimental import serialize_executable
    try:
      blob = pickle.dumps(serialize_executable.serialize(compiled))
      os.makedirs(self.directory, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
      try:
        with os.fdopen(fd, "wb") as f:
          f.write(blob)
        os.replace(tmp, path)
      finally:
        if os.path.exists(tmp):
          os.unlink(tmp)
    except Exception as e:   # noqa: BLE001 - serving goes on without the stored copy
      logging.warning("program store: cannot save %s (%s: %s)", path, type(e).__name__, e)
