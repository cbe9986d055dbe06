"""The notebooks run: every code cell, in order, in one namespace (shell `!` lines skipped)."""

import json
import os

from absl.testing import absltest

NOTEBOOKS = os.path.join(os.path.dirname(__file__), "..", "notebooks")


class NotebooksTest(absltest.TestCase):

  def test_walkthrough_runs(self):
    with open(os.path.join(NOTEBOOKS, "walkthrough.ipynb")) as f:
      nb = json.load(f)
    namespace: dict = {}
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    self.assertGreater(len(cells), 3)
    for i, cell in enumerate(cells):
      source = "".join(line for line in cell["source"] if not line.lstrip().startswith("!"))
      exec(compile(source, f"walkthrough.ipynb cell {i}", "exec"), namespace)   # asserts inside


if __name__ == "__main__":
  absltest.main()
