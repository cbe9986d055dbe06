"""The PTX compile check's pieces: occupancy arithmetic, ptxas parsing, the verdict, the matrix,
the Triton IR taken out of a CUDA lowering, and (where pip triton is at hand) a real compile that
must pass for the planned tiles and must flag spills for tiles known to spill.

The whole matrix is checked by `python -m experiments.kernel_ptx`, a stage of `.ci/run` (which
compiles the kernels the committed matrix has not, reuses the rest's figures by kernel key, and
spot-checks some of those: ReuseTest).
"""

import json
import os
import tempfile

from absl.testing import absltest, parameterized
import pytest
import jax
import jax.numpy as jnp

from experiments import kernel_ptx
from pallas_kernels.paged_attention import kernel_triton, ptx_compile

_PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'ragged_paged_attention' for 'sm_90'
ptxas info    : Function properties for ragged_paged_attention
    104 bytes stack frame, 116 bytes spill stores, 108 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 104 bytes cumulative stack size
"""


class OccupancyTest(parameterized.TestCase):

  @parameterized.parameters(
      # regs, warps, shared, arch -> programs per SM, limiting resource. Worked by hand:
      # 64 regs x 32 lanes = 2,048 per warp, x 4 warps = 8,192 per program: 8 fit in 65,536;
      # 64 warps / 4 = 16; shared (28 + 1 reserved) KiB: 164 // 29 = 5 on sm_80, 228 // 29 = 7.
      (64, 4, 28 * 1024, 80, 5, "shared"),
      (64, 4, 28 * 1024, 90, 7, "shared"),
      # 255 regs round up to 256: 8,192 per warp, 32,768 per program: 2 per SM.
      (255, 4, 8 * 1024, 90, 2, "registers"),
      # 100 regs round up to 104 (units of 8 per lane): 3,328 per warp, 26,624 per 8 warps: 2.
      (100, 8, 0, 80, 2, "registers"),
      # 32 regs, 1 warp, no shared memory: 64 by registers and warps, capped at 32 blocks.
      (32, 1, 0, 90, 32, "blocks"),
      # 16 regs, 8 warps: 64 warps / 8 = 8 programs before registers (16) bind.
      (16, 8, 0, 90, 8, "warps"),
  )
  def test_programs_per_sm(self, regs, warps, shared, arch, programs, limit):
    occ = ptx_compile.occupancy(regs, warps, shared, arch)
    self.assertEqual((occ["programs"], occ["limit"]), (programs, limit))
    self.assertEqual(occ["warps"], programs * warps)
    self.assertAlmostEqual(occ["occupancy"], programs * warps / 64)

  def test_shared_memory_over_the_launch_limit_runs_nothing(self):
    occ = ptx_compile.occupancy(64, 4, 164 * 1024, 80)   # sm_80 allows 163 KiB per block
    self.assertEqual((occ["programs"], occ["limit"]), (0, "shared"))
    self.assertGreater(ptx_compile.occupancy(64, 4, 164 * 1024, 90)["programs"], 0)


class VerdictTest(absltest.TestCase):

  def test_parse_ptxas(self):
    self.assertEqual(ptx_compile.parse_ptxas(_PTXAS_LOG),
                     dict(regs=255, stack=104, spill_stores=116, spill_loads=108))
    self.assertEqual(ptx_compile.parse_ptxas("garbage")["regs"], None)

  def test_parse_ptxas_entries_of_a_whole_module(self):
    log = ("ptxas info    : Compiling entry function 'loop_add_fusion' for 'sm_90'\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 12 registers\n" + _PTXAS_LOG)
    entries = ptx_compile.parse_ptxas_entries(log)
    self.assertEqual(set(entries), {"loop_add_fusion", "ragged_paged_attention"})
    self.assertEqual(entries["loop_add_fusion"]["regs"], 12)
    self.assertEqual(entries["ragged_paged_attention"]["spill_stores"], 116)

  def _row(self, **kw):
    row = dict(ok=True, arch=90, num_warps=4, regs=128, shared=64 * 1024, spill_stores=0,
               spill_loads=0)
    row.update(kw)
    return kernel_ptx.judge(row)

  def test_clean_compile_passes_with_occupancy(self):
    row = self._row()
    self.assertTrue(row["pass"], row["problems"])
    self.assertEqual(row["programs"], ptx_compile.occupancy(128, 4, 64 * 1024, 90)["programs"])

  def test_spills_shared_memory_and_errors_fail(self):
    self.assertIn("spills 8/0 B", self._row(spill_stores=8)["problems"][0])
    self.assertFalse(self._row(spill_loads=4)["pass"])
    over = self._row(arch=80, shared=164 * 1024)
    self.assertIn("shared memory 167936 B > sm_80 limit", over["problems"][0])
    self.assertTrue(self._row(arch=90, shared=164 * 1024)["pass"])
    self.assertFalse(self._row(ok=False, error="ptxas: error")["pass"])


class MatrixTest(absltest.TestCase):

  def test_every_axis_value_is_covered(self):
    cfgs = kernel_ptx.matrix(["bfloat16", "float32"], list(kernel_triton.PRECISIONS),
                             [64, 80, 96, 128, 256], [1, 16, 64], list(kernel_ptx.MODES),
                             [1, 4, 8], list(kernel_ptx.FEATURES))
    per_dtype = 5 * 3 * 3 * 3 * 2
    self.assertLen(cfgs, per_dtype * (1 + len(kernel_triton.PRECISIONS)))
    self.assertLen({c.label for c in cfgs}, len(cfgs))
    self.assertEqual({c.precision for c in cfgs if c.dtype == "bfloat16"}, {"highest"})
    for field, values in (("head_dim", {64, 80, 96, 128, 256}), ("page_size", {1, 16, 64}),
                          ("group", {1, 4, 8}), ("mode", set(kernel_ptx.MODES))):
      self.assertEqual({getattr(c, field) for c in cfgs}, values)

  def test_lowering_gives_the_planned_launch(self):
    cfg = kernel_ptx.Config("float32", "highest", 128, 16, "prefill", 4, "window+cap")
    [kernel] = kernel_ptx.lower(cfg)
    self.assertEqual(kernel.name, "ragged_paged_attention")
    self.assertIn("tt.func", kernel.ttir)
    tiles = kernel_triton.default_tiles(jnp.float32, "highest", 128)
    self.assertEqual((kernel.num_warps, kernel.num_stages), (tiles.num_warps, tiles.num_stages))
    # Different precision, different kernel (the TF32 dot is an attribute of tt.dot).
    [tf32] = kernel_ptx.lower(kernel_ptx.Config("float32", "default", 128, 16, "prefill", 4,
                                                "window+cap"))
    self.assertNotEqual(tf32.ttir, kernel.ttir)

  @pytest.mark.slow   # two spawned processes that import JAX: ~8 s of start-up here
  def test_lowering_in_processes_gives_the_same_kernels_in_order(self):
    cfgs = kernel_ptx.matrix(["bfloat16", "float32"], ["highest"], [64], [16],
                             ["decode", "prefill"], [1, 4], ["plain"])
    cfgs.append(kernel_ptx.Config("float32", "no-such-precision", 64, 16, "decode", 1, "plain"))
    serial = kernel_ptx.lower_all(cfgs, workers=1)
    parallel = kernel_ptx.lower_all(cfgs, workers=2)
    self.assertEqual([r[0] for r in parallel], cfgs)
    self.assertEqual([r[1] for r in parallel], [r[1] for r in serial])
    # A configuration that cannot lower comes back as its error, in its place, from either path.
    self.assertIn("no-such-precision", serial[-1][2])
    self.assertEqual(parallel[-1][2], serial[-1][2])
    self.assertTrue(all(r[2] is None for r in parallel[:-1]))

  def _sample(self, rec):
    """Three configurations per (dtype, precision, head_dim) of the matrix, so that every branch
    of default_tiles and each page size, mode, group and feature set is lowered (60 in all)."""
    combos = sorted({(r["dtype"], r["precision"], r["head_dim"]) for r in rec["rows"]})
    shapes = [(1, "decode", 1, "plain"), (16, "mixed", 4, "window+cap"),
              (64, "prefill", 8, "plain")]
    return [kernel_ptx.Config(*combo, *shape) for combo in combos for shape in shapes]

  def test_the_committed_matrix_compiled_todays_kernels(self):
    # WORKSPACE.md's kernel-resources table and default_tiles' choices stand on the newest
    # matrix in experiments/results/kernel_ptx.jsonl: every configuration there compiled
    # without a spill. This asserts those rows are today's kernels (same Triton IR, warps and
    # stages), so a change to the kernel or its tiles fails here until the matrix is re-run.
    rec = kernel_ptx.newest_matrix()
    self.assertIsNotNone(rec, "no whole-matrix record in experiments/results/kernel_ptx.jsonl")
    if rec["jax"] != jax.__version__:
      self.skipTest(f"the committed matrix was lowered by jax {rec['jax']}, this is "
                    f"{jax.__version__}: another JAX's Triton IR differs, so its keys cannot "
                    f"match; the Python 3.11 run checks it")
    cfgs = self._sample(rec)
    self.assertLen(cfgs, 60)
    self.assertEqual(kernel_ptx.unmeasured(cfgs), [],
                     "re-run `python -m experiments.kernel_ptx --write_table` (a CI stage: "
                     "PTX_RESULTS_DIR=experiments/results bash .ci/run)")

  def test_unmeasured_names_a_changed_kernel(self):
    # The check bites: the same configuration with other tiles, or a row that failed, or one
    # the matrix lacks, is reported by name.
    rec = kernel_ptx.newest_matrix()
    cfg = kernel_ptx.Config("float32", "tf32x3", 256, 16, "mixed", 8, "plain")
    [row] = [r for r in rec["rows"] if r["label"] == cfg.label and r["arch"] == 90]
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "kernel_ptx.jsonl")
    [today] = kernel_ptx.lower(cfg)
    other = dict(row, key="0" * 12)
    failed = dict(row, key=kernel_ptx.kernel_key(today), **{"pass": False},
                  problems=["spills 12/12 B"])
    with open(path, "w") as fh:
      fh.write(json.dumps(dict(kind="matrix", rows=[other])) + "\n")
    [why] = kernel_ptx.unmeasured([cfg], path)
    self.assertIn(f"{cfg.label} sm_90: today's kernel ['{kernel_ptx.kernel_key(today)}']", why)
    with open(path, "a") as fh:   # the newest record wins
      fh.write(json.dumps(dict(kind="matrix", rows=[failed])) + "\n")
    [why] = kernel_ptx.unmeasured([cfg], path)
    self.assertIn("measured, and failed: ['spills 12/12 B']", why)
    g1 = kernel_ptx.Config("float32", "tf32x3", 256, 16, "mixed", 1, "plain")
    self.assertEqual(kernel_ptx.unmeasured([g1], path), [f"{g1.label}: not in the matrix"])
    self.assertEqual(kernel_ptx.unmeasured([cfg], os.path.join(tmp.name, "none.jsonl")),
                     [f"no whole-matrix record in {os.path.join(tmp.name, 'none.jsonl')}"])

  def _tempfile(self, content):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "WORKSPACE.md")
    with open(path, "w") as fh:
      fh.write(content)
    return path

  def test_write_table_replaces_only_the_marked_block(self):
    path = self._tempfile(f"# W\nbefore\n{kernel_ptx.TABLE_BEGIN}\nold\n"
                          f"{kernel_ptx.TABLE_END}\nafter\n")
    kernel_ptx.write_table("| new |", "cmd", "today", path)
    text = open(path).read()
    self.assertIn("before\n", text)
    self.assertIn("after\n", text)
    self.assertIn("| new |", text)
    self.assertNotIn("old", text)
    with self.assertRaisesRegex(ValueError, "no <!-- kernel-resources -->"):
      kernel_ptx.write_table("x", "cmd", "today", self._tempfile("none"))


class EstimateTest(absltest.TestCase):

  def test_nearest_configuration_of_the_newest_matrix(self):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "kernel_ptx.jsonl")
    row = lambda page, group, regs: dict(dtype="bfloat16", precision="highest", head_dim=128,
                                         mode="decode", features="plain", arch=90,
                                         page_size=page, group=group, regs=regs)
    with open(path, "w") as fh:
      fh.write(json.dumps(dict(kind="matrix", rows=[row(16, 4, 1)])) + "\n")
      fh.write(json.dumps(dict(kind="precision_errors", rows=[])) + "\n")
      fh.write(json.dumps(dict(kind="matrix", rows=[row(16, 4, 2), row(64, 8, 3),
                                                    row(1, 1, 4)])) + "\n")
    est = lambda page, group, **kw: kernel_ptx.estimate("bfloat16", "default", 128, page,
                                                        "decode", group, path=path, **kw)
    self.assertEqual(est(16, 4)["regs"], 2)     # the newest matrix; bf16 has one precision
    self.assertEqual(est(32, 8)["regs"], 3)     # nearest page size (log scale), then group
    self.assertEqual(est(2, 1)["regs"], 4)
    self.assertIsNone(est(16, 4, arch=80))
    self.assertIsNone(kernel_ptx.estimate("bfloat16", "highest", 128, 16, "decode", 4,
                                          path=os.path.join(tmp.name, "none.jsonl")))


_TRITON = os.environ.get("PAGED_JAX_TRITON_PYTHON", "")


class ReuseTest(absltest.TestCase):
  """CI's PTX stage compiles only the kernels the committed matrix has not (`--reuse`)."""

  CFG = kernel_ptx.Config("bfloat16", "highest", 64, 16, "decode", 4, "plain")

  def _matrix(self, rows, triton=kernel_ptx.TRITON_VERSION):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "kernel_ptx.jsonl")
    with open(path, "w") as fh:
      fh.write(json.dumps(dict(kind="matrix", jax=jax.__version__, triton=triton, rows=rows))
               + "\n")
    return path

  def _row(self, key, arch, **kw):
    return dict(dict(label=self.CFG.label, key=key, arch=arch, ok=True, regs=77, spill_stores=0,
                     spill_loads=0, shared=4096, **{"pass": True}), **kw)

  def test_reusable_takes_passing_rows_of_the_same_triton(self):
    path = self._matrix([self._row("k1", 80), self._row("k1", 90, regs=300, **{"pass": False}),
                         self._row("k2", 90)])
    self.assertEqual(kernel_ptx.reusable(path),
                     {("k1", 80): dict(ok=True, regs=77, spill_stores=0, spill_loads=0,
                                       shared=4096),
                      ("k2", 90): dict(ok=True, regs=77, spill_stores=0, spill_loads=0,
                                       shared=4096)})
    self.assertEqual(kernel_ptx.reusable(self._matrix([self._row("k1", 80)], triton="3.8.0")), {})
    self.assertEqual(kernel_ptx.reusable(os.path.join(os.path.dirname(path), "none.jsonl")), {})

  def test_a_reused_kernel_is_not_compiled_and_keeps_its_figures(self):
    kernels = kernel_ptx.lower(self.CFG)
    key = kernel_ptx.kernel_key(kernels[0])
    reuse = kernel_ptx.reusable(self._matrix([self._row(key, 80), self._row(key, 90)]))
    with tempfile.TemporaryDirectory() as tmp:   # no triton at that path: nothing may compile
      rows = kernel_ptx.check([(self.CFG, kernels)], [80, 90], "/nonexistent/python", tmp, reuse)
    self.assertEqual([(r["arch"], r["reused"], r["regs"], r["pass"]) for r in rows],
                     [(80, True, 77, True), (90, True, 77, True)])
    self.assertEqual(rows[0]["programs"], ptx_compile.occupancy(77, kernels[0].num_warps, 4096,
                                                                80)["programs"])
    # A kernel the matrix has not (another key) is compiled: here that fails for want of triton.
    with tempfile.TemporaryDirectory() as tmp, self.assertRaises(OSError):
      kernel_ptx.check([(self.CFG, kernels)], [80, 90], "/nonexistent/python", tmp,
                       {(key, 80): reuse[(key, 80)]})

  def test_spot_sample_is_spread_and_stable(self):
    pairs = [(f"k{i:02d}", a) for i in range(10) for a in (80, 90)]
    self.assertEqual(kernel_ptx.spot_sample(pairs, 4),
                     {("k00", 80), ("k02", 90), ("k05", 80), ("k07", 90)})
    self.assertEqual(kernel_ptx.spot_sample(pairs[::-1], 4), kernel_ptx.spot_sample(pairs, 4))
    self.assertEqual(kernel_ptx.spot_sample(pairs, 0), set())
    self.assertEqual(kernel_ptx.spot_sample(pairs[:3], 9), set(pairs[:3]))


