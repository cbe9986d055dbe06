"""The notebooks run: every code cell of each, in order, in one namespace per notebook, at the
tiny sizes PAGED_JAX_NOTEBOOK_TINY=1 selects (shell `!` lines skipped). A cell that raises (the
notebooks assert what they show) fails the test, naming the notebook and the cell."""

import glob
import json
import os

from absl.testing import absltest, parameterized
import pytest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")
PATHS = sorted(glob.glob(os.path.join(NOTEBOOKS, "*.ipynb")))


class NotebooksTest(parameterized.TestCase):

  def test_the_notebooks_are_there(self):
    self.assertEqual([os.path.basename(p) for p in PATHS],
                     ["chat_smollm2.ipynb", "fragmentation_and_sharing.ipynb", "serving.ipynb",
                      "walkthrough.ipynb"])


@pytest.mark.slow
class NotebooksRunTest(parameterized.TestCase):

  @parameterized.parameters(*PATHS)
  def test_notebook_runs(self, path):
    import matplotlib
    matplotlib.use("Agg")   # plt.show() draws nothing
    import matplotlib.pyplot as plt
    os.environ["PAGED_JAX_NOTEBOOK_TINY"] = "1"
    self.addCleanup(os.environ.pop, "PAGED_JAX_NOTEBOOK_TINY", None)
    self.addCleanup(plt.close, "all")
    with open(path) as f:
      nb = json.load(f)
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    self.assertGreater(len(cells), 3)
    self.assertIn("pip_install", "".join(cells[0]["source"]))   # the first cell installs
    namespace: dict = {}
    name = os.path.basename(path)
    for i, cell in enumerate(cells):
      source = "".join(line for line in cell["source"] if not line.lstrip().startswith("!"))
      exec(compile(source, f"{name} cell {i}", "exec"), namespace)   # asserts inside


if __name__ == "__main__":
  absltest.main()