class CompileTest(absltest.TestCase):
  """A real compile with pip triton (PAGED_JAX_TRITON_PYTHON, set by .ci/run's PTX stage)."""

  def setUp(self):
    super().setUp()
    if not _TRITON:
      self.skipTest("PAGED_JAX_TRITON_PYTHON is not set (a python with triton==3.9.0): the PTX "
                    "compile did not run here; .ci/run's PTX stage runs it")

  def _compile(self, cfg, block_sizes=kernel_triton.BlockSizes()):
    with tempfile.TemporaryDirectory() as tmp:
      return kernel_ptx.check([(cfg, kernel_ptx.lower(cfg, block_sizes))], [80, 90], _TRITON, tmp)

  def test_planned_tiles_compile_clean_and_known_bad_tiles_are_caught(self):
    cfg = kernel_ptx.Config("float32", "highest", 128, 16, "prefill", 1, "window+cap")
    rows = self._compile(cfg)
    self.assertLen(rows, 2)
    for row in rows:
      self.assertTrue(row["pass"], row["problems"])
      self.assertGreaterEqual(row["programs"], 1)
    # Today's tiles before this check existed: 64 rows, 64 keys, 4 warps, whole head_dim dots.
    bad = self._compile(cfg, kernel_triton.BlockSizes(block_q=64, block_tokens=64, num_warps=4,
                                                      max_chunk=128))
    for row in bad:
      self.assertFalse(row["pass"])
      self.assertTrue(any("spills" in p for p in row["problems"]), row["problems"])

  def test_spot_check_catches_figures_the_compiler_does_not_give(self):
    cfg = ReuseTest.CFG
    kernels = kernel_ptx.lower(cfg)
    key = kernel_ptx.kernel_key(kernels[0])
    honest = {(key, a): {f: r.get(f) for f in kernel_ptx.FIGURES}
              for r in self._compile(cfg) for a in [r["arch"]]}
    forged = dict(honest)
    forged[(key, 90)] = dict(honest[(key, 90)], regs=honest[(key, 90)]["regs"] + 8)
    with tempfile.TemporaryDirectory() as tmp:
      rows = kernel_ptx.check([(cfg, kernels)], [80, 90], _TRITON, tmp, honest, spot_check=2)
      self.assertTrue(all(r["pass"] and r["spot_checked"] for r in rows),
                      [r["problems"] for r in rows])
      rows = kernel_ptx.check([(cfg, kernels)], [80, 90], _TRITON, tmp, forged, spot_check=2)
    self.assertEqual([r["pass"] for r in rows], [True, False])
    self.assertIn("spot check", rows[1]["problems"][0])
    self.assertIn("'regs'", rows[1]["problems"][0])

  def test_tf32x3_head_dim_256_keys_per_step_follow_the_group(self):
    # The two configurations where one tile set for every group spilled on sm_90: 32 keys per
    # step spilled 20 B for group 1 below, 16 keys 12 B for group 8's mixed batch. The planned
    # tiles take 16 keys for groups < 8 and 32 for 8: both clean.
    g1 = kernel_ptx.Config("float32", "tf32x3", 256, 64, "prefill", 1, "window+cap")
    g8 = kernel_ptx.Config("float32", "tf32x3", 256, 16, "mixed", 8, "plain")
    for cfg in (g1, g8):
      for row in self._compile(cfg):
        self.assertTrue(row["pass"], (cfg.label, row["arch"], row["problems"]))
    spilled = lambda rows: [r["arch"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    self.assertEqual(spilled(self._compile(g1, kernel_triton.BlockSizes(block_tokens=32))), [90])
    self.assertEqual(spilled(self._compile(g8, kernel_triton.BlockSizes(block_tokens=16))), [90])


if __name__ == "__main__":
  absltest.main()
